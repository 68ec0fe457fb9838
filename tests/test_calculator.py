"""The calculator task (tasks/calculator.py, configs/calculator_tools.yaml): its SFT traces are the episodes the
trainer runs (the tool call parses, the tool's answer is the trace's, the trained spans are the model's turns), the
tool's schema comes out of transformers, the recipe's stop token is the tool-call turn's last character. Cheap: no
model, no worker process."""

from __future__ import annotations

import config as C
from tasks.calculator import STOP, add, calculator_reward, encode_trace, make_problems, trace
from tasks.char_tokenizer import build_char_tokenizer
from tasks.environments import ToolEnvironment, parse_tool_calls, tool_schema


def test_sft_traces_are_episodes_of_the_tool_environment():
    tokenizer = build_char_tokenizer()
    env = ToolEnvironment({"add": add}, timeout_s=1.0)
    for a, b in make_problems(50, seed=1):
        (call, trained1), (result, trained2), (answer, trained3) = trace(a, b)
        assert (trained1, trained2, trained3) == (True, False, True) and call.endswith(STOP)
        assert parse_tool_calls(call) == ([{"name": "add", "arguments": {"a": a, "b": b}}], [])
        observation, reward, done, info = env.step(call)
        assert not done and [m["content"] for m in observation] == [result] and info["tool_errors"] == 0
        assert env.step(answer)[2]  # the answer turn has no call: the episode ends
        assert calculator_reward(call + result + answer, str(a + b)) == 1.0
        assert calculator_reward(call + result, str(a + b)) == 0.0  # the tool's result is not the model's answer
        ids, spans = encode_trace(tokenizer, a, b)
        prompt = len(f"{a}+{b}=")
        assert spans == [(prompt, prompt + len(call)), (len(ids) - len(answer) - 1, len(ids))]
        assert ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[:-1]) == f"{a}+{b}=" + call + result + answer


def test_tool_schema_and_the_recipe_agree_with_the_task():
    schema = tool_schema(add)["function"]
    assert schema["name"] == "add" and schema["parameters"]["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in schema["parameters"]["properties"].items()} == {"a": "integer", "b": "integer"}
    cfg = C.load_config("configs/calculator_tools.yaml")
    assert cfg.rollout.tools == ["tasks.calculator:add"]
    assert cfg.rollout.stop_token_ids == [build_char_tokenizer().convert_tokens_to_ids(STOP)]
    longest = len(trace(9999, 9999)[0][0])
    assert cfg.rollout.max_new_tokens >= longest
    assert cfg.rollout.max_episode_tokens >= longest + len("19998") + cfg.rollout.max_new_tokens

"""Multi-turn episodes (rollout/episodes.py) with environments and tools in worker processes (tasks/environments.py):
tool-call parsing, hostile environments contained, token-exact episodes on the native engine (plain text and a chat
template), GAE over the model's tokens only, the config's refusals, and a whole GRPO run of train_ppo.py whose only
reward is an environment's."""

from __future__ import annotations

import json
import os
import string
import time

import pandas as pd
import pytest
import torch
from test_algo_advantages import loop_gae
from test_ppo import assets, write_config  # noqa: F401  (assets is a fixture)

import config as C
from algo.advantages import gae
from conftest import explain, torchrun
from rollout.api import SamplingParams
from rollout.episodes import ObservationTokens, run_episodes
from rollout.native import NativeEngine
from tasks.char_tokenizer import build_char_tokenizer
from tasks.environments import EnvironmentPool, ToolEnvironment, parse_tool_calls
from tasks.tiny_model import build_tiny_causal_lm
from tests.user_envs import add, slow

CHATML = (
    "{% if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ------------------------------------------------------------------------------------------------ tools
def test_parse_tool_calls_reads_hermes_blocks_and_names_what_is_malformed():
    text = ('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]
    assert errors == []
    calls, errors = parse_tool_calls('<tool_call>{"name": add}</tool_call><tool_call>[1]</tool_call><tool_call>{')
    assert calls == []
    assert "not JSON" in errors[0] and "needs" in errors[1] and "not closed" in errors[2], errors
    assert parse_tool_calls("the answer is 3") == ([], [])


def test_tool_environment_answers_each_call_and_reports_errors_to_the_model():
    env = ToolEnvironment({"add": add, "slow": slow}, timeout_s=0.3)
    assert env.reset() is None
    obs, reward, done, info = env.step(
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 5}}</tool_call>'
        '<tool_call>{"name": "slow", "arguments": {"seconds": 5}}</tool_call>'
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert (reward, done) == (0.0, False)
    assert [m["content"] for m in obs[:1]] == ["7"]
    assert "longer than 0.3 s" in obs[1]["content"] and "no tool named 'mul'" in obs[2]["content"]
    assert obs[3]["content"].startswith("error: TypeError") and all(m["role"] == "tool" for m in obs)
    assert info == {"tool_calls": 4.0, "tool_errors": 3.0, "tool_timeouts": 1.0}
    assert env.step("it is 7") == (None, 0.0, True, {"tool_calls": 0.0, "tool_errors": 0.0})


def test_tool_pool_gives_schemas_and_runs_calls_in_its_workers():
    with EnvironmentPool("tools", ["tests.user_envs:add", "tests.user_envs:slow"], num_workers=1) as pool:
        assert [s["function"]["name"] for s in pool.tool_schemas] == ["add", "slow"]
        assert pool.tool_schemas[0]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
        assert pool.open({0: {}})[0].observation is None
        result = pool.step({0: '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'})[0]
        assert result.observation == [{"role": "tool", "name": "add", "content": "42"}] and not result.done


# ------------------------------------------------------------------------------------------------ hostile
def test_environment_pool_contains_raising_hanging_malformed_and_dying_environments():
    modes = ["ok", "hang", "raise", "ok", "bad_reward", "ok", "bad_obs", "ok"]  # episode e on worker e % 2
    with EnvironmentPool("environment", ["tests.user_envs:scripted"], num_workers=2, timeout_s=2.0) as pool:
        opened = pool.open({e: {"mode": m} for e, m in enumerate(modes)})
        assert all(r.error is None and r.observation is None for r in opened.values())
        first = pool.step({e: "11ab" for e in range(8)})
        assert all(r.observation == "+" and r.reward == 0.5 and not r.done for r in first.values())
        second = pool.step({e: "1" for e in range(8)})
        assert second[0].error is None and second[0].done and second[0].reward == 1.0
        assert second[0].info == {"steps": 2.0}
        assert second[1].timeout and "timed out" in second[1].error
        for lost in (3, 5, 7):  # their environments lived in the hung worker
            assert "lost with its worker" in second[lost].error
        assert "deliberate failure" in second[2].error and "RuntimeError" in second[2].error
        assert "reward 'high'" in second[4].error and "observation of type int" in second[6].error
        assert "deliberate failure" in pool.first_error or "timed out" in pool.first_error
        # the replaced worker serves new episodes; one whose process exits is counted, not fatal
        pool.open({9: {"mode": "exit"}, 11: {"mode": "ok"}})
        pool.step({9: "a", 11: "a"})
        after = pool.step({9: "a", 11: "a"})
        assert "exited with code 3" in after[9].error or "lost" in after[9].error
        assert after[11].error is None or "lost" in after[11].error
        assert pool.step({13: "a"})[13].error  # never opened
        again = pool.open({15: {"mode": "ok"}})
        assert again[15].error is None


def test_a_worker_dead_while_idle_is_replaced_once_and_its_opens_go_to_the_successor(tmp_path):
    with EnvironmentPool("environment", ["tests.user_envs:scripted"], num_workers=2) as pool:
        first = pool._workers[0].process
        first.kill()
        first.join()
        opened = pool.open({e: {"mode": "ok"} for e in range(6)})
        assert all(r.error is None for r in opened.values()), opened
        assert pool._workers[0].process is not first and pool._workers[0].process.is_alive()
        # an environment whose step raised is closed in its worker (what it holds is let go)
        flag = tmp_path / "closed"
        pool.open({7: {"mode": "raise", "closed_flag": str(flag)}})
        pool.step({7: "a"})
        assert "deliberate failure" in pool.step({7: "a"})[7].error
        for _ in range(50):
            if flag.exists():
                break
            time.sleep(0.05)
        assert flag.read_text() == "closed"


def test_environment_pool_names_a_factory_that_cannot_load_or_fails():
    with pytest.raises(ValueError, match=r"(?s)rollout.environment 'tests.user_envs:nope'.*has no function 'nope'"):
        EnvironmentPool("environment", ["tests.user_envs:nope"], num_workers=1)
    with EnvironmentPool("environment", ["tests.user_envs:broken_factory"], num_workers=1) as pool:
        assert "no 'board' column" in pool.open({0: {}})[0].error


def test_the_readmes_environment_runs_in_a_pool(tmp_path):
    with open(os.path.join(os.path.dirname(os.path.dirname(C.__file__)), "docs", "episodes_and_tools.md")) as f:
        code = "# my_env.py" + f.read().split("```python\n# my_env.py")[1].split("```")[0]
    (tmp_path / "my_env.py").write_text(code)
    with EnvironmentPool("environment", [f"{tmp_path / 'my_env.py'}:make_env"], num_workers=1) as pool:
        assert pool.open({0: {"prompt": "guess", "ground_truth": "7"}})[0].error is None
        assert pool.step({0: "3"})[0].observation == "higher"
        last = pool.step({0: " 7"})[0]
        assert (last.observation, last.reward, last.done, last.info) == (None, 1.0, True, {"tries": 2.0})


# ------------------------------------------------------------------------------------------------ episodes
@pytest.fixture(scope="module")
def scripted_pool():
    with EnvironmentPool("environment", ["tests.user_envs:scripted"], num_workers=2) as pool:
        yield pool


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def play(model, tokenizer, pool, prompts, records, observe, temperature=1.0, n=2, max_new=6, max_turns=3,
         max_tokens=40):
    engine = NativeEngine(model, tokenizer.pad_token_id)
    stops = tuple(sorted({tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(
        [t for t in ("<|im_end|>",) if t in tokenizer.get_vocab()])}))
    params = SamplingParams(max_new, temperature, n=n, stop_token_ids=stops)
    gen = torch.Generator().manual_seed(0)
    return run_episodes(lambda p, sp: engine.generate(p, sp, gen), prompts, records, pool, observe, params,
                        max_turns=max_turns, max_tokens=max_tokens, reward_mode="sum",
                        decode=lambda t: tokenizer.decode(t, skip_special_tokens=True), any_running=lambda f: f)


def check_exact(model, episodes, temperature=1.0):
    """Every model token of every episode has the log-prob a fresh forward of the whole final sequence gives it:
    each turn was sampled from exactly the history the trainer will see. Returns the masks."""
    out = episodes.output
    for e in range(episodes.count):
        length = int(episodes.lengths[e])
        prompt, response = out.prompt_ids[e], out.response_ids[e, :length].tolist()
        mask = out.response_mask[e, :length].bool()
        logp = teacher_forced(model, prompt + response)[len(prompt) - 1: len(prompt) - 1 + length]
        logp = (logp / temperature).log_softmax(-1) if temperature != 1.0 else logp
        expected = logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(out.logprobs[e, :length][mask], expected[mask], atol=2e-5, rtol=0)
        assert torch.all(out.logprobs[e, :length][~mask] == 0)


def test_plain_text_episodes_are_token_exact_and_mask_the_observations(scripted_pool):
    tokenizer = build_char_tokenizer("0123456789+=ab")
    model = build_tiny_causal_lm(len(tokenizer), hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("3+4=")["input_ids"]]
    observe = ObservationTokens(tokenizer, chat=False, stop_ids=(tokenizer.eos_token_id,))
    episodes = play(model, tokenizer, scripted_pool, prompts, [{"mode": "ok"}] * 2, observe)
    check_exact(model, episodes)
    plus = tokenizer.convert_tokens_to_ids("+")
    for e in range(4):
        turns = [t for t in episodes.transcripts[e] if t["role"] == "model"]
        mask = episodes.output.response_mask[e, : int(episodes.lengths[e])].tolist()
        response = episodes.output.response_ids[e, : int(episodes.lengths[e])].tolist()
        assert len(turns) == 2, episodes.transcripts[e]  # the environment ends after its second step
        first = turns[0]["tokens"]
        assert mask == [1] * first + [0] + [1] * turns[1]["tokens"], mask  # the "+" between the turns
        assert response[first] == plus
        # the reward: the share of "1" in each turn, summed
        expected = sum(t["text"].count("1") / max(len(t["text"]), 1) for t in turns)
        assert episodes.rewards[e].item() == pytest.approx(expected)
    assert episodes.sums["episode/turns"] == 8 and episodes.sums["env/steps"] == 3 * 4


def test_a_flood_of_observation_ends_the_episode_without_tokenising_it(scripted_pool):
    tokenizer = build_char_tokenizer("0123456789+=ab")
    model = build_tiny_causal_lm(len(tokenizer), hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    observe = ObservationTokens(tokenizer, chat=False, stop_ids=(tokenizer.eos_token_id,))
    episodes = play(model, tokenizer, scripted_pool, [tokenizer("1+2=")["input_ids"]], [{"mode": "flood"}], observe,
                    n=1)  # 50 MB of digits would take minutes to tokenise and could never fit
    assert [t["role"] for t in episodes.transcripts[0]] == ["model"] and episodes.sums["episode/truncated"] == 1


def test_greedy_turns_equal_hf_greedy_on_the_history(scripted_pool):
    tokenizer = build_char_tokenizer("0123456789+=ab")
    model = build_tiny_causal_lm(len(tokenizer), hidden_size=32, intermediate_size=64, max_position_embeddings=128)
    observe = ObservationTokens(tokenizer, chat=False, stop_ids=(tokenizer.eos_token_id,))
    episodes = play(model, tokenizer, scripted_pool, [tokenizer("12+9=")["input_ids"]], [{"mode": "ok"}], observe,
                    temperature=0.0, n=1)
    history = list(episodes.output.prompt_ids[0])
    response = episodes.output.response_ids[0, : int(episodes.lengths[0])].tolist()
    mask = episodes.output.response_mask[0, : int(episodes.lengths[0])].tolist()
    at = 0
    for turn in [t for t in episodes.transcripts[0] if t["role"] == "model"]:
        while at < len(mask) and not mask[at]:
            history.append(response[at])
            at += 1
        hf = model.generate(torch.tensor([history]), attention_mask=torch.ones(1, len(history), dtype=torch.long),
                            max_new_tokens=turn["tokens"], do_sample=False, pad_token_id=0)[0, len(history):].tolist()
        assert response[at: at + turn["tokens"]] == hf
        history += hf
        at += turn["tokens"]


# the assistant branch of Qwen3's chat template, reduced: an old assistant turn loses its empty thinking block once a
# user query follows it, so two renderings of one conversation do not share a prefix
QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}{%- for m in messages[::-1] %}{%- set index = "
    "(messages|length - 1) - loop.index0 %}{%- if m.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}{%- for message in messages %}{%- if message.role "
    "== 'user' %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}{%- elif message.role == 'assistant' "
    "%}{%- if loop.index0 > ns.last_query_index and loop.last %}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n'"
    " + message.content }}{%- else %}{{- '<|im_start|>assistant\n' + message.content }}{%- endif %}{{- '<|im_end|>\n'"
    " }}{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + message.content + "
    "'\n</tool_response><|im_end|>\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- "
    "'<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)


def test_observations_under_a_template_that_renders_old_turns_otherwise():
    tokenizer = chat_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.eos_token_id
    observe = ObservationTokens(tokenizer, chat=True, stop_ids=(eos, end), template=QWEN3,
                                template_kwargs={"enable_thinking": False})
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert text(observe("more")) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert text(observe([{"role": "tool", "content": "42"}], turn_ended=False)) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="stop tokens"):  # a template whose turns end on no stop token: at start
        ObservationTokens(tokenizer, chat=True, stop_ids=(eos,), template=QWEN3)


def chat_tokenizer():
    tokenizer = build_char_tokenizer(string.ascii_lowercase + string.digits + "<>/_: \n")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def test_chat_episodes_equal_the_chat_templates_rendering_of_their_messages(scripted_pool):
    tokenizer = chat_tokenizer()
    model = build_tiny_causal_lm(len(tokenizer), hidden_size=32, intermediate_size=64, max_position_embeddings=256,
                                 seed=3)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tools = [{"type": "function", "function": {"name": "count", "parameters": {}}}]
    question = [{"role": "user", "content": "count"}]
    prompt = tokenizer(tokenizer.apply_chat_template(question, tools=tools, add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False)["input_ids"]
    observe = ObservationTokens(tokenizer, chat=True, stop_ids=(tokenizer.eos_token_id, end), tools=tools)
    episodes = play(model, tokenizer, scripted_pool, [prompt], [{"mode": "tool"}], observe, n=4, max_tokens=150)
    check_exact(model, episodes)
    out = episodes.output
    for e in range(4):
        length = int(episodes.lengths[e])
        ours = out.prompt_ids[e] + out.response_ids[e, :length].tolist()
        mask = out.response_mask[e, :length].tolist()
        messages, at = list(question), 0
        for turn in episodes.transcripts[e]:
            if turn["role"] == "model":
                ids = out.response_ids[e, at: at + turn["tokens"]].tolist()
                ids = ids[:-1] if ids and ids[-1] == end else ids
                messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=False)})
                messages.append({"role": "tool", "content": str(len(turn["text"]))})
            at += turn["tokens"]
        messages = messages[:-1]  # the last turn's tool answer ended the episode, unseen
        rendered = tokenizer(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False),
                             add_special_tokens=False)["input_ids"]
        nl = tokenizer.convert_tokens_to_ids("\n")
        assert rendered[: len(ours)] == ours and rendered[len(ours):] in ([nl], [end, nl]), e
        assert 0 in mask and mask[-1] == 1  # the tool answer's tokens are masked; the episode ends on a turn


# ------------------------------------------------------------------------------------------------ GAE
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_across_gaps_runs_over_the_model_tokens_only(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(5, 9, generator=gen, dtype=torch.float64), torch.randn(5, 9, generator=gen,
                                                                                          dtype=torch.float64)
    mask = torch.rand(5, 9, generator=gen) < 0.6
    adv, ret = gae(rewards, values, mask, gamma, lam, across_gaps=True)
    for b in range(5):  # the slow way: the row's valid tokens as one contiguous sequence
        keep = mask[b].nonzero().squeeze(-1)
        exp_adv, exp_ret = loop_gae(rewards[b:b + 1, keep], values[b:b + 1, keep], torch.ones(1, len(keep)), gamma,
                                    lam)
        torch.testing.assert_close(adv[b, keep], exp_adv[0])
        torch.testing.assert_close(ret[b, keep], exp_ret[0])
        assert torch.all(adv[b][~mask[b]] == 0) and torch.all(ret[b][~mask[b]] == 0)
    prefix = torch.arange(9)[None, :] < torch.tensor([[3], [9], [0], [5], [7]])  # one turn: the same as before
    assert all(torch.equal(a, b) for a, b in zip(gae(rewards, values, prefix, gamma, lam, across_gaps=True),
                                                 gae(rewards, values, prefix, gamma, lam)))


# ------------------------------------------------------------------------------------------------ config
def test_config_refuses_what_episodes_cannot_do(tmp_path):
    base = ["data.train_path=x.jsonl", "reward.functions=[{spec: gsm8k}]"]

    def refused(*overrides) -> str:
        with pytest.raises(C.ConfigError) as info:
            C.check_ppo(C.load_config(None, [*base, *overrides]), 1, this_machine=False)
        return str(info.value)

    assert "set one" in refused("rollout.environment=a.b:f", "rollout.tools=[a.b:g]")
    assert "'module.path:function'" in refused("rollout.tools=[nofunction]")
    assert "replayed" in refused("rollout.environment=a.b:f", "data.rollouts_path=r.parquet", "data.train_path=null")
    assert "at least one whole turn" in refused("rollout.environment=a.b:f", "rollout.max_episode_tokens=8",
                                                "rollout.max_new_tokens=16")
    cfg = C.load_config(None, [*base, "rollout.environment=a.b:f", "rollout.max_new_tokens=16", "rollout.max_turns=3"])
    assert C.response_budget(cfg) == 48
    # an environment's rewards alone: no reward role
    env_only = C.load_config(None, ["data.train_path=x.jsonl", "rollout.environment=a.b:f"])
    assert "reward" not in C.required_roles(env_only)
    C.check_ppo(env_only, 1, this_machine=False)


# ------------------------------------------------------------------------------------------------ runs
def read_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "t" / "metrics.jsonl").read_text().splitlines()]


def test_episodes_under_tensor_parallelism_see_one_environment(assets, tmp_path):  # noqa: F811
    # the observations' lengths are random draws of each process: tp peers would build different histories (and
    # decode mismatched shapes together) if each ran its own environment; the first tp rank's are shared
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 1},
                       algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}}, placement={"tp": 2},
                       rollout={"environment": "tests.user_envs:random_length", "max_turns": 3, "env_workers": 1},
                       reward={"functions": []})
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    step = read_rows(tmp_path / "runs")[1]
    assert step["episode/turns/mean"] > 1.0 and step["episode/env_errors/mean"] == 0.0, step
    # later turns continue their episodes' slots on both ranks alike (a rank that did otherwise would hang)
    assert step["episode/reused_prompt_tokens/mean"] > 0, step


def test_grpo_on_an_environments_reward_alone_over_two_fsdp_ranks(assets, tmp_path):  # noqa: F811
    # episodes of one or two turns by prompt: the ranks run different numbers of turns' episodes, and a rank with
    # none left still joins the FSDP engine's turns
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2, "eval_every": 2,
                                                                            "save_rollouts": True},
                       algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}},
                       rollout={"environment": "tests.user_envs:by_prompt", "max_turns": 3, "env_workers": 1},
                       reward={"functions": []})
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    rows = read_rows(tmp_path / "runs")
    step = rows[1]
    # info's "steps" is the step's number: 1 for a one-step episode, 1 + 2 for a two-step one
    turns = step["episode/turns/mean"]
    assert 1.0 < turns < 2.0 and step["env/steps/mean"] == pytest.approx(2 * turns - 1), step
    assert step["episode/env_errors/mean"] == 0.0 and step["episode/truncated/mean"] == 0.0
    assert step["reward/score/mean"] == pytest.approx(step["episode/env_reward/mean"])
    assert "eval/score/mean" in rows[-1] and 1.0 <= rows[-1]["eval/episode/turns/mean"] <= 2.0
    evals = [json.loads(line) for line in (tmp_path / "runs" / "t" / "eval_samples.jsonl").read_text().splitlines()]
    assert all(sample["episode"][0]["role"] == "model" for sample in evals[-1]["samples"])
    saved = pd.read_parquet(tmp_path / "runs" / "t" / "rollouts" / "step_1.parquet")
    assert len(saved) == 32 and set(saved["response_mask"].map(lambda m: list(m).count(0))) == {0, 1}
    plus = build_char_tokenizer("0123456789+=").convert_tokens_to_ids("+")
    for _, row in saved.iterrows():
        mask, roles = list(row["response_mask"]), [t["role"] for t in row["episode"]]
        assert roles in (["model"], ["model", "env", "model"]) and row["score"] == pytest.approx(row["env_reward"])
        if len(roles) == 3:
            first = row["episode"][0]["tokens"]
            assert mask[first] == 0 and sum(mask) == len(mask) - 1 and row["response_ids"][first] == plus


def test_episodes_on_split_pools_generated_over_the_world(assets, tmp_path):  # noqa: F811
    # the reward's rank generates too (rollout.ranks=all): it joins every turn's generate call; the scores are the
    # reward function's (on its pool) plus the environment's (on the actor's)
    split = {"mode": "split", "pools": [{"name": "actor", "size": 1, "roles": ["actor"]},
                                        {"name": "reward", "size": 1, "roles": ["reward"]}]}
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                       algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}}, placement=split,
                       rollout={"environment": "tests.user_envs:by_prompt", "max_turns": 3, "env_workers": 1,
                                "ranks": "all"})
    proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    step = read_rows(tmp_path / "runs")[1]
    assert 1.0 < step["episode/turns/mean"] < 2.0, step
    # step 2's weights (one update on) went to the engines in its first turn: those seconds are the step's, not the
    # last turn's 0 (step 1 syncs nothing: the start's evaluation sent the same weights)
    assert read_rows(tmp_path / "runs")[2]["timing_s/reshard"] > 0
    assert step["reward/score/mean"] == pytest.approx(step["episode/env_reward/mean"] +
                                                      step["reward/fn/tests.user_rewards:ones_fraction/mean"])

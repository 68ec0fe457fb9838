"""A task that needs a tool: additions of 3-4 digit numbers, too long for the tiny character model to add by itself,
with a calculator tool (`add`) that gives the answer (configs/calculator_tools.yaml; README "A task that needs a tool").

An episode without a chat template, in plain text (the char tokenizer):

    prompt        1234+5678=
    model turn 1  <tool_call>{"name":"add","arguments":{"a":1234,"b":5678}}</tool_call>\\n    (ends on the stop "\\n")
    tool result   6912                                                                  (appended, loss mask 0)
    model turn 2  =6912<eos>

`calculator_reward` scores the text after the response's last "=": the answer the model wrote itself, after the
tool's result (a tool result alone scores 0). `write_data` writes the train / held-out prompts and `encode_trace`
one SFT trace (the loss on the model's turns only, as RL trains them); `python -m recipes.calculator`
(recipes/calculator.py) builds the assets from them into runs/calculator_assets: the character tokenizer, the data
and a tiny model SFT'd on a few hundred such traces.
"""

from __future__ import annotations

import json
import os
import random

STOP = "\n"  # ends the tool-call turn: its id is in the recipe's rollout.stop_token_ids


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum a + b.
    """
    return a + b


def tool_call(a: int, b: int) -> str:
    """The model's first turn for a+b: one Hermes tool call (compact JSON, which parse_tool_calls reads), then STOP."""
    body = json.dumps({"name": "add", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>{STOP}"


def trace(a: int, b: int) -> list[tuple[str, bool]]:
    """A whole episode after the prompt: (text, whether the model wrote it) — turn 1, the tool's result, turn 2
    (the eos after it is the tokenizer's)."""
    return [(tool_call(a, b), True), (str(add(a, b)), False), (f"={a + b}", True)]


def calculator_reward(response: str, ground_truth: str | None, prompt: str = "") -> float:
    """1 when the text after the response's last "=" is the sum, else 0 (the tool's result, which has no "=", is not
    an answer of the model's)."""
    if ground_truth is None:
        raise ValueError("calculator_reward needs a ground truth")
    _, sep, answer = response.rpartition("=")
    return float(bool(sep) and answer.strip() == ground_truth.strip())


def make_problems(n: int, seed: int, digits: tuple[int, int] = (3, 4)) -> list[tuple[int, int]]:
    """`n` distinct pairs, each operand with a digit count in `digits` (inclusive)."""
    rng, pairs = random.Random(seed), {}
    low, high = 10 ** (digits[0] - 1), 10 ** digits[1] - 1
    while len(pairs) < n:
        pairs[(rng.randint(low, high), rng.randint(low, high))] = None
    return list(pairs)


def write_data(work: str, n_sft: int, n_train: int, n_test: int, seed: int) -> dict[str, list]:
    """train.jsonl / test.jsonl (prompt "a+b=", ground_truth) with disjoint prompts, and the SFT problems (from the
    train split's first n_sft)."""
    problems = make_problems(n_train + n_test, seed)
    splits = {"train": problems[:n_train], "test": problems[n_train:]}
    os.makedirs(work, exist_ok=True)
    for name, pairs in splits.items():
        with open(os.path.join(work, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps({"prompt": f"{a}+{b}=", "ground_truth": str(a + b)}) + "\n" for a, b in pairs)
    return {**splits, "sft": problems[:n_sft]}


def encode_trace(tokenizer, a: int, b: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, trained spans) of a whole SFT trace: prompt, turn 1, the tool result (not trained), turn 2 + eos; the
    format roles.sft.sft_train takes (encode_pairs' conversation form)."""
    ids, spans = tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"], []
    pieces = trace(a, b)
    for k, (text, trained) in enumerate(pieces):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        if k == len(pieces) - 1:
            piece.append(tokenizer.eos_token_id)
        if trained:
            spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
    return ids, spans

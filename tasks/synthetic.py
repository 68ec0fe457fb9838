"""The quickstart's synthetic task: integer addition ("12+34=" -> "46"), scored by
`tasks.reward_functions.gsm8k_match`.

Small enough that a model of ~100k parameters learns it on a CPU in minutes with 1-2 digit operands; raise
`digits` to make it harder. Everything is a pure function of the seed.
"""

import json
import random
from pathlib import Path


def _operand_range(digits: int | tuple[int, int]) -> tuple[int, int]:
    """Smallest and largest operand with a digit count in `digits` (an int, or an inclusive (min, max) pair)."""
    low_digits, high_digits = (digits, digits) if isinstance(digits, int) else digits
    if not 1 <= low_digits <= high_digits:
        raise ValueError(f"digits={digits!r} must be a positive int or a pair (min, max) with 1 <= min <= max")
    low = 0 if low_digits == 1 else 10 ** (low_digits - 1)
    return low, 10**high_digits - 1


def make_addition_split(n: int, digits: int | tuple[int, int] = (1, 2), seed: int = 0) -> list[dict]:
    """`n` distinct problems `{"prompt": "a+b=", "ground_truth": str(a + b)}`.

    Each operand is drawn uniformly from the integers with a digit count in `digits` (an int or an inclusive
    (min, max) pair), so (1, 2) means 0..99. No prompt repeats.
    """
    low, high = _operand_range(digits)
    n_possible = (high - low + 1) ** 2
    if not 0 <= n <= n_possible:
        raise ValueError(f"n={n} problems requested, but digits={digits!r} allows only {n_possible} distinct ones")
    rng = random.Random(seed)
    pairs: dict[tuple[int, int], None] = {}  # a dict keeps the draw order, so the output is a function of the seed
    while len(pairs) < n:
        pairs[(rng.randint(low, high), rng.randint(low, high))] = None
    return [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b)} for a, b in pairs]


def write_addition_dataset(
    directory: str | Path, n_train: int, n_test: int, seed: int = 0, digits: int | tuple[int, int] = (1, 2)
) -> dict[str, Path]:
    """Write train.jsonl and test.jsonl (prompt, ground_truth) with disjoint prompts, and sft.jsonl.

    sft.jsonl pairs each train prompt with its answer as `response`, with no end-of-sequence marker: the SFT trainer
    appends the tokenizer's eos. Returns the three paths by split name ("train", "test", "sft").
    """
    if n_train < 1 or n_test < 0:
        raise ValueError(f"n_train={n_train} must be >= 1 and n_test={n_test} >= 0")
    problems = make_addition_split(n_train + n_test, digits=digits, seed=seed)
    train, test = problems[:n_train], problems[n_train:]
    sft = [{"prompt": p["prompt"], "response": p["ground_truth"]} for p in train]

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, records in (("train", train), ("test", test), ("sft", sft)):
        paths[name] = directory / f"{name}.jsonl"
        with open(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
    return paths


def addition_reward(response: str, ground_truth: str | None, prompt: str = "") -> float:
    """The quickstart's reward in [0, 1]: 1 for the exact answer, otherwise partial credit
    0.5 * (digits right at their position from the left) / max(len(response), len(answer)), so that a nearly right
    answer scores above a wrong one and the signal is dense enough for a tiny model to climb."""
    if ground_truth is None:
        raise ValueError("addition_reward needs a ground truth")
    answer, guess = ground_truth.strip(), response.strip()
    if guess == answer:
        return 1.0
    if not guess:
        return 0.0
    right = sum(a == b for a, b in zip(guess, answer))
    return 0.5 * right / max(len(guess), len(answer))

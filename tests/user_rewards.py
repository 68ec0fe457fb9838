"""User reward functions for the tests of tasks.rewards, loaded by spec ("tests.user_rewards:<name>") in workers.

They switch behaviour on the response so that one runner can see failures and successes in the same session.
"""

import os
import time


def char_count(response: str, ground_truth: str | None, prompt: str) -> float:
    """Works: the response's length."""
    return float(len(response))


def raises_on_request(response: str, ground_truth: str | None, prompt: str) -> float:
    """Raises on "raise...", returns nan on "nan" and text on "text", kills its process on "exit"; else works."""
    if response.startswith("raise"):
        raise RuntimeError(f"deliberate failure on {response!r}")
    if response == "nan":
        return float("nan")
    if response == "text":
        return "not a score"
    if response == "exit":
        os._exit(3)
    return float(len(response))


def hangs_on_request(response: str, ground_truth: str | None, prompt: str) -> float:
    """Never returns on "hang"; otherwise the response's length."""
    while response == "hang":
        time.sleep(3600)
    return float(len(response))


def ones_fraction(response: str, ground_truth: str | None, prompt: str) -> float:
    """Trivially learnable: the fraction of the response's characters that are "1" (0 for an empty response)."""
    return response.count("1") / len(response) if response else 0.0


def not_ones(response: str, ground_truth: str | None, prompt: str) -> float:
    """1 - ones_fraction: high for most responses (~0.9 for the tiny test model), so rising reward floors keep most
    groups."""
    return 1.0 - ones_fraction(response, ground_truth, prompt)


def flaky_ones(response: str, ground_truth: str | None, prompt: str) -> float:
    """ones_fraction, but raises on responses containing "5", and hangs exactly once per test session: on its first
    call while the file named by MESHRL_TEST_HANG_MARKER does not exist yet. The trainer's start-up call (the ground
    truth as the response) always works."""
    if response == ground_truth:
        return ones_fraction(response, ground_truth, prompt)
    marker = os.environ.get("MESHRL_TEST_HANG_MARKER")
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
        while True:
            time.sleep(3600)
    if "5" in response:
        raise ValueError(f"deliberate failure on {response!r}")
    return ones_fraction(response, ground_truth, prompt)


def counted_ones(response: str, ground_truth: str | None, prompt: str) -> float:
    """ones_fraction, appending one line per call to the file named by MESHRL_TEST_CALLS (who scored what)."""
    with open(os.environ["MESHRL_TEST_CALLS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return ones_fraction(response, ground_truth, prompt)


def constant(response: str, ground_truth: str | None, prompt: str) -> float:
    """The same score for every response: every GRPO group is flat."""
    return 1.0


def trl_style(completions, prompts=None, ground_truth=None, **columns):
    """TRL's convention: batched, columns as keyword lists; the fraction of "1"s plus 10 x the row's `bonus` column."""
    return [ones_fraction(c, None, "") + 10 * b for c, b in zip(completions, columns["bonus"])]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's convention, returning a dict: 1 for an exact answer, plus `extra_info["weight"]`, tagged by source."""
    return {"score": float(solution_str.strip() == ground_truth) + extra_info["weight"], "source": data_source}


def two_arguments(completion, answer):
    """No convention's signature: refused at start-up."""
    return 0.0


def text_score(response, ground_truth, prompt):
    """Returns text, not a number: refused at start-up."""
    return "1.0"


def always_raises(response, ground_truth, prompt):
    """Works on the start-up call (the ground truth as the response), raises on everything the model writes."""
    if response == ground_truth:
        return 1.0
    raise RuntimeError(f"deliberate failure on {response!r}")


def fails_on_eval(response, ground_truth, prompt):
    """ones_fraction on the train prompts; raises on the samples of prompts whose ground truth is "eval-only" (the
    start-up call, with the ground truth as the response, passes)."""
    if ground_truth == "eval-only" and response != ground_truth:
        raise RuntimeError(f"deliberate eval failure on {response!r}")
    return ones_fraction(response, ground_truth, prompt)


def main_script_ran(response, ground_truth, prompt):
    """1.0 when this worker process ran its parent's main script (spawn runs it as __mp_main__; a test's script sets
    OWNER_SCRIPT there), else 0.0."""
    import sys

    return float(getattr(sys.modules.get("__mp_main__"), "OWNER_SCRIPT", False))

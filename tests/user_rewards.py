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

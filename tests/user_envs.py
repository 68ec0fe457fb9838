"""User environments and tools for the tests of multi-turn episodes, loaded by spec ("tests.user_envs:<name>") in
the environment workers. `scripted` switches behaviour on the record's "mode" column so that one pool sees failures
and successes in the same session."""

import os
import time


class Scripted:
    """Two steps: the first answers "+" (or a tool message under "tool"), the second ends the episode. The reward
    of a step is the share of "1" in the model's turn; `mode` fails on purpose at the second step."""

    def __init__(self, record: dict, length: int = 2):
        self.mode, self.steps, self.length = record.get("mode", "ok"), 0, length
        self.closed_flag = record.get("closed_flag")  # a file close() writes

    def close(self):
        if self.closed_flag:
            with open(self.closed_flag, "w") as f:
                f.write("closed")

    def reset(self):
        return None

    def step(self, text: str):
        self.steps += 1
        if self.steps == 2:
            if self.mode == "raise":
                raise RuntimeError("deliberate failure at step 2")
            if self.mode == "hang":
                time.sleep(3600)
            if self.mode == "exit":
                os._exit(3)
            if self.mode == "bad_reward":
                return None, "high", True
            if self.mode == "bad_obs":
                return 42, 0.0, False
        if self.mode == "flood":
            return "9" * 50_000_000, 0.0, False
        reward = text.count("1") / max(len(text), 1)
        if self.steps >= self.length:
            return None, reward, True, {"steps": self.steps}
        observation = [{"role": "tool", "content": f"{len(text)}"}] if self.mode == "tool" else "+"
        return observation, reward, False, {"steps": self.steps}


def scripted(record: dict) -> Scripted:
    return Scripted(record, record.get("length", 2))


def by_prompt(record: dict) -> Scripted:
    """One step where the prompt's digits add up to an even number, two where odd: the ranks of a run hold episodes
    of different lengths."""
    digits = sum(int(c) for c in str(record["prompt"]) if c.isdigit())
    return Scripted(record, 1 + digits % 2)


def random_length(record: dict) -> "RandomLength":
    """Observations of a random length (an unseeded draw: every process its own), three steps."""
    return RandomLength()


class RandomLength:
    def __init__(self):
        self.steps = 0

    def step(self, text: str):
        import random

        self.steps += 1
        if self.steps >= 3:
            return None, 1.0, True
        return "+" * random.randint(1, 4), 0.0, False


def broken_factory(record: dict):
    raise KeyError("deliberate: the record has no 'board' column")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def slow(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "woke up"

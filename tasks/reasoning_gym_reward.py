"""A reasoning-gym task's own scorer as a reward in verl's convention (`reward.functions: [{spec:
tasks.reasoning_gym_reward:compute_score}]`), for the files scripts/real_assets.py writes: `data_source` names the
task, `extra_info` holds the generator's question and metadata. The answer scored is the response's last number (a
small model answers in a sentence); no number scores 0. Imported in the reward workers only."""

from __future__ import annotations

import functools
import json
import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


@functools.cache
def _dataset(task: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0)


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    answer = last_number(solution_str)
    if answer is None:
        return 0.0
    extra = extra_info or {}
    metadata = extra.get("metadata") or "{}"
    entry = {"question": extra.get("question", ""), "answer": ground_truth,
             "metadata": json.loads(metadata) if isinstance(metadata, str) else metadata}
    return float(_dataset(data_source).score_answer(answer, entry))

"""A step's metrics from every rank to rank 0 (summed, maxed or averaged by name), and the eval's per-rank sums and the
eval metrics made from them."""

from __future__ import annotations

import torch.distributed as dist


def gather_metrics(local: dict[str, float]) -> dict[str, float]:
    """Every rank calls; rank 0 gets each key averaged over the ranks that reported it (others get {})."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    if dist.get_rank() != 0:
        return {}
    sums: dict[str, list[float]] = {}
    for metrics in everyone:
        for k, v in metrics.items():
            sums.setdefault(k, []).append(float(v))
    return {k: (sum(v) if k.startswith(SUMMED) else max(v) if k in MAXED else sum(v) / len(v))
            for k, v in sorted(sums.items())}


def eval_sums(scores: list[float], lengths: list[int], prompt_index: list[int], sources: list) -> dict:
    """One rank's eval sums: per data source ("" for all; a source only when the records have the column), the
    samples' score and length sums, how many scored >= 1, and per prompt whether any of its samples did (pass@n)."""
    sums: dict = {}
    for score, length, index, source in zip(scores, lengths, prompt_index, sources):
        for key in {"", source} - {None}:
            entry = sums.setdefault(key, {"n": 0, "score": 0.0, "length": 0.0, "correct": 0, "passed": {}})
            entry["n"] += 1
            entry["score"] += score
            entry["length"] += length
            entry["correct"] += score >= 1.0
            entry["passed"][index] = entry["passed"].get(index, False) or score >= 1.0
    return sums


def eval_metrics(shares: list[dict], n: int) -> dict[str, float]:
    """eval/score/mean (mean@n), eval/accuracy (share of samples scoring >= 1), eval/response_length/mean, with
    rollout.eval_n > 1 eval/pass@n (share of prompts with a sample scoring >= 1), and the same per data source as
    eval/<source>/...; from every rank's eval_sums (a prompt's samples are all on one rank)."""
    out: dict[str, float] = {}
    for key in sorted({k for share in shares for k in share}):
        parts = [share[key] for share in shares if key in share]
        count = sum(p["n"] for p in parts)
        prompts = [passed for p in parts for passed in p["passed"].values()]
        prefix = f"eval/{key}/" if key else "eval/"
        out[f"{prefix}score/mean"] = sum(p["score"] for p in parts) / count
        out[f"{prefix}accuracy"] = sum(p["correct"] for p in parts) / count
        if not key:
            out["eval/response_length/mean"] = sum(p["length"] for p in parts) / count
        if n > 1:
            out[f"{prefix}pass@{n}"] = sum(prompts) / len(prompts)
    return out


# counters add up over ranks (each counted by one rank: tp peers do not repeat them); memory is the fullest rank's;
# everything else is a mean, and the step's statistics are already global (the same on every rank)
SUMMED = ("reward_fn/errors", "reward_fn/timeouts")
MAXED = ("perf/memory_fraction", "perf/gpu_memory_used_gb", "perf/max_memory_allocated_gb")

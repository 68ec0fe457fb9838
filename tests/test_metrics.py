"""Logged values are those of the whole batch: the same batch on 1 rank and on 2 ranks gives the same advantages and
metrics (tests/dist/same_metrics.py, 2 gloo processes), and empty updates are skipped, not NaN."""

from __future__ import annotations

from conftest import explain, torchrun


def test_same_batch_on_one_and_two_ranks_logs_the_same_values(tmp_path):
    proc = torchrun(["tests/dist/same_metrics.py", str(tmp_path)], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    for estimator in ("gae", "reinforce_pp", "grpo", "rloo"):
        assert f"PASS same metrics {estimator}" in proc.stdout, explain(proc)
    for check in ("one sample per rank", "empty batch"):
        for rank in (0, 1):
            assert f"rank {rank} PASS {check}" in proc.stdout, explain(proc)

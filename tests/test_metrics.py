"""Logged values are those of the whole batch: the same batch on 1 rank and on 2 ranks gives the same advantages and
metrics (tests/dist/same_metrics.py, 2 gloo processes), and empty updates are skipped, not NaN."""

from __future__ import annotations

from conftest import explain, torchrun


def test_same_batch_on_one_and_two_ranks_logs_the_same_values(tmp_path):
    proc = torchrun(["tests/dist/same_metrics.py", str(tmp_path)], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    for case in ("gae", "reinforce_pp", "grpo", "rloo", "reinforce_pp_baseline", "gspo", "gspo_token", "cispo",
                 "distill"):
        assert f"PASS same metrics {case}" in proc.stdout, explain(proc)
    assert "PASS packed micro-batches" in proc.stdout, explain(proc)
    assert "PASS on-policy old log-probs" in proc.stdout, explain(proc)
    for check in ("no old log-probs, two steps refused", "one sample per rank", "empty batch"):
        for rank in (0, 1):
            assert f"rank {rank} PASS {check}" in proc.stdout, explain(proc)


def test_eval_metrics_per_source_and_pass_at_n_from_two_ranks():
    from monitor import eval_metrics, eval_sums

    # rank 0: prompt 0 (source a) with samples 1.0 and 0.0; rank 1: prompt 1 (a) 0.0, 0.0 and prompt 2 (b) 0.5, 1.0
    shares = [eval_sums([1.0, 0.0], [2, 4], [0, 0], ["a", "a"]),
              eval_sums([0.0, 0.0, 0.5, 1.0], [1, 1, 3, 4], [1, 1, 2, 2], ["a", "a", "b", "b"])]
    m = eval_metrics(shares, n=2)
    assert m["eval/score/mean"] == 2.5 / 6 and m["eval/accuracy"] == 2 / 6 and m["eval/response_length/mean"] == 15 / 6
    assert m["eval/pass@2"] == 2 / 3  # prompts 0 and 2 have a sample scoring 1
    assert m["eval/a/score/mean"] == 1 / 4 and m["eval/a/pass@2"] == 1 / 2 and m["eval/b/accuracy"] == 1 / 2
    assert "eval/pass@1" not in eval_metrics(shares, n=1)

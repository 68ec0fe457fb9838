"""The logging rank's outputs: metrics.jsonl, its truncation on resume, and the Prometheus endpoint."""

from __future__ import annotations

import json
import socket
import urllib.request

from monitor import MetricsLogger


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jsonl_truncation_and_prometheus_endpoint(tmp_path):
    port = free_port()
    logger = MetricsLogger(str(tmp_path), tensorboard=False, prometheus_port=port)
    try:
        for step in range(1, 4):
            logger.log(step, {"reward/score/mean": step / 4, "timing_s/step": 1.5})
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "meshrl_reward_score_mean 0.75" in page and "meshrl_step 3.0" in page
        assert "meshrl_timing_s_step 1.5" in page
        logger.truncate_after(2)
        logger.log(3, {"reward/score/mean": 0.0})
    finally:
        logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/score/mean"]) for r in rows] == [(1, 0.25), (2, 0.5), (3, 0.0)]

"""The logging rank's outputs: metrics.jsonl and its truncation on resume, Prometheus, W&B, GPU sampling, the health
warnings and the run summary."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import threading
import time
import urllib.request

import pytest
import torch

from config import ConfigError, HealthConfig, load_config
from monitor import GpuSampler, HealthWarnings, MetricsLogger, nvml_reader, run_summary, summary_table


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


def wandb_records(run_dir) -> list:
    """Every record W&B wrote to the offline runs under `run_dir`/wandb, in order, as its protobuf Record messages.
    The .wandb file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte header
    (CRC-32, length, type: 1 whole, 2 first, 3 middle, 4 last) and a block tail under 7 bytes left as padding."""
    import struct

    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk = path.read_bytes(), 7, b""
        assert data.startswith(b":W&B"), path
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunk)
                records.append(record)
                chunk = b""
    return records


def test_wandb_offline_gets_the_metrics_the_config_and_one_run_across_a_resume(tmp_path):
    from test_ppo import read_metrics, write_config

    from conftest import explain, run_python
    from tasks.char_tokenizer import build_char_tokenizer
    from tasks.synthetic import write_addition_dataset
    from tasks.tiny_model import save_tiny_model

    save_tiny_model(tmp_path / "model", build_char_tokenizer("0123456789+="), hidden_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=64, seed=0)
    write_addition_dataset(tmp_path, n_train=40, n_test=8, seed=0, digits=(1, 1))
    runs = tmp_path / "runs"
    env = dict(WANDB_MODE="offline", WANDB_SILENT="true")
    for total in (2, 3):  # the second start resumes the first's checkpoint and goes on to step 3
        cfg = write_config(tmp_path / "c.yaml", tmp_path, runs, run={"total_steps": total, "wandb": True,
                                                                     "wandb_project": "meshrl-test"},
                           algorithm={"adv_estimator": "grpo", "kl": {"in_reward": False}})
        proc = run_python(["train_ppo.py", "--config", cfg], timeout=300, **env)
        assert proc.returncode == 0, explain(proc)
    records = wandb_records(runs / "t")
    starts = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    run_id = (runs / "t" / "wandb_id").read_text().strip()
    assert len(starts) == 2 and {s.run_id for s in starts} == {run_id}, "one W&B run, resumed"
    assert starts[0].project == "meshrl-test" and starts[0].display_name == "t"
    config = {u.key: json.loads(u.value_json) for u in starts[0].config.update}
    assert config["run"]["total_steps"] == 2 and config["algorithm"]["adv_estimator"] == "grpo", config
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history.setdefault(row["_step"], {}).update(row)
    logged = read_metrics(runs)
    assert sorted(history) == [row["step"] for row in logged] == [0, 1, 2, 3]
    for row in logged:  # every value metrics.jsonl has, W&B has too, at the same step
        for key, value in row.items():
            if key != "step" and value is not None:
                assert history[row["step"]][key] == value, (row["step"], key)
    # the eval samples as a W&B table: every eval prompt of the last step (a nested item flattens to its path)
    assert history[3]["eval/samples/_type"] == "table-file" and history[3]["eval/samples/nrows"] == 8, history[3]
    # the run report covers both starts (from metrics.jsonl), on the console and in summary.json
    summary = json.loads((runs / "t" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["phases_s"]["gen"] == pytest.approx(sum(r["timing_s/gen"]
                                                                                   for r in logged[1:]))
    assert summary["eval_before"] == logged[0]["eval/score/mean"] and summary["warnings"] == {}, summary
    assert "run summary: 3 steps" in proc.stdout, explain(proc)

    # an attempt that never saved (its checkpoints gone): a fresh start drops what it logged and opens a new W&B run
    shutil.rmtree(runs / "t" / "checkpoints")
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300, **env)
    assert proc.returncode == 0, explain(proc)
    assert [row["step"] for row in read_metrics(runs)] == [0, 1, 2, 3], "every step once"
    assert (runs / "t" / "wandb_id").read_text().strip() != run_id
    assert json.loads((runs / "t" / "summary.json").read_text())["steps"] == 3


class Readings:
    """A stand-in for NVML (not our code): utilisation 0.1, 0.2, ... and bytes 1 GB, 2 GB, ..., a reading each call,
    remembering what it returned and from which thread."""

    def __init__(self):
        self.returned, self.threads = [], set()

    def __call__(self):
        n = len(self.returned) + 1
        self.returned.append((n / 10 % 1, n * 1e9))
        self.threads.add(threading.get_ident())
        return self.returned[-1]


def test_gpu_sampler_reads_during_the_step_in_the_background():
    read = Readings()
    sampler = GpuSampler(read, period_s=0.01)
    try:
        time.sleep(0.3)  # "the step": the main thread is busy elsewhere meanwhile
        first = sampler.pop()
        taken = len(read.returned)
        time.sleep(0.1)
        second = sampler.pop()
    finally:
        sampler.close()
    assert taken >= 5 and read.threads and threading.get_ident() not in read.threads, "sampled by its own thread"
    # the readings grow: the second pop holds only readings after the first
    assert second["perf/gpu_memory_used_gb"] > first["perf/gpu_memory_used_gb"]
    assert not sampler.thread.is_alive()
    assert nvml_reader(torch.device("cpu")) is None and GpuSampler(None, 0.01).pop() == {}, "no GPU: no metrics"


def test_gpu_sampler_exact_aggregates_over_known_readings():
    """With the thread stopped, pop() is the mean utilisation and the max memory of exactly the readings taken."""
    read = Readings()
    sampler = GpuSampler(read, period_s=0.005)
    time.sleep(0.1)
    sampler.close()
    seen = list(read.returned)
    out = sampler.pop()
    assert out["perf/gpu_util"] == pytest.approx(sum(u for u, _ in seen) / len(seen))
    assert out["perf/gpu_memory_used_gb"] == pytest.approx(max(m for _, m in seen) / 2**30)


def test_health_warnings_once_per_crossing_and_as_metrics(caplog):
    health = HealthWarnings(HealthConfig(min_throughput=100.0, min_gpu_util=0.6, max_comm_fraction=0.3,
                                         max_memory_fraction=None, max_reshard_s=10.0))
    ok = {"perf/throughput": 150.0, "perf/gpu_util": 0.9, "perf/comm_fraction": 0.1, "perf/memory_fraction": 0.99,
          "timing_s/reshard": 0.5}
    with caplog.at_level(logging.WARNING, logger="meshrl"):
        assert health.check(ok) == {f"health/{n}": 0.0 for n in ("throughput", "gpu_util", "comm", "reshard")}, \
            "memory is off (null): no metric, no warning although 0.99"
        bad = {**ok, "perf/throughput": 50.0, "perf/comm_fraction": 0.45, "timing_s/reshard": 12.0}
        assert health.check(bad) == {"health/throughput": 1.0, "health/gpu_util": 0.0, "health/comm": 1.0,
                                     "health/reshard": 1.0}
        assert len(caplog.records) == 3 and "45%" in caplog.text and "health.max_comm_fraction=0.3" in caplog.text
        health.check(bad)
        assert len(caplog.records) == 3, "no repeat while still crossed"
        health.check(ok)
        health.check({"perf/comm_fraction": 0.31})  # again after going back; the others are absent: not checked
        assert len(caplog.records) == 4 and health.check({}) == {}


def test_health_config_ranges_and_the_moved_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"health.min_gpu_util=1.5: must be in \(0, 1\]"):
        HealthConfig(min_gpu_util=1.5)
    with pytest.raises(ConfigError, match="health.gpu_sample_s=0: must be > 0"):
        HealthConfig(gpu_sample_s=0)
    path = tmp_path / "c.yaml"
    path.write_text("comm:\n  comm_fraction_warn: 0.5\n")
    with pytest.raises(ConfigError, match="moved to health.max_comm_fraction"):
        load_config(str(path))


def test_run_summary_against_the_rows():
    rows = [
        {"step": 0, "eval/score/mean": 0.25, "timing_s/engine_init": 40.0},
        {"step": 1, "timing_s/step": 2.0, "timing_s/startup": 30.0, "timing_s/gen": 1.0, "timing_s/update_actor": 0.5,
         "perf/throughput": 100.0, "perf/max_memory_allocated_gb": 3.0, "health/comm": 1.0, "reward_fn/errors": 2.0,
         "actor/skipped_steps": 0.0},
        {"step": 2, "timing_s/step": 3.0, "timing_s/gen": 2.0, "timing_s/update_actor": 0.5, "perf/throughput": None,
         "perf/max_memory_allocated_gb": 5.0, "health/comm": 1.0, "actor/skipped_steps": 1.0},
        {"step": 3, "timing_s/step": 1.0, "timing_s/gen": 0.5, "perf/throughput": 300.0, "health/comm": 0.0,
         "health/gpu_util": 1.0, "reward_fn/timeouts": 1.0, "eval/score/mean": 0.75},
        {"step": 4, "timing_s/step": 1.0, "timing_s/gen": 0.5, "health/comm": 1.0},
    ]
    summary = run_summary(rows)
    assert summary["steps"] == 4 and summary["last_step"] == 4
    assert summary["step_s"] == 7.0 and summary["startup_s"] == 30.0
    assert summary["phases_s"] == {"gen": 4.0, "update_actor": 1.0}, "engine_init is start-up, not a step phase"
    assert summary["phase_share"] == {"gen": 4.0 / 7.0, "update_actor": 1.0 / 7.0}
    assert summary["tokens_per_s_per_rank"] == 200.0, "the non-finite step is left out"
    assert summary["peak_memory_gb"] == 5.0 and summary["peak_gpu_memory_used_gb"] is None
    assert (summary["eval_before"], summary["eval_after"]) == (0.25, 0.75)
    assert (summary["skipped_steps"], summary["reward_fn_errors"], summary["reward_fn_timeouts"]) == (1.0, 2.0, 1.0)
    assert summary["warnings"] == {"comm": [1, 4], "gpu_util": [3]}, "a warning per crossing"
    table = summary_table(summary)
    assert "4 steps" in table and "gen" in table and "57.1%" in table and "comm at steps [1, 4]" in table
    assert run_summary([{"step": 0}])["steps"] == 0 and "none" in summary_table(run_summary([{"step": 0}]))
    # a CPU run without an eval set: no GPU field, and "no eval" rather than "-" or nan
    bare = summary_table(run_summary([{"step": 0}, {"step": 1, "timing_s/step": 1.0, "eval/score/mean": float("nan")}]))
    assert "GPU in use" not in bare and "no eval;" in bare and "nan" not in bare, bare
    assert "(GPU in use 2 GB)" in summary_table(run_summary([{"step": 1, "perf/gpu_memory_used_gb": 2.0}]))

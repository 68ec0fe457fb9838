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

"""parallel/comm/: the NCCL environment and its fallback to sockets across a restart (nccl_env), gradient-sync
frequency on FSDP2 (grad_sync), compression hooks on DDP (compression), parameter averaging (param_averaging), the
one-step-stale replica all-reduce (stale_allreduce), their checkpointable state, the bandwidth check (bandwidth; bench
script included), the usage warnings (usage), the comm config checks, and a two-agent (--nnodes 2) rehearsal of a small
PPO run on localhost. Distributed parts run under torchrun on gloo."""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets: the tiny model and data fixture)

from config import CommConfig, ConfigError, load_config
from conftest import ROOT, explain, run_env, run_python, torchrun
from parallel.comm import (
    FALLBACK_MARKER,
    GradCompression,
    ReplicaAverager,
    StaleAllReduce,
    apply_comm_env,
    busbw_gbps,
    init_with_fallback,
    parse_env_entries,
    sync_now,
)

NCCL_VARS = ("NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "MESHRL_TEST_A")


@pytest.fixture
def clean_env(monkeypatch):
    for var in NCCL_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def passed_ranks(stdout: str, check: str) -> set[str]:
    return set(re.findall(rf"rank (\d) PASS {re.escape(check)}\b", stdout))


# ------------------------------------------------------------------------------------------------ environment


def test_comm_env_applied_before_init_and_logged(clean_env, tmp_path, caplog):
    clean_env.setenv("NCCL_DEBUG", "INFO")
    cfg = CommConfig(nccl_ib_disable=False, nccl_socket_ifname="ib0,eth0", nccl_ib_hca="mlx5_0:1",
                     nccl_debug="WARN", extra_env=["MESHRL_TEST_A=x=1"])
    with caplog.at_level("INFO", logger="meshrl.comm"):
        applied = apply_comm_env(cfg, str(tmp_path), rank=0)
    assert applied == {"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "ib0,eth0", "NCCL_IB_HCA": "mlx5_0:1",
                       "NCCL_DEBUG": "WARN", "MESHRL_TEST_A": "x=1"}
    assert all(os.environ[k] == v for k, v in applied.items())
    assert "NCCL_DEBUG=WARN (was INFO)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="meshrl.comm"):
        apply_comm_env(cfg, str(tmp_path), rank=3)
    assert caplog.text == "", "only rank 0 logs"
    # None leaves the environment alone
    clean_env.delenv("NCCL_IB_DISABLE")
    assert apply_comm_env(CommConfig(), str(tmp_path)) == {} and "NCCL_IB_DISABLE" not in os.environ


def test_malformed_env_entries_are_named():
    assert parse_env_entries(["A=1", "B_2="]) == {"A": "1", "B_2": ""}
    for bad in (["A=1", "NOEQUALS"], ["=1"], ["1A=2"], ["A B=1"], ["A=1", "A=2"]):
        with pytest.raises(ValueError, match=re.escape(f"comm.extra_env[{len(bad) - 1}]")):
            parse_env_entries(bad)
    with pytest.raises(ValueError, match="comm.nccl_debug"):
        apply_comm_env(CommConfig(nccl_debug="WARN", extra_env=["NCCL_DEBUG=INFO"]), "unused")


def test_failed_init_leaves_marker_and_next_start_disables_ib(clean_env, tmp_path, caplog):
    def unreachable_store():  # a real start that fails: nothing serves port 1
        dist.TCPStore("127.0.0.1", 1, 2, is_master=False, timeout=datetime.timedelta(seconds=1))

    cfg = CommConfig()
    assert apply_comm_env(cfg, str(tmp_path)) == {}
    with pytest.raises(RuntimeError):
        init_with_fallback(unreachable_store, cfg, str(tmp_path), rank=0)
    record = json.loads((tmp_path / FALLBACK_MARKER).read_text())
    assert record["rank"] == 0 and "DistNetworkError" in record["error"], record
    with caplog.at_level("INFO", logger="meshrl.comm"):
        assert apply_comm_env(cfg, str(tmp_path)) == {"NCCL_IB_DISABLE": "1"}
    assert "NCCL_IB_DISABLE=1" in caplog.text and "earlier start" in caplog.text
    # off: the marker is ignored and none is written
    off = CommConfig(fallback_to_sockets=False)
    clean_env.delenv("NCCL_IB_DISABLE")
    assert apply_comm_env(off, str(tmp_path)) == {}
    other = tmp_path / "other"
    with pytest.raises(RuntimeError):
        init_with_fallback(unreachable_store, off, str(other))
    assert not (other / FALLBACK_MARKER).exists()
    # InfiniBand already off: a failure is not the fabric's, no marker either
    ib_off = CommConfig(nccl_ib_disable=True)
    apply_comm_env(ib_off, str(other))
    with pytest.raises(RuntimeError):
        init_with_fallback(unreachable_store, ib_off, str(other))
    assert not (other / FALLBACK_MARKER).exists()


def test_fallback_across_a_torchrun_restart(tmp_path):
    proc = torchrun(["tests/dist/comm_fallback.py", str(tmp_path)], nproc=2, timeout=120, extra=["--max-restarts=1"])
    assert proc.returncode == 0, explain(proc)
    assert passed_ranks(proc.stdout, "fallback") == {"0", "1"}, explain(proc)
    assert "the next start will set NCCL_IB_DISABLE=1" in proc.stderr
    assert "NCCL init failed on an earlier start of this run" in proc.stderr


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("override,key", [("comm.topk_ratio=0", "comm.topk_ratio"),
                                          ("comm.topk_ratio=1.5", "comm.topk_ratio"),
                                          ("comm.compression=zip", "comm.compression"),
                                          ("comm.grad_sync_every=0", "comm.grad_sync_every"),
                                          ("comm.extra_env=[NCCL_DEBUG]", "comm.extra_env[0]")])
def test_bad_comm_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, [override])


@pytest.mark.parametrize("overrides,other", [(["comm.compression=int8"], "comm.compression=int8"),
                                             (["comm.param_averaging=true"], "comm.param_averaging")])
def test_stale_allreduce_excludes_other_replica_modes(overrides, other):
    assert CommConfig().stale_allreduce is False
    assert load_config(None, ["comm.stale_allreduce=true"]).comm.stale_allreduce is True
    with pytest.raises(ConfigError, match=re.escape("comm.stale_allreduce")) as err:
        load_config(None, ["comm.stale_allreduce=true", *overrides])
    assert other in str(err.value)


def test_stale_allreduce_with_compression_exits_2_from_train_ppo(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run:\n  name: stale\n")
    proc = run_python(["train_ppo.py", "--config", str(cfg), "comm.stale_allreduce=true", "comm.compression=int8"],
                      timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "comm.stale_allreduce" in proc.stderr and "comm.compression=int8" in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)


def test_bad_comm_value_exits_2_from_train_ppo():
    proc = run_python(["train_ppo.py", "comm.compression=zip"], timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "comm.compression" in proc.stderr and "'topk'" in proc.stderr, explain(proc)


# ------------------------------------------------------------------------------------------------ sync, hooks


def test_sync_now_marks_group_ends_and_the_last_micro_batch():
    assert [sync_now(i, 4, 1) for i in range(4)] == [True] * 4
    assert [sync_now(i, 4, 4) for i in range(4)] == [False, False, False, True]
    assert [sync_now(i, 5, 2) for i in range(5)] == [False, True, False, True, True]
    assert [sync_now(i, 3, 8) for i in range(3)] == [False, False, True]


def test_grad_sync_every_and_replica_compression_on_fsdp2():
    proc = torchrun(["tests/dist/comm_fsdp.py"], nproc=4, timeout=300)
    assert proc.returncode == 0, explain(proc)
    for check in ("grad_sync_fsdp4", "grad_sync_hsdp", "replica_compression", "bandwidth"):
        assert passed_ranks(proc.stdout, check) == {"0", "1", "2", "3"}, f"{check}\n{explain(proc)}"


def test_compression_hooks_bytes_and_error_feedback():
    proc = torchrun(["tests/dist/comm_ddp.py"], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    for check in ("bytes", "error_feedback"):
        assert passed_ranks(proc.stdout, check) == {"0", "1"}, f"{check}\n{explain(proc)}"


def test_stale_allreduce_applies_last_steps_average():
    """One-step-stale replica all-reduce: step t applies exactly the synchronous average of step t-1 (regression with
    4 replicas, HSDP 2x2), non-finite gradients are skipped one step late on every replica, flush() changes nothing,
    and the loss matches synchronous averaging (tolerance in tests/dist/comm_stale.py)."""
    proc = torchrun(["tests/dist/comm_stale.py"], nproc=4, timeout=300)
    assert proc.returncode == 0, explain(proc)
    for check in ("stale_regression", "stale_hsdp"):
        assert passed_ranks(proc.stdout, check) == {"0", "1", "2", "3"}, f"{check}\n{explain(proc)}"


# ------------------------------------------------------------------------------------------------ resume


def test_comm_state_resumes_exactly():
    """GradCompression (top-k residuals), ReplicaAverager and StaleAllReduce: K steps, a checkpoint (weights_only
    load), fresh objects and N - K steps equal N steps bit for bit, and not without load_state_dict; a state meeting
    other buckets is a ValueError naming both sizes (tests/dist/comm_resume.py)."""
    proc = torchrun(["tests/dist/comm_resume.py"], nproc=2, timeout=180)
    assert proc.returncode == 0, explain(proc)
    for check in ("resume_topk", "resume_averager", "resume_stale"):
        assert passed_ranks(proc.stdout, check) == {"0", "1"}, f"{check}\n{explain(proc)}"


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_comm_state_loads_check_what_they_get():
    compression = GradCompression("topk")
    compression.residuals = {0: torch.ones(10)}
    assert roundtrip(compression.state_dict())["residuals"][0].tolist() == [1.0] * 10
    with pytest.raises(ValueError, match="residuals"):
        GradCompression("topk").load_state_dict({"residual": {}})
    with pytest.raises(ValueError, match="bucket 0 has 12 elements, the model's bucket 0 has 10"):
        compression.load_state_dict({"residuals": {0: torch.ones(12)}})
    with pytest.raises(ValueError, match=re.escape("for 2 buckets [0, 1], but the model has 1 buckets [0]")):
        compression.load_state_dict({"residuals": {0: torch.ones(10), 1: torch.ones(3)}})

    averager = ReplicaAverager(None, k_min=1, k_max=4)
    averager.k, averager.since, averager.ema, averager.rounds = 4, 2, 0.5, 3
    restored = ReplicaAverager(None, k_min=1, k_max=4)
    restored.load_state_dict(roundtrip(averager.state_dict()))
    assert restored.state_dict() == {"k": 4, "since": 2, "ema": 0.5, "last_loss": None, "rounds": 3}
    with pytest.raises(ValueError, match=re.escape("k=4 is outside [k_min, k_max]=[1, 2]")):
        ReplicaAverager(None, k_min=1, k_max=2).load_state_dict(averager.state_dict())
    with pytest.raises(ValueError, match="missing since, rounds"):
        restored.load_state_dict({"k": 1, "ema": None, "last_loss": None})

    stale = StaleAllReduce(None)
    assert roundtrip(stale.state_dict()) == {"average": None, "bounds": [], "params": []}, "nothing pending yet"
    pending = {"average": [torch.arange(3.0)], "bounds": [[0, 2]], "params": [0, 2]}
    stale.load_state_dict(roundtrip(pending))
    again = stale.state_dict()  # loaded, not installed yet: still the pending average
    assert again["average"][0].tolist() == [0.0, 1.0, 2.0] and again["params"] == [0, 2], again
    with pytest.raises(ValueError, match="missing params"):
        stale.load_state_dict({"average": None, "bounds": []})


# ------------------------------------------------------------------------------------------------ measurements


def test_busbw_formula():
    assert busbw_gbps(1 << 30, 1.0, 2) == pytest.approx((1 << 30) / 1e9)  # 2(n-1)/n = 1 on 2 ranks
    assert busbw_gbps(1 << 30, 1.0, 8) == pytest.approx(1.75 * (1 << 30) / 1e9)


def test_bandwidth_bench_prints_a_table():
    proc = torchrun(["bench/comm_bandwidth.py", "--sizes", "64K,1M", "--iters", "3", "--warmup", "1"], nproc=2,
                    timeout=120)
    assert proc.returncode == 0, explain(proc)
    rows = re.findall(r"\|\s+(\d+ [KM]iB) \|\s+([\d.]+) \|", proc.stdout)
    assert [r[0] for r in rows] == ["64 KiB", "1 MiB"] and all(float(r[1]) > 0 for r in rows), explain(proc)
    assert "comm/allreduce_busbw_gbps" in proc.stdout


# ------------------------------------------------------------------------------------------------ two "nodes"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agent_rehearsal_on_localhost(assets, tmp_path):  # noqa: F811
    """Two torchrun agents (--nnodes 2, one worker each) meet at a c10d rendezvous on localhost, as two nodes of a
    Slurm job do at the first node, and run a small PPO job to the end."""
    cfg = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                       actor={"ppo_epochs": 1}, critic={"ppo_epochs": 1}, comm={"bandwidth_check": True})
    endpoint = f"localhost:{free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint={endpoint}", "--rdzv_id=rehearsal", "train_ppo.py", "--config", cfg]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    outs = []
    for agent in agents:
        try:
            out, err = agent.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise
        outs.append(subprocess.CompletedProcess(cmd, agent.returncode, out, err))
    for proc in outs:
        assert proc.returncode == 0, explain(proc)
    rows = read_metrics(tmp_path / "runs")
    assert [r["step"] for r in rows] == [0, 1, 2], rows
    assert "actor/pg_loss" in rows[2] and "eval/score/mean" in rows[2]

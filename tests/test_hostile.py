"""Hostile inputs, third round (issue 42): a run never reaches into another, a refused start writes nothing, no input
trains silently on junk. Real runs of the entry points on the tiny test model, real files made here."""

from __future__ import annotations

import os
import socket

import pytest
from test_faults import finished_run, snapshot
from test_ppo import assets, write_config  # noqa: F401  (assets is a fixture)

import config as C
from conftest import explain, run_python


def test_a_run_name_is_one_folder_name(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1})
    for name in ("../victim", "../../escaped", "/tmp/abs", "", ".", "..", "a/b", "x" * 256):
        with pytest.raises(C.ConfigError, match=r"run\.name="):
            C.load_config(cfg, [f"run.name={name}"])
    assert C.load_config(cfg, ["run.name=ok-name_1.v2"]).run.name == "ok-name_1.v2"
    # train_ppo.py and train_rm.py exit 2 at config time, before any folder exists
    for script in ("train_ppo.py", "train_rm.py"):
        proc = run_python([script, "--config", cfg, "run.name=../escaped"], timeout=120)
        assert proc.returncode == 2 and "config error: run.name='../escaped'" in proc.stderr, explain(proc)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "runs").exists()


def test_the_run_folder_must_be_usable_and_the_port_valid(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 1})
    for port in (0, 70000, -1):
        with pytest.raises(C.ConfigError, match=r"run\.prometheus_port=.*\[1, 65535\]"):
            C.load_config(cfg, [f"run.prometheus_port={port}"])
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(C.ConfigError, match=r"run\.output_dir=.*a_file is a file"):
        C.check_ppo(C.load_config(cfg, [f"run.output_dir={tmp_path / 'a_file'}"]), 1)
    (tmp_path / "runs").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / "runs" / "t")
    with pytest.raises(C.ConfigError, match=r"symbolic link to .*nowhere.*does not exist"):
        C.check_ppo(C.load_config(cfg), 1)
    with pytest.raises(C.ConfigError, match=r"symbolic link"):
        C.check_rm(C.load_config(cfg, [f"rm.train_path={cfg}"]), 1)
    os.unlink(tmp_path / "runs" / "t")
    (tmp_path / "runs" / "t").write_text("x")
    with pytest.raises(C.ConfigError, match=r"is a file, not a run folder"):
        C.check_ppo(C.load_config(cfg), 1)
    (tmp_path / "runs" / "t").unlink()
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(C.ConfigError, match=r"not writable"):
            C.check_ppo(C.load_config(cfg, [f"run.output_dir={tmp_path / 'ro'}"]), 1)
    proc = run_python(["train_ppo.py", "--config", cfg, f"run.output_dir={tmp_path / 'a_file'}"], timeout=120)
    assert proc.returncode == 2 and "config error: run.output_dir=" in proc.stderr, explain(proc)


def test_a_refused_start_leaves_the_run_config_as_it_was(assets, tmp_path):  # noqa: F811
    run, before = finished_run(assets, tmp_path, steps=1)
    written = (run / "config.yaml").read_bytes()
    # a protected key changed; the run already finished; the Prometheus port taken
    changed = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                           data={"batch_size": 4}, actor={"optim": {"lr": 1e-2}})
    finished = write_config(tmp_path / "c.yaml", assets, tmp_path / "runs", run={"total_steps": 1},
                            actor={"optim": {"lr": 1e-2}})
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = ((changed, [], "would change what its run means"), (finished, [], "has already finished"),
                 (changed, [f"run.prometheus_port={port}", "checkpoint.allow_config_change=[data.batch_size]"],
                  f"run.prometheus_port={port}: cannot serve metrics"))
        for path, extra, message in cases:
            proc = run_python(["train_ppo.py", "--config", path, *extra], timeout=300)
            assert proc.returncode == 2 and message in proc.stderr, explain(proc)
            assert "Traceback" not in proc.stderr, explain(proc)
            assert (run / "config.yaml").read_bytes() == written, f"{message}: config.yaml was rewritten"
            assert (snapshot(run / "checkpoints"), (run / "metrics.jsonl").read_text()) == before

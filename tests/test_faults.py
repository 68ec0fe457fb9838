"""Faults that used to lose work (issue 17, part): a resume that can read no checkpoint, two runs in one folder, a
metrics line cut in half. Real runs of train_ppo.py on the tiny test model, real files, real signals."""

from __future__ import annotations

import re
import signal
import time

import pytest
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)

import config as C
from conftest import explain, run_python, start_run_and_wait, torchrun
from tasks.char_tokenizer import build_char_tokenizer
from tasks.tiny_model import save_tiny_model


def snapshot(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_run(assets, tmp_path, steps: int):  # noqa: F811
    """Run `steps` steps of the test config; returns its run folder and a snapshot of its checkpoints and metrics."""
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": steps})
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 0, explain(proc)
    run = tmp_path / "runs" / "t"
    return run, (snapshot(run / "checkpoints"), (run / "metrics.jsonl").read_text())


def another_model(path, hidden_size: int, seed: int):
    """The test model's shape with another width and/or other random weights, as an HF folder."""
    save_tiny_model(path, build_char_tokenizer("0123456789+="), hidden_size=hidden_size, num_layers=2, num_heads=4,
                    num_kv_heads=2, intermediate_size=64, max_position_embeddings=64, seed=seed)
    return path


def test_a_resume_that_can_read_no_checkpoint_stops_and_keeps_them(assets, tmp_path):  # noqa: F811
    run, before = finished_run(assets, tmp_path, steps=2)
    # the same run name with another architecture: the checkpoint's shapes do not fit the model
    wider = another_model(tmp_path / "wider", hidden_size=48, seed=0)
    changed = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 4},
                           model={"path": str(wider)})
    proc = run_python(["train_ppo.py", "--config", changed], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "holds checkpoints but none could be resumed" in proc.stderr and "another run.name" in proc.stderr
    assert (snapshot(run / "checkpoints"), (run / "metrics.jsonl").read_text()) == before, "nothing may change"
    # starting over on purpose in the same folder is refused too: it would overwrite them
    proc = run_python(["train_ppo.py", "--config", changed, "checkpoint.resume=never"], timeout=300)
    assert proc.returncode == 2 and "checkpoint.resume=never but" in proc.stderr, explain(proc)
    assert snapshot(run / "checkpoints") == before[0]


def test_a_second_live_run_in_the_same_folder_is_refused(assets, tmp_path):  # noqa: F811
    cfg = write_config(tmp_path / "a.yaml", assets, tmp_path / "runs", run={"total_steps": 200})
    first = start_run_and_wait(cfg, tmp_path / "runs" / "t" / "metrics.jsonl", lines=2)
    proc = run_python(["train_ppo.py", "--config", cfg], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "is in use by a live run (pid" in proc.stderr, explain(proc)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    last = read_metrics(tmp_path / "runs")[-1]["step"]
    # the lock went with the process: the next start resumes
    more = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": last + 1})
    proc = run_python(["train_ppo.py", "--config", more], timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, explain(proc)


def test_a_metrics_line_cut_in_half_is_dropped_on_resume(assets, tmp_path):  # noqa: F811
    run, _ = finished_run(assets, tmp_path, steps=2)
    metrics = run / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "reward/sco')  # a kill in the middle of a write
    more = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 3})
    proc = run_python(["train_ppo.py", "--config", more], timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "is not complete JSON" in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0, 1, 2, 3]
    samples = (tmp_path / "runs" / "t" / "eval_samples.jsonl").read_text().splitlines()
    assert [int(s.split(",")[0].split(":")[1]) for s in samples] == [0, 2, 3], "eval samples once per step"


def test_every_group_honours_the_configured_timeout():
    """distributed.timeout_s reaches the groups meshrl creates itself (pool, I/O, pair) and those DeviceMesh creates,
    not only the default group: a rank stopped with SIGSTOP fails its peers' collectives in about that time."""
    from tests.dist.group_timeout import TIMEOUT_S

    began = time.time()
    proc = torchrun(["tests/dist/group_timeout.py"], nproc=4, timeout=150)
    assert proc.returncode == 0, explain(proc)
    seen = dict(re.findall(r"TIMEOUT (\S+(?: \S+)?) ([0-9.]+) s", proc.stdout))
    assert set(seen) == {"pool", "io", "tp axis", "pair"}, explain(proc)
    for name, seconds in seen.items():
        assert TIMEOUT_S * 0.5 <= float(seconds) <= TIMEOUT_S * 4, f"{name}: {seconds} s\n{explain(proc)}"
    assert time.time() - began < 120


def test_a_resume_that_changes_what_the_run_means_is_refused_unless_allowed(assets, tmp_path):  # noqa: F811
    run, before = finished_run(assets, tmp_path, steps=1)
    # the same architecture, so the checkpoint would load: another batch size and another reference model
    other = another_model(tmp_path / "other_model", hidden_size=32, seed=1)
    changed = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 2},
                           data={"batch_size": 4}, reference={"model_path": str(other)}, actor={"clip_high": 0.28})
    proc = run_python(["train_ppo.py", "--config", changed], timeout=300)
    assert proc.returncode == 2, explain(proc)
    assert "data.batch_size: 8 -> 4" in proc.stderr and "reference.model_path: None -> " in proc.stderr, explain(proc)
    assert "actor.clip_high" not in proc.stderr.split("would change")[1], "a free change is not refused"
    assert "checkpoint.allow_config_change=[data.batch_size,reference.model_path]" in proc.stderr, explain(proc)
    assert (snapshot(run / "checkpoints"), (run / "metrics.jsonl").read_text()) == before, "nothing may change"
    # a key that is not guarded cannot be listed
    # (a config check: train_ppo.py exits 2 on every ConfigError, tests/test_config.py; checked here in-process)
    with pytest.raises(C.ConfigError, match="only these keys are guarded"):
        C.check_ppo(C.load_config(changed, ["checkpoint.allow_config_change=[actor.clip_high]"]), 1)
    proc = run_python(["train_ppo.py", "--config", changed,
                       "checkpoint.allow_config_change=[data.batch_size,reference.model_path]"], timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0, 1, 2]


FULL_DISK = """
import resource, runpy, signal, sys
# writes past LIMIT bytes per file fail with EFBIG, as they would with ENOSPC on a full disk
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
sys.argv = ["train_ppo.py", *sys.argv[2:]]
runpy.run_path("train_ppo.py", run_name="__main__")
"""


def test_a_save_that_cannot_be_written_is_removed_and_training_goes_on(assets, tmp_path):  # noqa: F811
    run, _ = finished_run(assets, tmp_path, steps=1)
    ckpts = run / "checkpoints"
    good = snapshot(ckpts / "step_00000001")
    shard = max((ckpts / "step_00000001" / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    limit = shard.stat().st_size // 2  # every file of the run's logs stays far below it
    (ckpts / "step_00000005.tmp").mkdir()  # what a save killed half-way leaves
    (ckpts / "step_00000005.tmp" / "junk").write_bytes(b"x" * 100)
    more = write_config(tmp_path / "b.yaml", assets, tmp_path / "runs", run={"total_steps": 3},
                        checkpoint={"save_every": 1})
    proc = run_python(["-c", FULL_DISK, str(limit), "--config", more], timeout=300)
    # steps 2 and 3 ran; the save of step 2 failed and training went on; the final one failed: exit 1
    assert proc.returncode == 1, explain(proc)
    assert "removed step_00000005.tmp" in proc.stderr, explain(proc)
    assert "checkpoint step_00000002 could not be written" in proc.stderr and "Training goes on" in proc.stderr
    assert "checkpoint step_00000003 could not be written" in proc.stderr and "GiB are free" in proc.stderr
    assert "The last good checkpoint: step_00000001" in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0, 1, 2, 3]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000001"], "no partial save is left"
    assert snapshot(ckpts / "step_00000001") == good and (ckpts / "latest").read_text().strip() == "step_00000001"

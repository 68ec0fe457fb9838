"""Checkpoints, resume and faults on real runs of train_ppo.py (python and torchrun/gloo), and HF export."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_ppo import assets, read_metrics, write_config  # noqa: F401  (assets is a fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, explain, run_env, run_python, start_run_and_wait, torchrun

STRIP = ("timing_s/", "perf/", "health/")  # wall-clock figures, and the health flags set from them


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(STRIP)} for r in rows]


def config(tmp_path, assets, name, **sections):  # noqa: F811
    return write_config(tmp_path / f"{name}.yaml", assets, tmp_path / "runs", **sections)


def ckpts(tmp_path) -> list[str]:
    root = tmp_path / "runs" / "t" / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_resume_equals_uninterrupted_and_a_truncated_checkpoint_is_skipped(assets, tmp_path):  # noqa: F811
    # uninterrupted: 6 steps
    whole = write_config(tmp_path / "whole.yaml", assets, tmp_path / "whole", run={"total_steps": 6})
    proc = run_python(["train_ppo.py", "--config", whole])
    assert proc.returncode == 0, explain(proc)
    reference = comparable(read_metrics(tmp_path / "whole"))

    # interrupted: 3 steps (checkpoints at 2 and 3), then damage step 3, then resume to 5
    # written in the background (async_save): finished before the next save and at the end
    first = config(tmp_path, assets, "a", run={"total_steps": 3},
                   checkpoint={"save_every": 2, "keep_last": 2, "async_save": True})
    proc = run_python(["train_ppo.py", "--config", first])
    assert proc.returncode == 0, explain(proc)
    assert ckpts(tmp_path) == ["latest", "step_00000002", "step_00000003"]
    shard = next((tmp_path / "runs" / "t" / "checkpoints" / "step_00000003" / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    second = config(tmp_path, assets, "b", run={"total_steps": 5}, checkpoint={"save_every": 2, "keep_last": 2})
    proc = run_python(["train_ppo.py", "--config", second])
    assert proc.returncode == 0, explain(proc)
    assert "step_00000003 could not be read" in proc.stderr and "resumed from" in proc.stderr, explain(proc)
    assert "step_00000002 (step 2)" in proc.stderr, explain(proc)
    rows = comparable(read_metrics(tmp_path / "runs"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5], "each step once: the lines after step 2 were replaced"
    # steps after the resume point equal the uninterrupted run (the data position, RNG, optimizer all restored);
    # step 5 was this run's last: it carries the final eval, which the 6-step run has at step 6 only
    no_eval = lambda row: {k: v for k, v in row.items() if not k.startswith("eval/")}  # noqa: E731
    assert rows[3:5] == reference[3:5] and no_eval(rows[5]) == no_eval(reference[5])
    assert ckpts(tmp_path) == ["latest", "step_00000004", "step_00000005"], "keep_last=2"
    # extended to 6 steps from step 5, whose checkpoint was written after the final evaluation: the evaluation
    # samples from a stream of its own, so step 6 (and its final eval) equals the run that never evaluated at 5
    third = config(tmp_path, assets, "c", run={"total_steps": 6})
    proc = run_python(["train_ppo.py", "--config", third])
    assert proc.returncode == 0 and "step_00000005 (step 5)" in proc.stderr, explain(proc)
    assert comparable(read_metrics(tmp_path / "runs"))[6] == reference[6]


@pytest.mark.parametrize("ranks", ["actor", "all"])
def test_resume_keeps_the_controllers_when_rank_0_is_not_an_actor(assets, tmp_path, ranks):  # noqa: F811
    """Split placement with the actor's pool listed second: the KL coefficient (adaptive), the guard rails' raised
    reward threshold and LR back-off live on rank 1, and a resumed run continues with them. With rollout.ranks=all
    rank 0 generates too, on the weights rank 1 broadcasts: the resumed run syncs them again and draws from rank 0's
    restored sampling stream."""
    sections = dict(
        rollout={"ranks": ranks},
        placement={"mode": "split", "pools": [{"name": "judge", "size": 1, "roles": ["reference", "reward"]},
                                              {"name": "policy", "size": 1, "roles": ["actor"]}]},
        algorithm={"adv_estimator": "grpo", "guard": {"kl_limit": 1e-9, "var_limit": 1e-9},
                   "kl": {"in_reward": True, "controller": "adaptive", "target": 1e-6, "horizon": 100}})
    # eval every step: the final eval of the 2-step run then draws from the random streams as the 3-step run's does
    whole = write_config(tmp_path / "whole.yaml", assets, tmp_path / "whole", run={"total_steps": 3, "eval_every": 1},
                         **sections)
    proc = torchrun(["train_ppo.py", "--config", whole], nproc=2)
    assert proc.returncode == 0, explain(proc)
    reference = comparable(read_metrics(tmp_path / "whole"))
    for total in (2, 3):
        cfg = config(tmp_path, assets, f"part{total}", run={"total_steps": total, "eval_every": 1}, **sections)
        proc = torchrun(["train_ppo.py", "--config", cfg], nproc=2)
        assert proc.returncode == 0, explain(proc)
    rows = comparable(read_metrics(tmp_path / "runs"))
    assert reference[3]["actor/kl_coef"] != reference[1]["actor/kl_coef"], "the controller must have moved"
    assert reference[3]["guard/min_reward"] > 0 and reference[3]["guard/lr_scale"] < 1, reference[3]
    assert rows[3] == reference[3]


def test_sigterm_saves_and_exits_zero_then_resume_finishes(assets, tmp_path):  # noqa: F811
    cfg = config(tmp_path, assets, "c", run={"total_steps": 200})
    proc = start_run_and_wait(cfg, tmp_path / "runs" / "t" / "metrics.jsonl", lines=3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-4000:]
    last = read_metrics(tmp_path / "runs")[-1]["step"]
    assert 2 <= last < 200 and ckpts(tmp_path) == ["latest", f"step_{last:08d}"], (last, ckpts(tmp_path))
    done = config(tmp_path, assets, "d", run={"total_steps": last + 2})
    proc = run_python(["train_ppo.py", "--config", done])
    assert proc.returncode == 0, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == list(range(last + 3))


def test_sigkill_under_torchrun_restarts_and_resumes_then_resumes_on_one_rank(assets, tmp_path):  # noqa: F811
    cfg = config(tmp_path, assets, "e", run={"total_steps": 8}, checkpoint={"save_every": 2})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "train_ppo.py", "--config", cfg]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = tmp_path / "runs" / "t" / "checkpoints" / "latest"
    metrics = tmp_path / "runs" / "t" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (latest.exists() and len(metrics.read_text().splitlines()) >= 4):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(agent.pid), "-f", "train_ppo.py"], capture_output=True,
                             text=True).stdout.split()
    assert len(workers) == 2, workers
    subprocess.run(["kill", "-9", workers[1]], check=True)
    out, err = agent.communicate(timeout=400)
    assert agent.returncode == 0, err[-6000:]
    assert "resumed from" in err, err[-6000:]
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == list(range(9)), "every step exactly once"

    # the same run, continued on 1 rank: DCP reshards the 2-rank checkpoint
    more = config(tmp_path, assets, "f", run={"total_steps": 10})
    proc = torchrun(["train_ppo.py", "--config", more], nproc=1, timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "written by 2 ranks, this run has 1" in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == list(range(11))


def test_export_round_trip_generates_what_the_trainer_generated(assets, tmp_path):  # noqa: F811
    cfg = config(tmp_path, assets, "g", run={"total_steps": 2})
    proc = run_python(["train_ppo.py", "--config", cfg])
    assert proc.returncode == 0, explain(proc)
    out = tmp_path / "exported"
    proc = run_python(["scripts/export_hf.py", str(tmp_path / "runs" / "t" / "checkpoints" / "latest"),
                       "--out", str(out)])
    assert proc.returncode == 0, explain(proc)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    final_eval = json.loads((tmp_path / "runs" / "t" / "eval_samples.jsonl").read_text().splitlines()[-1])
    assert final_eval["step"] == 2
    for sample in final_eval["samples"]:
        ids = torch.tensor([tokenizer(sample["prompt"])["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
        assert text == sample["response"], (sample, text)


def test_export_rejects_what_is_not_a_checkpoint(tmp_path):
    proc = run_python(["scripts/export_hf.py", str(tmp_path), "--out", str(tmp_path / "o")])
    assert proc.returncode == 2 and "not a complete meshrl checkpoint" in proc.stderr




def test_a_checkpoint_damaged_inside_its_files_is_skipped(assets, tmp_path):  # noqa: F811
    """Bytes overwritten in the middle of a shard keep its size, so DCP would load them (the optimizer state once
    came back as 3.4e38): the save-time checksums catch it and the resume takes the checkpoint before."""
    first = config(tmp_path, assets, "a", run={"total_steps": 2}, checkpoint={"save_every": 1, "keep_last": 2})
    proc = run_python(["train_ppo.py", "--config", first])
    assert proc.returncode == 0, explain(proc)
    step2 = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    sums = json.loads((step2 / "checksums.json").read_text())
    assert {"trainer.pt", "rank_00000.pt"} <= set(sums) and any(k.startswith("actor/") for k in sums)
    shard = max((step2 / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4000] = b"\xff" * 4000
    shard.write_bytes(bytes(data))
    second = config(tmp_path, assets, "b", run={"total_steps": 3}, checkpoint={"save_every": 1, "keep_last": 2})
    proc = run_python(["train_ppo.py", "--config", second])
    assert proc.returncode == 0, explain(proc)
    assert "does not match its checksum" in proc.stderr and "step_00000001 (step 1)" in proc.stderr, explain(proc)
    assert [r["step"] for r in read_metrics(tmp_path / "runs")] == [0, 1, 2, 3]


FIRST_SAVE_ON_A_FULL_DISK = """
import resource, signal, sys
import torch
import torch.distributed as dist
import checkpoint
# writes past 64 KiB per file fail with EFBIG, as they would with ENOSPC on a full disk
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
model.bias.requires_grad_(False)  # frozen: not written
opt = torch.optim.AdamW([model.weight])
model(torch.randn(2, 256)).sum().backward()
opt.step()
try:
    checkpoint.save(sys.argv[1], 1, {"actor": (model, opt, None)}, {}, {}, keep_last=1)
except checkpoint.SaveError as e:
    print(e)
"""


def test_a_first_save_that_fails_says_what_it_needed(tmp_path):
    """With no earlier checkpoint to measure, a failed save's message gives the size of the tensors it was writing:
    the trained weight (256 x 256 float32), AdamW's two moments of it and its step count (one float32 scalar)."""
    proc = subprocess.run([sys.executable, "-c", FIRST_SAVE_ON_A_FULL_DISK, str(tmp_path / "ckpts"),
                           str(tmp_path / "store")], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, explain(proc)
    expected = 3 * 256 * 256 * 4 + 4
    assert "checkpoint step_00000001 could not be written" in proc.stdout, explain(proc)
    assert f"up to ~{expected / 2**10:.1f} KiB (this save's tensors over every rank" in proc.stdout, explain(proc)
    assert not (tmp_path / "ckpts" / "step_00000001.tmp").exists() and \
        not (tmp_path / "ckpts" / "step_00000001").exists()

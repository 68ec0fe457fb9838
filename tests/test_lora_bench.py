"""bench/lora_step.py's plumbing on CPU, without TRL or vLLM: the systems' overrides and TRL arguments, the report."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lora_step():
    spec = importlib.util.spec_from_file_location("lora_step", ROOT / "bench" / "lora_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_systems_overrides_and_trl_arguments():
    """meshrl-lora-vllm is meshrl-lora plus the vLLM engine at VLLM_SHARE; an override given after -- wins. TRL's two
    LoRA systems differ only in use_vllm; the fixed shape's 64 samples in one micro-batch, vLLM at the same share."""
    ls = lora_step()
    lora = ls.meshrl_overrides("meshrl-lora", 16, ["actor.micro_batch_tokens=8192"])
    assert lora == ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.micro_batch_tokens=8192"]
    assert ls.meshrl_overrides("meshrl-lora-vllm", 16, ["actor.micro_batch_tokens=8192"]) == \
        ["actor.lora.rank=16", "actor.lora.alpha=32", "rollout.engine=vllm",
         f"rollout.gpu_memory_utilization={ls.VLLM_SHARE}", "actor.micro_batch_tokens=8192"]
    assert ls.meshrl_overrides("meshrl-full", 16, []) == [f"actor.micro_batch_tokens={ls.STEP_TOKENS}"]
    assert ls.STEP_TOKENS == 64 * 384
    hf, vllm = ls.trl_args(False), ls.trl_args(True)
    assert {k for k in hf if hf[k] != vllm[k]} == {"use_vllm"}
    assert (vllm["vllm_mode"], vllm["vllm_gpu_memory_utilization"], vllm["vllm_enable_sleep_mode"]) == \
        ("colocate", ls.VLLM_SHARE, False)
    assert (vllm["per_device_train_batch_size"], vllm["gradient_accumulation_steps"], vllm["num_generations"],
            vllm["max_completion_length"], vllm["beta"]) == (64, 1, 8, 256, 0.0)


def test_report_ratios_against_meshrl_lora_and_skipped_rows(capsys):
    ls = lora_step()
    row = dict(model="m", params=1, start_s=10.0, memory_gb=50.0)
    results = [dict(row, system="meshrl-lora", steps=[30.0, 3.0, 3.0, 2.0, 2.0], update_actor=[1.0] * 5),
               dict(row, system="meshrl-lora-vllm", steps=[9.0, 4.0, 4.0, 4.0, 4.0], gpu_memory_used_gb=90.0),
               dict(row, system="trl-vllm-lora", steps=[9.0, 9.0, 9.0, 8.0, 8.0]),
               dict(model="m", system="trl-lora", skipped=ls.CPU_SKIP)]
    ls.report(results)
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].count("|")
    assert all(line.count("|") == head for line in lines), lines
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]
    cells = {r[1]: r for r in rows}
    assert cells["meshrl-lora"][-3:] == ["1.00x", "4.00x", "-"]
    assert cells["meshrl-lora-vllm"][-3:] == ["0.50x", "2.00x", "-"]
    assert cells["meshrl-lora-vllm"][10] == "90.0"
    assert cells["trl-vllm-lora"][-3:] == ["0.25x", "1.00x", "-"]
    assert "skipped: vLLM runs on GPUs only" in cells["trl-lora"][3]


def test_trl_run_cut_at_its_timeout_keeps_the_steps_it_ended(tmp_path, capsys):
    """A TRL run stopped at --trl-timeout: the steps its worker wrote as they ended become its result when more than
    the warm-up ended (steady over the rest, the cut named in the report's row), else an error naming the count."""
    ls = lora_step()
    log = tmp_path / "trl.json.steps"
    log.write_text("40.0\n9.0\n8.0\n7.0\n6.0\n")
    r = ls.ps.cut_short(log, 300.0, 8, 3)
    assert r["steps"] == [40.0, 9.0, 8.0, 7.0, 6.0] and r["warmup"] == 3
    assert r["cut"] == "stopped at 300 s after 5 of 8 steps"
    assert ls.ps.steady(r["steps"], r["warmup"]) == 6.5
    ls.report([dict(r, model="m", params=1, system="trl-vllm-lora")])
    row = capsys.readouterr().out.splitlines()[-1]
    assert "(stopped at 300 s after 5 of 8 steps)" in row and "| 6.500 |" in row
    log.write_text("40.0\n9.0\n")
    assert ls.ps.cut_short(log, 300.0, 8, 3) == \
        {"error": "timed out: stopped at 300 s after 2 of 8 steps: [40.0, 9.0] s"}
    log.unlink()
    assert "after 0 of 8 steps" in ls.ps.cut_short(log, 300.0, 8, 1)["error"]


def test_a_timed_out_run_takes_its_whole_process_group_with_it(tmp_path):
    """bench's run_group: past its timeout the command and what it started (a TRL worker's vLLM processes) are
    killed, not the command alone."""
    import os
    import subprocess
    import time

    import pytest

    ls = lora_step()
    pid_file = tmp_path / "child.pid"
    script = f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w')" \
             ".write(str(p.pid)); time.sleep(60)"
    with pytest.raises(subprocess.TimeoutExpired):
        ls.ps.run_group([sys.executable, "-c", script], 3.0, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered at once; its reaping by init may take a moment
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split(")")[1].split()[0] == "Z":  # a zombie: dead, not yet reaped
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"the command's child {child} outlived the timeout")

"""The benchmark scripts' own plumbing on CPU (their figures need a GPU: bench/RESULTS.md)."""

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import explain, run_python, torchrun

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(tmp_path: Path) -> Path:
    """A 2-layer Qwen2 shape (head_dim 16) as bench scripts take models: a config file."""
    tiny = json.loads((ROOT / "configs" / "models" / "qwen2.5-0.5b.json").read_text())
    tiny.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    model = tmp_path / "tiny_qwen.json"
    model.write_text(json.dumps(tiny))
    return model


def test_ppo_step_runs_meshrl_on_two_ranks_and_again_over_what_a_run_left(tmp_path):
    """bench/ppo_step.py --nproc 2 (the multi-GPU runs' launch: torchrun, the same global batch) on a tiny model, twice
    with the same settings: the second run starts although the first left checkpoints in the run's folder (an
    interrupted call leaves one, and checkpoint.resume=never refuses a folder with one)."""
    model = tiny_model(tmp_path)
    out = tmp_path / "results.json"
    cmd = [sys.executable, "bench/ppo_step.py", "--models", str(model), "--systems", "meshrl", "--lengths", "fixed",
           "--steps", "2", "--device", "cpu", "--nproc", "2", "--workdir", str(tmp_path / "work"), "--json", str(out),
           "checkpoint.save_every=1"]
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        [result] = json.loads(out.read_text())
        assert "error" not in result, result["error"]
        assert result["system"] == "meshrl (2 ranks, checkpoint.save_every=1)"
        assert len(result["steps"]) == 2 and result["response_len"] > 0
        assert len(result["pg_loss"]) == 2 and all(0 < f < 1 for f in result["comm_fraction"])
        assert any((Path(result["run_dir"]) / "checkpoints").iterdir()), "the run left no checkpoint to start over"
        assert "| meshrl (2 ranks, checkpoint.save_every=1) |" in proc.stdout


def test_rollout_bench_runs_one_tp_engine_or_an_engine_per_rank_under_torchrun(tmp_path):
    """bench/rollout.py under torchrun on 2 CPU processes: --layout tp (one engine, the model's projections sharded)
    and --layout dp (an engine per rank on every other prompt) generate the tokens one process does: 16 x 32 in the
    equal run, the drawn lengths' sum in the spread run."""
    args = ["bench/rollout.py", "--models", str(tiny_model(tmp_path)), "--prompts", "16", "--new", "32",
            "--spread", "8", "32", "--hf-prompts", "0", "--kernels", "torch", "--device", "cpu"]

    def token_counts(proc) -> list[int]:
        assert proc.returncode == 0, explain(proc)
        return [int(row.split("|")[4]) for row in proc.stdout.splitlines() if re.match(r"\| \S*tiny_qwen", row)]

    single = token_counts(run_python(args))
    assert single[0] == 16 * 32 and 16 * 8 <= single[1] <= 16 * 32
    for layout in ("tp", "dp"):
        proc = torchrun([*args, "--layout", layout], nproc=2)
        assert token_counts(proc) == single, explain(proc)
        assert f", {layout} 2 |" in proc.stdout
        # the TP engine's ranks hold half of each projection: 2 of the 4 query heads (16 dims each) of 64
        assert ("q_proj (32, 64) of (64, 64) per rank" in proc.stdout) == (layout == "tp"), explain(proc)


def test_attention_kernel_bench_compares_another_kernels_file(tmp_path):
    """bench/attention_kernel.py --device cpu (Triton's interpreter, tiny shapes): a baseline that is this tree's
    kernels.py reads "yes" in the last column, one whose rotary embedding has the wrong sign "NO"."""
    source = (ROOT / "rollout" / "kernels.py").read_text()
    sign = "sign = tl.where(d < ROTARY_DIM // 2, -1.0, 1.0)"
    wrong = source.replace(sign, sign.replace("-1.0", "1.0"))
    assert wrong != source
    for name, text, verdict in (("same.py", source, "yes"), ("wrong.py", wrong, "NO")):
        (tmp_path / name).write_text(text)
        proc = run_python(["bench/attention_kernel.py", "--device", "cpu", "--baseline", str(tmp_path / name)])
        assert proc.returncode == 0, explain(proc)
        [row] = [line for line in proc.stdout.splitlines() if line.startswith("| tiny | 3 |")]
        assert row.endswith(f"| {verdict} |"), row


def test_kernel_sweep_times_each_setting_and_restores_the_defaults(capsys):
    """bench/kernel_sweep.py's sweep on CPU (Triton's interpreter): the defaults' row first, one row per other
    setting, outputs checked against the defaults' ("yes"), a setting Triton cannot build (a tile of 3 tokens: not
    a power of two) reported as failed without stopping the sweep, and the module's constants as they were after."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import kernel_sweep
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import torch

    from rollout import sample_kernels

    before = sample_kernels.BLOCK_V, sample_kernels.SAMPLE_WARPS
    logits = (torch.randn(3, 3000, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    seed, keys, steps = torch.tensor([5], dtype=torch.int32), torch.arange(3), torch.zeros(3, dtype=torch.long)

    def make_call():
        return lambda: sample_kernels.sample_tokens_impl(logits, 1.0, seed, keys, steps, None, None)

    space = {"BLOCK_V": [256, 3, sample_kernels.BLOCK_V], "SAMPLE_WARPS": [sample_kernels.SAMPLE_WARPS]}
    kernel_sweep.sweep(sample_kernels, sample_kernels._sample_chunk, space, make_call,
                       lambda out, want: torch.equal(out[0], want[0]), "tiny", cuda=False)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 3, rows
    assert f"BLOCK_V={sample_kernels.BLOCK_V} SAMPLE_WARPS={sample_kernels.SAMPLE_WARPS} (defaults)" in rows[0]
    assert "BLOCK_V=256" in rows[1] and rows[1].endswith("| yes |"), rows[1]
    assert "BLOCK_V=3" in rows[2] and "| failed:" in rows[2], rows[2]
    assert (sample_kernels.BLOCK_V, sample_kernels.SAMPLE_WARPS) == before


def test_real_model_bench_parses_its_arguments():
    proc = subprocess.run([sys.executable, "bench/real_model.py", "--help"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--unpack" in proc.stdout and "trl-vllm" in proc.stdout, explain(proc)

"""The benchmark scripts' own plumbing on CPU (their figures need a GPU: bench/RESULTS.md)."""

import json
import math
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


def bench_module(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_ppo_step_stop_ids_give_the_truncated_mean_they_are_sized_for():
    """stop_ids(vocab, mean, N): k ids, so that a uniform model stops with p = k / vocab per token; the response
    length is then min(G, N), G geometric on 1, 2, ... (the stop token counted). Simulated, that mean is the closed
    form's, and k is the integer that brings it nearest the wanted mean: ~1000 of 4096 for the long shape at the 1.5B
    vocabulary, ~2% of the responses at the cap."""
    import torch

    ppo_step = bench_module("ppo_step")
    gen = torch.Generator().manual_seed(0)
    for vocab, mean, cap in ((151936, 1000, 4096), (151936, 100, 256), (512, 48, 192)):
        ids = ppo_step.stop_ids(vocab, mean, cap)
        assert len(set(ids)) == len(ids) and min(ids) >= 2 and max(ids) < vocab  # never pad (0) or eos (1)
        p = len(ids) / vocab
        # G = 1 + floor(log U / log(1 - p)) is geometric with success probability p
        draws = 1 + torch.floor(torch.log(torch.rand(400_000, generator=gen, dtype=torch.float64)) / math.log1p(-p))
        lengths = draws.clamp(max=cap)
        simulated, at_cap = float(lengths.mean()), float((draws > cap).double().mean())  # no stop in N
        assert abs(simulated - ppo_step.truncated_mean(p, cap)) < 0.01 * mean, (vocab, mean, simulated)
        assert abs(at_cap - (1 - p) ** cap) < 0.003, (at_cap, (1 - p) ** cap)
        off = [abs(ppo_step.truncated_mean(k / vocab, cap) - mean) for k in (len(ids) - 1, len(ids), len(ids) + 1)]
        assert off[1] <= min(off), (vocab, mean, off)
    long = ppo_step.SHAPES["long"]
    p = len(ppo_step.shape_stop_ids(151936, long)) / 151936
    assert abs(ppo_step.truncated_mean(p, long.new_tokens) - 1000) < 10 and 0.01 < (1 - p) ** 4096 < 0.03
    # the varying shape's set is the one it always had (the default arguments: mean 100 at 256 tokens)
    assert ppo_step.stop_ids(151936) == ppo_step.shape_stop_ids(151936, ppo_step.SHAPES["varying"])


def test_ppo_step_shapes_and_trl_batch_arguments():
    """The shape table: fixed and varying as they were (8 x 8 samples of 128 + 256 tokens), long 32 x 16 of 256 +
    up to 4096, smaller on the CPU; TRL's arguments give one optimizer step over the whole step's samples, generated
    at once (generation_batch_size defaults to per_device_train_batch_size x gradient_accumulation_steps)."""
    ppo_step = bench_module("ppo_step")
    shapes = ppo_step.SHAPES
    assert [(s.prompts, s.samples, s.prompt_len, s.new_tokens, s.mean_len) for s in shapes.values()] == \
        [(8, 8, 128, 256, None), (8, 8, 128, 256, 100), (32, 16, 256, 4096, 1000)]
    assert ppo_step.WHOLE_STEP == shapes["fixed"].whole_step == 64 * 384
    assert ppo_step.shape_of("fixed", "cpu") == shapes["fixed"] and ppo_step.shape_of("long", "cuda") == shapes["long"]
    assert ppo_step.shape_of("long", "cpu").whole_step * 50 < shapes["long"].whole_step
    assert ppo_step.trl_batch_args(shapes["fixed"]) == dict(
        per_device_train_batch_size=64, gradient_accumulation_steps=1, num_generations=8, max_completion_length=256,
        vllm_gpu_memory_utilization=0.3)
    long = ppo_step.trl_batch_args(shapes["long"])
    assert long["per_device_train_batch_size"] * long["gradient_accumulation_steps"] == 512
    assert (long["num_generations"], long["max_completion_length"], long["vllm_max_model_length"]) == (16, 4096, 4352)
    assert long["gradient_checkpointing"]


def test_ppo_step_long_smoke_on_cpu_and_the_partial_report(tmp_path):
    """--lengths long --device cpu: meshrl's run at the scaled-down shape, its per-sample lengths from the saved
    rollouts, TRL's HF-generate row skipped; then --report pairs a --partial run with the bench run before it."""
    out = tmp_path / "results.json"
    proc = run_python(["bench/ppo_step.py", "--models", str(tiny_model(tmp_path)), "--systems", "meshrl", "trl",
                       "--lengths", "long", "--steps", "2", "--device", "cpu", "--save-rollouts", "--workdir",
                       str(tmp_path / "work"), "--json", str(out)], timeout=240)
    assert proc.returncode == 0, explain(proc)
    meshrl, trl = json.loads(out.read_text())
    assert "error" not in meshrl, meshrl["error"]
    cpu_long = bench_module("ppo_step").CPU_SHAPES["long"]
    dist = meshrl["length_dist"]
    assert dist["n"] == 2 * cpu_long.samples_per_step and 1 <= dist["mean"] <= dist["max"] <= cpu_long.new_tokens
    assert 0 <= dist["truncated"] <= 1 and meshrl["warmup"] == 1
    assert "skipped" in trl and "| trl | skipped:" in proc.stdout, proc.stdout
    assert "| samples | mean | p50 | p90 | max | truncated at the cap |" in proc.stdout

    common = dict(model="m", lengths="long", params=1, tokens=1000, response_len=900.0, start_s=1.0, nproc=1,
                  warmup=1, defaults=False)
    results = [dict(common, system="meshrl", steps=[9.0, 4.0, 4.2, 4.1], partial=None),
               dict(common, system="meshrl (partial tail 0.25)", steps=[9.0, 3.0, 3.2, 3.1], partial=0.25)]
    out.write_text(json.dumps(results))
    proc = run_python(["bench/ppo_step.py", "--report", str(out)], timeout=60)
    assert proc.returncode == 0, explain(proc)
    assert ("partial m long: 3.100 s/step (rollout.partial_tail=0.25 rollout.partial_max_staleness=1 "
            "actor.tis_cap=2.0) vs 4.100 s/step without: 0.756x") in proc.stdout, proc.stdout


def test_rollout_bench_partial_stream_counts_the_calls_after_two(tmp_path):
    """bench/rollout.py --partial (rollout/partial.PartialRollouts over a stream of calls with spread lengths): the
    partial row's tokens are the sum of the calls after the first two, as each call's log line gives them."""
    proc = run_python(["bench/rollout.py", "--models", str(tiny_model(tmp_path)), "--prompts", "16", "--new", "32",
                       "--spread", "8", "32", "--hf-prompts", "0", "--kernels", "torch", "--device", "cpu",
                       "--partial", "0.5", "--partial-steps", "5"])
    assert proc.returncode == 0, explain(proc)
    calls = [int(m.group(1)) for m in re.finditer(r"\[partial 0\.5\] call \d: \d+ sequences .*?, (\d+) tokens in",
                                                  proc.stdout)]
    assert len(calls) == 5, explain(proc)
    row = next(r for r in proc.stdout.splitlines() if "+ partial 0.5: 3 calls" in r)
    assert int(row.split("|")[4].replace(",", "")) == sum(calls[2:])

"""The benchmark scripts' own plumbing on CPU (their figures need a GPU: bench/RESULTS.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ppo_step_runs_meshrl_on_two_ranks_and_again_over_what_a_run_left(tmp_path):
    """bench/ppo_step.py --nproc 2 (the multi-GPU runs' launch: torchrun, the same global batch) on a tiny model, twice
    with the same settings: the second run starts although the first left checkpoints in the run's folder (an
    interrupted call leaves one, and checkpoint.resume=never refuses a folder with one)."""
    tiny = json.loads((ROOT / "configs" / "models" / "qwen2.5-0.5b.json").read_text())
    tiny.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    model = tmp_path / "tiny_qwen.json"
    model.write_text(json.dumps(tiny))
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

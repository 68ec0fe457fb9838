"""Tensor parallelism (TP=2, 2 gloo processes) for the families whose layouts need more than parallel/tp.py's
column/row split: OLMo 2 (q/k RMSNorm over the whole projection: the sum of squares all-reduced over the tp group)
and Phi-3 (fused qkv_proj and gate_up_proj: each rank computes its own q, k, v heads and gate, up rows). One torchrun
launch (tests/dist/families_tp.py) checks, for each: logits and every gradient equal the 1-process model's; one PPO
update logs the same metrics as on 1 rank; the native engine's greedy tokens under TP=2 equal HF `generate`'s and its
log-probs the TP=2 trainer's; Phi-3 with LoRA under TP=2 gives 1 rank's log-probs, in the trainer and the engine."""

from __future__ import annotations

from conftest import explain, torchrun


def test_olmo2_and_phi3_under_tensor_parallelism(tmp_path):
    proc = torchrun(["tests/dist/families_tp.py", str(tmp_path)], nproc=2, timeout=300)
    assert proc.returncode == 0, explain(proc)
    for name in ("olmo2", "phi3"):
        for check in (f"PASS {name} TP=2 logits", f"PASS {name} one PPO update", f"PASS {name} native engine"):
            assert check in proc.stdout, explain(proc)
    assert "PASS phi3 LoRA under TP=2" in proc.stdout, explain(proc)

"""OLMo 2 (q/k RMSNorm over the whole projection) and Phi-3 (fused qkv_proj and gate_up_proj) under tensor
parallelism, 2 gloo processes; launched by tests/test_families_tp.py with a scratch folder as argument; prints
'PASS <check>'. For each family, a random-init model from transformers' config class (tests/test_rollout_families.py):

- training (parallel/tp.py): the TP=2 model's logits and every parameter's gradient equal the 1-process model's;
- one PPO update of the actor logs the same metrics under TP=2 as on 1 rank;
- the native engine under TP=2 (rollout/decoder.py reading the split weights): greedy tokens equal HF `generate`'s
  on the unsplit model, and sampled rows' log-probs equal the TP=2 trainer's teacher-forced ones;
- Phi-3 with LoRA on every projection (a fused projection's lora_B split and computed as its base): the TP=2
  trainer's log-probs equal 1 rank's, and the engine decoding the merged weights under TP=2 gives the trainer's."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the tests' own modules, as pytest sees them

from test_rollout_families import MAX_NEW, PAD, PROMPTS, VOCAB, tiny_model  # noqa: E402
from test_rollout_native import hf_greedy, responses  # noqa: E402

import config as C  # noqa: E402
from batch import select  # noqa: E402
from monitor import gather_metrics  # noqa: E402
from parallel.distributed import init_distributed  # noqa: E402
from parallel.layout import build_layout  # noqa: E402
from parallel.tp import apply_tp  # noqa: E402
from ppo.rollouts import rollout_batch  # noqa: E402
from roles.actor import Actor  # noqa: E402
from rollout.api import SamplingParams  # noqa: E402
from tests.dist.report import run_worker, say  # noqa: E402
from tests.dist.same_metrics import RESP, make_batch  # noqa: E402

FAMILIES = ("olmo2", "phi3")
# Float32 with unit roundoff u = 2^-24 ~ 6e-8. TP=2 computes the same sums in another order: the row-parallel
# projections and the norm's sum of squares add two halves' partial sums, the gathered fused weights are the same
# numbers. A reassociated sum of n <= 96 terms (the widest contraction here) moves by at most n * u ~ 6e-6 of the sum
# of its terms' magnitudes, typically sqrt(n) * u ~ 6e-7; the norms rescale each block's input, so the errors of 2-4
# blocks add rather than compound. Logits and gradients: within 1e-5 of each tensor's largest magnitude. A wrong
# split (a rank's norm over its own heads, a fused weight cut in plain halves, a gradient not reduced) moves them
# by 1e-2 and more.
REL = 1e-5


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    gap = float((got - want).abs().max())
    scale = float(want.abs().max())
    assert gap <= REL * scale, f"{what}: differs by {gap:.3e} (largest magnitude {scale:.3e})"
    return gap / max(scale, 1e-30)


def logits_and_gradients(name: str, mesh) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 12), generator=gen)
    targets = torch.randint(0, VOCAB, (3, 12), generator=gen)
    results = []
    for model in (tiny_model(name), apply_tp(tiny_model(name), mesh)):
        logits = model(ids).logits
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 for n, p in model.named_parameters()}
        results.append((logits.detach(), grads))
    (logits, grads), (tp_logits, tp_grads) = results
    worst = same(tp_logits, logits, f"{name} logits")
    split = [n for n, p in apply_tp(tiny_model(name), mesh).named_parameters() if hasattr(p, "device_mesh")]
    assert any("norm" in n for n in split) if name == "olmo2" else any("qkv_proj" in n for n in split), split
    for n, g in grads.items():
        worst = max(worst, same(tp_grads[n], g, f"{name} gradient of {n}"))
    say(f"rank {dist.get_rank()} PASS {name} TP=2 logits and {len(grads)} gradients (worst {worst:.1e} relative)")


def ppo_update(name: str, path: str, solo, tp) -> None:
    cfg = C.load_config(None, ["algorithm.adv_estimator=grpo", "actor.fsdp.param_dtype=float32",
                               "actor.optim.lr=1e-2", "actor.entropy_coef=0.01", "actor.micro_batch_tokens=16",
                               "actor.ppo_epochs=1"])
    full = make_batch(VOCAB)
    full["advantages"] = torch.randn(full["response_mask"].shape, generator=torch.Generator().manual_seed(5)) \
        * full["response_mask"]
    full["returns"] = full["advantages"].clone()

    def update(pool):
        torch.manual_seed(1)
        actor = Actor(path, cfg.actor, pool, torch.device("cpu"), PAD, 10, comm_cfg=cfg.comm, rollout_cfg=cfg.rollout)
        return actor.update(select(full, slice(0, 8)), 1.0, 0.0, max_response_len=RESP, generator=torch.Generator())

    one = gather_metrics(update(solo.pools[0]) if solo.pools[0].has(dist.get_rank()) else {})
    split = gather_metrics(update(tp.pools[0]))
    if dist.get_rank() == 0:
        keys = [k for k in one if not k.endswith("/lr")]
        assert {"actor/pg_loss", "actor/grad_norm", "actor/entropy"} <= set(keys), keys
        for key in keys:
            # the metrics are token means of the pre-step model's log-probs and the gradient's norm: the logits'
            # bound (REL) carried through a softmax and a mean, with an order of magnitude to spare
            assert math.isclose(one[key], split[key], rel_tol=10 * REL, abs_tol=1e-7), \
                f"{name} {key}: 1 rank {one[key]} vs TP=2 {split[key]}"
        say(f"PASS {name} one PPO update, the same {len(keys)} metrics on 1 rank and under TP=2")


def engine(name: str, path: str, tp) -> None:
    cfg = C.load_config(None, ["actor.fsdp.param_dtype=float32"])
    actor = Actor(path, cfg.actor, tp.pools[0], torch.device("cpu"), PAD, 10, comm_cfg=cfg.comm,
                  rollout_cfg=cfg.rollout)
    assert actor.engine.slots is not None and actor.engine.tp_group is not None
    greedy = actor.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0, stop_token_ids=[]))
    reference = tiny_model(name)
    for prompt, response in zip(PROMPTS, responses(greedy)):
        assert response == hf_greedy(reference, prompt, MAX_NEW), f"{name}: TP=2 greedy != HF generate on {prompt}"
    # an episode's next turn continues what its slot holds: the continuing prefill under TP=2 (OLMo 2's norm
    # statistics all-reduced there too) decodes what HF generate does from the whole history
    turn = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[], context_tokens=100)
    histories = [p + r + [5, 6] for p, r in zip(PROMPTS, responses(actor.generate(PROMPTS, turn)))]
    later = actor.generate(histories, dataclasses.replace(turn, max_new_tokens=6, continues=True))
    assert actor.engine.stats["continued"] == len(PROMPTS), actor.engine.stats
    for history, response in zip(histories, responses(later)):
        assert response == hf_greedy(reference, history, 6), f"{name}: TP=2 continued turn != HF generate"
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=1.0, top_k=0, n=2, stop_token_ids=[])
    out = actor.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    batch = rollout_batch(out, list(range(len(out.prompt_ids))), torch.device("cpu"))
    trainer = actor.log_probs(batch, 0.9)
    m = batch["response_mask"].bool()
    gap = float((trainer - batch["rollout_logprobs"]).abs()[m].max())
    # both sides are float32 forwards of the same split weights that differ in summation order (as
    # tests/test_rollout_families.py's 1e-4, derived there)
    assert gap < 1e-4, f"{name}: TP=2 engine vs trainer log-probs differ by {gap}"
    say(f"rank {dist.get_rank()} PASS {name} native engine under TP=2: greedy = HF generate over {MAX_NEW} tokens, "
        f"log-probs = the trainer's (gap {gap:.1e})")


def lora(path: str, solo, tp) -> None:
    cfg = C.load_config(None, ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.fsdp.param_dtype=float32"])
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0, n=2, stop_token_ids=[])

    def actor(pool):
        torch.manual_seed(1)  # lora_A's init, the same on every rank and in both layouts
        a = Actor(path, cfg.actor, pool, torch.device("cpu"), PAD, 10, comm_cfg=cfg.comm, rollout_cfg=cfg.rollout)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # non-zero B matrices (peft starts them at zero: the adapters would change nothing)
            for layer in a.lora.lora_layers():
                w = layer.lora_B["default"].weight
                full = torch.randn(w.shape, generator=gen) * 0.5
                w.copy_(distribute_tensor(full, w.device_mesh, w.placements) if hasattr(w, "device_mesh") else full)
        return a

    split = actor(tp.pools[0])
    out = split.generate(PROMPTS, params, torch.Generator().manual_seed(0))
    batch = rollout_batch(out, list(range(len(out.prompt_ids))), torch.device("cpu"))
    m = batch["response_mask"].bool()
    trainer = split.log_probs(batch, 1.0)
    gap = float((trainer - batch["rollout_logprobs"]).abs()[m].max())
    assert gap < 1e-4, f"phi3 LoRA: TP=2 engine vs trainer log-probs differ by {gap}"  # as in engine()
    one = actor(solo.pools[0]).log_probs(batch, 1.0) if solo.pools[0].has(dist.get_rank()) else trainer
    torch.testing.assert_close(trainer, one, rtol=0, atol=1e-4, msg="phi3 LoRA: TP=2 trainer vs 1 rank")
    say(f"rank {dist.get_rank()} PASS phi3 LoRA under TP=2: engine = trainer (gap {gap:.1e}) = 1 rank's trainer")


def main() -> None:
    folder = sys.argv[1]
    info = init_distributed("gloo", timeout_s=120, device="cpu")
    assert info.world_size == 2, "run with --nproc_per_node 2"
    if info.rank == 0:
        for name in FAMILIES:
            model = tiny_model(name)
            model.config.eos_token_id = None
            model.save_pretrained(f"{folder}/{name}")
    dist.barrier()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    solo = build_layout([C.PoolConfig("solo", 1, ["actor"]), C.PoolConfig("idle", 1, ["reward"])], "cpu")
    tp = build_layout([C.PoolConfig("tp", 2, ["actor"], tp=2)], "cpu")
    for name in FAMILIES:
        logits_and_gradients(name, mesh)
        ppo_update(name, f"{folder}/{name}", solo, tp)
        engine(name, f"{folder}/{name}", tp)
    lora(f"{folder}/phi3", solo, tp)


if __name__ == "__main__":
    run_worker(main)

"""A Plan rendered two ways: the text of --plan (describe) and its JSON (to_json)."""

from __future__ import annotations

from dataclasses import asdict

import yaml

import config as C
from plan.fixes import Fix
from plan.memory import Plan
from plan.models import GiB, _gib, role_models
from plan.suggest import placement_yaml


def _count(n: int) -> str:
    return next(f"{n / 10**e:.3g}{unit}" for e, unit in ((9, "B"), (6, "M"), (3, "K"), (0, "")) if n >= 10**e or not e)


def describe(cfg: C.Config, plan: Plan, fixes: dict[int, list[Fix]], gpu_source: str) -> str:
    models = role_models(cfg)
    lines = [f"plan: world {plan.world}, {plan.gpu / GiB:.1f} GiB per GPU ({gpu_source}), placement "
             f"{cfg.placement.mode}"]
    for role, m in models.items():
        lines.append(f"  {role:<10} " + (f"{m.arch} from {m.path}: {_count(m.numel)} parameters, {m.layers} "
                                         f"layers, hidden {m.hidden}, vocab {m.vocab}" if m else "function rewards"))
    for pp in plan.pools:
        ranks = f"rank {pp.first_rank}" if pp.pool.size == 1 else \
            f"ranks {pp.first_rank}-{pp.first_rank + pp.pool.size - 1}"
        lines += ["", f"pool {pp.name}: {ranks}, roles {', '.join(pp.roles)}; mesh dp_replicate="
                      f"{pp.pool.dp_replicate} dp_shard={pp.dp_shard} tp={pp.pool.tp}; GiB per rank (* = configured)",
                  f"  {'role':<10} {'params':>7} {'grads':>7} {'optim':>7} {'host':>7} {'gather':>7} "
                  f"{'act.fwd':>8} {'act':>8} {'act.ckpt':>9}"]
        for role, p in pp.roles.items():
            if p is None:
                lines.append(f"  {role:<10} function rewards: no model")
                continue
            full = (_gib(p.act_full) + ("" if p.checkpointing else "*")) if p.trained else "-"
            ckpt = (_gib(p.act_ckpt) + ("*" if p.checkpointing else "")) if p.trained else "-"
            grads, optim = (_gib(p.grads), _gib(p.optim)) if p.trained else ("-", "-")
            lines.append(f"  {role:<10} {_gib(p.params):>7} {grads:>7} {optim:>7} {_gib(p.host):>7} "
                         f"{_gib(p.gather_train if p.trained else p.gather_forward):>7} {_gib(p.act_forward):>8} "
                         f"{full:>8} {ckpt:>9}")
        e = pp.engine
        if e is not None and e.kind == "vllm":
            lines.append(f"  rollout (vllm): rollout.gpu_memory_utilization x GPU = {_gib(e.total)}: weights "
                         f"{_gib(e.weights)} + KV cache and activations {_gib(e.kv)}")
        elif e is not None:
            copies = "the engine's copy" if e.frees_gathered else "fused projections"
            total = (f"copy + max(kept cache and graphs' pool + gathered, KV cache + transient) = {_gib(e.total)}"
                     if e.frees_gathered else f"= {_gib(e.total)}")
            lines.append(f"  rollout ({e.kind}): gathered model {_gib(e.weights)}, {copies} {_gib(e.fused)}, "
                         f"transient {_gib(e.work)}, KV cache {_gib(e.kv)} ({e.slots} slots x {e.slot_len} tokens): "
                         f"{total}" + (f"; kept between rollouts {_gib(e.kept)}" if e.kept else ""))
        lines.append("  phases: " + " | ".join(f"{k} {_gib(v)}" for k, v in pp.phases.items()))
        verdict = "fits" if pp.fits(plan.gpu) else "DOES NOT FIT"
        lines.append(f"  peak {_gib(pp.peak)} of {plan.gpu / GiB:.1f} GiB ({pp.peak_phase}): {verdict}"
                     + (f", {_gib(plan.gpu - pp.peak)} GiB to spare" if pp.fits(plan.gpu) else ""))
        if e is not None and e.error:
            lines.append(f"  rollout: {e.error}")
        for fix in fixes.get(pp.index, []):
            lines.append(f"    fix: {fix.text(plan.world)}  -> peak {_gib(fix.peak)}"
                         + (" (everything fits)" if fix.fits else f" (helps; still too big: {', '.join(fix.over)})"))
        if pp.index in fixes and not fixes[pp.index]:
            lines.append("    no key change found that helps: more ranks (--suggest, a larger --world) or larger GPUs")
    return "\n".join(lines)


def to_json(plan: Plan, fixes: dict[int, list[Fix]], placement: C.PlacementConfig | None = None) -> dict:
    """Per-rank totals (ranks[i].peak_bytes, to compare with that rank's torch.cuda.max_memory_allocated) and the
    details behind them: each pool's phases, per-role bytes, the engine, the fixes."""
    pools = []
    ranks = []
    for pp in plan.pools:
        pools.append({
            "name": pp.name, "first_rank": pp.first_rank, "size": pp.pool.size, "roles": list(pp.roles),
            "tp": pp.pool.tp, "dp_replicate": pp.pool.dp_replicate, "dp_shard": pp.dp_shard,
            "peak_bytes": pp.peak, "peak_phase": pp.peak_phase, "fits": pp.fits(plan.gpu), "phases": pp.phases,
            "role_bytes": {r: (asdict(p) | {"act_train": p.act_train}) if p else None for r, p in pp.roles.items()},
            "engine": asdict(pp.engine) if pp.engine else None,
            "fixes": [fix.text(plan.world) for fix in fixes.get(pp.index, [])],
        })
        ranks += [{"rank": pp.first_rank + i, "pool": pp.name, "peak_bytes": pp.peak, "peak_phase": pp.peak_phase}
                  for i in range(pp.pool.size)]
    out = {"world": plan.world, "gpu_memory_bytes": plan.gpu, "fits": plan.fits, "ranks": ranks, "pools": pools}
    if placement is not None:
        out["placement"] = yaml.safe_load(placement_yaml(placement))["placement"]
    return out

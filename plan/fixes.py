"""What would fix a plan that does not fit: single-key changes, each planned on a copy of the config."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import config as C
from plan.make import make_plan, resolved
from plan.memory import Plan, PoolPlan, row_width
from plan.models import TP_DEGREES, check_plan, with_values


def _halvings(value: int, floor: int) -> list[int]:
    out = []
    while value // 2 >= floor:
        value //= 2
        out.append(value)
    return out or [floor]


@dataclass
class Fix:
    overrides: list[tuple[str, object]]
    world: int
    peak: int  # the pool's peak with it
    over: list[str]  # the pool's phases still too big with it
    shortfall: int  # the pool's bytes still missing with it
    fits: bool  # the whole plan fits with it

    def text(self, world: int) -> str:
        keys = " ".join(f"{k}={json.dumps(v)}" for k, v in self.overrides)
        return " ".join(filter(None, [keys, f"--world {self.world}" if self.world != world else ""]))


def _knob_families(cfg: C.Config, world: int, pp: PoolPlan):
    """Alternatives per knob for pool `pp`, mildest first: ([(key, value), ...], world)."""
    where = "placement" if cfg.placement.mode == "colocate" else f"placement.pools[{pp.index}]"
    floor = row_width(cfg)  # one sequence per micro-batch
    tokens_of = {"actor": "actor", "critic": "critic", "reference": "actor", "reward": "actor", "teacher": "actor"}
    for key in dict.fromkeys(f"{tokens_of[r]}.micro_batch_tokens" for r, p in pp.roles.items() if p):
        section = key.split(".")[0]
        fsdp = getattr(cfg, section).fsdp
        if section in pp.roles and not fsdp.activation_checkpointing:
            yield [([(f"{section}.fsdp.activation_checkpointing", True)], world)]
        yield [([(key, t)], world) for t in _halvings(getattr(cfg, section).micro_batch_tokens, floor)]
    for role, p in pp.roles.items():
        if p is not None and not getattr(cfg, role).fsdp.cpu_offload:
            yield [([(f"{role}.fsdp.cpu_offload", True)], world)]
    yield [([(f"{where}.tp", t)], world) for t in TP_DEGREES if t > pp.pool.tp]
    if pp.engine is not None:
        r = cfg.rollout
        grid = [g / 20 for g in range(1, 20)]
        if r.engine == "vllm":
            yield [([("rollout.gpu_memory_utilization", g)], world) for g in reversed(grid)
                   if g < r.gpu_memory_utilization]
        elif r.kv_cache_tokens is None:
            yield [([("rollout.gpu_memory_utilization", g)], world) for g in grid if g > r.gpu_memory_utilization]
        else:
            yield [([("rollout.kv_cache_tokens", t)], world) for t in _halvings(r.kv_cache_tokens, pp.engine.slot_len)]
        yield [([("rollout.max_num_seqs", s)], world) for s in _halvings(r.max_num_seqs, 1)]
        if pp.engine.kept:
            yield [([("rollout.resident", False)], world)]
    if cfg.placement.mode == "colocate":
        yield [([], world * f) for f in (2, 4, 8)]


def _try(cfg: C.Config, plan: Plan, index: int, overrides, world: int) -> Fix | None:
    """Pool `index` of `plan` with the overrides, or None when they do not pass the config checks."""
    candidate = with_values(cfg, overrides)
    try:
        check_plan(candidate, world)
    except C.ConfigError:
        return None
    trial = make_plan(candidate, world, plan.gpu)
    same = trial.pools[index]
    return Fix(list(overrides), world, same.peak, same.over(plan.gpu), same.shortfall(plan.gpu), trial.fits)


def _mildest(cfg: C.Config, plan: Plan, index: int, family, overrides, world: int):
    """The mildest alternative (overrides, world) of `family` that makes the whole plan fit together with these."""
    for own, own_world in family:
        if own_world != plan.world and world != plan.world:
            continue
        fix = _try(cfg, plan, index, overrides + own, max(own_world, world))
        if fix is not None and fix.fits:
            return own, own_world
    return None


def find_fixes(cfg: C.Config, plan: Plan) -> dict[int, list[Fix]]:
    """For each pool that does not fit, per knob: the mildest value that makes the whole plan fit, or else, of the
    values that cut the missing bytes by a tenth at least, the mildest that leaves the fewest phases too big. When
    no knob fits alone, a pair does: each family's strongest helping value, then each made as mild as the other
    allows."""
    out = {}
    cfg = resolved(cfg, plan.world, plan.gpu)  # a fix names its budget in tokens
    for pp in plan.pools:
        if pp.fits(plan.gpu):
            continue
        missing = pp.shortfall(plan.gpu)
        fixes, strongest = [], []
        for family in _knob_families(cfg, plan.world, pp):
            tried = []
            for overrides, world in family:
                fix = _try(cfg, plan, pp.index, overrides, world)
                if fix is not None:
                    tried.append(fix)
                    if fix.fits:
                        break
            helping = [f for f in tried if f.shortfall <= 0.9 * missing]
            if helping:
                fewest = min(len(f.over) for f in helping)
                fixes.append(next(f for f in helping if len(f.over) == fewest))
                strongest.append((min(helping, key=lambda f: f.shortfall), family))
        if not any(f.fits for f in fixes):
            for (a, family_a), (_, family_b) in itertools.combinations(strongest, 2):
                b = _mildest(cfg, plan, pp.index, family_b, a.overrides, a.world)
                a = _mildest(cfg, plan, pp.index, family_a, *b) if b is not None else None
                if a is not None:
                    fixes.insert(0, _try(cfg, plan, pp.index, a[0] + b[0], max(a[1], b[1])))
                    break
        out[pp.index] = sorted(fixes, key=lambda f: not f.fits)
    return out

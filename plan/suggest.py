"""--suggest: a placement for the world: colocate while it fits, else pools sized to the roles' weights."""

from __future__ import annotations

import yaml

import config as C
from plan.make import make_plan, resolved
from plan.memory import pool_plan, role_plan
from plan.models import TP_DEGREES, check_plan, role_models, with_values


def role_weights(cfg: C.Config, models: dict) -> dict[str, float]:
    """Each model role's share of a step: the mean of its share of the memory (its whole training state and
    activations, unsharded) and of the compute (a forward is 2 x parameters flops per token; an update ~3 forwards
    per epoch, 4 with activation checkpointing; the actor adds the old log-probs' forward and the generation, the
    critic the values' forward)."""
    tokens = cfg.data.batch_size * cfg.rollout.n * (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    generated = cfg.data.batch_size * cfg.rollout.n * cfg.rollout.max_new_tokens
    memory, flops = {}, {}
    for role, m in models.items():
        if m is None:
            continue
        p = role_plan(cfg, role, m, 1, 1, 1)
        memory[role] = p.params + p.grads + p.optim + p.host + max(p.act_train, p.act_forward)
        passes = 1.0
        if p.trained:
            passes += (3 + p.checkpointing) * getattr(cfg, role).ppo_epochs
        flops[role] = 2 * m.numel * (passes * tokens + (generated if role == "actor" else 0))
    return {r: 0.5 * memory[r] / sum(memory.values()) + 0.5 * flops[r] / sum(flops.values()) for r in memory}


def _partitions(items: list[str]):
    """Every way to group `items` into non-empty groups (set partitions)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def _valid(cfg: C.Config, world: int) -> bool:
    try:
        check_plan(cfg, world)
    except C.ConfigError:
        return False
    return True


def _pool_tp(cfg: C.Config, models: dict, roles: list[str], size: int, gpu: int) -> int | None:
    """The smallest tp at which a pool of `size` ranks hosting `roles` fits and checks, or None."""
    for tp in TP_DEGREES:
        pool = C.PoolConfig(name=roles[0], size=size, roles=roles, tp=tp)
        alone = with_values(cfg, [("placement", C.PlacementConfig(mode="split", pools=[pool]))])
        try:
            C.check_world(alone, size, ())
        except C.ConfigError:
            continue
        if "actor" in roles and cfg.data.batch_size % (size // tp):
            continue  # check_ppo's rule: every actor dp rank generates for an equal share
        if pool_plan(cfg, models, pool, 0, 0, gpu).fits(gpu):
            return tp
    return None


def _split(cfg: C.Config, world: int, gpu: int, groups: list[list[str]], weights: dict) -> C.PlacementConfig | None:
    """Pools for `groups` (the actor's first): each at least its smallest fitting size, the ranks left given one at
    a time to the pool furthest below its weight's share."""
    models = role_models(cfg)
    sizes, tps = [], []
    for roles in groups:
        smallest = next(((s, tp) for s in range(1, world + 1) if (tp := _pool_tp(cfg, models, roles, s, gpu))), None)
        if smallest is None:
            return None
        sizes.append(smallest[0])
        tps.append(smallest[1])
    if sum(sizes) > world:
        return None
    share = [sum(weights.get(r, 0.0) for r in roles) for roles in groups]
    while sum(sizes) < world:
        grown = None
        for g in sorted(range(len(groups)), key=lambda g: sizes[g] / max(share[g], 1e-9)):
            for extra in range(1, world - sum(sizes) + 1):
                tp = _pool_tp(cfg, models, groups[g], sizes[g] + extra, gpu)
                if tp is not None:
                    grown = (g, extra, tp)
                    break
            if grown:
                break
        if grown is None:
            return None
        g, extra, tps[g] = grown
        sizes[g] += extra
    pools = [C.PoolConfig(name=roles[0], size=s, roles=list(roles), tp=tp) for roles, s, tp in zip(groups, sizes, tps)]
    return C.PlacementConfig(mode="split", pools=pools)


def suggest(cfg: C.Config, world: int, gpu: int) -> C.PlacementConfig | None:
    """A placement for `world` ranks of `gpu` bytes: one colocated pool at the smallest tp that fits; else split
    pools, the fewest that fit, sized in proportion to role_weights (roles without a model ride with the actor).
    None when nothing fits (vLLM runs colocated only). micro_batch_tokens=auto: the budget it picks for the config's
    own placement."""
    cfg = resolved(cfg, world, gpu)
    replicas = cfg.placement.dp_replicate if cfg.placement.mode == "colocate" else 1
    for tp in TP_DEGREES:
        candidate = with_values(cfg, [("placement", C.PlacementConfig(mode="colocate", tp=tp, dp_replicate=replicas))])
        if _valid(candidate, world) and make_plan(candidate, world, gpu).fits:
            return candidate.placement
    if cfg.rollout.engine == "vllm":
        return None
    models = role_models(cfg)
    with_model = [r for r in C.ROLES if r in models and models[r] is not None]
    # function rewards, and the roles this run does not use (so the block passes check_world for every role)
    without = [r for r in C.ROLES if r not in with_model]
    weights = role_weights(cfg, models)
    for groups in sorted(_partitions(with_model), key=len):
        if not 1 < len(groups) <= world:
            continue
        groups = sorted(([*g, *without] if "actor" in g else g for g in groups), key=lambda g: "actor" not in g)
        placement = _split(cfg, world, gpu, groups, weights)
        if placement is None:
            continue
        candidate = with_values(cfg, [("placement", placement)])
        if _valid(candidate, world) and make_plan(candidate, world, gpu).fits:
            return placement
    return None


def placement_yaml(placement: C.PlacementConfig) -> str:
    """The `placement:` block to paste into a config (pools: [] for colocate, so it also replaces a split base)."""
    block = {"mode": placement.mode}
    if placement.mode == "colocate":
        block.update(tp=placement.tp, dp_replicate=placement.dp_replicate, pools=[])
    else:
        block["pools"] = [{"name": p.name, "size": p.size, "roles": p.roles, "tp": p.tp} for p in placement.pools]
    return yaml.safe_dump({"placement": block}, sort_keys=False, default_flow_style=None)

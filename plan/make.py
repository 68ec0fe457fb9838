"""The plan of a config (make_plan), after micro_batch_tokens=auto is sized: the largest budget whose planned
phases fit the GPU's free memory, resolved by train_ppo.py at start-up (resolve_at_start) and shown by --plan."""

from __future__ import annotations

from dataclasses import dataclass

import config as C
from plan.memory import Plan, pool_plan, row_width, sequences_per_rank, world_engines
from plan.models import GiB, _ceil_div, _gib, role_models, with_values


def make_plan(cfg: C.Config, world: int, gpu: int) -> Plan:
    """The plan of a checked config (check_plan) on `world` ranks of `gpu` bytes each (micro_batch_tokens=auto as
    auto_budgets sizes it for `gpu` bytes free)."""
    cfg = resolved(cfg, world, gpu)
    models = role_models(cfg)
    pools, start = [], 0
    engines = world_engines(cfg, world)
    for i, pool in enumerate(C.pools_of(cfg, world)):
        pools.append(pool_plan(cfg, models, pool, i, start, gpu, engines))
        start += pool.size
    return Plan(world, gpu, pools)


AUTO_MARGIN = 10  # percent of the free memory left out of what auto fills, 2 GiB at least: what the plan does not count


AUTO_MARGIN_MIN = 2 * GiB


BUDGET_USERS = {"actor": ("actor", "reference", "reward", "teacher"), "critic": ("critic",)}  # whose forwards use it


def auto_limit(free: int) -> int:
    """The bytes a rank's planned phases may fill on a GPU with `free` bytes free at start-up: less a margin of
    AUTO_MARGIN percent (AUTO_MARGIN_MIN at least) for what the plan does not count (NCCL buffers, allocator
    fragmentation, the batch tensors, compiled kernels' workspaces)."""
    return free - max(free * AUTO_MARGIN // 100, AUTO_MARGIN_MIN)


def largest_budget(limit: int, cost, width: int, max_rows: int) -> int:
    """The auto rule: the largest budget of whole rows, k x width tokens with k in [1, max_rows], whose cost(tokens)
    (bytes, non-decreasing in tokens) is at most `limit`; one row when none is. A bisection over k."""
    if cost(width) > limit:
        return width
    lo, hi = 1, max(max_rows, 1)  # cost(lo x width) fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid * width) <= limit else (lo, mid - 1)
    return lo * width


@dataclass
class PoolBudget:
    """What one pool's ranks allow a budget set to auto: `rows` rows of the widest length (row_width), at most
    `cap` (the most rows one forward of theirs ever holds: more changes nothing); `phase` is the largest phase the
    budget sizes, planned at `peak` bytes with it and at `over` bytes with one row more (None at the cap)."""

    pool: str
    rows: int
    cap: int
    phase: str
    peak: int
    over: int | None
    limit: int

    @property
    def bound(self) -> int | None:
        """The rows this pool holds the budget to, or None when it takes all of its rows (memory does not bind)."""
        return None if self.rows >= self.cap else self.rows


def budget_rows(cfg: C.Config, role: str, pool: C.PoolConfig) -> int:
    """The most rows one forward of `role` on a rank of `pool` holds (role_plan's count): a rank's samples, and for
    the reward its evaluations' too."""
    dp = pool.size // pool.tp
    return sequences_per_rank(cfg, dp) if role == "reward" else _ceil_div(cfg.data.batch_size * cfg.rollout.n, dp)


def pool_budget(cfg: C.Config, models: dict, section: str, pool: C.PoolConfig, index: int, free: int,
                engines: int | None = None) -> PoolBudget | None:
    """The largest `section.micro_batch_tokens` (actor or critic) whose phases fit a rank of `pool` with `free`
    bytes free (auto_limit), by pool_plan; None when no role of the pool uses it."""
    users = [r for r in BUDGET_USERS[section] if r in pool.roles and models.get(r) is not None]
    if not users:
        return None
    width, limit = row_width(cfg), auto_limit(free)
    cap = max(budget_rows(cfg, r, pool) for r in users)
    phases = [f"{r} {kind}" for r in users for kind in ("update", "forward")]
    key = f"{section}.micro_batch_tokens"

    def planned(tokens: int) -> tuple[int, str]:
        pp = pool_plan(with_values(cfg, [(key, tokens)]), models, pool, index, 0, free, engines)
        return max((pp.phases[p], p) for p in phases if p in pp.phases)

    tokens = largest_budget(limit, lambda t: planned(t)[0], width, cap)
    peak, phase = planned(tokens)
    rows = tokens // width
    return PoolBudget(pool.name or f"pool{index}", rows, cap, phase, peak,
                      planned(tokens + width)[0] if rows < cap else None, limit)


def combine(bounds: list[int | None], caps: list[int]) -> int:
    """One budget's rows for the whole run from its pools' (PoolBudget.bound, cap): the fewest rows a pool's memory
    allows, else the most rows any pool's forwards hold."""
    held = [b for b in bounds if b is not None]
    return min(held) if held else max(caps)


def auto_keys(cfg: C.Config) -> list[str]:
    return [s for s in ("actor", "critic") if getattr(cfg, s).micro_batch_tokens == "auto"]


def auto_budgets(cfg: C.Config, world: int, free: int) -> dict[str, tuple[int, list[PoolBudget]]]:
    """{section: (tokens, each pool's PoolBudget)} for the sections whose micro_batch_tokens is auto, every rank with
    `free` bytes free: what train_ppo.py resolves at start-up on GPUs of that free memory (run.device=cpu: the fixed
    config.FIXED_MICRO_BATCH_TOKENS, no pools)."""
    keys = auto_keys(cfg)
    if cfg.run.device == "cpu":
        return {s: (C.FIXED_MICRO_BATCH_TOKENS, []) for s in keys}
    width = row_width(cfg)
    base = with_values(cfg, [(f"{s}.micro_batch_tokens", width) for s in keys])  # the other's value sizes nothing here
    models, engines = role_models(cfg), world_engines(cfg, world)
    out = {}
    for s in keys:
        found = [pool_budget(base, models, s, pool, i, free, engines) for i, pool in enumerate(C.pools_of(cfg, world))]
        found = [b for b in found if b is not None]
        # a budget no role of the run uses: the fixed one (what the run's config.yaml then says)
        out[s] = (combine([b.bound for b in found], [b.cap for b in found]) * width if found else
                  C.FIXED_MICRO_BATCH_TOKENS, found)
    return out


def resolved(cfg: C.Config, world: int, free: int) -> C.Config:
    """`cfg` with every micro_batch_tokens=auto set to auto_budgets' value (a copy; `cfg` itself when none is)."""
    found = auto_budgets(cfg, world, free) if auto_keys(cfg) else {}
    return with_values(cfg, [(f"{s}.micro_batch_tokens", t) for s, (t, _) in found.items()]) if found else cfg


def describe_budget(section: str, tokens: int, pools: list[PoolBudget], width: int, cpu: bool = False) -> str:
    """Why auto picked `tokens` for `section`, in one line, from the pools' PoolBudgets (those known here)."""
    key = f"{section}.micro_batch_tokens=auto -> {tokens}"
    if cpu:
        return f"{key}: the fixed budget on the CPU"
    if not pools:
        return f"{key}: no role of this run on these ranks uses it (the fixed budget)"
    rows = tokens // width
    if any(b.bound == rows for b in pools):
        why = "the most rows that fit"
        if rows == 1 and any(b.bound == 1 and b.peak > b.limit for b in pools):
            why = "one row, and even that does not fit: see the plan's fixes"
    elif rows == max(b.cap for b in pools):
        why = "all of a rank's rows in one forward"
    else:
        why = "as another pool's ranks allow"
    parts = [f"pool {b.pool}: {b.phase} plans {_gib(b.peak)} GiB of {_gib(b.limit)} usable at {_rows(b.rows)}"
             + (f", {_gib(b.over)} at {b.rows + 1}" if b.over is not None else f" (all {b.cap} of its rows)")
             for b in pools]
    return f"{key} ({_rows(rows)} of {width} tokens: {why}; {'; '.join(parts)})"


def _rows(n: int) -> str:
    return f"{n} row" + ("s" if n != 1 else "")


def resolve_at_start(cfg: C.Config, rank: int, world: int, device, free: int | None = None) -> list[str]:
    """train_ppo.py at start-up, before any model is loaded: every micro_batch_tokens=auto set in `cfg` (in place,
    the same value on every rank) and the lines that say why. On the CPU the fixed budget; on a GPU auto_budgets'
    rule for this rank's pool with `free` bytes (default: the GPU's free memory now, what the plan's phases will
    fill), the fewest rows any rank allows (a collective over the world when there is one, on `device`). A run the
    planner cannot model falls back to the fixed budget."""
    import torch
    import torch.distributed as dist

    keys = auto_keys(cfg)
    if not keys:
        return []
    width = row_width(cfg)
    if device.type != "cuda" and free is None:
        for s in keys:
            getattr(cfg, s).micro_batch_tokens = C.FIXED_MICRO_BATCH_TOKENS
        return [describe_budget(s, C.FIXED_MICRO_BATCH_TOKENS, [], width, cpu=True) for s in keys]
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pools, index, first = C.pools_of(cfg, world), 0, 0
    while rank >= first + pools[index].size:
        first += pools[index].size
        index += 1
    base = with_values(cfg, [(f"{s}.micro_batch_tokens", width) for s in keys])
    problem, mine = None, {}
    try:
        models = role_models(cfg)
        for s in keys:
            mine[s] = pool_budget(base, models, s, pools[index], index, free, world_engines(cfg, world))
    except Exception as e:  # noqa: BLE001 - a model or layout the planner does not know: the fixed budget, said why
        problem = f"{type(e).__name__}: {e}"
    big = 1 << 40
    # per key: the fewest rows a rank's memory allows (big: none binds) and, negated, the most rows a rank holds
    wire = torch.tensor([v for s in keys for v in (
        (mine[s].bound or big, -mine[s].cap) if mine.get(s) else (big, 0))] + [float(problem is not None)],
        dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        wire[-1:].neg_()
        dist.all_reduce(wire, op=dist.ReduceOp.MIN)
        wire[-1:].neg_()
    values = wire.tolist()
    lines = []
    for n, s in enumerate(keys):
        bound, cap = int(values[2 * n]), int(-values[2 * n + 1])
        used = bound < big or cap > 0  # some rank's roles use it; else the fixed budget, as on the CPU
        tokens = (bound if bound < big else cap) * width if used and not values[-1] else C.FIXED_MICRO_BATCH_TOKENS
        getattr(cfg, s).micro_batch_tokens = tokens
        if values[-1]:
            lines.append(f"{s}.micro_batch_tokens=auto -> {tokens}: the planner cannot model this run ("
                         f"{problem or 'on another rank'}), so the fixed budget")
        else:
            line = describe_budget(s, tokens, [mine[s]] if mine.get(s) else [], width)
            lines.append(f"{line}; {_gib(free)} GiB free on this GPU at start")
    return lines

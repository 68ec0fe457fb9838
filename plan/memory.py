"""Bytes per rank: each role's weights, gradients, optimizer state and activations on its pool, and the rollout
engine's cache and copies (RolePlan, EnginePlan, PoolPlan, Plan)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace

import config as C
from plan.models import DTYPE_BYTES, LOSS_CHUNK, GiB, ModelShape, _ceil_div


@dataclass
class RolePlan:
    """One role on one rank of its pool, in bytes."""

    trained: bool
    params: int  # on the GPU (0 with cpu_offload: see host)
    grads: int
    optim: int
    host: int  # offloaded parameters, gradients and optimizer state
    gather_train: int
    gather_forward: int
    act_full: int  # an update's activations without activation checkpointing
    act_ckpt: int  # with
    act_forward: int
    checkpointing: bool

    @property
    def act_train(self) -> int:
        return self.act_ckpt if self.checkpointing else self.act_full


def activation_bytes(m: ModelShape, tokens: int, width: int, tp: int, b: int) -> tuple[int, int, int]:
    """(update without checkpointing, update with checkpointing, forward only) for a micro-batch of `tokens` padded
    tokens in rows of `width`; the formulas are in the module docstring."""
    h, i, heads = m.hidden, _ceil_div(m.inter, tp), _ceil_div(m.heads, tp)
    q = heads * m.head_dim
    layer = 2 * (4 + b) * h + 2 * b * h + 4 * b * q + 4 * heads + b * width + 4 * b * i
    in_flight = 2 * b * h + 4 * b * i  # a block's gradients during its backward: in/out, two of MLP width
    head = (4 + 2 * b) * h
    tile = min(tokens, LOSS_CHUNK) * m.vocab * 4
    lm = m.kind == "lm"
    logits = 2 * tokens * m.vocab * b + 3 * tile if lm else 0
    full = tokens * (m.layers * layer + head) + max(logits, tokens * in_flight)
    ckpt = tokens * m.layers * b * h + max(tokens * head + logits, tokens * (layer + in_flight))
    forward = tokens * (layer + 2 * b * h) + (2 * tokens * m.vocab * b + 2 * tile if lm else 0)
    return full, ckpt, forward


def row_width(cfg: C.Config) -> int:
    """The widest micro-batch row: max_prompt_len + the longest response (max_new_tokens, or a multi-turn episode's
    budget) rounded up to 16 (roles/micro_batches.WIDTH_MULTIPLE)."""
    return _ceil_div(cfg.data.max_prompt_len + C.response_budget(cfg), 16) * 16


def micro_batch_tokens(cfg: C.Config, budget: int, rows: int) -> int:
    """Padded tokens of the largest micro-batch roles/micro_batches.micro_batches cuts from `rows` samples: as many rows
    of the widest length as `budget` holds, one at least."""
    return max(1, min(budget // row_width(cfg), rows)) * row_width(cfg)


def lora_settings(lora) -> tuple[int, str | list[str]] | None:
    """(rank, target modules) of config.LoraConfig, read from its init_path's adapter_config.json when it names one
    (that folder's settings apply); None: no LoRA."""
    if lora.init_path:
        path = os.path.join(lora.init_path, "adapter_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                saved = json.load(f)
            return int(saved["r"]), saved["target_modules"]
        return (lora.rank or 8), lora.target_modules  # not on this machine: the config's settings stand in
    return (lora.rank, lora.target_modules) if lora.rank > 0 else None


def lora_shapes(lora, m: ModelShape, value_head: bool) -> tuple[ModelShape, ModelShape] | None:
    """(the adapters, the trained copies of modules_to_save) as parameter lists of `m`'s form; None without LoRA."""
    settings = lora_settings(lora)
    if settings is None:
        return None
    rank, targets = settings
    saved_names = set(lora.modules_to_save) | ({"score", "classifier"} if value_head else set())
    adapters, saved = [], []
    for name, shape, layer, _ in m.params:
        module = name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" -> q_proj
        wanted = (layer is not None and len(shape) == 2) if targets == "all-linear" else module in targets
        if wanted and name.endswith(".weight") and len(shape) == 2:
            adapters += [(f"{name}.lora_A", (rank, shape[1]), layer, None),
                         (f"{name}.lora_B", (shape[0], rank), layer, None)]
        if module in saved_names:
            saved.append((name, shape, layer, None))
    return replace(m, params=adapters), replace(m, params=saved)


def role_plan(cfg: C.Config, role: str, m: ModelShape, tp: int, shard: int, dp: int) -> RolePlan:
    """`role` on one rank of a pool with these tp and dp_shard degrees and dp data-parallel ranks."""
    section = getattr(cfg, role)
    fsdp = section.fsdp
    trained = role in ("actor", "critic")
    budget = section.micro_batch_tokens if trained else cfg.actor.micro_batch_tokens
    if budget == "auto":  # not sized (make_plan sizes it first: resolved): what a role built so uses
        budget = C.FIXED_MICRO_BATCH_TOKENS
    local = _ceil_div(cfg.data.batch_size * cfg.rollout.n, dp)
    minis = _ceil_div(cfg.data.batch_size * cfg.rollout.n, section.mini_batch_size) if trained and \
        section.mini_batch_size else 1
    b, r = DTYPE_BYTES[fsdp.param_dtype], DTYPE_BYTES[fsdp.reduce_dtype]
    params = 4 * m.local_numel(tp, shard)
    grads = params if trained else 0
    optim = 2 * params + 4 * len(m.params) if trained else 0
    root, block = m.local_numel(tp, 1, lambda layer: layer is None), m.block_numel(tp)
    unsharded_grads = (root + block) * (b + (r if r != b else 0))
    lora = lora_shapes(section.lora, m, m.kind == "value") if trained else None
    if lora is not None:  # the frozen base in param_dtype; the adapters and saved copies train in float32
        adapters, saved = lora
        trains = 4 * (adapters.local_numel(tp, shard) + saved.local_numel(tp, shard))
        params = b * m.local_numel(tp, shard) + trains
        grads, optim = trains, 2 * trains + 4 * (len(adapters.params) + len(saved.params))
        unsharded = sum(part.local_numel(tp, 1, lambda layer: layer is None) + part.block_numel(tp) for part in lora)
        unsharded_grads = unsharded * (b + (r if r != b else 0))
    host = 0
    if fsdp.cpu_offload:
        host, params, grads, optim = params + grads + optim, 0, 0, 0
    gathered = m.local_numel(tp, 1) if not fsdp.reshard_after_forward else root + 2 * block
    width = row_width(cfg)
    full, ckpt, _ = activation_bytes(m, micro_batch_tokens(cfg, budget, _ceil_div(local, minis)), width, tp, b)
    rows = sequences_per_rank(cfg, dp) if role == "reward" else local  # the reward also scores evaluations
    forward = activation_bytes(m, micro_batch_tokens(cfg, budget, rows), width, tp, b)[2]
    return RolePlan(trained, params, grads, optim, host, gathered * b + unsharded_grads if trained else 0,
                    gathered * b, full if trained else 0, ckpt if trained else 0, forward,
                    trained and fsdp.activation_checkpointing)


@dataclass
class EnginePlan:
    """The rollout engine on one rank of the actor's pool, in bytes."""

    kind: str  # "native" (slot engine), "native-hf" (the HF-forward loop), "vllm"
    weights: int  # native: the gathered model; vllm: its bf16 copy of the weights
    fused: int
    work: int  # native: the engine's transient bound
    kv: int
    slots: int
    slot_len: int
    error: str | None = None  # why the rollout cannot start
    missing: int = 0  # and the bytes it lacks
    kept: int = 0  # held between rollouts (rollout.resident): the weight buffers, the KV cache, the graphs' pool
    frees_gathered: bool = False  # the gathered model is freed before the decoding (the engine holds a copy)

    @property
    def total(self) -> int:
        if self.frees_gathered:  # the copy, a kept cache and graphs' pool are there when the next rollout gathers
            return self.fused + max(self.kept - self.fused + self.weights, self.kv + self.work)
        return self.weights + self.fused + self.work + self.kv


def sequences_per_rank(cfg: C.Config, dp: int) -> int:
    """The most sequences one actor rank generates in one call: a training batch's share, or an evaluation's
    (data.eval_size=0, the whole eval set, counts as max_num_seqs)."""
    r = cfg.rollout
    seqs = _ceil_div(cfg.data.batch_size, dp) * r.n
    files = len(C.path_list(cfg.data.eval_path))  # data.eval_size prompts from each eval file
    if files:
        seqs = max(seqs, _ceil_div(cfg.data.eval_size * files, dp) * r.eval_n if cfg.data.eval_size else
                   r.max_num_seqs)
    return seqs


def engine_plan(cfg: C.Config, m: ModelShape, pool: C.PoolConfig, resident: int, gpu: int,
                engines: int | None = None) -> EnginePlan:
    """engines: how many engines share the prompts (the actor pool's dp size unless the rollout spans the world);
    a pool without the actor holds a whole copy of its weights (a replica, tp 1) or its vLLM engine."""
    r = cfg.rollout
    tp = pool.tp if "actor" in pool.roles else 1
    # a slot holds a whole episode under multi-turn (its later turns continue the history the slot keeps)
    slot_len = _ceil_div(cfg.data.max_prompt_len + C.response_budget(cfg), 8) * 8
    seqs = sequences_per_rank(cfg, engines or pool.size // tp)
    if r.engine == "vllm":
        share, weights = int(r.gpu_memory_utilization * gpu), 2 * m.local_numel(r.vllm_tp, 1)
        error = None if share > weights else (f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} gives "
                                              f"vLLM {share / GiB:.1f} GiB, less than its weights")
        return EnginePlan("vllm", weights, 0, 0, max(share - weights, 0), 0, slot_len, error, weights - share + 1)
    b = DTYPE_BYTES[cfg.actor.fsdp.param_dtype]
    h, i = m.hidden, _ceil_div(m.inter, tp)
    q, k = _ceil_div(m.heads, tp) * m.head_dim, _ceil_div(m.kv_heads, tp) * m.head_dim
    weights = b * m.local_numel(tp, 1)
    compact = r.compact_forward and m.compact
    fused = 0
    copy = compact and r.resident and "actor" in pool.roles  # FSDP2 unshards into new storage: the engine copies
    if copy:
        fused = weights
    elif compact and r.fused_projections:
        fused_names = r"\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$"
        fused = b * sum(math.prod([_ceil_div(d, tp) if n == 0 else d for n, d in enumerate(shape)])
                        for name, shape, _, _ in m.params if re.search(fused_names, name))
    per_token = 2 * m.layers * k * b
    prefill_tokens = r.max_prefill_tokens if compact else _ceil_div(seqs, r.n) * cfg.data.max_prompt_len
    rows = r.max_num_seqs if compact else seqs
    per_prefill_token = (6 * h + 3 * i + 2 * (q + 2 * k)) * b  # a prefill's activations per prompt token
    graphs_used = compact and r.cuda_graphs and cfg.run.device != "cpu"
    if graphs_used:
        from rollout.slots import PREFILL_GRAPH_TOKENS

        prefill_tokens += PREFILL_GRAPH_TOKENS  # a graphed prefill's activations stay in the pool beside an eager one
    work = prefill_tokens * per_prefill_token + rows * m.vocab * 16
    budget = r.kv_cache_tokens if compact else None
    if compact and budget is None and cfg.run.device != "cpu":
        # the engine's rule: with its own copy, room for the next gathering (or the transients) beside the cache
        held = fused + max(weights, work) if copy else weights + fused + work
        budget = (int(r.gpu_memory_utilization * gpu) - resident - held) // per_token
    slots = min(r.max_num_seqs, seqs) if compact else seqs
    error = None
    if budget is not None:
        slots = min(slots, max(budget, 0) // slot_len)
        if budget < slot_len:
            source = "rollout.kv_cache_tokens" if r.kv_cache_tokens is not None else "rollout.gpu_memory_utilization"
            error = (f"the KV cache budget of {max(budget, 0)} tokens (from {source}) cannot hold one sequence of "
                     f"{slot_len} tokens")
    kv = slots * slot_len * per_token
    kept = 0
    if compact and r.resident:
        # the weight buffers, the cache and the graphs' pool (the decode step's logits and sampling temporaries, as
        # in work, and a graphed prefill's activations: rollout/slots.py). The engine keeps a cache the share did
        # not cut, sized by the call's sequences and the memory free then: a first rollout, before the optimizer's
        # state exists, may keep one that later ones would cut. So a cache sized from the share counts here uncut
        # (an upper bound), kv_cache_tokens' as it is.
        kept_slots = slots if r.kv_cache_tokens is not None else min(r.max_num_seqs, seqs)
        graphs = kept_slots * m.vocab * 16 + PREFILL_GRAPH_TOKENS * per_prefill_token if graphs_used else 0
        kept = fused + kept_slots * slot_len * per_token + graphs
    return EnginePlan("native" if compact else "native-hf", weights, fused, work, kv, slots, slot_len, error,
                      (slot_len - budget) * per_token if error else 0, kept, copy)


@dataclass
class PoolPlan:
    index: int
    name: str
    first_rank: int
    pool: C.PoolConfig
    dp_shard: int
    roles: dict[str, RolePlan | None]  # the needed roles it hosts; None: function rewards only
    engine: EnginePlan | None
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]

    def over(self, gpu: int) -> list[str]:
        """The phases above `gpu` bytes, and "rollout" when the engine cannot start."""
        out = [name for name, n in self.phases.items() if n > gpu]
        if self.engine is not None and self.engine.error and "rollout" not in out:
            out.append("rollout")
        return out

    def shortfall(self, gpu: int) -> int:
        """Bytes missing: each phase's excess over `gpu`, plus what the engine lacks to start."""
        engine = self.engine.missing if self.engine is not None and self.engine.error else 0
        return sum(max(0, n - gpu) for n in self.phases.values()) + engine

    def fits(self, gpu: int) -> bool:
        return not self.over(gpu)


def world_engines(cfg: C.Config, world: int) -> int | None:
    """How many engines generate when the rollout spans the world (rollout/world.py), else None: vLLM's blocks of
    rollout.vllm_tp ranks, or the actor pool's dp ranks plus every rank outside it."""
    if not C.world_rollout(cfg):
        return None
    if cfg.rollout.engine == "vllm":
        return world // cfg.rollout.vllm_tp
    actor = next(p for p in C.pools_of(cfg, world) if "actor" in p.roles)
    return actor.size // actor.tp + world - actor.size


def base_reference(cfg: C.Config) -> bool:
    """Whether the reference, on the actor's pool, is the LoRA actor's base (train_ppo.PPOTrainer's rule)."""
    actor_path = cfg.actor.model_path or cfg.model.path
    return lora_settings(cfg.actor.lora) is not None and cfg.reference.model_path in (None, actor_path)


def pool_plan(cfg: C.Config, models: dict, pool: C.PoolConfig, index: int, first_rank: int, gpu: int,
              engines: int | None = None) -> PoolPlan:
    dp_shard = pool.size // (pool.tp * pool.dp_replicate)
    roles = {r: role_plan(cfg, r, models[r], pool.tp, dp_shard, pool.size // pool.tp) if models[r] else None
             for r in C.ROLES if r in pool.roles and r in models}
    if roles.get("reference") and roles.get("actor") and base_reference(cfg):
        roles["reference"] = replace(roles["reference"], params=0, host=0)  # the actor's own base, adapters off
    resident = sum(p.params + p.optim for p in roles.values() if p)
    generates = "actor" in roles or engines is not None  # engines: the rollout spans the world
    engine = engine_plan(cfg, models["actor"], pool, resident, gpu, engines) if generates else None
    out = PoolPlan(index, pool.name or f"pool{index}", first_rank, pool, dp_shard, roles, engine)
    if engine is not None:
        out.phases["rollout"] = resident + engine.total
        if "actor" not in roles and engine.kind != "vllm":  # a native replica keeps its weights between rollouts
            resident += engine.weights
        resident += engine.kept
    for role, p in roles.items():
        if p is None:
            continue
        if p.trained:
            out.phases[f"{role} update"] = resident + p.grads + p.gather_train + p.act_train
        out.phases[f"{role} forward"] = resident + p.gather_forward + p.act_forward
    if not out.phases:
        out.phases["idle"] = 0
    return out


@dataclass
class Plan:
    world: int
    gpu: int
    pools: list[PoolPlan]

    @property
    def fits(self) -> bool:
        return all(p.fits(self.gpu) for p in self.pools)

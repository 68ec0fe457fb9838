"""The placement and memory planner, a dry run that reads the config and the models' config.json files only (no
weights, no process group):

    python train_ppo.py --config X --plan [--world N] [--gpu-memory GiB] [--suggest] [--json] [key=value ...]

It prints what one rank of each pool holds, per role, and the peak of each rank against the GPU's memory; what does
not fit comes with the config keys that would make it fit, each one tried on a copy of the config. `--suggest`
prints a `placement:` block for the world size. Exit codes: 0 everything fits (with --suggest: a placement was
found), 1 something does not fit (no placement found), 2 a config error. A model path may name an HF folder or a
config.json file itself (configs/models/*.json); the data files need not exist. A quickstart config plans the
tiny model its first run built (model.path's config.json); before that run the planner says so and exits 2.

Bytes per rank (the formulas follow the code that allocates them; GiB = 2**30 bytes):
- parameters: float32 masters for every role (roles/modeling.load_* load float32), each tensor cut by tensor
  parallelism as parallel/tp.LAYER_PLAN does (colwise: dim 0, rowwise: dim 1 of the weight) and then by FSDP2 on
  dim 0 over dp_shard, padded the way FSDP2 pads: ceil(dim0 / dp_shard) rows. dp_replicate holds copies.
- gradients (actor, critic): the sharded parameters' shapes and dtype (FSDP2 reduce-scatters into float32
  shards); freed after each optimizer step (zero_grad(set_to_none=True)), so only the update phases hold them.
- optimizer (roles/modeling.make_optimizer, AdamW): exp_avg and exp_avg_sq like the float32 shards, plus a float32
  `step` per tensor. fsdp.cpu_offload moves parameters, gradients and optimizer state to host memory ("host").
- FSDP2 working set ("gather"): parameters all-gathered in fsdp.param_dtype: the root module's (embeddings, final
  norm, head; FSDP2 keeps the root gathered from forward to backward) and two decoder blocks (the current and the
  prefetched one), or every block with fsdp.reshard_after_forward=false; an update adds the root's and one block's
  unsharded gradients in param_dtype, plus a reduce_dtype copy for the reduce-scatter when the dtypes differ.
- activations of one micro-batch of T padded tokens in rows of W = max_prompt_len + max_new_tokens (rounded up to
  16): T = as many rows as micro_batch_tokens holds (one at least; the reference and reward use the actor's
  budget), at most a rank's rows. With pack_sequences a micro-batch holds at most micro_batch_tokens real tokens
  (any number of shorter rows) and its packed forward adds the padding at the ends of its rows, up to two rows of
  W: within the planner's margin for budgets of many rows, not for a budget of one or two. b bytes per element of
  param_dtype (the compute dtype), h hidden, q = heads x head_dim, i intermediate, H heads (q, i, H divided by tp),
  L layers, V vocabulary. What autograd keeps per decoder
  layer and token (HF Llama/Qwen2, SDPA with a padding mask; rotary embeddings keep nothing per token):
      layer = 2 (4 + b) h   two RMSNorms (the float32 upcast and the normed copy)
            + 2 b h         the inputs of q/k/v and of gate/up
            + 4 b q + 4 H   attention: q, k and v repeated to every head, the output (o_proj reads it in place), and
                            the logsumexp
            + b W           the padding mask as SDPA's additive bias, made per layer
            + 4 b i         MLP: gate, silu, up and their product
  head = (4 + 2 b) h (final norm, head input); a causal LM adds logits = 2 T V b (the logits and their gradient;
  logits_to_keep skips the prompts' positions, counted here anyway: an upper bound) + 3 min(T, 1024) V 4 (the
  loss's float32 tiles, algo/losses); in flight = 2 b h + 4 b i (a block's gradients during its backward).
      no checkpointing:  T (L layer + head) + max(logits, T in flight)
      activation_checkpointing (one checkpoint per block): T L b h (the blocks' inputs) + max(T head + logits,
                         T (layer + in flight)) (the head's backward, or one block recomputed)
      forward only (no_grad: reference, reward, old log-probs, values): T (layer + 2 b h) plus, for a causal LM,
                         2 T V b (the logits and their gathered copy) + 2 min(T, 1024) V 4
  tests/test_plan.py measures an update's peak with torch's CPU memory profiler: plan / measured in [0.95, 1.5].
  micro_batch_tokens: auto (the default, actor and critic): the largest budget of whole rows of W, at most a rank's
  rows, whose phases (the role's update and forward, and the forwards of the roles that use its budget) fit the
  GPU's free memory less 10% (2 GiB at least), the fewest rows any pool allows (auto_budgets; train_ppo.py measures
  the free memory at start-up, before loading any model: resolve_at_start); 8192 on the CPU. The plan shows the
  pick and why, for GPUs of --gpu-memory bytes taken as free; tests/test_micro_budget.py.
- rollout on the actor's pool, native engine (rollout/native.py, rollout/slots.py): the whole model gathered in
  param_dtype, the fused q/k/v and gate/up copies (rollout.fused_projections), the transient bound the engine keeps
  out of the cache (SlotEngine._activation_bytes: max_prefill_tokens (6 h + 3 i + 2 (q + 2 k)) b + max_num_seqs V
  16, k = kv_heads x head_dim / tp), and the KV cache: slots x slot_len x 2 L k b, slot_len = max_prompt_len +
  max_new_tokens rounded up to 8, slots = min(max_num_seqs, a rank's sequences, budget // slot_len), budget =
  rollout.kv_cache_tokens or else what rollout.gpu_memory_utilization x GPU leaves once everything above is
  allocated (the engine's rule; when that is less than one slot the rollout does not fit).
  With rollout.resident the engine keeps its weight buffers, the KV cache and the graphs' pool (the decode steps'
  slots x V x 16, and a graphed prefill's activations: PREFILL_GRAPH_TOKENS (6 h + 3 i + 2 (q + 2 k)) b, also counted
  in the transient) between rollouts, and every other phase holds them too. On the actor's pool (FSDP2) its weight
  buffers are a copy of the whole local model in param_dtype (in the fused copies' place), the gathered model is freed
  before the decoding, and the budget above leaves room for the next rollout's gathering beside the cache: the
  rollout's peak is copy + the larger of (kept cache + graphs' pool + gathered model) and (cache + transient). A
  replica keeps its fused copies, cache and graphs. The engine does not keep a cache that
  rollout.gpu_memory_utilization cuts short, but a first rollout (before the optimizer's state exists) may keep one
  that later ones would cut: a cache sized from the share counts as kept at its uncut size, slots = min(max_num_seqs,
  a rank's sequences).
  vLLM: rollout.gpu_memory_utilization x GPU on top of the training state; it sleeps between rollouts, so the
  other phases count none of it.
- LoRA (actor.lora / critic.lora, roles/lora.py): the frozen base in param_dtype (b bytes an element); the adapters
  (A [rank, in] and B [out, rank] per targeted weight of the blocks, or of the LM head when named) and the trained
  copies of modules_to_save (the critic's value head among them) in float32, with gradients and AdamW state for them
  alone; FSDP2 shards both on dim 0 as above. A reference that is the LoRA actor's base on the actor's pool holds no
  parameters of its own (roles/lora.BaseReference). Activations are counted as without LoRA (the adapters' r-wide
  intermediates are within the margin).
A rank's peak is its largest phase: the resident state (every hosted role's parameters and optimizer state) plus
what the phase adds: `rollout` the engine; `<role> update` gradients, working set and activations; `<role> forward`
working set and forward activations. Not counted (leave a few GiB): the CUDA context, NCCL buffers, allocator
fragmentation, the batch tensors, vLLM's CUDA graphs.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field, replace

import yaml

import config as C

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOSS_CHUNK = 1024  # positions per float32 tile in algo/losses (its chunk_size default)
DEFAULT_GPU_GIB = 80.0
TP_DEGREES = (1, 2, 4, 8)  # tensor parallelism stays inside a node
EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_CONFIG_ERROR = 0, 1, 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------------------
# Models: parameter shapes from a meta-device build of config.json


@dataclass
class ModelShape:
    """One model as the planner sees it: every parameter tensor (tied ones once) and the sizes the formulas use."""

    path: str
    kind: str  # "lm": a causal LM (vocabulary logits); "value": a per-token scalar head (critic, reward model)
    arch: str  # the model class
    params: list[tuple[str, tuple[int, ...], int | None, int | None]]  # name, shape, layer index, tp-split dim
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    compact: bool  # the native engine's compact forward runs it (else its HF-forward loop)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape, _, _ in self.params)

    def local_numel(self, tp: int, shard: int, which=lambda layer: True) -> int:
        """Elements one rank holds of the parameters whose layer index passes `which` (None: the root's)."""
        total = 0
        for _, shape, layer, split in self.params:
            if not which(layer):
                continue
            dims = list(shape)
            if split is not None and tp > 1:
                dims[split] = _ceil_div(dims[split], tp)
            dims[0] = _ceil_div(dims[0], shard)
            total += math.prod(dims)
        return total

    def block_numel(self, tp: int) -> int:
        """The largest decoder block's elements on one tp rank, unsharded."""
        return max(self.local_numel(tp, 1, lambda layer, n=n: layer == n) for n in range(self.layers))


_SHAPES: dict[tuple[str, str], ModelShape] = {}


def _tp_dim(name: str) -> int | None:
    """The dimension parallel/tp.LAYER_PLAN splits this parameter on, or None (replicated over tp)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from parallel.tp import LAYER_PLAN

    m = re.search(r"\.layers\.\d+\.(\w+\.\w+)\.(weight|bias)$", name)
    style = LAYER_PLAN.get(m[1]) if m else None
    if style is ColwiseParallel:
        return 0
    if style is RowwiseParallel and m[2] == "weight":
        return 1
    return None


def model_shape(path: str, kind: str, key: str, trust_remote_code: bool = False) -> ModelShape:
    """Read `path` (an HF folder or a config.json file) and build its model on the meta device: exact parameter
    shapes, no memory. kind "value" builds what roles/modeling.load_value_model loads (a one-label token head)."""
    if (path, kind) in _SHAPES:
        return _SHAPES[(path, kind)]
    if not (os.path.isfile(os.path.join(path, "config.json")) or (path.endswith(".json") and os.path.isfile(path))):
        raise C.ConfigError(f"{key}={path!r}: no config.json there (the planner reads the model's architecture "
                            "from it; a config.json file itself, e.g. configs/models/qwen2.5-1.5b.json, works too)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from parallel.tp import decoder_layers
    from rollout.decoder import unsupported_reason

    arch = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if kind == "value":
        arch.num_labels = 1
    cls = AutoModelForCausalLM if kind == "lm" else AutoModelForTokenClassification
    with torch.device("meta"):
        model = cls.from_config(arch, dtype=torch.float32, trust_remote_code=trust_remote_code)
    try:
        decoder_layers(model)
    except ValueError as e:
        raise C.ConfigError(f"{key}={path!r}: {e}") from None
    sizes = {}
    for field_name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(getattr(arch, field_name, None), int):
            raise C.ConfigError(f"{key}={path!r}: config.json has no integer {field_name} (a Llama/Qwen2-family "
                                "architecture is expected)")
        sizes[field_name] = getattr(arch, field_name)
    heads = sizes["num_attention_heads"]
    params = []
    for name, p in model.named_parameters():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        params.append((name, tuple(p.shape), int(layer[1]) if layer else None, _tp_dim(name)))
    shape = ModelShape(
        path=path, kind=kind, arch=type(model).__name__, params=params, hidden=sizes["hidden_size"],
        inter=sizes["intermediate_size"], heads=heads, kv_heads=getattr(arch, "num_key_value_heads", None) or heads,
        head_dim=getattr(arch, "head_dim", None) or sizes["hidden_size"] // heads,
        layers=sizes["num_hidden_layers"], vocab=sizes["vocab_size"],
        compact=kind == "lm" and unsupported_reason(model) is None)
    _SHAPES[(path, kind)] = shape
    return shape


def role_models(cfg: C.Config) -> dict[str, ModelShape | None]:
    """The model of each role the run needs, from the paths train_ppo.PPOTrainer uses (None: function rewards)."""
    actor_key = "actor.model_path" if cfg.actor.model_path else "model.path"
    actor_path = cfg.actor.model_path or cfg.model.path
    sources = {
        "actor": (actor_path, "lm", actor_key),
        "critic": (cfg.critic.model_path or cfg.model.path, "value",
                   "critic.model_path" if cfg.critic.model_path else "model.path"),
        "reference": (cfg.reference.model_path or actor_path, "lm",
                      "reference.model_path" if cfg.reference.model_path else actor_key),
        "reward": (cfg.reward.model_path, "value", "reward.model_path"),
        "teacher": (cfg.teacher.model_path, "lm", "teacher.model_path"),
    }
    out = {}
    for role in (r for r in C.ROLES if r in C.required_roles(cfg)):
        path, kind, key = sources[role]
        if not path:
            out[role] = None
            continue
        if cfg.quickstart.enabled and not os.path.isfile(os.path.join(path, "config.json")):
            raise C.ConfigError(
                f"quickstart.enabled=true: the tiny model is built at run time into {cfg.quickstart.workdir!r}, and "
                f"{key}={path!r} has no config.json yet; run the config once without --plan to build it, or plan "
                "with model.path set to a folder or config.json file")
        out[role] = model_shape(path, kind, key, cfg.model.trust_remote_code)
        if cfg.quickstart.enabled and (out[role].hidden, out[role].layers) != (cfg.quickstart.hidden_size,
                                                                                cfg.quickstart.num_layers):
            raise C.ConfigError(
                f"quickstart.hidden_size={cfg.quickstart.hidden_size}, quickstart.num_layers="
                f"{cfg.quickstart.num_layers}, but the model built in {path!r} has {out[role].hidden} and "
                f"{out[role].layers}: run the config once without --plan to rebuild it")
    return out


def check_plan(cfg: C.Config, world_size: int) -> None:
    """config.check_ppo for this world size, less its rules about this machine: that the data and model files exist
    (a plan reads no data; role_models reads each model's config.json and names a missing one) and that vLLM or
    wandb is installed (a plan starts nothing; plan a cluster's config on a laptop)."""
    C.check_ppo(cfg, world_size, this_machine=False)
    role_models(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Bytes per rank


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
    """The widest micro-batch row: max_prompt_len + max_new_tokens rounded up to 16 (roles/modeling.WIDTH_MULTIPLE)."""
    return _ceil_div(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, 16) * 16


def micro_batch_tokens(cfg: C.Config, budget: int, rows: int) -> int:
    """Padded tokens of the largest micro-batch roles/modeling.micro_batches cuts from `rows` samples: as many rows
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
    slot_len = _ceil_div(cfg.data.max_prompt_len + r.max_new_tokens, 8) * 8
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


# ---------------------------------------------------------------------------------------------------------------
# micro_batch_tokens: auto, the largest budget whose activations fit the GPU's free memory

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


# ---------------------------------------------------------------------------------------------------------------
# What would fix it: single-key changes, each planned on a copy of the config


def with_values(cfg: C.Config, overrides) -> C.Config:
    """A copy of `cfg` with (dotted key, value) pairs set; `placement.pools[1].tp` indexes a list."""
    cfg = copy.deepcopy(cfg)
    for key, value in overrides:
        *path, last = key.split(".")
        node = cfg
        for part in path:
            name, _, index = part.partition("[")
            node = getattr(node, name)
            if index:
                node = node[int(index[:-1])]
        setattr(node, last, value)
    return cfg


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


# ---------------------------------------------------------------------------------------------------------------
# --suggest: colocate while it fits, else pools sized to the roles


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


# ---------------------------------------------------------------------------------------------------------------
# Output


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


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


def main(argv: list[str], world_env: int = 1, rank: int = 0) -> int:
    """train_ppo.py routes `--plan` here; the rest of argv is the usual --config FILE [key=value ...]."""
    parser = argparse.ArgumentParser(usage="train_ppo.py --config FILE --plan [--world N] [--gpu-memory GiB] "
                                           "[--suggest] [--json] [key=value ...]",
                                     description="The memory and placement planner: bytes per role and per rank, "
                                                 "each rank's peak against the GPU, the config keys that would make "
                                                 "it fit (plan.py's docstring has the formulas).",
                                     epilog="exit codes: 0 fits (--suggest: placement found), 1 does not fit (none "
                                            "found), 2 config error; `train_ppo.py --help` lists the config keys")
    parser.add_argument("--plan", action="store_true", help="plan memory and placement; no weights, no processes")
    parser.add_argument("--world", type=int, metavar="N",
                        help="ranks to plan for (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--gpu-memory", type=float, metavar="GiB",
                        help=f"memory per GPU (default: this machine's GPU, else {DEFAULT_GPU_GIB:g})")
    parser.add_argument("--suggest", action="store_true", help="print a placement: block for the world size")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (per-rank peak_bytes)")
    args, rest = parser.parse_known_args(argv)
    world = args.world if args.world is not None else world_env
    for flag, value in (("--world", world), ("--gpu-memory", args.gpu_memory)):
        if value is not None and not value > 0:
            if rank == 0:
                print(f"config error: {flag} {value}: must be > 0", file=sys.stderr, flush=True)
            return EXIT_CONFIG_ERROR
    cfg = C.parse_or_exit(rest, world, rank, check=check_plan)
    if args.gpu_memory is not None:
        gpu, source = int(args.gpu_memory * GiB), "--gpu-memory"
    else:
        import torch

        if torch.cuda.is_available():
            gpu, source = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
        else:
            gpu, source = int(DEFAULT_GPU_GIB * GiB), "no GPU here: the default; set --gpu-memory"
    placement = None
    if args.suggest:
        placement = suggest(cfg, world, gpu)
        if placement is not None:
            cfg = with_values(cfg, [("placement", placement)])
    # micro_batch_tokens=auto: what the run would pick on GPUs with this much free memory
    budgets = auto_budgets(cfg, world, gpu) if auto_keys(cfg) else {}
    cfg = with_values(cfg, [(f"{s}.micro_batch_tokens", t) for s, (t, _) in budgets.items()])
    plan = make_plan(cfg, world, gpu)
    fixes = find_fixes(cfg, plan)
    code = EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT
    if args.suggest:
        code = EXIT_FITS if placement is not None else EXIT_DOES_NOT_FIT
    if rank != 0:
        return code
    if args.json:
        out = to_json(plan, fixes, placement)
        out["auto_budgets"] = {f"{s}.micro_batch_tokens": {"tokens": t, "pools": [asdict(b) for b in pools]}
                               for s, (t, pools) in budgets.items()}
        print(json.dumps(out, indent=1))
        return code
    print(describe(cfg, plan, fixes, source))
    if budgets:
        print(f"\nmicro-batch budgets set to auto (a GPU of {gpu / GiB:.1f} GiB taken as free at start; the run "
              f"measures its own, less {AUTO_MARGIN}%, {AUTO_MARGIN_MIN / GiB:g} GiB at least):")
        for s, (tokens, pools) in budgets.items():
            print("  " + describe_budget(s, tokens, pools, row_width(cfg), cfg.run.device == "cpu"))
    if args.suggest and placement is None:
        print(f"\nno placement fits {world} ranks of {gpu / GiB:.1f} GiB: the fixes above, a larger --world or "
              "larger GPUs")
    elif args.suggest:
        print(f"\n# suggested for {world} ranks of {gpu / GiB:.1f} GiB: paste into the config\n"
              + placement_yaml(placement), end="")
    return code

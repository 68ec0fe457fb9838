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
- optimizer (roles/update_loop.make_optimizer, AdamW): exp_avg and exp_avg_sq like the float32 shards, plus a float32
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

from plan.cli import (  # noqa: F401
    EXIT_CONFIG_ERROR,
    EXIT_DOES_NOT_FIT,
    EXIT_FITS,
    main,
)
from plan.fixes import (  # noqa: F401
    Fix,
    find_fixes,
)
from plan.make import (  # noqa: F401
    AUTO_MARGIN,
    AUTO_MARGIN_MIN,
    BUDGET_USERS,
    PoolBudget,
    auto_budgets,
    auto_keys,
    auto_limit,
    budget_rows,
    combine,
    describe_budget,
    largest_budget,
    make_plan,
    pool_budget,
    resolve_at_start,
    resolved,
)
from plan.memory import (  # noqa: F401
    EnginePlan,
    Plan,
    PoolPlan,
    RolePlan,
    activation_bytes,
    base_reference,
    engine_plan,
    lora_settings,
    lora_shapes,
    micro_batch_tokens,
    pool_plan,
    role_plan,
    row_width,
    sequences_per_rank,
    world_engines,
)
from plan.models import (  # noqa: F401
    DEFAULT_GPU_GIB,
    DTYPE_BYTES,
    LOSS_CHUNK,
    TP_DEGREES,
    GiB,
    ModelShape,
    check_plan,
    model_shape,
    role_models,
    with_values,
)
from plan.output import (  # noqa: F401
    describe,
    to_json,
)
from plan.suggest import (  # noqa: F401
    placement_yaml,
    role_weights,
    suggest,
)

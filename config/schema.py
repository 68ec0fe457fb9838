"""The run configuration's schema: one dataclass per section, every field typed, with its default and a trailing
comment that `--help` and docs/configuration.md show (config/help.py reads them from this source)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

ROLES = ("actor", "critic", "reference", "reward", "teacher")


DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A user mistake in the configuration: the message names the key, the value and what would be valid."""


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    total_steps: int = 10
    epochs: int | None = None  # when set, overrides total_steps: passes over the training prompts
    log_every: int = 1
    # the console line's metrics (names as in metrics.jsonl); null: the estimator's own (monitor.console_defaults)
    console_keys: list[str] | None = None
    eval_every: int = 0  # 0: evaluate only at the start and the end
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tensorboard: bool = True
    prometheus_port: int | None = None  # rank 0 serves the step metrics at http://HOST:PORT/metrics
    wandb: bool = False  # also log to Weights & Biases (pip install wandb; WANDB_MODE=offline needs no network)
    wandb_project: str = "meshrl"
    wandb_entity: str | None = None  # the W&B team or user; default: your W&B default
    profile_step: int | None = None  # torch.profiler over this step: profile_step<N>_rank<R>.{txt,json} in the run dir
    save_rollouts: bool = False  # each step's samples to runs/NAME/rollouts/step_N.parquet (for data.rollouts_path)
    # GPU: torch.compile's artifacts saved by each rank after its first steps and loaded by the next run before it
    # compiles, Triton's kernel cache kept there too (compile_cache.py): a run on a fresh machine starts warm.
    # auto: output_dir/compile_cache; null: off
    compile_cache: str | None = "auto"

    def __post_init__(self):
        # the run folder is output_dir/name: a name with a separator, '..' or an absolute path would reach another
        # run's folder (and resume it) or a folder outside output_dir
        name = self.name
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ConfigError(f"run.name={name!r}: must be one folder name (no '/', not empty, '.' or '..'); the "
                              "run folder is run.output_dir/run.name, e.g. run.name=gsm8k_lr1e-6")
        if len(name.encode("utf-8", "surrogateescape")) > 255:
            raise ConfigError(f"run.name={name[:40]!r}... is {len(name.encode('utf-8', 'surrogateescape'))} bytes; "
                              "a folder name may have at most 255")
        keys = self.console_keys
        if keys is not None and (not all(isinstance(k, str) and k for k in keys) or len(set(keys)) != len(keys)):
            raise ConfigError(f"run.console_keys={keys!r}: distinct metric names as metrics.jsonl has them, e.g. "
                              "[reward/score/mean, actor/entropy]; null for the estimator's own")
        port = self.prometheus_port
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError(f"run.prometheus_port={port}: must be in [1, 65535] (or null: no endpoint)")


@dataclass
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on GPU, gloo on CPU
    timeout_s: int = 600


@dataclass
class PoolConfig:
    name: str = ""
    size: int = 1  # number of ranks
    roles: list[str] = field(default_factory=list)
    tp: int = 1
    dp_replicate: int = 1  # dp_shard is derived: size / (tp * dp_replicate)


@dataclass
class PlacementConfig:
    mode: Literal["colocate", "split"] = "colocate"
    # colocate: one pool of all ranks hosting every role, with these degrees
    tp: int = 1
    dp_replicate: int = 1
    # split: the pools, in rank order (the first pool takes ranks 0..size-1, and so on)
    pools: list[PoolConfig] = field(default_factory=list)


@dataclass
class FSDPConfig:
    param_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    # torch.compile each decoder block (parallel/fsdp.compile_blocks): GPU only, tp 1 only; the first forwards compile
    compile: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0


@dataclass
class LoraConfig:
    """LoRA adapters through peft (roles/lora.py): off unless rank > 0 or init_path names an adapter folder."""

    rank: int = 0  # 0: the whole model trains
    alpha: float = 16.0  # the adapters' scale is alpha / rank
    dropout: float = 0.0  # on the adapters' input in the update's forward (PPO's ratio then carries its noise)
    # the modules (last name part, e.g. [q_proj, v_proj]) that get adapters, or all-linear: every linear layer of
    # the decoder blocks (never the LM or value head)
    target_modules: str | list[str] = "all-linear"
    modules_to_save: list[str] = field(default_factory=list)  # modules trained in full beside the adapters
    init_path: str | None = None  # a peft adapter folder to start from (its rank, alpha and targets then apply)


@dataclass
class ModelConfig:
    path: str = ""  # an HF folder (config.json + safetensors + tokenizer)
    tokenizer_path: str | None = None  # default: the model path
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    # .jsonl, .parquet or a datasets.save_to_disk folder with a `prompt` column; null (or "") with rollouts_path
    train_path: str | None = ""
    eval_path: str | list[str] | None = None  # one file or a list; with several, each is reported as its own source
    prompt_key: str = "prompt"
    ground_truth_key: str = "ground_truth"
    max_prompt_len: int = 512
    batch_size: int = 8  # prompts per step, over all data-parallel ranks of the actor pool
    eval_size: int = 0  # prompts taken from the start of each eval file; 0: all of them
    shuffle: bool = True
    # null: template chat-message prompts only; true: text prompts too; false: never; a string: a template (Jinja text,
    # or a file holding it: TRL's chat_template_path) used instead of the tokenizer's, for every prompt
    chat_template: bool | str | None = None
    # extra variables for the chat template (TRL's chat_template_kwargs, verl's apply_chat_template_kwargs), e.g.
    # {enable_thinking: false} for Qwen3's
    chat_template_kwargs: dict = field(default_factory=dict)
    system_prompt: str | None = None  # a system message first in every templated prompt that has none
    # offline: train on logged rollouts (files, or a folder such as runs/NAME/rollouts) instead of generating;
    # rows of prompt (or prompt_ids), response (or response_ids), score, optional logprobs and group (tasks/offline.py)
    rollouts_path: str | list[str] | None = None


@dataclass
class RolloutConfig:
    engine: Literal["native", "vllm"] = "native"  # vllm: the embedded vLLM engine (rollout/vllm.py, an extra)
    # which ranks generate (rollout/world.py): actor = the actor pool's; all = every rank of the world, those outside
    # the actor's pool (split placement) on a copy of its weights broadcast before each rollout; auto = all with
    # vLLM (its engines span the world), actor with the native engine
    ranks: Literal["auto", "actor", "all"] = "auto"
    n: int = 1  # samples per prompt (GRPO/RLOO groups)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # the tokenizer's eos is always a stop token
    eval_temperature: float = 0.0  # 0: greedy
    eval_n: int = 1
    # the native engine (rollout/): slots, KV cache, CUDA graphs
    max_num_seqs: int = 256  # sequences decoded at once (KV-cache slots)
    kv_cache_tokens: int | None = None  # None: size the cache from gpu_memory_utilization on GPU
    # share of the GPU this process may hold while generating (training shares it); a cache it cuts short (fewer
    # slots than sequences) lives for one rollout, even with resident
    gpu_memory_utilization: float = 0.5
    max_prefill_tokens: int = 16384
    cuda_graphs: bool = True
    compile: bool = True  # torch.compile the decode step before graph capture (GPU only)
    compact_forward: bool = True  # our own Llama/Qwen2 decode forward (slots, graphs); false: the v1 loop on HF forward
    fused_projections: bool = True  # q/k/v and gate/up as one GEMM each: stacked copies of ~2/3 of the blocks' weights
    # keep the native engine's KV cache, CUDA graphs and weight buffers (the stacked q/k/v and gate/up; under FSDP2 a
    # copy of the whole model) between rollouts: no graph capture after the first rollout of a shape, the memory held
    # through training
    resident: bool = True
    # the decode step's attention and sampling: auto = the Triton kernels (rollout/kernels.py, sample_kernels.py)
    # where they run (CUDA, Triton, head_dim a power of 2), else PyTorch's; triton = the kernels or an error
    decode_kernels: Literal["auto", "triton", "torch"] = "auto"
    # the vLLM engine: ranks per engine (contiguous), what sleeping between rollouts frees (1: the KV cache, weights
    # kept in host memory; 2: both), and the start-up check's bound on the mean |vLLM - actor| log-prob gap
    # (gpu_memory_utilization above is vLLM's share of the GPU)
    vllm_tp: int = 1
    vllm_sleep_level: Literal[1, 2] = 1
    vllm_max_logprob_gap: float = 0.25
    # multi-turn episodes (rollout/episodes.py, tasks/environments.py): an environment, "module.path:factory" or
    # "path/to/file.py:factory" with factory(record) -> env (env.reset(), env.step(text) -> (obs, reward, done)), or
    # tools, ["module.path:function", ...] called from <tool_call> blocks; one or the other
    environment: str | None = None
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  # the model's turns per episode (with an environment or tools)
    # an episode's response, turns and observations; None: max_new_tokens x max_turns
    max_episode_tokens: int | None = None
    episode_reward: Literal["sum", "last"] = "sum"  # the environment's step rewards: their sum, or the last one
    env_workers: int = 2  # processes hosting the environments (or running the tools)
    env_timeout_s: float = 60.0  # one reset or step; past it the worker is killed and its episodes end (reward 0)
    tool_timeout_s: float = 10.0  # one tool call; past it the call's result is an error message
    # partial rollouts (rollout/partial.py; native engine on the actor's ranks, single turns): > 0 ends a step's
    # generation once no sample waits and fewer than this share of the engine's slots still decode; the unfinished
    # samples continue in the next step (re-prefilled under its weights, their tokens' log-probs kept) and their
    # groups train when every sample ended. Needs an importance correction (actor.tis_cap or
    # actor.rollout_correction) for the older policies' tokens
    partial_tail: float = 0.0
    # a sample's tokens span at most this many policy updates: a continued sample this old decodes to its end
    partial_max_staleness: int = 1


KL_KIND = Literal["k1", "k2", "k3", "low_var_kl", "abs"]


@dataclass
class KLConfig:
    # in the reward: GAE / REINFORCE++ token_reward = score at the end - coef * kl_t (Ziegler/InstructGPT);
    # GRPO / RLOO sequence reward = score - coef * sum_t kl_t, before the group baseline
    in_reward: bool = True
    in_loss: bool = False  # GRPO (DeepSeekMath): loss += coef * kl(pi, ref)
    reward_kind: KL_KIND = "k1"  # estimator in the reward: k1 is unbiased for the KL value
    loss_kind: KL_KIND = "low_var_kl"  # estimator in the loss: k2 or k3 / low_var_kl (k1 and abs have no gradient)
    coef: float = 0.05
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float = 0.1  # adaptive: per-token mean KL (nats per response token) the coefficient steers towards
    horizon: int = 10000  # adaptive: in samples


@dataclass
class FilterConfig:
    min_reward: float | None = None  # drop samples scoring below
    filter_ratio: float = 0.0  # drop this fraction of the lowest-scoring samples as noise
    pf_ppo: Literal["off", "pow", "max_min", "max_random"] = "off"
    weight_pow: float = 1.0
    dynamic_sampling: bool = False  # DAPO: drop groups whose samples all score the same
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last N tokens before max_new_tokens
    overlong_penalty: float = 1.0


@dataclass
class ReplayConfig:
    enabled: bool = False
    capacity: int = 10000
    unit: Literal["samples", "tokens"] = "samples"
    quality_threshold: float = 1.0
    mix_fraction: float = 0.1


@dataclass
class GuardConfig:
    kl_limit: float | None = None  # KL above: actor lr x 0.9
    var_limit: float | None = None  # reward variance above: min_reward + 0.1


@dataclass
class DistillConfig:
    # on-policy distillation (teacher.model_path scores the actor's own samples): per-token reward
    # -coef * (log p_actor - log p_teacher), the reverse KL's k1 estimate, added like the KL in the reward
    # (GAE / REINFORCE++ per token; GRPO / RLOO / REINFORCE++-baseline summed over the response). 0: off
    coef: float = 0.0
    task_weight: float = 1.0  # the task reward's weight beside it (0: the teacher's signal alone)


@dataclass
class AlgorithmConfig:
    # reinforce_pp_baseline: REINFORCE++ with a group-mean baseline, whitened over the batch (rollout.n >= 2)
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    norm_by_std: bool = True  # grpo; false: Dr. GRPO
    whiten_advantages: bool = True  # gae
    kl: KLConfig = field(default_factory=KLConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    filters: FilterConfig = field(default_factory=FilterConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling for the engine/trainer mismatch (algo/rollout_correction.py): weights by
    rho = pi_trainer / pi_engine per token or per sequence, truncated at weight_cap; masks of the tokens or sequences
    whose rho (per token, product or geometric mean) leaves [mask_low, mask_high]."""

    weight: Literal["off", "token", "sequence"] = "off"
    weight_cap: float = 2.0
    mask: Literal["off", "token", "sequence", "geometric"] = "off"
    mask_low: float = 0.5
    mask_high: float = 2.0


# micro_batch_tokens=auto on the CPU, and in a role built outside train_ppo.py (which sizes auto on a GPU at start-up)
FIXED_MICRO_BATCH_TOKENS = 8192


def fixed_budget(section):
    """ActorConfig or CriticConfig `section` with micro_batch_tokens=auto as FIXED_MICRO_BATCH_TOKENS (a copy)."""
    if section.micro_batch_tokens != "auto":
        return section
    return dataclasses.replace(section, micro_batch_tokens=FIXED_MICRO_BATCH_TOKENS)


@dataclass
class ActorConfig:
    model_path: str | None = None  # default: model.path
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # samples per optimizer step over all dp ranks; 0: the whole batch
    # padded tokens per forward/backward on one rank (the reference's and the reward's forwards use it too); auto: on a
    # GPU the largest budget whose activations fit the GPU's free memory at start-up, by the planner's model of the
    # run (plan.auto_budgets: the training state, the engine and a 10% margin counted; at most a rank's rows), logged
    # and written to the run's config.yaml; on the CPU 8192 (FIXED_MICRO_BATCH_TOKENS)
    micro_batch_tokens: int | Literal["auto"] = "auto"
    # lay the samples of a micro-batch end to end in shared rows when that saves >= 10% of its padded tokens (Llama /
    # Qwen2; the reference's forwards follow it)
    pack_sequences: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    entropy_coef: float = 0.0
    # the per-token objective (algo/objectives.py): ppo (clipped ratio), gspo / gspo_token (one geometric-mean ratio
    # per sequence; pair with loss_agg seq-mean-token-mean and small clips, e.g. 3e-4 / 4e-4), cispo (clipped,
    # stop-gradient weight times log-prob; clip_low 1 = no lower bound)
    policy_loss: Literal["ppo", "gspo", "gspo_token", "cispo"] = "ppo"
    tis_cap: float | None = None  # shorthand for rollout_correction {weight: token, weight_cap: tis_cap}
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # PPO's old log-probs. auto: when the update is the rollout's only optimizer step (ppo_epochs 1, one mini-batch, no
    # KL term, no replay, not offline), the update's own forward gives them, detached (ratio 1: the same loss and
    # gradient, one forward pass fewer); forward: always a separate forward pass before the update
    old_logprobs: Literal["auto", "forward"] = "auto"


@dataclass
class CriticConfig:
    model_path: str | None = None  # default: model.path (a causal LM backbone; the value head starts fresh)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # the value head trains in full beside the adapters
    ppo_epochs: int = 1
    mini_batch_size: int = 0
    micro_batch_tokens: int | Literal["auto"] = "auto"  # as actor.micro_batch_tokens (the critic's update and values)
    pack_sequences: bool = True  # as actor.pack_sequences
    value_clip: float = 0.2


@dataclass
class ReferenceConfig:
    model_path: str | None = None  # default: the actor's
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (algorithm.distill): any causal LM with the actor's tokenizer, frozen."""

    model_path: str | None = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RewardFunctionConfig:
    spec: str = "gsm8k"  # gsm8k | exact_match | module.path:function
    weight: float = 1.0


@dataclass
class RewardConfig:
    model_path: str | None = None  # an HF sequence-classification reward model; none: function rewards only
    model_weight: float = 1.0
    functions: list[RewardFunctionConfig] = field(default_factory=list)
    num_workers: int = 2
    timeout_s: float = 10.0
    max_error_fraction: float = 0.5  # a step whose share of failed samples (errors, timeouts, NaN) is above: stop
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    pack_sequences: bool = True  # the reward model's forwards, as actor.pack_sequences


@dataclass
class SFTConfig:
    """train_sft.py: supervised fine-tuning on prompt/response pairs (loss on response tokens)."""

    # records (.jsonl, .parquet, a save_to_disk folder or a hub dataset id) in one of TRL's formats: prompt/response
    # (or TRL's prompt/completion: loss on the response), or a conversation in `messages` (loss on assistant turns)
    train_path: str = ""
    eval_path: str | None = None  # held-out records in the same formats; their loss per token is eval/loss
    eval_every: int = 0  # steps; 0: evaluate only at the start and the end
    prompt_key: str = "prompt"
    response_key: str = "response"  # where a row has none, TRL's `completion` column
    messages_key: str = "messages"  # a row with this column and no prompt column is a conversation
    steps: int = 100
    batch_size: int = 16  # pairs per step over all ranks
    lr: float = 1e-5
    warmup_steps: int = 0  # linear from 0, then the schedule (actor.optim's keys)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0  # cosine's floor at sft.steps, as a share of lr
    output_dir: str = "runs/sft_model"


@dataclass
class RMConfig:
    """train_rm.py: a reward model trained on preference pairs (Bradley-Terry loss, chosen over rejected)."""

    train_path: str = ""  # pairs: prompt, chosen, rejected (text or one assistant message), optional margin
    eval_path: str | None = None  # held-out pairs; null: hold out eval_fraction of train_path
    eval_fraction: float = 0.05  # share of the train pairs held out (at random) when eval_path is null; 0: no eval
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str = "margin"  # a number the chosen score must beat the rejected one by; 0 where absent
    steps: int = 100
    batch_size: int = 16  # pairs per step over all data-parallel ranks (also the eval chunk)
    micro_batch_pairs: int = 0  # pairs per forward/backward on one rank (gradient accumulation); 0: its whole share
    lr: float = 1e-5
    warmup_steps: int = 0  # linear from 0, then the schedule
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0  # cosine's floor at rm.steps, as a share of lr
    eval_every: int = 0  # steps; 0: evaluate only at the start and the end
    max_len: int = 1024  # tokens of prompt + response; pairs with a longer side are dropped and counted
    output_dir: str = "runs/rm_model"  # the HF sequence-classification folder reward.model_path can name
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class QuickstartConfig:
    """Build a tiny model, a character tokenizer and the addition task locally, and warm-start it with SFT."""

    enabled: bool = False
    workdir: str = "runs/quickstart_assets"
    digits: list[int] = field(default_factory=lambda: [1, 2])
    n_train: int = 2000
    n_test: int = 200
    hidden_size: int = 64
    num_layers: int = 2
    sft_steps: int = 200
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    sft_fraction: float = 1.0  # SFT on the first part of the train prompts only (a weaker warm start)
    # > 0: also a wider teacher for on-policy distillation (configs/distill_quickstart.yaml) in workdir/teacher, SFT'd
    # for teacher_sft_steps on every train prompt
    teacher_hidden_size: int = 0
    teacher_sft_steps: int = 0
    teacher_sft_lr: float = 1e-3  # a wider model wants a smaller step than the student's sft_lr


@dataclass
class CommConfig:
    """NCCL environment, start-up checks and gradient-communication options (parallel/comm/)."""

    nccl_ib_disable: bool | None = None  # None: leave NCCL_IB_DISABLE as the environment has it
    nccl_socket_ifname: str | None = None
    nccl_ib_hca: str | None = None
    nccl_debug: str | None = None
    extra_env: list[str] = field(default_factory=list)  # more "KEY=VALUE" settings applied before init
    fallback_to_sockets: bool = True  # after an NCCL init failure with IB on, the next restart disables IB
    bandwidth_check: bool = False  # time all-reduces in each pool at start-up (comm/allreduce_busbw_gbps)
    grad_sync_every: int = 1  # micro-batches accumulated between gradient reductions
    compression: Literal["none", "bf16", "fp16", "int8", "topk"] = "none"
    topk_ratio: float = 0.01
    error_feedback: bool = True
    # local SGD across dp_replicate: no gradient all-reduce over replicas, parameters averaged every k optimizer steps,
    # k adapted between averaging_k_min and averaging_k_max from the loss change rate (comm/sync_period)
    param_averaging: bool = False
    averaging_k_min: int = 1
    averaging_k_max: int = 16
    # one-step-stale gradient all-reduce across dp_replicate: step t applies the replicas' average of step t-1's
    # gradients while step t's all-reduce runs during step t+1's forward and backward (comm/staleness)
    stale_allreduce: bool = False

    def __post_init__(self):
        if self.grad_sync_every < 1:
            raise ConfigError(f"comm.grad_sync_every={self.grad_sync_every}: must be >= 1 (1: sync every micro-batch)")
        if not 1 <= self.averaging_k_min <= self.averaging_k_max:
            raise ConfigError(f"comm.averaging_k_min={self.averaging_k_min}, comm.averaging_k_max="
                              f"{self.averaging_k_max}: need 1 <= averaging_k_min <= averaging_k_max")
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"comm.topk_ratio={self.topk_ratio}: must be in (0, 1]")
        if self.stale_allreduce and (self.param_averaging or self.compression != "none"):
            other = "comm.param_averaging=true" if self.param_averaging else f"comm.compression={self.compression}"
            raise ConfigError(f"comm.stale_allreduce=true with {other}: choose one way of joining the replicas "
                              "(stale_allreduce sends float32 gradients every step; set the other to its default)")
        for i, entry in enumerate(self.extra_env):
            name = entry.partition("=")[0].strip()
            if "=" not in entry or not name.replace("_", "a").isalnum() or name[0].isdigit():
                raise ConfigError(f"comm.extra_env[{i}]={entry!r}: expected KEY=VALUE, e.g. NCCL_NET_GDR_LEVEL=PHB")


@dataclass
class HealthConfig:
    """Health thresholds: crossing one logs a warning (again only after going back), sets health/<name> to 1 in the
    metrics while crossed and is counted in summary.json; null turns one off."""

    min_throughput: float | None = None  # perf/throughput (tokens/s per rank) below this: warn
    min_gpu_util: float | None = 0.6  # perf/gpu_util (NVML, mean over the step, 0-1) below this: warn (GPU only)
    max_comm_fraction: float | None = 0.3  # perf/comm_fraction (time in collectives / step time) above: warn
    max_memory_fraction: float | None = 0.8  # perf/memory_fraction (peak reserved / device memory) above: warn
    max_reshard_s: float | None = 10.0  # timing_s/reshard (actor weights into the rollout engine) above: warn
    gpu_sample_s: float = 0.5  # NVML sampling period of perf/gpu_util and perf/gpu_memory_used_gb during the step

    def __post_init__(self):
        for key in ("min_gpu_util", "max_comm_fraction", "max_memory_fraction"):
            if getattr(self, key) is not None and not 0 < getattr(self, key) <= 1:
                raise ConfigError(f"health.{key}={getattr(self, key)}: must be in (0, 1] (or null: off)")
        for key in ("min_throughput", "max_reshard_s", "gpu_sample_s"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ConfigError(f"health.{key}={getattr(self, key)}: must be > 0"
                                  + (" (or null: off)" if key != "gpu_sample_s" else ""))


@dataclass
class CheckpointConfig:
    save_every: int = 0  # steps; 0: only at the end (and on SIGTERM/SIGUSR1)
    save_final: bool = True  # false: no checkpoint when the run ends (a benchmark, a throwaway run); signals still save
    keep_last: int = 2
    resume: str = "auto"  # auto (newest complete checkpoint of the run), never, or a checkpoint folder
    async_save: bool = False  # write in the background while training goes on (finished before the next save)
    max_skipped_steps: int = 5  # non-finite gradient steps in a row before the run stops
    # keys of RESUME_PROTECTED a resume may change anyway (e.g. [model.path] to go on from the weights with a new base)
    allow_config_change: list[str] = field(default_factory=list)


# What a checkpoint means: changing one of these and resuming would silently train something else (another reference
# or base model, another data order, other group sizes). A resume that changes them exits 2 unless
# checkpoint.allow_config_change lists them; every other change is logged.
RESUME_PROTECTED = (
    "model.path", "model.tokenizer_path", "actor.model_path", "critic.model_path", "reference.model_path",
    "teacher.model_path", "reward.model_path", "data.train_path", "data.rollouts_path", "data.prompt_key",
    "data.batch_size", "data.shuffle", "rollout.n", "algorithm.adv_estimator", "quickstart.hidden_size",
    "quickstart.num_layers",
    # the adapters' shapes and scale (a checkpoint holds the adapters alone: another alpha would rescale them silently)
    *(f"{role}.lora.{key}" for role in ("actor", "critic") for key in ("rank", "alpha", "target_modules",
                                                                        "modules_to_save")),
)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    quickstart: QuickstartConfig = field(default_factory=QuickstartConfig)

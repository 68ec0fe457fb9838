"""Run configuration: a typed schema with defaults, YAML files and dotted command-line overrides.

    python train_ppo.py --config configs/quickstart.yaml actor.optim.lr=1e-6 placement.mode=split

Every field has a default. `load_config` checks keys and types; `check_world` checks what depends on the world
size and the model files (pool sizes, tensor-parallel degrees). A mistake raises `ConfigError`, which the entry points
turn into one message and exit code 2 on every rank before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

import yaml

ROLES = ("actor", "critic", "reference", "reward", "teacher")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A user mistake in the configuration: the message names the key, the value and what would be valid."""


# ---------------------------------------------------------------------------------------------------------------
# Schema


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
    # the decode step's attention and sampling: auto = rollout/kernels.py's Triton kernels where they run (CUDA,
    # Triton, head_dim a power of 2), else PyTorch's; triton = the kernels or an error
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


# ---------------------------------------------------------------------------------------------------------------
# Loading: YAML + overrides -> typed dataclasses


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read a YAML file (or nothing: all defaults), apply `a.b.c=value` overrides, and build the typed `Config`."""
    raw = _read_yaml(path) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    return build(Config, raw, "")


def check_given_once(overrides: list[str]) -> None:
    """A command line sets each key once: a key given twice (or a section and a key inside it) is a slip, whichever
    came last would win silently. (load_config itself layers overrides: later ones win.)"""
    given: dict[str, str] = {}  # dotted key -> the override that set it
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        for other, first in given.items():
            if "=" in item and (key == other or key.startswith(other + ".") or other.startswith(key + ".")):
                raise ConfigError(f"overrides {first!r} and {item!r} both set {min(key, other, key=len)}; give it "
                                  "once")
        given[key] = item


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: the key {key!r} is given twice in one "
                                  f"mapping (first on line {seen[key] + 1}); the later would silently override the "
                                  "earlier: keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str, seen: tuple[str, ...] = (), named_by: str | None = None) -> dict:
    """A YAML config; a top-level `base: other.yaml` (relative to this file) is read first and updated by this one.
    named_by: the file whose `base:` names this one (for the messages)."""
    if not os.path.isfile(path):
        if named_by is not None:
            raise ConfigError(f"--config {named_by}: base: file not found: {path!r} (a base path is relative to the "
                              "file that names it)")
        raise ConfigError(f"--config: file not found: {path!r}")
    if os.path.abspath(path) in seen:
        raise ConfigError(f"--config {path}: `base` files include each other: {' -> '.join(seen)}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"--config {path}: line {line}, column {column}: byte 0x{data[e.start]:02x} is not UTF-8 "
                          "text (save the file as UTF-8)") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if raw is None:
        raise ConfigError(f"--config {path}: the file is empty; start from configs/quickstart.yaml (python "
                          "train_ppo.py --help lists every key)")
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_yaml(os.path.join(os.path.dirname(path), base), (*seen, os.path.abspath(path)), named_by=path)
    _deep_update(merged, raw)
    return merged


def _deep_update(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_update(into[k], v)
        else:
            into[k] = v


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. actor.optim.lr=1e-6")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.load(text, Loader=_UniqueKeyLoader) if text.strip() else None
    except ConfigError as e:
        raise ConfigError(f"override {item!r}: {e}") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); e.g. "
                          "'reward.functions=[{spec: gsm8k, weight: 1.0}]', quoted for the shell") from None


# keys that existed once, with what replaced them
RENAMED = {
    "algorithm.kl.kind": "it was split in two: algorithm.kl.reward_kind (the estimator in the reward, default k1) and "
                         "algorithm.kl.loss_kind (in the loss, default low_var_kl)",
    "comm.comm_fraction_warn": "it moved to health.max_comm_fraction (with the other health thresholds)",
    "comm.memory_fraction_warn": "it moved to health.max_memory_fraction (with the other health thresholds)",
}


# TRL's (GRPOConfig, flat names) and verl's (dotted) names for meshrl's keys, suggested when one is given; the same
# table is in the README ("TRL and verl names")
FOREIGN_NAMES = {
    "num_generations": "rollout.n",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_len",
    "beta": "algorithm.kl.coef (with algorithm.kl.in_loss=true algorithm.kl.in_reward=false, as TRL)",
    "learning_rate": "actor.optim.lr",
    "per_device_train_batch_size": "data.batch_size (prompts per step over all ranks, not completions per device)",
    "num_iterations": "actor.ppo_epochs",
    "epsilon": "actor.clip_low",
    "epsilon_high": "actor.clip_high",
    "temperature": "rollout.temperature",
    "max_steps": "run.total_steps",
    "num_train_epochs": "run.epochs",
    "logging_steps": "run.log_every",
    "eval_steps": "run.eval_every",
    "save_steps": "checkpoint.save_every",
    "output_dir": "run.output_dir",
    "seed": "run.seed",
    "warmup_steps": "actor.optim.warmup_steps",
    "max_grad_norm": "actor.optim.grad_clip",
    "lr_scheduler_type": "actor.optim.schedule",
    "scale_rewards": "algorithm.norm_by_std",
    "gradient_checkpointing": "actor.fsdp.activation_checkpointing",
    "reward_funcs": "reward.functions ([{spec: module.path:function, weight: 1.0}])",
    "reward_weights": "reward.functions[i].weight",
    "model_name_or_path": "model.path",
    "use_vllm": "rollout.engine=vllm",
    "data.train_files": "data.train_path",
    "data.val_files": "data.eval_path",
    "data.train_batch_size": "data.batch_size",
    "data.max_prompt_length": "data.max_prompt_len",
    "data.max_response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.mini_batch_size (samples, not prompts)",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl.in_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl.coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl.loss_kind",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coef",
    "actor_rollout_ref.actor.clip_ratio": "actor.clip_low and actor.clip_high",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_high",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg",
    "algorithm.use_kl_in_reward": "algorithm.kl.in_reward",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl.coef",
    "trainer.total_training_steps": "run.total_steps",
    "trainer.total_epochs": "run.epochs",
    "trainer.experiment_name": "run.name",
    "trainer.save_freq": "checkpoint.save_every",
    "trainer.test_freq": "run.eval_every",
    "custom_reward_function.path": "reward.functions ([{spec: module.path:function}])",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "data.apply_chat_template_kwargs": "data.chat_template_kwargs",
    "environment_factory": "rollout.environment (module.path:factory; factory(record) -> env with step(text))",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "rollout.max_turns",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "rollout.tools ([module.path:function, ...])",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "rollout.environment (module.path:factory)",
    # the objectives (README "Objectives: which paper is which key" maps each value)
    "loss_type": "actor.loss_agg (grpo: seq-mean-token-mean; dapo, bnpo: token-mean; dr_grpo: "
                 "seq-mean-token-sum-norm with algorithm.norm_by_std=false; cispo: actor.policy_loss=cispo)",
    "importance_sampling_level": "actor.policy_loss (sequence: gspo; token: ppo)",
    "vllm_importance_sampling_mode": "actor.rollout_correction (weight: token/sequence, mask: token/sequence)",
    "vllm_importance_sampling_cap": "actor.rollout_correction.weight_cap",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss (vanilla: ppo; gspo; cispo)",
    "algorithm.rollout_correction.rollout_is": "actor.rollout_correction.weight",
    "algorithm.rollout_correction.rollout_rs": "actor.rollout_correction.mask",
}


def _foreign_hint(where: str, value) -> str | None:
    """"; TRL's num_generations is rollout.n here" for an unknown key, or for the keys under an unknown section (verl's
    actor_rollout_ref.*), that FOREIGN_NAMES knows. TRL's flat names are looked up under any PPO section too."""
    def leaves(prefix, v):
        return [p for k, w in v.items() for p in leaves(f"{prefix}.{k}", w)] if isinstance(v, dict) else [prefix]

    found = []
    for path in [where, *leaves(where, value)]:
        bare = path.rpartition(".")[2]
        name = path if path in FOREIGN_NAMES else (
            bare if bare in FOREIGN_NAMES and path.partition(".")[0] not in ("sft", "rm") else None)
        if name is not None and name not in found:
            found.append(name)
    return "".join(f"; {'verl' if '.' in name else 'TRL'}'s {name} is {FOREIGN_NAMES[name]} here"
                   for name in found) or None


def build(cls, raw, prefix: str):
    """Build dataclass `cls` from a mapping, checking unknown keys (with a suggestion) and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if where in RENAMED:
            raise ConfigError(f"{where} is no longer a key: {RENAMED[where]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = _foreign_hint(where, value) or (
                f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys here: {', '.join(names)}")
            raise ConfigError(f"unknown key {where!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, where)
    return cls(**kwargs)


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, where + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 2 and typing.get_origin(inner[1]) is list:  # X | list[X]: one value or a list of them
            return _coerce(inner[1] if isinstance(value, list) else inner[0], value, where)
        if inner == [bool, str]:  # a switch, or a text in its place
            if not isinstance(value, (bool, str)):
                raise ConfigError(f"{where}={value!r}: expected true, false, null or a text")
            return value
        if len(inner) == 2 and typing.get_origin(inner[1]) is Literal:  # X | Literal[words]: a value, or a word
            if value in typing.get_args(inner[1]):
                return value
            try:
                return _coerce(inner[0], value, where)
            except ConfigError as e:
                raise ConfigError(f"{e} or {' or '.join(map(repr, typing.get_args(inner[1])))}") from None
        assert len(inner) == 1, f"schema: only Optional[X], X | list[X] and X | Literal unions are supported ({where})"
        return _coerce(inner[0], value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}={value!r}: must be one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r}: expected a list")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
        return value
    if tp is float:
        # YAML reads 1e-6 (no dot) as a string; accept numbers in any spelling
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r}: expected a string")
        return value
    if tp is dict:  # free-form (template variables): string keys, values as YAML gives them
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}={value!r}: expected a mapping of names to values, e.g. {{enable_thinking: "
                              "false}")
        return value
    raise AssertionError(f"schema: unsupported type {tp} at {where}")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Checks that need the world size or the model files


def pools_of(cfg: Config, world_size: int) -> list[PoolConfig]:
    """The pools of the run: one of all ranks for colocate, the configured ones for split."""
    p = cfg.placement
    if p.mode == "colocate":
        if p.pools:
            raise ConfigError("placement.pools is for placement.mode=split; colocate uses placement.tp / dp_replicate")
        return [PoolConfig(name="all", size=world_size, roles=list(ROLES), tp=p.tp, dp_replicate=p.dp_replicate)]
    return p.pools


def check_world(cfg: Config, world_size: int, needed_roles=ROLES) -> None:
    """Check the placement against the world size and the tensor-parallel degrees against the model's heads."""
    pools = pools_of(cfg, world_size)
    if cfg.placement.mode == "split":
        if not pools:
            raise ConfigError("placement.mode=split needs placement.pools: a list of {name, size, roles, tp}")
        total = sum(pool.size for pool in pools)
        if total != world_size:
            sizes = " + ".join(f"{pool.name or i}={pool.size}" for i, pool in enumerate(pools))
            raise ConfigError(
                f"placement.pools: pool sizes add up to {total} ({sizes}) but the world size is {world_size}; "
                f"make them add up to {world_size}"
            )
    seen: dict[str, int] = {}
    for i, pool in enumerate(pools):
        where = f"placement.pools[{i}]" if cfg.placement.mode == "split" else "placement"
        if pool.size < 1:
            raise ConfigError(f"{where}.size={pool.size}: must be >= 1")
        for role in pool.roles:
            if role not in ROLES:
                raise ConfigError(f"{where}.roles: unknown role {role!r}; valid roles: {', '.join(ROLES)}")
            if role in seen:
                raise ConfigError(f"{where}.roles: role {role!r} is already hosted by pool {seen[role]}")
            seen[role] = i
        for axis in ("tp", "dp_replicate"):
            degree = getattr(pool, axis)
            if degree < 1 or pool.size % degree:
                valid = [d for d in range(1, pool.size + 1) if pool.size % d == 0]
                raise ConfigError(f"{where}.{axis}={degree}: must divide the pool size {pool.size}; valid: {valid}")
        if pool.size % (pool.tp * pool.dp_replicate):
            raise ConfigError(
                f"{where}: tp={pool.tp} x dp_replicate={pool.dp_replicate} must divide the pool size {pool.size}"
            )
        if pool.tp > 1:
            _check_tp_heads(cfg, pool.tp, f"{where}.tp")
    missing = [r for r in needed_roles if r not in seen]
    if missing:
        raise ConfigError(f"placement: no pool hosts the role(s) {', '.join(missing)}; add them to a pool's roles")


def check_ppo(cfg: Config, world_size: int, this_machine: bool = True) -> None:
    """Everything train_ppo.py needs to be true before it starts. this_machine=False leaves out what is about the
    machine rather than the config (the data and model files exist, vLLM and wandb are installed): the planner's
    view of a cluster's config on a laptop."""
    check_world(cfg, world_size, required_roles(cfg))
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_pp_baseline") and cfg.rollout.n < 2:
        raise ConfigError(f"rollout.n={cfg.rollout.n}: algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                          "compares the samples of a prompt; set rollout.n >= 2")
    check_ranges(cfg, PPO_RANGES)
    unknown = [k for k in cfg.checkpoint.allow_config_change if k not in RESUME_PROTECTED]
    if unknown:
        raise ConfigError(f"checkpoint.allow_config_change={unknown}: only these keys are guarded on resume (the "
                          f"others may change freely): {', '.join(RESUME_PROTECTED)}")
    kl = cfg.algorithm.kl
    if kl.controller == "adaptive" and kl.coef == 0:
        raise ConfigError("algorithm.kl.controller=adaptive with algorithm.kl.coef=0: the adaptive controller scales "
                          "the coefficient, so it would stay 0; start it above 0 (e.g. 0.05)")
    if kl.loss_kind in ("k1", "abs"):
        raise ConfigError(f"algorithm.kl.loss_kind={kl.loss_kind}: as a loss term this estimator has no useful "
                          "gradient (k1's expected gradient is 0); use low_var_kl (k3, the default) or k2")
    if cfg.algorithm.filters.dynamic_sampling and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.filters.dynamic_sampling=true with rollout.n={cfg.rollout.n}: it drops groups "
                          "whose samples all score the same, i.e. every group of one; set rollout.n >= 2")
    r = cfg.rollout
    truncated = r.top_p < 1 or r.top_k > 0
    corr = cfg.actor.rollout_correction
    correcting = [k for k, on in (("actor.tis_cap", cfg.actor.tis_cap is not None),
                                  ("actor.rollout_correction.weight", corr.weight != "off"),
                                  ("actor.rollout_correction.mask", corr.mask != "off")) if on]
    if correcting and truncated and r.engine == "native" and not cfg.data.rollouts_path:
        raise ConfigError(f"{correcting[0]} with rollout.top_p={r.top_p} / top_k={r.top_k}: importance "
                          "sampling weighs by the probability a token was sampled with, and the native engine "
                          "reports log-probs before the top-k/top-p cut (the weights would ignore it); sample "
                          "with top_p=1 and top_k=0, or use rollout.engine=vllm, whose log-probs are after the cut")
    if cfg.actor.tis_cap is not None and corr.weight != "off":
        raise ConfigError(f"actor.tis_cap={cfg.actor.tis_cap} and actor.rollout_correction.weight={corr.weight}: "
                          "both set importance weights; tis_cap is the short form of weight=token, "
                          "weight_cap=tis_cap. Keep one")
    check_objective(cfg)
    check_episodes(cfg)
    check_lora(cfg, world_size, this_machine)
    if cfg.rollout.engine == "vllm":
        check_vllm(cfg, world_size, this_machine)
    elif cfg.rollout.decode_kernels == "triton":
        check_triton_kernels(cfg, this_machine)
    buffer = cfg.algorithm.filters.overlong_buffer
    if buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.filters.overlong_buffer={buffer}: must be <= rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} (the penalty ramps over the last N tokens of a response)")
    if cfg.algorithm.kl.in_reward and cfg.algorithm.kl.in_loss:
        raise ConfigError("algorithm.kl.in_reward and algorithm.kl.in_loss are both true; choose one")
    _check_positions(cfg, required_roles(cfg))
    if cfg.reward.model_path is None and not cfg.reward.functions and "reward" in required_roles(cfg):
        raise ConfigError("reward: set reward.model_path or reward.functions (e.g. [{spec: gsm8k}])")
    if cfg.run.wandb and this_machine:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("run.wandb=true but wandb is not installed: pip install wandb (or run.wandb=false)")
    actor = next(p for p in pools_of(cfg, world_size) if "actor" in p.roles)
    if world_rollout(cfg) and cfg.comm.param_averaging and actor.dp_replicate > 1:
        raise ConfigError("comm.param_averaging=true with a rollout over the world (rollout.engine=vllm or "
                          "rollout.ranks=all): the actor's replicas hold different weights between averagings, and "
                          "the engines take one copy; use comm.stale_allreduce or compression, or rollout.ranks=actor "
                          "with the native engine")
    dp = actor.size // actor.tp
    if cfg.data.batch_size % dp:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size}: must be a multiple of the actor pool's "
                          f"data-parallel size {dp} (each dp rank generates for an equal share)")
    if this_machine:
        check_run_dir(cfg)
    if not cfg.data.train_path and not path_list(cfg.data.rollouts_path) and not cfg.quickstart.enabled:
        raise ConfigError("data.train_path is not set: name the prompts to train on (a .jsonl, .parquet or datasets "
                          "folder), or logged rollouts in data.rollouts_path to train offline")
    if not cfg.quickstart.enabled and this_machine:
        train = [] if path_list(cfg.data.rollouts_path) else [("data.train_path", cfg.data.train_path)]
        _check_found([*train, ("model.path", cfg.model.path)],
                     [("data.rollouts_path", cfg.data.rollouts_path), ("data.eval_path", cfg.data.eval_path)])


def _check_found(required: list[tuple[str, str | None]], optional: list[tuple[str, str | list[str] | None]] = ()
                 ) -> None:
    """Every required path is set and exists; every path an optional one-or-a-list key names exists (`key[i]` names
    one of several). A path that is not here may be a Hugging Face hub id (tasks/hub.py): a model's (Org/Name) for
    model.path, a dataset's (org/name[/subset][:split]) for the data keys but data.rollouts_path; the message then says
    how it was tried."""
    def problem(key: str, path: str) -> str | None:
        from tasks import hub

        if key == "model.path":
            return hub.model_problem(path)
        return "not found" if key == "data.rollouts_path" else hub.dataset_problem(path, "eval" in key)

    for key, path in required:
        if not path:
            raise ConfigError(f"{key}={path!r}: not found")
        if not os.path.exists(path) and (why := problem(key, path)):
            raise ConfigError(f"{key}={path!r}: {why}")
    for key, value in optional:
        paths = path_list(value)
        for i, path in enumerate(paths):
            if not os.path.exists(path) and (why := problem(key, path)):
                raise ConfigError(f"{key}{f'[{i}]' if len(paths) > 1 else ''}={path!r}: {why}")


def check_run_dir(cfg: Config) -> None:
    """The run folder (run.output_dir/run.name) is a folder this process can make or write: not a file, not a
    symbolic link to nothing, under a writable folder."""
    out, run_dir = cfg.run.output_dir, os.path.join(cfg.run.output_dir, cfg.run.name)
    if os.path.islink(run_dir) and not os.path.exists(run_dir):
        raise ConfigError(f"run.name={cfg.run.name!r}: the run folder {run_dir} is a symbolic link to "
                          f"{os.readlink(run_dir)!r}, which does not exist; remove the link or make its target")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"run.name={cfg.run.name!r}: {run_dir} is a file, not a run folder; pick another run.name "
                          "or run.output_dir")
    probe = run_dir  # the nearest folder that exists: the one the run folder is made in, or the run folder itself
    while not os.path.lexists(probe) and os.path.dirname(probe) not in ("", probe):
        probe = os.path.dirname(probe)
    probe = probe if os.path.lexists(probe) else "."
    if not os.path.isdir(probe):
        raise ConfigError(f"run.output_dir={out!r}: {probe} is a file (or a broken link), not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        key = f"run.name={cfg.run.name!r}" if probe == run_dir else f"run.output_dir={out!r}"
        raise ConfigError(f"{key}: {probe} is not writable by this user (metrics, TensorBoard and checkpoints go "
                          "there); pick a folder you can write")
    checkpoints = os.path.join(run_dir, "checkpoints")  # a resume writes its next checkpoint there
    if os.path.isdir(checkpoints) and not os.access(checkpoints, os.W_OK | os.X_OK):
        raise ConfigError(f"run.name={cfg.run.name!r}: {checkpoints} is not writable by this user, so the run could "
                          "resume but never save; make it writable or pick another run.name")
    wandb_dir = os.path.join(run_dir, "wandb")
    if cfg.run.wandb and os.path.lexists(wandb_dir) and not os.path.isdir(wandb_dir):
        raise ConfigError(f"run.wandb=true: {wandb_dir} (where W&B writes) is a file, not a folder; remove it")


def path_list(path: str | list[str] | None) -> list[str]:
    """A one-or-a-list path key (data.eval_path, data.rollouts_path) as a list: none, one path or several."""
    return [] if path is None else [path] if isinstance(path, str) else list(path)


def check_triton_kernels(cfg: Config, this_machine: bool = True) -> None:
    """rollout.decode_kernels=triton: a GPU, the compact forward, Triton importable."""
    import importlib.util

    import torch

    key = "rollout.decode_kernels=triton"
    if cfg.run.device == "cpu":
        raise ConfigError(f"{key}: the kernels run on GPUs; with run.device=cpu use auto or torch")
    if not cfg.rollout.compact_forward:
        raise ConfigError(f"{key} needs rollout.compact_forward=true (the HF-forward path uses HF's attention)")
    if this_machine and importlib.util.find_spec("triton") is None:
        raise ConfigError(f"{key}: Triton is not installed (the CUDA build of torch brings it); use auto or torch")
    if this_machine and cfg.run.device == "auto" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: this machine has no CUDA GPU (run.device=auto picks the CPU); use auto or torch")


def check_vllm(cfg: Config, world_size: int, this_machine: bool = True) -> None:
    """rollout.engine=vllm: engines over the whole world, vllm_tp dividing it, a GPU, vLLM importable."""
    import importlib.util

    if cfg.rollout.ranks == "actor" and cfg.placement.mode == "split":
        raise ConfigError("rollout.ranks=actor with rollout.engine=vllm and placement.mode=split: vLLM's external "
                          "launcher makes every rank of the world an engine worker, so the rollout spans the world; "
                          "use rollout.ranks=auto (or all)")
    tp = cfg.rollout.vllm_tp
    if tp < 1 or world_size % tp:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"rollout.vllm_tp={tp}: must divide the world size {world_size} (contiguous ranks form "
                          f"one vLLM engine); valid: {valid}")
    if cfg.run.device == "cpu":
        raise ConfigError("rollout.engine=vllm runs on GPUs; run.device=cpu needs rollout.engine=native")
    if this_machine and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm: vLLM is not installed in this environment; pip install -r "
                          "requirements-vllm.txt (vllm==0.24.0 with torch==2.11.0), or use rollout.engine=native")


# Numeric keys and their valid intervals, checked before anything starts (None values are "off" and skipped).
PPO_RANGES = (
    ("run.total_steps", "[0, inf)"), ("run.log_every", "[1, inf)"), ("run.eval_every", "[0, inf)"),
    ("run.epochs", "[1, inf)"), ("distributed.timeout_s", "[1, inf)"),
    ("data.batch_size", "[1, inf)"), ("data.max_prompt_len", "[1, inf)"), ("data.eval_size", "[0, inf)"),
    ("rollout.n", "[1, inf)"), ("rollout.max_new_tokens", "[1, inf)"), ("rollout.temperature", "(0, inf)"),
    ("rollout.top_p", "(0, 1]"), ("rollout.top_k", "[0, inf)"), ("rollout.eval_temperature", "[0, inf)"),
    ("rollout.eval_n", "[1, inf)"), ("rollout.max_num_seqs", "[1, inf)"), ("rollout.kv_cache_tokens", "[1, inf)"),
    ("rollout.gpu_memory_utilization", "(0, 1]"), ("rollout.max_prefill_tokens", "[1, inf)"),
    ("rollout.vllm_max_logprob_gap", "(0, inf)"), ("rollout.max_turns", "[1, inf)"),
    ("rollout.max_episode_tokens", "[1, inf)"), ("rollout.env_workers", "[1, inf)"),
    ("rollout.env_timeout_s", "(0, inf)"), ("rollout.tool_timeout_s", "(0, inf)"),
    ("algorithm.gamma", "[0, 1]"), ("algorithm.lam", "[0, 1]"),
    ("algorithm.kl.coef", "[0, inf)"), ("algorithm.kl.target", "(0, inf)"), ("algorithm.kl.horizon", "[1, inf)"),
    ("algorithm.filters.filter_ratio", "[0, 1)"), ("algorithm.filters.weight_pow", "[0, inf)"),
    ("algorithm.filters.overlong_buffer", "[0, inf)"), ("algorithm.filters.overlong_penalty", "[0, inf)"),
    ("algorithm.replay.capacity", "[1, inf)"), ("algorithm.replay.mix_fraction", "[0, 1]"),
    ("algorithm.guard.kl_limit", "(0, inf)"), ("algorithm.guard.var_limit", "(0, inf)"),
    ("actor.ppo_epochs", "[1, inf)"), ("actor.mini_batch_size", "[0, inf)"), ("actor.micro_batch_tokens", "[1, inf)"),
    ("actor.clip_low", "[0, 1]"), ("actor.clip_high", "[0, inf)"), ("actor.dual_clip", "(1, inf)"),
    ("actor.entropy_coef", "[0, inf)"), ("actor.tis_cap", "(0, inf)"),
    ("actor.rollout_correction.weight_cap", "(0, inf)"), ("actor.rollout_correction.mask_low", "[0, 1)"),
    ("actor.rollout_correction.mask_high", "(1, inf)"),
    ("algorithm.distill.coef", "[0, inf)"), ("algorithm.distill.task_weight", "[0, inf)"),
    ("critic.ppo_epochs", "[1, inf)"), ("critic.mini_batch_size", "[0, inf)"),
    ("critic.micro_batch_tokens", "[1, inf)"), ("critic.value_clip", "(0, inf)"),
    *((f"{role}.optim.{key}", interval) for role in ("actor", "critic") for key, interval in (
        ("lr", "[0, inf)"), ("weight_decay", "[0, inf)"), ("eps", "(0, inf)"), ("warmup_steps", "[0, inf)"),
        ("min_lr_ratio", "[0, 1]"), ("grad_clip", "[0, inf)"))),
    *((f"{role}.lora.{key}", interval) for role in ("actor", "critic") for key, interval in (
        ("rank", "[0, inf)"), ("alpha", "(0, inf)"), ("dropout", "[0, 1)"))),
    ("reward.num_workers", "[1, inf)"), ("reward.timeout_s", "(0, inf)"), ("reward.max_error_fraction", "[0, 1]"),
    ("checkpoint.save_every", "[0, inf)"), ("checkpoint.keep_last", "[1, inf)"),
    ("checkpoint.max_skipped_steps", "[1, inf)"),
)


RANGE_HINTS = {
    "rollout.temperature": "PPO samples from the policy and its log-probs divide by it; greedy decoding is for "
                           "evaluation: rollout.eval_temperature=0",
    "rollout.top_p": "1 keeps the whole distribution",
    "actor.dual_clip": "leave it unset (null) to turn dual clipping off",
}


def check_episodes(cfg: Config) -> None:
    """An environment or tools: one of them, specs that name a function, no offline data, a budget that holds a
    turn."""
    r = cfg.rollout
    if not episodes(cfg):
        return
    if r.environment and r.tools:
        raise ConfigError(f"rollout.environment={r.environment!r} and rollout.tools={r.tools}: set one (tools run in "
                          "a built-in environment of their own; an environment of yours can call them itself)")
    for key, spec in [("rollout.environment", r.environment)] + [(f"rollout.tools[{i}]", t) for i, t in
                                                                    enumerate(r.tools)]:
        if spec is None:
            continue
        module, colon, name = spec.rpartition(":")
        if not (colon and module and name.isidentifier()):
            raise ConfigError(f"{key}={spec!r}: name a function as 'module.path:function' or "
                              "'path/to/file.py:function'")
    if path_list(cfg.data.rollouts_path):
        raise ConfigError("data.rollouts_path (offline training) with rollout.environment / rollout.tools: logged "
                          "rollouts are replayed, not played again; drop one")
    if response_budget(cfg) < r.max_new_tokens and r.max_turns > 1:
        raise ConfigError(f"rollout.max_episode_tokens={r.max_episode_tokens} is below rollout.max_new_tokens="
                          f"{r.max_new_tokens}: an episode's budget must hold at least one whole turn")


def check_ranges(cfg: Config, ranges) -> None:
    """ConfigError for the first key whose value lies outside its interval ("[a, b)" etc.; inf for no bound)."""
    for key, interval in ranges:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value is None or isinstance(value, str):  # unset, or a word in a number's place (micro_batch_tokens: auto)
            continue
        lo_text, hi_text = interval[1:-1].split(", ")
        lo, hi = float(lo_text), float(hi_text)
        above = value >= lo if interval[0] == "[" else value > lo
        below = value <= hi if interval[-1] == "]" else value < hi
        if not (above and below and value == value):  # value == value rejects NaN
            hint = f" ({RANGE_HINTS[key]})" if key in RANGE_HINTS else ""
            raise ConfigError(f"{key}={value}: must be in {interval}{hint}")
    for role in ("actor", "critic"):
        betas = getattr(cfg, role).optim.betas
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"{role}.optim.betas={betas}: expected two numbers in [0, 1), e.g. [0.9, 0.999]")


def check_objective(cfg: Config) -> None:
    """The policy objective, distillation and the KL guard rail against each other (part of check_ppo)."""
    a, algo = cfg.actor, cfg.algorithm
    if a.clip_low == 1 and a.policy_loss != "cispo":
        raise ConfigError(f"actor.clip_low=1 with actor.policy_loss={a.policy_loss}: a ratio clipped at 0 from below "
                          "is no trust region; clip_low=1 (no lower bound) is for policy_loss=cispo, whose clip "
                          "bounds an importance weight. Use a value in [0, 1)")
    if a.dual_clip is not None and a.policy_loss != "ppo":
        raise ConfigError(f"actor.dual_clip={a.dual_clip} with actor.policy_loss={a.policy_loss}: the dual clip "
                          "bounds the ppo objective's loss for negative advantages; unset it or use policy_loss=ppo")
    if algo.distill.coef > 0 and not cfg.teacher.model_path:
        raise ConfigError(f"algorithm.distill.coef={algo.distill.coef}: on-policy distillation needs a teacher; set "
                          "teacher.model_path (a causal LM with the actor's tokenizer)")
    if cfg.teacher.model_path and algo.distill.coef == 0:
        raise ConfigError(f"teacher.model_path={cfg.teacher.model_path!r} with algorithm.distill.coef=0: the teacher "
                          "would be loaded and never used; set algorithm.distill.coef > 0 (e.g. 1.0) or unset "
                          "teacher.model_path")
    samples = cfg.data.batch_size * cfg.rollout.n
    one_step = a.ppo_epochs == 1 and not 0 < a.mini_batch_size < samples
    # offline and replayed samples keep another policy's log-probs: their ratio moves from the first step
    if algo.guard.kl_limit is not None and not (algo.kl.in_reward or algo.kl.in_loss) and one_step and \
            not cfg.data.rollouts_path and not algo.replay.enabled:
        raise ConfigError(f"algorithm.guard.kl_limit={algo.guard.kl_limit} without a reference model and with one "
                          "optimizer step per rollout: the only KL left is the update's own ratio (actor/ppo_kl), "
                          "which is exactly 0 when every sample is trained in one step, so the rail could never "
                          "fire. Add a KL term (algorithm.kl.in_reward or in_loss, which brings the reference), or "
                          "take several steps per rollout (actor.ppo_epochs > 1 or a smaller actor.mini_batch_size)")


SFT_RANGES = (
    ("sft.steps", "[1, inf)"), ("sft.batch_size", "[1, inf)"), ("sft.lr", "[0, inf)"), ("sft.eval_every", "[0, inf)"),
    ("sft.warmup_steps", "[0, inf)"), ("sft.min_lr_ratio", "[0, 1]"), ("run.log_every", "[1, inf)"),
    ("checkpoint.save_every", "[0, inf)"), ("checkpoint.keep_last", "[1, inf)"), ("distributed.timeout_s", "[1, inf)"),
)


def check_sft(cfg: Config, world_size: int) -> None:
    """Everything train_sft.py needs: one pool of all ranks for the model being fine-tuned."""
    check_world(cfg, world_size, ())
    check_lora(cfg, world_size)
    check_ranges(cfg, SFT_RANGES)
    _check_found([("sft.train_path", cfg.sft.train_path), ("model.path", cfg.model.path)],
                 [("sft.eval_path", cfg.sft.eval_path)])


RM_RANGES = (
    ("rm.steps", "[0, inf)"), ("rm.batch_size", "[1, inf)"), ("rm.lr", "[0, inf)"), ("rm.eval_every", "[0, inf)"),
    ("rm.micro_batch_pairs", "[0, inf)"), ("rm.warmup_steps", "[0, inf)"), ("rm.min_lr_ratio", "[0, 1]"),
    ("rm.eval_fraction", "[0, 1)"), ("rm.max_len", "[1, inf)"), ("run.log_every", "[1, inf)"),
    ("distributed.timeout_s", "[1, inf)"),
)


def check_rm(cfg: Config, world_size: int) -> None:
    """Everything train_rm.py needs: one pool of all ranks for the reward model, batches its data-parallel ranks
    share evenly, the files."""
    if cfg.placement.mode != "colocate":
        raise ConfigError("train_rm.py trains one model on one pool of all ranks: use placement.mode=colocate "
                          "(with placement.tp / placement.dp_replicate)")
    check_world(cfg, world_size, ())
    check_ranges(cfg, RM_RANGES)
    dp = world_size // cfg.placement.tp
    if cfg.rm.batch_size % dp:
        raise ConfigError(f"rm.batch_size={cfg.rm.batch_size}: must be a multiple of the data-parallel size {dp} "
                          f"(world size {world_size} / placement.tp {cfg.placement.tp}): each rank takes an equal "
                          "share")
    _check_found([("rm.train_path", cfg.rm.train_path), ("model.path", cfg.model.path)],
                 [("rm.eval_path", cfg.rm.eval_path)])
    check_run_dir(cfg)


def _check_positions(cfg: Config, roles: tuple[str, ...]) -> None:
    """The longest sequence, data.max_prompt_len + rollout.max_new_tokens, fits in the max_position_embeddings of
    every causal LM of the run whose config.json is on this machine (a hub id, or a model built at run time as the
    quickstart's, is checked where it is loaded)."""
    longest = cfg.data.max_prompt_len + response_budget(cfg)
    models = {}
    for role in ("actor", "critic", "reference", "teacher"):
        if role in roles:
            own = getattr(cfg, role).model_path
            models.setdefault(f"{role}.model_path" if own else "model.path", own or cfg.model.path)
    for key, path in models.items():
        file = path if path.endswith(".json") else os.path.join(path, "config.json")
        try:
            with open(file) as f:
                arch = json.load(f)
        except (OSError, ValueError):
            continue
        limit = arch.get("max_position_embeddings", (arch.get("text_config") or {}).get("max_position_embeddings"))
        if isinstance(limit, int) and longest > limit:
            budget = f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}" if not episodes(cfg) else \
                f"the episode's {response_budget(cfg)} (rollout.max_episode_tokens, or max_new_tokens x max_turns)"
            raise ConfigError(
                f"data.max_prompt_len={cfg.data.max_prompt_len} + {budget}"
                f" = {longest} tokens: more than the model's max_position_embeddings={limit} ({key}={path!r}); "
                f"lower them to add up to at most {limit}")


def check_lora(cfg: Config, world_size: int, this_machine: bool = True) -> None:
    """actor.lora / critic.lora: a target list that names something, an adapter folder that exists, and no dropout
    under tensor parallelism. Every engine decodes the merged weights (roles/lora.py): the actor's own native
    engine merges them in place, the others (vLLM, split placement's replicas) are sent them merged."""
    pools = pools_of(cfg, world_size)
    for role in ("actor", "critic"):
        lora = getattr(cfg, role).lora
        if lora.rank == 0 and not lora.init_path:
            continue
        targets = lora.target_modules
        if isinstance(targets, list) and not targets:
            raise ConfigError(f"{role}.lora.target_modules=[]: name the modules to adapt (e.g. [q_proj, v_proj]) or "
                              "use all-linear")
        if isinstance(targets, str) and targets != "all-linear":
            raise ConfigError(f"{role}.lora.target_modules={targets!r}: a list of module names (e.g. [q_proj, "
                              "v_proj]) or all-linear")
        if this_machine and lora.init_path and not os.path.isfile(os.path.join(lora.init_path,
                                                                               "adapter_config.json")):
            raise ConfigError(f"{role}.lora.init_path={lora.init_path!r}: not a peft adapter folder (no "
                              "adapter_config.json there)")
        pool = next((p for p in pools if role in p.roles), None)
        if pool is not None and pool.tp > 1 and lora.dropout > 0:
            where = "placement.tp" if cfg.placement.mode == "colocate" else f"the {pool.name or role} pool's tp"
            raise ConfigError(f"{role}.lora.dropout={lora.dropout} with {where}={pool.tp}: the tensor-parallel ranks "
                              "would drop different features of the same input; use dropout 0 with tp > 1")


def _check_tp_heads(cfg: Config, tp: int, where: str) -> None:
    # model.path is an HF folder; the planner also takes a config.json file itself (configs/models/*.json)
    path = cfg.model.path if cfg.model.path.endswith(".json") else os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.path={cfg.model.path!r}: no config.json there (needed to check {where})")
    with open(path) as f:
        arch = json.load(f)
    heads = arch.get("num_attention_heads")
    kv_heads = arch.get("num_key_value_heads", heads)
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n is None or n % tp:
            valid = [d for d in range(1, (n or 1) + 1) if n and n % d == 0]
            raise ConfigError(f"{where}={tp}: must divide the model's {name}={n}; valid: {valid}")


# ---------------------------------------------------------------------------------------------------------------
# --help: the schema described from its own source, so the keys, types, defaults and comments are written once


def describe_schema(cls=Config, width: int = 120) -> str:
    """One aligned line per key (`actor.optim.lr  float  1e-06  comment`), the field's trailing `# comment` in this
    file as its description (wrapped under itself past `width`); comment lines above a field are kept as `#` lines.
    Sections are split by blank lines; a list of dataclasses gives its item fields once, as `placement.pools[].size`."""
    blocks = [[]]
    for row in _schema_rows(cls, ""):
        if row == "":
            blocks.append([])
        else:
            blocks[-1].append(row)
    lines = ["keys (key  type  default  description):"]
    for block in filter(None, blocks):
        cells = [r for r in block if isinstance(r, tuple)]
        widths = [min(max(len(c[i]) for c in cells), cap) for i, cap in ((0, 40), (1, 16), (2, 12))]
        lines.append("")
        for r in block:
            if isinstance(r, tuple):
                head = "  ".join(f"{cell:<{w}}" for cell, w in zip(r[:3], widths))
                r = textwrap.fill(f"{head}  {r[3]}", width - 2, subsequent_indent=" " * (len(head) + 2),
                                  break_long_words=False, break_on_hyphens=False) if r[3] else head.rstrip()
            lines.append(textwrap.indent(r, "  "))
    return "\n".join(lines)


def _schema_rows(cls, prefix: str):
    """(key, type, default, description) per leaf field of `cls`, "# ..." for comment lines, "" between sections."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        above, text = comments.get(f.name, ([], ""))
        if dataclasses.is_dataclass(tp):
            if not prefix:
                yield ""
            if tp.__doc__ and not tp.__doc__.startswith(tp.__name__ + "("):  # not the signature dataclass writes
                yield f"# {tp.__doc__.splitlines()[0]}"
        yield from (f"# {line}" for line in above)
        if dataclasses.is_dataclass(tp):
            yield from _schema_rows(tp, key + ".")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        choices = [typing.get_args(a) for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is Literal]
        if choices:  # in the description, where a long list of choices does not push the columns apart
            text = " | ".join(map(str, choices[0])) + (f"; {text}" if text else "")
        yield key, _type_name(tp), _yaml_text(default), text
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):
            yield from _schema_rows(item, key + "[].")


def _field_comments(cls) -> dict[str, tuple[list[str], str]]:
    """{field: (the comment lines right above it, its trailing comment)}, from `name: type = default  # comment`."""
    names = {f.name for f in dataclasses.fields(cls)}
    out, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        comment = re.match(r"\s+#\s?(.*)", line)
        if comment:
            above.append(comment[1])
            continue
        item = re.match(r"\s+(\w+)\s*:[^#]*(?:#\s?(.*))?", line)
        if item and item[1] in names and item[1] not in out:
            out[item[1]] = (above, (item[2] or "").strip())
        above = []
    return out


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return type(args[0]).__name__
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return "None" if tp is type(None) else tp.__name__


def _yaml_text(value) -> str:
    """A default as YAML writes it (null, true, [0.9, 0.999]); strings without quotes unless empty."""
    if isinstance(value, str):
        return value or '""'
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------------------------
# Entry-point helper


def old_logprobs_pass(cfg: Config) -> str | None:
    """Why the actor needs a forward pass for PPO's old log-probs before its update, or None when it does not.

    The old policy of the ratio is the one that sampled the batch. When the update is that batch's only optimizer
    step, the weights of its forward are still the sampling weights, so the log-probs it computes, detached, are the
    old ones: ratio 1, the same loss and gradient as with a separate pass, one forward over the batch saved. That
    holds with one epoch and one mini-batch, and only when nothing reads the old log-probs before the update (the KL
    terms and their metrics) or keeps them from another policy (replayed samples, logged offline rollouts)."""
    a, algo = cfg.actor, cfg.algorithm
    samples = cfg.data.batch_size * cfg.rollout.n
    if a.old_logprobs == "forward":
        return "actor.old_logprobs=forward"
    if cfg.data.rollouts_path:
        return "offline training (data.rollouts_path): the ratio is against the logged policy"
    if a.ppo_epochs > 1:
        return f"actor.ppo_epochs={a.ppo_epochs}: later epochs train on weights that have moved"
    if 0 < a.mini_batch_size < samples:
        return (f"actor.mini_batch_size={a.mini_batch_size} is below the {samples} samples of a step: later "
                "mini-batches train on weights that have moved")
    if algo.kl.in_reward or algo.kl.in_loss:
        return "algorithm.kl: the KL to the reference is measured on them before the update"
    if algo.distill.coef > 0:
        return "algorithm.distill: the KL to the teacher is measured on them before the update"
    if algo.replay.enabled:
        return "algorithm.replay: replayed samples keep the log-probs of the policy that sampled them"
    return None


def world_rollout(cfg: Config) -> bool:
    """Whether the rollout runs through rollout/world.py: on vLLM's engines (any placement), or on every rank of
    split pools (rollout.ranks=all). Otherwise the actor's pool generates on its own parameters in place."""
    if cfg.rollout.engine == "vllm":
        return True
    return cfg.rollout.ranks == "all" and cfg.placement.mode == "split"


def episodes(cfg: Config) -> bool:
    """Multi-turn episodes: an environment or tools answer the model's turns."""
    return bool(cfg.rollout.environment or cfg.rollout.tools)


def response_budget(cfg: Config) -> int:
    """The longest response: one turn's max_new_tokens, or an episode's budget (turns and observations)."""
    r = cfg.rollout
    if not episodes(cfg):
        return r.max_new_tokens
    return r.max_episode_tokens if r.max_episode_tokens is not None else r.max_new_tokens * r.max_turns


def required_roles(cfg: Config) -> tuple[str, ...]:
    """The roles a PPO run needs: no critic without GAE, no reference without a KL term, no reward when nothing is
    scored (offline training, whose scores are logged, with no eval set; an environment's own rewards alone)."""
    roles = ["actor"]
    env_only = cfg.rollout.environment and not cfg.reward.functions and cfg.reward.model_path is None
    if not (cfg.data.rollouts_path and not path_list(cfg.data.eval_path)) and not env_only:
        roles.append("reward")
    if cfg.algorithm.adv_estimator == "gae":
        roles.append("critic")
    if cfg.algorithm.kl.in_reward or cfg.algorithm.kl.in_loss:
        roles.append("reference")
    if cfg.algorithm.distill.coef > 0:
        roles.append("teacher")
    return tuple(roles)


CONFIG_ERROR_GRACE_S = 5.0


def parse_or_exit(argv: list[str], world_size: int, rank: int, check=None) -> Config:
    """`--config PATH [key=value ...]` -> a checked Config. On a mistake, rank 0 prints one line and every rank
    exits with code 2 (the others CONFIG_ERROR_GRACE_S later), before any process group or model exists. `--help`
    lists every key (`describe_schema`); `--print-config` prints the checked config as YAML on rank 0 and exits 0
    on every rank."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        description="meshrl: PPO/GRPO on DeviceMesh pools\n\n"
                    "overrides: KEY=VALUE with a dotted key (actor.optim.lr=1e-6) and a YAML value (true, null, "
                    "[1, 2], {spec: gsm8k}),\napplied over --config FILE; a top-level `base: other.yaml` in FILE "
                    "(relative to it) is read first and FILE updates it."
                    + ("\n\nplanner: --plan [--world N] [--gpu-memory GiB] [--suggest] [--json] prints the memory per "
                       "role and rank\nfrom the config and the models' config.json files, and a placement with "
                       "--suggest (--plan --help)" if check in (None, check_ppo) else ""),
        # the schema's listing reads config.py's source (seconds): only for --help, not on every start
        epilog=describe_schema() if any(a == "-h" or (len(a) > 2 and "--help".startswith(a)) for a in argv) else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (configs/*.yaml)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the checked config (defaults, file and overrides) as YAML and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    args = parser.parse_args(argv)
    try:
        if args.config is None and not args.overrides:
            prog = os.path.basename(sys.argv[0]) or "train_ppo.py"
            raise ConfigError(f"no config given: python {prog} --config configs/quickstart.yaml [key=value ...] "
                              "(--help lists every key)")
        check_given_once(args.overrides)
        cfg = load_config(args.config, args.overrides)
        (check or check_ppo)(cfg, world_size)
    except ConfigError as e:
        if rank == 0:
            print(f"config error: {e}", file=sys.stderr, flush=True)
        else:
            # torchrun stops every worker when the first one exits: the others give rank 0 the time to print
            # (its line went missing in 4 of 28 launches when another rank ended first)
            import time

            time.sleep(CONFIG_ERROR_GRACE_S)
        sys.exit(2)
    if args.print_config:
        if rank == 0:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="", flush=True)
        sys.exit(0)
    return cfg


def config_changes(before: dict, after: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf that differs between two config dicts (nested sections dotted)."""
    out = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += config_changes(old, new, f"{prefix}{key}.")
        elif old != new:
            out.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return out

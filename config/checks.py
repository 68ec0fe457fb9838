"""The checks a config passes before any work starts (ConfigError, exit code 2): ranges of numbers, combinations
of settings, what depends on the world size and the model files (pool sizes, tensor-parallel heads), the kernels and
engines the machine must have, the run folder."""

from __future__ import annotations

import json
import os

from config.derived import episodes, path_list, pools_of, required_roles, response_budget, world_rollout
from config.schema import RESUME_PROTECTED, ROLES, Config, ConfigError


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
    check_partial(cfg, correcting)
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
    ("rollout.partial_tail", "[0, 1)"), ("rollout.partial_max_staleness", "[1, inf)"),
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


def check_partial(cfg: Config, correcting: list[str]) -> None:
    """Partial rollouts: what they run on (the native engine on the actor's ranks, single turns, online) and the
    importance correction their older tokens need."""
    r = cfg.rollout
    if r.partial_tail == 0:
        return
    key = f"rollout.partial_tail={r.partial_tail}"
    if world_rollout(cfg):
        raise ConfigError(f"{key}: partial rollouts run on the native engine of the actor's ranks; set "
                          "rollout.engine=native and rollout.ranks=actor (or auto), or rollout.partial_tail=0")
    if episodes(cfg):
        raise ConfigError(f"{key} with rollout.environment / rollout.tools: episodes are not continued across steps; "
                          "set rollout.partial_tail=0")
    if path_list(cfg.data.rollouts_path):
        raise ConfigError(f"{key} with data.rollouts_path: offline training generates nothing; set "
                          "rollout.partial_tail=0")
    if not correcting:
        raise ConfigError(f"{key}: a continued sample holds tokens of older policies, which need importance "
                          "weights against the policy being trained; set actor.tis_cap (e.g. 2.0) or "
                          "actor.rollout_correction.weight / mask")


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

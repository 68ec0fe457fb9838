"""What a config implies, read by the entry points, the planner and the checks: the pools of ranks, the roles a
run needs, whether the rollout runs over the world, multi-turn episodes and their token budget, when PPO's old
log-probs need a pass of their own."""

from __future__ import annotations

import os

from config.schema import ROLES, Config, ConfigError, PoolConfig


def pools_of(cfg: Config, world_size: int) -> list[PoolConfig]:
    """The pools of the run: one of all ranks for colocate, the configured ones for split."""
    p = cfg.placement
    if p.mode == "colocate":
        if p.pools:
            raise ConfigError("placement.pools is for placement.mode=split; colocate uses placement.tp / dp_replicate")
        return [PoolConfig(name="all", size=world_size, roles=list(ROLES), tp=p.tp, dp_replicate=p.dp_replicate)]
    return p.pools


def path_list(path: str | list[str] | None) -> list[str]:
    """A one-or-a-list path key (data.eval_path, data.rollouts_path) as a list: none, one path or several."""
    return [] if path is None else [path] if isinstance(path, str) else list(path)


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


def compile_cache_folder(cfg: Config) -> str | None:
    """Where run.compile_cache keeps compiled artifacts (None: off)."""
    folder = cfg.run.compile_cache
    return os.path.join(cfg.run.output_dir, "compile_cache") if folder == "auto" else folder

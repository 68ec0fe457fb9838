"""PPOTrainer: the roles of a PPO / GRPO / RLOO / REINFORCE++ run on their pools, and `step`, one step's dataflow
numbered 1-5. Around it: the rollout phase (ppo/rollouts.py), the run loop with evaluation and logging
(ppo/run_loop.py), checkpoints (ppo/save_resume.py); train_ppo.py starts it."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import torch
from transformers import AutoConfig

import checkpoint
import config as C
from algo.controller import GuardRails
from algo.filters import ReplayBuffer
from algo.kl_control import make_kl_controller
from algo.pipeline import prepare_batch
from batch import fit_width
from monitor import (
    GpuSampler,
    HealthWarnings,
    MetricsLogger,
    lock_run_dir,
    nvml_reader,
)
from parallel import comm
from parallel.distributed import anyone, reducer
from parallel.layout import Layout
from parallel.transfer import transfer
from ppo.rollouts import RolloutPhase
from ppo.run_loop import RunLoop
from ppo.save_resume import SaveResume
from roles.actor import Actor
from roles.critic import Critic
from roles.lora import BaseReference
from roles.reference import Reference
from roles.reward import Reward
from roles.update_loop import all_reduce_sum
from rollout.api import stop_token_ids
from rollout.episodes import ObservationTokens
from rollout.native import SamplingParams
from rollout.partial import PartialRollouts
from tasks.char_tokenizer import load_tokenizer
from tasks.data import (
    PromptDataset,
    PromptSampler,
    chat_template_text,
    load_eval_records,
    load_prompt_records,
    padding_id,
)
from tasks.offline import OfflineRollouts, file_fingerprints, load_offline_groups, rollout_files

log = logging.getLogger("meshrl")


@contextlib.contextmanager
def timed(times: dict[str, float], name: str):
    """Add the seconds spent in the block to times["timing_s/<name>"] (phases may run several times a step)."""
    start = time.perf_counter()
    yield
    key = f"timing_s/{name}"
    times[key] = times.get(key, 0.0) + time.perf_counter() - start


def check_teacher_vocab(tokenizer, teacher_path: str, trust_remote_code: bool) -> None:
    """The teacher scores the actor's token ids: its tokenizer must be the actor's (ValueError naming it, else)."""
    try:
        theirs = load_tokenizer(teacher_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"teacher.model_path={teacher_path!r}: no tokenizer could be read there to check it is the "
                         f"actor's ({e})") from e
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"teacher.model_path={teacher_path!r}: its tokenizer differs from the actor's (vocabularies "
                         f"of {len(theirs.get_vocab())} and {len(tokenizer.get_vocab())} tokens); on-policy "
                         "distillation scores the actor's token ids, so the teacher needs the same tokenizer")


class PPOTrainer(RolloutPhase, RunLoop, SaveResume):
    def __init__(self, cfg: C.Config, layout: Layout, device: torch.device):
        self.cfg, self.layout, self.device = cfg, layout, device
        self.rank = layout.rank
        algo = cfg.algorithm
        self.use_critic = algo.adv_estimator == "gae"
        self.use_ref = algo.kl.in_reward or algo.kl.in_loss
        self.use_teacher = algo.distill.coef > 0
        path = cfg.actor.model_path or cfg.model.path
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or path, cfg.model.trust_remote_code)
        self.pad = pad = padding_id(self.tokenizer, cfg.model.tokenizer_path or path)
        # multi-turn episodes: the environments' (or tools') worker processes; the tools' schemas go into the
        # prompts' chat template
        self.envs, self.tools = self._environments(layout)
        if cfg.data.rollouts_path:  # offline: logged responses and scores, no generation in the train steps
            files = rollout_files(C.path_list(cfg.data.rollouts_path))
            self.data_files = file_fingerprints(files)  # in each checkpoint: a resume refuses edited files
            vocab = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code).vocab_size
            self.train_set = load_offline_groups(
                files, self.tokenizer, group_size=cfg.rollout.n, vocab_size=vocab,
                max_prompt_len=cfg.data.max_prompt_len, max_response_len=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature, prompt_key=cfg.data.prompt_key,
                ground_truth_key=cfg.data.ground_truth_key, chat_template=cfg.data.chat_template,
                system_prompt=cfg.data.system_prompt, template_kwargs=cfg.data.chat_template_kwargs)
            if layout.rank == 0 and cfg.data.train_path:
                log.warning("data.train_path=%r is not read: offline training takes its prompts from "
                            "data.rollouts_path (data.train_path=null says so)", cfg.data.train_path)
            if layout.rank == 0:
                log.info("offline training on %d logged prompts x %d responses from %d file(s); the PPO ratio is "
                         "against %s", len(self.train_set), cfg.rollout.n, len(files),
                         "the logged behaviour log-probs" if self.train_set.has_logprobs else
                         "the current policy's log-probs before each update (the files have no logprobs)")
        else:
            self.data_files = {}
            self.train_set = PromptDataset(load_prompt_records(cfg.data.train_path, cfg.data.prompt_key,
                                                               cfg.data.ground_truth_key), self.tokenizer,
                                           cfg.data.max_prompt_len, cfg.data.chat_template, cfg.data.system_prompt,
                                           self.tools, cfg.data.chat_template_kwargs)
        self.offline = isinstance(self.train_set, OfflineRollouts)
        # the reward pool scores the samples (not offline, whose scores are logged; not an environment's alone)
        self.scoring = not self.offline and "reward" in C.required_roles(cfg)
        # None: the update's own forward gives PPO's old log-probs (one optimizer step per rollout); else why a
        # forward pass before the update computes them
        self.old_logprobs_pass = C.old_logprobs_pass(cfg)
        if layout.rank == 0:
            why = self.old_logprobs_pass
            log.info("old log-probs: %s", "from the update's forward (one optimizer step per rollout)" if why is None
                     else f"a forward pass before the update ({why})")
        self.eval_set = None
        if C.path_list(cfg.data.eval_path):
            self.eval_set = PromptDataset(load_eval_records(C.path_list(cfg.data.eval_path), cfg.data.prompt_key,
                                                            cfg.data.ground_truth_key), self.tokenizer,
                                          cfg.data.max_prompt_len, cfg.data.chat_template, cfg.data.system_prompt,
                                          self.tools, cfg.data.chat_template_kwargs)
        self.sampler = PromptSampler(len(self.train_set), cfg.data.batch_size, seed=cfg.run.seed,
                                     shuffle=cfg.data.shuffle)
        steps_per_epoch = len(self.train_set) // cfg.data.batch_size
        self.total_steps = cfg.run.epochs * steps_per_epoch if cfg.run.epochs else cfg.run.total_steps

        # micro_batch_tokens=auto, set in cfg before any model is loaded: from this GPU's free memory by the planner's
        # model of the run (plan.resolve_at_start; the same on every rank), the fixed budget on the CPU
        import plan

        budgets = plan.resolve_at_start(cfg, layout.rank, layout.world_size, device)
        for line in budgets if layout.rank == 0 else []:
            log.info("%s", line)
        self.pools = {role: layout.pool_of(role) for role in C.required_roles(cfg)}
        trust = cfg.model.trust_remote_code
        hosts = layout.hosts
        self.actor = Actor(path, cfg.actor, self.pools["actor"], device, pad, self.total_steps, trust, cfg.comm,
                           cfg.rollout) if hosts("actor") else None
        self.critic = Critic(cfg.critic.model_path or cfg.model.path, cfg.critic, self.pools["critic"], device,
                             self.total_steps, trust, cfg.comm) if self.use_critic and hosts("critic") else None
        self.reference = None
        if self.use_ref and hosts("reference"):
            # a LoRA actor's base, on the same ranks, is the reference: its model with the adapters off
            base_ref = self.actor is not None and self.actor.lora is not None and \
                self.pools["reference"] is self.pools["actor"] and cfg.reference.model_path in (None, path)
            self.reference = BaseReference(self.actor) if base_ref else Reference(
                cfg.reference.model_path or path, cfg.reference, self.pools["reference"], device,
                cfg.actor.micro_batch_tokens, trust, cfg.actor.pack_sequences)
        if self.use_teacher:
            check_teacher_vocab(self.tokenizer, cfg.teacher.model_path, trust)
        self.teacher = Reference(cfg.teacher.model_path, cfg.teacher, self.pools["teacher"], device,
                                 cfg.actor.micro_batch_tokens, trust, cfg.actor.pack_sequences
                                 ) if self.use_teacher and hosts("teacher") else None
        self.reward = Reward(cfg.reward, self.pools["reward"], device, self.tokenizer, cfg.actor.micro_batch_tokens,
                             trust) if "reward" in self.pools and hosts("reward") else None

        # vLLM's engines, or every rank of split pools, generate through rollout/world.py; each rank builds its side
        # here, at the same point (the engines' start-up is collective over the world)
        self.rollout = self._world_rollout(path, pad, device) if C.world_rollout(cfg) else None
        self.weights_version = 0  # the actor updates behind the current weights (the rollout syncs when it changes)

        self._check_rewards()
        stops = stop_token_ids(path, self.tokenizer, cfg.rollout.stop_token_ids, trust)
        r = cfg.rollout
        self.train_params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.n, stops)
        # partial rollouts: the samples a step's rollout left unfinished, continued in the next (rollout/partial.py)
        self.partial = PartialRollouts(r.n, r.max_new_tokens, r.partial_max_staleness) \
            if r.partial_tail > 0 and self.actor is not None else None
        self.eval_params = SamplingParams(r.max_new_tokens, r.eval_temperature, 1.0, 0, r.eval_n, stops)
        self.observe, self.last_episodes = None, None
        if self.envs is not None:  # an episode's observations in tokens: the chat template's, or plain text
            template = cfg.data.chat_template if isinstance(cfg.data.chat_template, str) else None
            chat = bool(cfg.data.chat_template) or self.train_set.items[0]["messages"] is not None
            self.observe = ObservationTokens(self.tokenizer, chat, stops, template and chat_template_text(template),
                                             self.tools, cfg.data.chat_template_kwargs)
            self._check_environment()
        self.kl_ctl = make_kl_controller(algo.kl.controller, algo.kl.coef, algo.kl.target, algo.kl.horizon)
        self.dp_reduce = reducer(self.pools["actor"].dp_group)  # statistics over the whole batch, on actor ranks
        self.guard = GuardRails(algo.guard.kl_limit, algo.guard.var_limit)
        rp = algo.replay
        self.replay = ReplayBuffer(rp.capacity, rp.quality_threshold, rp.mix_fraction, rp.unit, cfg.run.seed) \
            if rp.enabled else None
        actor_pool = self.pools["actor"]
        seed = cfg.run.seed * 1_000_003 + max(actor_pool.dp_rank, 0)
        # sampling tokens: one stream per engine (the actor's dp rank, or the rollout unit when engines are laid out
        # apart); shuffles and resampling: one per actor dp rank, so that tp peers of every role draw alike
        engine_seed = cfg.run.seed * 1_000_003 + self.rollout.unit if self.rollout is not None else seed
        self.gen_rng = torch.Generator(device=device).manual_seed(engine_seed)
        self.engine_seed = engine_seed
        self.cpu_rng = torch.Generator().manual_seed(seed)
        self.comm_timer = comm.CommTimer(device)
        for role in (self.actor, self.critic, self.reference, self.teacher, self.reward):
            if role is not None and getattr(role, "model", None) is not None:
                self.comm_timer.watch_fsdp(role.model)
        self.health = HealthWarnings(cfg.health)  # over the merged metrics, on rank 0
        self.gpu = GpuSampler(nvml_reader(device), cfg.health.gpu_sample_s)
        self.logger = None
        self.run_dir = run_dir = os.path.join(cfg.run.output_dir, cfg.run.name)
        # one live run per folder: a second would resume the first's checkpoints and cut its metrics
        self.lock, holder = lock_run_dir(run_dir) if self.rank == 0 else (None, None)
        if anyone(holder is not None):
            raise ValueError(f"the run folder {run_dir} is in use by a live run ({holder}); wait for it to end or "
                             "pick another run.name")
        self.ckpt_root = os.path.join(run_dir, "checkpoints")
        if self.rank == 0:  # the lock is ours: a partial save left by a dead run is never resumed, only in the way
            for name in checkpoint.remove_partial(self.ckpt_root):
                log.warning("removed %s, a checkpoint an earlier run did not finish writing", name)
        self.pending_save: checkpoint.PendingSave | None = None
        self.clock: tuple[int, float] | None = None  # (first step, its start time) of this process: the ETA
        problem = None
        if self.rank == 0:
            try:
                self.logger = MetricsLogger(run_dir, cfg.run.tensorboard, cfg.run.prometheus_port,
                                            cfg.run.console_keys)
            except ValueError as e:  # the Prometheus port is taken
                problem = str(e)
        if anyone(problem is not None):
            raise C.ConfigError(problem or "run.prometheus_port: rank 0 cannot serve metrics there (its message says "
                                "why)")

    def _check_rewards(self) -> None:
        """Every reward function called once on the first train and the first eval record, on the reward ranks;
        every rank raises ValueError (exit 2) when one failed, the rank that saw it with the traceback."""
        problem = None
        if self.reward is not None:
            # offline, the reward functions score only the eval responses
            samples = [] if self.offline else [("the first train record", self.train_set.items[0])]
            if self.eval_set is not None:
                samples.append(("the first eval record", self.eval_set.items[0]))
            problem = self.reward.check_functions(samples)
        if anyone(problem is not None):
            if problem and self.rank != 0:  # rank 0 prints the error it raises
                log.error("%s", problem)
            raise ValueError(problem or "a reward function failed its start-up call on another rank (its log says "
                             "why)")

    def step(self, step: int) -> dict[str, float]:
        cfg, algo = self.cfg, self.cfg.algorithm
        times: dict[str, float] = {}
        t = functools.partial(timed, times)
        P = self.pools
        metrics: dict[str, float] = {}
        indices = self.sampler.next_batch()  # the same global list on every rank

        # 1. rollout for the actor pool, each dp rank its share of the prompts (generated on the actor's ranks, or
        # on every rank through rollout/world.py)
        batch, rows = None, None
        if self.offline and self.actor is not None:
            with t("replay"):
                batch = self._replay(indices)
        elif not self.offline and (self.actor is not None or self.rollout is not None):
            with t("gen"):
                batch = self._generate_partial(indices, step) if self.partial is not None else \
                    self._generate(self.train_set, indices, self.train_params)
            if self.partial is not None:
                metrics.update(self.partial_metrics)
            reshard_s, engine_stats = self._engine_stats()
            times["timing_s/reshard"] = reshard_s
            for part in ("prefill", "capture", "decode"):  # the native slot engine's parts of gen
                if f"{part}_s" in engine_stats:
                    times[f"timing_s/gen_{part}"] = engine_stats[f"{part}_s"]
            if "memory_gb" in engine_stats:
                metrics["rollout/vllm_memory_gb"] = engine_stats["memory_gb"]
            if self.last_episodes is not None and self.actor is not None:
                metrics.update(self._episode_metrics())
        if self.actor is not None:
            rows = batch["input_ids"].shape[0]
            tokens = (batch["prompt_len"] + batch["response_len"]).sum()
            metrics["perf/total_tokens"] = float(all_reduce_sum(tokens, P["actor"].dp_group))

        # 2. the batch goes to the pools of reference, critic and reward (no-op for roles colocated with the actor)
        with t("transfer"), self.comm_timer.span():
            to_ref = transfer(batch, P["actor"], P["reference"], self.layout, self.device) if self.use_ref else None
            to_teacher = transfer(batch, P["actor"], P["teacher"], self.layout, self.device) if self.use_teacher \
                else None
            to_critic = transfer(batch, P["actor"], P["critic"], self.layout, self.device) if self.use_critic else None
            to_reward = transfer(batch, P["actor"], P["reward"], self.layout, self.device) if self.scoring else None

        # 3. reference log-probs, values, scores, old log-probs (at the same time where the pools are split)
        ref, teacher, values, scores = {}, {}, {}, {}
        if self.reference is not None:
            with t("ref"):
                ref = {"ref_logprobs": self.reference.log_probs(to_ref, cfg.rollout.temperature)}
        if self.teacher is not None:
            with t("teacher"):
                teacher = {"teacher_logprobs": self.teacher.log_probs(to_teacher, cfg.rollout.temperature)}
        if self.critic is not None:
            with t("values"):
                values = {"values": self.critic.values(to_critic)}
        if self.reward is not None and not self.offline:
            with t("reward"):
                s, reward_metrics, _ = self.reward.scores(to_reward, self.train_set.items)
                scores = {"scores": s}
                metrics.update(reward_metrics)
                metrics.update(self.reward.take_failures())
        # a broken reward function must not train the policy on zeros: every rank stops here, before the update
        fatal = self.reward.fatal if self.reward is not None else None
        if anyone(fatal is not None):
            if fatal:
                log.error("%s", fatal)
            raise RuntimeError(fatal or "reward functions failed on too many samples on another rank (its log says "
                               "which); stopping before the update. The last checkpoint is intact.")
        if self.actor is not None and self.old_logprobs_pass is not None:
            with t("old_logprobs"):
                if self.offline and self.train_set.has_logprobs:  # the ratio against the behaviour policy
                    batch["old_logprobs"] = batch["rollout_logprobs"]
                    if self.use_ref or self.use_teacher:  # every KL is the current actor's, not the logging one's
                        batch["policy_logprobs"] = self.actor.log_probs(batch, cfg.rollout.temperature)
                else:
                    batch["old_logprobs"] = self.actor.log_probs(batch, cfg.rollout.temperature)
                    if self.offline:
                        batch["rollout_logprobs"] = batch["old_logprobs"]
            if not self.offline:  # the engine's and the trainer's log-probs of the same tokens: ~0 in float32
                gap = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * batch["response_mask"]
                metrics["rollout/logprob_diff_max"] = float(self.dp_reduce(gap.max() if gap.numel() else
                                                                           gap.new_zeros(()), "max"))
        with t("transfer"), self.comm_timer.span():
            for got, role, on in ((ref, "reference", self.use_ref), (teacher, "teacher", self.use_teacher),
                                  (values, "critic", self.use_critic), (scores, "reward", self.scoring)):
                if on:
                    back = transfer(got, P[role], P["actor"], self.layout, self.device, want=rows)
                    if batch is not None:
                        width = batch["response_mask"].shape[1]
                        batch.update({k: fit_width(v, width) if v.dim() == 2 else v for k, v in back.items()})
        if batch is not None and "env_reward" in batch:  # an episode's score: its environment's reward and the rest
            batch["scores"] = batch["env_reward"] + batch.get("scores", 0.0)

        if cfg.run.save_rollouts and self.actor is not None:
            self._save_rollouts(step, batch)

        # 4. on the actor pool: filters, KL, advantages, resampling, replay (algo/pipeline.py has the order)
        if self.actor is not None:
            with t("adv"):
                batch, adv_metrics = prepare_batch(
                    batch, algo, self.kl_ctl, group_size=cfg.rollout.n, max_response_len=C.response_budget(cfg),
                    min_reward=self._min_reward(), replay=self.replay, generator=self.cpu_rng, reduce=self.dp_reduce)
            metrics.update(adv_metrics)

        # 5. updates: the critic's batch carries the returns to its pool
        with t("transfer"), self.comm_timer.span():
            critic_batch = transfer(batch, P["actor"], P["critic"], self.layout, self.device) \
                if self.use_critic else None
        if self.critic is not None:
            with t("update_critic"):
                metrics.update(self.critic.update(critic_batch, self.cpu_rng))
        if self.actor is not None:
            kl_loss = metrics.get("actor/kl_coef", 0.0) if algo.kl.in_loss else 0.0
            with t("update_actor"):
                metrics.update(self.actor.update(batch, cfg.rollout.temperature, kl_loss, algo.kl.loss_kind,
                                                 C.response_budget(cfg), self.cpu_rng))
            self._guard_rails(metrics)
        self.weights_version = step
        metrics.update(times)
        return metrics

    def _min_reward(self) -> float | None:
        base = self.cfg.algorithm.filters.min_reward
        raise_by = self.guard.metrics()["guard/min_reward"]
        if base is None:
            return None if raise_by == 0 else raise_by
        return base + raise_by

    def _guard_rails(self, metrics: dict[str, float]) -> None:
        g = self.cfg.algorithm.guard
        if g.kl_limit is None and g.var_limit is None:
            return
        # KL to the reference policy when there is one (what the rail is for); else the size of this update.
        # Both are statistics of the whole batch, the same on every actor rank: every rank takes the same decision.
        kl_now = None
        if g.kl_limit is not None:
            kl_now = metrics.get("actor/ref_kl", abs(metrics.get("actor/ppo_kl", 0.0)))
        # the variance of the scores the threshold filters (shaped by the overlong penalty when that is on)
        var_now = metrics.get("reward/shaped_score/var", metrics.get("reward/score/var")) \
            if g.var_limit is not None else None
        events = self.guard.step(kl_now, var_now)
        self.actor.lr_scale = self.guard.metrics()["guard/lr_scale"]
        for e in events:
            log.info("guard rail: %s", e)
        metrics.update(self.guard.metrics())

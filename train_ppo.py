"""meshrl: PPO / GRPO / RLOO / REINFORCE++ on DeviceMesh pools, one SPMD program.

    python train_ppo.py --config configs/quickstart.yaml                      # a world of one, CPU or GPU
    torchrun --nproc_per_node 4 train_ppo.py --config X placement.mode=split  # pools of ranks

Every rank runs this file; the layout decides which roles it hosts. `PPOTrainer.step` is the dataflow of one step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

import checkpoint
import config as C
from algo.controller import GuardRails
from algo.filters import ReplayBuffer
from algo.kl_control import make_kl_controller
from algo.pipeline import prepare_batch
from batch import Batch, fit_width
from monitor import (
    GpuSampler,
    HealthWarnings,
    MetricsLogger,
    eval_metrics,
    eval_sums,
    gather_metrics,
    lock_run_dir,
    memory_gb,
    nvml_reader,
    process_age_s,
    profiled,
    quiet_libraries,
    read_metrics_file,
    run_summary,
    summary_table,
)
from parallel import comm
from parallel.distributed import anyone, comm_device, env_world, exit_process, init_distributed, reducer, shutdown
from parallel.fsdp import DTYPES
from parallel.layout import Layout, build_layout
from parallel.transfer import transfer
from roles.actor import Actor, native_engine_options
from roles.critic import Critic
from roles.lora import BaseReference
from roles.modeling import all_reduce_sum
from roles.reference import Reference
from roles.reward import Reward, decode_responses, decode_texts
from rollout.api import stop_token_ids
from rollout.episodes import ObservationTokens, SharedEnvironments, episode_record, run_episodes
from rollout.native import RolloutOutput, SamplingParams
from rollout.world import Replica, WorldRollout, units_in_blocks, units_of_split
from tasks.char_tokenizer import load_tokenizer
from tasks.data import (
    PromptDataset,
    PromptSampler,
    chat_template_text,
    load_eval_records,
    load_prompt_records,
    padding_id,
)
from tasks.environments import EnvironmentPool
from tasks.offline import OfflineRollouts, file_fingerprints, load_offline_groups, rollout_files, write_rollouts

log = logging.getLogger("meshrl")


def rollout_batch(out: RolloutOutput, prompt_index: list[int], device: torch.device,
                  lengths: torch.Tensor | None = None) -> Batch:
    """The engine's output in the batch layout of roles/modeling.py: prompt + response per row, right-padded.
    lengths: the responses' lengths where the mask has holes (episodes' observations); the mask's sums otherwise."""
    n = len(out.prompt_ids)
    p_len = torch.tensor([len(p) for p in out.prompt_ids], dtype=torch.long)
    r_len = lengths.long().cpu() if lengths is not None else out.response_mask.sum(-1).long().cpu()
    width = int((p_len + r_len).max()) if n else 1
    ids = torch.zeros((n, width), dtype=torch.long)
    resp = out.response_ids.cpu()
    # one scatter for all the prompts and one for all the responses (a loop over rows costs ~50 us a row)
    rows = torch.repeat_interleave(torch.arange(n), p_len)
    starts = torch.repeat_interleave(p_len.cumsum(0) - p_len, p_len)
    ids[rows, torch.arange(len(rows)) - starts] = torch.tensor(list(itertools.chain.from_iterable(out.prompt_ids)),
                                                               dtype=torch.long)
    rows, cols = (torch.arange(resp.shape[1])[None, :] < r_len[:, None]).nonzero(as_tuple=True)
    ids[rows, p_len[rows] + cols] = resp[rows, cols]
    batch = {
        "input_ids": ids, "prompt_len": p_len, "response_len": r_len, "response_ids": resp,
        "response_mask": out.response_mask.float().cpu(), "rollout_logprobs": out.logprobs.float().cpu(),
        "prompt_index": torch.tensor(prompt_index, dtype=torch.long),
    }
    return {k: v.to(device) for k, v in batch.items()}


@contextlib.contextmanager
def timed(times: dict[str, float], name: str):
    """Add the seconds spent in the block to times["timing_s/<name>"] (phases may run several times a step)."""
    start = time.perf_counter()
    yield
    key = f"timing_s/{name}"
    times[key] = times.get(key, 0.0) + time.perf_counter() - start


class PPOTrainer:
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

    def _world_rollout(self, path: str, pad: int, device: torch.device) -> WorldRollout:
        cfg, r = self.cfg, self.cfg.rollout
        actor_pool, world = self.pools["actor"], self.layout.world_size
        trust = cfg.model.trust_remote_code
        if r.engine == "vllm":
            from rollout.vllm import VLLMEngine  # vLLM is an optional extra

            engine = VLLMEngine(path, pad, tp=r.vllm_tp, gpu_memory_utilization=r.gpu_memory_utilization,
                                sleep_level=r.vllm_sleep_level, seed=cfg.run.seed, trust_remote_code=trust,
                                max_model_len=cfg.data.max_prompt_len + C.response_budget(cfg))
            units, dtype = units_in_blocks(world, r.vllm_tp), torch.bfloat16
        else:
            # the dtype the actor's own engines generate with, unsharded
            units, dtype = units_of_split(world, actor_pool), DTYPES[cfg.actor.fsdp.param_dtype]
            if self.actor is not None:  # a LoRA actor generates on its merged weights (Actor.generate)
                engine = self.actor if self.actor.lora is not None else self.actor.engine
            else:
                arch = AutoConfig.from_pretrained(path, trust_remote_code=trust)
                with torch.device(device):
                    model = AutoModelForCausalLM.from_config(arch, dtype=dtype, trust_remote_code=trust)
                engine = Replica(model, pad, **native_engine_options(r))
        # the engines with a copy of their own (vLLM, the replicas) take a LoRA actor's merged weights
        lora = self.actor.lora if self.actor is not None else None
        return WorldRollout(engine, units, actor_pool, self.actor.model if self.actor is not None else None, pad,
                            dtype, device, weights=lora.merged_weights if lora is not None else None)

    def _engine_stats(self) -> tuple[float, dict[str, float]]:
        """(timing_s/reshard, the engine's stats) of the last rollout."""
        if self.rollout is not None:
            return self.rollout.stats.get("reshard_s", 0.0), self.rollout.engine.stats
        return self.actor.engine.stats.get("reshard_s", 0.0), self.actor.engine.stats

    # ------------------------------------------------------------------------------------------------ one step
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
                batch = self._generate(self.train_set, indices, self.train_params)
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

    def _generate(self, dataset: PromptDataset, indices: list[int], params: SamplingParams) -> Batch | None:
        """This actor dp rank's share of `indices`, sampled; None on ranks outside the actor's pool (which join a
        world rollout)."""
        pool = self.pools["actor"]
        mine = indices[pool.dp_rank :: pool.dp_size] if self.actor is not None else []
        if C.episodes(self.cfg):
            return self._episodes(dataset, mine, params)
        out = self._sample([dataset[i]["prompt_ids"] for i in mine] if self.actor is not None else None, params)
        if self.actor is None:
            return None
        return rollout_batch(out, [i for i in mine for _ in range(params.n)], self.device)

    def _sample(self, prompts: list[list[int]] | None, params: SamplingParams) -> RolloutOutput | None:
        """One generate call: on the engines laid out over the world (every rank calls, None outside the actor's
        pool), or on the actor's own engine."""
        if self.rollout is not None:
            return self.rollout.generate(prompts, params, self.gen_rng, self.weights_version)
        return self.actor.generate(prompts, params, self.gen_rng)

    def _environments(self, layout: Layout) -> tuple[EnvironmentPool | SharedEnvironments | None, list[dict] | None]:
        """(the environments of an episode run on the actor's ranks, the tools' JSON schemas). The pool of workers
        runs on each actor dp rank's first tp rank, shared with its tp peers (SharedEnvironments); the other ranks
        start one worker for the schemas (their prompts show the tools too) and stop it."""
        r = self.cfg.rollout
        if not C.episodes(self.cfg):
            return None, None
        kind, specs = ("environment", [r.environment]) if r.environment else ("tools", r.tools)
        actor = layout.pool_of("actor")
        hosts = layout.hosts("actor") and actor.tp_rank_of(self.rank) == 0
        pool = EnvironmentPool(kind, specs, r.env_workers if hosts else 1, r.env_timeout_s, r.tool_timeout_s)
        schemas = pool.tool_schemas or None
        if not hosts:
            pool.close()
            pool = None
        if layout.hosts("actor") and actor.tp > 1:
            group = actor.mesh.get_group("tp")
            return SharedEnvironments(pool, group, dist.get_global_rank(group, 0)), schemas
        return pool, schemas

    def _check_environment(self) -> None:
        """The environment made and reset on the first train record before any work: a factory that fails, or a
        first observation under a chat template (it belongs in the prompt's messages), says so (ValueError, exit 2)."""
        result = self.envs.open({0: episode_record(self.train_set.items[0])})[0]
        self.envs.close_episodes([0])
        what = f"rollout.environment={self.cfg.rollout.environment!r}" if self.cfg.rollout.environment else \
            f"rollout.tools={self.cfg.rollout.tools}"
        if result.error is not None:
            raise ValueError(f"{what} failed its start-up call on the first train record:\n{result.error}")
        if result.observation is not None and self.observe.chat:
            raise ValueError(f"{what}: reset() returned an observation for a chat-templated prompt; put it in the "
                             "prompt's messages (the data), or return None")

    def _episodes(self, dataset: PromptDataset, mine: list[int], params: SamplingParams) -> Batch | None:
        """Multi-turn episodes (rollout/episodes.py) of this dp rank's prompts; on ranks outside the actor's pool
        (a world rollout) their generate calls, one per turn, as long as some episode runs."""
        r = self.cfg.rollout
        group = None if self.rollout is not None else self.pools["actor"].group
        if self.actor is None:
            for _ in range(r.max_turns):
                if not anyone(False, group):
                    break
                self._sample(None, dataclasses.replace(params, n=1))
            return None
        turns: dict[str, float] = {}  # the engine's counters and phase times, summed over the turns

        def sample(prompts: list[list[int]], turn_params: SamplingParams) -> RolloutOutput:
            out = self._sample(prompts, turn_params)
            for key, value in self._engine_stats()[1].items():
                if key.endswith("_s") or key in ("prefills", "decode_steps", "continued", "continued_tokens"):
                    turns[key] = turns.get(key, 0.0) + value
            return out

        episodes = run_episodes(
            sample, [dataset[i]["prompt_ids"] for i in mine], [episode_record(dataset[i]) for i in mine],
            self.envs, self.observe, params, max_turns=r.max_turns, max_tokens=C.response_budget(self.cfg),
            reward_mode=r.episode_reward, decode=lambda t: self.tokenizer.decode(t, skip_special_tokens=True),
            any_running=lambda flag: anyone(flag, group), max_prompt_tokens=self.cfg.data.max_prompt_len)
        self._engine_stats()[1].update(turns)  # the step's timing_s/gen_* cover every turn
        # prompt tokens the engine did not prefill again: the history its slots kept from the turn before
        episodes.sums["episode/reused_prompt_tokens"] = turns.get("continued_tokens", 0.0)
        self.last_episodes = episodes
        batch = rollout_batch(episodes.output, [i for i in mine for _ in range(params.n)], self.device,
                              episodes.lengths)
        batch["env_reward"] = episodes.rewards.to(self.device)
        return batch

    def _episode_metrics(self) -> dict[str, float]:
        """Means over the actor's episodes of this step: turns, truncation, environment errors and timeouts, the
        environments' rewards and info numbers, tool calls."""
        episodes, pool = self.last_episodes, self.pools["actor"]
        shares: list = [None] * pool.dp_size
        dist.all_gather_object(shares, (episodes.count, episodes.sums), group=pool.dp_group)
        count = sum(c for c, _ in shares)
        keys = sorted({k for _, sums in shares for k in sums})
        return {f"{k}/mean": sum(sums.get(k, 0.0) for _, sums in shares) / max(count, 1) for k in keys}

    def _replay(self, indices: list[int]) -> Batch:
        """Offline: this dp rank's share of the logged groups in the layout of a generated batch, with their scores
        and behaviour log-probs (zeros without them: the caller puts the current policy's there)."""
        pool = self.pools["actor"]
        mine = indices[pool.dp_rank :: pool.dp_size]
        groups = [self.train_set[i] for i in mine]
        responses = [r for g in groups for r in g["responses"]]
        width = max((len(r) for r in responses), default=1)
        ids = torch.full((len(responses), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(responses), width), dtype=torch.long)
        logprobs = torch.zeros((len(responses), width), dtype=torch.float32)
        logged = [lp for g in groups for lp in (g["logprobs"] or [None] * len(g["responses"]))]
        for i, (response, lp) in enumerate(zip(responses, logged)):
            ids[i, : len(response)] = torch.tensor(response)
            mask[i, : len(response)] = 1
            if lp is not None:
                logprobs[i, : len(response)] = torch.tensor(lp, dtype=torch.float32)
        n = self.cfg.rollout.n
        out = RolloutOutput([g["prompt_ids"] for g in groups for _ in range(n)], ids, mask, logprobs)
        batch = rollout_batch(out, [i for i in mine for _ in range(n)], self.device)
        batch["scores"] = torch.tensor([s for g in groups for s in g["scores"]], dtype=torch.float32,
                                       device=self.device)
        return batch

    def _save_rollouts(self, step: int, batch: Batch) -> None:
        """runs/NAME/rollouts/step_N.parquet: every sample of the step (before filters), gathered over the actor's dp
        ranks and written by its first rank; data.rollouts_path reads it back."""
        pool = self.pools["actor"]
        texts = decode_responses(self.tokenizer, batch)
        rows = []
        for i, text in enumerate(texts):
            index, p_len, r_len = (int(batch[k][i]) for k in ("prompt_index", "prompt_len", "response_len"))
            item = self.train_set[index]
            rows.append({
                **item.get("columns", {}),  # the record's own columns (a reward reads them when it re-scores)
                "step": step, "group": f"{self.cfg.run.name}:{step}:{index}", "prompt": item["prompt_text"],
                "ground_truth": item.get("ground_truth"), "response": text,
                "prompt_ids": batch["input_ids"][i, :p_len].tolist(),
                "response_ids": batch["response_ids"][i, :r_len].tolist(), "score": float(batch["scores"][i]),
                "logprobs": batch["rollout_logprobs"][i, :r_len].tolist(), "temperature": self.cfg.rollout.temperature,
            })
            if self.envs is not None:  # the whole episode: its turns and observations, and which tokens are trained
                rows[-1].update({"response_mask": batch["response_mask"][i, :r_len].long().tolist(),
                                 "episode": self.last_episodes.transcripts[i],
                                 "env_reward": float(batch["env_reward"][i])})
        everyone: list = [None] * pool.dp_size
        dist.all_gather_object(everyone, rows, group=pool.dp_group)
        if pool.dp_rank == 0 and pool.tp_rank == 0:
            write_rollouts(os.path.join(self.run_dir, "rollouts", f"step_{step}.parquet"),
                           [row for part in everyone for row in part])

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

    def _check_engine(self) -> dict[str, float]:
        """After the first weight sync: the engine's log-probs of its own samples against the actor's teacher-forced
        ones on the first train prompts. A mean gap far beyond bf16 noise means the weights did not arrive as the
        actor has them (a name mapping or sleep-level bug): stop before training on them."""
        # without top-k / top-p: vLLM's log-probs are taken after the cut, the actor's before it, and the check
        # compares weights, not truncations
        whole = dataclasses.replace(self.train_params, top_p=1.0, top_k=0)
        batch = self._generate(self.train_set, list(range(min(8, len(self.train_set)))), whole)
        totals = torch.zeros(2, device=comm_device())
        if self.actor is not None:
            old = self.actor.log_probs(batch, self.cfg.rollout.temperature)
            mask = batch["response_mask"]
            if self.pools["actor"].tp_rank == 0:  # tp peers hold the same batch: count it once
                totals += torch.stack([((old - batch["rollout_logprobs"]).abs() * mask).sum(), mask.sum()]).to(
                    totals.device, torch.float32)
        dist.all_reduce(totals)  # every rank learns the gap, and stops on it together
        gap = float(totals[0] / totals[1].clamp(min=1))
        limit = self.cfg.rollout.vllm_max_logprob_gap
        if gap > limit:
            raise RuntimeError(f"the vLLM engine's log-probs differ from the actor's by {gap:.3f} nats per token on "
                               f"average (rollout.vllm_max_logprob_gap={limit}): its weights do not match the actor's")
        stats = self.rollout.engine.stats
        if self.rank == 0:
            log.info("vLLM engine: started in %.1f s, weights synced in %.3f s, log-prob gap %.4f nats per token",
                     stats["engine_init_s"], self.rollout.stats["reshard_s"], gap)
        return {"rollout/startup_logprob_gap": gap, "timing_s/engine_init": stats["engine_init_s"]}

    # ------------------------------------------------------------------------------------------------ eval
    def evaluate(self) -> tuple[dict[str, float], list[tuple[int, str, str, float, dict]]]:
        """Greedy (rollout.eval_temperature) responses to the held-out prompts, scored by the reward pool: the eval
        metrics and (prompt index, prompt, response, score, the verl compute_score dict's numbers) per sample."""
        if self.eval_set is None:
            return {}, []
        P = self.pools
        indices, taken = [], {}
        for i, item in enumerate(self.eval_set.items):  # the first data.eval_size prompts of each file
            taken[item["file"]] = taken.get(item["file"], 0) + 1
            if not self.cfg.data.eval_size or taken[item["file"]] <= self.cfg.data.eval_size:
                indices.append(i)
        batch = None
        if self.actor is not None or self.rollout is not None:
            batch = self._generate(self.eval_set, indices, self.eval_params)
        scoring = "reward" in P
        to_reward = transfer(batch, P["actor"], P["reward"], self.layout, self.device) if scoring else None
        scores, functions = {}, {}
        if self.reward is not None:
            s, reward_metrics, _ = self.reward.scores(to_reward, self.eval_set.items, training=False)
            # each sample's verl compute_score numbers (acc, ...) come back with its score, for eval_samples.jsonl
            scores = {"scores": s, **{f"extra/{k}": v.to(s.device) for k, v in self.reward.last_extras.items()}}
            # each reward function's mean, and a verl compute_score dict's other numbers (verl's val-aux)
            functions = {f"eval/{k}": v for k, v in reward_metrics.items() if k.startswith("reward/fn/")}
        # the prompts were dealt round-robin, so the actor ranks' shares differ by one: each asks for its own back
        rows = batch["input_ids"].shape[0] if batch is not None else None
        back = transfer(scores, P["reward"], P["actor"], self.layout, self.device, want=rows) if scoring else {}
        local: dict[str, float] = {}
        samples = []
        if self.actor is not None:
            s = back["scores"] if scoring else torch.zeros(rows, device=self.device)
            if "env_reward" in batch:
                s = s + batch["env_reward"]
            prompt_index = batch["prompt_index"].tolist()
            sources = [self.eval_set[i]["columns"].get("data_source") for i in prompt_index]
            sums = eval_sums(s.tolist(), batch["response_len"].tolist(), prompt_index, sources)
            shares: list = [None] * dist.get_world_size(P["actor"].dp_group)
            dist.all_gather_object(shares, sums, group=P["actor"].dp_group)
            local = eval_metrics(shares, self.eval_params.n)
            texts = decode_responses(self.tokenizer, batch)
            extras = {k.removeprefix("extra/"): v.tolist() for k, v in back.items()
                      if k.startswith("extra/") and not k.startswith("extra/text/")}
            extras.update({k.removeprefix("extra/text/"): decode_texts(v) for k, v in back.items()
                           if k.startswith("extra/text/")})
            if self.envs is not None:  # the episodes' turns per sample, and their metrics on the eval set
                extras["episode"] = self.last_episodes.transcripts
                local.update({f"eval/{k}": v for k, v in self._episode_metrics().items()})
            for i, text in enumerate(texts):
                index = int(batch["prompt_index"][i])
                samples.append((index, self.eval_set[index]["prompt_text"], text, float(s[i]),
                                {k: v[i] if v[i] == v[i] else None for k, v in extras.items()}))
        return {**local, **functions}, samples

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        start, before = self._resume()
        if self.rank == 0:  # only once the start is accepted: a refused one leaves the run's config as it was
            with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:  # the resolved config of this start
                yaml.safe_dump(C.to_dict(cfg), f, sort_keys=False)
        self.weights_version = start
        if self.rank == 0 and cfg.run.wandb:  # after the resume check: a refused resume leaves W&B untouched
            self.logger.open_wandb(fresh=start == 0, project=cfg.run.wandb_project, entity=cfg.run.wandb_entity,
                                   name=cfg.run.name, config=C.to_dict(cfg))
        startup = comm.bandwidth_check(self.layout, self.device) if cfg.comm.bandwidth_check else {}
        if cfg.rollout.engine == "vllm":
            startup.update(self._check_engine())
        startup["data/dropped_long_prompts"] = float(self.train_set.n_dropped_too_long)
        if start == 0:
            before = self._eval_and_log(0, gather_metrics(startup)).get("eval/score/mean", float("nan"))
        last: dict[str, float] = {}
        bar = self.logger.progress(start, self.total_steps) if self.logger is not None else None
        self.clock = (start, time.perf_counter())  # for the ETA of the console line
        for step in range(start + 1, self.total_steps + 1):
            began = time.perf_counter()
            if self.reward is not None:  # TRL-style rewards' trainer_state: the optimizer steps done so far
                self.reward.trainer_state = {"global_step": step - 1, "max_steps": self.total_steps}
            self.gpu.pop()  # what the eval or the save used belongs to no step
            with profiled(step == cfg.run.profile_step, self.run_dir, f"step{step}_rank{self.rank}"):
                local = self.step(step)
            local["timing_s/step"] = time.perf_counter() - began
            if step == start + 1:  # process start to this process's first step: imports, loading, eval
                local["timing_s/startup"] = process_age_s() - (time.perf_counter() - began)
            local["perf/max_memory_allocated_gb"] = memory_gb(self.device)
            local.update(self.comm_timer.pop(local["timing_s/step"]))
            local.update(self.gpu.pop())
            fullness = comm.device_memory_fraction(self.device)
            if fullness is not None:
                local["perf/memory_fraction"] = fullness
            merged = gather_metrics(local)
            if self.rank == 0:
                merged["perf/throughput"] = merged.pop("perf/total_tokens", 0.0) / merged["timing_s/step"] / \
                    self.layout.world_size
                merged["data/epoch"] = self.sampler.state_dict().get("epoch", 0)
                merged.update(self.health.check(merged))
            if step == self.total_steps or (cfg.run.eval_every and step % cfg.run.eval_every == 0):
                last = self._eval_and_log(step, merged)
            elif self.rank == 0:
                self._emit(step, merged)
            if bar is not None:
                bar.update(1)
            signalled, diverged = self._stop_flags()
            every = cfg.checkpoint.save_every
            if step == self.total_steps or signalled or (every and step % every == 0):
                self._save(step, before, final=step == self.total_steps or signalled)
            if diverged:
                raise RuntimeError(f"the actor skipped {cfg.checkpoint.max_skipped_steps} optimizer steps in a row "
                                   "(non-finite loss or gradient norm); stopping. The last checkpoint is intact.")
            if signalled:
                self.finish_save()
                log.info("stop signal received: saved step %d, exiting", step)
                break
        if bar is not None:
            bar.close()
        if self.rank == 0:
            self._write_summary()
        self.close()
        return {"before": before, "after": last.get("eval/score/mean", float("nan"))}

    def _write_summary(self) -> None:
        """runs/NAME/summary.json and its table on the console: the whole run's report, from metrics.jsonl (the run
        has finished: a report that cannot be written is a warning, not a failure)."""
        try:
            summary = run_summary(read_metrics_file(self.run_dir))
            with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
        except (OSError, ValueError, KeyError) as e:
            log.warning("no run summary: %s", e)
            return
        print(summary_table(summary), flush=True)

    def close(self) -> None:
        self.gpu.close()
        for role in self._trainers().values():
            role.replicas.flush()
        if self.reward is not None:
            self.reward.close()
        if self.envs is not None:
            self.envs.close()
        if self.logger is not None:
            self.logger.close()

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _trained_roles(self) -> dict:
        return {name: (role.model, role.optimizer, self.pools[name].io_group)
                for name, role in self._trainers().items()}

    def _stop_flags(self) -> tuple[bool, bool]:
        """(a stop signal arrived on some rank, the actor skipped too many steps in a row): agreed by every rank."""
        skips = self.actor.skips_in_a_row if self.actor is not None else 0
        flags = torch.tensor([float(checkpoint.STOP_SIGNAL["received"]),
                              float(skips >= self.cfg.checkpoint.max_skipped_steps)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _save(self, step: int, before: float, final: bool) -> None:
        """Checkpoint `step` (every rank). A save that fails (a full disk) is removed and, unless `final` (the last
        step, or a stop signal: agreed by every rank), logged while training goes on; a final one raises SaveError."""
        began = time.perf_counter()
        local = {}
        if self.actor is not None:  # the controllers' state lives where the actor's step updates it
            local["actor"] = {"step_count": self.actor.step_count, "lr_scale": self.actor.lr_scale,
                              "skips_in_a_row": self.actor.skips_in_a_row, "kl_ctl": self.kl_ctl.state_dict(),
                              "guard": self.guard.state_dict()}
        if self.critic is not None:
            local["critic"] = {"step_count": self.critic.step_count}
        trainer_state = {
            "step": step, "world_size": self.layout.world_size, "eval_before": before,
            "roles": checkpoint.gather_role_state(local), "sampler": self.sampler.state_dict(),
            "config": yaml.safe_dump(C.to_dict(self.cfg)),  # what scripts/export_hf.py needs to rebuild the model
            "data_files": self.data_files,
        }
        rank_state = {"rng": checkpoint.rng_state({"gen": self.gen_rng, "cpu": self.cpu_rng}),
                      "comm": {name: role.replicas.state_dict() for name, role in self._trainers().items()}}
        if self.replay is not None:
            rank_state["replay"] = self.replay.state_dict()
        try:
            self.finish_save()  # the previous checkpoint, if it is still being written
        except checkpoint.SaveError as e:
            if self.rank == 0:
                log.warning("%s", e)
        try:
            self.pending_save = checkpoint.save(self.ckpt_root, step, self._trained_roles(), rank_state,
                                                trainer_state, self.cfg.checkpoint.keep_last,
                                                self.cfg.checkpoint.async_save)
            if self.rank == 0:
                how = "staged (writing in the background)" if self.cfg.checkpoint.async_save else "saved"
                log.info("%s checkpoint %s in %.2f s", how, self.pending_save.final, time.perf_counter() - began)
            if self.cfg.checkpoint.async_save and step == self.total_steps:
                self.finish_save()
        except checkpoint.SaveError as e:
            self.pending_save = None
            if final:
                raise  # the run ends here: its last state would be lost, so say so with a failing exit code
            if self.rank == 0:
                log.warning("%s. Training goes on; the next save tries again.", e)

    def _trainers(self) -> dict:
        return {name: role for name, role in (("actor", self.actor), ("critic", self.critic)) if role is not None}

    def finish_save(self) -> None:
        """Complete a background checkpoint write, if one is under way (every rank calls)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.finish()

    def _resume(self) -> tuple[int, float]:
        """Load the newest readable checkpoint (checkpoint.resume); returns (its step, eval score before training),
        or (0, nan) for a fresh start."""
        began = time.perf_counter()
        found = checkpoint.resume(self.ckpt_root, self.cfg.checkpoint.resume, self._trained_roles())
        if found is None:
            if self.rank == 0:  # what an attempt that never saved logged is not part of this run
                self.logger.truncate_after(-1)
            return 0, float("nan")
        path, state, mine = found
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as e:  # the same on every rank: the data, not the checkpoint, changed
            key = "data.rollouts_path" if self.offline else "data.train_path"
            raise C.ConfigError(f"resuming {path}: the training data is not what the checkpoint saw ({e}); {key} "
                                f"now holds {len(self.train_set)} prompts. Restore the data, or start a new run "
                                "(another run.name)") from e
        self._check_data_files(path, state.get("data_files"))  # the same number of prompts, other contents
        roles = state["roles"]
        # checkpoints written before 2026-12-01 kept the controllers at the top level (from rank 0)
        self.kl_ctl.load_state_dict(roles["actor"].get("kl_ctl", state.get("kl_ctl")))
        self.guard.load_state_dict(roles["actor"].get("guard", state.get("guard")))
        for name, role in self._trainers().items():
            for key, value in roles[name].items():
                if key not in ("kl_ctl", "guard"):
                    setattr(role, key, value)
        if mine is not None:
            checkpoint.restore_rng(mine["rng"], {"gen": self.gen_rng, "cpu": self.cpu_rng})
            if self.replay is not None and "replay" in mine:
                self.replay.load_state_dict(mine["replay"])
            for name, role in self._trainers().items():
                if name in mine.get("comm", {}):
                    role.replicas.load_state_dict(mine["comm"][name])
        elif self.rank == 0:
            log.warning("checkpoint %s was written by %d ranks, this run has %d: weights and optimizer resharded by "
                        "DCP; per-rank random streams, replay buffers and gradient-communication state start afresh",
                        path, state["world_size"], self.layout.world_size)
        if state["step"] >= self.total_steps:
            raise C.ConfigError(
                f"run {self.cfg.run.name!r} has already finished: its checkpoint {path} is at step {state['step']} "
                f"and run.total_steps is {self.total_steps}, so there is nothing to train. To train on, raise "
                "run.total_steps; to start a new run, pick another run.name (or run.output_dir)")
        changed = C.config_changes(yaml.safe_load(state["config"]), C.to_dict(self.cfg))
        allowed = set(self.cfg.checkpoint.allow_config_change)
        refused = [c for c in changed if c.split(":")[0] in C.RESUME_PROTECTED and c.split(":")[0] not in allowed]
        if refused:  # the same on every rank: the saved config and this one are
            keys = ",".join(c.split(":")[0] for c in refused)
            raise C.ConfigError(
                f"resuming {path} would change what its run means: {'; '.join(refused)}. Nothing was trained or "
                f"written. Start a new run (another run.name), or accept it with "
                f"checkpoint.allow_config_change=[{keys}]")
        if self.rank == 0:
            if changed:
                log.warning("resuming %s with a changed config: %s", path, "; ".join(changed))
            log.info("resumed from %s (step %d) in %.2f s", path, state["step"], time.perf_counter() - began)
            self.logger.truncate_after(state["step"])
        return state["step"], state["eval_before"]

    def _check_data_files(self, path: str, saved: dict | None) -> None:
        """Offline: the rollout files are the ones the checkpoint trained on (size and content hash), unless
        checkpoint.allow_config_change lists data.rollouts_path. Checkpoints without fingerprints pass."""
        if not self.offline or saved is None:
            return
        now = self.data_files
        changed = []
        for f in sorted(set(saved) | set(now)):
            if f not in now:
                changed.append(f"{f} was read then and is not now")
            elif f not in saved:
                changed.append(f"{f} is new")
            elif list(saved[f]) != list(now[f]):
                changed.append(f"{f} changed ({saved[f][0]} -> {now[f][0]} bytes, sha256 {saved[f][1][:12]} -> "
                               f"{now[f][1][:12]})")
        if not changed:
            return
        if "data.rollouts_path" not in self.cfg.checkpoint.allow_config_change:  # the same on every rank
            raise C.ConfigError(
                f"resuming {path}: the rollout files are not the ones it trained on: {'; '.join(changed)}. Nothing "
                "was trained or written. Restore them, start a new run (another run.name), or accept them with "
                "checkpoint.allow_config_change=[data.rollouts_path]")
        if self.rank == 0:
            log.warning("resuming %s with changed rollout files (allowed): %s", path, "; ".join(changed))

    def _eval_and_log(self, step: int, merged: dict[str, float] | None = None) -> dict[str, float]:
        if self.reward is not None:
            self.reward.trainer_state = {"global_step": step, "max_steps": self.total_steps}
        local, samples = self.evaluate()
        ev = gather_metrics(local)
        everyone: list = [None] * self.layout.world_size
        dist.all_gather_object(everyone, samples)
        if self.rank != 0:
            return {}
        merged = {**(merged or {}), **ev}
        self._emit(step, merged)
        samples = sorted((s for part in everyone for s in part), key=lambda s: s[:4])
        self.logger.samples(step, [{"prompt": p, "response": r, "score": sc, **extra}
                                   for _, p, r, sc, extra in samples])
        for _, prompt, response, score, _ in samples[:4]:
            self.logger.text("eval/samples", f"**prompt** {prompt!r}  \n**response** {response!r}  \n"
                                             f"**score** {score:.3f}", step)
        return ev

    def _emit(self, step: int, merged: dict[str, float]) -> None:
        self.logger.log(step, merged)
        if step % self.cfg.run.log_every == 0 or step == self.total_steps:
            eta = None
            if self.clock is not None and step > self.clock[0]:
                first, began = self.clock
                eta = (time.perf_counter() - began) / (step - first) * (self.total_steps - step)
            self.logger.console(step, self.total_steps, merged, eta)


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


def setup(cfg: C.Config, rank: int) -> C.Config:
    """Quickstart assets (built once by rank 0 while the others wait), then the data files must exist."""
    if cfg.quickstart.enabled:
        if rank == 0:
            from tasks.quickstart import prepare_quickstart

            prepare_quickstart(cfg.quickstart, cfg.run.seed)
        dist.barrier()
    return cfg


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_libraries()
    rank, world, _ = env_world()
    if "--plan" in argv:  # the memory and placement planner: a dry run, no process group, no weights (plan.py)
        import plan

        return plan.main(argv, world, rank)
    cfg = C.parse_or_exit(argv, world, rank)
    run_dir = os.path.join(cfg.run.output_dir, cfg.run.name)
    comm.apply_comm_env(cfg.comm, run_dir, rank)
    info = comm.init_with_fallback(
        lambda: init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s, cfg.run.device),
        cfg.comm, run_dir, rank)
    torch.manual_seed(cfg.run.seed)
    setup(cfg, info.rank)
    layout = build_layout(C.pools_of(cfg, info.world_size), info.device.type)
    if info.rank == 0:
        print(layout.describe(C.required_roles(cfg)), flush=True)
    try:
        trainer = PPOTrainer(cfg, layout, info.device)
    except ValueError as e:  # bad data or reward spec: every rank hits it, before any step
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        shutdown()
        return 2
    # from here a stop signal means "save and exit"; until now (loading data and models, nothing to save) the
    # default action stops the process at once, even inside the tokenizer
    signal.signal(signal.SIGTERM, checkpoint.on_stop_signal)
    signal.signal(signal.SIGUSR1, checkpoint.on_stop_signal)
    signal.signal(signal.SIGINT, checkpoint.on_interrupt)
    try:
        result = trainer.fit()
    except (C.ConfigError, checkpoint.ResumeError) as e:  # a finished run started again, unreadable checkpoints:
        # nothing was trained or written
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        trainer.close()
        shutdown()
        return 2
    except checkpoint.SaveError as e:  # the final checkpoint could not be written (a full disk)
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        trainer.close()
        shutdown()
        return 1
    if info.rank == 0:
        before, after = result["before"], result["after"]
        if after == after:
            print(f"eval/score/mean: {before:.3f} at the start -> {after:.3f} at the end", flush=True)
        elif before == before:  # run.total_steps=0 (an evaluation of the start model), or a resume at the end
            print(f"eval/score/mean: {before:.3f} (no step trained)", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training set up its handler
        if os.environ.get("RANK", "0") == "0":
            print("interrupted: stopped at once, without saving; the last complete checkpoint is intact (a partial "
                  "one is removed at the next start)", file=sys.stderr, flush=True)
        code = 130
    exit_process(code)

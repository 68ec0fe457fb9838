"""The run loop around PPOTrainer.step (ppo/trainer.py), mixed into PPOTrainer: resume, the steps with their
metrics, the eval cadence and the evaluation itself, logging to metrics.jsonl / TensorBoard / W&B and the console,
saves, stop signals, the run's summary and the final close."""
from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.distributed as dist
import yaml

import checkpoint
import compile_cache
import config as C
from monitor import (
    eval_metrics,
    eval_sums,
    gather_metrics,
    memory_gb,
    process_age_s,
    profiled,
    read_metrics_file,
    run_summary,
    summary_table,
)
from parallel import comm
from parallel.transfer import transfer
from roles.reward import decode_responses, decode_texts

log = logging.getLogger("meshrl")


class RunLoop:
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
            ck = cfg.checkpoint
            if checkpoint.due(step, self.total_steps, ck.save_every, ck.save_final, signalled):
                self._save(step, before, final=step == self.total_steps or signalled)
            if diverged:
                raise RuntimeError(f"the actor skipped {cfg.checkpoint.max_skipped_steps} optimizer steps in a row "
                                   "(non-finite loss or gradient norm); stopping. The last checkpoint is intact.")
            if step - start == compile_cache.SAVE_AFTER_STEP:
                self._save_compiled()
            if signalled:
                self.finish_save()
                if self.rank == 0:  # every rank stops here; one line says so
                    log.info("stop signal received: saved step %d, exiting", step)
                break
        self.finish_save()  # a background save_every checkpoint still being written (save_final false)
        self._save_compiled()  # what the last steps and the final evaluation compiled besides
        if bar is not None:
            bar.close()
        if self.rank == 0:
            self._write_summary()
        self.close()
        return {"before": before, "after": last.get("eval/score/mean", float("nan"))}

    def _save_compiled(self) -> None:
        """run.compile_cache: this rank's torch.compile artifacts to its file, for the next run (GPU only)."""
        folder = C.compile_cache_folder(self.cfg)
        if folder and self.device.type == "cuda":
            said = compile_cache.save(compile_cache.cache_file(folder, self.rank, self.layout.world_size, self.device))
            if said and (self.rank == 0 or "could not" in said):
                log.info("%s", said)

    def evaluate(self, step: int = 0) -> tuple[dict[str, float], list[tuple[int, str, str, float, dict]]]:
        """Greedy (rollout.eval_temperature) responses to the held-out prompts, scored by the reward pool: the eval
        metrics and (prompt index, prompt, response, score, the verl compute_score dict's numbers) per sample. They
        are sampled from a stream of their own (side_rng(step)): an evaluation leaves training's draws as they were,
        so a run resumed after one trains as a run that never evaluated there."""
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
            batch = self._generate(self.eval_set, indices, self.eval_params, self.side_rng(step))
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

    def _eval_and_log(self, step: int, merged: dict[str, float] | None = None) -> dict[str, float]:
        if self.reward is not None:
            self.reward.trainer_state = {"global_step": step, "max_steps": self.total_steps}
        local, samples = self.evaluate(step)
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

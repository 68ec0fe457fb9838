"""The rollout phase of a PPO step (step 1 of ppo/trainer.py's PPOTrainer.step), mixed into PPOTrainer: the
prompts of this actor dp rank sampled on the actor's engine or the engines laid out over the world
(rollout/world.py), as single responses or multi-turn episodes with environments (rollout/episodes.py), offline
groups replayed from files, the samples saved, the vLLM engine's start-up check. Reads the trainer's cfg, pools,
roles, engines, environments and random streams (set up in PPOTrainer.__init__)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import config as C
from batch import Batch
from parallel.distributed import anyone, comm_device
from parallel.fsdp import DTYPES
from parallel.layout import Layout
from roles.actor import native_engine_options
from roles.reward import decode_responses
from rollout.episodes import SharedEnvironments, episode_record, run_episodes
from rollout.native import RolloutOutput, SamplingParams
from rollout.world import Replica, WorldRollout, units_in_blocks, units_of_split
from tasks.data import PromptDataset
from tasks.environments import EnvironmentPool
from tasks.offline import write_rollouts

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


class RolloutPhase:
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

    def _set_reshard(self, seconds: float) -> None:
        """What _engine_stats reports as timing_s/reshard for the rollout just done (an episode's turns summed)."""
        (self.rollout.stats if self.rollout is not None else self.actor.engine.stats)["reshard_s"] = seconds

    def side_rng(self, step: int) -> torch.Generator:
        """A sampling stream for generation beside training (the evaluation at `step`, the engine check: -1), drawn
        from the engine's seed and `step` alone: it neither takes from gen_rng nor depends on where a run resumed."""
        seed = (self.engine_seed * 1_000_033 + 7_919 * (step + 2)) % 2**63
        return torch.Generator(device=self.gen_rng.device).manual_seed(seed)

    def _generate(self, dataset: PromptDataset, indices: list[int], params: SamplingParams,
                  rng: torch.Generator | None = None) -> Batch | None:
        """This actor dp rank's share of `indices`, sampled (from `rng`, by default the training stream gen_rng);
        None on ranks outside the actor's pool (which join a world rollout)."""
        pool = self.pools["actor"]
        mine = indices[pool.dp_rank :: pool.dp_size] if self.actor is not None else []
        if C.episodes(self.cfg):
            return self._episodes(dataset, mine, params, rng)
        out = self._sample([dataset[i]["prompt_ids"] for i in mine] if self.actor is not None else None, params, rng)
        if self.actor is None:
            return None
        return rollout_batch(out, [i for i in mine for _ in range(params.n)], self.device)

    def _generate_partial(self, indices: list[int], step: int) -> Batch:
        """Partial rollouts (rollout/partial.py): this actor dp rank's share of `indices` and the samples the last
        step left unfinished, in one call that may end at its tail; the groups that ended, as the step's batch.
        Sets self.partial_metrics (this step's counts and staleness, over the actor's dp ranks)."""
        pool, r = self.pools["actor"], self.cfg.rollout
        mine = indices[pool.dp_rank :: pool.dp_size]
        call = self.partial.call([(i, self.train_set[i]["prompt_ids"]) for i in mine], step)
        params = dataclasses.replace(self.train_params, tail_share=r.partial_tail, finish_first=call.finish_first)
        out = self.actor.generate(call.prompts, params, self.gen_rng, max_new_tokens=call.limits,
                                  samples=call.samples)
        groups, counts = self.partial.collect(call, out, step)
        out, index, born = self.partial.output(groups, self.pad)
        staleness = (step - born).float()
        counts.update(trained_groups=len(groups), staleness_sum=float(staleness.sum()), trained_samples=len(born))
        sums = dict(zip(counts, self.dp_reduce(torch.tensor(list(counts.values()), dtype=torch.float64)).tolist()))
        most = self.dp_reduce(staleness.max() if len(born) else torch.zeros(()), "max")
        self.partial_metrics = {f"rollout/partial/{k}": sums[k]
                                for k in ("continued", "unfinished", "carried_groups", "trained_groups")}
        self.partial_metrics["rollout/partial/staleness_mean"] = sums["staleness_sum"] / max(sums["trained_samples"], 1)
        self.partial_metrics["rollout/partial/staleness_max"] = float(most)
        return rollout_batch(out, index, self.device)

    def _sample(self, prompts: list[list[int]] | None, params: SamplingParams,
                rng: torch.Generator | None = None) -> RolloutOutput | None:
        """One generate call: on the engines laid out over the world (every rank calls, None outside the actor's
        pool), or on the actor's own engine."""
        rng = self.gen_rng if rng is None else rng
        if self.rollout is not None:
            return self.rollout.generate(prompts, params, rng, self.weights_version)
        return self.actor.generate(prompts, params, rng)

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

    def _episodes(self, dataset: PromptDataset, mine: list[int], params: SamplingParams,
                  rng: torch.Generator | None = None) -> Batch | None:
        """Multi-turn episodes (rollout/episodes.py) of this dp rank's prompts; on ranks outside the actor's pool
        (a world rollout) their generate calls, one per turn, as long as some episode runs."""
        r = self.cfg.rollout
        group = None if self.rollout is not None else self.pools["actor"].group
        # the weight sync's seconds, summed over the turns (a world rollout syncs in its first call only, and its
        # stats hold the last call's)
        reshard = 0.0
        if self.actor is None:
            for _ in range(r.max_turns):
                if not anyone(False, group):
                    break
                self._sample(None, dataclasses.replace(params, n=1), rng)
                reshard += self._engine_stats()[0]
            self._set_reshard(reshard)
            return None
        turns: dict[str, float] = {}  # the engine's counters and phase times of its calls, summed over the turns

        def sample(prompts: list[list[int]], turn_params: SamplingParams) -> RolloutOutput:
            nonlocal reshard
            out = self._sample(prompts, turn_params, rng)
            reshard_s, stats = self._engine_stats()
            reshard += reshard_s
            for key, value in stats.items():
                if key in ("reshard_s", "engine_init_s"):  # the sync's, summed above; the engine's start, once
                    continue
                if key.endswith("_s") or key in ("prefills", "decode_steps", "continued", "continued_tokens"):
                    turns[key] = turns.get(key, 0.0) + value
            return out

        episodes = run_episodes(
            sample, [dataset[i]["prompt_ids"] for i in mine], [episode_record(dataset[i]) for i in mine],
            self.envs, self.observe, params, max_turns=r.max_turns, max_tokens=C.response_budget(self.cfg),
            reward_mode=r.episode_reward, decode=lambda t: self.tokenizer.decode(t, skip_special_tokens=True),
            any_running=lambda flag: anyone(flag, group), max_prompt_tokens=self.cfg.data.max_prompt_len)
        self._engine_stats()[1].update(turns)  # the step's timing_s/gen_* cover every turn
        self._set_reshard(reshard)
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

    def _check_engine(self) -> dict[str, float]:
        """After the first weight sync: the engine's log-probs of its own samples against the actor's teacher-forced
        ones on the first train prompts. A mean gap far beyond bf16 noise means the weights did not arrive as the
        actor has them (a name mapping or sleep-level bug): stop before training on them."""
        # without top-k / top-p: vLLM's log-probs are taken after the cut, the actor's before it, and the check
        # compares weights, not truncations
        whole = dataclasses.replace(self.train_params, top_p=1.0, top_k=0)
        batch = self._generate(self.train_set, list(range(min(8, len(self.train_set)))), whole, self.side_rng(-1))
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

"""Checkpoints of a PPO run, mixed into PPOTrainer (ppo/trainer.py): what is saved beside the trained roles'
weights and optimizers (controllers, sampler, random streams, replay buffer, gradient-communication state, the
config), the checks a resume makes before anything is trained (finished runs, changed data, protected config
changes), and the stop flags every rank agrees on. The files and their format: checkpoint.py."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import yaml

import checkpoint
import config as C

log = logging.getLogger("meshrl")


class SaveResume:
    def _trained_roles(self) -> dict:
        return {name: (role.model, role.optimizer, self.pools[name].io_group)
                for name, role in self._trainers().items()}

    def _trainers(self) -> dict:
        return {name: role for name, role in (("actor", self.actor), ("critic", self.critic)) if role is not None}

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
        if self.partial is not None:  # with the actor's layout: another one deals the prompts to other ranks
            pool = self.pools["actor"]
            rank_state["partial"] = {**self.partial.state_dict(), "layout": [pool.dp_rank, pool.dp_size, pool.tp]}
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
            if self.partial is not None and "partial" in mine:
                pool, saved = self.pools["actor"], mine["partial"]
                if saved["layout"] == [pool.dp_rank, pool.dp_size, pool.tp]:
                    self.partial.load_state_dict(saved)
                elif saved["carried"]:
                    log.warning("rank %d: the %d groups partial rollouts carried at step %d are dropped: the actor's "
                                "layout changed (dp rank, dp size, tp %s, now %s)", self.rank, len(saved["carried"]),
                                state["step"], saved["layout"], [pool.dp_rank, pool.dp_size, pool.tp])
            for name, role in self._trainers().items():
                if name in mine.get("comm", {}):
                    role.replicas.load_state_dict(mine["comm"][name])
        elif self.rank == 0:
            log.warning("checkpoint %s was written by %d ranks, this run has %d: weights and optimizer resharded by "
                        "DCP; per-rank random streams, replay buffers, gradient-communication state and the samples "
                        "partial rollouts carried start afresh",
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

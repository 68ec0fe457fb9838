"""Supervised fine-tuning on TRL's SFT formats (prompt/response or prompt/completion: the loss on the response; a
`messages` conversation: the loss on the assistant turns), with the same FSDP2 path as PPO.

    python train_sft.py --config configs/sft.yaml            # or under torchrun
Saves an HF folder (config, safetensors, tokenizer) at sft.output_dir that a PPO config's model.path can name; with
actor.lora, a peft adapter folder there that a PPO config's actor.lora.init_path can name (model.path the same base).
The run folder (run.output_dir/run.name) holds metrics.jsonl, TensorBoard events and config.yaml as train_ppo.py's,
and checkpoints: SIGTERM, SIGUSR1 or Ctrl-C saves one and exits; the same command then goes on from it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import yaml

import checkpoint
import config as C
from monitor import MetricsLogger, gather_metrics, lock_run_dir, quiet_libraries
from parallel.distributed import anyone, env_world, exit_process, init_distributed, shutdown
from parallel.fsdp import shard_model
from parallel.layout import build_layout
from roles.lora import apply_lora, save_adapter_folder
from roles.modeling import load_causal_lm
from roles.sft import encode_pairs, save_hf, sft_eval_loss, sft_step
from roles.update_loop import lr_factor
from tasks.char_tokenizer import load_tokenizer
from tasks.data import load_sft_records

log = logging.getLogger("meshrl")
CONSOLE_KEYS = ("sft/loss", "eval/loss", "sft/grad_norm", "sft/lr", "timing_s/step")
# what an SFT checkpoint means: resuming with another of these would train something else
PROTECTED = ("model.path", "sft.train_path", "sft.prompt_key", "sft.response_key", "sft.messages_key",
             "sft.batch_size", "data.chat_template", "data.system_prompt", "data.chat_template_kwargs",
             "actor.lora.rank", "actor.lora.alpha",
             "actor.lora.target_modules", "actor.lora.modules_to_save")


def load_data(cfg: C.Config, tokenizer) -> tuple[list, list]:
    """(train, held-out) encoded records (roles.sft.encode_pairs); ValueError for bad data."""
    s = cfg.sft
    template = dict(chat_template=cfg.data.chat_template, system_prompt=cfg.data.system_prompt,
                    template_kwargs=cfg.data.chat_template_kwargs)
    train = encode_pairs(load_sft_records(s.train_path, s.prompt_key, s.response_key, s.messages_key), tokenizer,
                         **template)
    held_out = encode_pairs(load_sft_records(s.eval_path, s.prompt_key, s.response_key, s.messages_key),
                            tokenizer, **template) if s.eval_path else []
    return train, held_out


def resume(cfg: C.Config, root: str, roles: dict, generator: torch.Generator) -> int:
    """The step of the newest readable checkpoint of the run, loaded (weights, optimizer, the batch draws' and this
    rank's random state), or 0. ConfigError (every rank) for a finished run or a changed meaning."""
    found = checkpoint.resume(root, cfg.checkpoint.resume, roles)
    if found is None:
        return 0
    path, state, mine = found
    if state["step"] >= cfg.sft.steps:
        raise C.ConfigError(f"run {cfg.run.name!r} has already finished: its checkpoint {path} is at step "
                            f"{state['step']} and sft.steps is {cfg.sft.steps}. To train on, raise sft.steps; to "
                            "start over, pick another run.name (or run.output_dir)")
    changed = C.config_changes(yaml.safe_load(state["config"]), C.to_dict(cfg))
    allowed = set(cfg.checkpoint.allow_config_change)
    refused = [c for c in changed if c.split(":")[0] in PROTECTED and c.split(":")[0] not in allowed]
    if refused:
        keys = ",".join(c.split(":")[0] for c in refused)
        raise C.ConfigError(f"resuming {path} would change what its run means: {'; '.join(refused)}. Start a new "
                            f"run (another run.name), or accept it with checkpoint.allow_config_change=[{keys}]")
    generator.set_state(state["generator"])
    if mine is not None:
        checkpoint.restore_rng(mine["rng"], {})
    if dist.get_rank() == 0:
        if changed:
            log.warning("resuming %s with a changed config: %s", path, "; ".join(changed))
        log.info("resumed from %s (step %d)", path, state["step"])
    return state["step"]


def give_up(error: Exception, code: int, rank: int, lock) -> int:
    """One line on rank 0, the run folder's lock let go, the process group shut down: the exit code to return."""
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    if lock is not None:
        lock.close()
    shutdown()
    return code


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_libraries()
    rank, world, _ = env_world()
    cfg = C.parse_or_exit(argv, world, rank, check=C.check_sft)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s, cfg.run.device)
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
        train, held_out = load_data(cfg, tokenizer)
    except (ValueError, OSError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        shutdown()
        return 2
    layout = build_layout([C.PoolConfig("all", world, ["actor"], cfg.placement.tp, cfg.placement.dp_replicate)],
                          info.device.type)
    pool = layout.pools[0]
    torch.manual_seed(cfg.run.seed)
    model = load_causal_lm(cfg.model.path, cfg.model.trust_remote_code).to(info.device)
    # actor.lora: the adapters train (their folder is saved, for a PPO run's actor.lora.init_path)
    adapters = apply_lora(model, cfg.actor.lora, cfg.actor.fsdp.param_dtype)
    model = shard_model(adapters.model if adapters is not None else model, pool, cfg.actor.fsdp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sft.lr)
    generator = torch.Generator().manual_seed(cfg.run.seed)  # the batches' draws: the same on every rank

    run_dir = os.path.join(cfg.run.output_dir, cfg.run.name)
    lock, holder = lock_run_dir(run_dir) if rank == 0 else (None, None)
    logger, start = None, 0
    roles = {"sft": (model, optimizer, pool.io_group)}
    root = os.path.join(run_dir, "checkpoints")
    try:
        if anyone(holder is not None):
            raise C.ConfigError(f"the run folder {run_dir} is in use by a live run ({holder}); wait for it to end "
                                "or pick another run.name")
        if rank == 0:
            for name in checkpoint.remove_partial(root):
                log.warning("removed %s, a checkpoint an earlier run did not finish writing", name)
        start = resume(cfg, root, roles, generator)
    except (C.ConfigError, checkpoint.ResumeError) as e:
        return give_up(e, 2, rank, lock)
    if rank == 0:
        logger = MetricsLogger(run_dir, cfg.run.tensorboard, console_keys=cfg.run.console_keys)
        logger.truncate_after(start if start else -1)  # what was logged after the checkpoint is done again
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(C.to_dict(cfg), f, sort_keys=False)
        print(f"sft: {len(train)} training records, {len(held_out)} held out; metrics in {run_dir}/metrics.jsonl"
              + (f"; resuming at step {start}" if start else ""), flush=True)

    def emit(step: int, metrics: dict) -> None:
        if logger is None:
            return
        logger.log(step, metrics)
        if step % cfg.run.log_every == 0 or step == cfg.sft.steps or "eval/loss" in metrics:
            logger.console(step, cfg.sft.steps, metrics, keys=None if cfg.run.console_keys else CONSOLE_KEYS)

    steps, s = cfg.sft.steps, cfg.sft
    if start == 0 and held_out:
        emit(0, {"eval/loss": sft_eval_loss(model, held_out, s.batch_size, info.device, pool)})
    # from here a stop signal means "save and exit" (as in train_ppo.py); the handlers are put back at the end
    checkpoint.STOP_SIGNAL.clear()
    checkpoint.STOP_SIGNAL["received"] = False
    previous = {sig: signal.signal(sig, handler) for sig, handler in (
        (signal.SIGTERM, checkpoint.on_stop_signal), (signal.SIGUSR1, checkpoint.on_stop_signal),
        (signal.SIGINT, checkpoint.on_interrupt))}
    bar = logger.progress(start, steps) if logger is not None else None
    stopped = False
    try:
        model.train()
        for step in range(start + 1, steps + 1):
            began = time.perf_counter()
            lr = s.lr * lr_factor(step - 1, s, steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, norm = sft_step(model, optimizer, train, s.batch_size, generator, info.device, pool)
            local = {"sft/loss": loss, "sft/grad_norm": norm, "sft/lr": lr,
                     "timing_s/step": time.perf_counter() - began}
            if held_out and (step == steps or (s.eval_every and step % s.eval_every == 0)):
                local["eval/loss"] = sft_eval_loss(model, held_out, s.batch_size, info.device, pool)
            emit(step, gather_metrics(local))
            if bar is not None:
                bar.update(1)
            stopped = anyone(checkpoint.STOP_SIGNAL["received"])
            # the end's checkpoint unless checkpoint.save_final is false (the model is saved below either way)
            if checkpoint.due(step, steps, cfg.checkpoint.save_every, cfg.checkpoint.save_final, stopped):
                trainer_state = {"step": step, "world_size": world, "generator": generator.get_state(),
                                 "config": yaml.safe_dump(C.to_dict(cfg))}
                checkpoint.save(root, step, roles, {"rng": checkpoint.rng_state({})}, trainer_state,
                                cfg.checkpoint.keep_last)
            if stopped:
                if rank == 0:
                    log.info("stop signal received: saved step %d; run the same command again to go on", step)
                break
    except checkpoint.SaveError as e:  # a full disk: the last good checkpoint is named
        return give_up(e, 1, rank, lock)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if bar is not None:
            bar.close()
        if logger is not None:
            logger.close()
        if lock is not None and sys.exc_info()[0] is not None:
            lock.close()
    if not stopped:
        if adapters is not None:
            save_adapter_folder(adapters, cfg.model.path, cfg.actor.lora, tokenizer, cfg.sft.output_dir, rank,
                                cfg.model.trust_remote_code)
        else:
            save_hf(model, tokenizer, cfg.sft.output_dir, rank)
        dist.barrier()
        if rank == 0:
            print(f"saved {cfg.sft.output_dir}", flush=True)
    if lock is not None:
        lock.close()
    shutdown()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once
        if os.environ.get("RANK", "0") == "0":
            print("interrupted: stopped at once, without saving; the last complete checkpoint is intact",
                  file=sys.stderr, flush=True)
        code = 130
    exit_process(code)

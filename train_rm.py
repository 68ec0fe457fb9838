"""Reward-model training on preference pairs (Bradley-Terry loss), with the same FSDP2 path as PPO.

    python train_rm.py --config configs/rm_quickstart.yaml            # or under torchrun
Saves an HF sequence-classification folder (config, safetensors, tokenizer) at rm.output_dir that a PPO config's
reward.model_path can name; metrics go to runs/NAME/metrics.jsonl (and TensorBoard) as PPO's do.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist
import yaml
from transformers import AutoModelForSequenceClassification

import config as C
from monitor import MetricsLogger, quiet_libraries
from parallel.distributed import env_world, exit_process, init_distributed, shutdown
from parallel.fsdp import shard_model
from parallel.layout import build_layout
from roles.rm import encode_preferences, hold_out, load_reward_model, train_reward_model
from roles.sft import save_hf
from tasks.char_tokenizer import load_tokenizer
from tasks.data import load_preference_records, padding_id

log = logging.getLogger("meshrl")
CONSOLE_KEYS = ("rm/loss", "rm/accuracy", "eval/accuracy", "eval/margin/mean", "eval/loss")


def load_pairs(cfg: C.Config, tokenizer, rank: int = 0) -> tuple[list, list, int]:
    """(train pairs, held-out pairs, pairs dropped as longer than rm.max_len); ValueError for bad data. Pairs with no
    signal are dropped too, with a warning (from rank 0) naming them."""
    rm = cfg.rm
    keys = (rm.prompt_key, rm.chosen_key, rm.rejected_key, rm.margin_key)
    records = load_preference_records(rm.train_path, *keys)
    if rm.eval_path is not None:
        train, held_out = records, load_preference_records(rm.eval_path, *keys)
    else:
        train, held_out = hold_out(records, rm.eval_fraction, cfg.run.seed)
    template = dict(chat_template=cfg.data.chat_template, system_prompt=cfg.data.system_prompt)
    train_pairs, dropped, blank = encode_preferences(train, tokenizer, rm.max_len, **template)
    eval_pairs, dropped_eval, blank_eval = encode_preferences(held_out, tokenizer, rm.max_len, **template)
    if rank == 0:
        for path, pairs in ((rm.train_path, blank), (rm.eval_path or rm.train_path, blank_eval)):
            if pairs:  # the loss of such a pair is log 2 whatever the model: it teaches nothing and dilutes the batch
                log.warning("%s: dropped %d preference pair(s) with no signal: %s%s", path, len(pairs),
                            "; ".join(pairs[:5]), f"; and {len(pairs) - 5} more" if len(pairs) > 5 else "")
    where = f"{rm.train_path}" + (f" ({len(held_out)} of its pairs held out)" if rm.eval_path is None else "")
    if len(train_pairs) < rm.batch_size:
        raise ValueError(f"{where}: {len(train_pairs)} training pairs (after dropping {dropped} with a side longer "
                         f"than rm.max_len={rm.max_len} tokens and {len(blank)} with no signal) cannot fill one batch "
                         f"of rm.batch_size={rm.batch_size}")
    if held_out and not eval_pairs:
        raise ValueError(f"{rm.eval_path or where}: no held-out pair is left ({dropped_eval} with a side longer than "
                         f"rm.max_len={rm.max_len} tokens, {len(blank_eval)} with no signal)")
    return train_pairs, eval_pairs, dropped + dropped_eval


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_libraries()
    rank, world, _ = env_world()
    cfg = C.parse_or_exit(argv, world, rank, check=C.check_rm)
    info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s, cfg.run.device)
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code)
        pad = padding_id(tokenizer, cfg.model.tokenizer_path or cfg.model.path)
        train, held_out, dropped = load_pairs(cfg, tokenizer, rank)
    except (ValueError, OSError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        shutdown()
        return 2
    layout = build_layout([C.PoolConfig("all", world, ["reward"], cfg.placement.tp, cfg.placement.dp_replicate)],
                          info.device.type)
    pool = layout.pools[0]
    torch.manual_seed(cfg.run.seed)  # the fresh score head: the same on every rank before sharding
    model = shard_model(load_reward_model(cfg.model.path, pad, cfg.model.trust_remote_code).to(info.device), pool,
                        cfg.rm.fsdp)

    logger = None
    if rank == 0:
        run_dir = os.path.join(cfg.run.output_dir, cfg.run.name)
        logger = MetricsLogger(run_dir, cfg.run.tensorboard)
        logger.truncate_after(-1)  # no resume: this run's metrics replace those of an earlier run of the same name
        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(C.to_dict(cfg), f, sort_keys=False)
        print(f"rm: {len(train)} training pairs, {len(held_out)} held out, {dropped} dropped as longer than "
              f"rm.max_len={cfg.rm.max_len}; metrics in {run_dir}/metrics.jsonl", flush=True)

    def emit(step: int, metrics: dict) -> None:
        if logger is None:
            return
        logger.log(step, metrics)
        if step % cfg.run.log_every == 0 or step == cfg.rm.steps or "eval/accuracy" in metrics:
            shown = " ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
            print(f"rm step {step}/{cfg.rm.steps} {shown}", flush=True)

    last = train_reward_model(model, train, held_out, cfg.rm, cfg.run.seed, info.device, pool, emit)
    save_hf(model, tokenizer, cfg.rm.output_dir, rank, AutoModelForSequenceClassification)
    dist.barrier()
    if logger is not None:
        logger.close()
        if last:
            print(f"held-out accuracy {last['eval/accuracy']:.3f} (mean margin {last['eval/margin/mean']:.3f}) on "
                  f"{int(last['eval/pairs'])} pairs", flush=True)
        print(f"saved {cfg.rm.output_dir}", flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))

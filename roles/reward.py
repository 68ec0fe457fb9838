"""The reward: function rewards (answer match, user `module:function`) and/or a reward model, combined with weights."""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist

from batch import Batch
from parallel.distributed import reducer
from parallel.fsdp import shard_model
from parallel.layout import Pool
from roles.micro_batches import join_values, micro_batches
from roles.modeling import last_token_values, load_value_model, packable
from tasks.rewards import RewardFunctionRunner

log = logging.getLogger(__name__)


def _number(value) -> float:
    return value if isinstance(value, float) else math.nan


def encode_texts(texts: list[str]) -> torch.Tensor:
    """[B, L] long: each text's UTF-8 bytes + 1, right-padded with 0 (texts travel between pools as tensors)."""
    codes = [list(t.encode("utf-8")) for t in texts]
    out = torch.zeros((len(codes), max((len(c) for c in codes), default=0) or 1), dtype=torch.long)
    for i, c in enumerate(codes):
        out[i, : len(c)] = torch.tensor(c, dtype=torch.long) + 1
    return out


def decode_texts(codes: torch.Tensor) -> list[str]:
    return [bytes(v - 1 for v in row if v > 0).decode("utf-8", "replace") for row in codes.tolist()]


def decode_responses(tokenizer, batch: Batch) -> list[str]:
    """The response text of every sample (special tokens dropped)."""
    ids, lens = batch["response_ids"].tolist(), batch["response_len"].tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(ids, lens)], skip_special_tokens=True)


def check_same_tokens(model_path: str, tokenizer, trust_remote_code: bool = False) -> None:
    """The reward model reads the policy's token ids: ValueError unless its folder's tokenizer has the same
    vocabulary (or, without a tokenizer there, its embedding holds every id of the policy's)."""
    from transformers import AutoConfig

    from tasks.char_tokenizer import load_tokenizer

    own = None
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not os.path.isdir(model_path) or any(os.path.exists(os.path.join(model_path, f)) for f in files):
        try:
            own = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            own = None
    if own is not None:
        if own.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"reward.model_path={model_path}: its tokenizer's vocabulary differs from the policy's "
                             f"({len(own)} vs {len(tokenizer)} tokens): the reward model would read the policy's "
                             "token ids as other tokens. Use a reward model trained on the policy's tokenizer "
                             "(train_rm.py from the same base model)")
        return
    vocab = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).vocab_size
    if vocab < len(tokenizer):
        raise ValueError(f"reward.model_path={model_path}: its vocabulary has {vocab} tokens, the policy's tokenizer "
                         f"{len(tokenizer)}: the reward model cannot read the policy's token ids")


class Reward:
    def __init__(self, cfg, pool: Pool, device: torch.device, tokenizer, micro_batch_tokens: int,
                 trust_remote_code: bool = False):
        """cfg: config.RewardConfig."""
        self.cfg, self.pool, self.tokenizer, self.micro_batch_tokens = cfg, pool, tokenizer, micro_batch_tokens
        self.model = None
        if cfg.model_path:
            check_same_tokens(cfg.model_path, tokenizer, trust_remote_code)
            model = load_value_model(cfg.model_path, trust_remote_code).to(device).eval().requires_grad_(False)
            self.model = shard_model(model, pool, cfg.fsdp, train=False)
        # micro-batches cut by real tokens and packed forwards (as the actor's, roles/modeling.packed_rows)
        self.pack = cfg.pack_sequences and self.model is not None and packable(self.model)
        self.functions = [(RewardFunctionRunner(f.spec, cfg.num_workers, cfg.timeout_s), f.weight, f.spec)
                          for f in cfg.functions]
        self.failures = {"reward_fn/errors": 0.0, "reward_fn/timeouts": 0.0}  # since the last take_failures()
        self.fatal: str | None = None  # set when a step's failures pass reward.max_error_fraction
        # what TRL-style functions get as `trainer_state` (global_step, max_steps), kept up by the trainer
        self.trainer_state: dict = {"global_step": 0, "max_steps": 0}
        # the last scores() call's per-sample numbers of verl compute_score dicts ({key: [B] float32, NaN where a
        # sample's dict had none}), for the eval samples; a key two functions share is named function/key
        self.last_extras: dict[str, torch.Tensor] = {}

    def check_functions(self, samples: list[tuple[str, dict]]) -> str | None:
        """One call of every reward function on each (where, record) before training, with the record's ground truth
        as the response (any finite number passes): the problem's description, or None. tp rank 0 checks for its
        peers, as it scores for them."""
        if self.pool.tp > 1 and self.pool.tp_rank != 0:
            return None
        for runner, _, _ in self.functions:
            for where, record in samples:
                response = record["ground_truth"] or ""
                extras = {"messages": record.get("messages"),
                          "completion_ids": self.tokenizer(response, add_special_tokens=False)["input_ids"]}
                try:
                    runner.check(response, record["ground_truth"], record["prompt_text"], record["columns"], where,
                                 extras)
                except ValueError as e:
                    return str(e)
        return None

    def take_failures(self) -> dict[str, float]:
        """Reward-function errors and timeouts counted since the last call (eval's included), then reset."""
        out, self.failures = self.failures, dict.fromkeys(self.failures, 0.0)
        return out

    def close(self) -> None:
        for runner, _, _ in self.functions:
            runner.close()

    @torch.no_grad()
    def scores(self, batch: Batch, records: list[dict], training: bool = True
               ) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        """Scores [B] (float32): model_weight x the model's score at the last token + sum of weight x function.
        `records[batch["prompt_index"][i]]` holds the sample's ground truth and prompt text.

        With tensor parallelism the tp peers hold the same samples: the reward functions run once, on tp rank 0,
        and its scores are broadcast, so a timeout or a non-deterministic judge cannot give the peers different
        batches (and only tp rank 0 counts failures). The metrics are means over the whole pool's samples.
        training: too many failed samples set `fatal` (the trainer stops before the update); False (evaluation): they
        are logged as a warning and score 0, and training goes on."""
        n = batch["response_ids"].shape[0]
        device = batch["response_ids"].device
        total = torch.zeros(n, dtype=torch.float32, device=device)
        sums: dict[str, float] = {}
        self.last_extras = {}
        texts = decode_responses(self.tokenizer, batch)
        if self.model is not None:
            micro = micro_batches(batch, self.micro_batch_tokens, self.pool.dp_group, self.pack)
            parts = [last_token_values(self.model, mb, self.pack) for mb in micro]
            model_scores = join_values(parts, micro, n).to(device)
            total += self.cfg.model_weight * model_scores
            sums["reward/model_score/mean"] = float(model_scores.sum())
        if self.functions:
            fn_total, fn_sums, self.last_extras = self._function_scores(batch, records, texts, training)
            total += fn_total.to(device)
            sums.update(fn_sums)
        # one reduction over the pool's data-parallel ranks: sample count, then each mean's sum
        keys = sorted(sums)
        totals = reducer(self.pool.dp_group)(torch.tensor([float(n), *(sums[k] for k in keys)], dtype=torch.float64))
        metrics = {k: float(totals[i + 1] / totals[0]) for i, k in enumerate(keys)} if totals[0] > 0 else {}
        return total, metrics, texts

    def _function_scores(self, batch: Batch, records: list[dict], texts: list[str], training: bool = True
                         ) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
        """sum of weight x function over the configured functions [B] (CPU), each function's score sum, and the
        per-sample numbers of verl compute_score dicts (last_extras).
        When more than reward.max_error_fraction of the pool's samples failed (errors, timeouts, non-finite or
        non-numeric results) in this call: sets `fatal` (training), or logs a warning (evaluation)."""
        lead = self.pool.tp == 1 or self.pool.tp_rank == 0
        result = [None, None, None]
        failed, first_error = set(), None
        if lead:
            picked = [records[i] for i in batch["prompt_index"].tolist()]
            truths = [r["ground_truth"] for r in picked]
            prompts = [r["prompt_text"] for r in picked]
            columns = [r.get("columns", {}) for r in picked]
            ids, lens = batch["response_ids"].tolist(), batch["response_len"].tolist()
            extras = [{"messages": r.get("messages"), "completion_ids": row[:n]}
                      for r, row, n in zip(picked, ids, lens)]
            total = torch.zeros(len(texts), dtype=torch.float32)
            sums, per_sample = {}, {}
            for runner, weight, spec in self.functions:
                values, stats = runner(texts, truths, prompts, columns, extras, self.trainer_state)
                failed |= runner.last_failed
                first_error = first_error or (f"{spec}: {runner.last_error}" if runner.last_error else None)
                # a TRL-style function's None (NaN here): that function adds nothing to the sample's reward
                values = torch.tensor(values, dtype=torch.float32).nan_to_num(0.0)
                total += weight * values
                name = spec.rpartition("/")[2]  # a file's spec (path/to/file.py:f) by its file's name
                sums[f"reward/fn/{name}/mean"] = float(values.sum())
                for key in runner.extra_keys:  # a verl compute_score dict's other numbers (acc, ...); 0 where absent
                    values = [_number(e.get(key)) for e in runner.last_extras]
                    sums[f"reward/fn/{name}/{key}/mean"] = sum(v for v in values if v == v)
                    per_sample[key if key not in per_sample else f"{name}/{key}"] = torch.tensor(values,
                                                                                              dtype=torch.float32)
                for key in runner.text_keys:  # its texts (pred, ...): for the eval samples, as byte codes
                    texts_of = [e.get(key) if isinstance(e.get(key), str) else "" for e in runner.last_extras]
                    per_sample[f"text/{key}"] = encode_texts(texts_of)
                for key, count in stats.items():
                    self.failures[key] = self.failures.get(key, 0.0) + float(count)
            result = [total, sums, per_sample]
        if self.pool.tp > 1:
            group = self.pool.mesh.get_group("tp")
            dist.broadcast_object_list(result, src=dist.get_global_rank(group, 0), group=group)
        counts = reducer(self.pool.dp_group)(torch.tensor([float(len(failed)), float(len(texts) if lead else 0)]))
        if counts[1] > 0 and counts[0] / counts[1] > self.cfg.max_error_fraction:
            if training:
                self.fatal = (f"reward functions failed on {int(counts[0])} of {int(counts[1])} samples of this step "
                              f"(reward.max_error_fraction={self.cfg.max_error_fraction}); a failure of this "
                              f"rank's:\n{first_error or '(on another rank)'}")
            elif self.pool.dp_rank == 0 and lead:
                log.warning("evaluation: reward functions failed on %d of %d samples (scored 0; training goes on); "
                            "a failure of this rank's: %s", int(counts[0]), int(counts[1]),
                            first_error or "(on another rank)")
        return result[0], result[1], result[2]

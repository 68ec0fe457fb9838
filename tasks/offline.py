"""Offline RLHF data: the rollouts a run logs (run.save_rollouts) and training from logged rollouts with no generation
(data.rollouts_path).

A rollout file is a parquet (or .jsonl, or a datasets folder) with one row per response: `prompt` (text or chat
messages) or `prompt_ids`, `response` (text) or `response_ids`, `score`, and optionally `logprobs` (the behaviour
policy's log-prob of each response token, over `response_ids`), `group` (the responses of one prompt; default: rows
with the same prompt) and any other column. meshrl's own files (runs/NAME/rollouts/step_N.parquet) have all of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.data import (
    MAX_CHARS_PER_TOKEN,
    PromptDataset,
    _check_prompt,
    _finite_number,
    _lookup,
    _read_rows,
    _required,
    text_chars,
)

logger = logging.getLogger(__name__)

# what write_rollouts' rows hold besides the data's own columns
ROLLOUT_COLUMNS = ("step", "group", "prompt", "prompt_ids", "response", "response_ids", "score", "logprobs",
                   "temperature", "response_mask", "episode", "env_reward")


def write_rollouts(path: str, rows: list[dict]) -> None:
    """One step's rollouts as a parquet file, written whole or not at all (a temporary name, then a rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def _token_ids(value: object, key: str, where: str, vocab_size: int) -> list[int]:
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{where}: {key} must be a list of token ids, got {value!r:.100}")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: {key} has token id {bad[0]}, beyond the model's vocabulary of {vocab_size}")
    return value


def _group_key(row: dict, prompt: object) -> str:
    """Rows of one prompt, split further by a `group` value where the rows have one."""
    return json.dumps([row.get("group"), prompt], sort_keys=True, default=str)


class OfflineRollouts:
    """Logged groups as a train set: `items[i]` has what a PromptDataset item has (prompt_ids, prompt_text,
    ground_truth, columns) and the group's `responses` (token ids), `scores` and behaviour `logprobs` (None without
    them); `has_logprobs` when every row had them."""

    def __init__(self, items: list[dict], has_logprobs: bool, n_dropped_too_long: int):
        self.items, self.has_logprobs, self.n_dropped_too_long = items, has_logprobs, n_dropped_too_long

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def load_offline_groups(paths: list[str], tokenizer, *, group_size: int, vocab_size: int, max_prompt_len: int,
                        max_response_len: int, temperature: float = 1.0, prompt_key: str = "prompt",
                        ground_truth_key: str = "ground_truth", chat_template: bool | None = None,
                        system_prompt: str | None = None, template_kwargs: dict | None = None) -> OfflineRollouts:
    """The groups of logged responses in order of first appearance, each with `group_size` responses. Text
    responses are tokenised without special tokens and end with the tokenizer's eos (a finished response). Groups
    whose prompt is longer than `max_prompt_len` tokens are dropped and counted in the log, as online; every other
    mistake raises ValueError naming the file and row, among them log-probs taken at another temperature than
    `temperature` (rollout.temperature: the PPO ratio compares them with the policy's at it)."""
    eos = tokenizer.eos_token_id
    rows = []  # (where, row, prompt ids or None, prompt text or messages or None) in file order
    for path in paths:
        for where, row in _read_rows(path):
            if row.get("prompt_ids") is not None:
                ids = _token_ids(row["prompt_ids"], "prompt_ids", where, vocab_size)
                if not ids:
                    raise ValueError(f"{where}: prompt_ids is empty")
                rows.append((where, row, ids, None))
            else:
                prompt = _check_prompt(_required(row, prompt_key, where, "prompt (or prompt_ids)"), where)
                rows.append((where, row, None, prompt))
    if not rows:
        raise ValueError(f"{', '.join(map(str, paths))}: no rollout rows")

    # prompts given as text or messages: tokenised as online prompts are (chat template, system prompt)
    keys = [json.dumps(prompt, sort_keys=True) if ids is None else None for _, _, ids, prompt in rows]
    texts = {}  # each text prompt once, with its first row for errors
    for (where, _, ids, prompt), key in zip(rows, keys):
        # a prompt far longer in characters than max_prompt_len allows is dropped untokenised (PromptDataset's bound)
        if ids is None and text_chars(prompt) <= max_prompt_len * MAX_CHARS_PER_TOKEN:
            texts.setdefault(key, {"prompt": prompt, "where": where})
    encoded = {}
    if texts:
        dataset = PromptDataset(list(texts.values()), tokenizer, 1 << 30, chat_template, system_prompt,
                                template_kwargs=template_kwargs)
        encoded = dict(zip(texts, dataset.items))

    groups: dict[str, dict] = {}
    with_logprobs = 0
    for (where, row, ids, prompt), key in zip(rows, keys):
        if ids is not None:
            prompt_ids, prompt_text = ids, tokenizer.decode(ids)
        elif key in encoded:
            item = encoded[key]
            prompt_ids, prompt_text = item["prompt_ids"], item["prompt_text"]
        else:  # too long to tokenise: its group is dropped below
            prompt_ids, prompt_text = None, None
        if row.get("response_ids") is not None:
            response = _token_ids(row["response_ids"], "response_ids", where, vocab_size)
        else:
            text = _required(row, "response", where, "response (or response_ids)")
            if not isinstance(text, str):
                raise ValueError(f"{where}: response must be text, got {text!r:.100}")
            if len(text) > max_response_len * MAX_CHARS_PER_TOKEN:  # not worth tokenising to learn it
                raise ValueError(f"{where}: the response has {len(text)} characters, far more than "
                                 f"rollout.max_new_tokens={max_response_len} tokens hold; raise it")
            response = tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        if not response:
            raise ValueError(f"{where}: the response has no tokens")
        trained = row.get("response_mask")
        if trained is not None and 0 in list(trained):  # a saved multi-turn episode: its observations are untrained
            raise ValueError(f"{where}: its response_mask has zeros (a multi-turn episode's tool and environment "
                             "tokens); offline training trains every response token, so it would learn them: "
                             "episodes are not replayed offline yet")
        if len(response) > max_response_len:
            raise ValueError(f"{where}: the response has {len(response)} tokens, more than rollout.max_new_tokens="
                             f"{max_response_len}; raise it")
        score, found = _lookup(row, "score")
        if not found:
            raise ValueError(f"{where}: no score column (columns: {', '.join(sorted(row))})")
        score = _finite_number(score, "score", where)
        logprobs = row.get("logprobs")
        if logprobs is not None:
            logprobs = logprobs.tolist() if hasattr(logprobs, "tolist") else logprobs
            if not isinstance(logprobs, list) or len(logprobs) != len(response) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0
                    for x in logprobs):
                raise ValueError(f"{where}: logprobs must hold one finite log-probability (<= 0) per response token "
                                 f"({len(response)}), got {logprobs!r:.100}")
            logged_at = row.get("temperature")
            if logged_at is not None:
                logged_at = _finite_number(logged_at, "temperature", where)
            if logged_at is not None and abs(logged_at - temperature) > 1e-6:
                raise ValueError(f"{where}: its logprobs were taken at temperature {logged_at}, this run samples at "
                                 f"rollout.temperature={temperature}; set it to {logged_at}, or drop the logprobs "
                                 "column to train against the current policy")
            with_logprobs += 1
        ground_truth, _ = _lookup(row, ground_truth_key)
        group = groups.setdefault(_group_key(row, ids if ids is not None else prompt), {
            "prompt_ids": prompt_ids, "prompt_text": prompt_text, "responses": [], "scores": [], "logprobs": [],
            "where": where, "ground_truth": None if ground_truth is None else str(ground_truth),
            "columns": {k: v for k, v in row.items() if k not in ROLLOUT_COLUMNS}})
        group["responses"].append(response)
        group["scores"].append(score)
        group["logprobs"].append(logprobs)
    if 0 < with_logprobs < len(rows):
        first = next(where for where, row, _, _ in rows if row.get("logprobs") is None)
        raise ValueError(f"{first}: no logprobs, but {with_logprobs} other rows have them; give every row its "
                         "behaviour log-probs or none")
    sizes = {len(g["responses"]) for g in groups.values()}
    if sizes != {group_size}:
        odd = next(g for g in groups.values() if len(g["responses"]) != group_size)
        hint = f"set rollout.n={sizes.pop()} (the files' group size)" if len(sizes) == 1 else \
            "every prompt needs the same number of responses"
        raise ValueError(f"{odd['where']}: the group of this prompt has {len(odd['responses'])} responses but "
                         f"rollout.n={group_size}; {hint}")
    kept = [g for g in groups.values() if g["prompt_ids"] is not None and len(g["prompt_ids"]) <= max_prompt_len]
    if len(kept) < len(groups):
        logger.warning("dropped %d of %d logged prompts longer than max_prompt_len=%d tokens",
                       len(groups) - len(kept), len(groups), max_prompt_len)
    if not kept:
        raise ValueError(f"{paths[0]}: every logged prompt is longer than data.max_prompt_len={max_prompt_len}")
    has_logprobs = with_logprobs == len(rows)
    for g in kept:
        if not has_logprobs:
            g["logprobs"] = None
    return OfflineRollouts(kept, has_logprobs, len(groups) - len(kept))


def file_fingerprints(paths: list[str]) -> dict[str, list]:
    """{path: [size in bytes, sha256 hex digest]} of each rollout file (a datasets folder: its files together, with
    their names), for a checkpoint to tell whether a resume reads what it trained on."""
    out = {}
    for p in paths:
        files = sorted(f for f in Path(p).rglob("*") if f.is_file()) if os.path.isdir(p) else [Path(p)]
        digest, size = hashlib.sha256(), 0
        for f in files:
            if os.path.isdir(p):
                digest.update(str(f.relative_to(p)).encode() + b"\0")
            with open(f, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
                    size += len(chunk)
        out[str(p)] = [size, digest.hexdigest()]
    return out


def rollout_files(paths: list[str]) -> list[str]:
    """data.rollouts_path's entries as files: a file as it is, a folder as its *.parquet / *.jsonl in step order
    (step_2 before step_10); a datasets save_to_disk folder as one entry."""
    out = []
    for p in paths:
        if os.path.isdir(p) and not os.path.exists(os.path.join(p, "dataset_info.json")):
            found = sorted((f for f in Path(p).iterdir() if f.suffix in (".parquet", ".jsonl")),
                           key=lambda f: (len(f.stem), f.stem))
            if not found:
                raise ValueError(f"{p}: a folder with no .parquet or .jsonl rollout files")
            out += [str(f) for f in found]
        else:
            out.append(p)
    return out

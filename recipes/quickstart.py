"""Everything the quickstart needs, built locally with no downloads: a character tokenizer, a tiny Qwen2-style
model, the addition task's data (train / held-out test; the task itself is tasks/synthetic.py), and an SFT warm start
(roles/sft.py). Built once into `quickstart.workdir` by train_ppo.py (rank 0) when `quickstart.enabled`."""

from __future__ import annotations

import json
import os

import torch

from roles.sft import encode_pairs, sft_train
from tasks.char_tokenizer import build_char_tokenizer
from tasks.data import load_sft_records
from tasks.synthetic import write_addition_dataset
from tasks.tiny_model import save_tiny_model

DONE = "quickstart_done.json"
TEACHER_DONE = "teacher_done.json"


def prepare_quickstart(qcfg, seed: int) -> dict[str, str]:
    """Build the assets unless `workdir` already has them (a marker file is written last). Returns the paths:
    "model" (the SFT warm start), "train", "test"."""
    work = qcfg.workdir
    paths = {"model": os.path.join(work, "sft"), "train": os.path.join(work, "train.jsonl"),
             "test": os.path.join(work, "test.jsonl")}
    teacher = {k: v for k, v in vars(qcfg).items() if k.startswith("teacher_")}
    wanted = {k: v for k, v in vars(qcfg).items() if k not in teacher} | {"seed": seed}
    if not _built(os.path.join(work, DONE), wanted):
        tokenizer = build_char_tokenizer("0123456789+=")
        files = write_addition_dataset(work, qcfg.n_train, qcfg.n_test, seed=seed, digits=tuple(qcfg.digits))
        records = load_sft_records(files["sft"])
        _sft_model(paths["model"], tokenizer, records[: max(1, int(len(records) * qcfg.sft_fraction))],
                   qcfg.hidden_size, qcfg, qcfg.sft_steps, qcfg.sft_lr, seed, os.path.join(work, "init"))
        _mark(os.path.join(work, DONE), wanted)
    if qcfg.teacher_hidden_size:
        paths["teacher"] = os.path.join(work, "teacher")
        wanted = wanted | teacher
        if not _built(os.path.join(work, TEACHER_DONE), wanted):
            records = load_sft_records(os.path.join(work, "sft.jsonl"))
            _sft_model(paths["teacher"], build_char_tokenizer("0123456789+="), records, qcfg.teacher_hidden_size,
                       qcfg, qcfg.teacher_sft_steps, qcfg.teacher_sft_lr, seed)
            _mark(os.path.join(work, TEACHER_DONE), wanted)
    return paths


def _built(marker: str, wanted: dict) -> bool:
    if os.path.isfile(marker):
        with open(marker) as f:
            return json.load(f) == wanted
    return False


def _mark(marker: str, wanted: dict) -> None:  # written last: a build stopped half-way is redone
    with open(marker, "w") as f:
        json.dump(wanted, f)


def _sft_model(out: str, tokenizer, records: list, hidden: int, qcfg, steps: int, lr: float, seed: int,
               init: str | None = None) -> None:
    """A tiny model `hidden` wide (qcfg.num_layers deep), SFT'd for `steps` on `records`, saved with the tokenizer."""
    model = save_tiny_model(init or out, tokenizer, hidden_size=hidden, num_layers=qcfg.num_layers, num_heads=4,
                            num_kv_heads=2, intermediate_size=2 * hidden, max_position_embeddings=64, seed=seed)
    torch.manual_seed(seed)
    sft_train(model, encode_pairs(records, tokenizer), steps, lr, qcfg.sft_batch_size, seed,
              torch.device("cpu"))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

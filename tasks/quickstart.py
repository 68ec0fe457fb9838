"""Everything the quickstart needs, built locally with no downloads: a character tokenizer, a tiny Qwen2-style
model, the addition task (train / held-out test), and an SFT warm start. Built once into `quickstart.workdir`."""

from __future__ import annotations

import json
import os

import torch

from tasks.char_tokenizer import build_char_tokenizer
from tasks.data import load_sft_records
from tasks.synthetic import write_addition_dataset
from tasks.tiny_model import save_tiny_model

DONE = "quickstart_done.json"


def prepare_quickstart(qcfg, seed: int) -> dict[str, str]:
    """Build the assets unless `workdir` already has them (a marker file is written last). Returns the paths:
    "model" (the SFT warm start), "train", "test"."""
    from roles.sft import encode_pairs, sft_train  # imports the model stack: keep tasks/ light to import

    work = qcfg.workdir
    paths = {"model": os.path.join(work, "sft"), "train": os.path.join(work, "train.jsonl"),
             "test": os.path.join(work, "test.jsonl")}
    marker = os.path.join(work, DONE)
    wanted = {k: v for k, v in vars(qcfg).items()} | {"seed": seed}
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == wanted:
                return paths
    tokenizer = build_char_tokenizer("0123456789+=")
    files = write_addition_dataset(work, qcfg.n_train, qcfg.n_test, seed=seed, digits=tuple(qcfg.digits))
    model = save_tiny_model(os.path.join(work, "init"), tokenizer, hidden_size=qcfg.hidden_size,
                            num_layers=qcfg.num_layers, num_heads=4, num_kv_heads=2,
                            intermediate_size=2 * qcfg.hidden_size, max_position_embeddings=64, seed=seed)
    records = load_sft_records(files["sft"])
    records = records[: max(1, int(len(records) * qcfg.sft_fraction))]
    torch.manual_seed(seed)
    sft_train(model, encode_pairs(records, tokenizer), qcfg.sft_steps, qcfg.sft_lr, qcfg.sft_batch_size, seed,
              torch.device("cpu"))
    model.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return paths

"""The calculator task's assets (tasks/calculator.py: the tool, the reward, the traces; configs/calculator_tools.yaml):
`python -m recipes.calculator` builds them into runs/calculator_assets.

What it writes: the character tokenizer, train.jsonl / test.jsonl (disjoint prompts), a tiny model SFT'd on a few
hundred tool-use traces (the loss on the model's turns only, as RL trains them) in sft/, and stop_token_id.txt (the
id of the turn's stop, the config's rollout.stop_token_ids). A rebuild with the same arguments is bit-identical.
"""

from __future__ import annotations

import argparse
import os

import torch

from roles.sft import sft_train
from tasks.calculator import STOP, encode_trace, write_data
from tasks.char_tokenizer import build_char_tokenizer
from tasks.tiny_model import save_tiny_model

WORKDIR = "runs/calculator_assets"


def build_assets(work: str = WORKDIR, n_sft: int = 300, n_train: int = 2000, n_test: int = 200, sft_steps: int = 200,
                 lr: float = 1e-3, batch_size: int = 32, hidden: int = 128, layers: int = 3, seed: int = 0) -> str:
    """Tokenizer, tiny model, SFT warm start (saved to work/sft) and data; returns the SFT model's folder."""
    tokenizer = build_char_tokenizer()  # digits, letters, punctuation, space and newline: a call's JSON fits
    splits = write_data(work, n_sft, n_train, n_test, seed)
    model = save_tiny_model(os.path.join(work, "init"), tokenizer, hidden_size=hidden, num_layers=layers,
                            num_heads=4, num_kv_heads=2, intermediate_size=2 * hidden, max_position_embeddings=256,
                            seed=seed)
    torch.manual_seed(seed)
    pairs = [encode_trace(tokenizer, a, b) for a, b in splits["sft"]]
    sft_train(model, pairs, sft_steps, lr, batch_size, seed, torch.device("cpu"))
    out = os.path.join(work, "sft")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(work, "stop_token_id.txt"), "w") as f:
        f.write(f"{tokenizer.convert_tokens_to_ids(STOP)}\n")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=WORKDIR)
    parser.add_argument("--n-sft", type=int, default=300)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_assets(args.workdir, n_sft=args.n_sft, sft_steps=args.sft_steps, seed=args.seed))

"""Export a trained role of a meshrl checkpoint to a Hugging Face folder (config.json, safetensors, tokenizer files)
that `AutoModelForCausalLM.from_pretrained` and vLLM load.

    python scripts/export_hf.py runs/NAME/checkpoints/step_00000100 --out exported/ [--role actor|critic]
    python scripts/export_hf.py runs/NAME/checkpoints/latest --out exported/

The architecture and tokenizer come from the model the run started from (recorded in the checkpoint); the weights
come from the checkpoint, gathered from however many ranks wrote it. Runs in one process, no GPU needed.

A role trained with LoRA (actor.lora / critic.lora) exports as a peft adapter folder, which
`peft.PeftModel.from_pretrained(base, out)` loads on the model the run started from; with --merged, as that model
with the adapters merged in, which plain transformers (and vLLM) load.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed.checkpoint as dcp
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config import LoraConfig, build  # noqa: E402
from roles.lora import apply_lora, value_head_name  # noqa: E402
from roles.modeling import load_causal_lm, load_value_model  # noqa: E402


def resolve(path: str) -> str:
    """A checkpoint folder, or a checkpoints/latest pointer file."""
    if os.path.isfile(path) and os.path.basename(path) == "latest":
        with open(path) as f:
            return os.path.join(os.path.dirname(path), f.read().strip())
    return path


def export(checkpoint_dir: str, out: str, role: str = "actor", merged: bool = False) -> str:
    """merged: for a LoRA role, the base model with the adapters merged in rather than the adapter folder."""
    checkpoint_dir = resolve(checkpoint_dir)
    state_file = os.path.join(checkpoint_dir, "trainer.pt")
    if not os.path.isfile(state_file):
        raise ValueError(f"{checkpoint_dir}: not a complete meshrl checkpoint (no trainer.pt)")
    if not os.path.isdir(os.path.join(checkpoint_dir, role)):
        have = sorted(d for d in os.listdir(checkpoint_dir) if os.path.isdir(os.path.join(checkpoint_dir, d)))
        raise ValueError(f"{checkpoint_dir}: no trained role {role!r} in it; it has {have}")
    cfg = yaml.safe_load(torch.load(state_file, weights_only=True)["config"])
    section = cfg[role]
    base = section.get("model_path") or cfg["model"]["path"]
    trust = cfg["model"]["trust_remote_code"]
    model = load_causal_lm(base, trust) if role == "actor" else load_value_model(base, trust)
    lora = build(LoraConfig, section.get("lora") or {}, f"{role}.lora.")
    adapters = apply_lora(model, lora, "float32", value_head_name(model) if role == "critic" else None)
    if adapters is None:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(checkpoint_dir, role))
        model.load_state_dict(state["model"])
        model.save_pretrained(out)
    else:  # the checkpoint holds the trained parameters only: the adapters (and a critic's value head)
        trained = {n: p.detach().clone() for n, p in adapters.model.named_parameters() if p.requires_grad}
        state = {"model": trained}
        dcp.load(state, checkpoint_id=os.path.join(checkpoint_dir, role))
        result = adapters.model.load_state_dict(state["model"], strict=False)
        assert not result.unexpected_keys and not set(trained) & set(result.missing_keys), result
        if merged:
            adapters.peft.merge_and_unload().save_pretrained(out)
        else:
            adapters.save(out)
    from tasks.char_tokenizer import load_tokenizer

    load_tokenizer(cfg["model"]["tokenizer_path"] or base, trust_remote_code=trust).save_pretrained(out)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (runs/NAME/checkpoints/step_N) or its `latest` file")
    parser.add_argument("--out", required=True, help="the HF folder to write")
    parser.add_argument("--role", default="actor", choices=("actor", "critic"))
    parser.add_argument("--merged", action="store_true",
                        help="a LoRA role: write the model with the adapters merged in, not the adapter folder")
    args = parser.parse_args(argv)
    try:
        print(f"exported {export(args.checkpoint, args.out, args.role, args.merged)}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Tiny random-init causal LMs (Qwen2 or Llama architecture) for the quickstart and for tests.

They are ordinary `transformers` models, so everything downstream (FSDP, the rollout engines, export) treats them
like a real checkpoint; they are just small enough to train on a CPU.
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config

CONFIG_CLASSES = {"qwen2": Qwen2Config, "llama": LlamaConfig}


def build_tiny_causal_lm(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    family: str = "qwen2",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> PreTrainedModel:
    """A float32 causal LM with random weights; the same arguments and seed give the same weights.

    The global torch RNG is left untouched, so building a model does not shift the random stream of the caller.
    """
    if family not in CONFIG_CLASSES:
        raise ValueError(f"family={family!r} is not supported; valid: {sorted(CONFIG_CLASSES)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be positive")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")

    config = CONFIG_CLASSES[family](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(directory: str | Path, tokenizer: PreTrainedTokenizerBase, **model_kwargs) -> PreTrainedModel:
    """Build a tiny model sized to `tokenizer` and write an HF folder (config, safetensors weights, tokenizer files).

    `model_kwargs` are those of `build_tiny_causal_lm` except `vocab_size` and the special token ids, which come
    from the tokenizer. Returns the model that was saved.
    """
    derived = {"vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"}
    clashing = sorted(derived & model_kwargs.keys())
    if clashing:
        raise ValueError(f"save_tiny_model: {clashing} come from the tokenizer; do not pass them")
    model = build_tiny_causal_lm(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **model_kwargs,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model

"""LoRA on a trained role's model (config.LoraConfig, issue 39), through peft.

peft injects its LoRA layers into the HF model in place; the roles keep that model (so every forward in
roles/modeling.py, packing and `logits_to_keep` included, runs unchanged) and keep the `PeftModel` beside it in an
`Adapters` for what only peft knows: turning the adapters off (the reference policy), saving them in its format.

- The frozen base is cast to `fsdp.param_dtype` (bf16 halves its memory); the adapters (and `modules_to_save`) stay
  float32: they are the optimizer's masters, and FSDP2's mixed precision casts them for compute. FSDP2 then shards
  both like any other parameter (parallel/fsdp.shard_model), and the optimizer takes only what requires grad.
- The native engine decodes merged weights (`Adapters.merged`): after FSDP2's unshard, each LoRA layer's B @ A x
  scaling is added, in float32 and rounded once, into the gathered copy of its base weight. FSDP2's gathered
  parameters are buffers of their own, freed by the reshard after the rollout, so the sharded base is never written.
- The reference with adapters disabled is the actor's base: no second copy of the weights (BaseReference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from parallel.fsdp import DTYPES
from parallel.reshard import named_weights, whole
from parallel.tp import decoder_layers
from roles.reference import Reference

ADAPTER = "default"  # peft's name of the one adapter a role trains


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel DTensor's shard on this rank; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def lora_enabled(lora_cfg) -> bool:
    """Whether config.LoraConfig asks for adapters: a rank, or an adapter folder to start from."""
    return lora_cfg is not None and (lora_cfg.rank > 0 or bool(lora_cfg.init_path))


def linear_names(model: nn.Module) -> list[str]:
    """The names (last part) of the nn.Linear modules inside the decoder blocks: "all-linear" (never the LM head or
    a value head, which are not in the blocks)."""
    names = {name.rsplit(".", 1)[-1] for layer in decoder_layers(model) for name, m in layer.named_modules()
             if isinstance(m, nn.Linear)}
    return sorted(names)


def value_head_name(model: nn.Module) -> str:
    """The value (token-classification) head's module name: `score` for the HF decoders, `classifier` elsewhere."""
    return "score" if hasattr(model, "score") else "classifier"


class Adapters:
    """The peft side of a role's model: `peft` is the PeftModel, `model` the HF model with the LoRA layers in it
    (what the role runs and shards)."""

    def __init__(self, model: nn.Module, lora_cfg, param_dtype: str, value_head: str | None = None):
        """model: a float32 HF model (dropout already off where the role wants it). value_head: the critic's head
        module name, trained in full beside the adapters (it starts fresh)."""
        from peft import LoraConfig, PeftModel, get_peft_model

        to_save = list(lora_cfg.modules_to_save)
        if value_head is not None and value_head not in to_save:
            to_save.append(value_head)
        if lora_cfg.init_path:
            self.peft = PeftModel.from_pretrained(model, lora_cfg.init_path, adapter_name=ADAPTER, is_trainable=True)
        else:
            targets = lora_cfg.target_modules
            targets = linear_names(model) if targets == "all-linear" else list(targets)
            self.peft = get_peft_model(model, LoraConfig(
                r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=targets,
                modules_to_save=to_save or None, bias="none"), adapter_name=ADAPTER)
        self.model = self.peft.get_base_model()
        dtype = DTYPES[param_dtype]
        for p in self.model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dtype)

    def lora_layers(self) -> list[nn.Module]:
        from peft.tuners.lora import LoraLayer

        return [m for m in self.model.modules() if isinstance(m, LoraLayer)]

    def saved_modules(self) -> list[nn.Module]:
        """The `modules_to_save` wrappers: a trained copy beside the frozen original."""
        from peft.utils import ModulesToSaveWrapper

        return [m for m in self.model.modules() if isinstance(m, ModulesToSaveWrapper)]

    @contextlib.contextmanager
    def disabled(self):
        """The base model: adapters and trained copies off inside the block."""
        with self.peft.disable_adapter():
            yield

    @contextlib.contextmanager
    @torch.no_grad()
    def merged(self, reshard_after_forward: bool = True):
        """Inside the block the model's (unsharded) base weights hold the adapters merged in, and the trained
        copies of `modules_to_save` in their originals' place, and the adapters off: what an engine reading the base
        weights, or calling the model's forward, decodes with.
        The parameters stay unsharded (FSDP2) until the caller reshards them; on leaving, those gathered buffers are
        freed, and the sharded base, never written, is what the next unshard gathers again. Without FSDP2 the base
        tensors are written in place and put back from a copy on leaving. reshard_after_forward: the FSDP2 setting
        the model was sharded with, put back on leaving."""
        fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in fsdp:
            module.set_reshard_after_forward(False, recurse=False)
        for handle in [module.unshard(async_op=True) for module in fsdp]:
            handle.wait()
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for layer in self.lora_layers():
                if ADAPTER not in layer.lora_A and ADAPTER not in getattr(layer, "lora_embedding_A", {}):
                    continue
                w = layer.get_base_layer().weight
                if not fsdp:
                    saved.append((w, w.detach().clone()))
                linear = isinstance(layer.get_base_layer(), nn.Linear) and not getattr(layer, "fan_in_fan_out", False)
                if linear and ADAPTER in layer.lora_A:  # B @ A in float32 (peft's own keeps the weights' dtype)
                    # on this rank's shards under tensor parallelism (parallel/tp.py splits the base and the
                    # adapter's matrix on the same side): B_local @ A_local is the local part of B @ A
                    a, b = _local(layer.lora_A[ADAPTER].weight), _local(layer.lora_B[ADAPTER].weight)
                    delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]
                else:
                    delta = layer.get_delta_weight(ADAPTER).float()
                w = _local(w).detach()
                w.copy_((w.float() + delta).to(w.dtype))
            for wrapper in self.saved_modules():
                trained = dict(wrapper.modules_to_save[ADAPTER].named_parameters())
                for name, p in wrapper.original_module.named_parameters():
                    if not fsdp:
                        saved.append((p, p.detach().clone()))
                    p.detach().copy_(trained[name].detach().to(p.dtype))
            # the adapters off: a forward through the modules (the engine's HF-forward path) must not add them twice
            with self.peft.disable_adapter():
                yield
        finally:
            for tensor, original in saved:
                tensor.detach().copy_(original)
            for module in fsdp:
                module.reshard()
                module.set_reshard_after_forward(reshard_after_forward, recurse=False)

    def merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's weights as an engine without LoRA takes them (parallel/reshard.weight_buckets' `weights`, for
        the engines that keep their own copy: vLLM, the replicas of split placement): each adapted base weight with
        B @ A x scaling added, in float32; the trained copies of `modules_to_save` under their originals' names; the
        adapters themselves left out. Collective under FSDP2 like weight_buckets (each tensor is gathered whole, in
        the same order on every rank); call it with the model resharded."""
        layers = set(self.lora_layers())
        adapted = {name: m for name, m in self.model.named_modules() if m in layers}
        params = dict(self.model.named_parameters())
        for name, tensor in named_weights(self.model):
            owner, _, leaf = name.rpartition(".")
            if ".lora_" in name or ".modules_to_save." in name:
                continue
            if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in adapted:
                layer = adapted[owner[: -len(".base_layer")]]
                if ADAPTER in getattr(layer, "lora_embedding_A", {}) or not isinstance(layer.get_base_layer(),
                                                                                       nn.Linear):
                    raise NotImplementedError(f"{owner}: only LoRA on linear layers streams its merged weights")
                value = whole(tensor, torch.float32, None)
                if leaf == "weight" and ADAPTER in layer.lora_A:
                    a = whole(layer.lora_A[ADAPTER].weight, torch.float32, None)
                    b = whole(layer.lora_B[ADAPTER].weight, torch.float32, None)
                    value = value + (b @ a) * layer.scaling[ADAPTER]
                yield name.replace(".base_layer.", "."), value
            elif ".original_module." in name:
                trained = params[name.replace(".original_module.", f".modules_to_save.{ADAPTER}.")]
                yield name.replace(".original_module.", "."), trained
            else:
                yield name, tensor

    def save(self, out: str) -> None:
        """The adapter folder (adapter_config.json, adapter_model.safetensors) that
        `peft.PeftModel.from_pretrained(base, out)` loads. Every parameter must be whole on this process (no FSDP)."""
        self.peft.save_pretrained(out)


def apply_lora(model: nn.Module, lora_cfg, param_dtype: str, value_head: str | None = None) -> Adapters | None:
    """Adapters for `model` when config.LoraConfig asks for them, else None (the model trains in full)."""
    if not lora_enabled(lora_cfg):
        return None
    return Adapters(model, lora_cfg, param_dtype, value_head)


class BaseReference(Reference):
    """The reference policy as the actor's own base: its model with the adapters disabled (the same parameters, the
    same shards; no second copy of the weights). For a LoRA actor whose reference is the model it started from."""

    def __init__(self, actor):
        """actor: a roles.actor.Actor with LoRA (actor.lora not None)."""
        assert actor.lora is not None
        self.pool, self.micro_batch_tokens = actor.pool, actor.cfg.micro_batch_tokens
        self.model, self.pack, self.adapters = actor.model, actor.pack, actor.lora

    @torch.no_grad()
    def log_probs(self, batch, temperature: float) -> torch.Tensor:
        """[B, R] log-probs of the response tokens under the base model (Reference.log_probs, adapters off)."""
        self.model.eval()
        with self.adapters.disabled():
            return super().log_probs(batch, temperature)


def save_adapter_folder(adapters: Adapters, base_path: str, lora_cfg, tokenizer, out: str, rank: int,
                        trust_remote_code: bool = False) -> None:
    """Gather the trained tensors of a sharded LoRA model to rank 0 and write there the peft adapter folder (and the
    tokenizer) that `actor.lora.init_path` (or `PeftModel.from_pretrained`) starts from: a fresh float32 base from
    `base_path` with the same adapters, loaded with them. Every rank calls (the gather is a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from roles.modeling import load_causal_lm

    state = get_model_state_dict(adapters.model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
    if rank != 0:
        return
    fresh = Adapters(load_causal_lm(base_path, trust_remote_code), lora_cfg, "float32")
    result = fresh.model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and not set(state) & set(result.missing_keys), result
    fresh.save(out)
    tokenizer.save_pretrained(out)

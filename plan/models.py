"""The planner's models: parameter shapes of each role's model from a meta-device build of its config.json (no
weights), the units and constants the memory model uses, and two helpers every part shares."""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass

import config as C

GiB = 1 << 30


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


LOSS_CHUNK = 1024  # positions per float32 tile in algo/losses (its chunk_size default)


DEFAULT_GPU_GIB = 80.0


TP_DEGREES = (1, 2, 4, 8)  # tensor parallelism stays inside a node


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ModelShape:
    """One model as the planner sees it: every parameter tensor (tied ones once) and the sizes the formulas use."""

    path: str
    kind: str  # "lm": a causal LM (vocabulary logits); "value": a per-token scalar head (critic, reward model)
    arch: str  # the model class
    params: list[tuple[str, tuple[int, ...], int | None, int | None]]  # name, shape, layer index, tp-split dim
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    compact: bool  # the native engine's compact forward runs it (else its HF-forward loop)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape, _, _ in self.params)

    def local_numel(self, tp: int, shard: int, which=lambda layer: True) -> int:
        """Elements one rank holds of the parameters whose layer index passes `which` (None: the root's)."""
        total = 0
        for _, shape, layer, split in self.params:
            if not which(layer):
                continue
            dims = list(shape)
            if split is not None and tp > 1:
                dims[split] = _ceil_div(dims[split], tp)
            dims[0] = _ceil_div(dims[0], shard)
            total += math.prod(dims)
        return total

    def block_numel(self, tp: int) -> int:
        """The largest decoder block's elements on one tp rank, unsharded."""
        return max(self.local_numel(tp, 1, lambda layer, n=n: layer == n) for n in range(self.layers))


_SHAPES: dict[tuple[str, str], ModelShape] = {}


def _tp_dim(name: str) -> int | None:
    """The dimension parallel/tp.LAYER_PLAN splits this parameter on, or None (replicated over tp)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from parallel.tp import LAYER_PLAN

    m = re.search(r"\.layers\.\d+\.(\w+\.\w+)\.(weight|bias)$", name)
    style = LAYER_PLAN.get(m[1]) if m else None
    if style is ColwiseParallel:
        return 0
    if style is RowwiseParallel and m[2] == "weight":
        return 1
    return None


def model_shape(path: str, kind: str, key: str, trust_remote_code: bool = False) -> ModelShape:
    """Read `path` (an HF folder or a config.json file) and build its model on the meta device: exact parameter
    shapes, no memory. kind "value" builds what roles/modeling.load_value_model loads (a one-label token head)."""
    if (path, kind) in _SHAPES:
        return _SHAPES[(path, kind)]
    if not (os.path.isfile(os.path.join(path, "config.json")) or (path.endswith(".json") and os.path.isfile(path))):
        raise C.ConfigError(f"{key}={path!r}: no config.json there (the planner reads the model's architecture "
                            "from it; a config.json file itself, e.g. configs/models/qwen2.5-1.5b.json, works too)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from parallel.tp import decoder_layers
    from rollout.families import unsupported_reason

    arch = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if kind == "value":
        arch.num_labels = 1
    cls = AutoModelForCausalLM if kind == "lm" else AutoModelForTokenClassification
    with torch.device("meta"):
        model = cls.from_config(arch, dtype=torch.float32, trust_remote_code=trust_remote_code)
    try:
        decoder_layers(model)
    except ValueError as e:
        raise C.ConfigError(f"{key}={path!r}: {e}") from None
    sizes = {}
    for field_name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(getattr(arch, field_name, None), int):
            raise C.ConfigError(f"{key}={path!r}: config.json has no integer {field_name} (a Llama/Qwen2-family "
                                "architecture is expected)")
        sizes[field_name] = getattr(arch, field_name)
    heads = sizes["num_attention_heads"]
    params = []
    for name, p in model.named_parameters():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        params.append((name, tuple(p.shape), int(layer[1]) if layer else None, _tp_dim(name)))
    shape = ModelShape(
        path=path, kind=kind, arch=type(model).__name__, params=params, hidden=sizes["hidden_size"],
        inter=sizes["intermediate_size"], heads=heads, kv_heads=getattr(arch, "num_key_value_heads", None) or heads,
        head_dim=getattr(arch, "head_dim", None) or sizes["hidden_size"] // heads,
        layers=sizes["num_hidden_layers"], vocab=sizes["vocab_size"],
        compact=kind == "lm" and unsupported_reason(model) is None)
    _SHAPES[(path, kind)] = shape
    return shape


def role_models(cfg: C.Config) -> dict[str, ModelShape | None]:
    """The model of each role the run needs, from the paths train_ppo.PPOTrainer uses (None: function rewards)."""
    actor_key = "actor.model_path" if cfg.actor.model_path else "model.path"
    actor_path = cfg.actor.model_path or cfg.model.path
    sources = {
        "actor": (actor_path, "lm", actor_key),
        "critic": (cfg.critic.model_path or cfg.model.path, "value",
                   "critic.model_path" if cfg.critic.model_path else "model.path"),
        "reference": (cfg.reference.model_path or actor_path, "lm",
                      "reference.model_path" if cfg.reference.model_path else actor_key),
        "reward": (cfg.reward.model_path, "value", "reward.model_path"),
        "teacher": (cfg.teacher.model_path, "lm", "teacher.model_path"),
    }
    out = {}
    for role in (r for r in C.ROLES if r in C.required_roles(cfg)):
        path, kind, key = sources[role]
        if not path:
            out[role] = None
            continue
        if cfg.quickstart.enabled and not os.path.isfile(os.path.join(path, "config.json")):
            raise C.ConfigError(
                f"quickstart.enabled=true: the tiny model is built at run time into {cfg.quickstart.workdir!r}, and "
                f"{key}={path!r} has no config.json yet; run the config once without --plan to build it, or plan "
                "with model.path set to a folder or config.json file")
        out[role] = model_shape(path, kind, key, cfg.model.trust_remote_code)
        if cfg.quickstart.enabled and (out[role].hidden, out[role].layers) != (cfg.quickstart.hidden_size,
                                                                                cfg.quickstart.num_layers):
            raise C.ConfigError(
                f"quickstart.hidden_size={cfg.quickstart.hidden_size}, quickstart.num_layers="
                f"{cfg.quickstart.num_layers}, but the model built in {path!r} has {out[role].hidden} and "
                f"{out[role].layers}: run the config once without --plan to rebuild it")
    return out


def check_plan(cfg: C.Config, world_size: int) -> None:
    """config.check_ppo for this world size, less its rules about this machine: that the data and model files exist
    (a plan reads no data; role_models reads each model's config.json and names a missing one) and that vLLM or
    wandb is installed (a plan starts nothing; plan a cluster's config on a laptop)."""
    C.check_ppo(cfg, world_size, this_machine=False)
    role_models(cfg)


def with_values(cfg: C.Config, overrides) -> C.Config:
    """A copy of `cfg` with (dotted key, value) pairs set; `placement.pools[1].tp` indexes a list."""
    cfg = copy.deepcopy(cfg)
    for key, value in overrides:
        *path, last = key.split(".")
        node = cfg
        for part in path:
            name, _, index = part.partition("[")
            node = getattr(node, name)
            if index:
                node = node[int(index[:-1])]
        setattr(node, last, value)
    return cfg


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"

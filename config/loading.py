"""From YAML files and dotted command-line overrides to a typed Config: `base:` files, unique keys, renamed and
foreign (TRL / verl) key names with a hint, coercion of each value to its field's type; to_dict and config_changes
for what a run saves and compares on resume."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Literal

import yaml

from config.schema import Config, ConfigError


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read a YAML file (or nothing: all defaults), apply `a.b.c=value` overrides, and build the typed `Config`."""
    raw = _read_yaml(path) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    return build(Config, raw, "")


def check_given_once(overrides: list[str]) -> None:
    """A command line sets each key once: a key given twice (or a section and a key inside it) is a slip, whichever
    came last would win silently. (load_config itself layers overrides: later ones win.)"""
    given: dict[str, str] = {}  # dotted key -> the override that set it
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        for other, first in given.items():
            if "=" in item and (key == other or key.startswith(other + ".") or other.startswith(key + ".")):
                raise ConfigError(f"overrides {first!r} and {item!r} both set {min(key, other, key=len)}; give it "
                                  "once")
        given[key] = item


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: the key {key!r} is given twice in one "
                                  f"mapping (first on line {seen[key] + 1}); the later would silently override the "
                                  "earlier: keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str, seen: tuple[str, ...] = (), named_by: str | None = None) -> dict:
    """A YAML config; a top-level `base: other.yaml` (relative to this file) is read first and updated by this one.
    named_by: the file whose `base:` names this one (for the messages)."""
    if not os.path.isfile(path):
        if named_by is not None:
            raise ConfigError(f"--config {named_by}: base: file not found: {path!r} (a base path is relative to the "
                              "file that names it)")
        raise ConfigError(f"--config: file not found: {path!r}")
    if os.path.abspath(path) in seen:
        raise ConfigError(f"--config {path}: `base` files include each other: {' -> '.join(seen)}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"--config {path}: line {line}, column {column}: byte 0x{data[e.start]:02x} is not UTF-8 "
                          "text (save the file as UTF-8)") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if raw is None:
        raise ConfigError(f"--config {path}: the file is empty; start from configs/quickstart.yaml (python "
                          "train_ppo.py --help lists every key)")
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_yaml(os.path.join(os.path.dirname(path), base), (*seen, os.path.abspath(path)), named_by=path)
    _deep_update(merged, raw)
    return merged


def _deep_update(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_update(into[k], v)
        else:
            into[k] = v


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. actor.optim.lr=1e-6")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.load(text, Loader=_UniqueKeyLoader) if text.strip() else None
    except ConfigError as e:
        raise ConfigError(f"override {item!r}: {e}") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); e.g. "
                          "'reward.functions=[{spec: gsm8k, weight: 1.0}]', quoted for the shell") from None


# keys that existed once, with what replaced them
RENAMED = {
    "algorithm.kl.kind": "it was split in two: algorithm.kl.reward_kind (the estimator in the reward, default k1) and "
                         "algorithm.kl.loss_kind (in the loss, default low_var_kl)",
    "comm.comm_fraction_warn": "it moved to health.max_comm_fraction (with the other health thresholds)",
    "comm.memory_fraction_warn": "it moved to health.max_memory_fraction (with the other health thresholds)",
}


# TRL's (GRPOConfig, flat names) and verl's (dotted) names for meshrl's keys, suggested when one is given; the same
# table is in the README ("TRL and verl names")
FOREIGN_NAMES = {
    "num_generations": "rollout.n",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_len",
    "beta": "algorithm.kl.coef (with algorithm.kl.in_loss=true algorithm.kl.in_reward=false, as TRL)",
    "learning_rate": "actor.optim.lr",
    "per_device_train_batch_size": "data.batch_size (prompts per step over all ranks, not completions per device)",
    "num_iterations": "actor.ppo_epochs",
    "epsilon": "actor.clip_low",
    "epsilon_high": "actor.clip_high",
    "temperature": "rollout.temperature",
    "max_steps": "run.total_steps",
    "num_train_epochs": "run.epochs",
    "logging_steps": "run.log_every",
    "eval_steps": "run.eval_every",
    "save_steps": "checkpoint.save_every",
    "output_dir": "run.output_dir",
    "seed": "run.seed",
    "warmup_steps": "actor.optim.warmup_steps",
    "max_grad_norm": "actor.optim.grad_clip",
    "lr_scheduler_type": "actor.optim.schedule",
    "scale_rewards": "algorithm.norm_by_std",
    "gradient_checkpointing": "actor.fsdp.activation_checkpointing",
    "reward_funcs": "reward.functions ([{spec: module.path:function, weight: 1.0}])",
    "reward_weights": "reward.functions[i].weight",
    "model_name_or_path": "model.path",
    "use_vllm": "rollout.engine=vllm",
    "data.train_files": "data.train_path",
    "data.val_files": "data.eval_path",
    "data.train_batch_size": "data.batch_size",
    "data.max_prompt_length": "data.max_prompt_len",
    "data.max_response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.mini_batch_size (samples, not prompts)",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl.in_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl.coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl.loss_kind",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coef",
    "actor_rollout_ref.actor.clip_ratio": "actor.clip_low and actor.clip_high",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_high",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg",
    "algorithm.use_kl_in_reward": "algorithm.kl.in_reward",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl.coef",
    "trainer.total_training_steps": "run.total_steps",
    "trainer.total_epochs": "run.epochs",
    "trainer.experiment_name": "run.name",
    "trainer.save_freq": "checkpoint.save_every",
    "trainer.test_freq": "run.eval_every",
    "custom_reward_function.path": "reward.functions ([{spec: module.path:function}])",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "data.apply_chat_template_kwargs": "data.chat_template_kwargs",
    "environment_factory": "rollout.environment (module.path:factory; factory(record) -> env with step(text))",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "rollout.max_turns",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "rollout.tools ([module.path:function, ...])",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "rollout.environment (module.path:factory)",
    # the objectives (README "Objectives: which paper is which key" maps each value)
    "loss_type": "actor.loss_agg (grpo: seq-mean-token-mean; dapo, bnpo: token-mean; dr_grpo: "
                 "seq-mean-token-sum-norm with algorithm.norm_by_std=false; cispo: actor.policy_loss=cispo)",
    "importance_sampling_level": "actor.policy_loss (sequence: gspo; token: ppo)",
    "vllm_importance_sampling_mode": "actor.rollout_correction (weight: token/sequence, mask: token/sequence)",
    "vllm_importance_sampling_cap": "actor.rollout_correction.weight_cap",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss (vanilla: ppo; gspo; cispo)",
    "algorithm.rollout_correction.rollout_is": "actor.rollout_correction.weight",
    "algorithm.rollout_correction.rollout_rs": "actor.rollout_correction.mask",
}


def _foreign_hint(where: str, value) -> str | None:
    """"; TRL's num_generations is rollout.n here" for an unknown key, or for the keys under an unknown section (verl's
    actor_rollout_ref.*), that FOREIGN_NAMES knows. TRL's flat names are looked up under any PPO section too."""
    def leaves(prefix, v):
        return [p for k, w in v.items() for p in leaves(f"{prefix}.{k}", w)] if isinstance(v, dict) else [prefix]

    found = []
    for path in [where, *leaves(where, value)]:
        bare = path.rpartition(".")[2]
        name = path if path in FOREIGN_NAMES else (
            bare if bare in FOREIGN_NAMES and path.partition(".")[0] not in ("sft", "rm") else None)
        if name is not None and name not in found:
            found.append(name)
    return "".join(f"; {'verl' if '.' in name else 'TRL'}'s {name} is {FOREIGN_NAMES[name]} here"
                   for name in found) or None


def build(cls, raw, prefix: str):
    """Build dataclass `cls` from a mapping, checking unknown keys (with a suggestion) and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if where in RENAMED:
            raise ConfigError(f"{where} is no longer a key: {RENAMED[where]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = _foreign_hint(where, value) or (
                f"; did you mean {prefix + close[0]!r}?" if close else f"; valid keys here: {', '.join(names)}")
            raise ConfigError(f"unknown key {where!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, where)
    return cls(**kwargs)


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value if value is not None else {}, where + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 2 and typing.get_origin(inner[1]) is list:  # X | list[X]: one value or a list of them
            return _coerce(inner[1] if isinstance(value, list) else inner[0], value, where)
        if inner == [bool, str]:  # a switch, or a text in its place
            if not isinstance(value, (bool, str)):
                raise ConfigError(f"{where}={value!r}: expected true, false, null or a text")
            return value
        if len(inner) == 2 and typing.get_origin(inner[1]) is Literal:  # X | Literal[words]: a value, or a word
            if value in typing.get_args(inner[1]):
                return value
            try:
                return _coerce(inner[0], value, where)
            except ConfigError as e:
                raise ConfigError(f"{e} or {' or '.join(map(repr, typing.get_args(inner[1])))}") from None
        assert len(inner) == 1, f"schema: only Optional[X], X | list[X] and X | Literal unions are supported ({where})"
        return _coerce(inner[0], value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}={value!r}: must be one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r}: expected a list")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={value!r}: expected an integer")
        return value
    if tp is float:
        # YAML reads 1e-6 (no dot) as a string; accept numbers in any spelling
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}={value!r}: expected a string")
        return value
    if tp is dict:  # free-form (template variables): string keys, values as YAML gives them
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}={value!r}: expected a mapping of names to values, e.g. {{enable_thinking: "
                              "false}")
        return value
    raise AssertionError(f"schema: unsupported type {tp} at {where}")


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_changes(before: dict, after: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf that differs between two config dicts (nested sections dotted)."""
    out = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out += config_changes(old, new, f"{prefix}{key}.")
        elif old != new:
            out.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return out

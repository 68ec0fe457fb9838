"""Reward functions: the built-in answer matchers, a spec to its function, and the three calling conventions.

Three conventions are accepted, told apart by the function's signature (see `reward_convention`):
- meshrl's per-sample `f(response: str, ground_truth: str | None, prompt: str) -> float`;
- TRL's batched `f(completions: list[str], prompts=..., **columns) -> list[float | None]`, called once per worker
  with its share of the step's samples (a timeout or an error costs that share), every data column as a keyword list
  (`ground_truth` under its column name, `data_source`, anything the file has), `completion_ids`, and on chat
  prompts the messages as `prompts` and conversational completions; None: the function does not apply (TRL's);
- verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict` (a dict's "score").
`prompt` is the prompt as the model saw it (chat template applied). Name one with a spec: "gsm8k", "exact_match",
"module.path:function" for a user function importable from this process's sys.path, or "path/to/file.py:function".
tasks/rewards.py runs them (user functions in worker processes).

This module imports only the standard library, so the spawned workers that import it start fast.
"""

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import types
from collections.abc import Callable
from decimal import Decimal

# A number with optional sign, dollar sign and thousands commas; trailing "." and "," are never part of it.
_NUMBER = re.compile(r"(-?)\$?(-?)((?:\d[\d,]*)?\.?\d+)")


def _numbers(text: str) -> list[Decimal]:
    found = []
    for sign_before, sign_after, digits in _NUMBER.findall(text):
        value = Decimal(digits.replace(",", ""))
        found.append(-value if sign_before or sign_after else value)
    return found


def extract_final_number(text: str) -> Decimal | None:
    """The answer a GSM8K-style text ends with: the first number after the last "####" if there is one there,
    otherwise the last number in the text; None when the text has no number."""
    _, marker, after = text.rpartition("####")
    if marker:
        after_marker = _numbers(after)
        if after_marker:
            return after_marker[0]
    found = _numbers(text)
    return found[-1] if found else None


def gsm8k_match(response: str, ground_truth: str | None, prompt: str = "") -> float:
    """1.0 when the response's final number equals the ground truth's numerically ("1,000.0" matches "1000").

    `prompt` is unused; it is accepted so all reward functions share one signature.
    """
    if ground_truth is None:
        raise ValueError("the gsm8k reward needs a ground truth for every prompt; the data has none")
    expected = extract_final_number(ground_truth)
    if expected is None:
        raise ValueError(f"the gsm8k reward needs a number in the ground truth, got {ground_truth!r}")
    return 1.0 if extract_final_number(response) == expected else 0.0


def exact_match(response: str, ground_truth: str | None, prompt: str = "") -> float:
    """1.0 when response and ground truth are equal after stripping surrounding whitespace. `prompt` is unused."""
    if ground_truth is None:
        raise ValueError("the exact_match reward needs a ground truth for every prompt; the data has none")
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {"gsm8k": gsm8k_match, "exact_match": exact_match}


def _check_spec(spec: str, what: str = "reward function") -> tuple[str, str]:
    """(module or .py file, function) of a "module.path:function" or "path/to/file.py:function" spec (verl's
    custom_reward_function.path); ValueError for anything else, and for a file that is not there. `what` names the
    spec's kind in the message ("reward function", "environment", "tool")."""
    module_name, colon, function_name = spec.rpartition(":")
    if not module_name.endswith(".py"):
        module_name, colon, function_name = spec.partition(":")
    if not (colon and module_name and function_name.isidentifier()):
        builtins = f"one of {sorted(BUILTIN_REWARDS)}, " if what == "reward function" else ""
        raise ValueError(
            f"{what} spec {spec!r} is not valid; use {builtins}'module.path:function' or 'path/to/file.py:function'"
        )
    if module_name.endswith(".py") and not os.path.isfile(module_name):
        raise ValueError(f"{what} {spec!r}: no file {os.path.abspath(module_name)}")
    return module_name, function_name


def _import_file(path: str):
    """The module of a .py file, its folder first on sys.path so that the modules beside it (its own config.py) are
    the ones it imports."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # as an import would: dataclasses and pickling look the module up by name
    module_spec.loader.exec_module(module)
    return module


def load_reward_function(spec: str, what: str = "reward function") -> Callable[[str, str | None, str], float]:
    """The function a spec names: a builtin ("gsm8k", "exact_match"), "module.path:function" or
    "path/to/file.py:function". `what` names it in errors (environments and tools are loaded so too)."""
    if what == "reward function" and spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, function_name = _check_spec(spec, what)
    if module_name.endswith(".py"):
        module = _import_file(module_name)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            hint = ""
            if isinstance(e, ModuleNotFoundError) and e.name and (module_name + ".").startswith(e.name + "."):
                top = module_name.partition(".")[0]
                hint = (f". The folder that holds {top!r} is not on the path: start with PYTHONPATH=that/folder "
                        f"(PYTHONPATH=. from there), or name the file: 'path/to/{module_name.replace('.', '/')}.py:"
                        f"{function_name}'")
            raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}{hint}") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{what} {spec!r}: module {module_name!r} has no function {function_name!r}; "
            f"its public callables are {available}"
        )
    return function


CONVENTIONS = ("meshrl", "trl", "verl")
SIGNATURES = ("meshrl: f(response, ground_truth, prompt) -> float; TRL: f(completions, prompts=None, **columns) -> "
              "list[float]; verl: compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float")


def reward_convention(function: Callable, spec: str) -> str:
    """Which of CONVENTIONS `function` follows, from its parameters; ValueError naming the signature otherwise."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: assume ours
        return "meshrl"
    names = list(signature.parameters)
    if "solution_str" in names:
        return "verl"
    if names[:1] == ["completions"]:
        return "trl"
    try:
        signature.bind("", None, "")
    except TypeError:
        raise ValueError(f"reward function {spec!r} has the signature {function.__name__}{signature}, which none "
                         f"of the accepted conventions has; {SIGNATURES}") from None
    return "meshrl"


def bind_reward(function: Callable, convention: str) -> Callable[..., list]:
    """`call(responses, ground_truths, prompts, columns, extras, state=None)`: the rewards of a chunk of samples under
    `convention`, one per sample (columns: each sample's other data columns by name; extras: "messages", the prompt's
    chat messages when it was given as such, and "completion_ids", the response's token ids; state: TRL's
    trainer_state fields; the last two for TRL's functions).
    A TRL-style function gets the whole chunk in one call, as TRL calls it; the others one sample at a time. The
    keywords a TRL or verl function accepts are read once, here, not per sample."""
    if convention == "meshrl":
        return lambda responses, ground_truths, prompts, columns, extras, state=None: [
            function(*args) for args in zip(responses, ground_truths, prompts)]
    accepted = inspect.signature(function).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())

    def keywords(given: dict) -> dict:
        return {k: v for k, v in given.items() if takes_all or k in accepted}

    def verl(responses, ground_truths, prompts, columns, extras, state=None):
        outs = [function(**keywords({"data_source": c.get("data_source"), "solution_str": response,
                                     "ground_truth": ground_truth, "extra_info": c.get("extra_info")}))
                for response, ground_truth, c in zip(responses, ground_truths, columns)]
        return outs  # a dict's "score" and its other numbers: _score_and_extras

    def trl(responses, ground_truths, prompts, columns, extras, state=None):
        extras = [e or {} for e in extras]
        names = dict.fromkeys(k for c in columns for k in c)
        given = {**{k: [c.get(k) for c in columns] for k in names}, "ground_truth": list(ground_truths),
                 "prompts": [p if e.get("messages") is None else e["messages"] for p, e in zip(prompts, extras)]}
        if all(e.get("completion_ids") is not None for e in extras):
            given["completion_ids"] = [e["completion_ids"] for e in extras]
        if state is not None:  # TRL's TrainerState, as far as meshrl has its fields: trainer_state.global_step
            given["trainer_state"] = types.SimpleNamespace(**state)
        # conversational data gets TRL's conversational completions: c[0]["content"]
        completions = [r if e.get("messages") is None else [{"role": "assistant", "content": r}]
                       for r, e in zip(responses, extras)]
        out = function(completions, **keywords(given))
        if not isinstance(out, (list, tuple)) or len(out) != len(completions):
            raise TypeError(f"a TRL-style reward function returns one score per completion; for "
                            f"{len(completions)} it returned {out!r:.200}")
        return [NOT_APPLICABLE if v is None else v for v in out]

    return verl if convention == "verl" else trl


# what a TRL-style function's None (TRL: "this function does not apply to this sample") becomes: no part of the
# sample's reward, not an error
NOT_APPLICABLE = float("nan")


def _as_score(value: object) -> float:
    if value is NOT_APPLICABLE:
        return value
    if not isinstance(value, numbers.Real):
        raise TypeError(f"the reward function returned {value!r:.200} ({type(value).__name__}), not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"the reward function returned {score}, not a finite number")
    return score


MAX_TEXT_EXTRA_CHARS = 200  # a dict's text (verl's `pred`) is kept this long, for the eval samples


def _score_and_extras(value: object) -> tuple[float, dict[str, float | str]]:
    """(score, the other values) of a result: a verl-style dict gives its "score", its other finite numbers (`acc`,
    ...: verl's reward_extra_info, logged as metrics) and its texts (`pred`, cut to MAX_TEXT_EXTRA_CHARS: kept in the
    eval samples); anything else is the score alone."""
    if not isinstance(value, dict):
        return _as_score(value), {}
    if "score" not in value:
        raise KeyError(f"a compute_score dict needs a 'score'; it had {sorted(value)}")
    extras: dict[str, float | str] = {}
    for k, v in value.items():
        if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v)):
            extras[str(k)] = float(v)
        elif k != "score" and isinstance(v, str):
            extras[str(k)] = v[:MAX_TEXT_EXTRA_CHARS]
    return _as_score(value["score"]), extras

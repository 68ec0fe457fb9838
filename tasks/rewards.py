"""Function rewards: built-in answer matchers and user functions, the latter run in worker processes.

Three conventions are accepted, told apart by the function's signature (see `reward_convention`):
- meshrl's per-sample `f(response: str, ground_truth: str | None, prompt: str) -> float`;
- TRL's batched `f(completions: list[str], prompts=..., **columns) -> list[float | None]`, called once per worker
  with its share of the step's samples (a timeout or an error costs that share), every data column as a keyword list
  (`ground_truth` under its column name, `data_source`, anything the file has), `completion_ids`, and on chat
  prompts the messages as `prompts` and conversational completions; None: the function does not apply (TRL's);
- verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict` (a dict's "score").
`prompt` is the prompt as the model saw it (chat template applied). Name one with a spec: "gsm8k", "exact_match",
"module.path:function" for a user function importable from this process's sys.path, or "path/to/file.py:function".

This module imports only the standard library, so the spawned workers that import it start fast.
"""

import contextlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import re
import signal
import sys
import threading
import time
import traceback
import types
from collections import deque
from collections.abc import Callable, Sequence
from decimal import Decimal
from multiprocessing.connection import wait

logger = logging.getLogger("meshrl")

# A worker imports the user's module (not the main script: _main_script_hidden); a generous bound still catches
# a hang.
START_TIMEOUT_S = 120.0

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


def _exit_with_parent(parent: int) -> None:
    """A worker busy in a user function never reads its pipe, so it would not see its trainer die (SIGKILL): poll."""
    while os.getppid() == parent:
        time.sleep(1.0)
    _end_own_group()


def _end_own_group(*_) -> None:
    """End this worker and every process in its group (what the user's module started, at import or in a call):
    nothing a reward function spawned outlives the run."""
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


# meshrl's top-level folder: its modules (config, tasks, algo, batch, plan, monitor, checkpoint, ...) have names a
# user's reward folder may have too
_MESHRL_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _user_sys_path(spec: str) -> list[str]:
    """The workers' sys.path: this process's, less meshrl's top-level folder where it is there only because Python
    put the folder of the script it runs (train_ppo.py) first, so that a user's `config.py` or `tasks/` is not
    hidden by ours. A user who names that folder in PYTHONPATH keeps it in place; a spec whose module the user's
    path does not have (meshrl's own, as `tasks.synthetic:addition_reward`) finds it there last."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file or os.path.dirname(os.path.realpath(main_file)) != _MESHRL_ROOT:
        return list(sys.path)
    named = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if _MESHRL_ROOT in named:
        return list(sys.path)
    paths = [p for p in sys.path if os.path.realpath(p or os.curdir) != _MESHRL_ROOT]
    module_name = _check_spec(spec)[0]
    if not module_name.endswith(".py") and importlib.machinery.PathFinder.find_spec(
            module_name.partition(".")[0], paths) is None:
        paths.append(_MESHRL_ROOT)
    return paths


def _forget_meshrl_modules() -> None:
    """Drop what spawn imported of meshrl to start a worker (`tasks`, `tasks.rewards`) from sys.modules, so that the
    user's module of the same name is imported from the user's path."""
    ours = set()
    for name in {n.partition(".")[0] for n in sys.modules}:
        path = os.path.realpath(getattr(sys.modules.get(name), "__file__", None) or os.devnull)
        if path in (os.path.join(_MESHRL_ROOT, name + ".py"), os.path.join(_MESHRL_ROOT, name, "__init__.py")):
            ours.add(name)
    for name in [n for n in sys.modules if n.partition(".")[0] in ours]:
        del sys.modules[name]


def enter_worker(sys_path: list[str], specs: Sequence[str]) -> None:
    """What a spawned worker of user code (a reward function's, an environment's) does first: ignore Ctrl-C, lead a
    process group of its own, end with its parent, and import the user's modules from the user's paths."""
    # Ctrl-C reaches the whole process group; the parent decides how to shut down, the workers just get stopped.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a group of its own, which the processes the user's module starts join: stop() and the parent's end take it all
    os.setpgrp()
    signal.signal(signal.SIGTERM, _end_own_group)  # multiprocessing's atexit terminates daemon workers so
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    sys.path[:] = sys_path
    if not any(spec.partition(":")[0] in ("__main__", "__mp_main__") for spec in specs):
        _forget_meshrl_modules()


def stop_worker(process, conn, idle: bool) -> None:
    """End a worker and every process in its group (what the user's code started); an idle one is first asked to
    exit on its own."""
    if idle:
        try:
            conn.send(None)
        except OSError:
            pass
        process.join(timeout=1.0)
    try:  # the worker's group: the worker (if still alive) and what the user's module started
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left, or the worker had not made its group yet
        pass
    if process.is_alive():
        process.kill()
    process.join()
    conn.close()


def _worker_main(conn, spec: str, sys_path: list[str]) -> None:
    """Worker loop: load the function, say "ready", then score (indices, responses, ground_truths, prompts, columns,
    extras) chunks until a None task or the parent's end of the pipe closes."""
    enter_worker(sys_path, [spec])
    try:
        function = load_reward_function(spec)
        convention = reward_convention(function, spec)
        call = bind_reward(function, convention)
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", convention))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        indices, chunk = task[0], task[1:]
        try:
            results = [_score_and_extras(v) for v in call(*chunk)]
        except Exception:
            conn.send(("failed", indices, traceback.format_exc()))
        else:
            conn.send(("scored", indices, results))


_MAIN_HIDDEN_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_script_hidden(spec: str):
    """Start a spawned process without it running the main script: spawn makes the child import the parent's
    `__main__` from its file (train_ppo.py: torch, transformers, every role; seconds of CPU and hundreds of MB per
    worker), which a worker needs only when the reward function lives there ("__main__:f"). The child reads the
    script's path from `__main__.__file__` / `__spec__` when the process starts; they are put back right after."""
    main = sys.modules.get("__main__")
    if main is None or spec.partition(":")[0] in ("__main__", "__mp_main__"):
        yield
        return
    with _MAIN_HIDDEN_LOCK:  # two runners starting workers from two threads must not save each other's hidden state
        saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None  # spawn reads it unguarded; None (a script) with no file: nothing to import
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class _Worker:
    """One spawned process that scores one chunk of items at a time over a pipe."""

    def __init__(self, context, spec: str):
        self.conn, child_conn = context.Pipe()
        # The user's module may be importable only through paths added at run time (pytest's pythonpath, a script's
        # sys.path.insert), so the worker gets this process's sys.path explicitly (less meshrl's own folder).
        self.process = context.Process(
            target=_worker_main, args=(child_conn, spec, _user_sys_path(spec)), daemon=True, name="meshrl-reward-worker"
        )
        with _main_script_hidden(spec):
            self.process.start()
        child_conn.close()  # so that recv() here raises EOFError once the worker exits
        self.ready = False
        self.indices: list[int] | None = None  # the chunk in hand
        self.deadline = time.monotonic() + START_TIMEOUT_S  # until ready; then the deadline of the chunk in hand

    def stop(self) -> None:
        stop_worker(self.process, self.conn, idle=self.indices is None)


class RewardFunctionRunner:
    """Scores batches with a reward function; user functions run in `num_workers` spawned processes.

    Builtins run in this process. A user function that raises, returns a non-finite or non-numeric value, or runs
    longer than `timeout_s` per item on its chunk (one item, or a TRL-style function's share) scores 0.0 for the
    chunk's items; its worker is killed and replaced after a timeout.
    Failures are counted per call in the stats ("reward_fn/errors", "reward_fn/timeouts"); only the first traceback
    and the first timeout are logged. Workers use the "spawn" start method (fork is unsafe once torch has started
    threads) without running the main script (_main_script_hidden), except for a function defined there
    ("__main__:f"), for which the script must guard its entry point with `if __name__ == "__main__":`.
    """

    def __init__(self, spec: str, num_workers: int = 2, timeout_s: float = 10.0):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be at least 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        self.spec, self.timeout_s = spec, timeout_s
        # A user module is imported only in the workers, under their start timeout: a module that hangs or fails on
        # import cannot hang the trainer. Its errors (import, missing function, signature) come back from the first
        # call as a ValueError with the worker's traceback (the file and line).
        self._inline = BUILTIN_REWARDS.get(spec)
        if self._inline is None:
            _check_spec(spec)
        self.convention = "meshrl" if self._inline is not None else None  # a user function's: once a worker is up
        self.last_failed: set[int] = set()  # the items of the last call that failed or timed out
        self.last_error: str | None = None  # the first failure's traceback in the last call
        self.last_extras: list[dict[str, float]] = []  # each item's other numbers in the last call (verl's dicts)
        # the other numbers the start-up calls (check) returned: the same on every rank, so the metrics' keys are
        self.extra_keys: list[str] = []
        self.text_keys: list[str] = []  # likewise, the texts (verl's `pred`): kept in the eval samples
        self._context = multiprocessing.get_context("spawn")
        self._workers = [] if self._inline is not None else [_Worker(self._context, spec) for _ in range(num_workers)]
        self._logged_error = self._logged_timeout = False

    def __call__(
        self, responses: Sequence[str], ground_truths: Sequence[str | None], prompts: Sequence[str],
        columns: Sequence[dict] | None = None, extras: Sequence[dict | None] | None = None,
        trainer_state: dict | None = None,
    ) -> tuple[list[float], dict[str, int]]:
        """Scores of the items; columns: each item's other data columns (for TRL- and verl-style functions); extras:
        each item's chat messages and response token ids, and trainer_state, {"global_step", "max_steps"} (for
        TRL-style ones: bind_reward). A TRL-style function's None scores NaN (NOT_APPLICABLE): no part of the item's
        reward, and no failure."""
        columns = columns if columns is not None else [{}] * len(responses)
        extras = extras if extras is not None else [None] * len(responses)
        if not len(responses) == len(ground_truths) == len(prompts) == len(columns):
            raise ValueError(
                f"got {len(responses)} responses, {len(ground_truths)} ground truths, {len(prompts)} prompts and "
                f"{len(columns)} column sets; they must be equally many"
            )
        stats = {"reward_fn/errors": 0, "reward_fn/timeouts": 0}
        self.last_failed, self.last_error = set(), None
        self.last_extras = [{} for _ in responses]
        if self._inline is not None:
            return [float(self._inline(*args)) for args in zip(responses, ground_truths, prompts)], stats
        if not self._workers:
            raise RuntimeError("RewardFunctionRunner is closed")

        scores = [0.0] * len(responses)
        todo = deque(range(len(responses)))
        n_left = len(responses)
        # a TRL-style function takes a chunk per worker in one call (batched judges keep their batching); the others
        # one item at a time, so that an error or a timeout costs one item
        per_chunk = -(-len(responses) // len(self._workers))
        while n_left:
            for slot, worker in enumerate(self._workers):
                if todo and worker.ready and worker.indices is None:
                    size = min(len(todo), per_chunk if self.convention == "trl" else 1)
                    chunk = [todo.popleft() for _ in range(size)]
                    try:
                        worker.conn.send((chunk, *([part[i] for i in chunk] for part in
                                                   (responses, ground_truths, prompts, columns, extras)),
                                          trainer_state))
                    except OSError:  # the worker died while idle
                        todo.extendleft(reversed(chunk))
                        self._replace(slot)
                        continue
                    worker.indices, worker.deadline = chunk, time.monotonic() + self.timeout_s * len(chunk)
            deadlines = [w.deadline for w in self._workers if w.indices is not None or not w.ready]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            readable = wait([w.conn for w in self._workers], timeout=wait_s)
            for slot, worker in enumerate(self._workers):
                if worker.conn in readable:
                    n_left -= self._receive(slot, scores, stats)
                elif time.monotonic() < worker.deadline:
                    continue
                elif not worker.ready:
                    self.close()
                    raise ValueError(f"a reward worker for {self.spec!r} did not start within {START_TIMEOUT_S} s "
                                     "(importing its module hangs?)")
                elif worker.indices is not None:
                    stats["reward_fn/timeouts"] += len(worker.indices)
                    self.last_failed.update(worker.indices)
                    n_left -= len(worker.indices)
                    self.last_error = self.last_error or f"timed out after timeout_s={self.timeout_s} s"
                    if not self._logged_timeout:
                        self._logged_timeout = True
                        logger.warning(
                            "reward function %s ran longer than timeout_s=%s per item (on a chunk of %d); scored 0.0 "
                            "and restarted its worker. Later timeouts are counted in reward_fn/timeouts, not logged.",
                            self.spec,
                            self.timeout_s,
                            len(worker.indices),
                        )
                    self._replace(slot)
        return scores, stats

    def _receive(self, slot: int, scores: list[float], stats: dict[str, int]) -> int:
        """Handle one message from a worker; returns how many items it finished."""
        worker = self._workers[slot]
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return self._worker_exited(slot, stats)
        kind = message[0]
        if kind == "ready":
            worker.ready, self.convention = True, message[1]
            return 0
        if kind == "init_error":
            self.close()
            raise ValueError(f"reward function {self.spec!r} could not be loaded in its worker process:\n{message[1]}")
        _, indices, payload = message
        assert indices == worker.indices, (indices, worker.indices)
        worker.indices = None
        if kind == "scored":
            for index, (score, extras) in zip(indices, payload):
                scores[index], self.last_extras[index] = score, extras
        else:
            self.last_failed.update(indices)
            self._record_error(stats, payload, len(indices))
        return len(indices)

    def _worker_exited(self, slot: int, stats: dict[str, int]) -> int:
        worker = self._workers[slot]
        worker.process.join(timeout=1.0)
        if not worker.ready:
            self.close()
            raise ValueError(
                f"a reward worker for {self.spec!r} exited with code {worker.process.exitcode} while starting "
                "(its module exits on import?)"
            )
        busy = worker.indices or []
        if busy:
            self.last_failed.update(busy)
            self._record_error(stats, f"the worker process exited with code {worker.process.exitcode} while scoring",
                               len(busy))
        self._replace(slot)
        return len(busy)

    def check(self, response: str, ground_truth: str | None, prompt: str, columns: dict, where: str,
              extras: dict | None = None) -> None:
        """One call on one sample before training: ValueError naming `where` and with the traceback when it fails,
        returns something that is not a finite number, or times out."""
        try:
            self([response], [ground_truth], [prompt], [columns], [extras], {"global_step": 0, "max_steps": 0})
        except Exception as e:  # a builtin runs inline and raises here
            raise ValueError(f"reward function {self.spec!r} failed its start-up call on {where}: {e}") from e
        if self.last_failed:
            raise ValueError(f"reward function {self.spec!r} ({self.convention} convention) failed its start-up "
                             f"call on {where} (response {response!r:.80}):\n{self.last_error}")
        first = self.last_extras[0]
        self.extra_keys = sorted(set(self.extra_keys) | {k for k, v in first.items() if not isinstance(v, str)})
        self.text_keys = sorted(set(self.text_keys) | {k for k, v in first.items() if isinstance(v, str)})

    def _record_error(self, stats: dict[str, int], description: str, items: int = 1) -> None:
        self.last_error = self.last_error or description
        stats["reward_fn/errors"] += items
        if not self._logged_error:
            self._logged_error = True
            logger.error(
                "reward function %s failed on one item; scored 0.0. Later failures are counted in "
                "reward_fn/errors, not logged.\n%s",
                self.spec,
                description,
            )

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop()
        self._workers[slot] = _Worker(self._context, self.spec)

    def close(self) -> None:
        """Stop the workers; idempotent."""
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> "RewardFunctionRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

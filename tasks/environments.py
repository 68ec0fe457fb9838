"""Environments and tools of multi-turn episodes, run in worker processes (rollout/episodes.py drives them).

An environment is any object a factory makes from a data record (every column of the row, as a dict):

    def make_env(record: dict) -> env          # rollout.environment: "module.path:make_env" or "path/to/file.py:..."
    env.reset() -> observation | None          # shown before the model's first turn (None: the prompt is enough)
    env.step(text: str) -> (observation | None, reward: float, done: bool[, info: dict of numbers])
    env.close()                                # optional

`text` is the model's turn, decoded; an observation is a str (a user message under a chat template, else plain
text), a message dict ({"role": "tool", "content": ...}) or a list of them. The episode ends when `done` is true or
the observation is None; rewards of the steps are summed (or the last one kept: rollout.episode_reward). An `info`
dict's numbers are logged as `env/<key>/mean`.

Tools (rollout.tools: ["module.path:function", ...]) are plain functions with type hints and a docstring (the
transformers / TRL convention: the JSON schema comes from them and goes to the chat template as `tools=`). They run
in a ToolEnvironment: a turn with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes /
Qwen format) gets one tool message per call back; a turn without one ends the episode (its text is the answer).

Everything user-made runs in spawned worker processes that import the user's modules from the user's paths (as the
reward workers do; both through tasks/worker_processes.py): an environment that raises, returns something malformed,
hangs past `timeout_s` or kills its process ends its episode with reward 0 and is counted; the trainer goes on.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import numbers
import re
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from tasks.reward_functions import load_reward_function
from tasks.worker_processes import START_TIMEOUT_S, _main_script_hidden, _user_sys_path, enter_worker, stop_worker

logger = logging.getLogger("meshrl")
MAX_TOOL_RESULT_CHARS = 4000  # a tool's output beyond this is cut (a model's context is not a log file)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


# ------------------------------------------------------------------------------------------------------ tools
def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The Hermes / Qwen tool calls in a model's turn: ([{"name", "arguments"}], [what was malformed]).
    `arguments` may be given as a JSON object or as a string holding one."""
    calls, errors = [], []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not JSON ({e.msg} at char {e.pos}): {body.strip()[:200]}")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            errors.append(f'a tool call needs {{"name": str, "arguments": object}}, got: {body.strip()[:200]}')
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    if text.count("<tool_call>") > text.count("</tool_call>"):
        errors.append("a <tool_call> was not closed with </tool_call>")
    return calls, errors


class _ToolTimeout(Exception):
    pass


def _on_alarm(*_):
    raise _ToolTimeout


class ToolEnvironment:
    """The environment of rollout.tools: each turn's tool calls run (each under `timeout_s`, in this worker's main
    thread) and their results come back as tool messages; a turn without a call ends the episode. Errors, unknown
    tools, malformed calls and timeouts are reported to the model as the call's result and counted."""

    def __init__(self, functions: dict[str, Callable], timeout_s: float):
        self.functions, self.timeout_s = functions, timeout_s

    def reset(self):
        return None

    def step(self, text: str):
        calls, malformed = parse_tool_calls(text)
        if not calls and not malformed:
            return None, 0.0, True, {"tool_calls": 0.0, "tool_errors": 0.0}
        messages, errors, timeouts = [], len(malformed), 0
        for call in calls:
            function = self.functions.get(call["name"])
            if function is None:
                result, errors = f"error: no tool named {call['name']!r}; tools: {sorted(self.functions)}", errors + 1
            else:
                try:
                    result = self._call(function, call["arguments"])
                except _ToolTimeout:
                    result = f"error: the tool ran longer than {self.timeout_s} s and was stopped"
                    errors, timeouts = errors + 1, timeouts + 1
                except Exception as e:
                    result, errors = f"error: {type(e).__name__}: {e}", errors + 1
            text_result = result if isinstance(result, str) else json.dumps(result, default=str)
            if len(text_result) > MAX_TOOL_RESULT_CHARS:
                text_result = text_result[:MAX_TOOL_RESULT_CHARS] + "\n[... output cut]"
            messages.append({"role": "tool", "name": call["name"], "content": text_result})
        messages += [{"role": "tool", "content": f"error: {m}"} for m in malformed]
        info = {"tool_calls": float(len(calls) + len(malformed)), "tool_errors": float(errors),
                "tool_timeouts": float(timeouts)}
        return messages, 0.0, False, info

    def _call(self, function: Callable, arguments: dict):
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            return function(**arguments)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def tool_schema(function: Callable) -> dict:
    """The JSON schema transformers derives from a function's type hints and Google-style docstring (what
    `apply_chat_template(tools=[function])` would use)."""
    from transformers.utils import get_json_schema

    return get_json_schema(function)


# ------------------------------------------------------------------------------------------------------ results
def _check_observation(obs: object, where: str) -> object:
    if obs is None or isinstance(obs, str):
        return obs
    messages = [obs] if isinstance(obs, dict) else obs
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise TypeError(f"{where} returned an observation of type {type(obs).__name__}: {obs!r:.200}; an observation "
                        "is None, a str, a message dict {'role': ..., 'content': str} or a list of them")
    return messages


def _check_step(value: object) -> tuple:
    if not isinstance(value, tuple) or len(value) not in (3, 4):
        raise TypeError(f"env.step returned {value!r:.200}; it must return (observation, reward, done) or "
                        "(observation, reward, done, info)")
    obs, reward, done, info = (*value, {}) if len(value) == 3 else value
    obs = _check_observation(obs, "env.step")
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or not math.isfinite(float(reward)):
        raise TypeError(f"env.step returned the reward {reward!r:.100}; it must be a finite number")
    if not isinstance(info, dict):
        raise TypeError(f"env.step returned info of type {type(info).__name__}; it must be a dict")
    numbers_only = {str(k): float(v) for k, v in info.items()
                    if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))}
    return obs, float(reward), bool(done), numbers_only


@dataclass
class StepResult:
    """One reset or step of one episode's environment; error set when it failed (the episode ends, reward 0)."""

    observation: object = None
    reward: float = 0.0
    done: bool = True
    info: dict = field(default_factory=dict)
    error: str | None = None
    timeout: bool = False


# ------------------------------------------------------------------------------------------------------ workers
def _load_factory(kind: str, specs: list[str], tool_timeout_s: float) -> Callable:
    """factory(record) -> env, in a worker."""
    if kind == "environment":
        return load_reward_function(specs[0], "environment")
    functions = {}
    for spec in specs:
        function = load_reward_function(spec, "tool")
        name = getattr(function, "__name__", spec.rpartition(":")[2])
        if name in functions:
            raise ValueError(f"two tools are named {name!r} (rollout.tools: {specs})")
        functions[name] = function
    return lambda record: ToolEnvironment(functions, tool_timeout_s)


def _worker_main(conn, kind: str, specs: list[str], sys_path: list[str], tool_timeout_s: float,
                 want_schemas: bool) -> None:
    """Worker loop: load the factory, say "ready" (with the tools' schemas when asked), then serve ("open", id,
    record), ("step", id, text) and ("close", id) until None or the parent's end of the pipe closes."""
    enter_worker(sys_path, specs)
    try:
        factory = _load_factory(kind, specs, tool_timeout_s)
        schemas = []
        if kind == "tools" and want_schemas:
            schemas = [tool_schema(f) for f in factory({}).functions.values()]
    except BaseException:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", schemas))
    envs: dict[int, object] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        op, episode, argument = message
        try:
            if op == "close":
                env = envs.pop(episode, None)
                if env is not None and hasattr(env, "close"):
                    env.close()
                continue
            if op == "open":
                env = envs[episode] = factory(argument)
                obs = _check_observation(env.reset() if hasattr(env, "reset") else None, "env.reset")
                result = (obs, 0.0, False, {})
            else:
                result = _check_step(envs[episode].step(argument))
        except Exception:
            error = traceback.format_exc()
            broken = envs.pop(episode, None)  # its episode ends: what it holds (a sandbox, a process) is let go
            if broken is not None and hasattr(broken, "close"):
                try:
                    broken.close()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            if op != "close":
                conn.send(("error", episode, error))
            continue
        conn.send(("ok", episode, result))


class _Worker:
    def __init__(self, context, kind: str, specs: list[str], tool_timeout_s: float, want_schemas: bool):
        self.conn, child = context.Pipe()
        spec = specs[0] if specs else "x:y"
        self.process = context.Process(
            target=_worker_main, args=(child, kind, specs, _user_sys_path(spec), tool_timeout_s, want_schemas),
            daemon=True, name="meshrl-env-worker")
        with _main_script_hidden(spec):
            self.process.start()
        child.close()
        self.ready, self.busy = False, None  # busy: the episode of the request in flight
        self.deadline = time.monotonic() + START_TIMEOUT_S
        self.episodes: set[int] = set()  # whose environments live here

    def stop(self) -> None:
        stop_worker(self.process, self.conn, idle=self.busy is None)


class EnvironmentPool:
    """`num_workers` processes hosting the environments of a rollout's episodes (episode e on worker e % num_workers).

    kind "environment": specs = [the factory's spec]; kind "tools": specs = the tools' specs (a ToolEnvironment per
    episode; `tool_schemas` holds their JSON schemas for the chat template). Requests of all workers run at once; a
    request past `timeout_s` kills its worker, which ends every episode it hosted (counted as timeouts)."""

    def __init__(self, kind: str, specs: Sequence[str], num_workers: int = 2, timeout_s: float = 60.0,
                 tool_timeout_s: float = 10.0):
        if kind not in ("environment", "tools"):
            raise ValueError(f"kind must be 'environment' or 'tools', got {kind!r}")
        if num_workers < 1 or not timeout_s > 0 or not tool_timeout_s > 0:
            raise ValueError(f"need num_workers >= 1 and positive timeouts, got {num_workers}, {timeout_s}, "
                             f"{tool_timeout_s}")
        self.kind, self.specs, self.timeout_s, self.tool_timeout_s = kind, list(specs), timeout_s, tool_timeout_s
        self.what = f"rollout.environment {self.specs[0]!r}" if kind == "environment" else \
            f"rollout.tools {self.specs}"
        self._context = multiprocessing.get_context("spawn")
        self._workers = [self._start(i == 0) for i in range(num_workers)]
        self.tool_schemas: list[dict] = []
        self._wait_ready(self._workers)
        self.first_error: str | None = None

    def _start(self, want_schemas: bool) -> _Worker:
        return _Worker(self._context, self.kind, self.specs, self.tool_timeout_s, want_schemas)

    def _wait_ready(self, workers: list[_Worker]) -> None:
        for worker in workers:
            while not worker.ready:
                if not worker.conn.poll(max(0.0, worker.deadline - time.monotonic())):
                    self.close()
                    raise ValueError(f"{self.what}: a worker did not start within {START_TIMEOUT_S} s "
                                     "(importing its module hangs?)")
                try:
                    message = worker.conn.recv()
                except EOFError:
                    code = worker.process.exitcode
                    self.close()
                    raise ValueError(f"{self.what}: a worker exited with code {code} while starting (its module "
                                     "exits on import?)") from None
                if message[0] == "init_error":
                    self.close()
                    raise ValueError(f"{self.what} could not be loaded in its worker process:\n{message[1]}")
                worker.ready = True
                self.tool_schemas = self.tool_schemas or message[1]

    def open(self, records: dict[int, dict]) -> dict[int, StepResult]:
        """Make and reset an environment per episode: {episode: record} -> {episode: first observation}."""
        return self._run([("open", e, r) for e, r in records.items()])

    def step(self, texts: dict[int, str]) -> dict[int, StepResult]:
        """One step per episode with the model's turn: {episode: text} -> {episode: result}."""
        return self._run([("step", e, t) for e, t in texts.items()])

    def close_episodes(self, episodes: Sequence[int]) -> None:
        for e in episodes:
            worker = self._workers[e % len(self._workers)]
            if e in worker.episodes:
                worker.episodes.discard(e)
                try:
                    worker.conn.send(("close", e, None))
                except OSError:
                    pass

    def _run(self, requests: list[tuple]) -> dict[int, StepResult]:
        if not self._workers:
            raise RuntimeError("EnvironmentPool is closed")
        queues = [deque() for _ in self._workers]
        for request in requests:
            queues[request[1] % len(self._workers)].append(request)
        results: dict[int, StepResult] = {}
        retried: set[int] = set()  # opens sent again to the successor of a worker found dead
        while any(queues) or any(w.busy is not None for w in self._workers):
            for slot, worker in enumerate(self._workers):
                while worker.busy is None and queues[slot]:
                    op, episode, argument = queues[slot].popleft()
                    if op == "step" and episode not in worker.episodes:  # its worker was lost: so was the episode
                        results[episode] = StepResult(error="its environment was lost with its worker")
                        continue
                    try:
                        worker.conn.send((op, episode, argument))
                    except OSError:  # it died while idle: its episodes are lost; an open goes to its successor
                        self._replace(slot, results)
                        worker = self._workers[slot]
                        if op == "open" and episode not in retried:
                            retried.add(episode)
                            queues[slot].appendleft((op, episode, argument))
                        else:
                            results[episode] = StepResult(error="the environment's worker died")
                        continue
                    if op == "open":
                        worker.episodes.add(episode)
                    worker.busy, worker.deadline = episode, time.monotonic() + self.timeout_s
            busy = [w for w in self._workers if w.busy is not None]
            if not busy:
                continue
            readable = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic()))
            for slot, worker in enumerate(self._workers):
                if worker.busy is None:
                    continue
                if worker.conn in readable:
                    try:
                        kind, episode, payload = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(timeout=1.0)
                        results[worker.busy] = StepResult(
                            error=f"the environment's worker exited with code {worker.process.exitcode}")
                        self._note(results[worker.busy].error)
                        self._replace(slot, results)
                        continue
                    worker.busy = None
                    if kind == "ok":
                        obs, reward, done, info = payload
                        results[episode] = StepResult(obs, reward, done, info)
                    else:
                        worker.episodes.discard(episode)
                        results[episode] = StepResult(error=payload)
                        self._note(payload)
                elif time.monotonic() >= worker.deadline:
                    results[worker.busy] = StepResult(error=f"timed out after {self.timeout_s} s", timeout=True)
                    self._note(f"{self.what}: a call timed out after rollout.env_timeout_s={self.timeout_s} s; "
                               "its worker was restarted")
                    self._replace(slot, results)
        return results

    def _note(self, error: str) -> None:
        """The first failure is logged with its traceback; the later ones are counted (episode/env_errors,
        episode/env_timeouts)."""
        if self.first_error is None:
            self.first_error = error
            logger.error("%s failed; its episode ends with reward 0. Later failures are counted in "
                         "episode/env_errors and episode/env_timeouts, not logged.\n%s", self.what, error)

    def _replace(self, slot: int, results: dict[int, StepResult]) -> None:
        """Kill a worker (hung or dead) and start another; the episodes it hosted end."""
        worker = self._workers[slot]
        for episode in worker.episodes:
            results.setdefault(episode, StepResult(error="its environment was lost with its worker"))
        worker.stop()
        self._workers[slot] = fresh = self._start(False)
        self._wait_ready([fresh])

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

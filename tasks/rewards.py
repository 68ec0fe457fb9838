"""Function rewards scored for the trainer: builtins in this process, user functions in spawned worker processes
(RewardFunctionRunner), with their failures and timeouts counted. What a reward function is, its spec and its
conventions: tasks/reward_functions.py; the worker processes' start and stop: tasks/worker_processes.py.

This module imports only the standard library (the two tasks modules above, which do too), so the spawned workers
that import it start fast.
"""

import logging
import multiprocessing
import time
import traceback
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import wait

from tasks.reward_functions import (
    BUILTIN_REWARDS,
    _check_spec,
    _score_and_extras,
    bind_reward,
    load_reward_function,
    reward_convention,
)
from tasks.worker_processes import (
    START_TIMEOUT_S,
    _main_script_hidden,
    _user_sys_path,
    enter_worker,
    stop_worker,
)

logger = logging.getLogger("meshrl")


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

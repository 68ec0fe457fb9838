"""The spawned processes that run user code (reward functions, environments, tools): started without the trainer's
main script and with the user's sys.path, each the leader of a process group of its own that ends with its parent,
and stopped with everything the user's code started.

This module imports only the standard library (tasks/reward_functions.py, which does too), so the spawned workers
that import it start fast.
"""

import contextlib
import importlib.machinery
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from tasks.reward_functions import _check_spec

# A worker imports the user's module (not the main script: _main_script_hidden); a generous bound still catches
# a hang.
START_TIMEOUT_S = 120.0


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
    """Drop what spawn imported of meshrl to start a worker (`tasks`, `tasks.rewards`, ...) from sys.modules, so
    that the user's module of the same name is imported from the user's path."""
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

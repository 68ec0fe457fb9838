"""Run untrusted Python (a model's code) in a child process that cannot hurt the trainer or the machine, and say what
happened. Used by code rewards (tasks/humaneval_reward.py) and as a tool; imports nothing of the trainer.

The child is a fresh `python -I` (no environment, no user site) in a throwaway folder, in its own session (the whole
group is killed at the wall-clock limit), under rlimits: address space (memory), CPU seconds, file size (its output
files too: a flood of output ends it), open files, and no core dumps. Before the program runs, an audit hook
(PEP 578, which the program cannot remove) refuses what a test program never needs: new processes (fork, exec,
subprocess, os.system: no fork bomb), sockets (no network), and writes, renames or deletions outside its folder;
loading native libraries through ctypes is refused too, so the hook cannot be sidestepped from Python. Where the
kernel allows unprivileged user namespaces, the child also gets an empty network namespace.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# what the audit hook refuses (event names of the PEP 578 table)
_PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
                   "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg")
_NETWORK_EVENTS = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto")
_NATIVE_EVENTS = ("ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function")
_WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
                 "os.truncate", "shutil.rmtree", "shutil.move", "os.chdir")

# runs in the child before the program: the hook, then the program as __main__
_BOOT = r'''
import os, sys
HOME = os.path.realpath(os.getcwd())
BLOCKED = set(%(blocked)r)
PATHS = set(%(paths)r)

def inside(path):
    try:
        path = os.fsdecode(path) if not isinstance(path, int) else None
    except TypeError:
        return False
    if path is None:
        return True  # a file descriptor the process already holds
    full = os.path.realpath(os.path.join(HOME, path))
    return full == HOME or full.startswith(HOME + os.sep)

def hook(event, args):
    if event in BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = (list(args) + [None, 0])[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
            bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
        if writing and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox's folder is not allowed")
    elif event in PATHS and args and not inside(args[0]):
        raise PermissionError(f"sandbox: {event} on {args[0]!r} outside the sandbox's folder is not allowed")
    elif event in PATHS and event in ("os.rename", "os.link", "os.symlink", "shutil.move") and len(args) > 1 \
            and not inside(args[1]):
        raise PermissionError(f"sandbox: {event} to {args[1]!r} outside the sandbox's folder is not allowed")

sys.addaudithook(hook)
del hook
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    source = f.read()
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclasses.dataclass
class SandboxResult:
    ok: bool  # exited 0 within the limits
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool
    reason: str  # "ok", "timeout", "exit N", "signal NAME" (e.g. SIGXCPU: CPU limit; SIGXFSZ: output limit)
    seconds: float


def _limits(memory_mb: int, cpu_s: int, file_mb: int) -> None:
    """In the child, before exec: its own session, the rlimits, and an empty network namespace where allowed."""
    os.setsid()
    mem = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET; refused without user namespaces
    except (OSError, AttributeError):
        pass


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, cpu_s: int | None = None,
               max_output: int = 10_000, file_mb: int = 16) -> SandboxResult:
    """Run `code` as a Python program in a fresh sandbox (module docstring). stdout and stderr are returned cut to
    `max_output` characters each; a program writing more than `file_mb` MB (output or files) is ended by SIGXFSZ."""
    cpu = cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1)
    folder = tempfile.mkdtemp(prefix="meshrl_sandbox_")
    began = time.perf_counter()
    try:
        with open(os.path.join(folder, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        boot = _BOOT % {"blocked": _PROCESS_EVENTS + _NETWORK_EVENTS + _NATIVE_EVENTS, "paths": _WRITE_EVENTS}
        out_path, err_path = os.path.join(folder, ".stdout"), os.path.join(folder, ".stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", boot], cwd=folder, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, env={"PATH": "/usr/bin:/bin", "HOME": folder},
                                    preexec_fn=lambda: _limits(memory_mb, cpu, file_mb), close_fds=True)
            try:
                code_ = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                code_, timed_out = None, True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: whatever it started, if anything got through
                except ProcessLookupError:
                    pass
                proc.wait()
        stdout, stderr = (_head(p, max_output) for p in (out_path, err_path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if timed_out:
        reason = "timeout"
    elif code_ is not None and code_ < 0:
        reason = f"signal {signal.Signals(-code_).name}"
    else:
        reason = "ok" if code_ == 0 else f"exit {code_}"
    return SandboxResult(code_ == 0 and not timed_out, code_, stdout, stderr, timed_out, reason,
                         time.perf_counter() - began)


def _head(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 4)
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "\n[... output cut]"


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed (stdout, then stderr), or why it stopped.

    Args:
        code: a complete Python program; print what you want to see.
    """
    r = run_python(code)
    text = r.stdout + (("\n" if r.stdout else "") + r.stderr if r.stderr else "")
    return text if r.ok else f"{text.rstrip()}\n[{r.reason}]".strip()

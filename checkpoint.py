"""Checkpoints of a run: trained roles through torch.distributed.checkpoint (DCP), plus the run state.

    <run_dir>/checkpoints/step_00000040/
        actor/   critic/          DCP folders (model + optimizer), written by each role's pool, sharded
        rank_00003.pt             per-rank state: RNG streams, replay buffer, gradient-communication state (stale
                                  all-reduce average, top-k error feedback, parameter-averaging period)
        trainer.pt                rank 0: step, data position, config, and each role's counters from a rank hosting
                                  it (the actor's: update count, LR back-off, skipped steps, KL controller, guard)
        checksums.json            CRC-32 of every file above, checked before a resume reads any of them
    <run_dir>/checkpoints/latest  the name of the newest complete checkpoint (written last)

A checkpoint is written into `step_N.tmp` and renamed when every rank has finished, so a folder without `.tmp`
is complete. DCP reshards on load: a run may resume on a different number of ranks or another layout (the per-rank
RNG streams are then started afresh from the seed, and the log says so). Files are read back with
`torch.load(weights_only=True)`: a checkpoint can't run code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from parallel.distributed import anyone

log = logging.getLogger("meshrl")
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def due(step: int, total: int, save_every: int, save_final: bool, signalled: bool) -> bool:
    """Whether a run saves after `step` (of `total`): on a stop signal, at the end unless save_final is false, and
    every save_every steps before the end (checkpoint.save_every / save_final)."""
    at_end = step == total
    return signalled or (at_end and save_final) or bool(save_every and step % save_every == 0 and not at_end)


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint folders under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    names = sorted((n for n in os.listdir(root) if STEP_DIR.match(n)), reverse=True)
    return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n, "trainer.pt"))]


# frozen parameters (a LoRA role's base) are not saved: the run loads them from the model path again
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def save_role(path: str, model, optimizer, group, async_save: bool = False):
    """One trained role (its trained parameters + optimizer, sharded as they are) into the DCP folder `path`, by
    its pool's gloo group. async_save: the state is staged to CPU memory now and written by a background thread;
    returns its future (None when synchronous)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state = {"model": model_sd, "optim": optim_sd}
    if async_save:
        return dcp.async_save(state, checkpoint_id=path, process_group=group)
    dcp.save(state, checkpoint_id=path, process_group=group)
    return None


def load_role(path: str, model, optimizer, group) -> None:
    """The trained parameters and the optimizer from `path` (dcp.load fails on any of them missing there); the frozen
    ones keep what the model path gave them."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


CHECKSUMS = "checksums.json"


def _crc32(path: str) -> str:
    value = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


def _files(folder: str) -> list[str]:
    """Every file under `folder`, relative, sorted: the same list on every rank of a shared filesystem."""
    out = []
    for base, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(base, n), folder) for n in names]
    return sorted(f for f in out if f != CHECKSUMS)


def _agree(error: str | None) -> str | None:
    """Every rank calls: the first rank's error message, on every rank, or None when no rank failed."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, error)
    return next((e for e in everyone if e), None)


def interrupted(e: BaseException) -> bool:
    """A Ctrl-C, bare or as DCP passes it on (a CheckpointException holding each rank's KeyboardInterrupt): the user
    stopping the run, never a disk or file fault."""
    if isinstance(e, KeyboardInterrupt):
        return True
    failures = e.failures if isinstance(e, CheckpointException) else {}
    return any(isinstance(failure[0], KeyboardInterrupt) for failure in failures.values())


def _describe(e: BaseException) -> str:
    """An exception as one short line for a message every rank shares."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def write_checksums(folder: str) -> None:
    """Every rank calls: the CRC-32 of every file of the finished checkpoint, the files dealt round-robin over the
    ranks (each reads ~1/world of the bytes), into `checksums.json` (rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = _files(folder)
    mine = {f: _crc32(os.path.join(folder, f)) for f in files[rank::world]}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        sums = {k: v for part in everyone for k, v in part.items()}
        with open(os.path.join(folder, CHECKSUMS), "w") as f:
            json.dump(sums, f, indent=0, sort_keys=True)


def verify_checksums(folder: str) -> None:
    """Every rank calls: raises RuntimeError on every rank when a file of the checkpoint is missing or does not
    match the CRC-32 written at save time (corruption that keeps a file's size loads silently otherwise). Each rank
    checks a round-robin share. A checkpoint without checksums (written before 2026-12-01) passes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = None
    listing = os.path.join(folder, CHECKSUMS)
    if os.path.isfile(listing):
        try:
            with open(listing) as f:
                sums = json.load(f)
            for name in sorted(sums)[rank::world]:
                path = os.path.join(folder, name)
                if not os.path.isfile(path):
                    problem = f"{name} is missing"
                elif _crc32(path) != sums[name]:
                    problem = f"{name} does not match its checksum (damaged after it was written)"
                if problem:
                    break
        except (OSError, ValueError) as e:
            problem = f"{CHECKSUMS} is unreadable: {e}"
    problem = _agree(problem)
    if problem:
        raise RuntimeError(problem)


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a write error on some rank). Raised on every rank after the
    partial files were removed; the checkpoints before it are untouched."""


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in _files(folder)) if os.path.isdir(folder) else 0


def _tensor_bytes(roles: dict) -> int:
    """This rank's bytes of the tensors save_role writes: the trained parameters and the optimizer's state (a
    DTensor counts its local part)."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = 0
    with torch.no_grad():  # to_local() of a trained parameter would record an autograd node
        for model, optimizer, _ in roles.values():
            total += sum(nbytes(p) for p in model.parameters() if p.requires_grad)
            total += sum(nbytes(v) for state in optimizer.state.values() for v in state.values()
                         if torch.is_tensor(v))
    return total


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _failed(root: str, tmp: str, error: str, tensor_bytes: int) -> SaveError:
    """Remove a failed save's partial folder (rank 0) and say what a save needs and what is free (every rank calls:
    tensor_bytes is this rank's _tensor_bytes, the need when no checkpoint was written before)."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tensor_bytes)
    done = complete_checkpoints(root)
    # replicated tensors are written once but counted on each rank holding them: the sum is an upper bound
    need = f"~{_size(_folder_bytes(done[0]))} (the last checkpoint)" if done else \
        f"up to ~{_size(sum(everyone))} (this save's tensors over every rank; no earlier checkpoint)"
    free = shutil.disk_usage(root).free / 2**30 if os.path.isdir(root) else float("nan")
    last = os.path.basename(done[0]) if done else "none"
    return SaveError(f"checkpoint {os.path.basename(tmp)[:-4]} could not be written ({error}); its partial files "
                     f"were removed. A checkpoint here takes {need}; {free:.2f} GiB are free on {root}. The last "
                     f"good checkpoint: {last}")


def remove_partial(root: str) -> list[str]:
    """Rank 0, with the run folder's lock held: remove `step_N.tmp` folders a dead or failed save left behind (they
    are never resumed, and may be what fills the disk). Returns their names."""
    if not os.path.isdir(root):
        return []
    partial = [n for n in os.listdir(root) if n.endswith(".tmp") and STEP_DIR.match(n[:-4])]
    for name in partial:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return partial


class PendingSave:
    """A checkpoint whose files may still be being written; `finish` (every rank) waits, then makes it complete."""

    def __init__(self, root: str, tmp: str, final: str, futures: list, keep_last: int, tensor_bytes: int):
        self.root, self.tmp, self.final, self.futures, self.keep_last = root, tmp, final, futures, keep_last
        self.tensor_bytes = tensor_bytes
        self.done = False

    def finish(self) -> str:
        if self.done:
            return self.final
        self.done = True
        error = None
        try:
            for future in self.futures:
                future.result()
        except (Exception, CheckpointException) as e:  # a background write failed (disk full): every rank learns it
            if interrupted(e):
                raise KeyboardInterrupt from e
            error = _describe(e)
        error = _agree(error)
        if error is None:
            try:
                write_checksums(self.tmp)
            except OSError as e:
                error = _describe(e)
            error = _agree(error)
        if error is not None:
            raise _failed(self.root, self.tmp, error, self.tensor_bytes)
        if dist.get_rank() == 0:
            shutil.rmtree(self.final, ignore_errors=True)
            os.replace(self.tmp, self.final)
            _write_latest(self.root, os.path.basename(self.final))
            for old in complete_checkpoints(self.root)[max(self.keep_last, 1) :]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return self.final


def save(root: str, step: int, roles: dict, rank_state: dict, trainer_state: dict, keep_last: int,
         async_save: bool = False) -> PendingSave:
    """Write checkpoint `step` (every rank calls). roles: {name: (model, optimizer, pool io group)} hosted by this
    rank. Synchronous saves come back finished; with async_save the caller calls `finish()` later (before the next
    save and before exiting), and training may go on meanwhile."""
    rank = dist.get_rank()
    final = step_dir(root, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    futures, error = [], None
    tensor_bytes = _tensor_bytes(roles)
    try:
        futures = [save_role(os.path.join(tmp, name), model, optimizer, group, async_save)
                   for name, (model, optimizer, group) in roles.items()]
        torch.save(rank_state, os.path.join(tmp, f"rank_{rank:05d}.pt"))
        if rank == 0:
            torch.save(trainer_state, os.path.join(tmp, "trainer.pt"))
    except (Exception, CheckpointException) as e:  # a full disk, a failed write on this rank
        if interrupted(e):  # Ctrl-C while writing: the partial folder goes at the next start
            raise KeyboardInterrupt from e
        error = _describe(e)
    error = _agree(error)
    if error is not None:
        for future in futures:  # let a background write that did start end before its folder goes
            if future is not None:
                try:
                    future.result()
                except Exception:
                    pass
        raise _failed(root, tmp, error, tensor_bytes)
    pending = PendingSave(root, tmp, final, [f for f in futures if f is not None], keep_last, tensor_bytes)
    if not async_save:
        pending.finish()
    return pending


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
    os.replace(tmp, os.path.join(root, "latest"))


def candidates(root: str, resume: str) -> list[str]:
    """Checkpoints to try, in order, for `checkpoint.resume` (auto / never / a folder). Same list on every rank."""
    if resume == "never":
        return []
    if resume != "auto":
        if not os.path.isfile(os.path.join(resume, "trainer.pt")):
            raise ValueError(f"checkpoint.resume={resume!r}: not a complete checkpoint (no trainer.pt there)")
        return [resume]
    found = [None]
    if dist.get_rank() == 0:
        found[0] = complete_checkpoints(root)
    dist.broadcast_object_list(found, src=0)
    return found[0]


def load(path: str, roles: dict) -> tuple[dict, dict | None]:
    """Load the roles (resharding as needed) and return (trainer_state, this rank's state or None when the
    checkpoint was written by a different number of ranks). Raises if any rank fails to read its part."""
    rank, world = dist.get_rank(), dist.get_world_size()
    verify_checksums(path)  # before any collective of the load: every rank agrees to skip a damaged checkpoint
    error = None
    trainer_state = rank_state = None
    try:
        for name, (model, optimizer, group) in roles.items():
            load_role(os.path.join(path, name), model, optimizer, group)
        trainer_state = torch.load(os.path.join(path, "trainer.pt"), weights_only=True)
        if trainer_state["world_size"] == world:
            rank_state = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), weights_only=True)
    except (Exception, CheckpointException) as e:  # a corrupt or truncated file: all ranks must move on together
        if interrupted(e):  # Ctrl-C while reading: not a reason to skip this checkpoint
            raise KeyboardInterrupt from e
        error = f"{type(e).__name__}: {e}"
    if anyone(error is not None):
        raise RuntimeError(error or "another rank could not read its part")
    return trainer_state, rank_state


def rng_state(generators: dict[str, torch.Generator]) -> dict:
    state = {"torch": torch.get_rng_state(), **{k: g.get_state() for k, g in generators.items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for k, g in generators.items():
        g.set_state(state[k])


def gather_role_state(local: dict[str, dict]) -> dict[str, dict]:
    """{role: state} from the ranks hosting each role (every rank calls): the trainer-wide file is written by rank 0,
    which need not host the actor."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return {k: v for part in everyone for k, v in part.items()}


class ResumeError(ValueError):
    """Checkpoints are there but none can be resumed: starting over would overwrite them, so the run stops."""


def resume(root: str, resume_mode: str, roles: dict) -> tuple[str, dict, dict | None] | None:
    """The newest readable checkpoint for `checkpoint.resume` (auto / never / a folder), loaded into `roles`:
    (its path, trainer state, this rank's state or None), or None for a fresh start (no checkpoint there, or
    resume=never in a folder that holds none). A corrupt checkpoint is skipped with a warning naming it. ResumeError
    when checkpoints exist and none could be read (a changed model, every file damaged) or resume=never finds some:
    a fresh start would rotate away or overwrite checkpoints this run did not write."""
    if resume_mode == "never":
        existing = candidates(root, "auto")
        if existing:
            raise ResumeError(f"checkpoint.resume=never but {root} holds {len(existing)} checkpoint(s) of an earlier "
                              "run, which this run's saves would overwrite or rotate away; pick another run.name "
                              "(or run.output_dir) to start over")
        return None
    reasons = []
    for path in candidates(root, resume_mode):
        try:
            state, mine = load(path, roles)
        except RuntimeError as e:
            reasons.append(f"{os.path.basename(path)}: {str(e).splitlines()[0]:.300}")
            if dist.get_rank() == 0:
                log.warning("checkpoint %s could not be read (%s); trying the one before", path, e)
            continue
        return path, state, mine
    if reasons:
        raise ResumeError(f"{root} holds checkpoints but none could be resumed ({'; '.join(reasons)}). Nothing was "
                          "changed. If the model or the layout changed on purpose, start over under another run.name "
                          "(checkpoint.resume=never in a fresh folder)")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Stop signals: the entry points (train_ppo.py, train_sft.py) install these, and save and exit at the end of a step
STOP_SIGNAL = {"received": False}


def on_stop_signal(signum, frame) -> None:
    """SIGTERM / SIGUSR1 (SLURM preemption): finish the current step, save, exit 0."""
    STOP_SIGNAL["received"] = True


def on_interrupt(signum, frame) -> None:
    """Ctrl-C (SIGINT): the first one stops as SIGTERM does (finish the step, save, exit 0); a second one stops at
    once, without saving (KeyboardInterrupt, exit 130). One within a second of the first is the same Ctrl-C passed on
    by torchrun's agent (the terminal's reaches the agent and its workers alike)."""
    now = time.monotonic()
    if STOP_SIGNAL["received"]:
        if now - STOP_SIGNAL.get("interrupted_at", float("-inf")) < 1.0:
            return
        raise KeyboardInterrupt
    STOP_SIGNAL["received"], STOP_SIGNAL["interrupted_at"] = True, now
    if os.environ.get("RANK", "0") == "0":  # a terminal's Ctrl-C reaches every rank of the job
        os.write(2, b"\nCtrl-C: finishing this step, then saving a checkpoint and exiting; "
                    b"Ctrl-C again to stop at once without saving\n")

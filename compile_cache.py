"""Compiled code kept across runs and machines (run.compile_cache).

On a GPU the first steps of a process compile the native engine's decode step and the trainers' blocks with
torch.compile (~15-20 s of a cold first step at 0.5B on an H200); Inductor keeps what it built in its own caches under
/tmp, which a cluster job on another node, or a fresh machine, does not have. Here each rank saves the artifacts of its
compiles (Inductor's FX graphs, AOTAutograd's, the Triton kernels: torch.compiler.save_cache_artifacts) to one file
in the run.compile_cache folder after its first steps, and a later run loads its rank's file before compiling
(load_cache_artifacts): the compiles become cache hits (Dynamo still traces). The file's name holds what the
artifacts depend on: the torch version, the GPU, the world size and the rank. A file that cannot be read or loaded
is reported and ignored (the run compiles as without it), never fatal; a save that fails is reported, and training
goes on. Nothing is saved where nothing was compiled (the CPU: torch.compile is used on GPUs only).

The artifacts leave out the Triton kernels of our own (the engine's attention and sampling kernels, the update's
log-prob kernels), which Triton compiles on first use into its own cache: use_triton_cache points that cache into
the same folder (Inductor's and an embedded vLLM's Triton kernels land there too), so that a fresh machine finds
those compiled as well. Triton notes a kernel's files by absolute path; the cache set here looks them up in its own
folder instead, so a run folder copied elsewhere, or mounted at another path, still finds them.
"""

from __future__ import annotations

import json
import os
import re
import time

import torch

SAVE_AFTER_STEP = 3  # the first steps compile (the update's recompile for new lengths is in step 2); saved after


def cache_file(folder: str, rank: int, world_size: int, device: torch.device) -> str:
    """The rank's artifact file in `folder`, named after what its artifacts depend on."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = f"torch{torch.__version__}-{gpu}-w{world_size}-r{rank}"
    return os.path.join(folder, re.sub(r"[^A-Za-z0-9_.+-]", "_", name) + ".bin")


def _keys(info) -> set[str]:
    return {f"{kind}:{key}" for kind, keys in info.artifacts.items() for key in keys}


def use_triton_cache(folder: str) -> str:
    """Triton's kernel cache in `folder`/triton (TRITON_CACHE_DIR, which Triton and Inductor's workers read), unless
    the environment sets TRITON_CACHE_DIR to a folder already; returns what happened, for the log. Call before
    anything compiles. Triton writes each kernel to a temporary file and renames it, so ranks (and nodes) can share
    the folder. This process's Triton then reads kernel groups from the folder itself (_FolderCache)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return f"compile cache: Triton kernels cached in TRITON_CACHE_DIR={os.environ['TRITON_CACHE_DIR']} (as set)"
    path = os.path.abspath(os.path.join(folder, "triton"))
    os.environ["TRITON_CACHE_DIR"] = path
    try:
        import triton

        if triton.knobs.cache.manager_class is None:  # none named by TRITON_CACHE_MANAGER
            triton.knobs.cache.manager_class = _folder_cache()  # this process only: Inductor's workers keep Triton's
    except (ImportError, AttributeError):  # no Triton, or one without knobs: its own cache, absolute paths
        pass
    return f"compile cache: Triton kernels cached in {path}"


def _folder_cache():
    """Triton's file cache, except that a kernel's group (its files: the binary, its metadata) is looked up in the
    cache's own folder, not at the absolute paths its group file recorded when it was written."""
    from triton.runtime.cache import FileCacheManager

    class _FolderCache(FileCacheManager):
        def get_group(self, filename: str) -> dict[str, str] | None:
            found = super().get_group(filename)  # Triton's own lookup: right where the folder has not moved
            if found is not None:
                return found
            path = self.get_file(f"__grp__{filename}")
            if path is None:
                return None
            try:
                with open(path) as f:
                    children = dict(json.load(f)["child_paths"])
            except (OSError, ValueError, KeyError, TypeError):  # a torn group file: compile again, as Triton does
                return None
            found = {}
            for name, child in children.items():
                here = self._make_path(os.path.basename(str(child)))  # the group's files sit beside it
                if not os.path.exists(here):
                    return None
                found[name] = here
            return found

    return _FolderCache


def load(path: str) -> str:
    """Load the artifacts of `path` into this process's compile caches; returns what happened, for the log."""
    if not os.path.exists(path):
        return f"compile cache: none yet at {path} (this run's compiles are saved there after step {SAVE_AFTER_STEP})"
    began = time.perf_counter()
    try:
        with open(path, "rb") as f:
            info = torch.compiler.load_cache_artifacts(f.read())
    except Exception as e:  # a torn or foreign file: compile as without it
        return f"compile cache: {path} could not be loaded ({type(e).__name__}: {e}); compiling without it"
    count = len(_keys(info)) if info is not None else 0
    if not count:  # torch reads a torn file (or another version's) as holding nothing
        return (f"compile cache: {path} could not be loaded (no artifacts this torch can read: a torn file, or "
                "another torch's); compiling without it")
    return f"compile cache: loaded {count} artifacts from {path} in {time.perf_counter() - began:.1f} s"


def save(path: str) -> str | None:
    """Save what this process compiled (and the loaded artifacts it used) to `path`, unless nothing was compiled or
    the file already holds every artifact; returns what happened, for the log (None: nothing to say)."""
    began = time.perf_counter()
    got = torch.compiler.save_cache_artifacts()
    if got is None:
        return None
    data, info = got
    keys = _keys(info)
    if not keys:
        return None
    index = path + ".json"  # the artifact keys the file holds
    try:
        with open(index) as f:
            held = set(json.load(f))
    except (OSError, ValueError):
        held = set()
    if keys <= held and os.path.exists(path):
        return None
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        for target, payload, mode in ((path, data, "wb"), (index, json.dumps(sorted(keys)), "w")):
            partial = f"{target}.{os.getpid()}.tmp"
            with open(partial, mode) as f:
                f.write(payload)
            os.replace(partial, target)  # a reader never sees half a file
    except OSError as e:
        return f"compile cache: could not save {path} ({e}); training goes on"
    return (f"compile cache: saved {len(keys)} artifacts ({len(data) / 2**20:.1f} MiB) to {path} in "
            f"{time.perf_counter() - began:.1f} s")

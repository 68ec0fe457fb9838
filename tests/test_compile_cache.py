"""run.compile_cache (compile_cache.py): what one process compiled, saved to a file, turns another process's compile
(with empty Inductor caches: a fresh machine) into cache hits; a torn file is reported and compiled around; a save
that adds nothing is skipped. Real torch.compile (Inductor on the CPU) in real subprocesses."""

from __future__ import annotations

import json
import textwrap

import torch

import compile_cache
from compile_cache import cache_file
from conftest import ROOT, explain, run_python

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    import compile_cache

    path = sys.argv[1]
    said = [compile_cache.load(path)]
    f = torch.compile(lambda x: (x * 2).sin() + x.cos())
    f(torch.randn(16))
    said.append(compile_cache.save(path))
    print(json.dumps({"said": said, "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
''')


def run(tmp_path, name: str, path) -> dict:
    script = tmp_path / "compile_once.py"
    script.write_text(SCRIPT)
    proc = run_python([str(script), str(path)], timeout=300, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / name),
                      TRITON_CACHE_DIR=str(tmp_path / f"{name}_triton"))
    assert proc.returncode == 0, explain(proc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_saved_compile_is_a_cache_hit_in_a_fresh_process(tmp_path):
    path = tmp_path / "cache" / "rank0.bin"
    first = run(tmp_path, "machine_a", path)
    assert "none yet" in first["said"][0] and first["misses"] == 1 and first["hits"] == 0
    assert first["said"][1].startswith("compile cache: saved") and path.exists()
    # another machine: empty Inductor caches, the file loaded first
    second = run(tmp_path, "machine_b", path)
    assert "loaded 2 artifacts" in second["said"][0], second  # Inductor's graph and AOTAutograd's
    assert second["hits"] == 1 and second["misses"] == 0, second
    assert second["said"][1] is None, "nothing new to save"
    assert json.loads((tmp_path / "cache" / "rank0.bin.json").read_text())
    # a torn file: reported, nothing raised (the run compiles as without it)
    path.write_bytes(path.read_bytes()[:50])
    assert "could not be loaded" in compile_cache.load(str(path))


def test_the_file_name_holds_what_the_artifacts_depend_on(tmp_path):
    name = cache_file(str(tmp_path), rank=3, world_size=8, device=torch.device("cpu"))
    assert name.startswith(str(tmp_path)) and name.endswith("-cpu-w8-r3.bin")
    assert f"torch{torch.__version__}" in name


TRITON_SCRIPT = textwrap.dedent('''
    import json, os, sys
    import triton  # imported before the call, as in train_ppo.py
    from triton.runtime.cache import FileCacheManager, get_cache_manager
    import compile_cache

    mode, folder = sys.argv[1], sys.argv[2]
    KEY = "ab" * 32  # a kernel hash, hex
    if mode != "as-set":
        os.environ.pop("TRITON_CACHE_DIR", None)
    said = compile_cache.use_triton_cache(folder)
    out = {"said": said, "dir": triton.knobs.cache.dir}
    if mode == "write":  # what Triton's compiler does for a kernel: its files, then the group naming them
        cache = get_cache_manager(KEY)
        files = {name: cache.put(b"compiled", name) for name in ("k.cubin", "k.json")}
        cache.put_group("k.json", files)
    if mode == "read":
        cache = get_cache_manager(KEY)
        out["group"] = cache.get_group("k.json")
        out["plain"] = FileCacheManager.get_group(cache, "k.json")  # Triton's own lookup: the recorded absolute paths
    print(json.dumps(out))
''')


def test_triton_kernels_are_cached_in_the_folder_and_found_where_it_is_moved(tmp_path):
    """Our own Triton kernels are not among torch.compile's artifacts: Triton's cache goes into the folder (a
    relative folder made absolute), so a fresh machine finds them compiled, also where the folder is copied or
    mounted at another path; a TRITON_CACHE_DIR the user set is kept."""
    import shutil

    script = tmp_path / "triton_dir.py"
    script.write_text(TRITON_SCRIPT)

    def run(mode, folder, **env):
        proc = run_python([str(script), mode, str(folder)], timeout=120, **env)
        assert proc.returncode == 0, explain(proc)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run("write", tmp_path / "a" / "cache")
    assert first["dir"] == str(tmp_path / "a" / "cache" / "triton"), first
    shutil.move(tmp_path / "a", tmp_path / "b")  # the run folder, elsewhere
    moved = run("read", tmp_path / "b" / "cache")
    kernel = tmp_path / "b" / "cache" / "triton"
    assert moved["group"] and all(p.startswith(str(kernel)) for p in moved["group"].values()), moved
    assert moved["plain"] is None, "Triton alone misses a moved folder's kernels (what the lookup is for)"
    assert run("check", "rel/cache")["dir"] == str(ROOT / "rel" / "cache" / "triton")  # from the launch folder
    mine = run("as-set", tmp_path / "cache", TRITON_CACHE_DIR=str(tmp_path / "mine"))
    assert mine["dir"] == str(tmp_path / "mine") and "(as set)" in mine["said"], mine

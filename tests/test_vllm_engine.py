"""The vLLM engine's config checks, which run without vLLM (its routing between layouts and weight stream are
rollout/world.py's, tested in tests/test_world_rollout.py); the engine itself is verified on a GPU by
bench/vllm_check.py (bench/RESULTS.md), and its tests here skip without vLLM."""

from __future__ import annotations

import importlib.util

import pytest

import config as C
from conftest import explain, run_python

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def check(overrides: list[str], world: int = 1):
    cfg = C.load_config(None, ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]",
                               "rollout.engine=vllm", *overrides])
    C.check_ppo(cfg, world)


@pytest.mark.parametrize("overrides, world, needle", [
    (["rollout.vllm_tp=3"], 4, "rollout.vllm_tp=3: must divide the world size 4 (contiguous ranks form one vLLM "
                               "engine); valid: [1, 2, 4]"),
    (["placement.mode=split", "rollout.ranks=actor",
      "placement.pools=[{name: a, size: 1, roles: [actor, reference]}, {name: b, size: 1, roles: [critic, reward]}]"],
     2, "rollout.ranks=actor with rollout.engine=vllm and placement.mode=split: vLLM's external launcher makes every "
        "rank of the world an engine worker"),
    (["run.device=cpu"], 1, "rollout.engine=vllm runs on GPUs"),
])
def test_vllm_config_mistakes(overrides, world, needle):
    with pytest.raises(C.ConfigError) as err:
        check(overrides, world)
    assert needle in str(err.value)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_exits_2_naming_the_extra(tmp_path):
    proc = run_python(["train_ppo.py", "--config", "configs/quickstart.yaml", "rollout.engine=vllm",
                       "run.device=auto", f"run.output_dir={tmp_path}"], timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "vLLM is not installed" in proc.stderr and "requirements-vllm.txt" in proc.stderr, explain(proc)

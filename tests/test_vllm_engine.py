"""The vLLM engine's parts that run without vLLM (routing between layouts, config checks); the engine itself is
verified on a GPU by bench/vllm_check.py (bench/RESULTS.md), and its tests here skip without vLLM."""

from __future__ import annotations

import importlib.util
import re

import pytest

import config as C
from conftest import explain, run_python, torchrun
from rollout.vllm import engine_groups

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_routing_between_the_actor_layout_and_the_engines():
    proc = torchrun(["tests/dist/vllm_routing.py"], nproc=4, timeout=120)
    assert proc.returncode == 0, explain(proc)
    for check in ("dp owners", "tp peers once"):
        passed = set(re.findall(rf"rank (\d) PASS {check}", proc.stdout))
        assert passed == {"0", "1", "2", "3"}, f"{check}: {sorted(passed)}\n{explain(proc)}"


def test_engine_groups_are_contiguous_and_must_divide_the_world():
    assert engine_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert engine_groups(3, 1) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="rollout.vllm_tp=3 must divide the world size 4"):
        engine_groups(4, 3)


def check(overrides: list[str], world: int = 1):
    cfg = C.load_config(None, ["quickstart.enabled=true", "reward.functions=[{spec: exact_match}]",
                               "rollout.engine=vllm", *overrides])
    C.check_ppo(cfg, world)


@pytest.mark.parametrize("overrides, world, needle", [
    (["rollout.vllm_tp=3"], 4, "rollout.vllm_tp=3: must divide the world size 4 (contiguous ranks form one vLLM "
                               "engine); valid: [1, 2, 4]"),
    (["placement.mode=split", "placement.pools=[{name: a, size: 1, roles: [actor, critic, reference, reward]}]"], 1,
     "rollout.engine=vllm with placement.mode=split is not built yet"),
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

"""--help lists the schema (every key, its type, default and source comment); --print-config prints the checked
config as YAML and exits before any work (checked on real entry-point processes)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import pytest
import yaml

import config as C
from conftest import explain, run_python, torchrun


def leaf_keys(cls, prefix=""):
    """Every settable key of the schema, a list of dataclasses giving `key[].field`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            yield from leaf_keys(tp, f"{prefix}{f.name}.")
        elif dataclasses.is_dataclass(item):
            yield from leaf_keys(item, f"{prefix}{f.name}[].")
        else:
            yield prefix + f.name


def source_field(cls, name):
    """(type, default, comment) of `name: type = default  # comment` as written in config/schema.py."""
    m = re.search(rf"^\s+{name}: (\S+) = (\S+)\s+#\s*(.+)$", inspect.getsource(cls), re.M)
    assert m, f"{cls.__name__}.{name} has no trailing comment in config/schema.py"
    return m.groups()


@pytest.mark.parametrize("script", ["train_ppo.py", "train_sft.py", "train_rm.py"])
def test_help_lists_every_key_with_type_default_and_comment(script):
    proc = run_python([script, "--help"])
    assert proc.returncode == 0, explain(proc)
    lines = proc.stdout.splitlines()
    first_words = {line.split()[0] for line in lines if line.strip()}
    keys = list(leaf_keys(C.Config))
    assert "actor.optim.lr" in keys and "placement.pools[].size" in keys
    missing = [k for k in keys if k not in first_words]
    assert not missing, f"keys not listed by --help: {missing}\n{proc.stdout}"
    assert "base:" in proc.stdout and "KEY=VALUE" in proc.stdout
    assert ("--plan [--world N]" in proc.stdout) == (script == "train_ppo.py"), "the planner is train_ppo.py's"
    for cls, key in ((C.RolloutConfig, "rollout.n"), (C.PoolConfig, "placement.pools[].size")):
        tp, default, comment = source_field(cls, key.rsplit(".", 1)[1])
        line = next(line for line in lines if line.split()[:1] == [key])
        assert line.split()[1:3] == [tp, default], line
        assert line.rstrip().endswith(comment), line
    assert max(map(len, C.describe_schema().splitlines())) <= 120


def test_print_config_prints_yaml_and_starts_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_python(["train_ppo.py", "--config", "configs/quickstart.yaml", "actor.optim.lr=0.5",
                       f"run.output_dir={out}", "--print-config"])
    assert proc.returncode == 0, explain(proc)
    printed = yaml.safe_load(proc.stdout)
    assert printed["actor"]["optim"]["lr"] == 0.5
    assert printed["run"]["name"] == "quickstart" and printed["rollout"]["n"] == 4  # from the file
    assert printed == C.to_dict(C.load_config("configs/quickstart.yaml", ["actor.optim.lr=0.5",
                                                                          f"run.output_dir={out}"]))
    assert not out.exists()


def test_print_config_once_over_ranks(tmp_path):
    out = tmp_path / "out"
    proc = torchrun(["train_ppo.py", "--config", "configs/quickstart.yaml", f"run.output_dir={out}",
                     "--print-config"], nproc=2)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("actor:\n") == 1, explain(proc)
    assert not out.exists()


def test_print_config_with_a_bad_key_exits_2(tmp_path):
    proc = run_python(["train_ppo.py", "--config", "configs/quickstart.yaml", "actor.optim.lrr=0.5",
                       f"run.output_dir={tmp_path / 'out'}", "--print-config"])
    assert proc.returncode == 2, explain(proc)
    assert "config error: unknown key 'actor.optim.lrr'" in proc.stderr, explain(proc)
    assert "actor:" not in proc.stdout

"""Hugging Face hub ids where a path is expected, as TRL and verl users give them.

A model: `model.path=Org/Name` (transformers' from_pretrained resolves it: the hub cache, then the hub). A dataset:
`data.train_path=org/name`, optionally `org/name/subset` (a config of the repo, e.g. openai/gsm8k/main) and `:split`
(default: train; an eval key names its split, e.g. org/name:test): the repo's data files through huggingface_hub's
snapshot_download, read by datasets from that folder (the repo's README configs and split names as datasets reads
them). With HF_HUB_OFFLINE=1 only the local hub cache (HF_HUB_CACHE, HF_HOME/hub) is looked in, as everywhere else.
A local path that exists always wins over a hub id of the same spelling.
"""

from __future__ import annotations

import os
import re

# Org/Name[/subset][:split]: letters, digits, '-', '_', '.'; no leading '.', '/' or '~' (those are local paths)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:/(?P<subset>[\w.-]+))?(?::(?P<split>[\w.-]+))?")
DATA_FILES = ["*.parquet", "*.jsonl", "*.json", "*.csv", "*.arrow", "README.md"]


def parse_dataset_id(value: str) -> tuple[str, str | None, str | None] | None:
    """(repo, subset, split) of a dataset hub id that is not a local path, else None."""
    m = HUB_ID.fullmatch(value)
    if m is None or os.path.exists(value) or value.endswith((".jsonl", ".parquet", ".json")):
        return None
    return m["repo"], m["subset"], m["split"]


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _not_here(kind: str, repo: str, reason: str) -> str:
    return f"not a local path; tried as a Hugging Face hub {kind} id {repo!r}: {reason}"


def model_problem(value: str) -> str | None:
    """None when `value`, not a local path, names a model repo from_pretrained can load (in the hub cache, or on the
    hub when online); else why not, saying whether it was tried as a hub id and that offline mode was on ("not
    found" for a path that is no hub id)."""
    if not HUB_ID.fullmatch(value) or value.count("/") != 1 or ":" in value:
        return "not found"
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(value, "config.json"), str):
        return None
    if offline():
        return _not_here("model", value, f"not in the hub cache {_cache()}, and HF_HUB_OFFLINE=1 is set, so nothing "
                         "is downloaded (download it once online, or unset HF_HUB_OFFLINE)")
    try:
        from huggingface_hub import file_exists

        if file_exists(value, "config.json"):
            return None
        return _not_here("model", value, "the hub has no config.json there (no such model, or not a transformers "
                         "model)")
    except Exception as e:  # no network, a gated or private repo without a token
        return _not_here("model", value, f"not in the hub cache {_cache()}, and the hub said: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def dataset_problem(value: str, eval_key: bool = False) -> str | None:
    """None when `value`, not a local path, names a dataset repo snapshot_download can give (in the hub cache, or on
    the hub when online); else why not ("not found" for a path that is no hub id). An eval key's id must name its
    split (org/name:test)."""
    parsed = parse_dataset_id(value)
    if parsed is None:
        return "not found"
    repo, _, split = parsed
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo, repo_type="dataset", local_files_only=True)
        found = True
    except Exception:  # not in the cache
        found = False
    if not found and offline():
        return _not_here("dataset", repo, f"not in the hub cache {_cache()}, and HF_HUB_OFFLINE=1 is set, so "
                         "nothing is downloaded (download it once online, or unset HF_HUB_OFFLINE)")
    if not found:
        try:
            from huggingface_hub import repo_exists

            if not repo_exists(repo, repo_type="dataset"):
                return _not_here("dataset", repo, "the hub has no such dataset")
        except Exception as e:
            return _not_here("dataset", repo, f"not in the hub cache {_cache()}, and the hub said: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if eval_key and split is None:
        return (f"a hub dataset id for evaluation names its split, e.g. {value}:test (without one it would be the "
                "train split)")
    return None


def dataset_rows(value: str) -> list[tuple[str, dict]]:
    """Every row of the hub dataset `value` (org/name[/subset][:split], split train by default) as (where, row);
    ValueError naming the id when it cannot be had or read."""
    parsed = parse_dataset_id(value)
    assert parsed is not None, value
    repo, subset, split = parsed
    split = split or "train"
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo, repo_type="dataset", allow_patterns=DATA_FILES)
    except Exception as e:
        reason = dataset_problem(value) or f"{type(e).__name__}: {e}"
        raise ValueError(f"{value}: {reason}") from e
    import datasets

    datasets.disable_progress_bars()  # the console is the trainer's
    try:
        dataset = datasets.load_dataset(folder, name=subset, split=split)
    except (ValueError, FileNotFoundError) as e:  # an unknown split or subset: datasets names the ones there are
        raise ValueError(f"{value}: the hub dataset {repo!r} (from {folder}) has no {split!r} split"
                         f"{f' in subset {subset!r}' if subset else ''} that datasets can read: "
                         f"{str(e).splitlines()[0]}") from e
    return [(f"{value} row {i}", row) for i, row in enumerate(dataset.to_list())]

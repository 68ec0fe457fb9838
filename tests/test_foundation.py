"""Layouts, FSDP2 / TP / 2-D / HSDP equivalence with the unsharded model (packed micro-batches under TP and 2-D too,
and under FSDP2 on 2 ranks with compiled blocks), and batch transfer, on 4 gloo processes."""

from __future__ import annotations

import re

import torch

from batch import pad_cat, split_batch
from conftest import explain, torchrun
from parallel.transfer import balanced_bounds


def test_foundation_under_torchrun():
    proc = torchrun(["tests/dist/foundation.py"], nproc=4)
    assert proc.returncode == 0, explain(proc)
    for check in ("layouts", "fsdp4", "tp2+fsdp2", "2d", "hsdp", "packed tp2", "packed 2d", "packed fsdp2 compiled",
                  "transfer"):
        # ranks print concurrently, so lines may interleave: find the marks anywhere
        passed = set(re.findall(rf"rank (\d) PASS {re.escape(check)}(?= |\n|rank |$)", proc.stdout))
        expected = {"0", "1"} if "compiled" in check else {"0", "1", "2", "3"}
        assert passed == expected, f"{check}: ranks {sorted(passed)} passed\n{explain(proc)}"


def test_balanced_bounds():
    for n in range(0, 20):
        for parts in range(1, 6):
            b = balanced_bounds(n, parts)
            sizes = [b[i + 1] - b[i] for i in range(parts)]
            assert b[0] == 0 and b[-1] == n and max(sizes) - min(sizes) <= 1


def test_pad_cat_and_split_keep_values():
    a = torch.arange(6).view(2, 3)
    b = torch.arange(10, 18).view(2, 4)
    joined = pad_cat([a, b])
    assert joined.shape == (4, 4)
    assert torch.equal(joined[:2, :3], a) and not joined[:2, 3].any() and torch.equal(joined[2:], b)
    parts = split_batch({"x": joined, "y": torch.arange(4)}, [1, 3])
    assert torch.equal(parts[1]["y"], torch.tensor([1, 2, 3])) and parts[0]["x"].shape == (1, 4)


def test_fit_width_cuts_or_pads_the_response_axis():
    """Tensors sent back from another pool are as wide as the widest batch it received (seen on the quickstart's
    split layout: values [64, 5] came back to an actor rank whose responses were [64, 4])."""
    from batch import fit_width

    t = torch.arange(12.0).view(2, 6)
    assert torch.equal(fit_width(t, 4), t[:, :4])
    padded = fit_width(t[:, :2], 5)
    assert padded.shape == (2, 5) and torch.equal(padded[:, :2], t[:, :2]) and not padded[:, 2:].any()

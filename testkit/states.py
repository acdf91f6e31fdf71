"""Whole training states read back from checkpoints, and exact comparison of two of them."""

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def checkpoint_state(step_dir: Path, scratch: Path) -> dict:
    """Everything a committed checkpoint holds: model, optimizer, RNG, progress, loader."""
    out = scratch / f"state-{abs(hash(str(step_dir.resolve())))}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def differences(a, b, path="state") -> list[str]:
    """The paths at which two states differ: keys, values, tensors (with the largest gap)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        if torch.equal(a, b):
            return []
        gap = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "-"
        return [f"{path}: {int((a != b).sum())} of {a.numel()} differ, max gap {gap}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def assert_same_state(a, b) -> None:
    """Bitwise the same; else every difference is named (which parts diverged says where to look)."""
    found = differences(a, b)
    assert not found, f"{len(found)} differences:\n" + "\n".join(found[:40])

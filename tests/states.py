"""Whole training states read back from checkpoints, and exact comparison of two of them."""

from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def checkpoint_state(step_dir: Path, scratch: Path) -> dict:
    """Everything a committed checkpoint holds: model, optimizer, RNG, progress, loader."""
    out = scratch / f"state-{abs(hash(str(step_dir.resolve())))}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def assert_same_state(a, b, path="state") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path

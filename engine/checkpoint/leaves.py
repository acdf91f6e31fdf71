"""A training state as the memory tier lays it out: its leaves in order and its structure as
JSON (a tenth of torch's pytree's time, which matters when it runs every step), and what one
process holds of a sharded leaf (a DTensor's local part) with how to make it one again."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def flatten(tree: object) -> tuple[list, object]:
    """A state's leaves in order, and its structure as JSON-able nesting: {"d": [keys, children]}
    for a dict, {"l": [...]} or {"t": [...]} for a list or tuple, None for a leaf. A tenth of
    torch's pytree's time, which matters when it runs every step."""
    leaves: list = []

    def walk(node: object) -> object:
        if isinstance(node, dict):
            return {"d": [list(node), [walk(v) for v in node.values()]]}
        if isinstance(node, (list, tuple)):
            return {"l" if isinstance(node, list) else "t": [walk(v) for v in node]}
        leaves.append(node)
        return None

    return leaves, walk(tree)


def unflatten(leaves: list, structure: object) -> object:
    it = iter(leaves)

    def build(node: object) -> object:
        if node is None:
            return next(it)
        if "d" in node:
            keys, children = node["d"]
            return {key: build(child) for key, child in zip(keys, children)}
        children = [build(child) for child in node.get("l", node.get("t", []))]
        return children if "l" in node else tuple(children)

    return build(structure)


def local(leaf: object) -> object:
    """What this process holds of a leaf: a DTensor's local shard (the bytes a slot keeps)."""
    return leaf.to_local() if isinstance(leaf, DTensor) else leaf


def spec(leaf: object) -> tuple | None:
    """How a DTensor lies over its mesh, to make its local shard one again; None for anything else."""
    if not isinstance(leaf, DTensor):
        return None
    return leaf.device_mesh, leaf.placements, leaf.shape, leaf.stride()


def sharded_like(view: torch.Tensor, spec: tuple | None) -> torch.Tensor:
    if spec is None:
        return view
    mesh, placements, shape, stride = spec
    return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape, stride=stride)


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def view_of(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return buffer[offset:offset + nbytes].view(dtype).view(shape)

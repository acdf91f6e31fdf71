"""Which parameters get weight decay, and which ones Muon optimises.

Weight decay goes to the matmul weights of blocks and the untied head. Norm gains, biases
and embeddings are excluded: decaying them pulls scales toward zero and hurts rare tokens
without regularising anything useful.

Muon is for hidden layers: the 2-D weights inside the transformer blocks (attention wq wk wv
wo, feed-forward w1 w2 w3). The token embedding and the output head are 2-D too, but their
role differs (a lookup table and a classifier over the vocabulary, tied or not), so they stay
on AdamW with the norms and biases.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn


def decay_groups(model: nn.Module, weight_decay: float, exclude: Collection[torch.Tensor] = ()) -> list[dict]:
    """[decay group, no-decay group] over the model's trainable parameters not in `exclude`."""
    skip = {id(p) for p in exclude}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in skip:
            continue
        excluded = param.dim() < 2 or "embeddings" in name or name.endswith("bias")
        (no_decay if excluded else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def hidden_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable 2-D weight inside the transformer blocks (model.layers)."""
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.Module):
        raise TypeError(f"{type(model).__name__} has no `layers` (transformer blocks) for Muon to optimise")
    return [(f"layers.{name}", p) for name, p in blocks.named_parameters() if p.requires_grad and p.dim() == 2]

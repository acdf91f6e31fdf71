"""Which parameters get weight decay: the matmul weights of blocks and the untied head.

Norm gains, biases and embeddings are excluded: decaying them pulls scales toward zero
and hurts rare tokens without regularising anything useful.
"""

from __future__ import annotations

from torch import nn


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        excluded = param.dim() < 2 or "embeddings" in name or name.endswith("bias")
        (no_decay if excluded else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]

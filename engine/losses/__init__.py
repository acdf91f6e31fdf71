"""Loss registry: loss(hidden [N, D], output weight [V, D], targets [N]) -> scalar."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import LossConfig
from engine.losses.ce import cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(cfg: LossConfig) -> LossFn:
    return {"ce": cross_entropy}[cfg.name]

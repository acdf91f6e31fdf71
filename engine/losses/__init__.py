"""Loss registry: loss(hidden [N, D], output weight [V, D], targets [N]) -> scalar mean.

`loss.name: auto` picks cut cross-entropy whenever the vocabulary is larger than the
hidden size, which is where the logits dominate activation memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.spec.schema import LossConfig, ModelConfig
from engine.losses.cce import linear_cross_entropy
from engine.losses.ce import cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_loss_name(cfg: LossConfig, model: ModelConfig) -> str:
    if cfg.name != "auto":
        return cfg.name
    return "cce" if model.vocab_size > model.dim else "ce"


def build_loss(cfg: LossConfig, model: ModelConfig) -> LossFn:
    terms = dict(label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss, softcap=cfg.softcap,
                 focal_gamma=cfg.focal_gamma)
    if resolve_loss_name(cfg, model) == "cce":
        return functools.partial(linear_cross_entropy, chunk_size=cfg.chunk_size, **terms)
    return functools.partial(cross_entropy, **terms)

"""Loss registry: loss(hidden [N, D], output weight [V, D], targets [N]) -> scalar mean.

`loss.name: auto` picks by size: the full-logits cross-entropy while one micro-batch's fp32
logits on one device fit `loss.logits_budget_mib` (it is the fastest there: one matmul, and
XLA and torch.compile fuse the rest), else the token-chunked one. Cut cross-entropy, the
least memory and the slowest, is only ever picked by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.losses.cce import linear_cross_entropy
from engine.losses.ce import cross_entropy, token_losses
from engine.losses.chunked import chunked_cross_entropy
from engine.spec.schema import LossConfig, ModelConfig

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_loss_name(cfg: LossConfig, model: ModelConfig, tokens_per_device: int) -> str:
    if cfg.name != "auto":
        return cfg.name
    logits_bytes = tokens_per_device * model.vocab_size * 4
    return "ce" if logits_bytes <= cfg.logits_budget_mib << 20 else "chunked"


def build_loss(cfg: LossConfig, model: ModelConfig, tokens_per_device: int,
               compile: Callable[[Callable], Callable] = lambda fn: fn) -> LossFn:
    """The loss function; `compile` (the backend's) is applied to the full-logits math it runs."""
    terms = dict(label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss, softcap=cfg.softcap,
                 focal_gamma=cfg.focal_gamma)
    name = resolve_loss_name(cfg, model, tokens_per_device)
    if name == "cce":  # its own hand-written backward: nothing for a compiler to fuse across
        return functools.partial(linear_cross_entropy, chunk_size=cfg.chunk_size, **terms)
    if name == "chunked":
        return functools.partial(chunked_cross_entropy, chunk_tokens=cfg.chunk_tokens,
                                 losses=compile(token_losses), **terms)
    return compile(functools.partial(cross_entropy, **terms))

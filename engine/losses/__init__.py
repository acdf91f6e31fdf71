"""Loss registry: loss(hidden [N, D], output weight [V, D], targets [N]) -> scalar mean, and distillation's
(the same plus the teacher's hidden states and head).

`loss.name: auto` picks by size: the full-logits cross-entropy while one micro-batch's fp32
logits on one device fit `loss.logits_budget_mib` (it is the fastest there: one matmul, and
XLA and torch.compile fuse the rest), else the token-chunked one. The budget's own auto is a
sixteenth of the device's memory where the backend knows it (cuda), else 1 GiB. Cut
cross-entropy, the least memory and the slowest, is only ever picked by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.losses.cce import linear_cross_entropy
from engine.losses.ce import cross_entropy, token_losses
from engine.losses.chunked import chunked_cross_entropy
from engine.losses.distill import chunked_distill_loss, chunked_topk_distill_loss, topk_token_losses
from engine.losses.distill import token_losses as distill_token_losses
from engine.spec.schema import DistillConfig, LossConfig, ModelConfig

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (student hidden, student head, targets, teacher hidden, teacher head) -> (scalar mean, its TERMS' means)
DistillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]]


DEFAULT_BUDGET_MIB = 1024  # where the device's memory is unknown (cpu, xla): a TPU v5e's HBM / 16
DEVICE_SHARE = 16  # auto budget: this fraction of the device's memory (bench/results/train_overhead-cuda-compile*.json)


def logits_budget_bytes(cfg: LossConfig, device_bytes: int | None) -> int:
    if cfg.logits_budget_mib != "auto":
        return cfg.logits_budget_mib << 20
    return device_bytes // DEVICE_SHARE if device_bytes else DEFAULT_BUDGET_MIB << 20


def resolve_loss_name(cfg: LossConfig, model: ModelConfig, tokens_per_device: int,
                      device_bytes: int | None = None) -> str:
    """device_bytes: the memory of one device (Backend.memory_capacity), for the auto budget."""
    if cfg.name != "auto":
        return cfg.name
    logits_bytes = tokens_per_device * model.vocab_size * 4
    return "ce" if logits_bytes <= logits_budget_bytes(cfg, device_bytes) else "chunked"


def build_loss(cfg: LossConfig, model: ModelConfig, tokens_per_device: int,
               compile: Callable[[Callable], Callable] = lambda fn: fn, device_bytes: int | None = None) -> LossFn:
    """The loss function; `compile` (the backend's) is applied to the full-logits math it runs."""
    terms = dict(label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss, softcap=cfg.softcap,
                 focal_gamma=cfg.focal_gamma)
    name = resolve_loss_name(cfg, model, tokens_per_device, device_bytes)
    if name == "cce":  # its own hand-written backward: nothing for a compiler to fuse across
        return functools.partial(linear_cross_entropy, chunk_size=cfg.chunk_size, **terms)
    if name == "chunked":
        return functools.partial(chunked_cross_entropy, chunk_tokens=cfg.chunk_tokens,
                                 losses=compile(token_losses), **terms)
    return compile(functools.partial(cross_entropy, **terms))


def build_distill_loss(cfg: DistillConfig, compile: Callable[[Callable], Callable] = lambda fn: fn) -> DistillFn:
    """Distillation's loss (engine.losses.distill), always in token chunks: neither model's logits
    ever exist for the whole micro-batch; `compile` is applied to each chunk's math. An offline
    teacher's takes its stored top k (ids, log-probabilities) in place of its hidden states and head."""
    if cfg.offline:
        return functools.partial(chunked_topk_distill_loss, temperature=cfg.temperature, alpha=cfg.alpha,
                                 chunk_tokens=cfg.chunk_tokens, losses=compile(topk_token_losses), with_terms=True)
    return functools.partial(chunked_distill_loss, kind=cfg.loss, temperature=cfg.temperature, beta=cfg.beta,
                             alpha=cfg.alpha, chunk_tokens=cfg.chunk_tokens, losses=compile(distill_token_losses),
                             with_terms=True)

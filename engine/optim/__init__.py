"""Build the optimizer named in the job spec."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import OptimizerConfig
from engine.optim.param_groups import decay_groups


def build_optimizer(cfg: OptimizerConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    groups = decay_groups(model, cfg.weight_decay)
    # The fused kernel is fastest on cpu and cuda; XLA fuses the plain loop itself.
    fused = device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None)
    return with_base_lr(optimizer)


def with_base_lr(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Record each group's peak lr: the schedule scales it, and groups may differ (Muon)."""
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
    return optimizer

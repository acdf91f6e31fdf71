"""Build the optimizer named in the job spec: adamw | lion | muon."""

from __future__ import annotations

import torch
from torch import nn

from engine.spec.schema import OptimizerConfig
from engine.errors import ConfigError
from engine.optim.lion import Lion
from engine.optim.muon import MuonWithAdamW
from engine.optim.param_groups import decay_groups, hidden_matrices

# Lion's defaults relative to AdamW's (LionConfig): lr 3x smaller, weight decay 3x larger.
LION_LR_DIVISOR = 3.0
LION_WD_FACTOR = 3.0


def build_optimizer(cfg: OptimizerConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    # The fused kernel is fastest on cpu and cuda; XLA fuses the plain loop itself.
    fused = (device.type in ("cpu", "cuda")) or None
    if cfg.name == "adamw":
        groups = decay_groups(model, cfg.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    elif cfg.name == "lion":
        lr, weight_decay = lion_hyperparameters(cfg)
        optimizer = Lion(decay_groups(model, weight_decay), lr=lr, betas=cfg.lion.betas)
    elif cfg.name == "muon":
        optimizer = build_muon(cfg, model, fused)
    else:  # the config schema lists the names; this catches one added there but not here
        raise ConfigError("optimizer.name", f"unknown optimizer {cfg.name!r}")
    return with_base_lr(optimizer)


def lion_hyperparameters(cfg: OptimizerConfig) -> tuple[float, float]:
    """(lr, weight_decay) of Lion: its own, or derived from AdamW's."""
    lr = cfg.lion.lr if cfg.lion.lr is not None else cfg.lr / LION_LR_DIVISOR
    wd = cfg.lion.weight_decay if cfg.lion.weight_decay is not None else cfg.weight_decay * LION_WD_FACTOR
    return lr, wd


def muon_hyperparameters(cfg: OptimizerConfig) -> tuple[float, float]:
    """(lr, weight_decay) of the Muon part: its own, or AdamW's (right with match_rms_adamw)."""
    m = cfg.muon
    return (m.lr if m.lr is not None else cfg.lr,
            m.weight_decay if m.weight_decay is not None else cfg.weight_decay)


def build_muon(cfg: OptimizerConfig, model: nn.Module, fused: bool | None) -> MuonWithAdamW:
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError("optimizer.name",
                          f"muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}")
    matrices = [p for _, p in hidden_matrices(model)]
    lr, weight_decay = muon_hyperparameters(cfg)
    m = cfg.muon
    # Empty groups (the decay group when the head is tied) would only clutter checkpoints.
    adamw_groups = [g for g in decay_groups(model, cfg.weight_decay, exclude=matrices) if g["params"]]
    return MuonWithAdamW(
        [{"params": matrices}], adamw_groups,
        muon={"lr": lr, "weight_decay": weight_decay, "momentum": m.momentum, "nesterov": m.nesterov,
              "ns_steps": m.ns_steps, "adjust_lr_fn": m.adjust_lr_fn},
        adamw={"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "fused": fused},
    )


def with_base_lr(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Record each group's peak lr: the schedule scales it, and groups may differ (Muon)."""
    for group in optimizer.param_groups:
        group.setdefault("base_lr", group["lr"])
    return optimizer

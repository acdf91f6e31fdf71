"""Cross-entropy over the full logits: simple and fast while (tokens x vocab) is small."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                 focal_gamma: float = 0.0) -> torch.Tensor:
    """Each token's loss [N] of hidden [N, D] against weight [V, D] (0 where ignored)."""
    logits = (hidden @ weight.T).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    if focal_gamma:
        loss = (1 - torch.exp(-loss)).pow(focal_gamma) * loss
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).square()
    return torch.where(targets != ignore_index, loss, 0.0)


def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  **terms) -> torch.Tensor:
    """Mean token loss of hidden [N, D] against weight [V, D]; the same terms as cut cross-entropy."""
    valid = (targets != ignore_index).sum().clamp(min=1)
    return token_losses(hidden, weight, targets, ignore_index=ignore_index, **terms).sum() / valid

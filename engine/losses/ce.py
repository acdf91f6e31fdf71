"""Plain cross-entropy over full logits: the reference every other loss is checked against."""

import torch
import torch.nn.functional as F


def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss of hidden [N, D] against weight [V, D]; targets [N] (-100 ignored)."""
    logits = hidden @ weight.T
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)

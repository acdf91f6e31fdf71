"""Lion: EvoLved Sign Momentum (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Per parameter p with gradient g and momentum m (the only state):

    update = sign(b1 m + (1 - b1) g)
    p      = p - lr wd p - lr update          (decoupled weight decay, as in AdamW)
    m      = b2 m + (1 - b2) g

Every coordinate moves by exactly lr (or not at all), so the update's norm is larger than
AdamW's: use an lr 3-10x smaller than AdamW's and a weight decay 3-10x larger, keeping
lr x wd (the decay per step) about the same; the paper's betas are (0.9, 0.99). Half of
AdamW's optimizer memory (one state tensor, not two).

The step is written with torch._foreach_* ops over each param group (one kernel launch per
op on cuda; XLA traces them like the per-tensor ops). b1 m + (1 - b1) g is computed as two
products and a sum, not a lerp or an add with alpha (which fuses into an FMA on cpu), so a
step equals the formula above evaluated op by op, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas: {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                if torch.is_complex(p):
                    raise RuntimeError("Lion does not support complex parameters")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            if params:
                beta1, beta2 = group["betas"]
                # Every op is elementwise, so sharded (FSDP) tensors step shard by shard.
                params, grads, exp_avgs = ([_local(t) for t in ts] for ts in (params, grads, exp_avgs))
                lion_foreach(params, grads, exp_avgs, lr=group["lr"], beta1=beta1, beta2=beta2,
                             weight_decay=group["weight_decay"])
        return loss


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def lion_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """One Lion step over lists of tensors, in place on params and exp_avgs."""
    update = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(update, torch._foreach_mul(grads, 1 - beta1))
    torch._foreach_sign_(update)
    if weight_decay != 0:  # a per-group constant: the decay-free group skips the pass
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    # alpha x (+-1 or 0) is exact, so this equals p - lr * update even when fused.
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, 1 - beta2))

"""Quintic Newton-Schulz orthogonalisation: G = U S V^T  ->  about U V^T, with matmuls only.

Muon's core (Keller Jordan, https://kellerjordan.github.io/posts/muon/). After dividing G by
its Frobenius norm every singular value lies in (0, 1]; each step maps X -> a X + b (X X^T) X
+ c (X X^T)^2 X, which applies p(s) = a s + b s^3 + c s^5 to every singular value and leaves
the singular vectors alone. The coefficients (3.4445, -4.7750, 2.0315) maximise the slope at
zero (a), so small singular values grow ~3.4x per step, at the price of not converging to
exactly 1: after 5 steps they sit in a band around 1 instead (tests/test_optimizers.py
measures [0.68, 1.21] for every singular value above ~1.5e-3 x the Frobenius norm, bf16 or
fp32, Gaussian and ill-conditioned matrices). Smaller ones are only amplified (x450-530
after 5 steps; a^5 = 487), never shrunk.

The arithmetic is the same as torch.optim.Muon's (torch/optim/_muon.py): the normalisation
and the two addmm per step in the compute dtype, on the wide orientation, so in bf16 both
give identical bits (tested on cpu). On XLA devices the norm and the addmm are computed
differently (see below), and engine.optim.muon has torch.optim.Muon use this function there.
"""

from __future__ import annotations

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def newton_schulz(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = COEFFICIENTS,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = EPS,
) -> torch.Tensor:
    """Approximately orthogonalise the matrix `g` (U S V^T -> U S' V^T, S' ~ 1); returns `dtype`.

    Tall matrices are transposed first so that the Gram matrix X X^T is the smaller one
    (min(m, n) squared), and back at the end.
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    # torch_xla 2.9 differs from cpu and cuda twice here. It reduces a bf16 norm in bf16 (10%
    # low for a 96 x 32 Gaussian, worse as matrices grow: a norm below the spectral norm makes
    # the iteration diverge), so the norm is taken in fp32 there. And it lowers addmm only for
    # beta = alpha = 1, running any other on the host CPU (counted as aten::addmm, and cutting
    # the step's graph into pieces), so the products and sums are separate ops; XLA fuses them.
    fused = x.device.type != "xla"
    # Frobenius norm >= spectral norm, so afterwards every singular value is at most 1.
    norm = x.norm() if fused else x.float().norm().to(x.dtype)
    x = x / norm.clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        if fused:
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
            x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
        else:
            poly = b * gram + c * (gram @ gram)
            x = a * x + poly @ x
    return x.mT if tall else x

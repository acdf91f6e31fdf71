"""Token-chunked cross-entropy: the logits of a few thousand tokens at a time, each chunk's
backward done inside forward (the design torchtitan calls ChunkedLossWrapper).

Forward walks the tokens in chunks of `chunk_tokens` (default: an eighth of them). Each chunk's loss is the full-logits
one (engine.losses.ce.token_losses: every term, whole vocabulary rows in one matmul), and its
gradients are taken at once, while its chunk x vocab logits exist: d hidden for the chunk's
rows, d weight accumulated over chunks, both in fp32. Backward only scales them by the
upstream gradient. So the logits never exist for all tokens, and, unlike cut cross-entropy's
vocabulary tiles, each chunk is a few large matmuls: fast where launches and elementwise
passes dominate small tiles (bench/cce.py).

The cost is memory for the fp32 gradients until backward (N x D and V x D): far below the
N x V logits whenever the vocabulary is large, which is when this loss is picked.
Nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.losses.ce import token_losses

CHUNKS, MIN_CHUNK_TOKENS = 8, 256


def default_chunk_tokens(n_tokens: int) -> int:
    """An eighth of the tokens (so an eighth of the logits at a time), at least 256: a 16k-token
    micro-batch is walked in chunks of 2048."""
    return max(MIN_CHUNK_TOKENS, -(-n_tokens // CHUNKS))


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          ignore_index: int = -100, chunk_tokens: int | None = None,
                          losses: Callable = token_losses, **terms) -> torch.Tensor:
    """Mean token loss of hidden [N, D] against weight [V, D], equal to engine.losses.ce.cross_entropy.

    `losses` computes a chunk's token losses: token_losses, or a compiled token_losses."""
    return chunked_loss(hidden, weight, targets, (), ignore_index=ignore_index, chunk_tokens=chunk_tokens,
                        losses=losses, **terms)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, per_token: tuple, *,
                 ignore_index: int = -100, chunk_tokens: int | None = None, losses: Callable, stats: int = 0,
                 **terms) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mean over the targets not ignored of losses(hidden rows, weight, target rows, *per_token rows,
    **terms), chunk by chunk. `per_token`: more [N, ...] inputs that take no gradient (a teacher's
    hidden states, engine.losses.distill). With `stats` > 0, `losses` returns (token losses, token
    statistics [rows, stats] without gradient), and so does this: (the loss, the statistics' means)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, D] and weight [V, D], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    chunk_tokens = chunk_tokens or default_chunk_tokens(hidden.shape[0])
    loss, means = _ChunkedLoss.apply(hidden, weight, targets, per_token, chunk_tokens, losses, stats,
                                     {"ignore_index": ignore_index, **terms})
    return (loss, means) if stats else loss


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, per_token, chunk_tokens, losses, stats, terms):
        count = (targets != terms["ignore_index"]).sum().clamp(min=1)
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        sums = torch.zeros(stats, dtype=torch.float32, device=hidden.device)
        w = weight.detach().requires_grad_()
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h = hidden[rows].detach().requires_grad_()
            with torch.enable_grad():
                out = losses(h, w, targets[rows], *(t[rows] for t in per_token), **terms)
                token_losses, token_stats = out if stats else (out, None)
                loss = token_losses.sum()
                d_hidden, d_weight = torch.autograd.grad(loss, (h, w))
            grad_hidden[rows] = d_hidden
            grad_weight += d_weight
            total += loss.detach()
            if stats:
                sums += token_stats.float().sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.dtypes = hidden.dtype, weight.dtype
        means = sums / count
        ctx.mark_non_differentiable(means)
        return total / count, means

    @staticmethod
    def backward(ctx, grad_output, _grad_means):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_output / count
        return ((grad_hidden * scale).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None,
                (grad_weight * scale).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None,
                None, None, None, None, None, None)

"""Cut cross-entropy (Wijmans et al. 2024): the loss of `hidden @ weight.T` without the logits.

The (tokens x vocab) logits never exist. The vocabulary is walked in chunks of
`chunk_size` rows of the weight:

- forward: each chunk's logits [N, chunk] are reduced into a running (max, sum-exp) pair,
  giving the log-sum-exp in fp32; the target logit is one gathered dot product per token.
- backward: each chunk's logits are recomputed, turned into d loss / d logits in place,
  and immediately consumed: `dW[chunk] = G.T @ hidden` (written once, never accumulated)
  and `d hidden += G @ W[chunk]`.

Why recompute rather than computing the gradients during forward, as Liger does: the
gradient-in-forward scheme must chunk over tokens (every token needs its full softmax
before its gradient exists), so its scratch is chunk x vocab and the weight gradient is
re-read and re-written once per chunk. At N=4096, V=65536 the 1/20 memory budget leaves
room only for token chunks of ~30, which makes that traffic dominate. Vocabulary chunks
cost one extra matmul pass but touch each weight-gradient row once, and they also serve
reduction="none", whose per-token upstream gradient is known only in backward.
bench/cce.py holds the measurements.

Matmuls run in the hidden states' dtype (bf16 under autocast) with fp32 accumulation;
the softmax, log-sum-exp and gradient math run in fp32. Shapes are static and nothing
is read back to the host, so the same code traces to one fixed XLA graph; under SPMD
the batch-sharded hidden states and sharded weight are partitioned by XLA itself.
"""

from __future__ import annotations

import torch

_SCRATCH_ELEMENTS = 1 << 21  # logits elements per chunk by default: 8 MiB in fp32
_XLA_CHUNKS = 8


def default_chunk_size(n_tokens: int, vocab: int, device_type: str = "cpu") -> int:
    """Vocabulary rows per chunk.

    Eager backends: a power of two keeping one chunk's fp32 logits near 8 MiB, in
    [128, vocab]. XLA: the loop is unrolled into the graph and n_tokens is the global
    (all-device) count, so the chunk count is fixed instead: 8 chunks, rounded to 128
    rows. Measured on PJRT CPU (N=1024, D=256, V=32768): compile 0.8 s unchunked, 1.1 s
    at 8 chunks, 5.3 s at 128 chunks; a scan could save at most the 0.3 s in between.
    """
    if device_type == "xla":
        return min(vocab, 128 * -(-vocab // (128 * _XLA_CHUNKS)))
    size = 1 << max(7, (_SCRATCH_ELEMENTS // max(n_tokens, 1)).bit_length() - 1)
    return min(size, vocab)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    focal_gamma: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits = hidden [N, D] @ weight [V, D].T against targets [N].

    Matches `F.cross_entropy(logits, targets, ignore_index=..., reduction=...,
    label_smoothing=...)` plus `z_loss * logsumexp(logits) ** 2` per token, with logits
    first soft-capped as `softcap * tanh(logits / softcap)` when softcap is set. With
    focal_gamma > 0 the cross-entropy term of each token is scaled by (1 - p_target)^gamma.
    "mean" averages over the tokens that are not ignored (0, not NaN, when all are).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, not {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, D] and weight [V, D], got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    chunk = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0], hidden.device.type)
    if focal_gamma and (focal_gamma < 1 or label_smoothing):
        raise ValueError("focal_gamma must be 0 or >= 1, and cannot be combined with label_smoothing")
    options = (ignore_index, reduction, float(label_smoothing), float(z_loss), softcap, float(focal_gamma), chunk)
    return _LinearCrossEntropy.apply(hidden, weight, targets, options)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, start: int, end: int, softcap: float | None):
    """fp32 logits of one vocabulary chunk, and tanh of the uncapped ones (for the softcap derivative)."""
    logits = (hidden @ weight[start:end].T).float()
    if softcap is None:
        return logits, None
    capped = logits.div_(softcap).tanh_()
    return capped * softcap, capped


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, options):
        ignore_index, reduction, smoothing, z_loss, softcap, gamma, chunk = options
        n, vocab = hidden.shape[0], weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            valid = targets != ignore_index
            safe_targets = torch.where(valid, targets, 0)
            running_max = torch.full((n,), float("-inf"), device=hidden.device)
            sum_exp = torch.zeros(n, device=hidden.device)
            sum_logits = torch.zeros(n, device=hidden.device) if smoothing else None
            for start in range(0, vocab, chunk):
                logits, _ = _chunk_logits(hidden, w, start, min(start + chunk, vocab), softcap)
                if sum_logits is not None:
                    sum_logits += logits.sum(dim=1)
                new_max = torch.maximum(running_max, logits.amax(dim=1))
                sum_exp = sum_exp * torch.exp(running_max - new_max) + logits.sub_(new_max[:, None]).exp_().sum(dim=1)
                running_max = new_max
            lse = running_max + sum_exp.log()

            target_logit = (hidden * w[safe_targets]).sum(dim=1).float()
            if softcap is not None:
                target_logit = softcap * torch.tanh(target_logit / softcap)
            loss = lse - (1.0 - smoothing) * target_logit
            # d CE-term / d logits = ce_scale * (p - onehot): 1 for plain CE; for focal,
            # (1 - p)^g - g (1 - p)^(g - 1) p log p, from differentiating (1 - p)^g * CE.
            ce_scale = torch.ones_like(loss)
            if gamma:
                p_target = torch.exp(-loss)
                ce_scale = (1 - p_target).pow(gamma) + gamma * (1 - p_target).pow(gamma - 1) * p_target * loss
                loss = (1 - p_target).pow(gamma) * loss
            if smoothing:
                loss -= (smoothing / vocab) * sum_logits
            if z_loss:
                loss += z_loss * lse.square()
            loss = torch.where(valid, loss, 0.0)
            count = valid.sum().clamp(min=1)

        ctx.save_for_backward(hidden, weight, safe_targets, valid, lse, ce_scale, count)
        ctx.options = options
        if reduction == "none":
            return loss
        total = loss.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, targets, valid, lse, ce_scale, count = ctx.saved_tensors
        _, reduction, smoothing, z_loss, softcap, _, chunk = ctx.options
        vocab = weight.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            # The upstream gradient of each token's loss; zero for ignored tokens.
            token_grad = grad_output.float() / count if reduction == "mean" else grad_output.float()
            token_grad = torch.where(valid, token_grad.expand_as(lse), 0.0)
            softmax_scale = (token_grad * (ce_scale + 2.0 * z_loss * lse))[:, None]
            grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            grad_weight = torch.empty(weight.shape, dtype=hidden.dtype, device=hidden.device)
            for start in range(0, vocab, chunk):
                end = min(start + chunk, vocab)
                logits, capped = _chunk_logits(hidden, w, start, end, softcap)
                # d loss / d logit = p (s + 2 z lse) - s (1 - eps) [j = y] - eps / V, per token,
                # with s the CE term's scale (1 but for focal).
                grad = logits.sub_(lse[:, None]).exp_().mul_(softmax_scale)
                if smoothing:
                    grad.sub_(token_grad[:, None] * (smoothing / vocab))
                in_chunk = (targets >= start) & (targets < end)
                index = (targets - start).clamp(0, end - start - 1)[:, None]
                grad.scatter_add_(1, index, (-(1.0 - smoothing) * token_grad * ce_scale * in_chunk)[:, None])
                if capped is not None:
                    grad.mul_(1.0 - capped.square_())
                grad = grad.to(hidden.dtype)
                if grad.dtype == grad_hidden.dtype:
                    grad_hidden.addmm_(grad, w[start:end])  # in place: no [N, D] temporary
                else:
                    grad_hidden += (grad @ w[start:end]).float()
                torch.mm(grad.T, hidden, out=grad_weight[start:end])
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None

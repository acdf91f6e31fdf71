"""Reference attention: explicit matmuls with an fp32 softmax.

The slowest kernel and the one every other kernel is tested against. Under torch_xla on
CPU it is also the kernel that runs: the Pallas kernels need a TPU.
"""

import math

import torch


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n_rep, T, D], each KV head serving n_rep query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """mask: None (causal), or engine.models.llama.document_mask's [B, 1, T, T]."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    t = q.shape[2]
    scores = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)

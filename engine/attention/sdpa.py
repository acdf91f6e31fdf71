"""PyTorch's fused scaled_dot_product_attention (flash / memory-efficient / math backends).

enable_gqa lets the kernel broadcast KV heads itself instead of materialising the repeat.
"""

import torch
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """mask: None (causal), or engine.models.llama.document_mask's [B, 1, T, T]: with one, CUDA
    runs the memory-efficient kernel, not flash (engine.attention.flex keeps flash speed)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])

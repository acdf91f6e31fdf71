"""PyTorch's fused scaled_dot_product_attention (flash / memory-efficient / math backends).

enable_gqa lets the kernel broadcast KV heads itself instead of materialising the repeat.
"""

import torch
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

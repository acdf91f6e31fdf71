"""PyTorch's flex_attention with a block mask: packed documents masked at flash-class speed on CUDA.

The block mask records which (query block, key block) tiles hold any allowed pair, so the
kernel skips the tiles above the diagonal and those between documents altogether; it is
made once per forward from the segment ids (`block_mask`) and serves every layer. Compiled,
flex_attention generates a fused Triton kernel; uncompiled (on the CPU, in tests) it runs
its reference implementation, with the same results.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BLOCK = 128  # the kernel's tile: query and key blocks of 128 tokens


def block_mask(segments: torch.Tensor) -> BlockMask:
    """The block mask of document masking: query q sees key kv <= q of its own segment."""
    b, t = segments.shape

    def same_document(batch, head, q, kv):
        return (q >= kv) & (segments[batch, q] == segments[batch, kv])

    # Compiled on CUDA: made eagerly, the mask is first materialised whole, B x T x T.
    return create_block_mask(same_document, b, None, t, t, device=segments.device, BLOCK_SIZE=min(BLOCK, t),
                             _compile=segments.is_cuda)


@functools.cache
def _causal(t: int, device: str) -> BlockMask:
    return create_block_mask(lambda batch, head, q, kv: q >= kv, None, None, t, t, device=device,
                             BLOCK_SIZE=min(BLOCK, t))


@functools.cache
def _kernel(device_type: str):
    # Uncompiled, flex_attention materialises the scores: the fused kernel needs torch.compile.
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | None = None) -> torch.Tensor:
    """mask: None (causal), or `block_mask` of the segment ids."""
    if mask is None:
        mask = _causal(q.shape[2], str(q.device))
    return _kernel(q.device.type)(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

"""torch_xla's Pallas TPU kernels: flash and splash attention.

Both run under SPMD with a partition spec so each device attends over its own batch
shard. Imported only on the xla backend: torch_xla is optional everywhere else. Both mask
packed documents from the segment ids themselves (their MaskFn is `segment_ids`): the
kernels skip the blocks that no query of a document needs.
"""

from __future__ import annotations

import math

import torch

from engine.attention.eager import repeat_kv
from engine.spec.schema import FlashBlocks, SplashBlocks
from engine.models.llama import AttentionFn

# Batch over the data-parallel axes, heads over the tensor axis.
QKV_PARTITION = (("data", "fsdp"), "tensor", None, None)


def segment_ids(segments: torch.Tensor) -> torch.Tensor:
    """The kernels' segment ids: int32 [B, T], one id per document of a window."""
    return segments.to(torch.int32)


def flash(blocks: FlashBlocks, mesh) -> AttentionFn:
    from torch_xla.experimental.custom_kernel import FlashAttention, flash_attention

    # The kernel reads block sizes from this class attribute, not from arguments.
    FlashAttention.DEFAULT_BLOCK_SIZES.update(blocks.model_dump())

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None = None):
        # The flash kernel has no GQA: repeat KV to the query heads. Its default
        # sm_scale is 1.0, so the 1/sqrt(d) scaling must be explicit. Queries and keys are
        # the same tokens, so their segment ids are one tensor (sharded like the batch).
        n_rep = q.shape[1] // k.shape[1]
        return flash_attention(
            q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), causal=True, q_segment_ids=segments,
            kv_segment_ids=segments, sm_scale=1.0 / math.sqrt(q.shape[-1]), partition_spec=QKV_PARTITION, mesh=mesh,
        )

    return attention


def splash(blocks: SplashBlocks, mesh) -> AttentionFn:
    from torch_xla.experimental.splash_attention import SplashAttentionConfig, splash_attention

    config = SplashAttentionConfig(
        mesh=str(mesh), qkv_partition_spec=QKV_PARTITION, segment_ids_partition_spec=(("data", "fsdp"), None),
        **{f"sa_{name}": size for name, size in blocks.model_dump().items()},
    ).to_json()

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor | None = None):
        # Splash takes GQA directly, but unlike flash it does not scale the scores. Its segment
        # ids serve queries and keys both.
        return splash_attention(q * (1.0 / math.sqrt(q.shape[-1])), k, v, config, decoder_segment_ids=segments,
                                causal=True)

    return attention

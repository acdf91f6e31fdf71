"""Choose the attention kernel for a backend: `attention.kernel` in the job spec.

auto picks the backend's best kernel; asking for one the backend lacks is a config
error naming what it does offer, never a silent fallback. With data.document_mask the
choice is among the kernels that mask packed documents on the backend at their speed
(`Backend.document_mask_kernels`); each takes the mask in its own form (`build_mask`).
"""

from __future__ import annotations

import structlog

from engine.attention.eager import eager_attention
from engine.attention.sdpa import sdpa_attention
from engine.backends.base import Backend
from engine.spec.schema import AttentionConfig
from engine.errors import ConfigError
from engine.models.llama import AttentionFn, MaskFn, document_mask

log = structlog.get_logger()


def build_attention(cfg: AttentionConfig, backend: Backend, document_mask: bool = False) -> tuple[str, AttentionFn]:
    offered = backend.document_mask_kernels if document_mask else backend.attention_kernels
    kernel = offered[0] if cfg.kernel == "auto" else cfg.kernel
    if kernel not in backend.attention_kernels:
        where = "a TPU (torch_xla Pallas kernels)" if kernel in ("flash", "splash") else "another backend"
        raise ConfigError(
            "attention.kernel",
            f"{kernel!r} needs {where}; backend {backend.name!r} offers: {', '.join(backend.attention_kernels)}",
        )
    if kernel not in offered:
        raise ConfigError("attention.kernel", f"{kernel!r} cannot mask packed documents (data.document_mask) on "
                          f"backend {backend.name!r} at its speed; kernels that can: {', '.join(offered)}")
    if cfg.kernel == "auto":
        log.info("attention kernel chosen", kernel=kernel, backend=backend.name)
    if kernel == "eager":
        return kernel, eager_attention
    if kernel == "sdpa":
        return kernel, sdpa_attention
    if kernel == "flex":
        from engine.attention.flex import flex

        return kernel, flex
    from engine.attention import pallas

    return kernel, pallas.flash(cfg.flash, backend.mesh) if kernel == "flash" else pallas.splash(cfg.splash, backend.mesh)


def build_mask(kernel: str) -> MaskFn:
    """What `kernel` takes as its mask, made from the segment ids once per forward."""
    if kernel == "flex":
        from engine.attention.flex import block_mask

        return block_mask
    if kernel in ("flash", "splash"):
        from engine.attention.pallas import segment_ids

        return segment_ids
    return document_mask

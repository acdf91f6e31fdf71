"""Choose the attention kernel for a backend: `attention.kernel` in the job spec.

auto picks the backend's best kernel; asking for one the backend lacks is a config
error naming what it does offer, never a silent fallback.
"""

from __future__ import annotations

import structlog

from engine.attention.eager import eager_attention
from engine.attention.sdpa import sdpa_attention
from engine.backends.base import Backend
from engine.spec.schema import AttentionConfig
from engine.errors import ConfigError
from engine.models.llama import AttentionFn

log = structlog.get_logger()


def build_attention(cfg: AttentionConfig, backend: Backend) -> tuple[str, AttentionFn]:
    kernel = backend.attention_kernels[0] if cfg.kernel == "auto" else cfg.kernel
    if kernel not in backend.attention_kernels:
        where = "a TPU (torch_xla Pallas kernels)" if kernel in ("flash", "splash") else "another backend"
        raise ConfigError(
            "attention.kernel",
            f"{kernel!r} needs {where}; backend {backend.name!r} offers: {', '.join(backend.attention_kernels)}",
        )
    if cfg.kernel == "auto":
        log.info("attention kernel chosen", kernel=kernel, backend=backend.name)
    if kernel == "eager":
        return kernel, eager_attention
    if kernel == "sdpa":
        return kernel, sdpa_attention
    from engine.attention import pallas

    return kernel, pallas.flash(cfg.flash, backend.mesh) if kernel == "flash" else pallas.splash(cfg.splash, backend.mesh)

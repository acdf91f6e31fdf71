"""Pick a backend for a job: cpu, cuda or xla (SPMD). torch_xla is imported only for xla."""

from __future__ import annotations

import importlib.util
import os

import torch

from engine.backends.base import Backend
from engine.spec.schema import DeviceConfig
from engine.errors import ConfigError


def _xla_wanted() -> bool:
    # A TPU host runs torch_xla; PJRT_DEVICE makes the choice explicit anywhere else.
    return importlib.util.find_spec("torch_xla") is not None and (
        "PJRT_DEVICE" in os.environ or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
    )


def resolve_backend_name(cfg: DeviceConfig) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    if _xla_wanted():
        return "xla"
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_backend(cfg: DeviceConfig, xla_cache: str | None = None, inductor_cache: str | None = None,
                  gang: bool = False) -> Backend:
    """gang: the processes are the hosts of a gang (engine.checkpoint.hosts), each one whole replica."""
    name = resolve_backend_name(cfg)
    if name == "xla" and cfg.compile is True:
        raise ConfigError("device.compile", "xla compiles whole steps by itself: leave it auto (or false)")
    if name == "xla":
        try:
            import torch_xla  # noqa: F401  (imported here first, so a missing one is a config error)
        except ImportError as e:
            raise ConfigError("device.backend", f"xla needs torch_xla (pip install 'tpud[tpu]'): {e}") from e
        from engine.backends.xla import XlaBackend

        return XlaBackend(cfg, xla_cache if cfg.compile_cache else None)
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device.backend", "cuda was asked for but torch sees no CUDA device")
    from engine.backends.torch_native import TorchBackend

    compiling = cfg.compile if cfg.compile != "auto" else name == "cuda"
    return TorchBackend(name, cfg.peak_flops, compiling, inductor_cache if cfg.compile_cache else None, cfg.mesh,
                        gang, cfg.deterministic)

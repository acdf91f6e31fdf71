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


def require_matching_torch(torch_version: str | None = None, xla: str | None = None) -> None:
    """torch_xla X.Y runs only on torch X.Y (its last release, 2.9, on torch 2.9): with another torch
    its import fails deep in a shared library, or worse, half works. Refused first, by versions
    (this environment's, unless given)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        xla = xla or version("torch_xla")
    except PackageNotFoundError:
        return  # the import below says it is missing
    torch_version = torch_version or torch.__version__

    def release(v: str) -> tuple[str, ...]:
        return tuple(v.split("+")[0].split(".")[:2])

    if release(xla) != release(torch_version):
        raise ConfigError("device.backend", f"xla needs the torch its torch_xla was built for: torch_xla {xla} "
                          f"runs on torch {'.'.join(release(xla))}.x, this is torch {torch_version}; install "
                          f"both from 'tpud[tpu]' (torch_xla {xla} with its torch) in their own environment")


def build_backend(cfg: DeviceConfig, xla_cache: str | None = None, inductor_cache: str | None = None,
                  gang: bool = False) -> Backend:
    """gang: the processes are the hosts of a gang (engine.checkpoint.hosts), each one whole replica."""
    name = resolve_backend_name(cfg)
    if name == "xla" and cfg.compile is True:
        raise ConfigError("device.compile", "xla compiles whole steps by itself: leave it auto (or false)")
    if name == "xla":
        require_matching_torch()
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

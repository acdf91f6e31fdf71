"""A host's worker processes for one job (device.processes_per_host): how many, and each one's
place in torch.distributed's world, given as torchrun gives it (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so the engine runs alike under either. Torch-free: the daemon counts
GPUs from the driver's list, never by importing torch."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

from engine.spec.schema import DeviceConfig

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one directory per GPU the driver sees


def processes_per_host(device: DeviceConfig, environ: Mapping[str, str] = os.environ,
                       gpus: Path = NVIDIA_GPUS) -> int:
    """device.processes_per_host, with auto resolved: one per visible GPU for cuda (or auto on a
    host with GPUs), else one."""
    if device.processes_per_host != "auto":
        return device.processes_per_host
    if device.backend in ("cpu", "xla"):
        return 1
    return max(1, visible_gpus(environ, gpus))


def visible_gpus(environ: Mapping[str, str] = os.environ, gpus: Path = NVIDIA_GPUS) -> int:
    """The GPUs a worker's torch will see: CUDA_VISIBLE_DEVICES's ("" or -1: none), else the driver's."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        return sum(1 for _ in gpus.iterdir())
    except OSError:
        return 0


def too_many(device: DeviceConfig, processes: int, environ: Mapping[str, str] = os.environ,
             gpus: Path = NVIDIA_GPUS) -> str | None:
    """Why `processes` cannot run on this host: more than its GPUs (cuda), or its cores (cpu: each
    process needs one); None when they can."""
    if processes == 1 or device.backend == "xla":  # xla's is refused by the spec itself
        return None
    visible = visible_gpus(environ, gpus)
    if device.backend == "cuda" or (device.backend == "auto" and visible):
        return None if processes <= visible else f"{processes} processes but {visible} GPUs visible (one a GPU)"
    cores = os.cpu_count() or 1
    return None if processes <= cores else f"{processes} processes but this host has {cores} cores (one a core)"


def local_env(local_rank: int, processes: int, port: int | None) -> dict[str, str]:
    """The environment that places one of a host's `processes` in their torch.distributed world
    (its rendezvous on 127.0.0.1:port); nothing for a single process."""
    if processes == 1:
        return {}
    env = {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(processes),
           "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun's rule: the cores shared, not each process taking all
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    return env


def free_port() -> int:
    """A port for local rank 0's store: the kernel's pick, released for the worker to bind (torchrun's way)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

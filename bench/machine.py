"""The machine a benchmark result was measured on, for every bench/results/*.json."""

from __future__ import annotations

import os
import platform
import subprocess
import sys


def describe(**extra) -> dict:
    """CPU, Python and load; torch's version and thread count when the benchmark loaded torch."""
    info = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "load": os.getloadavg()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        if torch.cuda.is_available():  # the GPU, its driver and CUDA: a figure means little without them
            info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, driver=_driver())
    return {**info, **extra}


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None

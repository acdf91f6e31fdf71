"""Model initialisation: the whole model built on the host then moved, against meta + materialise.

before: `torch.manual_seed(seed); Transformer(cfg)` on the host (every parameter allocated and
        initialised in fp32 there, in place, by the constructors and then by the engine's
        former `init_weights`, kept below as `_former_init_weights`), then
        `backend.prepare_model` moves it to the device: the engine's path until the meta-device
        change.
after:  the Trainer's path: `Transformer(cfg)` on the meta device, then `backend.materialise`
        with `initial_values` (each tensor made on the host, copied to its final placement,
        freed) and `prepare_model`.

Each arm runs in a fresh process: wall time from before construction to the weights in place
(device synchronised), peak host RSS (VmHWM) above the RSS once torch and the backend are
loaded, and the model's own bytes for scale. The two arms draw different random numbers (the
global RNG in place vs one generator per model), so their weights differ; both are from the
same distributions. On the CPU backend the model itself lives in host
memory, so "after" saves the constructor's work, not the model's size; on a GPU the host keeps
about one tensor instead of the whole model.

    .venv/bin/python bench/init.py                         # 1b preset on the CPU, ~1 min
    python bench/init.py --backend cuda --out /tmp/init-cuda.json

Results: a table on stdout and bench/results/init.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from machine import describe

REPO = Path(__file__).resolve().parents[1]


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _former_init_weights(model) -> None:
    """The engine's init before the meta-device change: in place, on the global RNG."""
    import torch
    from torch import nn

    std = model.cfg.init_std
    residual_std = std / math.sqrt(2 * model.cfg.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = residual_std if name.endswith(("wo.weight", "w2.weight")) else std
                nn.init.trunc_normal_(p, std=s, a=-3 * s, b=3 * s)


def measure(preset: str, backend_name: str, arm: str) -> dict:
    import torch
    import yaml

    from engine.attention.sdpa import sdpa_attention
    from engine.backends import build_backend
    from engine.models.llama import Transformer, initial_values
    from engine.spec.schema import DeviceConfig, ModelConfig

    cfg = ModelConfig(**yaml.safe_load((REPO / "configs" / "models" / f"{preset}.yaml").read_text())["model"])
    backend = build_backend(DeviceConfig(backend=backend_name))
    sync = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda: None)
    torch.empty(1, device=backend.device)  # the device context is created before the clock starts
    sync()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark
    base = _kib("VmRSS")
    start = time.perf_counter()
    if arm == "before":
        Transformer.init_weights = _former_init_weights
        torch.manual_seed(0)
        model = backend.prepare_model(Transformer(cfg, sdpa_attention))
    else:
        with torch.device("meta"):
            model = Transformer(cfg, sdpa_attention)
        backend.materialise(model, initial_values(model, torch.Generator().manual_seed(0)))
        model = backend.prepare_model(model)
    sync()
    seconds = time.perf_counter() - start
    peak = _kib("VmHWM")
    params = list(model.parameters())
    return {"arm": arm, "seconds": seconds, "peak_rss_above_base_bytes": (peak - base) * 1024,
            "model_bytes": sum(p.numel() * p.element_size() for p in params),
            "weight_std": float(torch.cat([p.detach().flatten()[:100000].float().cpu() for p in params]).std()),
            "device": str(backend.device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "init.json")
    parser.add_argument("--worker", metavar="ARM", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.preset, args.backend, args.worker)))
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    rows = []
    for arm in ("before", "after"):
        out = subprocess.run([sys.executable, __file__, "--preset", args.preset, "--backend", args.backend,
                              "--worker", arm], capture_output=True, text=True, cwd=REPO, env=env)
        if out.returncode:
            raise SystemExit(f"{arm} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    before, after = rows
    print(f"{args.preset} on {args.backend}: model {before['model_bytes'] / 2**30:.2f} GiB")
    print(f"{'arm':<7} {'seconds':>8} {'peak host RSS GiB':>18}")
    for r in rows:
        print(f"{r['arm']:<7} {r['seconds']:>8.2f} {r['peak_rss_above_base_bytes'] / 2**30:>18.2f}")
    print(f"after/before: time {after['seconds'] / before['seconds']:.2f}x, peak host RSS "
          f"{after['peak_rss_above_base_bytes'] / max(before['peak_rss_above_base_bytes'], 1):.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "init", "preset": args.preset, "backend": args.backend,
                                    "machine": describe(), "arms": rows,
                                    "time_ratio": after["seconds"] / before["seconds"],
                                    "rss_ratio": after["peak_rss_above_base_bytes"]
                                    / max(before["peak_rss_above_base_bytes"], 1)}, indent=2))


if __name__ == "__main__":
    main()

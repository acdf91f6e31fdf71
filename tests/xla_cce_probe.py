"""Run under PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 by tests/test_xla.py; prints one JSON line.

A chunked loss (argv[1]: cce, cut cross-entropy; chunked, token chunks with the backward in
forward) on sharded XLA tensors (hidden over the batch, weight over the vocab and over the
model dim) against the same function on the CPU, plus its compile time.
"""

import json
import sys
import time

import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from engine.losses.cce import linear_cross_entropy
from engine.losses.chunked import chunked_cross_entropy

TERMS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=10.0)
LOSSES = {
    "cce": (linear_cross_entropy, dict(chunk_size=384)),  # 1000 = 2 x 384 + a ragged 232
    "chunked": (chunked_cross_entropy, dict(chunk_tokens=96)),  # 256 = 2 x 96 + a ragged 64
}


def run(hidden, weight, targets):
    fn, chunking = LOSSES[sys.argv[1]]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets, **TERMS, **chunking)
    loss.backward()
    return loss, h.grad, w.grad


def main() -> None:
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(256, 64, generator=g), torch.randn(1000, 64, generator=g) * 0.3
    targets = torch.randint(0, 1000, (256,), generator=g)
    targets[::7] = -100
    cpu = run(hidden, weight, targets)

    device = torch_xla.device()
    h, w, t = hidden.to(device), weight.to(device), targets.to(device)
    xs.mark_sharding(h, mesh, ("data", "model"))
    xs.mark_sharding(w, mesh, ("model", "data"))
    xs.mark_sharding(t, mesh, ("data",))
    start = time.perf_counter()
    on_xla = run(h, w, t)
    torch_xla.sync()
    results = [x.cpu() for x in on_xla]
    seconds = time.perf_counter() - start
    print(json.dumps({
        "errors": [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(results, cpu)],
        "graph_seconds": seconds, "compiles": met.metric_data("CompileTime")[0],
        "item_calls": met.counter_value("ItemCall") or 0,
    }))


if __name__ == "__main__":
    main()

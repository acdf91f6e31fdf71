"""Run under PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 by tests/test_xla.py; prints one JSON line.

A chunked loss (argv[1]: cce, cut cross-entropy; chunked, token chunks with the backward in
forward; distill, distillation's divergence in token chunks from a teacher of another width;
offline, the same from that teacher's stored top k) on
sharded XLA tensors (hidden over the batch, weight over the vocab and over the model dim) against
the same function on the CPU, plus its compile time and the compilations a second call with
other values adds (none: static chunk shapes).
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
from engine.losses.distill import chunked_distill_loss, chunked_topk_distill_loss

TERMS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=10.0)
LOSSES = {
    "cce": (linear_cross_entropy, dict(chunk_size=384)),  # 1000 = 2 x 384 + a ragged 232
    "chunked": (chunked_cross_entropy, dict(chunk_tokens=96)),  # 256 = 2 x 96 + a ragged 64
}
DISTILL = dict(kind="jsd", beta=0.3, temperature=2.0, alpha=0.2, chunk_tokens=96, with_terms=True)


def run(hidden, weight, targets, teacher):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if sys.argv[1] == "distill":
        loss, _ = chunked_distill_loss(h, w, targets, *teacher, **DISTILL)  # as the trainer calls it
    elif sys.argv[1] == "offline":  # an offline teacher's top 16 of the 1000, from the teacher above
        logp, ids = torch.log_softmax(teacher[0] @ teacher[1].T / 2.0, -1).topk(16)
        loss, _ = chunked_topk_distill_loss(h, w, targets, ids.int(), logp, temperature=2.0, alpha=0.2,
                                            chunk_tokens=96, with_terms=True)
    else:
        fn, chunking = LOSSES[sys.argv[1]]
        loss = fn(h, w, targets, **TERMS, **chunking)
    loss.backward()
    return loss, h.grad, w.grad


def problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(256, 64, generator=g), torch.randn(1000, 64, generator=g) * 0.3
    targets = torch.randint(0, 1000, (256,), generator=g)
    targets[::7] = -100
    teacher = torch.randn(256, 48, generator=g), torch.randn(1000, 48, generator=g) * 0.3
    return hidden, weight, targets, teacher


def main() -> None:
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    device = torch_xla.device()

    def on_device(hidden, weight, targets, teacher):
        h, w, t = hidden.to(device), weight.to(device), targets.to(device)
        th, tw = (x.to(device) for x in teacher)
        for x, spec in ((h, ("data", "model")), (w, ("model", "data")), (t, ("data",)), (th, ("data", "model")),
                        (tw, ("model", "data"))):
            xs.mark_sharding(x, mesh, spec)
        return h, w, t, (th, tw)

    hidden, weight, targets, teacher = problem(0)
    cpu = run(hidden, weight, targets, teacher)
    start = time.perf_counter()
    on_xla = run(*on_device(hidden, weight, targets, teacher))
    torch_xla.sync()
    seconds = time.perf_counter() - start
    compiles = met.metric_data("CompileTime")[0]
    results = [x.cpu() for x in on_xla]  # reading sharded values compiles their gathers, every time
    before = met.metric_data("CompileTime")[0]
    run(*on_device(*problem(1)))
    torch_xla.sync()
    print(json.dumps({
        "errors": [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(results, cpu)],
        "graph_seconds": seconds, "compiles": compiles,
        "recompiles": met.metric_data("CompileTime")[0] - before,
        "item_calls": met.counter_value("ItemCall") or 0,
    }))


if __name__ == "__main__":
    main()

"""Run under PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 by tests/test_xla.py; prints one JSON line.

Trains the tiny job on the xla backend (SPMD over 4 virtual devices) and reports the
per-step losses (read through the backend's asynchronous metric path), the sharding of
a few weights, and torch_xla's counts (compilations, transfers) at each step boundary and
after the run; the final weights, gathered to the host, go to STATE_DIR/final-params.pt.
"""

import json
import sys
from pathlib import Path

from engine.spec.loader import load_spec
from engine.train import Trainer
from testkit.recorders import XlaCounters


def attention_checks(backend) -> dict:
    """Eager attention on the XLA device against the CPU, causal with GQA; TPU kernels refused."""
    import torch

    from engine.attention import build_attention
    from engine.attention.eager import eager_attention
    from engine.spec.schema import AttentionConfig
    from engine.errors import ConfigError

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 8, 40, 16, generator=g), torch.randn(4, 2, 40, 16, generator=g), torch.randn(4, 2, 40, 16, generator=g)
    on_xla = eager_attention(*(t.to(backend.device) for t in (q, k, v))).cpu()
    refused = {}
    for kernel in ("flash", "splash"):
        try:
            build_attention(AttentionConfig(kernel=kernel), backend)
        except ConfigError as e:
            refused[kernel] = str(e)
    return {"max_abs_diff": (on_xla - eager_attention(q, k, v)).abs().max().item(),
            "auto": build_attention(AttentionConfig(), backend)[0], "refused": refused}


def train(job: str, state_dir: str, overrides) -> tuple[Trainer, XlaCounters, dict]:
    """Train the job, counting at each step boundary: the trainer, the counters, and the common report fields."""
    counters = XlaCounters()
    trainer = Trainer(load_spec(job, list(overrides)), Path(state_dir), counters)
    counters.flush = trainer.backend.flush
    code = trainer.run()
    steps = sorted(counters.at_step)
    from engine import events

    return trainer, counters, {"exit": code, "losses": [counters.losses[s] for s in sorted(counters.losses)],
                               "step_compilations": [e.compilations for e in counters.of(events.Step)],
                               "dropped": counters.dropped,
                               "compiles_at_step": [counters.at_step[s]["compiles"] for s in steps],
                               "counts_at_step": counters.at_step, "counts_at_end": counters.counts()}


def main(job: str, state_dir: str, *overrides: str) -> None:
    import torch_xla

    trainer, probe, report = train(job, state_dir, overrides)
    layer = trainer.model.layers[0]
    sharding = {name: torch_xla._XLAC._get_xla_sharding_spec(p) for name, p in
                [("wq", layer.attention.wq.weight), ("wo", layer.attention.wo.weight),
                 ("embedding", trainer.model.tok_embeddings.weight), ("norm", layer.attention_norm.weight),
                 *([("experts_w1", layer.moe.w1), ("experts_w2", layer.moe.w2)] if layer.sparse else [])]}
    import torch

    # The trained weights gathered to the host: what an export of the final checkpoint must hold.
    torch.save({n: p.detach().cpu() for n, p in trainer.model.named_parameters()}, Path(state_dir) / "final-params.pt")
    attention = attention_checks(trainer.backend)  # its graphs count in the cache figures too
    cache = {name: probe.met.counter_value(f"PersistentCache{name}") or 0
             for name in ("Hit", "Miss", "DeserializeFailure")}
    print(json.dumps({**report, "sharding": sharding, "attention": attention, "cache": cache,
                      "describe": trainer.backend.describe()}))


if __name__ == "__main__":
    main(*sys.argv[1:])

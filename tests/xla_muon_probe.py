"""Run under PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 by tests/test_xla_muon.py; prints one JSON line.

Trains the tiny job on the xla backend (SPMD over 4 virtual devices, FSDP-sharded weights)
with the optimizer named in the overrides (optimizer.name=muon) and reports the per-step
losses, the XLA compilations counted at each step boundary, the sharding of a few weights
and of their optimizer state after training, and any op that fell back to the CPU (torch_xla
counts those as aten::<op>). Also runs Newton-Schulz on a sharded rank-1 matrix, ours and
torch.optim.Muon's own, whose bf16 Frobenius norm torch_xla reduces in bf16.
"""

import json
import sys

from tests.xla_probe import train


def newton_schulz_checks(backend) -> dict:
    """A rank-1 +-1 matrix (Frobenius norm = spectral norm = 1024), sharded like a weight."""
    import torch
    import torch_xla.distributed.spmd as xs
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    from engine.optim.newton_schulz import newton_schulz

    g = torch.Generator().manual_seed(0)
    signs = [torch.randint(0, 2, (n, 1), generator=g).float() * 2 - 1 for n in (2048, 512)]
    x = (signs[0] @ signs[1].T).to(backend.device)
    xs.mark_sharding(x, backend.mesh, ("fsdp", "tensor"))
    ours = newton_schulz(x).cpu().float()
    theirs = _zeropower_via_newtonschulz(x, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7).cpu().float()
    return {"bf16_norm": x.bfloat16().norm().item(), "exact_norm": 1024.0,
            "ours_top_singular_value": torch.linalg.svdvals(ours)[0].item(),
            "torch_finite": bool(theirs.isfinite().all())}


def main(job: str, state_dir: str, *overrides: str) -> None:
    import torch_xla

    trainer, probe, report = train(job, state_dir, overrides)
    layer = trainer.model.layers[0]
    state = trainer.optimizer.state

    def sharding(t) -> str:
        return torch_xla._XLAC._get_xla_sharding_spec(t)

    weights = {"wq": layer.attention.wq.weight, "w2": layer.feed_forward.w2.weight,
               "embedding": trainer.model.tok_embeddings.weight, "norm": layer.attention_norm.weight}
    print(json.dumps({
        **report,
        "optimizer": type(trainer.optimizer).__name__,
        "sharding": {name: sharding(p) for name, p in weights.items()},
        "state_sharding": {name: {k: sharding(v) for k, v in state[p].items() if k != "step"}
                           for name, p in weights.items()},
        "cpu_fallbacks": {name: probe.met.counter_value(name) for name in probe.met.counter_names()
                          if name.startswith("aten::")},
        "newton_schulz": newton_schulz_checks(trainer.backend),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])

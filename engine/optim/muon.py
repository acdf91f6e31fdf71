"""Muon for the hidden matrices plus AdamW for everything else, as one torch.optim.Optimizer.

torch.optim.Muon (torch >= 2.9) takes 2-D parameters only and is meant for hidden layers;
embeddings, the output head, norms and biases need AdamW. The training loop and the
checkpointer see a single optimizer:

- `param_groups` is the Muon groups followed by the AdamW groups, the very dicts the two
  inner optimizers read, each tagged with group["optimizer"] = "muon" | "adamw". Setting
  group["lr"] (the schedule does, from group["base_lr"]) reaches the inner optimizer.
- `state` is one dict shared by both inner optimizers (keyed by parameter, disjoint sets).
- state_dict() / load_state_dict() / zero_grad() are torch.optim.Optimizer's own, over
  those groups and that state, so a checkpoint is one ordinary optimizer state dict (and
  torch.distributed.checkpoint's optimizer helpers work on it). Loading replaces the group
  dicts and the state dict; __setstate__ hands the new ones to the inner optimizers.
- step() runs Muon's step, then AdamW's.

Muon's update per matrix (torch/optim/_muon.py): buf = mu buf + (1 - mu) g; nesterov:
u = (1 - mu) g + mu buf, else u = buf; O = NS5(u) in bf16 (engine.optim.newton_schulz
computes the same); p = p (1 - lr wd) - lr s O with s = 0.2 sqrt(max(A, B))
("match_rms_adamw", then Muon shares AdamW's lr and weight decay) or sqrt(max(1, A/B))
("original", lr ~0.02).

torch.optim.Muon under torch_xla 2.9 SPMD traces (no .item(), no data-dependent branch),
but its Newton-Schulz has two problems there (tests/test_xla_muon.py):
- torch.addmm with beta/alpha != 1 has no XLA lowering: all 10 calls per matrix per step ran
  on the host CPU (aten::addmm fallback), cutting the steps into pieces (22 compilations in
  the first two steps, AdamW: 3) and leaving the momentum buffers replicated, not sharded.
- the bf16 Frobenius norm is reduced in bf16: 512 instead of 1024 for a sharded rank-1
  2048 x 512 matrix of +-1, so its spectral norm stays at 2 and the iteration overflows to
  inf/nan (low-rank gradients are common).
The workaround: while the Muon part steps on XLA tensors, torch.optim._muon's module-level
_zeropower_via_newtonschulz is swapped for engine.optim.newton_schulz (same arithmetic, but
an fp32 norm and plain matmuls and sums on XLA); nothing else of torch's Muon changes, and
the swap is undone after the step. On cpu and cuda torch's own function runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine.optim.newton_schulz import newton_schulz

KINDS = ("muon", "adamw")


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], *, muon: dict, adamw: dict):
        """`muon` and `adamw`: keyword arguments of torch.optim.Muon and torch.optim.AdamW,
        the defaults of their groups."""
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"Muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}")
        for kind, groups in zip(KINDS, (muon_groups, adamw_groups)):
            for group in groups:
                group["optimizer"] = kind
        self._inner = {"muon": torch.optim.Muon(muon_groups, **muon),
                       "adamw": torch.optim.AdamW(adamw_groups, **adamw)}
        # The base class adds the inner optimizers' group dicts themselves (add_param_group below).
        super().__init__([g for kind in KINDS for g in self._inner[kind].param_groups], defaults={})
        self._link()

    def add_param_group(self, param_group: dict) -> None:
        kind = param_group.get("optimizer")
        if kind not in KINDS:
            raise ValueError(f'a param group needs "optimizer": one of {KINDS}')
        inner = self._inner[kind]
        if not any(g is param_group for g in inner.param_groups):
            inner.add_param_group(param_group)  # fills in that optimizer's defaults
        super().add_param_group(param_group)

    def _link(self) -> None:
        for kind, inner in self._inner.items():
            inner.param_groups = [g for g in self.param_groups if g["optimizer"] == kind]
            inner.state = self.state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_inner" in self.__dict__:
            self._link()

    def load_state_dict(self, state_dict: dict) -> None:
        saved = [g.get("optimizer") for g in state_dict["param_groups"]]
        ours = [g["optimizer"] for g in self.param_groups]
        if saved != ours:
            raise ValueError(f"optimizer state has param groups {saved}, this optimizer {ours}")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = self._inner["muon"]
        on_xla = any(p.device.type == "xla" for g in muon.param_groups for p in g["params"])
        with xla_newton_schulz() if on_xla else contextlib.nullcontext():
            muon.step()
        self._inner["adamw"].step()
        return loss


def _zeropower(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
               eps: float) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz's signature and result (bf16)."""
    return newton_schulz(grad, ns_steps, ns_coefficients, torch.bfloat16, eps)


@contextlib.contextmanager
def xla_newton_schulz() -> Iterator[None]:
    """Have torch.optim.Muon orthogonalise with newton_schulz (no addmm fallback on XLA)."""
    import torch.optim._muon as impl

    original = getattr(impl, "_zeropower_via_newtonschulz", None)
    if original is None:
        raise RuntimeError(f"torch {torch.__version__}: torch.optim._muon has no _zeropower_via_newtonschulz "
                           "to replace; check whether its Newton-Schulz still needs the XLA workaround")
    impl._zeropower_via_newtonschulz = _zeropower
    try:
        yield
    finally:
        impl._zeropower_via_newtonschulz = original

"""The training state a checkpoint holds, as one tree of state dicts: gathered for a save, laid
out as a template for a load to fill, and applied to the model and optimizer after it.

The tree: model and optimizer (DCP's FQN-keyed state dicts, sharded under SPMD), the loop's
progress (step, micro-step, tokens seen), every RNG state, the data loader's geometry (its
position is a pure function of the step), and, when the save falls inside gradient
accumulation, the loss and gradients accumulated so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_flatten

from engine.backends.base import Backend
from engine.checkpoint import manifest as mf
from engine.models.moe import STATS

log = structlog.get_logger()


@dataclass
class Progress:
    """Where the loop stands: `micro_step` micro-batches of step `step` are accumulated."""

    step: int = 0
    micro_step: int = 0
    tokens_seen: int = 0
    loss_sum: torch.Tensor | None = None  # summed micro-batch losses of the current step ([loss, *STATS] with experts)


class TrainingState:
    def __init__(self, backend: Backend, model: nn.Module, optimizer: torch.optim.Optimizer, loader_state: dict,
                 *, every_step: bool):
        """every_step: the state is gathered every step or few (a memory tier), so its name lookups are cached."""
        self.backend, self.model, self.optimizer, self.loader_state = backend, model, optimizer, loader_state
        # The optimizer's parameter names (state_dicts); False: not cached.
        self._names: list[str] | bool | None = None if every_step else False
        self._create_optimizer_state()

    def _create_optimizer_state(self) -> None:
        """Create the optimizer's state now, exactly as its first step would.

        DCP's state-dict helper fills an empty optimizer's state with a zero-lr step, which
        also counts a step: a checkpoint taken before the first update would otherwise
        resume with a different step count, or hold no optimizer state at all. Doing it in
        every run, and resetting the counters, makes state creation part of the start. An
        optimizer that already has its state (kept through a change of the gang) keeps it.
        """
        if self.optimizer.state:
            return
        get_state_dict(self.model, self.optimizer)
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                state["step"] = 0

    def _state_dicts(self) -> tuple[dict, dict]:
        """get_state_dict's model and optimizer state dicts. With a memory tier they are taken every
        step, and get_state_dict's per-call name lookups cost more than a small model's step: after
        a first call that proves them equal, they come from the plain state dicts and its names."""
        if self._names is False:
            return get_state_dict(self.model, self.optimizer)
        if self._names is None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            by_id = {id(p): name for name, p in self.model.named_parameters()}
            names = [by_id.get(id(p)) for group in self.optimizer.param_groups for p in group["params"]]
            self._names = names if None not in names and _same((model_state, optim_state),
                                                               self._plain_state_dicts(names)) else False
            return model_state, optim_state
        return self._plain_state_dicts(self._names)

    def _plain_state_dicts(self, names: list[str]) -> tuple[dict, dict]:
        plain = self.optimizer.state_dict()  # keyed by the parameters' places in the groups
        return self.model.state_dict(), {
            "state": {names[i]: value for i, value in plain["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in plain["param_groups"]]}

    def gather(self, progress: Progress) -> dict:
        """The live state at `progress`: its tensors are the model's and optimizer's own."""
        model_state, optim_state = self._state_dicts()
        state = {
            "model": model_state,
            "optim": optim_state,
            "progress": {"step": progress.step, "micro_step": progress.micro_step,
                         "tokens_seen": progress.tokens_seen},
            "rng": self.backend.rng_state(),
            "loader": dict(self.loader_state),
        }
        if progress.micro_step:
            # Inside gradient accumulation: the partial gradients and loss are state too.
            state["partial"] = {"loss_sum": progress.loss_sum.detach(),
                                "grads": {n: p.grad for n, p in self.model.named_parameters()}}
        return state

    def template(self, manifest: mf.Manifest) -> dict:
        """A state of the manifest's shape for a load to fill: the live tensors, and fresh ones for
        a partial step's accumulated values."""
        # A mixture of experts sums its router statistics with the loss (engine.train); a model
        # without a config (bench/checkpoint.py's) is dense.
        moe = getattr(getattr(self.model, "cfg", None), "moe", None)
        shape = (1 + len(STATS),) if moe is not None else ()
        progress = Progress(step=manifest.step, micro_step=manifest.micro_step,
                            loss_sum=torch.zeros(shape, device=self.backend.device))
        self.gather(progress)  # creates the optimizer's state, to be laid out before loading into it
        grads = {n: torch.zeros_like(p) for n, p in self.model.named_parameters()} if manifest.micro_step else {}
        self.backend.shard_like_weights(self.model, self.optimizer, grads)
        template = self.gather(progress)
        if grads:
            template["partial"]["grads"] = grads
        return template

    def apply(self, template: dict, manifest: mf.Manifest) -> Progress:
        """Make a loaded state the live one: where the loop stands in it."""
        set_state_dict(self.model, self.optimizer, model_state_dict=template["model"],
                       optim_state_dict=template["optim"])
        self.backend.set_rng_state(template["rng"])
        if template["loader"] != self.loader_state:
            log.warning("data geometry changed since the checkpoint; batches will differ from the saved run",
                        saved=template["loader"], now=self.loader_state)
        progress = Progress(**template["progress"])
        saved = template["loader"]
        if manifest.micro_step and _geometry(saved) != _geometry(self.loader_state):
            # Its gradients were summed over micro-batches of another size and scaled by another count
            # (a micro-batch fitted smaller, another number of processes): the step is trained again
            # from its start, on the same weights (a partial step's update has not happened yet).
            unseen = progress.micro_step * saved["micro_batch_size"] * saved["world"] * (saved["window"] - 1)
            log.warning("a partial step saved with another micro-batch geometry: its accumulated gradients are "
                        "dropped and the step trained again from its start", step=progress.step,
                        micro_step=progress.micro_step, saved=_geometry(saved), now=_geometry(self.loader_state))
            return Progress(progress.step, 0, progress.tokens_seen - unseen)
        if manifest.micro_step:
            for name, param in self.model.named_parameters():
                param.grad = template["partial"]["grads"][name]
            progress.loss_sum = template["partial"]["loss_sum"]
        return progress


def _geometry(loader: dict) -> tuple:
    """What a partial step's accumulated values depend on: the micro-batch, the ranks, the schedule."""
    return loader.get("micro_batch_size"), loader.get("world"), loader.get("accum")


def _same(a: object, b: object) -> bool:
    """Whether two state trees have one structure, the same values, and tensors over the same memory."""
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if (x.shape, x.dtype, x.device) != (y.shape, y.dtype, y.device) or x.data_ptr() != y.data_ptr():
                return False
        elif x != y:
            return False
    return True


def nbytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return 0

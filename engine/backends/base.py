"""What the training loop needs from a device backend, and nothing more.

The loop never branches on the backend: placement, sharding, precision, graph
boundaries and reading metrics without stalling the device all live behind this class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from engine.requests import Action, Request

_ACTIONS = (Action.CHECKPOINT, Action.CHECKPOINT_AND_EXIT, Action.STOP)  # weakest first

# Peak dense bf16 FLOP/s per device, from the vendors' data sheets.
PEAK_FLOPS = {
    "v4": 275e12,
    "v5e": 197e12,
    "v5litepod": 197e12,
    "v5p": 459e12,
    "v6e": 918e12,
    "A100": 312e12,
    "H100": 989e12,
}


@dataclass
class DataPosition:
    """Which slice of the global batch this process loads."""

    rank: int = 0
    world: int = 1


class Backend:
    name: str
    device: torch.device
    # Kernels this backend can run, best first; the first is what `auto` picks.
    attention_kernels: tuple[str, ...]
    # Those of them that mask packed documents (data.document_mask) at their speed, best first.
    document_mask_kernels: tuple[str, ...]
    # Devices that share one training step (for MFU), and this process's data slice.
    num_devices: int = 1
    data: DataPosition = DataPosition()
    mesh = None
    bf16: bool = False
    # Whether one program's loss covers every process's slice of the batch (SPMD), rather than each
    # process's loss its own slice, their gradients then averaged (DDP, FSDP).
    global_loss: bool = False

    def autocast(self, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Place (and shard or wrap) the model; returns the module to call."""
        raise NotImplementedError

    def shard(self, model: nn.Module) -> None:
        """Shard the model while it is still on the meta device (before materialise), where the
        backend shards by module (FSDP2); a no-op elsewhere."""

    def compile(self, target: Callable) -> Callable:
        """`target` (a module, compiled in place, or a function) as this backend runs it best."""
        return target

    @torch.no_grad()
    def materialise(self, model: nn.Module, values: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Give a Transformer built on the meta device its weights on this backend's device, from
        (name, host tensor) pairs taken one at a time: the host never holds a second model."""
        model.to_empty(device=self.device)
        params = dict(model.named_parameters())
        for name, value in values:
            params.pop(name).copy_(value)
        require_all(params)
        model.reset_rotary(self.device)

    def host_ready(self, batch: torch.Tensor) -> torch.Tensor:
        """A host batch made ready to send, off the training thread (engine.data.prefetch)."""
        return batch

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def release(self, module: nn.Module) -> None:
        """Take off the model what prepare_model hung on it (a gang changing in place wraps it again)."""

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation for a micro-batch that is not the step's last."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients' global norm; the norm, as a plain tensor on the device."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    checkpoint_fn: Callable | None = None
    memory_tier = True  # whether its state can live in the memory tier (engine.checkpoint.memory)

    def micro_step_end(self) -> None:
        """Graph boundary after each micro-batch but a step's last (XLA cuts its graph here)."""

    def step_end(self) -> None:
        """Graph boundary after the optimizer step: XLA's step graph holds the last micro-batch too."""

    def read_values(self, tensors: list[torch.Tensor], callback: Callable[[list[list[float]]], None]) -> None:
        """Deliver each 1-D tensor's values to callback without stalling the device pipeline.

        The tensors must be outputs of a finished step (no pending computation).
        """
        callback([t.tolist() for t in tensors])

    # --- checkpointing ---

    _staging: tuple | None = None  # (tree structure, host buffers) kept between saves

    def stage(self, state: dict) -> dict:
        """A host copy of `state` that training can no longer change (async checkpoints).

        The host buffers are kept and reused while the state's structure and shapes stay
        the same: copying into memory already mapped is twice as fast as allocating it, and
        at most one save is in flight, so the previous one no longer reads them.
        """
        leaves, spec = tree_flatten(state)
        tensors = [_local(x.detach()) for x in leaves if isinstance(x, torch.Tensor)]
        layout = (spec, [(t.shape, t.dtype) for t in tensors])
        if self._staging is None or self._staging[0] != layout:
            self._staging = (layout, [self._host_buffer(t) for t in tensors])
        buffers = iter(self._staging[1])
        staged = [_staged(x, next(buffers)) if isinstance(x, torch.Tensor) else x for x in leaves]
        self._staging_done()
        return tree_unflatten(staged, spec)

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    def _staging_done(self) -> None:
        """Wait for non-blocking copies into the staging buffers (CUDA)."""

    def host_view(self, state: dict) -> dict:
        """What a synchronous save can write directly (training waits, so no copy is needed)."""
        return state

    def shard_like_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                           grads: dict[str, torch.Tensor]) -> None:
        """Lay out optimizer state and partial gradients (by parameter name) like their parameters
        (SPMD); nothing to do elsewhere."""

    def planners(self) -> tuple:
        """torch.distributed.checkpoint (save planner, load planner); None for the defaults."""
        return None, None

    checkpoint_group = None  # process group for checkpoint collectives; None in one process
    # Its own group: an async save's collectives run on the writer thread meanwhile.
    agreement_group = None
    # In a gang (engine.checkpoint.hosts), the groups a host's part of a checkpoint is written and
    # committed over, with several processes a host: its own processes, and one process of each
    # host holding the same part of the state (None: one process a host, which commits over the
    # checkpoint group).
    host_group = None
    replica_group = None
    replicas = 1  # copies of the whole state among the processes (data parallelism)
    # A gang's host runs this many processes, consecutive ranks that live, die and leave together.
    processes_per_host = 1

    def shard_of(self, rank: int) -> int:
        """Which part of the state process `rank` holds (0 where each holds all of it): the ranks
        holding the same part are the replicas of that part."""
        return 0

    def host_of(self, rank: int) -> int:
        """The unit process `rank` is quarantined or evicted with: its host in a gang."""
        return rank // self.processes_per_host

    def agree(self, request: Request | None) -> Request | None:
        """Every rank acts on the same request at the same boundary (docs/architecture.md,
        "The worker channel").

        A request may reach one rank only (a signal, one host's daemon); the strongest one
        any rank has is taken by all, through one tiny all-reduce on the checkpoint group.
        Without it, that rank alone would enter a checkpoint's collectives and hang.
        """
        if self.agreement_group is None:
            return request
        import torch.distributed as dist

        code = torch.tensor([0 if request is None else _ACTIONS.index(request.action) + 1])
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.agreement_group)
        return None if code.item() == 0 else Request(_ACTIONS[code.item() - 1], deadline_s=0.0)

    def smallest(self, value: int) -> int:
        """The smallest `value` of all ranks (one tiny all-reduce on the agreement group)."""
        return self._reduced(value, "MIN")

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        return bool(self._reduced(int(flag), "MAX"))

    def _reduced(self, value: int, op: str) -> int:
        if self.agreement_group is None:
            return value
        import torch.distributed as dist

        reduced = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(reduced, op=getattr(dist.ReduceOp, op), group=self.agreement_group)
        return int(reduced)

    def rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def flush(self) -> None:
        """Wait until every read_scalars callback has run."""

    def device_memory(self) -> dict[str, int] | None:
        """This process's device memory now: bytes `in_use` and `peak` (and `limit` where known);
        None where the runtime cannot tell (cpu; xla on the CPU runtime)."""
        return None

    def compilations(self) -> tuple[int, float] | None:
        """(graphs compiled by this process so far, the seconds they took); None when nothing compiles.
        A count that keeps growing after warm-up is a step whose graph changes: a recompile per step."""
        return None

    def memory_capacity(self) -> int | None:
        """The memory of one device in bytes, where the runtime can tell (it sizes loss.name auto)."""
        return None

    def peak_flops(self) -> float | None:
        return None

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device), "num_devices": self.num_devices}

    def close(self) -> None:
        pass


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of a tensor: a sharded (DTensor) one's local shard."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _staged(tensor: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    buffer.copy_(_local(tensor.detach()), non_blocking=True)
    if not isinstance(tensor, DTensor):
        return buffer
    # The host shard keeps its place in the whole, so the checkpoint writer saves it as a shard.
    return DTensor.from_local(buffer, tensor.device_mesh, tensor.placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def require_all(left: dict) -> None:
    if left:  # never train on uninitialised memory
        raise RuntimeError(f"no initial value for {', '.join(sorted(left))}")


def peak_flops_for(device_kind: str) -> float | None:
    for key, flops in PEAK_FLOPS.items():
        if key.lower() in device_kind.lower():
            return flops
    return None


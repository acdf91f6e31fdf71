"""cpu and cuda: PyTorch, optionally several processes under torch.distributed.

With more than one process (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR) over
gloo (cpu) or nccl (cuda), each rank loads its own slice of the global batch and the job's
mesh says how the model is spread, as under XLA: over an `fsdp` axis of more than one process,
FSDP2 (`fully_shard`) shards the parameters, gradients and optimizer state, each transformer
block a unit of its own and the rest (embeddings, final norm, head) in the root, with `data`
replicas of that (HSDP) when both axes exceed one; with fsdp 1 the model is replicated with
DistributedDataParallel. A sharded model is sharded on the meta device, before its weights
exist, so no device ever holds all of them, and checkpoints hold each rank's shards
(torch.distributed.checkpoint reshards them on a resume with another process count).

With device.compile each transformer block and the loss go through torch.compile: a block is
where the fusable elementwise work (norms, rotary, SwiGLU) lies, all blocks share one graph,
and a block compiles in seconds where the whole model would take minutes. Inductor's and
Triton's caches live under the job's state directory, so a restarted worker loads its kernels
instead of compiling them again.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from engine.backends.base import Backend, DataPosition, peak_flops_for, require_all
from engine.errors import ConfigError
from engine.spec.schema import MeshConfig


def _checkpoint(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


# Attention kernels per device type, best first: all, and those that mask packed documents at
# their speed. On CUDA sdpa takes a document mask only as a dense [B, 1, T, T] one, which rules
# out its flash kernel; flex keeps it.
KERNELS = {"cuda": (("sdpa", "flex", "eager"), ("flex", "eager")), "cpu": (("sdpa", "eager"), ("sdpa", "eager"))}


class TorchBackend(Backend):
    checkpoint_fn = staticmethod(_checkpoint)

    def __init__(self, device_type: str, peak_flops: float | None = None, compiling: bool = False,
                 cache_dir: str | None = None, mesh: MeshConfig | None = None, gang: bool = False,
                 deterministic: bool = False):
        self.name = device_type
        if deterministic:
            deterministic_kernels()
        self.compiling, self.gang = compiling, gang
        if compiling and cache_dir is not None:  # an operator's own setting wins
            if _inductor_cache_unset():
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
            os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir, "triton"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
            self.bf16 = torch.cuda.is_bf16_supported()
        else:
            self.device = torch.device("cpu")
        self.attention_kernels, self.document_mask_kernels = KERNELS[device_type]
        self.distributed = world > 1
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        # A gang's host runs LOCAL_WORLD_SIZE processes (device.processes_per_host), consecutive ranks.
        self.processes_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if gang else 1
        self.sizes = resolve_mesh(mesh or MeshConfig(), world, gang, self.processes_per_host)
        if self.distributed:
            # Checkpoints are written from a background thread: their collectives get a
            # group of their own so they never interleave with the training step's.
            self.checkpoint_group = dist.new_group(backend="gloo")
            self.agreement_group = dist.new_group(backend="gloo")
            if gang and self.processes_per_host > 1:
                self.host_group, self.replica_group = self._gang_groups(world)
        self.num_devices = world
        self.data = DataPosition(rank=dist.get_rank() if self.distributed else 0, world=world)
        self._peak_flops = peak_flops
        self.sharded = self.sizes["fsdp"] > 1
        self.replicas = self.sizes["data"]
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh

            # HSDP when there are replicas: the outer dimension replicates, the inner one shards.
            self.mesh = init_device_mesh(device_type, (self.sizes["data"], self.sizes["fsdp"]),
                                         mesh_dim_names=("data", "fsdp"))

    def _gang_groups(self, world: int) -> tuple:
        """(this host's processes, this process's peers of every host); new_subgroups_by_enumeration
        makes every group on every rank, as new_group must be called."""
        per = self.processes_per_host
        hosts = range(world // per)
        host, _ = dist.new_subgroups_by_enumeration([[h * per + i for i in range(per)] for h in hosts], backend="gloo")
        peers, _ = dist.new_subgroups_by_enumeration([[h * per + i for h in hosts] for i in range(per)], backend="gloo")
        return host, peers

    def shard_of(self, rank: int) -> int:
        return rank % self.sizes["fsdp"]  # the mesh is (data, fsdp): the fsdp coordinate varies fastest

    def shard(self, model: nn.Module) -> None:
        if not self.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.mesh if self.sizes["data"] > 1 else self.mesh["fsdp"]
        # A distillation teacher's blocks are gathered one at a time too; its embedding, norm and
        # head join the root's group with the student's (gathered for the whole forward and loss).
        teacher = getattr(model, "teacher", None)
        for block in [*model.model.layers, *(teacher.layers if teacher is not None else ())]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    @torch.no_grad()
    def materialise(self, model: nn.Module, values) -> None:
        if not self.sharded:
            return super().materialise(model, values)
        model.to_empty(device=self.device)
        params = dict(model.named_parameters())
        for name, value in values:
            param = params.pop(name)
            # Each rank cuts its own shard from the value it made (src_data_rank=None: no collective).
            param.copy_(distribute_tensor(value.to(self.device), param.device_mesh, param.placements,
                                          src_data_rank=None))
        require_all(params)
        model.reset_rotary(self.device)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if self.sharded:  # shard() made it FSDP's
            return model
        model = model.to(self.device)
        if self.distributed:
            # find_unused_parameters keeps DDP's first bucket layout for good. Without it DDP
            # regroups the buckets after a process's first step, and with three or more ranks
            # where an element sits in a bucket decides the order its sum is taken in: a gang
            # that restarted mid-run would round differently from one that never stopped.
            # broadcast_buffers off: the only buffers (RoPE's tables) are made alike on every rank
            # and never change, and the broadcast was a collective at the start of every forward.
            # A gang's hosts hold the same state by then (the same seed or commit, or a peer's live
            # state sent after this): rank 0 may be a host that has just joined with none.
            model = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                            find_unused_parameters=True, broadcast_buffers=False,
                                            init_sync=not self.gang)
        return model

    def release(self, module: nn.Module) -> None:
        if isinstance(module, DistributedDataParallel):
            module._remove_autograd_hooks()  # else the old reducer's hooks would still sum the gradients

    def compile(self, target):
        if not self.compiling:
            return target
        if isinstance(target, nn.Module):
            # The forward alone: its state_dict keys stay those of the eager module, and FSDP's
            # hooks around it (gathers, reduce-scatters) run eagerly rather than traced.
            target.forward = torch.compile(target.forward)
            return target
        return torch.compile(target)

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager:
        # FSDP reduce-scatters every micro-batch's gradients: each rank then accumulates its
        # shard only, which a partial-step checkpoint saves like the weights.
        return module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext()

    def clip_grad_norm(self, parameters, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm(parameters, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def host_ready(self, batch: torch.Tensor) -> torch.Tensor:
        # Pinned, the copy to the GPU runs asynchronously at full speed.
        return batch.pin_memory() if self.device.type == "cuda" else batch

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda" and batch.dim():  # a scalar stays a host number: a kernel argument
            return batch.pin_memory().to(self.device, non_blocking=True)  # pin_memory: a no-op when pinned
        return batch

    def read_values(self, tensors, callback) -> None:
        values = torch.stack(tensors)
        if self.distributed:  # report the global batch's mean, not one rank's share
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= dist.get_world_size()
        callback(values.tolist())

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        # Pinned memory on CUDA: device-to-host copies run at full speed and asynchronously.
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.device.type == "cuda")

    def _staging_done(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def describe(self) -> dict:
        described = {**super().describe(), "compile": self.compiling}
        if self.distributed:
            described["parallel"] = "fsdp" if self.sharded else "ddp"
            described["mesh"] = self.sizes
        return described

    def _device_module(self):
        """The device's own module (torch.cuda here), where it keeps memory statistics: another
        accelerator type that keeps the same ones reports them unchanged. None on cpu."""
        module = torch.get_device_module(self.device.type) if self.device.type != "cpu" else None
        return module if module is not None and hasattr(module, "memory_allocated") else None

    def device_memory(self) -> dict[str, int] | None:
        if (module := self._device_module()) is None:
            return None
        return {"in_use": module.memory_allocated(self.device), "peak": module.max_memory_allocated(self.device),
                "limit": module.get_device_properties(self.device).total_memory}

    def compilations(self) -> tuple[int, float] | None:
        if not self.compiling:
            return None
        try:  # dynamo's own bookkeeping: each graph compiled, and the time of each compilation
            from torch._dynamo.utils import compilation_time_metrics, counters

            return (int(counters["stats"]["unique_graphs"]),
                    float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))))
        except (ImportError, AttributeError, TypeError):  # another torch's internals
            return None

    def memory_capacity(self) -> int | None:
        if (module := self._device_module()) is None:
            return None
        # The smallest device of all ranks: every rank must size the loss alike (ce or chunked
        # round differently, which replicas on GPUs of two sizes would take for corruption).
        return self.smallest(module.get_device_properties(self.device).total_memory)

    def peak_flops(self) -> float | None:
        if self._peak_flops or self.device.type != "cuda":
            return self._peak_flops  # no meaningful peak for a CPU
        return peak_flops_for(torch.cuda.get_device_name(self.device))

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _inductor_cache_unset() -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR is nobody's choice: torch 2.15 sets it to its default (a
    directory under /tmp) when torch._dynamo is imported, which a fork server has done already."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir())


def deterministic_kernels() -> None:
    """Every kernel bitwise reproducible (device.deterministic): torch refuses or replaces the ones
    that are not (atomic scatter-adds, some attention backwards), and cuBLAS gets the fixed
    workspace it needs to pick the same reduction order on every call. Its variable is read when
    the first cuBLAS handle is made, which is after this: the worker has run no matmul yet."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def resolve_mesh(mesh: MeshConfig, world: int, gang: bool = False, per_host: int = 1) -> dict[str, int]:
    """The mesh's axis sizes over `world` processes; tensor parallelism is XLA's alone.

    The hosts of a gang are data replicas: each host checkpoints a whole state of its own, which
    is what lets any host restore alone (from its disk, a peer's memory, or GCS) and the gang
    resume on another number of hosts. A host's `per_host` processes shard its state (fsdp -1,
    the default) or replicate it too (fsdp 1).
    """
    if gang:
        if mesh.fsdp not in (-1, 1, per_host) or mesh.tensor > 1 or mesh.expert > 1:
            raise ConfigError("device.mesh", "on cpu and cuda the hosts of a gang are data replicas (each host "
                              f"checkpoints a whole state), sharded over a host's {per_host} process(es) "
                              "(device.processes_per_host): leave fsdp at -1 (or 1 to replicate), tensor and "
                              "expert at 1")
        fsdp = per_host if mesh.fsdp == -1 else mesh.fsdp
        return {"data": world // fsdp, "expert": 1, "fsdp": fsdp, "tensor": 1}
    try:
        sizes = mesh.resolve(world)
    except ValueError as e:
        raise ConfigError("device.mesh", f"{e} (processes)") from e
    for axis, what in (("tensor", "tensor parallelism"), ("expert", "expert parallelism")):
        if sizes[axis] != 1:
            raise ConfigError(f"device.mesh.{axis}", f"{what} runs under xla only; on cpu and cuda the mesh "
                              "has data and fsdp axes")
    return sizes

"""cpu and cuda: PyTorch, optionally several processes under torch.distributed.

With more than one process (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR)
the model is wrapped in DistributedDataParallel over gloo (cpu) or nccl (cuda), and each
rank loads its own slice of the global batch.

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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from engine.backends.base import Backend, DataPosition, peak_flops_for


def _checkpoint(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


class TorchBackend(Backend):
    checkpoint_fn = staticmethod(_checkpoint)

    def __init__(self, device_type: str, peak_flops: float | None = None, compiling: bool = False,
                 cache_dir: str | None = None):
        self.name = device_type
        self.compiling = compiling
        if compiling and cache_dir is not None:  # an operator's own setting wins
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, "inductor"))
            os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir, "triton"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
            self.attention_kernels = ("sdpa", "eager")
            self.bf16 = torch.cuda.is_bf16_supported()
        else:
            self.device = torch.device("cpu")
            self.attention_kernels = ("sdpa", "eager")
        self.distributed = world > 1
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        if self.distributed:
            # Checkpoints are written from a background thread: their collectives get a
            # group of their own so they never interleave with the training step's.
            self.checkpoint_group = dist.new_group(backend="gloo")
            self.agreement_group = dist.new_group(backend="gloo")
        self.num_devices = world
        self.data = DataPosition(rank=dist.get_rank() if self.distributed else 0, world=world)
        self._peak_flops = peak_flops

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.distributed:
            # find_unused_parameters keeps DDP's first bucket layout for good. Without it DDP
            # regroups the buckets after a process's first step, and with three or more ranks
            # where an element sits in a bucket decides the order its sum is taken in: a gang
            # that restarted mid-run would round differently from one that never stopped.
            model = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                            find_unused_parameters=True)
        return model

    def compile(self, target):
        if not self.compiling:
            return target
        if isinstance(target, nn.Module):
            target.compile()  # in place: its state_dict keys stay those of the eager module
            return target
        return torch.compile(target)

    def no_sync(self, module: nn.Module) -> contextlib.AbstractContextManager:
        return module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext()

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return batch.pin_memory().to(self.device, non_blocking=True)
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
        return {**super().describe(), "compile": self.compiling}

    def memory_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def peak_flops(self) -> float | None:
        if self._peak_flops or self.device.type != "cuda":
            return self._peak_flops  # no meaningful peak for a CPU
        return peak_flops_for(torch.cuda.get_device_name(self.device))

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

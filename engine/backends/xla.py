"""torch_xla SPMD: one process per host drives every local device through one sharded graph.

Parameters are sharded FSDP-style over the `fsdp` mesh axis (and Megatron-style over
`tensor`; a mixture of experts' 3-D expert weights also by expert over `expert`), batches are
sharded over (data, expert, fsdp) as they enter the device, and XLA's compiler inserts the
collectives (for experts split over `expert`, the all-to-alls of the token dispatch). torch_xla is imported here only, so the rest of the
engine runs where it is not installed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch
from torch import nn

from engine.backends.base import Backend, DataPosition, require_all, peak_flops_for
from engine.side_threads import side_thread
from engine.spec.schema import DeviceConfig

# Output-dim-sharded ("column-parallel") weights get (tensor, fsdp); input-dim-sharded
# ("row-parallel") ones get (fsdp, tensor), so a tensor-parallel block needs one reduction.
_ROW_PARALLEL = ("wo", "w2")
BATCH_AXES = ("data", "expert", "fsdp")


def row_parallel(module: str) -> bool:
    return module.endswith(_ROW_PARALLEL)


def weight_partition(name: str, param: torch.Tensor) -> tuple | None:
    """The partition spec of one parameter; None leaves it replicated (norms). An expert tensor
    [experts, out, in] is split by expert over `expert` and each expert's matrix like a dense one's."""
    if param.dim() == 3:
        return ("expert",) + weight_partition(name, param[0])
    if param.dim() != 2:
        return None
    return ("fsdp", "tensor") if row_parallel(name.removesuffix(".weight")) else ("tensor", "fsdp")


class XlaBackend(Backend):
    name = "xla"
    global_loss = True
    memory_tier = False  # sharded state: its shards would need the SPMD planners the disk tier uses

    def __init__(self, cfg: DeviceConfig, cache_dir: str | None):
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        # The cache must be set up before the first computation and before use_spmd.
        if cache_dir:
            os.makedirs(cache_dir, exist_ok=True)
            xr.initialize_cache(cache_dir, readonly=False)
        xr.use_spmd()
        self._xs, self._xr = xs, xr
        n = xr.global_runtime_device_count()
        sizes = cfg.mesh.resolve(n)
        self.mesh = xs.Mesh(np.arange(n), tuple(sizes.values()), tuple(sizes))
        xs.set_global_mesh(self.mesh)
        self.device = torch_xla.device()
        self.num_devices = n
        # Under SPMD each host loads its own part of the global batch.
        self.data = DataPosition(rank=xr.process_index(), world=xr.process_count())
        if xr.process_count() > 1:
            # Hosts coordinate checkpoints over gloo, rendezvousing through the XLA runtime.
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method="xla://")
            self.checkpoint_group = dist.new_group(backend="gloo")
            self.agreement_group = dist.new_group(backend="gloo")
        self.device_kind = self._tpu_type()
        self.attention_kernels = ("splash", "flash", "eager") if self.device_kind else ("eager",)
        self.document_mask_kernels = self.attention_kernels  # the Pallas kernels take segment ids
        self.bf16 = True
        self._peak_flops = cfg.peak_flops
        self._input_sharding = xs.ShardingSpec(self.mesh, (BATCH_AXES, None), minibatch=True)
        self._reader = side_thread("xla-metrics")
        self._reads: list[Future] = []

    @staticmethod
    def _tpu_type() -> str | None:
        """'v5p', 'v6e', ... on a TPU host; None on PJRT_DEVICE=CPU."""
        if os.environ.get("PJRT_DEVICE", "TPU").upper() != "TPU":
            return None
        from torch_xla._internal import tpu

        try:
            return tpu.get_tpu_type()
        except (OSError, KeyError):
            return None

    def prepare_model(self, model: nn.Module) -> nn.Module:
        import torch_xla

        model = model.to(self.device)
        for name, param in model.named_parameters():
            spec = weight_partition(name, param)
            if spec is None:
                continue
            if not torch_xla._XLAC._get_xla_sharding_spec(param):  # materialise() placed it
                self._xs.mark_sharding(param, self.mesh, spec)
            # Each gradient laid out like its weight, as it is accumulated: XLA then reduce-scatters
            # it (FSDP) instead of all-reducing the whole gradient onto every device and slicing it.
            param.register_post_accumulate_grad_hook(functools.partial(self._shard_grad, spec=spec))
        # Each projection's output sharded over the batch (its features over the tensor axis, but
        # a row-parallel one's): left to itself, GSPMD's propagation may keep the weight's
        # sharding instead and move activations (all-gathers of the whole batch's, all-to-alls)
        # where FSDP gathers the weight; the gradients flowing back are pinned alike.
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                features = None if row_parallel(name) else "tensor"
                module.register_forward_hook(functools.partial(self._shard_activation, features=features))
        return model

    def _shard_activation(self, module: nn.Module, inputs: tuple, output: torch.Tensor, features: str | None):
        spec = (BATCH_AXES,) + (None,) * (output.dim() - 2) + (features,)
        return self._xs.mark_sharding_with_gradients(output, self.mesh, spec)

    def _shard_grad(self, param: torch.Tensor, spec: tuple) -> None:
        self._xs.mark_sharding(param.grad, self.mesh, spec)

    @torch.no_grad()
    def materialise(self, model: nn.Module, values) -> None:
        # One tensor at a time is sent and sharded at once: beyond the sharded model, a device holds
        # at most one whole weight, never the whole replicated model.
        params = dict(model.named_parameters())
        for name, value in values:
            params.pop(name)
            on_device = value.to(self.device)
            spec = weight_partition(name, value)
            if spec is not None:
                self._xs.mark_sharding(on_device, self.mesh, spec)
            module, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module), leaf, nn.Parameter(on_device))
        require_all(params)
        model.reset_rotary(self.device)

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        if not batch.dim():  # a scalar (a loss weight) is device data, not a constant: one graph for every value
            return batch.to(self.device)
        (on_device,) = xm.send_cpu_data_to_device([batch], self.device, input_sharding=self._input_sharding)
        return on_device

    @property
    def checkpoint_fn(self) -> Callable:
        # torch_xla's variant keeps XLA's CSE from folding the recomputation away. It has only the
        # reentrant implementation (use_reentrant=False raises).
        from torch_xla.utils.checkpoint import checkpoint

        return lambda fn, *args: checkpoint(fn, *args, use_reentrant=True)

    def micro_step_end(self) -> None:
        import torch_xla

        torch_xla.sync()

    step_end = micro_step_end

    def read_values(self, tensors, callback) -> None:
        # The tensors are outputs of graphs already launched by step_end(). The side thread
        # only copies device data to the host: any tensor op there would build a second
        # lazy graph concurrently with the training thread's, which torch_xla does not allow.
        def read() -> None:
            callback([t.cpu().tolist() for t in tensors])

        self._reads = [r for r in self._reads if not r.done() or r.result()]  # surfaces failures early
        self._reads.append(self._reader.submit(read))

    def flush(self) -> None:
        reads, self._reads = self._reads, []
        for read in reads:
            read.result()  # re-raises a failed read here, on the training thread

    def stage(self, state: dict) -> dict:
        # Each device's shard goes to the host as it is, never gathered into a whole tensor.
        import torch_xla.core.xla_model as xm
        from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

        # Shard handles are placeholders while the step that fills them still runs
        # asynchronously; reading them then fails ("async operation is in flight").
        xm.wait_device_ops()
        return _sharded_cpu_state_dict(state)

    def shard_like_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                           grads: dict[str, torch.Tensor]) -> None:
        """Give each parameter-shaped optimizer state tensor, and each partial gradient, its
        parameter's sharding.

        Fresh tensors (the template a checkpoint is loaded into) start replicated; left so,
        every device would hold them whole and the next step would compile new graphs for
        the new input shardings.
        """
        for name, param in model.named_parameters():
            spec = weight_partition(name, param)
            if spec is None:
                continue
            state = [v for v in optimizer.state.get(param, {}).values()
                     if isinstance(v, torch.Tensor) and v.shape == param.shape]
            for value in state + ([grads[name]] if name in grads else []):
                self._xs.mark_sharding(value, self.mesh, spec)

    def host_view(self, state: dict) -> dict:
        return self.stage(state)  # device shards must reach the host either way

    def planners(self) -> tuple:
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

        return SPMDSavePlanner(), SPMDLoadPlanner()

    def rng_state(self) -> dict:
        import torch_xla.core.xla_model as xm

        # An unsigned 64-bit seed: kept as a Python int (DCP pickles it), not an int64 tensor.
        return {**super().rng_state(), "xla": int(xm.get_rng_state())}

    def set_rng_state(self, state: dict) -> None:
        import torch_xla.core.xla_model as xm

        super().set_rng_state(state)
        xm.set_rng_state(int(state["xla"]))

    def peak_flops(self) -> float | None:
        if self._peak_flops:
            return self._peak_flops
        return peak_flops_for(self.device_kind) if self.device_kind else None

    def device_memory(self) -> dict[str, int] | None:
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(self.device)
        except RuntimeError:  # the CPU runtime keeps no allocator statistics
            return None
        used = info.get("bytes_used")
        if used is None:
            return None
        return {"in_use": int(used), "peak": int(info.get("peak_bytes_used", used)),
                **({"limit": int(info["bytes_limit"])} if info.get("bytes_limit") else {})}

    def compilations(self) -> tuple[int, float] | None:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")  # (count, total nanoseconds, samples); None before the first
        return (0, 0.0) if not data else (int(data[0]), float(data[1]) / 1e9)

    def describe(self) -> dict:
        return {**super().describe(), "mesh": dict(zip(self.mesh.axis_names, self.mesh.mesh_shape)),
                "device_kind": self.device_kind or "cpu"}

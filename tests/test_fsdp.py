"""FSDP2 on the torch backends, in this process: sharded (DTensor) weights train like plain ones.

A one-process gloo group is enough for the arithmetic: fully_shard over a mesh of one rank makes
every parameter, gradient and optimizer state a DTensor, so each optimizer's step and the
backend's gradient clipping run through DTensor's dispatch as on many ranks. What several
processes add (collectives, resharding checkpoints) is tested in tests/test_distributed.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.attention.sdpa import sdpa_attention
from engine.backends.torch_native import TorchBackend, resolve_mesh
from engine.errors import ConfigError
from engine.models.llama import Transformer, initial_values
from engine.optim import build_optimizer
from engine.spec.schema import MeshConfig


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class ShardedBackend(TorchBackend):
    """The cpu backend with an fsdp axis, though this process is alone in its group."""

    def __init__(self):
        super().__init__("cpu")
        from torch.distributed.device_mesh import init_device_mesh

        self.sizes, self.sharded = {"data": 1, "fsdp": 1, "tensor": 1}, True
        self.mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data", "fsdp"))


class Wrapper(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model.logits(self.model(tokens)).float().square().mean()


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "muon"])
def test_sharded_weights_step_like_plain_ones(one_rank_group, tiny_spec, optimizer):
    spec = tiny_spec(f"optimizer.name={optimizer}", "train.grad_clip=0.5")
    with torch.device("meta"):
        lazy = Transformer(spec.model, sdpa_attention)
    plain, sharded = copy.deepcopy(lazy), Wrapper(copy.deepcopy(lazy))
    TorchBackend("cpu").materialise(plain, initial_values(plain, torch.Generator().manual_seed(3)))
    backend = ShardedBackend()
    backend.shard(sharded)
    backend.materialise(sharded.model, initial_values(sharded.model, torch.Generator().manual_seed(3)))
    assert all(isinstance(p, DTensor) for p in sharded.parameters())

    tokens = torch.randint(0, spec.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    norms = []
    for model, module in ((plain, Wrapper(plain)), (sharded.model, sharded)):
        opt = build_optimizer(spec.optimizer, model, torch.device("cpu"))
        for _ in range(2):
            module(tokens).backward()
            norm = backend.clip_grad_norm(model.parameters(), spec.train.grad_clip)
            norms.append(norm)
            opt.step()
            opt.zero_grad()
    assert all(type(n) is torch.Tensor for n in norms)  # a plain number to log, not a DTensor
    assert torch.stack(norms[2:]).tolist() == pytest.approx(torch.stack(norms[:2]).tolist(), rel=1e-5)
    for (name, a), b in zip(plain.named_parameters(), sharded.model.parameters()):
        torch.testing.assert_close(b.full_tensor(), a, rtol=1e-5, atol=1e-6, msg=name)


def test_the_mesh_over_processes():
    one = {"expert": 1, "tensor": 1}
    assert resolve_mesh(MeshConfig(), 4) == {"data": 1, "fsdp": 4, **one}
    assert resolve_mesh(MeshConfig(data=2), 4) == {"data": 2, "fsdp": 2, **one}
    assert resolve_mesh(MeshConfig(data=-1, fsdp=1), 4) == {"data": 4, "fsdp": 1, **one}
    with pytest.raises(ConfigError, match="tensor parallelism runs under xla only"):
        resolve_mesh(MeshConfig(tensor=2), 4)
    with pytest.raises(ConfigError, match="expert parallelism runs under xla only"):
        resolve_mesh(MeshConfig(expert=2), 4)
    with pytest.raises(ConfigError, match="does not divide 4 devices"):
        resolve_mesh(MeshConfig(fsdp=3), 4)
    # A gang's hosts are replicas, whatever the default mesh says; sharding across them is refused.
    assert resolve_mesh(MeshConfig(), 3, gang=True) == {"data": 3, "fsdp": 1, **one}
    with pytest.raises(ConfigError, match="hosts of a gang are data replicas"):
        resolve_mesh(MeshConfig(fsdp=3), 3, gang=True)


def test_device_deterministic_turns_on_reproducible_kernels(monkeypatch):
    from engine.backends import build_backend
    from engine.spec.schema import DeviceConfig

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        build_backend(DeviceConfig(backend="cpu"))
        assert not torch.are_deterministic_algorithms_enabled()
        build_backend(DeviceConfig(backend="cpu", deterministic=True))
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # read when cuBLAS makes its first handle
    finally:
        torch.use_deterministic_algorithms(False)


def test_an_xla_job_on_a_torch_its_torch_xla_was_not_built_for_is_refused_by_versions():
    from engine.backends import require_matching_torch

    require_matching_torch("2.9.1+cu128", xla="2.9.0")
    with pytest.raises(ConfigError) as refused:
        require_matching_torch("2.15.0+cu130", xla="2.9.0")
    assert refused.value.key == "device.backend" and "runs on torch 2.9.x, this is torch 2.15.0+cu130" in str(refused.value)


def _capacity_of_rank(rank: int, rendezvous: str, results) -> None:
    from types import SimpleNamespace

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        backend = TorchBackend("cpu")
        backend.distributed, backend.agreement_group = True, dist.new_group(backend="gloo")
        gib = (40 if rank == 0 else 80) << 30  # a gang of an A100 40GB and an 80GB one
        backend._device_module = lambda: SimpleNamespace(get_device_properties=lambda device: SimpleNamespace(
            total_memory=gib))
        results[rank] = backend.memory_capacity()
    finally:
        dist.destroy_process_group()


def test_every_rank_sizes_the_loss_by_the_smallest_device(tmp_path):
    """loss.name auto picks by device memory: ranks on GPUs of two sizes must pick alike, or their
    replicas round differently and a replica check names one of them corrupt."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_capacity_of_rank, args=(str(tmp_path / "rendezvous"), results), nprocs=2)
    assert dict(results) == {0: 40 << 30, 1: 40 << 30}

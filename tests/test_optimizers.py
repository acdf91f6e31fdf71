"""Lion, Muon (+ AdamW for the rest) and the Newton-Schulz iteration; fast, CPU."""

import io
import math

import pytest
import torch

from engine.attention.sdpa import sdpa_attention
from engine.spec.schema import ModelConfig, OptimizerConfig
from engine.models.llama import Transformer
from engine.optim import build_optimizer
from engine.optim.lion import Lion
from engine.optim.muon import MuonWithAdamW
from engine.optim.newton_schulz import newton_schulz

CPU = torch.device("cpu")
NAMES = ("adamw", "lion", "muon")
HIDDEN = [f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")] + [
    f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]


def tiny_model(tie: bool = True, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, tie_embeddings=tie)
    return Transformer(cfg, sdpa_attention)


def loss_of(model: Transformer, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1000 + step))
    logits = model.logits(model(tokens[:, :-1]))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train_step(model, optimizer, step: int, factor: float = 1.0) -> None:
    """What the training loop does around the optimizer in one step (engine/train.py)."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    loss_of(model, step).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def config(name: str, **kw) -> OptimizerConfig:
    return OptimizerConfig(name=name, lr=2e-3, weight_decay=0.1, **kw)


# ---------------------------------------------------------------- Lion


def test_one_lion_step_equals_the_formula_by_hand():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 7, generator=g).requires_grad_(), torch.randn(7, generator=g).requires_grad_()]
    lr, (b1, b2), wd = 3e-3, (0.8, 0.97), 0.25
    opt = Lion([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=lr, betas=(b1, b2),
               weight_decay=wd)
    p = [x.detach().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    for _ in range(3):  # from the second step on, the momentum is not zero
        grads = [torch.randn(x.shape, generator=g) for x in p]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        opt.step()
        for i, (decay, grad) in enumerate(zip((wd, 0.0), grads)):
            update = torch.sign(b1 * m[i] + (1 - b1) * grad)
            p[i] = p[i] * (1 - lr * decay) - lr * update
            m[i] = b2 * m[i] + (1 - b2) * grad
        for i, param in enumerate(params):
            assert torch.equal(param.detach(), p[i])
            assert torch.equal(opt.state[param]["exp_avg"], m[i])


def test_lion_defaults_derive_from_adamw_and_decay_skips_norms_and_embeddings():
    cfg = OptimizerConfig(name="lion", lr=3e-3, weight_decay=0.1)
    opt = build_optimizer(cfg, tiny_model(tie=False), CPU)
    assert isinstance(opt, Lion)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3, 1e-3])  # 3x smaller
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.3, 0.0])  # 3x larger
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    explicit = OptimizerConfig(name="lion", lion={"lr": 1e-4, "weight_decay": 1.0, "betas": (0.95, 0.98)})
    opt = build_optimizer(explicit, tiny_model(), CPU)
    assert opt.param_groups[0]["lr"] == 1e-4 and opt.param_groups[0]["weight_decay"] == 1.0
    assert opt.param_groups[0]["betas"] == (0.95, 0.98)


# ---------------------------------------------------------------- Muon routing


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_muon_takes_every_hidden_matrix_and_adamw_the_rest(tie):
    model = tiny_model(tie)
    opt = build_optimizer(config("muon"), model, CPU)
    assert isinstance(opt, MuonWithAdamW) and isinstance(opt, torch.optim.Optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    by_kind = {"muon": set(), "adamw-decay": set(), "adamw-no-decay": set()}
    for group in opt.param_groups:
        kind = group["optimizer"] if group["optimizer"] == "muon" else (
            "adamw-decay" if group["weight_decay"] else "adamw-no-decay")
        by_kind[kind] |= {names[id(p)] for p in group["params"]}
    assert by_kind["muon"] == {f"layers.{i}.{w}" for i in range(2) for w in HIDDEN}
    head = set() if tie else {"output.weight"}
    assert by_kind["adamw-decay"] == head  # the untied head: 2-D, decayed, but AdamW's
    norms = {f"layers.{i}.{n}_norm.weight" for i in range(2) for n in ("attention", "ffn")} | {"norm.weight"}
    assert by_kind["adamw-no-decay"] == norms | {"tok_embeddings.weight"}
    counts = sum(len(g["params"]) for g in opt.param_groups)
    assert counts == len(names) == len(set().union(*by_kind.values()))  # each parameter exactly once
    # The inner optimizers hold the very same group dicts.
    assert opt._inner["muon"].param_groups[0] is opt.param_groups[0]
    assert isinstance(opt._inner["muon"], torch.optim.Muon) and isinstance(opt._inner["adamw"], torch.optim.AdamW)


def test_muon_hyperparameters_reach_both_parts():
    cfg = config("muon", betas=(0.8, 0.9), muon={"momentum": 0.9, "nesterov": False, "ns_steps": 3})
    groups = build_optimizer(cfg, tiny_model(), CPU).param_groups
    muon, adamw = groups[0], groups[1]
    assert (muon["lr"], muon["weight_decay"], muon["adjust_lr_fn"]) == (2e-3, 0.1, "match_rms_adamw")
    assert (muon["momentum"], muon["nesterov"], muon["ns_steps"]) == (0.9, False, 3)
    assert (adamw["lr"], adamw["betas"], adamw["fused"]) == (2e-3, (0.8, 0.9), True)
    original = config("muon", muon={"adjust_lr_fn": "original", "lr": 0.02, "weight_decay": 0.0})
    muon = build_optimizer(original, tiny_model(), CPU).param_groups[0]
    assert (muon["lr"], muon["base_lr"], muon["weight_decay"], muon["adjust_lr_fn"]) == (0.02, 0.02, 0.0, "original")
    with pytest.raises(ValueError, match="original needs an explicit lr"):
        config("muon", muon={"adjust_lr_fn": "original"})


# ---------------------------------------------------------------- checkpoints and the schedule


def snapshot(model, opt) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for p in model.parameters() for v in opt.state[p].values() if torch.is_tensor(v)]
    return params, state


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", NAMES)
def test_save_load_then_next_steps_equal_never_having_saved(name, tie):
    factors = [0.3, 0.6, 1.0, 0.8, 0.5]  # a schedule: resuming must restore every group's lr too
    model = tiny_model(tie)
    opt = build_optimizer(config(name), model, CPU)
    for step in range(3):
        train_step(model, opt, step, factors[step])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    for step in range(3, 5):
        train_step(model, opt, step, factors[step])
    expected = snapshot(model, opt)

    fresh = tiny_model(tie, seed=123)  # other weights: the checkpoint must overwrite them
    fresh_opt = build_optimizer(config(name), fresh, CPU)
    buf.seek(0)
    saved = torch.load(buf)  # weights_only: the state dict holds only tensors and plain values
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optimizer"])
    assert [g["lr"] for g in fresh_opt.param_groups] == pytest.approx([g["base_lr"] * 1.0 for g in opt.param_groups])
    for step in range(3, 5):
        train_step(fresh, fresh_opt, step, factors[step])
    params, state = snapshot(fresh, fresh_opt)
    assert len(state) == len(expected[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(params, expected[0]))
    assert all(torch.equal(a, b) for a, b in zip(state, expected[1]))


def test_muon_refuses_a_checkpoint_with_other_groups():
    opt = build_optimizer(config("muon"), tiny_model(tie=False), CPU)
    other = build_optimizer(config("muon"), tiny_model(tie=True), CPU)  # no decayed AdamW group
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_the_schedule_scales_every_groups_own_base_lr(name):
    cfg = config(name, muon={"lr": 5e-3}, lion={"lr": 7e-4})
    model = tiny_model(tie=False)
    opt = build_optimizer(cfg, model, CPU)
    expected = {"adamw": [2e-3] * 2, "lion": [7e-4] * 2, "muon": [5e-3, 2e-3, 2e-3]}[name]
    assert [g["base_lr"] for g in opt.param_groups] == pytest.approx(expected)
    train_step(model, opt, 0, factor=1.0)  # momentum state exists from here on
    # The factor reaches the optimizer that does the work: at 0 nothing may move (decay
    # is lr x wd, so it stops too), at 0.5 every group steps with half its own peak lr.
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt, 1, factor=0.0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for step in (2, 3):
        train_step(model, opt, step, factor=0.5)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5 * x for x in expected])
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    if name == "muon":
        inner = [g["lr"] for o in opt._inner.values() for g in o.param_groups]
        assert inner == pytest.approx([0.5 * x for x in expected])


@pytest.mark.parametrize("name", NAMES)
def test_each_optimizer_lowers_the_loss(name):
    model = tiny_model()
    opt = build_optimizer(OptimizerConfig(name=name, lr=3e-3), model, CPU)
    first = loss_of(model, 0).item()
    for _ in range(30):
        train_step(model, opt, 0)  # one fixed batch: the loss must drop well below its start
    assert loss_of(model, 0).item() < first - 0.5


# ---------------------------------------------------------------- Newton-Schulz


def with_singular_values(m: int, n: int, s: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, len(s), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, len(s), generator=g, dtype=torch.float64))
    return (u * s) @ v.T


def ns_matrices():
    """Gaussian (tall, wide; singular values >= 1.6e-2 x the Frobenius norm) and ill-conditioned (cond 10, 100)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 256), (256, 64), (128, 384), (384, 128), (128, 192)]:
        yield f"gauss{shape}", torch.randn(*shape, generator=g, dtype=torch.float64)
    for i, (shape, cond) in enumerate([((128, 256), 10), ((256, 128), 100), ((128, 128), 100)]):
        k = min(shape)
        s = torch.logspace(0, -math.log10(cond), k, dtype=torch.float64)
        yield f"cond{cond}{shape}", with_singular_values(*shape, s, i)


BAND = (0.65, 1.25)  # measured [0.679, 1.203] over these matrices, bf16 and fp32, 5 steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_maps_singular_values_into_a_band_and_keeps_the_singular_vectors(dtype):
    for name, g in ns_matrices():
        out = newton_schulz(g, steps=5, dtype=dtype)
        assert out.dtype == dtype and out.shape == g.shape
        s = torch.linalg.svdvals(out.double())
        assert BAND[0] <= s.min() and s.max() <= BAND[1], (name, s.min().item(), s.max().item())
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        exact = u @ vh
        cosine = (out.double() * exact).sum() / (out.double().norm() * exact.norm())
        assert cosine > 0.98, (name, cosine.item())  # measured >= 0.982
        # In G's singular basis the result is (nearly) diagonal: same singular vectors.
        inner = u.T @ out.double() @ vh.T
        off_diagonal = inner - torch.diag(torch.diagonal(inner))
        assert off_diagonal.norm() / inner.norm() < (0.03 if dtype == torch.bfloat16 else 1e-4), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_on_an_ill_conditioned_matrix_lifts_small_singular_values(dtype):
    s = torch.logspace(0, -3, 128, dtype=torch.float64)  # cond 1000
    g = with_singular_values(128, 256, s, seed=7)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    mapped = torch.diagonal(u.T @ newton_schulz(g, dtype=dtype).double() @ vh.T)  # p(s_i), in s order
    relative = s / s.norm()  # what the Frobenius normalisation leaves
    # Measured: in the band from 1.47e-3 x the norm up; below, x451 to x529 (3.4445^5 = 487).
    big, small = relative >= 2e-3, relative < 1.4e-3
    assert BAND[0] <= mapped[big].min() and mapped[big].max() <= BAND[1]
    assert small.sum() > 10 and (mapped[small] >= 400 * relative[small]).all()


def test_newton_schulz_treats_tall_matrices_as_transposed_wide_ones_and_matches_torch_bit_for_bit():
    from torch.optim._muon import _zeropower_via_newtonschulz  # what torch.optim.Muon calls

    g = torch.randn(96, 40, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(newton_schulz(g, dtype=dtype), newton_schulz(g.T, dtype=dtype).T)
    for x in (g, g.T):
        assert torch.equal(newton_schulz(x), _zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7))
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(2, 3, 4))


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(48, 80), (80, 48)], ids=["wide", "tall"])
def test_torch_muon_steps_equal_our_formula_with_our_newton_schulz(shape, adjust_lr_fn):
    gen = torch.Generator().manual_seed(5)
    lr, wd, mu = 0.02, 0.1, 0.95
    param = torch.randn(shape, generator=gen).requires_grad_()
    opt = torch.optim.Muon([param], lr=lr, weight_decay=wd, momentum=mu, nesterov=True, adjust_lr_fn=adjust_lr_fn)
    a, b = shape
    scale = math.sqrt(max(1, a / b)) if adjust_lr_fn == "original" else 0.2 * math.sqrt(max(a, b))
    p, buf = param.detach().clone(), torch.zeros(shape)
    for _ in range(2):  # the second step has momentum
        grad = torch.randn(shape, generator=gen)
        param.grad = grad.clone()
        opt.step()
        buf = mu * buf + (1 - mu) * grad
        update = (1 - mu) * grad + mu * buf  # nesterov
        p = p * (1 - lr * wd) - lr * scale * newton_schulz(update).float()
        torch.testing.assert_close(param.detach(), p, rtol=0, atol=2e-5)
    # Not a tautology: the scale matters far beyond the tolerance.
    assert (lr * scale * newton_schulz(update).float()).abs().max() > 1e-3

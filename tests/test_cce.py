"""The chunked losses (cut cross-entropy, token-chunked) against F.cross_entropy on the full logits."""

import pytest
import torch
import torch.nn.functional as F

from engine.losses.cce import default_chunk_size, linear_cross_entropy
from engine.losses.chunked import chunked_cross_entropy


def reference(hidden, weight, targets, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
              softcap=None, focal_gamma=0.0):
    logits = (hidden @ weight.T).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    if focal_gamma:
        loss = (1 - torch.exp(-loss)) ** focal_gamma * loss
    valid = targets != ignore_index
    if z_loss:
        loss = loss + torch.where(valid, z_loss * torch.logsumexp(logits, dim=-1).square(), 0.0)
    if reduction == "none":
        return loss
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()


def inputs(n=96, d=32, v=1000, dtype=torch.float32, ignored=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) * 0.3
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignored] = -100
    return hidden.to(dtype), weight.to(dtype), targets


def loss_and_grads(fn, hidden, weight, targets, upstream=None, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets, **kw)
    loss.backward(upstream if upstream is not None else torch.ones_like(loss))
    return loss.detach(), h.grad, w.grad


CASES = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 2.0},
    "everything": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 5.0},
    "focal": {"focal_gamma": 2.0, "z_loss": 1e-3, "softcap": 5.0},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-3},
}


@pytest.mark.parametrize("chunk", [128, 333, 1000])  # 1000 = no chunking; 333 leaves a ragged last chunk
@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_cross_entropy_within_1e_5(case, chunk):
    upstream = torch.rand(96) if CASES[case].get("reduction") == "none" else None
    assert_fp32_match(linear_cross_entropy, dict(chunk_size=chunk, **CASES[case]), upstream)


def assert_fp32_match(fn, kw, upstream=None):
    """fn's loss and gradients equal the full-logits reference's to 1e-5 of each one's largest element."""
    hidden, weight, targets = inputs()
    ours = loss_and_grads(fn, hidden, weight, targets, upstream, **kw)
    ref = loss_and_grads(reference, hidden, weight, targets, upstream,
                         **{k: v for k, v in kw.items() if k not in ("chunk_size", "chunk_tokens")})
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fn, chunking", [(linear_cross_entropy, {"chunk_size": 512}),
                                          (chunked_cross_entropy, {"chunk_tokens": 64})])
def test_bf16_inputs_accumulate_in_fp32(fn, chunking):
    hidden, weight, targets = inputs(n=256, d=64, v=3000)
    ref = loss_and_grads(reference, hidden.double(), weight.double(), targets)
    ours = loss_and_grads(fn, hidden.bfloat16(), weight.bfloat16(), targets, **chunking)
    assert ours[1].dtype == torch.bfloat16 and ours[2].dtype == torch.bfloat16
    # bf16 rounding of the inputs and of each matmul's output bounds the error: the loss
    # to 1e-2 relative, gradients to 2% of their largest element.
    torch.testing.assert_close(ours[0].double(), ref[0].double(), rtol=1e-2, atol=0)
    for got, want in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=0.02 * want.abs().max().item())


def written_out(hidden, weight, targets, *, label_smoothing=0.0, z_loss=0.0, softcap=None, focal_gamma=0.0):
    """The mean loss from its definition, in float64, without F.cross_entropy."""
    logits = hidden.double() @ weight.double().T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(logits, dim=-1)
    valid = targets != -100
    target_logit = logits.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0]
    nll = lse - target_logit
    ce = (1 - label_smoothing) * nll + label_smoothing * (lse - logits.mean(dim=-1))
    ce = (1 - torch.exp(-nll)) ** focal_gamma * ce
    loss = ce + z_loss * lse**2
    return loss[valid].sum() / valid.sum()


@pytest.mark.parametrize("case", ["plain", "label_smoothing", "everything", "focal"])
def test_the_full_logits_ce_path_matches_the_written_out_definition(case):
    from engine.losses.ce import cross_entropy

    hidden, weight, targets = inputs()
    ours = loss_and_grads(cross_entropy, hidden, weight, targets, **CASES[case])
    ref = loss_and_grads(written_out, hidden.double(), weight.double(), targets, **CASES[case])
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_auto_uses_the_full_logits_while_they_fit_the_budget_else_token_chunks():
    from engine.losses import build_loss, resolve_loss_name
    from engine.spec.schema import LossConfig, ModelConfig

    model = ModelConfig(vocab_size=32768, dim=768, n_heads=12)
    assert resolve_loss_name(LossConfig(), model, 8192) == "ce"  # 1 GiB of fp32 logits: the default budget
    assert resolve_loss_name(LossConfig(), model, 8193) == "chunked"
    assert resolve_loss_name(LossConfig(logits_budget_mib=4096), model, 16384) == "ce"
    # auto's budget is a sixteenth of the device's memory where the backend knows it: on an 80 GiB
    # GPU 5 GiB, which holds the 125m preset's 32k-token micro-batch (4 GiB), not one of 48k tokens.
    gpu = 80 << 30
    assert resolve_loss_name(LossConfig(), model, 32768, gpu) == "ce"
    assert resolve_loss_name(LossConfig(), model, 49152, gpu) == "chunked"
    assert resolve_loss_name(LossConfig(logits_budget_mib=1024), model, 32768, gpu) == "chunked"  # a set budget wins
    assert resolve_loss_name(LossConfig(name="cce"), model, 1) == "cce"
    chosen = build_loss(LossConfig(chunk_tokens=40, z_loss=1e-3), ModelConfig(vocab_size=1000, dim=32, n_heads=4), 1 << 20)
    hidden, weight, targets = inputs()
    torch.testing.assert_close(chosen(hidden, weight, targets), reference(hidden, weight, targets, z_loss=1e-3))


def test_never_materialises_the_logits():
    """The biggest tensor created while chunked must be far smaller than N x V."""
    hidden, weight, targets = inputs(n=512, d=16, v=8192)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    sizes = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out

    with Watch():
        linear_cross_entropy(h, w, targets, chunk_size=512).backward()
    # The largest tensors are one chunk of logits and the weight gradient; the full
    # [512, 8192] logits (4.2 M elements) never appear, in forward or backward.
    assert max(sizes) == 512 * 512 and 8192 * 16 in sizes


def test_default_chunk_keeps_scratch_near_8_mib():
    assert default_chunk_size(4096, 65536) == 512  # 4096 x 512 fp32 = 8 MiB
    assert default_chunk_size(16, 300) == 300
    assert default_chunk_size(1 << 20, 65536) == 128
    # Under XLA the loop is unrolled into the graph: a fixed count of 8 chunks.
    assert default_chunk_size(1 << 21, 128256, "xla") == 16128 and -(-128256 // 16128) == 8


MEAN_CASES = [case for case in CASES if "reduction" not in CASES[case]]


@pytest.mark.parametrize("chunk", [7, 40, 96])  # 96 = one chunk; 7 and 40 leave a ragged last chunk
@pytest.mark.parametrize("case", MEAN_CASES)
def test_token_chunked_matches_cross_entropy_within_1e_5(case, chunk):
    assert_fp32_match(chunked_cross_entropy, dict(chunk_tokens=chunk, **CASES[case]), torch.tensor(0.7))


@pytest.mark.parametrize("fn", [linear_cross_entropy, chunked_cross_entropy])
def test_all_tokens_ignored_gives_zero_loss_and_gradients(fn):
    hidden, weight, _ = inputs()
    loss, gh, gw = loss_and_grads(fn, hidden, weight, torch.full((96,), -100))
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_token_chunked_holds_one_chunk_of_logits_at_a_time():
    hidden, weight, targets = inputs(n=512, d=16, v=8192)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    sizes = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(t.numel() for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))
            return out

    with Watch():
        chunked_cross_entropy(h, w, targets, chunk_tokens=64).backward()
    assert max(sizes) == 64 * 8192  # one chunk's logits; the full [512, 8192] never


def test_token_chunks_default_to_an_eighth_of_the_tokens_and_at_least_256():
    from engine.losses.chunked import default_chunk_tokens

    assert default_chunk_tokens(16384) == 2048 and default_chunk_tokens(1000) == 256


@pytest.mark.parametrize("value", ["0", "-5", "huge", "true", "1.5"])
def test_a_logits_budget_that_is_neither_mib_nor_auto_is_refused_in_one_message(value):
    from engine.spec.loader import SpecError, load_spec
    from tests.conftest import TINY_JOB

    with pytest.raises(SpecError) as refused:
        load_spec(TINY_JOB, [f"loss.logits_budget_mib={value}"])
    assert len(str(refused.value).splitlines()) == 1  # not one problem per branch of the union
    assert "loss.logits_budget_mib: must be a number of MiB (above 0) or auto" in str(refused.value)
    assert load_spec(TINY_JOB, ["loss.logits_budget_mib=512"]).loss.logits_budget_mib == 512

import pytest
import torch

from engine.attention import build_attention
from engine.attention.eager import eager_attention
from engine.attention.sdpa import sdpa_attention
from engine.backends.torch_native import TorchBackend
from engine.spec.schema import AttentionConfig
from engine.errors import ConfigError


def qkv(heads, kv_heads, t=33, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, t, d, generator=g)
    k, v = (torch.randn(2, kv_heads, t, d, generator=g) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v):
    """Attention written out per head in float64, one query position at a time."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // rep], v[:, h // rep]
        for t in range(q.shape[2]):
            scores = torch.einsum("bd,bsd->bs", q[:, h, t], kh[:, : t + 1]) / q.shape[-1] ** 0.5
            out[:, h, t] = torch.einsum("bs,bsd->bd", scores.softmax(-1), vh[:, : t + 1])
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_eager_is_causal_gqa_attention(heads, kv_heads):
    q, k, v = qkv(heads, kv_heads)
    assert torch.allclose(eager_attention(q, k, v).double(), reference(q, k, v), atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_sdpa_matches_eager_fp32(heads, kv_heads):
    q, k, v = qkv(heads, kv_heads)
    torch.testing.assert_close(sdpa_attention(q, k, v), eager_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_sdpa_matches_eager_bf16():
    q, k, v = qkv(4, 2, dtype=torch.bfloat16)
    # bf16 has 8 mantissa bits: outputs of magnitude ~1 agree to a few units of 2^-8.
    torch.testing.assert_close(sdpa_attention(q, k, v).float(), eager_attention(q, k, v).float(), rtol=0, atol=2e-2)


def test_auto_picks_sdpa_on_cpu_and_eager_is_honoured():
    backend = TorchBackend("cpu")
    assert build_attention(AttentionConfig(kernel="auto"), backend)[0] == "sdpa"
    assert build_attention(AttentionConfig(kernel="eager"), backend) == ("eager", eager_attention)


@pytest.mark.parametrize("kernel", ["flash", "splash"])
def test_tpu_kernels_off_tpu_are_a_config_error(kernel):
    with pytest.raises(ConfigError) as info:
        build_attention(AttentionConfig(kernel=kernel), TorchBackend("cpu"))
    assert info.value.key == "attention.kernel"
    assert kernel in str(info.value) and "TPU" in str(info.value) and "sdpa, eager" in str(info.value)

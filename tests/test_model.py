import math

import pytest
import torch

from engine.attention.eager import eager_attention
from engine.attention.sdpa import sdpa_attention
from engine.spec.schema import ModelConfig
from engine.models.llama import Attention, Transformer, apply_rotary, flops_per_token, rotary_tables

TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)


def test_shapes_and_tied_head():
    torch.manual_seed(0)
    model = Transformer(TINY, sdpa_attention)
    tokens = torch.randint(0, 256, (3, 17))
    hidden = model(tokens)
    assert hidden.shape == (3, 17, 64)
    assert model.logits(hidden).shape == (3, 17, 256)
    assert model.output_weight is model.tok_embeddings.weight
    untied = Transformer(TINY.model_copy(update={"tie_embeddings": False}), sdpa_attention)
    n_tied = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 256 * 64


def test_parameter_count_matches_llama_geometry():
    model = Transformer(TINY, sdpa_attention)
    kv = 2 * 16  # kv heads x head dim
    per_layer = 64 * 64 * 2 + 2 * 64 * kv + 3 * 64 * 96 + 2 * 64  # q, o, k, v, swiglu, two norms
    assert sum(p.numel() for p in model.parameters()) == 256 * 64 + 2 * per_layer + 64


def test_hidden_dim_default_rounds_swiglu_width():
    cfg = ModelConfig(dim=128, n_heads=4, multiple_of=64)
    assert cfg.hidden_dim == 384  # 8/3 * 128 = 341.3 -> next multiple of 64
    assert ModelConfig(dim=4096, n_heads=32, ffn_dim=14336).hidden_dim == 14336


def test_rotary_is_a_rotation_that_encodes_relative_position():
    cos, sin = rotary_tables(head_dim=16, max_seq_len=32, theta=10000.0)
    torch.manual_seed(0)
    q, k = torch.randn(16), torch.randn(16)

    def at(x, pos):  # place x at one position of a [1, 1, T, D] tensor and rotate
        seq = torch.zeros(1, 1, 32, 16)
        seq[0, 0, pos] = x
        return apply_rotary(seq, cos, sin)[0, 0, pos]

    assert torch.allclose(at(q, 0), q)  # position 0 is the identity
    assert torch.allclose(at(q, 7).norm(), q.norm())  # rotations keep the norm
    # q.k depends only on the distance between positions.
    assert torch.allclose(at(q, 3) @ at(k, 1), at(q, 12) @ at(k, 10), atol=1e-5)
    assert not torch.allclose(at(q, 3) @ at(k, 1), at(q, 3) @ at(k, 2), atol=1e-3)


def test_rope_theta_changes_frequencies():
    _, sin_a = rotary_tables(16, 8, 10000.0)
    _, sin_b = rotary_tables(16, 8, 500000.0)
    assert torch.equal(sin_a[:, 0], sin_b[:, 0])  # the fastest frequency is always 1
    # The slowest rotates theta^(-7/8) radians per position: a larger theta, a slower turn.
    assert sin_a[7, -1].item() == pytest.approx(7 * 10000.0 ** -0.875, rel=1e-4)
    assert sin_b[7, -1].item() == pytest.approx(7 * 500000.0 ** -0.875, rel=1e-4)


def test_grouped_query_attention_equals_mha_with_shared_kv_heads():
    torch.manual_seed(0)
    gqa = Attention(TINY, eager_attention)
    mha = Attention(TINY.model_copy(update={"n_kv_heads": 4}), eager_attention)
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        # Each KV head of the GQA layer serves two consecutive query heads.
        for name in ("wk", "wv"):
            w = getattr(gqa, name).weight.view(2, 16, 64)
            getattr(mha, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(64, 64))
    x = torch.randn(2, 10, 64)
    cos, sin = rotary_tables(16, 10, 10000.0)
    assert torch.allclose(gqa(x, cos, sin), mha(x, cos, sin), atol=1e-6)


def test_model_is_causal():
    torch.manual_seed(0)
    model = Transformer(TINY, sdpa_attention)
    tokens = torch.randint(0, 256, (1, 20))
    changed = tokens.clone()
    changed[0, 15] = (changed[0, 15] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :15], b[0, :15], atol=1e-6)
    assert not torch.allclose(a[0, 15:], b[0, 15:], atol=1e-3)


def test_activation_checkpointing_gives_the_same_gradients():
    from engine.backends.torch_native import TorchBackend

    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        cfg = TINY.model_copy(update={"activation_checkpointing": checkpointing})
        model = Transformer(cfg, sdpa_attention, TorchBackend.checkpoint_fn)
        assert (model.checkpoint_fn is not None) == checkpointing
        model(torch.arange(32).view(2, 16)).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_init_scales_residual_projections_down_with_depth():
    torch.manual_seed(0)
    cfg = ModelConfig(dim=256, n_layers=8, n_heads=4, ffn_dim=512)
    model = Transformer(cfg, sdpa_attention)
    wq_std = model.layers[0].attention.wq.weight.std().item()
    wo_std = model.layers[0].attention.wo.weight.std().item()
    assert wq_std == pytest.approx(0.02 * 0.986, rel=0.05)  # truncation at 3 sigma trims 1.4%
    assert wo_std == pytest.approx(wq_std / math.sqrt(16), rel=0.1)
    assert torch.equal(model.norm.weight, torch.ones(256))


def test_flops_per_token_is_six_times_matmul_params_plus_attention():
    model = Transformer(TINY, sdpa_attention)
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
    attention = 12 * 2 * 4 * 16 * 64
    assert flops_per_token(TINY, 64) == 6 * matmul_params + attention


def test_a_model_built_on_meta_and_materialised_equals_the_eager_one_of_the_same_seed():
    from engine.backends.torch_native import TorchBackend
    from engine.models.llama import initial_values

    torch.manual_seed(7)
    eager = Transformer(TINY, sdpa_attention)
    with torch.device("meta"):
        lazy = Transformer(TINY, sdpa_attention)
    TorchBackend("cpu").materialise(lazy, initial_values(lazy, torch.Generator().manual_seed(7)))
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(eager.rope_cos, lazy.rope_cos) and lazy.rope_cos.device.type == "cpu"
    with torch.device("meta"):
        other = Transformer(TINY, sdpa_attention)
    TorchBackend("cpu").materialise(other, initial_values(other, torch.Generator().manual_seed(8)))
    assert not torch.equal(other.tok_embeddings.weight, lazy.tok_embeddings.weight)
    with torch.device("meta"):
        partial = Transformer(TINY, sdpa_attention)
    with pytest.raises(RuntimeError, match="no initial value for norm.weight"):
        TorchBackend("cpu").materialise(partial, ((n, v) for n, v in initial_values(partial, torch.Generator())
                                                  if n != "norm.weight"))

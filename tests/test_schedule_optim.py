import torch

from engine.attention.sdpa import sdpa_attention
from engine.spec.schema import ModelConfig, OptimizerConfig
from engine.models.llama import Transformer
from engine.optim import build_optimizer
from engine.optim.param_groups import decay_groups


def test_weight_decay_skips_norms_biases_and_embeddings():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64, tie_embeddings=False)
    model = Transformer(cfg, sdpa_attention)
    model.extra = torch.nn.Linear(4, 4, bias=True)  # a bias, to show biases are excluded
    decay, no_decay = decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "layers.0.attention.wq.weight" in decayed and "output.weight" in decayed
    assert "tok_embeddings.weight" in skipped and "norm.weight" in skipped and "extra.bias" in skipped
    assert "layers.1.ffn_norm.weight" in skipped and "extra.weight" in decayed
    assert len(decayed) + len(skipped) == len(names)


def test_adamw_uses_the_groups_and_the_configured_hyperparameters():
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, ffn_dim=64), sdpa_attention)
    opt = build_optimizer(OptimizerConfig(lr=1e-3, betas=(0.8, 0.9), weight_decay=0.2), model, torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.defaults["fused"]

"""Mixture-of-experts: the engine's MoE against transformers' Mixtral, its losses, schema and training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from pydantic import ValidationError

from engine.attention.sdpa import sdpa_attention
from engine.hf.export import export
from engine.hf.weights import load_weights
from engine.models.llama import Transformer
from engine.models.moe import load_balancing_loss, router_loss
from engine.requests import Action, Request
from engine.spec.loader import SpecError, load_mapping, load_spec
from engine.spec.schema import ModelConfig, MoEConfig
from engine.train import Trainer
from tests.conftest import TINY_JOB
from tests.recorders import Recorder
from tests.test_hf_export import weights
from tests.test_hf_import import job


def mixtral(directory, seed=0):
    """A random Mixtral (2 layers, 4 experts, top 2, GQA) saved by transformers."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=False,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():  # transformers' init leaves the router near uniform: make the routing decisive
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.5)
    model.save_pretrained(directory, max_shard_size="200KB")
    return model


def test_an_imported_mixtral_gives_transformers_logits_and_aux_loss(tmp_path):
    reference = mixtral(tmp_path)
    cfg = job(tmp_path).model
    assert cfg.moe == MoEConfig(num_experts=4, top_k=2, norm_topk_prob=True, router_aux_loss_coef=0.02)
    assert cfg.expert_dim == 96
    model = Transformer(cfg, sdpa_attention)
    load_weights(model, tmp_path)
    tokens = torch.randint(0, 384, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, logits = model.hidden_and_router_logits(tokens)
        theirs = reference(tokens, labels=tokens, output_router_logits=True)
    assert (model.logits(hidden) - theirs.logits).abs().max().item() < 1e-4
    ours = router_loss(logits, cfg.moe)
    assert abs(ours.item() - reference.router_aux_loss_coef * theirs.aux_loss.item()) < 1e-5
    assert ours.item() > 0.02  # the routers are not balanced: the loss is above its minimum, coef x 1


def test_import_then_export_is_bitwise_and_transformers_loads_it(tmp_path):
    mixtral(tmp_path / "hf")
    spec = job(tmp_path / "hf", "data.micro_batch_size=2", "train.max_steps=2", "scheduler.warmup_steps=1")
    Trainer(spec, tmp_path / "state", Recorder({(0, 0): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)})).run()
    (step,) = (tmp_path / "state" / "checkpoints" / "tiny-cpu").glob("step_*")
    export(spec, step, tmp_path / "out", dtype="fp32", max_shard_bytes=300_000)
    original, exported = weights(tmp_path / "hf"), weights(tmp_path / "out")
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == "MixtralForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_one_expert_top_1_is_the_dense_model():
    dense_cfg = ModelConfig(n_layers=2, ffn_dim=192)
    moe_cfg = dense_cfg.model_copy(update={"moe": MoEConfig(num_experts=1, top_k=1)})
    torch.manual_seed(0)
    dense, sparse = Transformer(dense_cfg, sdpa_attention), Transformer(moe_cfg, sdpa_attention)
    values = {}
    for name, param in dense.named_parameters():
        values[name.replace("feed_forward.w", "moe.w").removesuffix(".weight") if "feed_forward" in name
               else name] = param.detach()
    with torch.no_grad():
        for name, param in sparse.named_parameters():
            if not name.endswith("router.weight"):
                param.copy_(values[name].reshape(param.shape))
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (sparse(tokens) - dense(tokens)).abs().max().item() <= 1e-6


def test_the_load_balancing_loss_is_one_when_routing_is_uniform_and_balanced():
    logits = [torch.zeros(8, 4)]  # equal probabilities: topk picks experts 0 and 1 for every token
    assert load_balancing_loss(logits, 4, 2).item() == pytest.approx(2.0)  # 4 x (2 x 1 x 1/4)
    balanced = [torch.eye(4).repeat(2, 1) * 10]  # each expert first choice of 2 of 8 tokens
    assert load_balancing_loss(balanced, 4, 1).item() == pytest.approx(1.0, abs=1e-3)


def test_the_z_loss_is_added_with_its_coefficient():
    logits = [torch.randn(16, 4, generator=torch.Generator().manual_seed(0)) for _ in range(2)]
    without = router_loss(logits, MoEConfig(num_experts=4, top_k=2))
    with_z = router_loss(logits, MoEConfig(num_experts=4, top_k=2, router_z_loss_coef=0.1))
    expected = 0.1 * sum(torch.logsumexp(x, -1).square().mean() for x in logits)
    assert (with_z - without).item() == pytest.approx(expected.item(), rel=1e-6)


def test_the_schema_refuses_more_experts_per_token_than_there_are():
    with pytest.raises(ValidationError, match=r"top_k \(3\) must be at most num_experts \(2\)"):
        MoEConfig(num_experts=2, top_k=3)
    with pytest.raises(ValidationError, match="top_k"):
        MoEConfig(num_experts=2, top_k=0)
    with pytest.raises(ValidationError, match="num_experts"):
        MoEConfig(top_k=1)
    assert ModelConfig().moe is None


def test_an_moe_job_on_the_xla_backend_is_refused_until_its_expert_path_exists():
    from engine.spec.loader import SpecError, load_spec
    from tests.conftest import TINY_JOB

    with pytest.raises(SpecError, match=r"model\.moe: trains on the cpu and cuda backends only"):
        load_spec(TINY_JOB, ["model.moe={num_experts: 4, top_k: 2}", "device.backend=xla"])
    assert load_spec(TINY_JOB, ["model.moe={num_experts: 4, top_k: 2}"]).model.moe.top_k == 2


def test_a_tiny_moe_trains_with_a_falling_loss(tmp_path):
    preset = load_mapping(Path(TINY_JOB).parent.parent / "models" / "tiny-moe.yaml")["model"]
    spec = load_spec(TINY_JOB, [f"model={json.dumps(preset)}", "train.max_steps=12", "data.seq_len=64",
                                "data.micro_batch_size=8", "scheduler.warmup_steps=2", "train.log_interval=1",
                                "data.corpus_bytes=400000"])
    assert spec.model.moe is not None
    recorder = Recorder()
    trainer = Trainer(spec, tmp_path / "state", recorder)
    assert trainer.run() == 0
    losses = recorder.losses
    assert len(losses) == 12 and losses[12] < losses[1] - 0.5


@pytest.mark.parametrize(("key", "value"), [("sliding_window", 4096), ("router_jitter_noise", 0.01)])
def test_a_mixtral_the_engine_does_not_implement_is_refused_naming_the_key(tmp_path, key, value):
    mixtral(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(SpecError, match=f"{key} is {value}; the engine's Mixtral has none"):
        job(tmp_path)


def test_a_job_from_a_mixtral_may_set_its_router_loss_but_not_another_shape(tmp_path):
    mixtral(tmp_path)
    spec = job(tmp_path, "model.moe={router_aux_loss_coef: 0.05, router_z_loss_coef: 0.001}")
    moe = spec.model.moe
    assert (moe.num_experts, moe.top_k, moe.router_aux_loss_coef, moe.router_z_loss_coef) == (4, 2, 0.05, 0.001)
    with pytest.raises(SpecError, match=r"model\.moe\.top_k: 1 differs from 2"):
        job(tmp_path, "model.moe={top_k: 1}")

"""Mixture-of-experts: the engine's MoE against transformers' Mixtral, its losses, schema and training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from pydantic import ValidationError

from engine import events

from engine.attention.sdpa import sdpa_attention
from engine.hf.export import export
from engine.hf.weights import load_weights
from engine.models.llama import Transformer
from engine.models.moe import MoE, Routing, load_balancing_loss, route, router_loss, router_terms
from engine.requests import Action, Request
from engine.spec.loader import SpecError, load_mapping, load_spec
from engine.spec.schema import ModelConfig, MoEConfig
from engine.train import Trainer
from tests.conftest import PYTHON, TINY_JOB, python_env
from testkit.helpers import metric, read_records
from testkit.recorders import Recorder
from testkit.states import assert_same_state, checkpoint_state
from tests.test_hf_export import weights
from tests.test_hf_import import job


def mixtral(directory, seed=0, fused=False):
    """A random Mixtral (2 layers, 4 experts, top 2, GQA) saved by transformers; fused: its in-memory
    state (transformers 5's names: mlp.gate, fused 3-D experts) written as it is."""
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=False,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    model = transformers.MixtralForCausalLM(config).float().eval()
    with torch.no_grad():  # transformers' init leaves the router near uniform: make the routing decisive
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.5)
    save(model, directory, fused)
    return model


def save(model, directory, fused: bool) -> None:
    model.save_pretrained(directory, max_shard_size="200KB")
    if fused:
        from safetensors.torch import save_file

        for old in Path(directory).glob("model*.safetensors*"):
            old.unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(Path(directory) / "model.safetensors"))


def qwen3_moe(directory, seed=0, fused=False):
    """A random Qwen3-MoE (2 layers, 4 experts, top 2 not renormalised, heads of 32 on a 64-wide model, qk
    norms) saved by transformers; fused: its in-memory state (fused 3-D experts) written as it is."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, router_aux_loss_coef=0.02,
        tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.5)
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)  # not ones: a norm read into the wrong place shows
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    save(model, directory, fused)
    return model


FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "mixtral-fused": lambda d: mixtral(d, fused=True),
            "qwen3_moe-fused": lambda d: qwen3_moe(d, fused=True)}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_imported_moe_gives_transformers_logits_and_aux_loss(tmp_path, family):
    reference = FAMILIES[family](tmp_path)
    cfg = job(tmp_path).model
    if family.startswith("mixtral"):
        assert cfg.moe == MoEConfig(num_experts=4, top_k=2, norm_topk_prob=True, router_aux_loss_coef=0.02)
        assert cfg.expert_dim == 96
    else:
        assert cfg.moe == MoEConfig(num_experts=4, top_k=2, norm_topk_prob=False, expert_ffn_dim=48,
                                    router_aux_loss_coef=0.02)
        assert (cfg.qk_norm, cfg.head_dim, cfg.dim, cfg.n_heads) == (True, 32, 64, 4)
    model = Transformer(cfg, sdpa_attention)
    load_weights(model, tmp_path)
    tokens = torch.randint(0, 384, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, routing = model.hidden_and_routing(tokens)
        theirs = reference(tokens, labels=tokens, output_router_logits=True)
    assert (model.logits(hidden) - theirs.logits).abs().max().item() < 1e-4
    ours = router_loss(routing.logits, cfg.moe)
    assert abs(ours.item() - reference.config.router_aux_loss_coef * theirs.aux_loss.item()) < 1e-5
    assert ours.item() > 0.02  # the routers are not balanced: the loss is above its minimum, coef x 1


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_import_then_export_is_bitwise_and_transformers_loads_it(tmp_path, family):
    FAMILIES[family](tmp_path / "hf")
    spec = job(tmp_path / "hf", "data.micro_batch_size=2", "train.max_steps=2", "scheduler.warmup_steps=1")
    Trainer(spec, tmp_path / "state", Recorder({(0, 0): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)})).run()
    (step,) = (tmp_path / "state" / "checkpoints" / "tiny-cpu").glob("step_*")
    export(spec, step, tmp_path / "out", dtype="fp32", max_shard_bytes=300_000)
    original, exported = weights(tmp_path / "hf"), weights(tmp_path / "out")
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    experts = config.get("num_local_experts", config.get("num_experts"))
    assert (config["model_type"], experts, config["num_experts_per_tok"]) == (family, 4, 2)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    if family == "qwen3_moe":
        assert (theirs.config.norm_topk_prob, theirs.config.moe_intermediate_size, theirs.config.head_dim) == (False, 48, 32)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("mlp_only_layers", [1], "mlp_only_layers is \\[1\\]; the engine's Qwen3-MoE has experts in every layer"),
    ("decoder_sparse_step", 2, "decoder_sparse_step is 2"),
    ("use_sliding_window", True, "use_sliding_window is true"),
])
def test_a_qwen3_moe_the_engine_does_not_implement_is_refused_naming_the_key(tmp_path, key, value, message):
    qwen3_moe(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(SpecError, match=message):
        job(tmp_path)


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


def test_an_moe_job_on_the_xla_backend_needs_a_capacity_factor():
    with pytest.raises(SpecError, match=r"model\.moe\.capacity_factor: must be set on the xla backend"):
        load_spec(TINY_JOB, ["model.moe={num_experts: 4, top_k: 2}", "device.backend=xla"])
    spec = load_spec(TINY_JOB, ["model.moe={num_experts: 4, top_k: 2, capacity_factor: 1.25}", "device.backend=xla",
                                "device.mesh={expert: 2, fsdp: -1}"])
    assert (spec.model.moe.capacity_factor, spec.device.mesh.expert) == (1.25, 2)


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.moe={num_experts: 4, top_k: 2, capacity_factor: 2}", "device.backend=xla", "device.mesh.expert=3"],
     r"device\.mesh\.expert: must divide model\.moe\.num_experts \(4\)"),
    (["device.backend=xla", "device.mesh.expert=2"], r"device\.mesh\.expert: must divide model\.moe\.num_experts"),
    (["model.moe={num_experts: 4, top_k: 2}", "device.backend=cpu", "device.mesh.expert=2"],
     r"device\.mesh\.expert: must be 1 on the cpu backend"),
])
def test_the_expert_axis_is_refused_where_it_cannot_split_the_experts(overrides, message):
    with pytest.raises(SpecError, match=message):
        load_spec(TINY_JOB, overrides)


def moe_layer(capacity_factor, experts=4, top_k=2, seed=0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(32, 48, MoEConfig(num_experts=experts, top_k=top_k, capacity_factor=capacity_factor))
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.1)
    return layer


def test_the_capacity_path_with_room_for_every_choice_equals_the_dropless_one():
    x = torch.randn(3, 40, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    capped, dropless = moe_layer(4 / 2), moe_layer(None)  # num_experts / top_k: seats for every token
    out_c, logits_c, dropped_c = capped(x)
    out_d, logits_d, dropped_d = dropless(x)
    assert dropped_c.item() == dropped_d.item() == 0
    assert torch.equal(logits_c, logits_d)
    assert (out_c - out_d).abs().max().item() <= 1e-5
    grads = [torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]) for out, layer
             in ((out_c, capped), (out_d, dropless))]
    for mine, theirs in zip(*grads):
        assert (mine - theirs).abs().max().item() <= 1e-4


def test_a_small_capacity_drops_the_choices_past_each_experts_seats_and_counts_them():
    layer = moe_layer(0.5)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, logits, dropped = layer(x)
        weights, experts = route(logits, 2, True)
    seats = 16  # ceil(0.5 x 64 tokens x 2 choices / 4 experts)
    # Counted here: all first choices seated in token order, then the second ones.
    taken, kept = [0] * 4, torch.zeros(64, 2, dtype=torch.bool)
    for choice in range(2):
        for token in range(64):
            e = int(experts[token, choice])
            kept[token, choice] = taken[e] < seats
            taken[e] += 1
    assert int(dropped.item()) == int((~kept).sum()) > 0
    expected = torch.zeros(64, 32)
    for token in range(64):
        for choice in range(2):
            if kept[token, choice]:
                expected[token] += weights[token, choice] * layer.expert_mlp(x[token:token + 1], int(experts[token, choice]))[0]
    assert (out - expected).abs().max().item() <= 1e-5
    _, stats = router_terms(Routing([logits], [dropped]), MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5))
    assert stats[4].item() == pytest.approx(int((~kept).sum()) / 128)


def test_the_router_statistics_show_the_busiest_expert_and_the_spread():
    # Layer 1: every token picks experts 0 then 1; layer 2: the four experts in turn, evenly.
    skewed = torch.tensor([[4.0, 3.0, 0.0, 0.0]]).repeat(8, 1)
    even = (torch.eye(4) * 5).repeat(2, 1)
    _, stats = router_terms(Routing([skewed, even]), MoEConfig(num_experts=4, top_k=1))
    aux, z, load_max, load_cv, dropped = stats.tolist()
    assert load_max == pytest.approx(1.0)  # layer 1's expert 0 took all 8 choices
    assert load_cv == pytest.approx((3 ** 0.5 + 0) / 2)  # shares [1, 0, 0, 0]: std sqrt(3)/4 over mean 1/4
    assert dropped == 0
    assert aux == pytest.approx(load_balancing_loss([skewed, even], 4, 1).item())


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
    for step in recorder.of(events.Step):  # dropless: nothing dropped; 4 experts: a share of at least 1/4
        assert step.dropped_fraction == 0 and 0.25 <= step.expert_load_max <= 1 and step.aux_loss >= 1 - 1e-3


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


@pytest.mark.slow
def test_a_tiny_moe_under_tpud_run_shows_its_routers_and_resumes_bit_for_bit_after_sigkills(tmp_path):
    """The worker SIGKILLed twice under `tpud run`: every step's loss and the final state are bitwise
    those of an uninterrupted run, and the routers' figures reach the log and Prometheus."""
    preset = load_mapping(Path(TINY_JOB).parent.parent / "models" / "tiny-moe.yaml")["model"]
    args = [f"model={json.dumps(preset)}", "model.moe.capacity_factor=1.0", "train.max_steps=12",
            "train.grad_accum_steps=2", "train.log_interval=1", "scheduler.warmup_steps=2", "data.micro_batch_size=4",
            "data.seq_len=64", "data.corpus_bytes=400000", "checkpoint.interval_steps=3"]
    whole = subprocess.Popen([PYTHON, "-m", "engine.train", str(TINY_JOB), *args, "--state-dir", str(tmp_path / "whole")],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=python_env())
    home = tmp_path / "cut"
    run = subprocess.Popen([PYTHON, "-m", "tpud", "run", str(TINY_JOB), *args, "--home", str(home)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=python_env())
    records = []
    try:
        for at in (4, 8):
            records += read_records(run, lambda r: r["event"] == "step" and r["step"] >= at)
            worker = next(r["pid"] for r in reversed(records) if r["event"] == "worker started")
            if at == 8:  # held still while Prometheus scrapes: the job cannot end meanwhile
                os.kill(worker, signal.SIGSTOP)
                scraped_at = metric(home, "tpud_job_step", job="tiny-cpu")
                scraped = {key: metric(home, name, job="tiny-cpu") for name, key in (
                    ("tpud_job_expert_load_max_ratio", "expert_load_max"),
                    ("tpud_job_dropped_tokens_ratio", "dropped_fraction"), ("tpud_job_router_aux_loss", "aux_loss"))}
                assert metric(home, "tpud_job_step", job="tiny-cpu") == scraped_at
            os.kill(worker, signal.SIGKILL)
            restored = read_records(run, lambda r: r["event"] == "checkpoint restored")
            records += restored
            assert restored[-1]["step"] >= at - 3  # from a checkpoint, not from the start
        records += [json.loads(line) for line in run.stdout if line.startswith("{")]
    finally:
        run.kill()
    assert run.wait() == 0 and whole.wait() == 0
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    reference = {r["step"]: r for r in map(json.loads, whole.stdout) if r["event"] == "step"}
    assert sorted(steps) == list(range(1, 13))
    assert {s: r["loss"] for s, r in steps.items()} == {s: r["loss"] for s, r in reference.items()}
    assert steps[12]["loss"] < steps[1]["loss"] - 0.3
    for key, value in scraped.items():  # that step's figures (its line may come from the redone step: bitwise alike)
        assert value == pytest.approx(steps[int(scraped_at)][key], rel=1e-4), key
    for r in steps.values():  # the step log line carries the routers' figures
        assert r["aux_loss"] >= 1 - 1e-3 and r["z_loss"] > 0 and r["expert_load_cv"] >= 0
        assert r["dropped_fraction"] == reference[r["step"]]["dropped_fraction"]
    final = "checkpoints/tiny-cpu/step_000000012"
    assert_same_state(checkpoint_state(home / "state" / final, tmp_path),
                      checkpoint_state(tmp_path / "whole" / final, tmp_path))


def test_the_routers_figures_reach_status_and_prometheus():
    from tpud.job.report import WorkerReport
    from tpud.metrics.series import Metrics
    from tpud.view.status import lines

    metrics = Metrics()
    try:
        report = WorkerReport("moe", metrics, lambda: 0.0)
        common = dict(loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=10.0, step_time_s=0.1)
        report.on_step(events.Step(step=3, **common, aux_loss=1.25, z_loss=3.5, expert_load_max=0.4,
                                   expert_load_cv=0.2, dropped_fraction=0.05))
        job = {"name": "moe", **report.snapshot(10)}
        assert job["experts"] == {"aux_loss": 1.25, "z_loss": 3.5, "load_max": 0.4, "load_cv": 0.2,
                                  "dropped_fraction": 0.05}
        assert ("moe: experts: busiest 40.0% of its layer's tokens, spread (cv) 0.2, aux loss 1.25, z loss 3.5, "
                "5.0% dropped") in lines([job])
        text = metrics.exposition().decode()
        for line in ('tpud_job_router_aux_loss{job="moe"} 1.25', 'tpud_job_router_z_loss{job="moe"} 3.5',
                     'tpud_job_expert_load_max_ratio{job="moe"} 0.4', 'tpud_job_expert_load_cv{job="moe"} 0.2',
                     'tpud_job_dropped_tokens_ratio{job="moe"} 0.05'):
            assert line in text.splitlines(), line
        dense = WorkerReport("dense", metrics, lambda: 0.0)
        dense.on_step(events.Step(step=3, **common))
        assert dense.snapshot(10)["experts"] is None
        assert not [line for line in lines([{"name": "dense", **dense.snapshot(10)}]) if "experts" in line]
        assert 'job="dense"' not in "".join(l for l in metrics.exposition().decode().splitlines() if "router" in l)
    finally:
        metrics.close()


def test_a_dense_qwen3_imports_with_transformers_logits_and_exports_as_qwen3(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    reference = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    reference.save_pretrained(tmp_path / "hf")
    spec = job(tmp_path / "hf", "data.micro_batch_size=2", "train.max_steps=2", "scheduler.warmup_steps=1")
    assert (spec.model.qk_norm, spec.model.head_dim, spec.model.moe) == (True, 32, None)
    model = Transformer(spec.model, sdpa_attention)
    load_weights(model, tmp_path / "hf")
    tokens = torch.randint(0, 384, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model.logits(model(tokens)) - reference(tokens).logits).abs().max().item() < 1e-4
    Trainer(spec, tmp_path / "state", Recorder({(0, 0): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)})).run()
    (step,) = (tmp_path / "state" / "checkpoints" / "tiny-cpu").glob("step_*")
    export(spec, step, tmp_path / "out", dtype="fp32")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == "Qwen3ForCausalLM" and not any(info.values())
    with torch.no_grad():
        assert torch.equal(theirs(tokens).logits, reference(tokens).logits)

"""model.init_from against the real thing: models built and saved by `transformers` itself, no download."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from engine.attention.sdpa import sdpa_attention
from engine.errors import ConfigError
from engine.hf.weights import load_weights
from engine.models.llama import Transformer
from engine.spec.loader import SpecError, load_spec
from engine.train import Trainer
from tests.conftest import TINY_JOB
from testkit.recorders import Recorder

ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def hf_model(directory, *, tied=False, rope_scaling=None, seed=0):
    """A random Llama (GQA, rope theta 500000) saved by transformers in shards of at most 200 kB."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, tie_word_embeddings=tied,
        rms_norm_eps=1e-5, rope_scaling=rope_scaling)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(directory, max_shard_size="200KB")
    return model


def job(directory, *overrides, **model):
    """The demo job with its model section replaced (a mapping override replaces the whole section)."""
    section = json.dumps({"init_from": str(directory), **model})
    return load_spec(TINY_JOB, [f"model={section}", "data.seq_len=64", *overrides])


@pytest.mark.parametrize("variant", ["untied", "tied", "llama3-rope"])
def test_imported_models_give_transformers_logits(tmp_path, variant):
    reference = hf_model(tmp_path, tied=variant == "tied", rope_scaling=ROPE_LLAMA3 if variant == "llama3-rope" else None)
    assert variant == "tied" or (tmp_path / "model.safetensors.index.json").is_file()  # sharded
    spec = job(tmp_path)
    cfg = spec.model
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.ffn_dim) == (384, 64, 3, 8, 2, 160)
    assert cfg.rope_theta == 500000.0 and cfg.tie_embeddings == (variant == "tied")
    model = Transformer(cfg, sdpa_attention)
    load_weights(model, tmp_path)
    tokens = torch.randint(0, 384, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.logits(model(tokens))
        theirs = reference(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_a_job_starts_from_the_weights_and_resumes_from_its_own_checkpoint(tmp_path):
    hf_model(tmp_path / "hf")
    spec = job(tmp_path / "hf", "train.max_steps=2", "data.micro_batch_size=2", "scheduler.warmup_steps=1",
               "train.log_interval=1")
    first = Trainer(spec, tmp_path / "home", Recorder())
    reference = Transformer(spec.model, sdpa_attention)
    load_weights(reference, tmp_path / "hf")
    assert torch.equal(first.model.tok_embeddings.weight, reference.tok_embeddings.weight)
    assert first.run() == 0
    resumed = Trainer(job(tmp_path / "hf", "train.max_steps=3", "data.micro_batch_size=2", "scheduler.warmup_steps=1"),
                      tmp_path / "home", Recorder())
    assert resumed.progress.step == 2
    assert torch.equal(resumed.model.tok_embeddings.weight, first.model.tok_embeddings.weight)


def test_mismatches_and_bad_directories_are_clear_errors(tmp_path):
    hf_model(tmp_path / "hf")
    with pytest.raises(SpecError, match=r"model.dim: 128 differs from hidden_size = 64"):
        job(tmp_path / "hf", dim=128)
    with pytest.raises(SpecError, match=r"model.vocab_size: 256 differs from vocab_size = 384"):
        job(tmp_path / "hf", vocab_size=256)
    with pytest.raises(SpecError, match=r"configs/models/tiny.yaml:4: model.dim: 128 differs from hidden_size"):
        load_spec(TINY_JOB, [f"model.init_from={tmp_path / 'hf'}"])  # the demo's preset names other dimensions
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SpecError, match="model_type 'gpt2' is not a Llama model"):
        job(gpt2)
    with pytest.raises(SpecError, match="no config.json"):
        job(tmp_path / "nowhere")
    spec = job(tmp_path / "hf")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{shard.name}: missing"):
        load_weights(Transformer(spec.model, sdpa_attention), tmp_path / "hf")
    other = tmp_path / "other"
    hf_model(other)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 128  # the weights say 160
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"proj.weight has shape \[(160, 64|64, 160)\], the model expects"):
        load_weights(Transformer(job(other).model, sdpa_attention), other)


@pytest.mark.slow
def test_a_model_on_gcs_is_read_through_the_host_cache(tmp_path, gcs_server):
    """init_from: gs://...: config.json fills the model section; the weights come through <state>/models/."""
    reference = hf_model(tmp_path / "hf")
    (tmp_path / "hf" / "original").mkdir()
    (tmp_path / "hf" / "original" / "consolidated.00.pth").write_bytes(b"another copy of the weights")
    bucket = gcs_server.client().bucket("tpud-test")
    for path in (tmp_path / "hf").rglob("*"):
        if path.is_file():
            bucket.blob(f"models/llama/{path.relative_to(tmp_path / 'hf')}").upload_from_filename(str(path))
    spec = job("gs://tpud-test/models/llama", "train.max_steps=1", "data.micro_batch_size=2",
               "scheduler.warmup_steps=0")
    assert (spec.model.dim, spec.model.n_kv_heads, spec.model.rope_theta) == (64, 2, 500000.0)
    trainer = Trainer(spec, tmp_path / "state", Recorder())
    (cached,) = [p for p in (tmp_path / "state" / "models").iterdir() if not p.name.startswith(".")]
    assert sorted(p.name for p in cached.iterdir()) == sorted(
        p.name for p in (tmp_path / "hf").iterdir() if p.is_file())  # not original/
    assert torch.equal(trainer.model.tok_embeddings.weight, reference.model.embed_tokens.weight)
    mtime = cached.stat().st_mtime_ns
    Trainer(spec, tmp_path / "state", Recorder())  # no checkpoint yet: init_from again, from the cache
    assert [p.name for p in (tmp_path / "state" / "models").iterdir() if not p.name.startswith(".")] == [cached.name]
    assert cached.stat().st_mtime_ns == mtime
    with pytest.raises(SpecError, match="gs://tpud-test/models/none: no config.json"):
        job("gs://tpud-test/models/none")


def test_a_dataset_must_use_the_tokenizer_of_the_model_it_trains(tmp_path, capsys):
    from engine.prepare.pipeline import prepare
    from engine.prepare.options import Options
    from testkit.corpus import docstrings, make_tokenizer, write
    from tpud.cli import main

    texts = docstrings(200)
    hf_model(tmp_path / "hf")
    make_tokenizer(tmp_path / "hf", texts, vocab_size=384)  # the model's own tokenizer, beside its weights
    make_tokenizer(tmp_path / "tok", texts[::-1], vocab_size=300)
    src = write(tmp_path / "docs.jsonl", texts, "jsonl")
    for name, tokenizer in (("same", tmp_path / "hf"), ("other", tmp_path / "tok")):
        prepare(Options(inputs=(str(src),), tokenizer=str(tokenizer), out=str(tmp_path / name), workers=1,
                        progress=False))
    for name in ("same", "other"):
        (tmp_path / f"{name}.yaml").write_text(
            f"name: t\nmodel: {{init_from: {tmp_path / 'hf'}}}\n"
            f"data: {{dataset: {tmp_path / name}, seq_len: 64, micro_batch_size: 2}}\n"
            "train: {max_steps: 2}\nscheduler: {warmup_steps: 1}\ndevice: {backend: cpu}\n")
    assert main(["validate", str(tmp_path / "same.yaml")]) == 0
    assert main(["validate", str(tmp_path / "other.yaml")]) == 1
    err = capsys.readouterr().err
    assert "other.yaml:3: data.dataset: prepared with another tokenizer" in err and "--tokenizer" in err
    with pytest.raises(ConfigError, match="data.dataset: prepared with another tokenizer"):
        Trainer(load_spec(tmp_path / "other.yaml"), tmp_path / "state", Recorder())
    Trainer(load_spec(tmp_path / "same.yaml"), tmp_path / "state", Recorder())


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_rope_scaling_keeps_a_mixture_of_experts_and_qwen3s_norms(tmp_path, model_type):
    """The rope scaling's type once overwrote the model's: a Mixtral or Qwen3-MoE with llama3 rope
    scaling read as a dense model (and a Qwen3 without its q/k norms)."""
    from engine.hf.config import model_fields

    config = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 128, "vocab_size": 256, "rope_scaling": ROPE_LLAMA3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    fields = model_fields(tmp_path)
    assert fields["moe"]["top_k"] == (2 if model_type == "mixtral" else 8)
    assert fields.get("qk_norm", False) == (model_type == "qwen3_moe")
    assert fields["rope_scaling"]["rope_type"] == "llama3"

"""`tpud export` against the real thing: transformers loads what we write and computes our logits."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import transformers
from safetensors import safe_open

from engine.attention.sdpa import sdpa_attention
from engine.prepare.pipeline import prepare
from engine.prepare.options import Options
from engine.hf.export import ExportError, export
from engine.requests import Action, Request
from engine.models.llama import Transformer
from engine.train import Trainer
from tests.conftest import PYTHON, TINY_JOB, python_env
from testkit.corpus import docstrings, make_tokenizer, write
from testkit.recorders import Recorder
from tests.test_hf_import import hf_model, job
from tpud.cli import main

TRAIN = ["train.max_steps=3", "data.micro_batch_size=2", "data.seq_len=64", "scheduler.warmup_steps=1",
         "checkpoint.interval_steps=2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The demo job trained 3 steps on the CPU: committed steps 2 and 3, and the model in memory."""
    from engine.spec.loader import load_spec

    home = tmp_path_factory.mktemp("home")
    spec = load_spec(TINY_JOB, ["data.corpus_bytes=400000", *TRAIN])
    trainer = Trainer(spec, home / "state", Recorder())
    assert trainer.run() == 0
    return spec, home, trainer.model


def weights(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def step_dir(home, step):
    return home / "state" / "checkpoints" / "tiny-cpu" / f"step_{step:09d}"


def test_exported_model_loads_in_transformers_with_the_engines_logits(trained, tmp_path):
    spec, home, model = trained
    files = export(spec, step_dir(home, 3), tmp_path / "out", dtype="fp32", max_shard_bytes=400_000)
    names = {f.name for f in files}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1  # sharded at the limit
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(model(tokens))
        assert (ours - theirs.eval()(tokens).logits).abs().max().item() < 1e-4


def test_bf16_is_the_default_and_shards_hold_at_most_the_limit(trained, tmp_path):
    spec, home, model = trained
    export(spec, step_dir(home, 2), tmp_path / "out", max_shard_bytes=300_000)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    found = weights(tmp_path / "out")
    assert {t.dtype for t in found.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in found  # tied: transformers ties it to the embedding
    shards = list((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        assert shard.stat().st_size <= 300_000 + 4096  # the limit, plus the header
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(found)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in found.values())


def test_import_then_export_is_bitwise_identical_in_fp32(tmp_path):
    hf_model(tmp_path / "hf")  # sharded, untied, GQA, rope theta 500000
    spec = job(tmp_path / "hf", "data.micro_batch_size=2", "train.max_steps=2", "scheduler.warmup_steps=1")
    stop_at_start = Recorder({(0, 0): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)})
    Trainer(spec, tmp_path / "state", stop_at_start).run()
    (step,) = (tmp_path / "state" / "checkpoints" / "tiny-cpu").glob("step_*")
    export(spec, step, tmp_path / "out", dtype="fp32")
    original, exported = weights(tmp_path / "hf"), weights(tmp_path / "out")
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rope_theta", "tie_word_embeddings", "rms_norm_eps"):
        assert config[key] == source.get(key, source.get("rope_parameters", {}).get(key)), key


def test_tokenizer_of_the_dataset_comes_along_and_loads_with_auto_tokenizer(tmp_path):
    texts = docstrings(200)
    tok_dir = make_tokenizer(tmp_path / "tok", texts, vocab_size=400)
    src = write(tmp_path / "docs.jsonl", texts, "jsonl")
    prepare(Options(inputs=(str(src),), tokenizer=str(tok_dir), out=str(tmp_path / "data"), workers=1,
                    progress=False))
    from engine.spec.loader import load_spec

    spec = load_spec(TINY_JOB, [*TRAIN, f"data.dataset={tmp_path / 'data'}", "model.vocab_size=512"])
    Trainer(spec, tmp_path / "state", Recorder({(1, 0): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)})).run()
    (step,) = (tmp_path / "state" / "checkpoints" / "tiny-cpu").glob("step_*")
    export(spec, step, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.eos_token == "</s>" and tokenizer.bos_token == "<s>"
    from tokenizers import Tokenizer

    assert tokenizer("def main():")["input_ids"] == Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(
        "def main():").ids


def test_a_special_file_where_the_tokenizer_config_should_be_never_blocks_the_export(tmp_path):
    import os

    hf_model(tmp_path / "hf")
    make_tokenizer(tmp_path / "hf", docstrings(50), vocab_size=300)
    spec = job(tmp_path / "hf", "data.micro_batch_size=2", "train.max_steps=2", "scheduler.warmup_steps=1")
    Trainer(spec, tmp_path / "state", Recorder({(0, 0): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)})).run()
    (step,) = (tmp_path / "state" / "checkpoints" / "tiny-cpu").glob("step_*")
    (tmp_path / "hf" / "config.json").unlink()
    os.mkfifo(tmp_path / "hf" / "config.json")  # read as is, it would block forever
    export(spec, step, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()  # the tokenizer comes along, without the ids
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "bos_token_id" not in config and config["hidden_size"] == 64


def test_a_damaged_or_foreign_checkpoint_and_a_busy_output_are_refused(trained, tmp_path):
    spec, home, _ = trained
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        export(spec, step_dir(home, 2), out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    export(spec, step_dir(home, 2), out, overwrite=True)
    assert not (out / "mine.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old copy left behind

    from engine.spec.loader import load_spec

    wider = load_spec(TINY_JOB, ["data.corpus_bytes=400000", *TRAIN, "model.dim=256"])
    with pytest.raises(ExportError, match=r"model.tok_embeddings.weight has shape \[256, 128\], the job's model "
                       r"section gives \[256, 256\]"):
        export(wider, step_dir(home, 2), tmp_path / "other")

    with pytest.raises(ExportError, match="holds the checkpoint being exported"):
        export(spec, step_dir(home, 2), home / "state", overwrite=True)
    assert (step_dir(home, 2) / "manifest.json").is_file()

    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(step_dir(home, 2), damaged)
    data = next(damaged.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ExportError, match="damaged, not exported"):
        export(spec, damaged, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_cli_picks_steps_and_explains_what_is_missing(trained, tmp_path, capsys):
    spec, home, _ = trained
    assert main(["export", str(TINY_JOB), str(tmp_path / "a"), "--step", "2", "--home", str(home)]) == 0
    assert "exported step_000000002 of tiny-cpu" in capsys.readouterr().out
    assert main(["export", "--step", "7", str(TINY_JOB), str(tmp_path / "b"), "--home", str(home)]) == 1
    assert "no committed checkpoint of step 7 in" in (err := capsys.readouterr().err) and "(committed: 2, 3)" in err
    assert main(["export", str(TINY_JOB), str(tmp_path / "c"), "--home", str(tmp_path / "empty")]) == 1
    assert "no committed checkpoint in" in capsys.readouterr().err
    assert main(["export", str(TINY_JOB), str(tmp_path / "d"), "--tier", "gcs", "--home", str(home)]) == 1
    assert "checkpoint.remote is not set" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(TINY_JOB), str(tmp_path / "e"), "--max-shard-size", "lots"])
    assert "not a size: 'lots'" in capsys.readouterr().err


@pytest.mark.slow
def test_export_from_the_gcs_tier_on_a_fresh_host(trained, tmp_path, gcs_server):
    """The checkpoint exists only on GCS (a recreated VM): `tpud export --tier gcs` downloads and exports it."""
    from tpud.gcs.tier import GcsTier

    spec, home, _ = trained
    remote = "gs://tpud-test/ckpt"
    GcsTier(remote, spec.name).upload_step(step_dir(home, 3))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"include: {json.dumps(str(TINY_JOB))}\ncheckpoint: {{remote: {remote}}}\n")
    out = subprocess.run([PYTHON, "-m", "tpud", "export", str(job_file), str(tmp_path / "out"), "--tier", "gcs",
                          "--dtype", "fp32", "--home", str(tmp_path / "fresh")],
                         capture_output=True, text=True, env=python_env(**gcs_server.env()), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "exported step_000000003" in out.stdout
    exported = weights(tmp_path / "out")
    assert torch.equal(exported["model.embed_tokens.weight"], trained[2].tok_embeddings.weight)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the download is gone

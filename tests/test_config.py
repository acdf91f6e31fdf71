"""Job files: includes, overrides, located errors, and the `tpud validate` / `tpud schema` CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.spec.loader import OVERRIDE_FILE, Problem, SpecError, dump_schema, load_job, load_spec
from tpud.cli import main
from testkit.helpers import write

REPO = Path(__file__).resolve().parents[1]



def problems(path: Path, overrides: Sequence[str] = ()) -> list[Problem]:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return info.value.problems


def only_problem(path: Path, overrides: Sequence[str] = ()) -> Problem:
    found = problems(path, overrides)
    assert len(found) == 1, found
    return found[0]


# --- includes ---


def test_top_level_include_merges_deeply_and_own_keys_win(tmp_path):
    write(tmp_path, "models/tiny.yaml", """
        model: {dim: 96, n_layers: 2, n_heads: 4}
        train: {max_steps: 7}
    """)
    job = write(tmp_path, "jobs/job.yaml", """
        include: ../models/tiny.yaml
        model:
          n_layers: 3
    """)
    spec = load_spec(job)
    assert (spec.model.dim, spec.model.n_layers, spec.model.n_heads) == (96, 3, 4)
    assert spec.train.max_steps == 7


def test_later_include_wins_and_includes_resolve_relative_to_their_own_file(tmp_path):
    write(tmp_path, "models/base.yaml", "model: {dim: 64, n_heads: 2, n_layers: 5}\n")
    write(tmp_path, "models/wide.yaml", "include: base.yaml\nmodel: {dim: 256}\n")
    write(tmp_path, "models/deep.yaml", "model: {n_layers: 9}\n")
    job = write(tmp_path, "jobs/job.yaml", "include: [../models/wide.yaml, ../models/deep.yaml]\n")
    spec = load_spec(job)
    assert (spec.model.dim, spec.model.n_heads, spec.model.n_layers) == (256, 2, 9)


def test_nested_include_merges_at_its_own_level(tmp_path):
    write(tmp_path, "attention/splash.yaml", """
        kernel: splash
        splash: {block_q: 128, block_kv: 128}
    """)
    job = write(tmp_path, "jobs/job.yaml", """
        attention:
          include: ../attention/splash.yaml
          splash: {block_kv: 64}
    """)
    spec = load_spec(job)
    assert spec.attention.kernel == "splash"
    assert (spec.attention.splash.block_q, spec.attention.splash.block_kv) == (128, 64)


def test_include_cycle_is_reported_at_the_include_that_closes_it(tmp_path):
    a = write(tmp_path, "a.yaml", "include: b.yaml\n")
    b = write(tmp_path, "b.yaml", "train: {seed: 1}\ninclude: a.yaml\n")
    problem = only_problem(a)
    assert (problem.file, problem.line, problem.key) == (str(b), 2, "include")
    assert "cycle" in problem.message and "a.yaml" in problem.message


def test_missing_include_names_the_including_file_and_line(tmp_path):
    job = write(tmp_path, "jobs/job.yaml", """
        train: {seed: 1}
        attention:
          include: ../attention/nope.yaml
    """)
    problem = only_problem(job)
    assert (problem.file, problem.line, problem.key) == (str(job), 3, "attention.include")
    assert "nope.yaml" in problem.message
    assert str(problem).startswith(f"{job}:3: attention.include: ")


def test_include_of_a_non_mapping_is_an_error(tmp_path):
    write(tmp_path, "list.yaml", "- 1\n- 2\n")
    job = write(tmp_path, "job.yaml", "include: list.yaml\n")
    problem = only_problem(job)
    assert (problem.file, problem.line) == (str(job), 1)
    assert "mapping" in problem.message


def test_problems_inside_an_included_file_name_that_file(tmp_path):
    model = write(tmp_path, "models/tiny.yaml", "model:\n  dim: 64\n  n_layerz: 2\n")
    job = write(tmp_path, "jobs/job.yaml", "include: ../models/tiny.yaml\n")
    problem = only_problem(job)
    assert (problem.file, problem.line, problem.key) == (str(model), 3, "model.n_layerz")


# --- YAML and schema errors ---


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    job = write(tmp_path, "job.yaml", """
        model:
          dim: 128
          n_layers: 2: 3
    """)
    problem = only_problem(job)
    assert (problem.file, problem.line) == (str(job), 3)
    assert "YAML" in problem.message


def test_top_level_must_be_a_mapping(tmp_path):
    job = write(tmp_path, "job.yaml", "- train\n")
    assert "mapping" in only_problem(job).message


def test_duplicate_key_is_an_error(tmp_path):
    job = write(tmp_path, "job.yaml", "train:\n  seed: 1\n  seed: 2\n")
    problem = only_problem(job)
    assert (problem.line, problem.key) == (3, "train.seed")
    assert "line 2" in problem.message


def test_unknown_key_lists_the_expected_keys(tmp_path):
    job = write(tmp_path, "job.yaml", """
        train:
          seed: 3
          max_stepz: 10
    """)
    problem = only_problem(job)
    assert (problem.file, problem.line, problem.key) == (str(job), 3, "train.max_stepz")
    assert "unknown key; expected one of: max_steps, grad_accum_steps, seed" in problem.message
    assert str(problem).startswith(f"{job}:3: train.max_stepz: unknown key")


def test_wrong_type_names_file_line_key_and_value(tmp_path):
    job = write(tmp_path, "job.yaml", """
        train:
          max_steps: lots
    """)
    problem = only_problem(job)
    assert (problem.file, problem.line, problem.key) == (str(job), 2, "train.max_steps")
    assert "integer" in problem.message and "'lots'" in problem.message


def test_cross_section_problem_names_its_key_and_line(tmp_path):
    job = write(tmp_path, "job.yaml", """
        model: {max_seq_len: 512}
        data:
          micro_batch_size: 2
          seq_len: 1024
    """)
    problem = only_problem(job)
    assert (problem.file, problem.line, problem.key) == (str(job), 4, "data.seq_len")
    assert "max_seq_len (512)" in problem.message


def test_exponent_without_a_dot_is_a_float_in_files(tmp_path):
    # PyYAML's YAML 1.1 rules read 1e3 as a string, which an int field rejects.
    spec = load_spec(write(tmp_path, "job.yaml", "train: {seed: 1e3}\noptimizer: {lr: 3e-4}\n"))
    assert spec.train.seed == 1000
    assert spec.optimizer.lr == pytest.approx(3e-4)


# --- overrides ---


def test_overrides_coerce_types(tmp_path):
    job = write(tmp_path, "job.yaml", "model: {n_kv_heads: 2}\n")
    spec = load_spec(job, [
        "train.max_steps=50",
        "train.seed=2e1",
        "optimizer.lr=3e-4",
        "model.tie_embeddings=false",
        "optimizer.betas=[0.8, 0.99]",
        "model.n_kv_heads=null",
    ])
    assert spec.train.max_steps == 50
    assert spec.train.seed == 20
    assert spec.optimizer.lr == pytest.approx(3e-4)
    assert spec.model.tie_embeddings is False
    assert spec.optimizer.betas == (0.8, 0.99)
    assert spec.model.n_kv_heads is None


def test_overrides_apply_after_includes(tmp_path):
    write(tmp_path, "base.yaml", "train: {max_steps: 10, seed: 4}\n")
    job = write(tmp_path, "job.yaml", "include: base.yaml\n")
    spec = load_spec(job, ["train.max_steps=20"])
    assert (spec.train.max_steps, spec.train.seed) == (20, 4)


def test_a_valid_key_is_located_where_it_was_set_include_or_override(tmp_path):
    """Messages about keys that validated but may not run here (tpud's refusals) point at their origin."""
    write(tmp_path, "base.yaml", "# shared\ndebug:\n  inject: {crash_at_step: 3}\n")
    job = write(tmp_path, "job.yaml", "include: base.yaml\ntrain:\n  seed: 1\n")
    loaded = load_job(job, ["train.max_steps=20"])
    assert str(loaded.problem("debug.inject", "refused")) == f"{tmp_path / 'base.yaml'}:3: debug.inject: refused"
    assert str(loaded.problem("train.seed", "x")) == f"{job}:3: train.seed: x"
    assert str(loaded.problem("train.max_steps", "x")) == f"{OVERRIDE_FILE}: train.max_steps: x [override 'train.max_steps=20']"
    assert str(loaded.problem("train.grad_clip", "x")) == f"{job}:2: train.grad_clip: x"  # unset: its section's line


@pytest.mark.parametrize("text", ["train.max_steps", "=5", "train..seed=1"])
def test_malformed_override_is_an_error(tmp_path, text):
    problem = only_problem(write(tmp_path, "job.yaml", "{}\n"), [text])
    assert problem.file == OVERRIDE_FILE
    assert repr(text) in problem.message


def test_unknown_override_key_is_located_at_the_override(tmp_path):
    job = write(tmp_path, "job.yaml", "train: {seed: 1}\n")
    problem = only_problem(job, ["train.max_stepz=5"])
    assert (problem.file, problem.line, problem.key) == (OVERRIDE_FILE, None, "train.max_stepz")
    assert "unknown key; expected one of:" in problem.message
    assert "'train.max_stepz=5'" in problem.message


def test_unparsable_override_value_is_an_error(tmp_path):
    problem = only_problem(write(tmp_path, "job.yaml", "{}\n"), ["optimizer.betas=[0.9,"])
    assert (problem.file, problem.key) == (OVERRIDE_FILE, "optimizer.betas")


# --- name ---


def test_name_defaults_to_the_lowercased_file_stem(tmp_path):
    assert load_spec(write(tmp_path, "Tiny-CPU.yaml", "{}\n")).name == "tiny-cpu"
    assert load_spec(write(tmp_path, "other.yaml", "name: chosen\n")).name == "chosen"


# --- CLI ---


def test_validate_exit_codes_and_messages(tmp_path, capsys):
    good = write(tmp_path, "good.yaml", "name: good-job\n")
    bad = write(tmp_path, "bad.yaml", "train:\n  max_stepz: 5\n")

    assert main(["validate", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok (job good-job)\n"

    assert main(["validate", str(good), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert f"{good}: ok (job good-job)" in out
    assert err.startswith(f"{bad}:2: train.max_stepz: unknown key; expected one of:")


def test_validate_applies_set_overrides(tmp_path, capsys):
    good = write(tmp_path, "good.yaml", "{}\n")
    assert main(["validate", str(good), "--set", "train.max_steps=0"]) == 1
    assert f"{OVERRIDE_FILE}: train.max_steps: " in capsys.readouterr().err


def test_validate_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2


def test_schema_is_json_with_sections_and_include(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "model" in schema["properties"]
    assert "dim" in schema["$defs"]["ModelConfig"]["properties"]
    assert "include" in schema["properties"]
    assert "include" in schema["$defs"]["AttentionConfig"]["properties"]
    assert "name" not in schema.get("required", [])  # load_spec defaults it
    assert json.loads(dump_schema()) == schema


# --- the repository's configs: jobs, and the presets and fragments they include ---

CONFIG_FILES = sorted((REPO / "configs").rglob("*.y*ml"))


def test_repository_has_example_jobs_presets_and_attention_configs():
    folders = {p.parent.name for p in CONFIG_FILES}
    assert {"jobs", "models", "attention"} <= folders


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_file_validates(path, capsys):
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def test_tpu_examples_select_splash_on_xla_and_the_8b_preset_is_llama3():
    spec = load_spec(REPO / "configs" / "jobs" / "llama3-8b-v6e-256.yaml")
    assert (spec.attention.kernel, spec.device.backend) == ("splash", "xla")
    m = spec.model
    assert (m.dim, m.hidden_dim, m.n_layers, m.n_heads, m.kv_heads, m.vocab_size, m.rope_theta) == (
        4096, 14336, 32, 32, 8, 128256, 500000.0)


def test_validate_checks_a_prepared_dataset_against_the_model(tmp_path, capsys):
    from engine.prepare.pipeline import prepare
    from engine.prepare.options import Options

    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    prepare(Options(inputs=(str(tmp_path / "in.jsonl"),), tokenizer="bytes", out=str(tmp_path / "data" / "ds"),
                    workers=1, progress=False))
    job = write(tmp_path, "job.yaml", "name: d\ndata:\n  dataset: data/ds\nmodel:\n  vocab_size: 256\n")
    assert main(["validate", str(job)]) == 1
    err = capsys.readouterr().err
    assert f"{job}:5: model.vocab_size: 256 is smaller than the vocabulary of data.dataset's tokenizer (257)" in err
    assert main(["validate", str(job), "--set", "model.vocab_size=320"]) == 0  # relative to the job file
    missing = write(tmp_path, "missing.yaml", "data:\n  dataset: nowhere\n")
    assert main(["validate", str(missing)]) == 1
    assert f"{missing}:2: data.dataset: {tmp_path / 'nowhere'}: not a prepared dataset" in capsys.readouterr().err


def test_data_sources_and_eval_are_checked_together(tmp_path, capsys):
    both = write(tmp_path, "both.yaml", "data:\n  dataset: a\n  mixture: [{dataset: b, weight: 1}]\n")
    assert main(["validate", str(both)]) == 1
    assert "give data.dataset or data.mixture, not both" in capsys.readouterr().err
    tiny = write(tmp_path, "tiny.yaml", "data:\n  mixture: [{dataset: a, weight: 1000}, {dataset: b, weight: 0.5}]\n")
    assert main(["validate", str(tiny)]) == 1
    assert "data.mixture.1.weight: is 0.05% of the mixture" in capsys.readouterr().err
    no_val = write(tmp_path, "eval.yaml", "eval: {batches: 2}\n")
    assert main(["validate", str(no_val)]) == 1
    assert "eval: needs data.dataset or data.mixture" in capsys.readouterr().err

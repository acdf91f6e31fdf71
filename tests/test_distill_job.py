"""Distillation as a job runs it (`distill:`): a teacher from a tpud checkpoint or a Hugging Face
directory, refused when its vocabulary or tokenizer is not the student's or when it changed under
a resume, and a run SIGKILLed mid-way that ends bit for bit as the uninterrupted one."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch

from engine import events
from engine.errors import ConfigError
from engine.spec.loader import SpecError
from engine.train import Trainer
from tests.conftest import PYTHON, TINY_JOB, python_env, tiny
from tests.test_train import run as train
from testkit.recorders import StepLosses

SHORT = ("train.log_interval=4", "scheduler.warmup_steps=2", "data.micro_batch_size=4", "data.seq_len=64",
         "checkpoint.interval_steps=0")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A teacher's checkpoint directory: the tiny model trained 20 steps (its newest commit, step 20)."""
    home = tmp_path_factory.mktemp("teacher")
    train(tiny(*SHORT, "name=teacher", "train.max_steps=20"), home)
    return home / "checkpoints" / "teacher"


def student(teacher_dir, *overrides):
    return tiny(*SHORT, "name=student", "model.dim=64", "model.n_layers=2", "model.ffn_dim=192",
                f"distill.teacher={teacher_dir}", *overrides)


def test_the_student_learns_the_teachers_distribution_and_nothing_of_the_teacher_is_trained_or_saved(teacher, tmp_path):
    from testkit.states import checkpoint_state

    trainer, hooks, code = train(student(teacher, "train.max_steps=6", "checkpoint.interval_steps=3"), tmp_path)
    assert code == 0 and len(hooks.losses) == 6
    saved = checkpoint_state(teacher / "step_000000020", tmp_path)["model"]
    for name, param in trainer.teacher_model.named_parameters():  # the committed teacher, untouched by training
        assert torch.equal(param, saved[name]), name
    assert hooks.losses[-1] < hooks.losses[0] - 0.3  # the divergence from the teacher falls
    for step in hooks.of(events.Step):  # alpha 0: the loss is the divergence; the hard CE is reported beside it
        assert step.distill_divergence == pytest.approx(step.loss, rel=1e-5) and step.distill_ce > step.loss
    assert all(not p.requires_grad and p.grad is None for p in trainer.teacher_model.parameters())
    assert not trainer.teacher_model.training and trainer.module.model.training
    committed = json.loads((tmp_path / "checkpoints" / "student" / "step_000000006" / "manifest.json").read_text())
    names = {f["path"] for f in committed["files"]}
    assert committed["fingerprint"]["distill.teacher_identity"] == trainer.teacher.identity
    metadata = torch.distributed.checkpoint.FileSystemReader(
        str(tmp_path / "checkpoints" / "student" / "step_000000006")).read_metadata().state_dict_metadata
    assert names and not any("teacher" in key for key in metadata)  # the student's state alone
    assert sum(m.size.numel() for k, m in metadata.items() if k.startswith("model.")) == sum(
        p.numel() for p in trainer.model.parameters())


def test_with_alpha_one_distillation_is_the_hard_label_run(teacher, tmp_path):
    """alpha weighs the hard-label cross-entropy: at 1 the teacher has no say, at 0 only the teacher."""
    _, hard, _ = train(tiny(*SHORT, "name=student", "model.dim=64", "model.n_layers=2", "model.ffn_dim=192",
                            "train.max_steps=3"), tmp_path / "hard")
    _, alpha1, _ = train(student(teacher, "train.max_steps=3", "distill.alpha=1"), tmp_path / "alpha1")
    _, alpha0, _ = train(student(teacher, "train.max_steps=3"), tmp_path / "alpha0")
    assert alpha1.losses == pytest.approx(hard.losses, rel=1e-5)
    assert alpha0.losses[0] != pytest.approx(hard.losses[0], rel=1e-2)


def test_a_checkpoint_and_its_hugging_face_export_teach_alike(teacher, hf_teacher, tmp_path):
    exported = hf_teacher
    _, from_checkpoint, _ = train(student(teacher, "train.max_steps=3"), tmp_path / "a")
    trainer, from_hf, _ = train(student(exported, "train.max_steps=3"), tmp_path / "b")
    assert trainer.teacher.source.kind == "hf"
    assert from_hf.losses == from_checkpoint.losses


def test_a_teacher_of_another_vocabulary_or_none_at_all_is_refused_naming_the_key(teacher, tmp_path):
    with pytest.raises(SpecError) as refused:
        student(teacher, "model.vocab_size=300")
    assert "distill.teacher" in str(refused.value) and "256 tokens" in str(refused.value)
    with pytest.raises(SpecError, match="distill.teacher: .*no such directory"):
        student(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match="distill.teacher: .*neither config.json"):
        student(tmp_path / "empty")
    with pytest.raises(SpecError, match="loss.z_loss: .*does not apply to distillation"):
        student(teacher, "loss.z_loss=1e-4")


HIDDEN = 'distill.hidden={"layers": [[1, 2], [2, 4]], "weight": 1.0}'


def test_hidden_states_train_projections_that_are_checkpointed_resumed_bitwise_and_left_out_of_the_export(
        teacher, tmp_path):
    """The student (width 64) learns the teacher's (width 128) 2nd and 4th block outputs through two
    projections: trained with it, in its checkpoints, restored by a resume, not in its export."""
    from safetensors import safe_open

    from engine.hf.export import export
    from testkit.states import checkpoint_state
    from tests.test_checkpoint import assert_same_training_state
    from testkit.recorders import Recorder

    from engine.hooks import Boundary
    from engine.requests import Action, Request

    spec = student(teacher, "train.max_steps=8", "checkpoint.interval_steps=4", "train.log_interval=1", HIDDEN)
    whole, hooks, code = train(spec, tmp_path / "whole")
    assert code == 0
    projections = whole.model.distill_projections
    assert [tuple(p.weight.shape) for p in projections] == [(128, 64), (128, 64)]
    assert all(p.weight in whole.optimizer.state for p in projections)  # trained like the student's weights
    steps = hooks.of(events.Step)
    assert steps[-1].distill_hidden < 0.8 * steps[0].distill_hidden  # the student's blocks come nearer the teacher's
    for step in steps:  # the step's loss stays the distribution's; the hidden error is added beside it
        assert step.distill_divergence == pytest.approx(step.loss, rel=1e-5)
    final = tmp_path / "whole" / "checkpoints" / "student" / "step_000000008"
    saved = checkpoint_state(final, tmp_path)["model"]
    assert torch.equal(saved["distill_projections.1.weight"], projections[1].weight)

    cut = Trainer(spec, tmp_path / "cut", Recorder({Boundary(6, 0): Request(Action.STOP)}))
    cut.run()
    resumed = Trainer(spec, tmp_path / "cut", Recorder())
    assert resumed.progress.step in (4, 6) and resumed.run() == 0
    assert_same_training_state(whole, resumed)

    export(spec, final, tmp_path / "hf", dtype="fp32")
    names = set()
    for file in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    assert names and not any("distill" in name for name in names)
    # The export starts another student: its weights from there, its projections drawn afresh.
    again, _, code = train(student(teacher, "train.max_steps=3", f"model.init_from={tmp_path / 'hf'}", HIDDEN),
                           tmp_path / "again")
    assert code == 0 and len(again.model.distill_projections) == 2


def test_hidden_state_pairs_are_refused_where_a_model_has_no_such_block_or_the_teacher_is_offline(teacher):
    with pytest.raises(SpecError, match=r"distill.hidden.layers: .*past model.n_layers \(2\)"):
        student(teacher, 'distill.hidden={"layers": [[3, 1]], "weight": 1}')
    with pytest.raises(SpecError, match=r"distill.hidden.layers: names the teacher's block 5; .* has 4"):
        student(teacher, 'distill.hidden={"layers": [[1, 5]], "weight": 1}')
    with pytest.raises(SpecError, match="distill.hidden: needs a teacher model"):
        tiny(*SHORT, "distill.teacher=offline", 'distill.hidden={"layers": [[1, 1]], "weight": 1}')


def test_the_hidden_state_loss_is_the_mean_squared_error_over_the_kept_tokens():
    from torch import nn

    from engine.data.batch import IGNORE
    from engine.distill.hidden import hidden_loss

    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)]
    theirs = [torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 6, generator=g)]
    targets = torch.randint(0, 9, (2, 5), generator=g)
    targets[0, :2] = IGNORE
    projections = nn.ModuleList(nn.Linear(4, 6, bias=False) for _ in range(2))
    kept = targets.flatten() != IGNORE
    by_hand = sum(((p(a.flatten(0, 1)[kept]) - b.flatten(0, 1)[kept]) ** 2).mean()
                  for p, a, b in zip(projections, ours, theirs)) / 2
    torch.testing.assert_close(hidden_loss(ours, theirs, projections, targets), by_hand)
    torch.testing.assert_close(hidden_loss(ours[:1], ours[:1], None, targets), torch.tensor(0.0))


def word_tokenizer(path, vocab, special=()):
    """A tokenizer.json of whole words (the tokenizers library's WordLevel) with these ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special))
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def hf_teacher(teacher, tmp_path_factory):
    """The teacher's step 20 exported as a Hugging Face directory (fp32: the same weights)."""
    from engine.hf.export import export

    out = tmp_path_factory.mktemp("hf") / "teacher"
    export(tiny(*SHORT, "name=teacher"), teacher / "step_000000020", out, dtype="fp32")
    return out


def test_tokenizers_are_compared_by_what_the_models_see(tmp_path):
    from engine.distill.teacher import tokenizer_difference

    words = {"<unk>": 0, "a": 1, "b": 2}
    ours = word_tokenizer(tmp_path / "a.json", words, ["</s>"])
    assert tokenizer_difference(ours, word_tokenizer(tmp_path / "same.json", dict(words), ["</s>"])) is None
    swapped = tokenizer_difference(ours, word_tokenizer(tmp_path / "b.json", {"<unk>": 0, "b": 1, "a": 2}, ["</s>"]))
    assert "4 (token, id) pairs in one only" in swapped and "'a'=1" in swapped
    # The same ids, but </s> an ordinary word in one of them.
    assert "special tokens" in tokenizer_difference(ours, word_tokenizer(tmp_path / "c.json", {**words, "</s>": 3}))
    (tmp_path / "bad.json").write_text("{not json")
    assert "unreadable tokenizer" in tokenizer_difference(ours, tmp_path / "bad.json")


def test_a_teacher_with_another_tokenizer_than_the_datas_is_refused_by_the_worker(hf_teacher, tmp_path):
    import shutil

    from engine.prepare.options import Options
    from engine.prepare.pipeline import prepare

    words = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3}
    source = tmp_path / "docs.jsonl"
    source.write_text(('{"text": "' + "a b b a " * 500 + '"}\n') * 5)
    prepare(Options(inputs=(str(source),), tokenizer=str(word_tokenizer(tmp_path / "words.json", words, ["</s>"])),
                    out=str(tmp_path / "data"), workers=1, progress=False))
    same, other = tmp_path / "same-teacher", tmp_path / "other-teacher"
    for directory, vocab in ((same, dict(words)), (other, {"<unk>": 0, "</s>": 1, "b": 2, "a": 3})):
        shutil.copytree(hf_teacher, directory)
        word_tokenizer(directory / "tokenizer.json", vocab, ["</s>"])
    Trainer(student(same, f"data.dataset={tmp_path / 'data'}"), tmp_path / "a", StepLosses())  # accepted
    with pytest.raises(ConfigError, match="the teacher's tokenizer is not the student's") as refused:
        Trainer(student(other, f"data.dataset={tmp_path / 'data'}"), tmp_path / "b", StepLosses())
    assert refused.value.key == "distill.teacher"


def test_a_damaged_teacher_checkpoint_is_refused_before_training(teacher, tmp_path):
    import shutil

    damaged = tmp_path / "teacher" / "step_000000020"
    shutil.copytree(teacher / "step_000000020", damaged)
    shard = max(damaged.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, one byte flipped
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="damaged, not loaded: .*CRC32C mismatch"):
        Trainer(student(damaged.parent), tmp_path / "home", StepLosses())
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SpecError, match="distill.teacher: .*not a directory"):
        student(tmp_path / "a-file")


def test_a_changed_teacher_is_refused_on_resume_unless_the_job_allows_it(teacher, tmp_path):
    home = tmp_path / "student"
    _, _, code = train(student(teacher, "train.max_steps=4"), home)
    assert code == 0
    # The teacher trains on: its newest commit, the one distill.teacher names, is another model.
    moved = tmp_path / "teacher-home"
    train(tiny(*SHORT, "name=teacher", "train.max_steps=3"), moved)
    with pytest.raises(ConfigError, match="distilled from another teacher") as refused:
        Trainer(student(moved / "checkpoints" / "teacher", "train.max_steps=6"), home, StepLosses())
    assert refused.value.key == "distill.teacher"
    _, hooks, code = train(student(moved / "checkpoints" / "teacher", "train.max_steps=6",
                                   "checkpoint.allow_spec_changes=[distill]"), home)
    assert code == 0 and [e.step for e in hooks.of(events.Step)] == [5, 6]


@pytest.mark.slow
def test_a_distilled_run_killed_mid_way_ends_bit_for_bit_as_the_uninterrupted_one(teacher, tmp_path):
    from engine.checkpoint.manifest import committed_steps
    from testkit.states import assert_same_state, checkpoint_state

    args = [*SHORT, "train.max_steps=12", "train.log_interval=1", "checkpoint.interval_steps=4", "name=student",
            "model.dim=64", "model.n_layers=2", "model.ffn_dim=192", f"distill.teacher={teacher}",
            "data.corpus_bytes=400000"]

    def start(home):
        return subprocess.Popen([PYTHON, "-m", "engine.train", str(TINY_JOB), *args, "--state-dir", str(home)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=python_env())

    whole = tmp_path / "whole"
    train(tiny(*args), whole)
    cut = tmp_path / "cut"
    run = start(cut)
    # Killed after step 5 and step 4's commit, whichever comes last: step 4's save is async and a
    # loaded machine can run step 5 before that save commits.
    seen_step, seen_commit = False, False
    for line in run.stdout:
        record = json.loads(line)
        seen_step |= record["event"] == "step" and record["step"] >= 5
        seen_commit |= record["event"] == "checkpoint committed" and record["step"] >= 4
        if seen_step and seen_commit:
            run.send_signal(signal.SIGKILL)
            break
    assert run.wait() == -signal.SIGKILL
    # Step 4's commit, or step 8's where the worker ran ahead of this reader on a loaded machine.
    newest = max(step for step, _, _ in committed_steps(cut / "checkpoints" / "student"))
    resumed = start(cut)
    records = [json.loads(line) for line in resumed.stdout]
    assert resumed.wait() == 0
    assert newest < 12 and [r["step"] for r in records if r["event"] == "step"] == list(range(newest + 1, 13))
    final = "checkpoints/student/step_000000012"
    assert_same_state(checkpoint_state(whole / final, tmp_path), checkpoint_state(cut / final, tmp_path))


def test_under_fsdp2_the_teacher_is_sharded_with_the_student_and_the_loss_and_gradients_are_the_plain_ones(tmp_path):
    """One rank's gloo group is enough for FSDP2's arithmetic (tests/test_fsdp.py): every weight of
    both models is a DTensor, the frozen teacher's head is gathered in the root's group for the loss;
    the student's hidden-state projections (distill.hidden) are sharded there too, their gradients the plain ones."""
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from engine.attention.sdpa import sdpa_attention
    from engine.backends.torch_native import TorchBackend
    from engine.distill.hidden import attach
    from engine.losses import build_distill_loss, build_loss
    from engine.models.llama import Transformer, initial_values
    from engine.train import LanguageModel
    from tests.test_fsdp import ShardedBackend

    from engine.spec.schema import DistillConfig, LossConfig

    model_cfg = tiny(*SHORT).model
    teacher_cfg = tiny(*SHORT, "model.dim=64", "model.n_layers=2", "model.ffn_dim=192").model
    distill = DistillConfig(teacher="unused", loss="jsd", alpha=0.25, temperature=2.0, chunk_tokens=40,
                            hidden={"layers": [[1, 1], [4, 2]], "weight": 0.5})
    with torch.device("meta"):
        student_lazy, teacher_lazy = Transformer(model_cfg, sdpa_attention), Transformer(teacher_cfg, sdpa_attention)
        attach(student_lazy, distill.hidden, teacher_cfg)  # its projections join the root's group
    teacher_lazy.requires_grad_(False)

    def language_model(student, teacher):
        return LanguageModel(student, build_loss(LossConfig(), model_cfg, 128), teacher, build_distill_loss(distill),
                             distill.hidden)

    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(4))
    results = []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        for backend in (TorchBackend("cpu"), ShardedBackend()):
            student, teacher = copy.deepcopy(student_lazy), copy.deepcopy(teacher_lazy)
            module = language_model(student, teacher)
            backend.shard(module)
            backend.materialise(student, initial_values(student, torch.Generator().manual_seed(1)))
            backend.materialise(teacher, initial_values(teacher, torch.Generator().manual_seed(2)))
            loss, extras = module(tokens[:, :-1], tokens[:, 1:])
            (loss + extras[0]).backward()  # with the hidden states' error, as the trainer adds it
            grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in student.parameters()]
            results.append((torch.cat([loss.detach().reshape(1), extras.detach()]), grads))
            if isinstance(backend, ShardedBackend):
                assert all(isinstance(p, DTensor) for p in module.parameters())
                assert all(p.grad is None for p in teacher.parameters())
    finally:
        dist.destroy_process_group()
    (plain_loss, plain_grads), (sharded_loss, sharded_grads) = results
    torch.testing.assert_close(sharded_loss, plain_loss)
    for a, b in zip(sharded_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_models_by_hub_id_come_from_the_hugging_face_cache_offline(hf_teacher, tmp_path, monkeypatch):
    """`org/name[@revision]` where a model directory is taken: resolved by huggingface_hub in its
    cache (a machine with a warm cache, HF_HUB_OFFLINE=1), here a cache laid out as the library does."""
    import shutil

    import huggingface_hub.constants

    exported = hf_teacher
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tpud-test--teacher"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(exported, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    trainer, by_id, _ = train(student("tpud-test/teacher@main", "train.max_steps=3"), tmp_path / "a")
    assert trainer.teacher.source.path == str(repo / "snapshots" / commit)
    _, by_path, _ = train(student(exported, "train.max_steps=3"), tmp_path / "b")
    assert by_id.losses == by_path.losses
    # model.init_from takes one too: the model section from its config.json, the weights from its snapshot.
    from safetensors.torch import load_file

    spec = tiny(*SHORT, "name=student", "model.init_from=tpud-test/teacher")
    assert spec.model.init_from == "tpud-test/teacher" and spec.model.dim == 128
    started = Trainer(spec, tmp_path / "c", StepLosses())
    torch.testing.assert_close(started.model.tok_embeddings.weight,
                               load_file(exported / "model.safetensors")["model.embed_tokens.weight"], rtol=0, atol=0)
    # tpud prepare --tokenizer takes one: the tokenizer files of the snapshot.
    import argparse

    from engine.prepare import command

    word_tokenizer(repo / "snapshots" / commit / "tokenizer.json", {"<unk>": 0, "a": 1, "</s>": 2}, ["</s>"])
    (tmp_path / "docs.jsonl").write_text('{"text": "a a a"}\n' * 20)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "docs.jsonl"), "--tokenizer", "tpud-test/teacher", "--out",
                              str(tmp_path / "data"), "--workers", "0", "--no-progress"])
    assert command.run(args) == 0
    assert (tmp_path / "data" / "tokenizer.json").read_text() == (repo / "snapshots" / commit / "tokenizer.json").read_text()
    args = parser.parse_args([str(tmp_path / "docs.jsonl"), "--tokenizer", "tpud-test/none", "--out",
                              str(tmp_path / "data2"), "--workers", "0", "--no-progress"])
    assert command.run(args) == 1 and not (tmp_path / "data2" / "manifest.json").exists()
    with pytest.raises(SpecError, match="distill.teacher: tpud-test/other: not in the Hugging Face cache"):
        student("tpud-test/other")
    with pytest.raises(SpecError, match="model.init_from: tpud-test/teacher@v2: no such revision|not in the"):
        tiny(*SHORT, "model.init_from=tpud-test/teacher@v2")


# --- an offline teacher: its top k stored with the data (tpud prepare --teacher) ---


@pytest.fixture(scope="module")
def offline_data(tmp_path_factory):
    """A bytes dataset, a teacher trained on it (tiny, vocabulary 264), and the teacher's top 264 (the
    whole vocabulary) stored beside the dataset for windows of 65 tokens."""
    from engine.distill.offline import annotate
    from engine.prepare.options import Options
    from engine.prepare.pipeline import prepare
    from testkit import corpus

    root = tmp_path_factory.mktemp("offline")
    source = corpus.write(root / "docs.jsonl", corpus.docstrings(60), "jsonl")  # ~140 windows: 20 MB of top k
    prepare(Options(inputs=(str(source),), tokenizer="bytes", out=str(root / "data"), workers=1, progress=False))
    train(tiny(*SHORT, "name=teacher", "train.max_steps=10", f"data.dataset={root / 'data'}", "model.vocab_size=264"),
          root / "home")
    teacher = root / "home" / "checkpoints" / "teacher"
    annotate(root / "data", str(teacher), 264, 64, models_cache=root / "models")
    return root / "data", teacher


def offline_student(data, teacher, *overrides):
    return tiny(*SHORT, "name=student", "model.dim=64", "model.n_layers=2", "model.ffn_dim=192", "model.vocab_size=264",
                f"data.dataset={data}", f"distill.teacher={teacher}", *overrides)


def test_an_offline_teacher_of_the_whole_vocabulary_trains_the_student_as_the_teacher_in_memory_does(offline_data,
                                                                                                    tmp_path):
    data, teacher = offline_data
    _, online, _ = train(offline_student(data, teacher, "train.max_steps=3"), tmp_path / "online")
    trainer, offline, _ = train(offline_student(data, teacher, "train.max_steps=3", "distill.teacher=offline"),
                                tmp_path / "offline")
    assert trainer.teacher_model is None and trainer.loss_name == "distill:offline"
    assert offline.losses == pytest.approx(online.losses, rel=1e-5)
    steps = offline.of(events.Step)
    assert all(s.distill_divergence == pytest.approx(s.loss, rel=1e-5) for s in steps)
    committed = json.loads((tmp_path / "offline" / "checkpoints" / "student" / "step_000000003" / "manifest.json")
                           .read_text())
    assert committed["fingerprint"]["distill.teacher_identity"].endswith(":k264:t1")


def test_an_offline_teacher_is_refused_where_it_does_not_fit_the_job(offline_data, tmp_path):
    data, teacher = offline_data
    with pytest.raises(ConfigError, match="data.seq_len: 32, but .* windows of 65 tokens"):
        Trainer(offline_student(data, teacher, "distill.teacher=offline", "data.seq_len=32"), tmp_path, StepLosses())
    with pytest.raises(ConfigError, match="distill.temperature: 2.0, but .* temperature 1.0"):
        Trainer(offline_student(data, teacher, "distill.teacher=offline", "distill.temperature=2"), tmp_path,
                StepLosses())
    with pytest.raises(SpecError, match="distill.loss: offline: only forward_kl"):
        offline_student(data, teacher, "distill.teacher=offline", "distill.loss=jsd")
    with pytest.raises(SpecError, match="distill.teacher: .*the built-in corpus carries no teacher"):
        tiny(*SHORT, "distill.teacher=offline")


def test_the_teachers_pass_resumes_where_it_stopped_and_a_finished_one_is_not_redone(offline_data, tmp_path,
                                                                                     monkeypatch):
    import shutil

    import numpy as np

    from engine.data import manifest as mf
    from engine.distill import offline

    data, teacher = offline_data
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.pop("teacher")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    for name in ("train-topk-ids.npy", "train-topk-logp.npy"):
        (copy / name).unlink()
    calls, predict, stop_at = [], offline.predict, 3

    def counting(*args):
        calls.append(1)
        if len(calls) == stop_at:
            raise KeyboardInterrupt  # killed in its third batch of windows
        return predict(*args)

    monkeypatch.setattr(offline, "predict", counting)
    with pytest.raises(KeyboardInterrupt):
        offline.annotate(copy, str(teacher), 264, 64, models_cache=tmp_path / "models")
    assert mf.read(copy).teacher is None  # the dataset reads as before, without a teacher
    calls.clear()
    stop_at = None
    section = offline.annotate(copy, str(teacher), 264, 64, models_cache=tmp_path / "models")
    windows = len(np.load(data / "train-topk-ids.npy", mmap_mode="r"))
    assert len(calls) == -(-windows // offline.BATCH_WINDOWS) - 2  # the two batches done are not done again
    assert section == mf.read(data).teacher  # the same files, byte for byte (their CRC32C)
    for name in ("train-topk-ids.npy", "train-topk-logp.npy"):
        assert np.array_equal(np.load(copy / name), np.load(data / name))
    assert not (copy / offline.PROGRESS).exists()
    monkeypatch.setattr(offline, "predict", lambda *a: pytest.fail("a finished pass ran again"))
    assert offline.annotate(copy, str(teacher), 264, 64, models_cache=tmp_path / "models") == section


def test_tpud_prepare_stores_a_teacher_from_the_command_line_and_validate_checks_it(offline_data, tmp_path):
    import argparse
    import contextlib
    import io

    from engine.data import manifest as mf
    from engine.prepare import command

    data, teacher = offline_data
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x + 1\n" * 30}) + "\n")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = [str(tmp_path / "docs.jsonl"), "--tokenizer", "bytes", "--out", str(tmp_path / "data"), "--workers", "1",
            "--no-progress", "--teacher", str(teacher), "--top-k", "4"]

    def run(argv):
        # Plain buffers, never closed: the command points the log at its stderr, which later tests still write to.
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return command.run(parser.parse_args(argv)), out.getvalue(), err.getvalue()

    code, _, err = run(args)
    assert code == 1 and "give --seq-len" in err and not (tmp_path / "data").exists()
    code, out, _ = run([*args, "--seq-len", "32"])
    assert code == 0 and json.loads(out.splitlines()[-1])["teacher"]["top_k"] == 4
    stored = mf.read(tmp_path / "data").teacher
    assert (stored.top_k, stored.window, stored.splits["train"][0].path) == (4, 33, "train-topk-ids.npy")
    # tpud validate's local checks: the job's windows against the teacher's.
    manifests = [("data.dataset", mf.read(tmp_path / "data"))]
    assert mf.check_teacher(manifests, 32, 1.0, False) == []
    assert [key for key, _ in mf.check_teacher(manifests, 64, 1.0, False)] == ["data.seq_len"]
    assert [key for key, _ in mf.check_teacher([("data.dataset", mf.read(data).model_copy(update={"teacher": None}))],
                                               64, 1.0, False)] == ["data.dataset"]


def test_a_full_disk_fails_the_teachers_pass_cleanly_and_the_dataset_reads_as_before(offline_data, tmp_path):
    import os
    import shutil
    import subprocess

    from engine.data import manifest as mf
    from engine.distill import offline

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    data, teacher = offline_data
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tpud-test", str(mount)], check=True)
    try:
        copy = mount / "data"
        copy.mkdir()
        for path in data.iterdir():
            if "topk" not in path.name:
                shutil.copy(path, copy / path.name)
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest.pop("teacher")
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(OSError) as full:
            offline.annotate(copy, str(teacher), 264, 64, models_cache=tmp_path / "models")
        assert full.value.errno == 28  # ENOSPC, raised where the arrays are allocated: never a SIGBUS
        assert mf.read(copy).teacher is None and mf.read(copy).identity == mf.read(data).identity
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)

"""Training on prepared datasets: orders, mixtures, rank-independent batches, exact resume, eval loss."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine import events, exit_codes
from engine.backends.base import DataPosition
from engine.data import order
from engine.data.dataset import Prepared, open_data
from engine.data.batch import Batch
from engine.data.loader import PackedLoader
from engine.prepare.pipeline import prepare
from engine.prepare.options import Options
from engine.errors import ConfigError
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.spec.loader import load_spec
from engine.train import Trainer
from testkit import corpus
from tests.conftest import TINY_JOB
from testkit.recorders import Recorder

TEXTS = corpus.docstrings(300)


def _prepare(out, texts, **options):
    src = corpus.write(out.parent / f"{out.name}.jsonl", texts, "jsonl")
    return prepare(Options(inputs=(str(src),), tokenizer="bytes", out=str(out), workers=1, progress=False, **options))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The docstrings, byte-tokenized, 10% held out, in small shards (windows straddle them)."""
    out = tmp_path_factory.mktemp("data") / "docs"
    _prepare(out, TEXTS, val_fraction=0.1, shard_tokens=5000)
    return out


def spec(dataset, *overrides):
    return load_spec(TINY_JOB, [f"data.dataset={dataset}", "model.vocab_size=264", "data.seq_len=32",
                                "data.micro_batch_size=2", "train.max_steps=8", "train.log_interval=1",
                                "scheduler.warmup_steps=1", "checkpoint.interval_steps=4", *overrides])


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_the_permutation_is_a_bijection_and_differs_by_key(n):
    perm = order.Permutation(n, 7)(np.arange(n))
    assert sorted(perm.tolist()) == list(range(n))
    if n >= 17:
        assert not np.array_equal(perm, order.Permutation(n, 8)(np.arange(n)))


def test_a_huge_permutation_costs_nothing_to_set_up_or_index():
    n = 10**12
    perm = order.Permutation(n, 1)
    picks = perm(np.array([0, 1, 10**9, n - 1]))
    assert len(set(picks.tolist())) == 4 and (picks >= 0).all() and (picks < n).all()


def test_blend_proportions_hold_at_every_prefix_and_indices_are_dense():
    blend = order.Blend([0.7, 0.2, 0.1], key=3)
    source, index = blend(np.arange(20_000))
    for prefix in (1000, 5000, 20_000):
        shares = np.bincount(source[:prefix], minlength=3) / prefix
        assert np.allclose(shares, [0.7, 0.2, 0.1], atol=0.002), (prefix, shares)
    for s in range(3):  # each source's samples are 0, 1, 2, ... in order: none skipped, none repeated
        assert index[source == s].tolist() == list(range((source == s).sum()))


def test_a_mixture_reads_each_dataset_in_its_weight(tmp_path):
    a = _prepare(tmp_path / "a", ["a" * 200] * 50)
    b = _prepare(tmp_path / "b", ["b" * 200] * 50)
    assert a.identity != b.identity
    cfg = load_spec(TINY_JOB, [f"data.mixture=[{{dataset: {tmp_path / 'a'}, weight: 3}}, "
                               f"{{dataset: {tmp_path / 'b'}, weight: 1}}]", "data.seq_len=32"]).data
    data = open_data(cfg, seed=0, cache_root=tmp_path, vocab_size=300)
    rows = data.train.read("rows", np.arange(4000))
    share_a = (rows[:, 0] == ord("a")).mean()
    assert abs(share_a - 0.75) < 0.01 and ((rows[:, 0] == ord("a")) | (rows[:, 0] == ord("b")) | (rows[:, 0] == 256)).all()
    assert data.identity == f"{a.identity}*3;{b.identity}*1"


def test_global_batches_do_not_depend_on_the_number_of_ranks(dataset, tmp_path):
    data = open_data(spec(dataset).data, seed=5, cache_root=tmp_path, vocab_size=264)
    one = PackedLoader(data.train, 4, 1, position=DataPosition(0, 1))
    two = [PackedLoader(data.train, 2, 1, position=DataPosition(r, 2)) for r in range(2)]
    four = [PackedLoader(data.train, 1, 1, position=DataPosition(r, 4)) for r in range(4)]
    for step in (0, 3, 10**9):
        whole = one.batch(step, 0)
        assert Batch.cat([loader.batch(step, 0) for loader in two]) == whole
        assert Batch.cat([loader.batch(step, 0) for loader in four]) == whole


def test_windows_straddle_shards_and_match_the_token_stream(dataset):
    prepared = Prepared.open(dataset)
    windows = prepared.windows("train", 33)
    stream = np.concatenate([np.load(dataset / s.path) for s in prepared.manifest.splits["train"].shards])
    assert len(prepared.manifest.splits["train"].shards) > 3
    picks = np.array([0, 5000 // 33, windows.n - 1])  # window 151 crosses the first shard boundary
    assert np.array_equal(windows.rows(picks), np.stack([stream[w * 33:(w + 1) * 33] for w in picks]))


def test_a_damaged_or_missing_dataset_names_the_key(dataset, tmp_path):
    with pytest.raises(ConfigError, match="data.dataset.*not a prepared dataset"):
        open_data(spec(tmp_path).data, 0, tmp_path, 264)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "manifest.json")  # never opened: reading it would block forever
    with pytest.raises(ConfigError, match="a FIFO, not a regular file"):
        open_data(spec(fifo).data, 0, tmp_path, 264)
    with pytest.raises(ConfigError, match="model.vocab_size.*257"):
        open_data(spec(dataset).data, 0, tmp_path, 256)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in dataset.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = sorted(copy.glob("train-0000*.npy"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="manifest says"):
        open_data(spec(copy).data, 0, tmp_path, 264)


def test_resume_on_a_prepared_dataset_is_bitwise_and_eval_loss_is_reported(dataset, tmp_path):
    job = spec(dataset, "eval={interval_steps: 4, batches: 3}")
    whole = Trainer(job, tmp_path / "whole", straight := Recorder())
    assert whole.run() == exit_codes.OK
    cut = Trainer(job, tmp_path / "cut", Recorder({Boundary(5, 0): Request(Action.CHECKPOINT_AND_EXIT)}))
    assert cut.run() == exit_codes.STOPPED
    resumed = Trainer(job, tmp_path / "cut", again := Recorder())
    assert resumed.progress.step == 5 and resumed.run() == exit_codes.OK
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert {s: again.losses[s] for s in range(6, 9)} == {s: straight.losses[s] for s in range(6, 9)}
    evals = straight.of(events.Eval)
    assert [e.step for e in evals] == [4, 8] and all(0 < e.loss < 6 for e in evals)
    assert evals[-1].perplexity == pytest.approx(np.exp(evals[-1].loss))
    assert again.of(events.Eval)[-1].loss == evals[-1].loss  # the same fixed batches, the same weights
    assert straight.of(events.Step)[-1].badput.eval > 0


def test_resuming_on_other_data_fails_unless_allowed(dataset, tmp_path):
    other = tmp_path / "other"
    _prepare(other, TEXTS[:100])
    assert Trainer(spec(dataset, "train.max_steps=4"), tmp_path / "home", Recorder()).run() == exit_codes.OK
    with pytest.raises(ConfigError, match="data.dataset.*other data.*allow_change"):
        Trainer(spec(other, "train.max_steps=6"), tmp_path / "home", Recorder())
    allowed = Trainer(spec(other, "train.max_steps=6", "data.allow_change=true"), tmp_path / "home", Recorder())
    assert allowed.progress.step == 4


def test_eval_needs_a_validation_split(tmp_path):
    _prepare(tmp_path / "noval", TEXTS[:50])
    with pytest.raises(ConfigError, match="no validation split"):
        Trainer(spec(tmp_path / "noval", "eval={batches: 2}"), tmp_path / "home", Recorder())

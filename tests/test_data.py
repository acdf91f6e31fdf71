import numpy as np
import pytest
import torch

from engine.backends.base import DataPosition
from engine.data.batch import Batch
from engine.data.corpus import stdlib_corpus
from engine.errors import ConfigError
from testkit.recorders import array_loader


def test_stdlib_corpus_is_bounded_deterministic_python_source():
    a, b = stdlib_corpus(200_000), stdlib_corpus(200_000)
    assert len(a) == 200_000 and np.array_equal(a, b)
    assert b"import " in a.tobytes() and b"def " in a.tobytes()


def loader(tokens, mb=4, accum=1, seed=0, rank=0, world=1):
    return array_loader(tokens, seq_len=7, micro_batch_size=mb, accum=accum, seed=seed,
                        position=DataPosition(rank=rank, world=world))


TOKENS = np.arange(8 * 10, dtype=np.int64) % 256  # ten windows of 8 tokens, each distinct


def test_batches_are_a_pure_function_of_seed_and_step():
    first = loader(TOKENS)
    again = loader(TOKENS)
    assert first.batch(3, 0) == again.batch(3, 0)  # fresh loader, same batch: resumable
    assert first.batch(3, 0) != loader(TOKENS, seed=1).batch(3, 0)
    batch = first.batch(0, 0)
    assert batch.inputs.shape == batch.targets.shape == (4, 7) and batch.inputs.dtype == torch.int64
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])  # targets: the inputs shifted by one


def test_every_window_is_seen_once_per_epoch():
    data = loader(TOKENS, mb=5)
    starts = torch.cat([data.batch(0, 0).inputs, data.batch(1, 0).inputs])[:, 0]
    assert sorted(starts.tolist()) == list(range(0, 80, 8))  # two batches = one epoch of ten windows
    next_epoch = torch.cat([data.batch(2, 0).inputs, data.batch(3, 0).inputs])[:, 0]
    assert sorted(next_epoch.tolist()) == list(range(0, 80, 8))
    assert not torch.equal(starts, next_epoch)  # reshuffled


def test_ranks_and_micro_batches_partition_the_global_batch():
    whole = loader(TOKENS, mb=4).batch(1, 0)
    ranks = [loader(TOKENS, mb=2, rank=r, world=2).batch(1, 0) for r in range(2)]
    assert Batch.cat(ranks) == whole
    micros = loader(TOKENS, mb=2, accum=2)
    assert Batch.cat([micros.batch(1, 0), micros.batch(1, 1)]) == whole


def test_corpus_too_small_is_an_error():
    with pytest.raises(ConfigError, match="windows"):
        loader(TOKENS[:20], mb=4)

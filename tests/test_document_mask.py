"""Document masking (data.document_mask) and the loss over the targets of the whole global batch.

Packed documents must train as if each ran alone: attention within a document only, RoPE
positions restarting with it, and no loss on predicting one document's start from the one
before. Segment ids come from the stored document index, as a pure function of the sample.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import exit_codes
from engine.attention import build_attention, build_mask
from engine.attention.eager import eager_attention
from engine.attention.sdpa import sdpa_attention
from engine.backends.base import Backend
from engine.backends.torch_native import KERNELS
from engine.data.batch import IGNORE, Batch
from engine.data.dataset import Windows, open_data
from engine.data.loader import PackedLoader
from engine.prepare.pipeline import prepare
from engine.prepare.command import Options
from engine.data.shards import ArrayStream
from engine.errors import ConfigError
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.losses.ce import token_losses
from engine.models.llama import Transformer, document_mask
from engine.spec.loader import load_spec
from engine.spec.schema import AttentionConfig, ModelConfig
from engine.train import Trainer
from testkit import corpus
from tests.conftest import TINY_JOB
from testkit.recorders import Recorder, StepLosses

TINY = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64)
KERNEL_FNS = {"eager": eager_attention, "sdpa": sdpa_attention}


def packed(documents: list[np.ndarray], follower: int = 7) -> Batch:
    """One window holding `documents` back to back, its last target the first token of one more."""
    rows = np.concatenate([*documents, [follower]])[None]
    segments = np.concatenate([np.full(len(d), i) for i, d in enumerate(documents)] + [[len(documents)]])[None]
    return Batch.of(rows, segments.astype(np.int32))


def run(model: Transformer, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, V] and token losses [T] of a one-sequence batch."""
    hidden = model(batch.inputs, batch.segments, batch.positions)[0]
    return model.logits(hidden), token_losses(hidden, model.output_weight, batch.targets[0])


def tiny_model(kernel: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TINY, KERNEL_FNS[kernel])  # random fp32 weights


def test_segment_ids_follow_the_stored_index_never_a_token_id():
    tokens = np.zeros(40, dtype=np.int64)  # every token is "end of text" alike: only the index knows
    index = np.array([0, 3, 3, 10, 27, 40], dtype=np.uint64)  # an empty document at 3
    windows = Windows(ArrayStream(tokens), 13, "t", index)
    assert windows.segments(np.array([0])).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2]]
    assert windows.segments(np.array([1])).tolist() == [[0] * 13]  # tokens 13-25: inside document 3
    # Window 2 (tokens 26-38): document 3 ends at 27.
    assert windows.segments(np.array([2])).tolist() == [[0] + [1] * 12]
    assert windows.boundaries(np.array([0, 1, 2])).tolist() == [2, 0, 1]


def test_a_batch_ignores_the_targets_across_a_boundary_and_restarts_positions():
    batch = packed([np.arange(10, 13), np.arange(20, 22)], follower=30)
    assert batch.inputs.tolist() == [[10, 11, 12, 20, 21]]
    assert batch.targets.tolist() == [[11, 12, IGNORE, 21, IGNORE]]
    assert batch.segments.tolist() == [[0, 0, 0, 1, 1]] and batch.positions.tolist() == [[0, 1, 2, 0, 1]]
    plain = Batch.of(np.arange(6)[None])
    assert plain.targets.tolist() == [[1, 2, 3, 4, 5]] and plain.segments is None and plain.positions is None


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_packed_documents_train_as_if_each_ran_alone(kernel):
    model = tiny_model(kernel)
    g = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, 64, (n,), generator=g).numpy() for n in (5, 17, 42)]
    assert sum(map(len, documents)) == 64
    _, losses = run(model, packed(documents))
    losses.sum().backward()
    together = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    starts = np.cumsum([0] + [len(d) for d in documents])
    for document, start in zip(documents, starts):
        _, alone = run(model, packed([document]))
        alone.sum().backward()
        assert losses[start:start + len(document)].sum().item() == pytest.approx(alone.sum().item(), rel=1e-5)
    for joint, summed in zip(together, (p.grad for p in model.parameters())):
        assert (joint - summed).norm() <= 1e-5 * summed.norm()


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_documents_never_see_each_other(kernel):
    model = tiny_model(kernel)
    g = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, 64, (32,), generator=g).numpy() for _ in range(2))
    with torch.no_grad():
        twins, _ = run(model, packed([second, second]))
        assert (twins[:32] - twins[32:]).abs().max() <= 1e-6
        before, _ = run(model, packed([first, second]))
        after, _ = run(model, packed([(first + 1) % 64, second]))
    assert (before[32:] - after[32:]).abs().max() <= 1e-7
    assert (before[:32] - after[:32]).abs().max() > 1e-3  # the change itself did reach document 1


def test_flex_block_mask_matches_the_dense_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from engine.attention.flex import block_mask, flex

    segments = packed([np.arange(5), np.arange(17), np.arange(42)]).segments.repeat(2, 1)
    segments[1] = 0  # the second row one document: masks differ per sequence
    dense = document_mask(segments)
    made = block_mask(segments)
    assert made.shape == (2, 1, 64, 64)
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(64), torch.arange(64), indexing="ij")
    assert torch.equal(made.mask_mod(b, torch.zeros_like(b), q, kv), dense[:, 0])
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 64, 16, generator=g), torch.randn(2, 2, 64, 16, generator=g), torch.randn(2, 2, 64, 16, generator=g)
    torch.testing.assert_close(flex(q, k, v, made), eager_attention(q, k, v, dense), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex(q, k, v), eager_attention(q, k, v), rtol=1e-5, atol=1e-5)


def cuda_like() -> Backend:
    backend = Backend()
    backend.name = "cuda"
    backend.attention_kernels, backend.document_mask_kernels = KERNELS["cuda"]
    return backend


def test_a_kernel_that_cannot_mask_at_speed_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot mask packed documents.*flex, eager") as info:
        build_attention(AttentionConfig(kernel="sdpa"), cuda_like(), document_mask=True)
    assert info.value.key == "attention.kernel"
    assert build_attention(AttentionConfig(), cuda_like(), document_mask=True)[0] == "flex"
    assert build_attention(AttentionConfig(), cuda_like())[0] == "sdpa"  # without masks, flash sdpa
    assert build_mask("sdpa") is document_mask


@pytest.mark.xla
@pytest.mark.parametrize("kernel", ["flash", "splash"])
def test_pallas_kernels_are_given_the_segment_ids(kernel, monkeypatch):
    """The TPU kernels cannot run on a CPU: what they are called with is checked instead."""
    pytest.importorskip("torch_xla")
    import torch_xla.experimental.custom_kernel as custom_kernel
    import torch_xla.experimental.splash_attention as splash_module

    from engine.attention import pallas
    from engine.spec.schema import FlashBlocks, SplashBlocks

    calls = []
    module, name = (custom_kernel, "flash_attention") if kernel == "flash" else (splash_module, "splash_attention")
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append((args, kwargs)) or args[0])
    attention = pallas.flash(FlashBlocks(), "mesh") if kernel == "flash" else pallas.splash(SplashBlocks(), "mesh")
    segments = build_mask(kernel)(packed([np.arange(5), np.arange(59)]).segments.long())
    assert segments.dtype == torch.int32
    q, k = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16)
    attention(q, k, k, segments)
    (args, kwargs), = calls
    if kernel == "flash":
        assert kwargs["q_segment_ids"] is segments and kwargs["kv_segment_ids"] is segments
        assert kwargs["causal"] and args[1].shape[1] == 4  # KV repeated to the query heads
    else:
        assert kwargs["decoder_segment_ids"] is segments and kwargs["causal"]
    calls.clear()
    attention(q, k, k)  # unmasked: no segment ids, as before
    assert calls[0][1].get("q_segment_ids", calls[0][1].get("decoder_segment_ids")) is None


# --- training on a prepared dataset of short documents ---


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Docstrings, byte-tokenized: documents of tens to hundreds of tokens, so windows of 33 hold
    from none to several boundaries."""
    out = tmp_path_factory.mktemp("docs") / "docs"
    src = corpus.write(out.parent / "docs.jsonl", corpus.docstrings(300), "jsonl")
    prepare(Options(inputs=(str(src),), tokenizer="bytes", out=str(out), workers=1, progress=False))
    return out


def job(dataset, *overrides):
    return load_spec(TINY_JOB, [f"data.dataset={dataset}", "model.vocab_size=264", "data.seq_len=32",
                                "data.document_mask=true", "train.mixed_precision=fp32", "model.n_layers=2",
                                "train.max_steps=6", "train.log_interval=1", "scheduler.warmup_steps=1",
                                "checkpoint.interval_steps=100", *overrides])


def test_the_step_loss_counts_every_target_of_the_global_batch_once(dataset, tmp_path):
    """4 micro-batches holding different numbers of targets: the same gradients as one batch of all."""
    grads = {}
    for accum, size in ((4, 2), (1, 8)):
        trainer = Trainer(job(dataset, f"train.grad_accum_steps={accum}", f"data.micro_batch_size={size}"),
                          tmp_path / str(accum), Recorder())
        for _ in range(accum):
            trainer.micro_batch()
        grads[accum] = [p.grad.clone() for p in trainer.model.parameters()]
        if accum == 4:
            counts = trainer.loader._target_counts(0)[:, 0]
            assert len(set(counts.tolist())) > 1, counts  # uneven: a mean of means would differ
            assert trainer.loader.step_targets(0) == counts.sum() < 8 * 32
        trainer.batches.close()
        trainer.checkpointer.close()
    for split, whole in zip(grads[4], grads[1]):
        assert (split - whole).abs().max() <= 1e-6 * whole.abs().max()


def test_a_resumed_masked_run_sees_the_same_samples_and_losses(dataset, tmp_path):
    spec = job(dataset, "train.grad_accum_steps=2")
    whole = Trainer(spec, tmp_path / "whole", straight := StepLosses())
    assert whole.run() == exit_codes.OK
    cut = Trainer(spec, tmp_path / "cut", Recorder({Boundary(3, 1): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0.0)}))
    assert cut.run() == exit_codes.STOPPED
    resumed = Trainer(spec, tmp_path / "cut", again := StepLosses())
    assert (resumed.progress.step, resumed.progress.micro_step) == (3, 1)
    for step in range(3, 6):  # a fresh loader's batches (segments, positions, targets) and weights are the same
        for micro in range(2):
            assert resumed.loader.batch(step, micro) == whole.loader.batch(step, micro)
            assert resumed.loader.loss_weight(step, micro) == whole.loader.loss_weight(step, micro)
    assert resumed.run() == exit_codes.OK
    assert again.losses == straight.losses[3:]
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_samples_of_a_masked_dataset_are_a_pure_function_of_the_index(dataset, tmp_path):
    data = open_data(job(dataset).data, seed=3, cache_root=tmp_path, vocab_size=264)
    again = open_data(job(dataset).data, seed=3, cache_root=tmp_path, vocab_size=264)
    picks = np.array([10**9, 5, 0, 77])
    for what in ("rows", "segments", "boundaries"):
        assert np.array_equal(data.train.read(what, picks), again.train.read(what, picks[::-1])[::-1])
    segments = data.train.read("segments", np.arange(400))
    assert (np.diff(segments, axis=1) >= 0).all() and segments.max() >= 1
    assert np.array_equal((np.diff(segments, axis=1) > 0).sum(axis=1), data.train.read("boundaries", np.arange(400)))


# This job's per-step losses without document masking, by torch release (its random draws, and so
# the initial weights, differ between releases), each as the CPU kernels torch picks round them
# (step 5's last bit differs between machines: AVX2 and some AVX-512 ones give the first, others
# the second, whatever get_cpu_capability says): on 2.9 recorded by the engine before document
# masking existed, on 2.15 by the engine with it off. Every step must round as one of them does.
UNMASKED = {
    "2.9": [[5.344520568847656, 4.931114196777344, 4.591662883758545, 4.188116550445557, 3.9520304203033447,
             3.8339297771453857]],
    "2.15": [[5.250762939453125, 4.788845539093018, 4.450893878936768, 4.067201614379883, 3.843997001647949,
              3.7426135540008545],
             [5.250762939453125, 4.788845539093018, 4.450893878936768, 4.067201614379883, 3.8439972400665283,
              3.7426135540008545]],
}


def test_without_document_mask_the_losses_are_bitwise_those_of_before(tiny_spec, tmp_path):
    spec = tiny_spec("data.seq_len=64", "data.micro_batch_size=4", "train.max_steps=6", "train.log_interval=1",
                     "scheduler.warmup_steps=2", "model.n_layers=2", "train.mixed_precision=fp32",
                     "train.grad_accum_steps=3", "attention.kernel=sdpa")
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert release in UNMASKED, f"no losses recorded for torch {release}: record them from a tree known good"
    assert Trainer(spec, tmp_path, losses := StepLosses()).run() == exit_codes.OK
    assert losses.losses in UNMASKED[release], (torch.backends.cpu.get_cpu_capability(), losses.losses)


def test_document_mask_on_the_builtin_corpus_masks_its_files(tiny_spec, tmp_path):
    data = open_data(tiny_spec("data.document_mask=true").data, seed=0, cache_root=tmp_path, vocab_size=256)
    loader = PackedLoader(data.train, 16, 1, document_mask=True)
    batches = [loader.batch(step, 0) for step in range(40)]
    assert any((b.targets == IGNORE).any() for b in batches)
    assert sum(int((b.targets != IGNORE).sum()) for b in batches[:1]) == loader.step_targets(0)


@pytest.mark.parametrize("global_loss", [False, True])
def test_loss_weights_make_any_split_of_the_global_batch_one_mean(dataset, tmp_path, global_loss):
    """Per-token values standing for losses: however a step is split over 3 micro-batches and 2
    ranks, each mean weighted as the trainer does gives the mean over every target of the step.
    DDP: each rank's mean of its slice, the ranks' results averaged; SPMD (global_loss): one mean
    over both ranks' slices, nothing averaged."""
    from engine.backends.base import DataPosition

    data = open_data(job(dataset).data, seed=1, cache_root=tmp_path, vocab_size=264)
    ranks = [PackedLoader(data.train, 2, 3, position=DataPosition(r, 2), document_mask=True, global_loss=global_loss)
             for r in range(2)]
    value = lambda batch: torch.where(batch.targets != IGNORE, batch.targets.double().sin(), 0.0)  # noqa: E731
    for step in range(4):
        batches = [[loader.batch(step, m) for m in range(3)] for loader in ranks]
        flat = [value(b) for per_rank in batches for b in per_rank]
        expected = sum(v.sum() for v in flat) / sum(int((b.targets != IGNORE).sum()) for r in batches for b in r)
        per_rank = []
        for r, loader in enumerate(ranks):
            means = []
            for m in range(3):
                shares = [batches[r][m]] if not global_loss else [batches[0][m], batches[1][m]]
                mean = sum(value(b).sum() for b in shares) / sum(int((b.targets != IGNORE).sum()) for b in shares)
                means.append(mean * loader.loss_weight(step, m))
            per_rank.append(sum(means) / 3)
        got = per_rank[0] if global_loss else sum(per_rank) / 2  # under SPMD every process holds the one loss
        if global_loss:
            assert per_rank[0] == per_rank[1]
        assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    assert any(len(set(ranks[0]._target_counts(s).flatten().tolist())) > 1 for s in range(4))  # uneven splits

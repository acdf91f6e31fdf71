"""An offline teacher: its top-k log-probabilities stored beside a prepared dataset's tokens
(`tpud prepare ... --teacher DIR --top-k K --seq-len N`), so a job distils from them
(`distill.teacher: offline`) with no teacher in memory.

Training cuts each split into non-overlapping windows of seq_len + 1 tokens (engine.data.dataset),
so the teacher reads exactly those windows, with document masking if the jobs use it, and stores
for every input position its k likeliest next tokens (int32) and their log-probabilities at
`temperature` (float32): k x 8 bytes a token, against a vocabulary's worth of logits online.

The pass is resumable: the arrays are preallocated .npy files filled window batch by window batch,
and a progress file records the windows done after each batch is flushed; a run that stops
(killed, a full disk) goes on from there, and a finished one is not redone. manifest.json gains
the `teacher` section last, so until then the dataset reads as it did.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog
import torch

from engine.attention import build_mask
from engine.attention.sdpa import sdpa_attention
from engine.checkpoint.manifest import file_crc32c
from engine.data import manifest as mf
from engine.data.batch import Batch
from engine.data.dataset import Prepared
from engine.distill.teacher import Teacher, tokenizer_difference
from engine.layout import atomic_write, fsync_path
from engine.spec.schema import DistillConfig

log = structlog.get_logger()

PROGRESS = ".topk-progress.json"
BATCH_WINDOWS = 8


class OfflineError(ValueError):
    """The teacher cannot annotate this dataset; the message says why."""


def annotate(directory: Path, teacher: str, top_k: int, seq_len: int, *, temperature: float = 1.0,
             document_mask: bool = False, models_cache: Path, device: str = "cpu",
             progress: Callable[[str, int, int], None] = lambda split, done, total: None) -> mf.TeacherTopK:
    """Store `teacher`'s top-k predictions beside the prepared dataset in `directory`; its manifest's
    new teacher section. Resumes an interrupted run with the same teacher and options."""
    directory = Path(directory)
    with open(directory / ".prepare.lock", "w") as lock:  # the lock tpud prepare's own writing holds
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OfflineError(f"{directory}: another tpud prepare is writing there") from None
        return _annotate(directory, teacher, top_k, seq_len, temperature, document_mask, models_cache, device,
                         progress)


def _annotate(directory: Path, teacher: str, top_k: int, seq_len: int, temperature: float, document_mask: bool,
              models_cache: Path, device: str, progress: Callable[[str, int, int], None]) -> mf.TeacherTopK:
    prepared = Prepared.open(directory)
    opened = Teacher(DistillConfig(teacher=teacher), models_cache, seq_len)
    _check(prepared, opened, top_k)
    window = seq_len + 1
    identity = f"{opened.identity}:k{top_k}:t{temperature:g}"
    existing = prepared.manifest.teacher
    if existing is not None and (existing.identity, existing.window, existing.document_mask) == (
            identity, window, document_mask):
        return existing  # done before
    if existing is not None:  # another teacher's: no longer part of the dataset before its files are rewritten
        atomic_write(directory / mf.MANIFEST, prepared.manifest.model_copy(update={"teacher": None}).to_json())
    key = hashlib.sha256(json.dumps([prepared.manifest.identity, identity, window, document_mask]).encode()).hexdigest()
    done = _progress(directory, key)
    model = _model(opened, document_mask, device)
    splits = {}
    for split in prepared.manifest.splits:
        windows = prepared.windows(split, window, document_mask)
        if windows is None:
            continue
        names = (f"{split}-topk-ids.npy", f"{split}-topk-logp.npy")
        shape = (windows.n, seq_len, top_k)
        start = done.get(split, 0)
        if not start:
            for name, dtype in zip(names, (np.int32, np.float32)):
                _allocate(directory / name, dtype, shape)
        ids, logp = (np.lib.format.open_memmap(directory / name, mode="r+") for name in names)
        for first in range(start, windows.n, BATCH_WINDOWS):
            last = min(first + BATCH_WINDOWS, windows.n)
            index = np.arange(first, last)
            batch = Batch.of(windows.rows(index), windows.segments(index) if document_mask else None)
            ids[first:last], logp[first:last] = predict(model, batch, top_k, temperature, device)
            ids.flush()
            logp.flush()
            done[split] = last
            atomic_write(directory / PROGRESS, json.dumps({"key": key, "done": done}))
            progress(split, last, windows.n)
        del ids, logp
        splits[split] = [_entry(directory / name) for name in names]
    section = mf.TeacherTopK(identity=identity, source=opened.source.path, top_k=top_k, window=window,
                             temperature=temperature, document_mask=document_mask, splits=splits)
    atomic_write(directory / mf.MANIFEST, prepared.manifest.model_copy(update={"teacher": section}).to_json())
    (directory / PROGRESS).unlink(missing_ok=True)
    log.info("offline teacher stored", dataset=str(directory), teacher=opened.source.path, top_k=top_k,
             bytes_per_token=top_k * 8)
    return section


@torch.no_grad()
def predict(model, batch: Batch, top_k: int, temperature: float, device: str) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's top k (ids, log-probabilities at `temperature`) at every input position of `batch`."""
    batch = batch.map(lambda t: t.to(device))
    hidden, _ = model.hidden_and_routing(batch.inputs, batch.segments, batch.positions)
    logp = torch.log_softmax((hidden @ model.output_weight.T).float() / temperature, dim=-1)
    values, indices = logp.topk(top_k, dim=-1)
    return indices.int().cpu().numpy(), values.cpu().numpy()


def _check(prepared: Prepared, teacher: Teacher, top_k: int) -> None:
    vocab = teacher.config.vocab_size
    if prepared.manifest.tokenizer.vocab_size > vocab:
        raise OfflineError(f"{prepared.path}: its tokenizer has {prepared.manifest.tokenizer.vocab_size} tokens, "
                           f"the teacher's vocabulary {vocab}")
    if not 1 <= top_k <= vocab:
        raise OfflineError(f"--top-k {top_k}: must be from 1 to the teacher's vocabulary ({vocab})")
    ours = prepared.path / "tokenizer.json"
    if teacher.source.tokenizer is not None and ours.is_file():
        if (problem := tokenizer_difference(ours, teacher.source.tokenizer)) is not None:
            raise OfflineError(f"{teacher.source.tokenizer}: the teacher's tokenizer is not the dataset's: {problem}")


def _model(teacher: Teacher, document_mask: bool, device: str):
    model = teacher.build(sdpa_attention, build_mask("sdpa"))
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in teacher.values(model):
            params[name].copy_(value)
    model.reset_rotary(torch.device(device))
    return model


def _allocate(path: Path, dtype, shape: tuple[int, ...]) -> None:
    """A new .npy file of `shape` with its blocks allocated now: a disk too small fails here with
    ENOSPC, not later as a SIGBUS on writing into a sparse mapping."""
    np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
    with open(path, "r+b") as f:
        os.posix_fallocate(f.fileno(), 0, path.stat().st_size)


def _progress(directory: Path, key: str) -> dict[str, int]:
    """Windows done per split by an earlier run with the same key; {} to start afresh."""
    try:
        saved = json.loads((directory / PROGRESS).read_text())
        if saved.get("key") == key and isinstance(saved.get("done"), dict):
            return {split: int(n) for split, n in saved["done"].items()}
    except (OSError, ValueError, TypeError):
        pass
    return {}


def _entry(path: Path) -> mf.FileEntry:
    fsync_path(path)
    return mf.FileEntry(path=path.name, bytes=path.stat().st_size, crc32c=file_crc32c(path))

"""What a job trains on, as sample streams: sample g of the run -> one window of seq_len + 1 tokens.

A split's token stream (memory-mapped shards, or the built-in corpus in memory) is cut into
fixed windows; nothing else is precomputed, so opening a dataset costs the same at 1 GB and
at 50 TB. Three ways to turn samples into windows:

    Shuffled  epoch g div n visits every window once, in a permutation keyed by (seed, epoch)
    InOrder   window g mod n: the fixed validation batches
    Mixed     several sources blended in fixed proportions (engine.data.order.Blend)

With document masking a window also has segment ids (which document each token is in),
read from the split's stored document index, never guessed from an end-of-text token. Chat
data also has a loss mask (which tokens are trained targets), stored beside its tokens.

Every stream is a pure function of the sample index, so the loader above it has no state to
save and a resume at step 10^9 costs what a resume at step 10 does. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.data import manifest as mf
from engine.data import order
from engine.data.shards import ArrayStream, TokenStream, document_index
from engine.errors import ConfigError
from engine.spec.schema import DataConfig

SHUFFLE_KEY = 0x5348_5546


class Samples(Protocol):
    n: int  # windows in one pass over the data
    window: int
    masked: bool  # whether some windows have a loss mask

    def read(self, what: str, samples: np.ndarray) -> np.ndarray:
        """`what` (a Windows method: rows, segments, boundaries or masks) of each global sample index's window."""


class Windows:
    """Non-overlapping windows of `window` tokens; a trailing partial window is dropped.

    documents: the stream's document index (0, then where each document ends), for the
    segment ids of document masking; None when the job does not mask.
    masks: the stream's loss mask (chat data), None when every token is trained.
    teacher: an offline teacher's top k per window (ids, log-probabilities [n, window - 1, k]), or None.
    """

    def __init__(self, stream: TokenStream | ArrayStream, window: int, name: str, documents: np.ndarray | None = None,
                 masks: TokenStream | None = None, teacher: tuple[np.ndarray, np.ndarray] | None = None):
        self.stream, self.window, self.name, self.documents, self.mask_stream = stream, window, name, documents, masks
        self.n = stream.n_tokens // window
        self.masked = masks is not None
        self.teacher = teacher

    def read(self, what: str, windows: np.ndarray) -> np.ndarray:
        return getattr(self, what)(np.asarray(windows, dtype=np.int64))

    def rows(self, windows: np.ndarray) -> np.ndarray:
        """[len(windows), window] tokens."""
        return np.stack([self.stream.read(int(w) * self.window, (int(w) + 1) * self.window) for w in windows])

    def teacher_ids(self, windows: np.ndarray) -> np.ndarray:
        """int32 [len(windows), window - 1, k]: the offline teacher's likeliest next tokens at each input."""
        return np.asarray(self.teacher[0][windows])

    def teacher_logp(self, windows: np.ndarray) -> np.ndarray:
        """float32 [len(windows), window - 1, k]: their log-probabilities."""
        return np.asarray(self.teacher[1][windows])

    def masks(self, windows: np.ndarray) -> np.ndarray:
        """uint8 [len(windows), window]: 1 where a token is a trained target."""
        if self.mask_stream is None:
            return np.ones((len(windows), self.window), dtype=np.uint8)
        return np.stack([self.mask_stream.read(int(w) * self.window, (int(w) + 1) * self.window) for w in windows])

    def _inside(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each window's first token, and the range [lo, hi) of the index's entries strictly inside
        it: the ends of earlier documents, so where documents begin (a few pages of the index,
        whatever its size)."""
        begins = windows.astype(np.uint64) * np.uint64(self.window)
        lo = np.searchsorted(self.documents, begins, "right")
        return begins, lo, np.searchsorted(self.documents, begins + np.uint64(self.window), "left")

    def _starts(self, begin: np.uint64, lo: int, hi: int) -> np.ndarray:
        """Offsets in a window (1 .. window - 1) where a document begins."""
        return np.unique(self.documents[lo:hi] - begin).astype(np.int64)  # unique: an empty document starts nothing

    def segments(self, windows: np.ndarray) -> np.ndarray:
        """int32 [len(windows), window]: each token's document, counted from the window's first (0)."""
        out = np.zeros((len(windows), self.window), dtype=np.int32)
        for row, inside in zip(out, zip(*self._inside(windows))):
            row[self._starts(*inside)] = 1
        return np.cumsum(out, axis=1, dtype=np.int32)

    def boundaries(self, windows: np.ndarray) -> np.ndarray:
        """int64 [len(windows)]: documents beginning inside each window, each one a prediction
        (the previous document's last token -> its first) that no loss is taken on."""
        begins, lo, hi = self._inside(windows)
        counts = (hi - lo).astype(np.int64)
        for i in np.flatnonzero(counts > 1):  # only there can an empty document repeat an end
            counts[i] = len(self._starts(begins[i], lo[i], hi[i]))
        return counts


class Shuffled:
    def __init__(self, windows: Windows, seed: int):
        self.windows, self.seed = windows, seed
        self.n, self.window, self.masked = windows.n, windows.window, windows.masked
        self._cached: tuple[int, order.Permutation | None] = (-1, None)

    def _permutation(self, epoch: int) -> order.Permutation:
        # One attribute, replaced whole: the prefetch thread and the training thread (counting a
        # step's targets) both read samples, and must never pair one epoch with another's order.
        cached = self._cached
        if cached[0] != epoch:
            cached = self._cached = (epoch, order.Permutation(self.n, order.key_of(SHUFFLE_KEY, self.seed, epoch)))
        return cached[1]

    def read(self, what: str, samples: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(np.asarray(samples, dtype=np.int64), self.n)
        windows = np.empty_like(positions)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            windows[at] = self._permutation(int(epoch))(positions[at])
        return self.windows.read(what, windows)


class InOrder:
    def __init__(self, windows: Windows):
        self.windows, self.n, self.window, self.masked = windows, windows.n, windows.window, windows.masked

    def read(self, what: str, samples: np.ndarray) -> np.ndarray:
        return self.windows.read(what, np.asarray(samples, dtype=np.int64) % self.n)


class Mixed:
    def __init__(self, parts: list, weights: list[float], seed: int):
        self.parts, self.blend = parts, order.Blend(weights, order.key_of(SHUFFLE_KEY, seed, len(parts)))
        self.n, self.window = sum(p.n for p in parts), parts[0].window
        self.masked = any(p.masked for p in parts)

    def read(self, what: str, samples: np.ndarray) -> np.ndarray:
        which, index = self.blend(samples)
        out = None
        for i, part in enumerate(self.parts):
            at = which == i
            if at.any():
                values = part.read(what, index[at])
                if out is None:
                    out = np.empty((len(which), *values.shape[1:]), dtype=values.dtype)
                out[at] = values
        return out


@dataclass(frozen=True)
class Prepared:
    """A prepared dataset on this host: its directory and manifest."""

    path: Path
    manifest: mf.Manifest

    @classmethod
    def open(cls, path: str | Path) -> Prepared:
        return cls(Path(path), mf.read(path))

    def windows(self, split: str, window: int, documents: bool = False, teacher: bool = False) -> Windows | None:
        """The split cut into windows, with its document index if `documents` and its offline
        teacher's top k if `teacher`; None when it holds less than one window."""
        entry = self.manifest.splits.get(split)
        if entry is None or entry.tokens < window:
            return None
        return Windows(TokenStream(self.path, entry), window, f"{self.path} ({split})",
                       document_index(self.path, entry) if documents else None,
                       TokenStream(self.path, entry, masks=True) if entry.masks else None,
                       self._teacher(split, window) if teacher else None)

    def _teacher(self, split: str, window: int) -> tuple[np.ndarray, np.ndarray]:
        """The split's top-k arrays, memory-mapped after checking their sizes against the manifest."""
        t = self.manifest.teacher
        files = t.splits.get(split) if t is not None and t.window == window else None
        if not files:
            raise ValueError(f"{self.path}: no offline teacher for the {split} split's windows of {window} tokens")
        arrays = []
        for entry in files:
            path = self.path / entry.path
            if path.stat().st_size != entry.bytes:
                raise ValueError(f"{path}: {path.stat().st_size} bytes, the manifest says {entry.bytes} (damaged)")
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            expected = (self.manifest.splits[split].tokens // window, window - 1, t.top_k)
            if array.shape != expected:
                raise ValueError(f"{path}: shape {array.shape}, expected {expected}")
            arrays.append(array)
        return arrays[0], arrays[1]


@dataclass(frozen=True)
class TrainingData:
    train: Samples
    val: Samples | None  # None: no validation split
    identity: str  # what a checkpoint records: the datasets' identities and weights, or the corpus
    max_token: int  # the largest token id the data may hold
    description: dict  # for the start-up log line
    tokenizer: Path | None = None  # the first dataset's tokenizer.json (None: bytes, the corpus)
    teacher: str | None = None  # the offline teacher's identity, when the training samples carry one


def open_data(data: DataConfig, seed: int, cache_root: Path, vocab_size: int,
              model_dir: Path | None = None, validation: bool = False,
              offline_teacher: float | None = None) -> TrainingData:
    """The job's training (and validation) samples; ConfigError naming the key when they cannot be.
    model_dir: the local model.init_from directory, whose tokenizer the datasets must share.
    validation: the job evaluates (an eval section), so a validation split is required.
    offline_teacher: distill.temperature, when the training samples carry the data's stored teacher."""
    opened = _open_data(data, seed, cache_root, vocab_size, model_dir, offline_teacher)
    if validation and opened.val is None:
        raise ConfigError("eval", "the dataset has no validation split: prepare it with --val-fraction "
                          "or --val-docs")
    return opened


def _open_data(data: DataConfig, seed: int, cache_root: Path, vocab_size: int,
               model_dir: Path | None, offline_teacher: float | None) -> TrainingData:
    window = data.seq_len + 1
    if not data.datasets:
        from engine.data.corpus import stdlib_documents

        tokens, ends = stdlib_documents(data.corpus_bytes)
        max_token = int(tokens.max())
        if max_token >= vocab_size:
            raise ConfigError("model.vocab_size", f"{vocab_size} is below the corpus's largest token id")
        windows = Windows(ArrayStream(tokens), window, "stdlib", ends if data.document_mask else None)
        return TrainingData(Shuffled(windows, seed), None, "stdlib",
                            max_token, {"corpus": "stdlib", "corpus_tokens": len(tokens)})
    mixture = bool(data.mixture)
    keys = [f"data.mixture.{i}.dataset" if mixture else "data.dataset" for i in range(len(data.datasets))]
    prepared = [_open(path, key, cache_root) for (path, _), key in zip(data.datasets, keys)]
    manifests = [(key, p.manifest) for key, p in zip(keys, prepared)]
    problems = mf.check_vocab(manifests, vocab_size, model_dir) + mf.check_window(manifests, data.seq_len)
    if offline_teacher is not None:
        problems += mf.check_teacher(manifests, data.seq_len, offline_teacher, data.document_mask)
    if problems:
        raise ConfigError(*problems[0])
    trains, vals = [], []
    for i, (dataset, key) in enumerate(zip(prepared, keys)):
        try:
            teacher = offline_teacher is not None  # evaluation takes no teacher: the train split's alone
            train, val = (dataset.windows(split, window, data.document_mask, teacher and split == "train")
                          for split in ("train", "val"))
        except (ValueError, OSError) as e:  # a shard missing, truncated or damaged
            raise ConfigError(key, str(e)) from None
        if train is None:
            raise ConfigError(key, f"{dataset.path}: its train split holds fewer than {window} tokens "
                              f"(one window of data.seq_len + 1)")
        trains.append(Shuffled(train, order.key_of(seed, i) if mixture else seed))
        vals.append(val)
    weights = [weight for _, weight in data.datasets]
    if mixture:
        train_samples = Mixed(trains, weights, seed)
        with_val = [(InOrder(v), w) for v, w in zip(vals, weights) if v is not None]
        val_samples = Mixed([v for v, _ in with_val], [w for _, w in with_val], seed) if with_val else None
    else:
        train_samples, val_samples = trains[0], InOrder(vals[0]) if vals[0] is not None else None
    identity = ";".join(f"{p.manifest.identity}*{w:g}" for p, w in zip(prepared, weights))
    description = {"datasets": [str(p.path) for p in prepared], "weights": weights,
                   "train_tokens": sum(p.manifest.splits["train"].tokens for p in prepared),
                   "val_tokens": sum(p.manifest.splits["val"].tokens for p in prepared if "val" in p.manifest.splits)}
    tokenizer = prepared[0].path / "tokenizer.json"
    return TrainingData(train_samples, val_samples, identity,
                        max(p.manifest.tokenizer.vocab_size for p in prepared) - 1, description,
                        tokenizer if tokenizer.is_file() else None,
                        prepared[0].manifest.teacher.identity if offline_teacher is not None else None)


def _open(path: str, key: str, cache_root: Path) -> Prepared:
    try:
        if path.startswith("gs://"):
            from engine.data import remote

            path = remote.fetch(path, cache_root)
        return Prepared.open(path)
    except (mf.DatasetError, ValueError, OSError) as e:
        raise ConfigError(key, str(e)) from None

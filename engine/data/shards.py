"""A split's token stream on disk: written as fixed-size .npy shards, read back memory-mapped. Torch-free.

The writer appends tokens of unknown total length, so each shard's .npy header is written
with a fixed size first and rewritten with the real length when the shard is closed; numpy
reads the result like any .npy file. The reader maps every shard and reads any token range
of the stream, across shard boundaries, touching only the pages it needs: its memory and
its start-up time do not grow with the dataset.
"""

from __future__ import annotations

import ast
import bisect
import os
from pathlib import Path

import numpy as np

from engine.checkpoint.manifest import file_crc32c
from engine.data.manifest import FileEntry, Split

_HEADER = 128  # bytes: magic, version, length, then the header dict padded with spaces
_MAGIC = b"\x93NUMPY\x01\x00"


def npy_header(dtype: np.dtype, length: int) -> bytes:
    text = repr({"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (length,)})
    body_len = _HEADER - len(_MAGIC) - 2
    body = text.encode("latin1").ljust(body_len - 1) + b"\n"
    return _MAGIC + body_len.to_bytes(2, "little") + body


class NpyAppender:
    """One .npy file of a 1-D array, appended to; `close()` fixes its length and makes it durable."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self.file = open(path, "wb")
        self.file.write(npy_header(self.dtype, 0))

    def append(self, values: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> FileEntry:
        self.file.seek(0)
        self.file.write(npy_header(self.dtype, self.length))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return FileEntry(path=self.path.name, bytes=self.path.stat().st_size, crc32c=file_crc32c(self.path),
                         tokens=self.length)


class SplitWriter:
    """A split's documents, in order, into shards of `shard_tokens` tokens and a document index;
    with `masked`, a loss mask beside each shard, cut at the same places."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, shard_tokens: int, masked: bool = False):
        self.directory, self.name, self.dtype, self.shard_tokens = directory, name, dtype, shard_tokens
        self.shards: list[FileEntry] = []
        self.masks: list[FileEntry] | None = [] if masked else None
        self.current: tuple[NpyAppender, NpyAppender | None] | None = None
        self.index = NpyAppender(directory / f"{name}-docs.npy", np.uint64)
        self.index.append(np.zeros(1, dtype=np.uint64))
        self.tokens = self.documents = self.targets = 0

    def add(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Documents whose framed tokens are `ids`, `lengths` tokens each; `mask` (masked splits):
        1 where a token is a trained target."""
        if (mask is None) != (self.masks is None):
            raise ValueError(f"{self.name}: a loss mask must come with every document of a masked split only")
        self.index.append(self.tokens + np.cumsum(lengths, dtype=np.uint64))
        self.tokens += len(ids)
        self.documents += len(lengths)
        if mask is not None:
            self.targets += int(np.count_nonzero(mask))
        while len(ids):
            if self.current is None:
                number = len(self.shards)
                self.current = (NpyAppender(self.directory / f"{self.name}-{number:05d}.npy", self.dtype),
                                None if mask is None else
                                NpyAppender(self.directory / f"{self.name}-mask-{number:05d}.npy", np.uint8))
            tokens, masks = self.current
            room = self.shard_tokens - tokens.length
            tokens.append(ids[:room])
            ids = ids[room:]
            if masks is not None:
                masks.append(mask[:room])
                mask = mask[room:]
            if tokens.length == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        tokens, masks = self.current
        self.shards.append(tokens.close())
        if masks is not None:
            self.masks.append(masks.close())
        self.current = None

    def close(self) -> Split:
        if self.current is not None:
            self._close_shard()
        return Split(documents=self.documents, tokens=self.tokens, shards=self.shards, index=self.index.close(),
                     masks=self.masks or [], targets=None if self.masks is None else self.targets)


def _open(path: Path, expected: FileEntry) -> np.memmap:
    """Map a shard after checking it against its manifest entry (sizes: a full CRC at every start
    would read the whole dataset; fetched copies are checked in full, engine.data.remote)."""
    size = path.stat().st_size
    if size != expected.bytes:
        raise ValueError(f"{path}: {size} bytes, the manifest says {expected.bytes} (damaged or truncated)")
    with open(path, "rb") as f:
        head = f.read(_HEADER)
    try:
        if head[:6] != _MAGIC[:6]:
            raise ValueError("not a .npy file")
        length = int.from_bytes(head[8:10], "little")
        header = ast.literal_eval(head[10:10 + length].decode("latin1"))
        dtype, (count,) = np.dtype(header["descr"]), header["shape"]
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: damaged shard header ({e})") from None
    if 10 + length + count * dtype.itemsize != expected.bytes or count != expected.tokens:
        raise ValueError(f"{path}: holds {count} tokens in {size} bytes, the manifest says "
                         f"{expected.tokens} in {expected.bytes}")
    return np.memmap(path, dtype=dtype, mode="r", offset=10 + length, shape=(count,))


def document_index(directory: Path, split: Split) -> np.memmap:
    """The split's document index (uint64: 0, then where each document ends), memory-mapped."""
    return _open(directory / split.index.path, split.index)


class TokenStream:
    """A split's tokens (or with `masks`, its loss mask), read by position across its memory-mapped shards."""

    def __init__(self, directory: Path, split: Split, masks: bool = False):
        self.shards = [_open(directory / entry.path, entry) for entry in (split.masks if masks else split.shards)]
        self.starts = [0]
        for shard in self.shards:
            self.starts.append(self.starts[-1] + len(shard))
        self.n_tokens = self.starts[-1]
        if self.n_tokens != split.tokens:
            raise ValueError(f"{directory}: shards hold {self.n_tokens} tokens, the manifest says {split.tokens}")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens start .. stop - 1 of the stream (a copy)."""
        i = bisect.bisect_right(self.starts, start) - 1
        parts = []
        while start < stop:
            shard, offset = self.shards[i], start - self.starts[i]
            take = min(stop - start, len(shard) - offset)
            parts.append(shard[offset:offset + take])
            start, i = start + take, i + 1
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])


class ArrayStream:
    """The same reads from tokens held in memory (the built-in corpus)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self.n_tokens = tokens, len(tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.array(self.tokens[start:stop])

"""The inputs of `tpud prepare`: finding them, and reading their texts one record at a time.

An input is a file, a directory (searched recursively) or a glob, local or gs://. Formats go
by suffix, each optionally compressed (.gz, .zst):

    .jsonl .json   one JSON object per line; the text is one field of it
    .parquet       one row per document; the text is one column
    .csv .tsv      a header row names the columns; the text is one column
    .txt           the whole file is one document

Readers stream (nothing holds a whole file) and never raise on bad content: they yield a
`Problem` naming the file and line or row, and the caller decides whether to stop or skip.
Torch-free.
"""

from __future__ import annotations

import csv
import fnmatch
import glob
import gzip
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "txt"}
COMPRESSIONS = (".gz", ".zst")
_GLOB = re.compile(r"[*?\[]")
csv.field_size_limit(2**31 - 1)  # a document may be long; the default limit is 128 KiB


class InputError(ValueError):
    """An input argument that names nothing readable."""


@dataclass(frozen=True)
class Source:
    """One input file: where it is, what it holds, and how it is compressed."""

    url: str  # a local path or gs://bucket/name
    size: int
    mtime: float  # seconds since the epoch (for gs://, the object's update time)

    @property
    def compression(self) -> str | None:
        suffix = _suffix(self.url)
        return suffix if suffix in COMPRESSIONS else None

    @property
    def format(self) -> str:
        name = self.url[: -len(self.compression)] if self.compression else self.url
        return FORMATS[_suffix(name)]

    def open(self) -> BinaryIO:
        """The file's bytes, decompressed, as a stream."""
        if self.url.startswith("gs://"):
            from engine.data import remote

            raw = remote.open_blob(self.url)
        else:
            raw = open(self.url, "rb")
        if self.compression == ".gz":
            return gzip.GzipFile(fileobj=raw, mode="rb")
        if self.compression == ".zst":
            import zstandard

            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
        return raw


@dataclass(frozen=True)
class Record:
    text: str
    where: str  # FILE:LINE or FILE:row N


@dataclass(frozen=True)
class Problem:
    where: str
    reason: str
    kind: str  # a short category, counted in the manifest: "malformed JSON", "not a string", ...

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def _suffix(name: str) -> str:
    return os.path.splitext(name)[1].lower()


def supported(name: str) -> bool:
    base = name[: -len(_suffix(name))] if _suffix(name) in COMPRESSIONS else name
    return _suffix(base) in FORMATS


def discover(inputs: Iterable[str], exclude: str | None = None) -> list[Source]:
    """Every input file, in argument order, each directory's and glob's files in sorted order.

    An argument that names nothing, or only files of no known format, is an InputError: a
    typo must not quietly prepare a smaller dataset. Files under `exclude` (the output
    directory, which may lie inside an input directory) and hidden files are left out.
    """
    found: list[Source] = []
    seen: set[str] = set()
    for arg in inputs:
        sources = _remote_sources(arg) if arg.startswith("gs://") else _local_sources(arg, exclude)
        if not sources:
            raise InputError(f"{arg}: no input files there (formats: {', '.join(sorted(FORMATS))}, "
                             f"optionally {' or '.join(COMPRESSIONS)})")
        for source in sources:
            if source.url not in seen:
                seen.add(source.url)
                found.append(source)
    return found


def _local_sources(arg: str, exclude: str | None) -> list[Source]:
    if _GLOB.search(arg):
        paths = sorted(glob.glob(arg, recursive=True))
    elif os.path.isdir(arg):
        paths = sorted(str(p) for p in Path(arg).rglob("*")
                       if not any(part.startswith(".") for part in p.relative_to(arg).parts))
    elif os.path.lexists(arg):
        if not os.path.isfile(arg):
            raise InputError(f"{arg}: not a regular file")
        if not supported(arg):
            raise InputError(f"{arg}: unknown format (formats: {', '.join(sorted(FORMATS))}, "
                             f"optionally {' or '.join(COMPRESSIONS)})")
        paths = [arg]
    else:
        raise InputError(f"{arg}: no such file or directory")
    sources = []
    skip = os.path.realpath(exclude) + os.sep if exclude else None
    for path in paths:
        inside_output = skip is not None and os.path.realpath(path).startswith(skip)
        if inside_output or (os.path.basename(path).startswith(".") and path != arg):
            continue
        if supported(path) and os.path.isfile(path):
            stat = os.stat(path)
            sources.append(Source(path, stat.st_size, stat.st_mtime))
    return sources


def _remote_sources(arg: str) -> list[Source]:
    from engine.data import remote

    bucket, prefix = remote.split(arg)
    pattern = prefix if _GLOB.search(prefix) else None
    listing_prefix = prefix[: _GLOB.search(prefix).start()] if pattern else prefix
    sources = []
    for name, size, mtime in remote.list_objects(bucket, listing_prefix):
        exact_or_below = name == prefix or name.startswith(prefix.rstrip("/") + "/") or not prefix
        if (fnmatch.fnmatchcase(name, pattern) if pattern else exact_or_below) and supported(name):
            sources.append(Source(f"gs://{bucket}/{name}", size, mtime))
    return sorted(sources, key=lambda s: s.url)


def read(source: Source, text_field: str) -> Iterator[Record | Problem]:
    """The source's documents in order, or the problems found instead of them."""
    try:
        with source.open() as stream:
            yield from _READERS[source.format](source.url, stream, text_field)
    except (OSError, EOFError) as e:  # unreadable, truncated or corrupt compressed data
        yield Problem(source.url, f"cannot read: {e}", "unreadable")


def _jsonl(url: str, stream: BinaryIO, field: str) -> Iterator[Record | Problem]:
    empty = True
    for number, raw in enumerate(stream, 1):
        if not raw.strip():
            continue  # blank lines (a trailing newline, say) hold no record
        empty = False
        where = f"{url}:{number}"
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError as e:
            yield Problem(where, f"invalid UTF-8 at byte {e.start}", "invalid UTF-8")
            continue
        except (json.JSONDecodeError, RecursionError) as e:
            yield Problem(where, f"malformed JSON: {e}", "malformed JSON")
            continue
        yield _field(obj, field, where)
    if empty:
        yield Problem(url, "empty file", "empty file")


def _field(obj: object, field: str, where: str) -> Record | Problem:
    if not isinstance(obj, dict):
        return Problem(where, f"not a JSON object but {type(obj).__name__}", "not an object")
    if field not in obj:
        return Problem(where, f"no field {field!r} (fields: {', '.join(map(repr, list(obj)[:8])) or 'none'})",
                       "missing field")
    return _text(obj[field], field, where)


def _text(value: object, field: str, where: str) -> Record | Problem:
    if not isinstance(value, str):
        return Problem(where, f"field {field!r} is {'null' if value is None else type(value).__name__}, not a string",
                       "not a string")
    if not value:
        return Problem(where, f"field {field!r} is empty", "empty text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: from \ud800 escapes, or undecodable bytes
        return Problem(where, f"invalid UTF-8 in field {field!r} at character {e.start}", "invalid UTF-8")
    return Record(value, where)


def _delimited(delimiter: str):
    def reader(url: str, stream: BinaryIO, field: str) -> Iterator[Record | Problem]:
        # Undecodable bytes are kept as surrogates and reported on the record that holds them.
        text = io.TextIOWrapper(stream, encoding="utf-8", errors="surrogateescape", newline="")
        rows = csv.reader(text, delimiter=delimiter)
        try:
            header = next(rows)
        except StopIteration:
            yield Problem(url, "empty file", "empty file")
            return
        except csv.Error as e:
            yield Problem(f"{url}:1", f"malformed header: {e}", "malformed CSV")
            return
        if field not in header:
            yield Problem(f"{url}:1", f"no column {field!r} (columns: {', '.join(map(repr, header[:8]))})", "missing field")
            return
        column, records = header.index(field), 0
        while True:
            try:
                row = next(rows)
            except StopIteration:
                break
            except csv.Error as e:
                yield Problem(f"{url}:{rows.line_num}", f"malformed row: {e}", "malformed CSV")
                break  # the parser's state is unknown after an error
            if not row:
                continue
            records += 1
            where = f"{url}:{rows.line_num}"
            if column >= len(row):
                yield Problem(where, f"row has {len(row)} columns, no {field!r}", "missing field")
            else:
                yield _text(row[column], field, where)
        if not records:
            yield Problem(url, "no rows after the header", "empty file")

    return reader


def _txt(url: str, stream: BinaryIO, field: str) -> Iterator[Record | Problem]:
    data = stream.read()
    if not data.strip():
        yield Problem(url, "empty file", "empty file")
        return
    try:
        yield Record(data.decode("utf-8"), url)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        yield Problem(f"{url}:{line}", f"invalid UTF-8 at byte {e.start}", "invalid UTF-8")


def _parquet(url: str, stream: BinaryIO, field: str) -> Iterator[Record | Problem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _seekable(stream) as file:
        try:
            parquet = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as e:
            yield Problem(url, f"not a readable parquet file: {e}", "unreadable")
            return
        names = parquet.schema_arrow.names
        if field not in names:
            yield Problem(url, f"no column {field!r} (columns: {', '.join(map(repr, names[:8]))})", "missing field")
            return
        if parquet.metadata.num_rows == 0:
            yield Problem(url, "empty file (no rows)", "empty file")
            return
        row = 0
        try:
            for batch in parquet.iter_batches(batch_size=1024, columns=[field]):
                for value in batch.column(0).to_pylist():
                    row += 1
                    yield _text(value, field, f"{url}:row {row}")
        except (pa.ArrowException, OSError) as e:
            yield Problem(f"{url}:row {row + 1}", f"unreadable parquet data: {e}", "unreadable")


class _seekable:
    """Parquet needs random access: a compressed stream is first spooled to a temporary file."""

    def __init__(self, stream: BinaryIO):
        self.stream, self.spool = stream, None

    def __enter__(self) -> BinaryIO:
        if self.stream.seekable() and not isinstance(self.stream, gzip.GzipFile):  # gzip seeks by re-reading
            return self.stream
        self.spool = tempfile.TemporaryFile()
        shutil.copyfileobj(self.stream, self.spool, 1 << 20)
        self.spool.seek(0)
        return self.spool

    def __exit__(self, *exc) -> None:
        if self.spool is not None:
            self.spool.close()


_READERS = {"jsonl": _jsonl, "csv": _delimited(","), "tsv": _delimited("\t"), "txt": _txt, "parquet": _parquet}

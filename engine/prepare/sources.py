"""The inputs of `tpud prepare`: finding them, and reading their texts one record at a time.

An input is a file, a directory (searched recursively) or a glob, local or gs://. Formats go
by suffix, each optionally compressed (.gz, .zst):

    .jsonl .json   one JSON object per line; the text is one field of it
    .parquet       one row per document; the text is one column
    .csv .tsv      a header row names the columns; the text is one column
    .txt           the whole file is one document

Readers stream and never raise on bad content: they yield a `Problem` naming the file and line
or row, and the caller decides whether to stop or skip. Memory is bounded whatever the input
(a line that decompresses to gigabytes, say): nothing holds more than `max_doc_bytes` of one
line, field or document, or one parquet row group of at most ROW_GROUP_BYTES. A longer record
is a "too long" problem; a longer .txt file, whose lines no structure ties together, is cut into
documents of at most `max_doc_bytes` (at a line break where there is one). Torch-free.
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
ROW_GROUP_BYTES = 512 << 20  # a parquet row group's text column is read whole: larger ones are refused
TOO_LONG = "too long"


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


class Conversations:
    """What a chat or prompt/completion record holds, in place of a text field: each record's
    conversation becomes a Record whose text is its messages as JSON ([{"role", "content"}, ...])."""

    COLUMNS = {"chat": ("messages", "conversations"), "prompt-completion": ("prompt", "completion")}

    def __init__(self, fmt: str):
        self.format, self.columns = fmt, self.COLUMNS[fmt]

    def record(self, obj: object, where: str, limit: int) -> Record | Problem:
        from engine.prepare.chat import ChatError, conversation

        try:
            messages = conversation(obj, self.format)
        except ChatError as e:
            return Problem(where, str(e), "bad conversation")
        text = json.dumps(messages, ensure_ascii=False)
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # lone surrogates, from \ud800 escapes
            return Problem(where, f"invalid UTF-8 in the conversation at character {e.start}", "invalid UTF-8")
        return _too_long(where, "a conversation", limit) if size > limit else Record(text, where)


def read(source: Source, field: str | Conversations, max_doc_bytes: int) -> Iterator[Record | Problem]:
    """The source's documents in order, or the problems found instead of them; `field` names the
    text field, or says the records are conversations."""
    if isinstance(field, Conversations) and source.format not in ("jsonl", "parquet"):
        yield Problem(source.url, f"{field.format} data is read from .jsonl, .json or .parquet files",
                      "not conversations")
        return
    try:
        with source.open() as stream:
            yield from _READERS[source.format](source.url, stream, field, max_doc_bytes)
    except (OSError, EOFError) as e:  # unreadable, truncated or corrupt compressed data
        yield Problem(source.url, f"cannot read: {e}", "unreadable")


def _jsonl(url: str, stream: BinaryIO, field: str, limit: int) -> Iterator[Record | Problem]:
    empty, number = True, 0
    while raw := stream.readline(limit + 1):
        number += 1
        if not raw.strip():
            continue  # blank lines (a trailing newline, say) hold no record
        empty = False
        where = f"{url}:{number}"
        if len(raw) > limit and not raw.endswith(b"\n"):
            _skip_line(stream)
            yield _too_long(where, "a line", limit)
            continue
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError as e:
            yield Problem(where, f"invalid UTF-8 at byte {e.start}", "invalid UTF-8")
            continue
        except (json.JSONDecodeError, RecursionError) as e:
            yield Problem(where, f"malformed JSON: {e}", "malformed JSON")
            continue
        yield field.record(obj, where, limit) if isinstance(field, Conversations) else _field(obj, field, where, limit)
    if empty:
        yield Problem(url, "empty file", "empty file")


def _skip_line(stream: BinaryIO) -> None:
    """Read past the rest of an over-long line, a bounded piece at a time."""
    while (piece := stream.readline(1 << 20)) and not piece.endswith(b"\n"):
        pass


def _too_long(where: str, what: str, limit: int, then: str = "") -> Problem:
    return Problem(where, f"{what} of more than {limit} bytes (--max-doc-bytes raises the limit){then}", TOO_LONG)


def _field(obj: object, field: str, where: str, limit: int) -> Record | Problem:
    if not isinstance(obj, dict):
        return Problem(where, f"not a JSON object but {type(obj).__name__}", "not an object")
    if field not in obj:
        return Problem(where, f"no field {field!r} (fields: {', '.join(map(repr, list(obj)[:8])) or 'none'})",
                       "missing field")
    return _text(obj[field], field, where, limit)


def _text(value: object, field: str, where: str, limit: int) -> Record | Problem:
    if not isinstance(value, str):
        return Problem(where, f"field {field!r} is {'null' if value is None else type(value).__name__}, not a string",
                       "not a string")
    if not value:
        return Problem(where, f"field {field!r} is empty", "empty text")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates: from \ud800 escapes, or undecodable bytes
        return Problem(where, f"invalid UTF-8 in field {field!r} at character {e.start}", "invalid UTF-8")
    if size > limit:
        return _too_long(where, f"field {field!r}", limit)
    return Record(value, where)


class _LineTooLong(Exception):
    pass


def _bounded_lines(text: io.TextIOWrapper, limit: int) -> Iterator[str]:
    while line := text.readline(limit + 1):
        if len(line) > limit and not line.endswith(("\n", "\r")):
            raise _LineTooLong
        yield line


def _delimited(delimiter: str):
    def reader(url: str, stream: BinaryIO, field: str, limit: int) -> Iterator[Record | Problem]:
        # Undecodable bytes are kept as surrogates and reported on the record that holds them.
        text = io.TextIOWrapper(stream, encoding="utf-8", errors="surrogateescape", newline="")
        csv.field_size_limit(limit)  # a quoted field spanning lines is bounded by the parser
        rows = csv.reader(_bounded_lines(text, limit), delimiter=delimiter)
        try:
            header = next(rows)
        except StopIteration:
            yield Problem(url, "empty file", "empty file")
            return
        except _LineTooLong:
            yield _too_long(f"{url}:1", "a header line", limit)
            return
        except csv.Error as e:
            yield Problem(f"{url}:1", f"malformed header: {e}", "malformed CSV")
            return
        if field not in header:
            yield Problem(f"{url}:1", f"no column {field!r} (columns: {', '.join(map(repr, header[:8]))})", "missing field")
            return
        column, records = header.index(field), 0
        lost = "; the rest of the file is not read"  # the parser cannot tell where the next row starts
        while True:
            start = rows.line_num + 1
            try:
                row = next(rows)
            except StopIteration:
                break
            except _LineTooLong:
                yield _too_long(f"{url}:{start}", "a line", limit, lost)
                break
            except csv.Error as e:
                if "field larger than field limit" in str(e):
                    yield _too_long(f"{url}:{start}", "a field", limit, lost)
                else:
                    yield Problem(f"{url}:{rows.line_num}", f"malformed row: {e}", "malformed CSV")
                break  # the parser's state is unknown after an error
            if not row:
                continue
            records += 1
            where = f"{url}:{rows.line_num}"
            if column >= len(row):
                yield Problem(where, f"row has {len(row)} columns, no {field!r}", "missing field")
            else:
                yield _text(row[column], field, where, limit)
        if not records:
            yield Problem(url, "no rows after the header", "empty file")

    return reader


def _txt(url: str, stream: BinaryIO, field: str, limit: int) -> Iterator[Record | Problem]:
    """The file as one document, or, past `limit` bytes, as documents cut at line breaks."""
    data = _read_up_to(stream, limit + 1)
    if len(data) <= limit:
        if not data.strip():
            yield Problem(url, "empty file", "empty file")
            return
        yield _decoded(url, data, url, 1, 0)
        return
    line, offset = 1, 0
    while data:
        cut = _cut(data, limit) if len(data) > limit else len(data)
        piece, data = data[:cut], data[cut:]
        if piece.strip():
            yield _decoded(url, piece, f"{url}:{line}", line, offset)
        line, offset = line + piece.count(b"\n"), offset + cut
        data += _read_up_to(stream, limit + 1 - len(data))


def _read_up_to(stream: BinaryIO, size: int) -> bytes:
    parts, wanted = [], size
    while wanted > 0 and (part := stream.read(min(wanted, 8 << 20))):
        parts.append(part)
        wanted -= len(part)
    return b"".join(parts)


def _cut(data: bytes, limit: int) -> int:
    """Where to end a piece of at most `limit` bytes: after its last line break in the second
    half, else on a UTF-8 character boundary."""
    newline = data.rfind(b"\n", limit // 2, limit)
    if newline >= 0:
        return newline + 1
    cut = limit
    while cut > 0 and data[cut] & 0xC0 == 0x80:  # a continuation byte: back up to its character's start
        cut -= 1
    return cut or limit


def _decoded(url: str, data: bytes, where: str, line: int, offset: int) -> Record | Problem:
    try:
        return Record(data.decode("utf-8"), where)
    except UnicodeDecodeError as e:
        at = line + data.count(b"\n", 0, e.start)
        return Problem(f"{url}:{at}", f"invalid UTF-8 at byte {offset + e.start}", "invalid UTF-8")


def _parquet(url: str, stream: BinaryIO, field: str, limit: int) -> Iterator[Record | Problem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _seekable(stream) as file:
        try:
            parquet = pq.ParquetFile(file)
        except (pa.ArrowException, OSError) as e:
            yield Problem(url, f"not a readable parquet file: {e}", "unreadable")
            return
        names = parquet.schema_arrow.names
        columns = [c for c in field.columns if c in names] if isinstance(field, Conversations) else [field]
        if not columns or columns[0] not in names:
            wanted = " or ".join(map(repr, field.columns if isinstance(field, Conversations) else [field]))
            yield Problem(url, f"no column {wanted} (columns: {', '.join(map(repr, names[:8]))})", "missing field")
            return
        if parquet.metadata.num_rows == 0:
            yield Problem(url, "empty file (no rows)", "empty file")
            return
        row = 0
        try:
            for group in range(parquet.num_row_groups):
                meta = parquet.metadata.row_group(group)
                size = sum(meta.column(i).total_uncompressed_size for i in range(meta.num_columns)
                           if meta.column(i).path_in_schema.split(".")[0] in columns)
                if size > ROW_GROUP_BYTES:
                    yield Problem(f"{url}:row {row + 1}", f"row group {group} holds {size} bytes of {columns}, "
                                  f"more than the {ROW_GROUP_BYTES} read at once (write it with smaller row groups)",
                                  TOO_LONG)
                    row += meta.num_rows
                    continue
                for batch in parquet.iter_batches(batch_size=1024, row_groups=[group], columns=columns):
                    if isinstance(field, Conversations):
                        for obj in batch.to_pylist():
                            row += 1
                            yield field.record(obj, f"{url}:row {row}", limit)
                        continue
                    for value in batch.column(0).to_pylist():
                        row += 1
                        yield _text(value, field, f"{url}:row {row}", limit)
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

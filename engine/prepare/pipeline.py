"""The work of `tpud prepare` (engine.prepare.command): texts -> tokens -> a prepared dataset.

The expensive text work happens here, once, off the accelerator hosts: reading jsonl/parquet/csv/tsv/txt (engine.prepare.sources), tokenizing in
worker processes around the tokenizer's batch encode, and writing each split's token stream
as shards with a document index (engine.data.shards) and manifest.json last
(engine.data.manifest). Training then only memory-maps the shards.

The main process reads records and writes shards; `--workers` processes tokenize, at most a
few chunks' worth of text ahead, so memory stays bounded for inputs larger than RAM (and one
document is bounded by --max-doc-bytes, see engine.prepare.sources). Results are taken in
submission order, so the same inputs and options give byte-identical shards. A worker that
dies (the kernel's out-of-memory killer, a signal, a crash) fails the run at once, naming the
records it was encoding.

Everything is written to DIR/.incomplete/ and moved into DIR before the manifest is
written, so an interrupted run leaves nothing that looks complete; running it again starts
over cleanly (the inputs are re-read), and a run whose inputs and options match an existing
manifest has nothing to do. A gs:// output is prepared in a local work directory and
uploaded, manifest last. Torch-free.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path

import numpy as np
import structlog

from engine.checkpoint.manifest import file_crc32c
from engine.data import manifest as mf
from engine.data import order
from engine.prepare import chat, sources
from engine.prepare import tokenizer as tk
from engine.prepare.options import Options, PrepareError
from engine.prepare.packing import ConversationEncoder, Encoded, Packer
from engine.data.shards import SplitWriter
from engine.layout import atomic_write, fsync_path

log = structlog.get_logger()

STAGING = ".incomplete"
CHUNK_CHARS = 1 << 20  # text per task sent to a worker: large enough to amortise the pickling
VAL_KEY = 0x5641_4C49  # the validation draw's hash key, mixed with --seed


# --- worker processes ---

_worker: tuple[tk.Tokenizer, ConversationEncoder | None] | None = None


def _init_worker(tokenizer: tk.Tokenizer, conversations: ConversationEncoder | None) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core is the parallelism
    _worker = tokenizer, conversations


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray] | Encoded:
    return _encode_with(*_worker, texts)


def _encode_with(tokenizer: tk.Tokenizer, conversations: ConversationEncoder | None,
                 texts: list[str]) -> tuple[np.ndarray, np.ndarray] | Encoded:
    """Texts as framed ids and lengths; conversations as an Encoded chunk."""
    return tokenizer.encode_batch(texts) if conversations is None else conversations.encode(tokenizer, texts)


class Encoder:
    """Chunks of texts encoded in worker processes, results in submission order, few in flight.

    In flight is bounded by text, not by chunks: a chunk holding one long document counts for
    what it is. With one worker the main process encodes itself: a lone worker process would
    only add the copying between the two, and its start-up.
    """

    def __init__(self, tokenizer: tk.Tokenizer, workers: int, conversations: ConversationEncoder | None = None):
        self.tokenizer, self.conversations = tokenizer, conversations
        self.context = _RecordingContext()
        self.pool = ProcessPoolExecutor(workers, self.context, _init_worker,
                                        (tokenizer, conversations)) if workers > 1 else None
        self.pending: collections.deque[tuple[Future, object, int, str]] = collections.deque()
        self.in_flight, self.budget = 0, 2 * workers * CHUNK_CHARS

    def submit(self, texts: list[str], tag: object, span: str) -> Iterator[tuple[object, object]]:
        """Queue a chunk (`span` names its records); yields the (result, tag) pairs collected to make room."""
        if self.pool is None:
            yield _encode_with(self.tokenizer, self.conversations, texts), tag
            return
        chars = sum(map(len, texts))
        while self.pending and self.in_flight + chars > self.budget:
            yield self._collect()
        try:
            self.pending.append((self.pool.submit(_encode, texts), tag, chars, span))
        except BrokenProcessPool:
            raise self._died(span) from None
        except (OSError, ValueError):
            # Starting a worker just as another dies can trip over the pipes the pool is closing.
            if not self._ended():
                raise
            raise self._died(span) from None
        self.in_flight += chars

    def drain(self) -> Iterator[tuple[object, object]]:
        while self.pending:
            yield self._collect()

    def _collect(self) -> tuple[object, object]:
        future, tag, chars, span = self.pending.popleft()
        try:
            result = future.result()
        except BrokenProcessPool:
            raise self._died(span) from None
        self.in_flight -= chars
        return result, tag

    def _ended(self) -> list[multiprocessing.process.BaseProcess]:
        started = [p for p in self.context.started if p.pid is not None]
        ready = multiprocessing.connection.wait([p.sentinel for p in started], timeout=0)
        return [p for p in started if p.sentinel in ready]

    def _died(self, span: str) -> PrepareError:
        # The pool knows a worker died when its sentinel closes, which the kernel does a moment
        # before the exit status can be read: wait for the status of those.
        ended = self._ended()
        for process in ended:
            process.join()
            # The pool's own thread may have reaped it first and not yet recorded the status on the
            # same object: this join then returns with none. It is a matter of instructions.
            settled = time.monotonic() + 1.0
            while process.exitcode is None and time.monotonic() < settled:
                time.sleep(0.001)
        codes = {p.exitcode for p in ended if p.exitcode is not None} - {0}
        if len(codes) > 1:
            codes.discard(-signal.SIGTERM)  # how the pool stops the others once one has died
        how = sorted(map(_how, codes))
        # The pool stops only the workers in its table; one it was starting as the other died can
        # sit on the task queue's lock forever, and the pool's shutdown waits for it.
        for process in self.context.started:
            if process not in ended and process.pid is not None and process.is_alive():
                process.kill()
                process.join()
        return PrepareError(f"a tokenizer process died ({', '.join(how) or 'it exited'}) while encoding {span}; "
                            f"nothing was written (for a document too large for memory, lower --max-doc-bytes)")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class _RecordingContext(multiprocessing.context.SpawnContext):
    """Spawn, keeping every worker process the pool makes: its exit status outlives the pool's table."""

    def __init__(self):
        super().__init__()
        self.started: list[multiprocessing.process.BaseProcess] = []

    def Process(self, *args, **kwargs):  # noqa: N802 (multiprocessing's name)
        process = super().Process(*args, **kwargs)
        self.started.append(process)
        return process


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit status {exitcode}"
    name = signal.Signals(-exitcode).name
    if name == "SIGKILL":
        return "killed by SIGKILL, as the kernel's out-of-memory killer does: see `dmesg`"
    return f"killed by {name}"


# --- reading, with the --on-error policy ---

class Reader:
    """Every input's records in order; problems raise (fail) or are counted (skip)."""

    def __init__(self, inputs: list[sources.Source], opts: Options):
        self.inputs, self.opts = inputs, opts
        self.skips = mf.Skips()
        self.per_source: dict[str, list[int]] = {s.url: [0, 0] for s in inputs}  # documents, skipped
        self.bytes_done = 0  # input bytes of the sources finished, for progress

    def records(self) -> Iterator[sources.Record]:
        self.skips, self.bytes_done = mf.Skips(), 0
        self.per_source = {s.url: [0, 0] for s in self.inputs}
        for source in self.inputs:
            counts = self.per_source[source.url]
            field = sources.Conversations(self.opts.format) if self.opts.chat else self.opts.text_field
            for item in sources.read(source, field, self.opts.max_doc_bytes):
                if isinstance(item, sources.Problem):
                    self.problem(item)
                    counts[1] += 1
                    continue
                counts[0] += 1
                yield item
            self.bytes_done += source.size

    def rejected(self, item: sources.Problem) -> None:
        """A record read and counted, then found bad (a conversation its template refuses)."""
        self.problem(item)
        counts = self.per_source.get(item.where.rsplit(":", 1)[0])  # FILE:LINE or FILE:row N
        if counts is not None:
            counts[0] -= 1
            counts[1] += 1

    def problem(self, item: sources.Problem) -> None:
        """A bad record: raises (fail) or counts it (skip)."""
        if self.opts.on_error == "fail":
            raise PrepareError(f"{item} (--on-error skip skips such records and counts them)")
        by_reason = dict(self.skips.by_reason)
        by_reason[item.kind] = by_reason.get(item.kind, 0) + 1
        examples = self.skips.examples + [str(item)] if len(self.skips.examples) < 20 else self.skips.examples
        self.skips = mf.Skips(count=self.skips.count + 1, by_reason=by_reason, examples=examples)

    def texts(self) -> Iterator[str]:
        return (record.text for record in self.records())


# --- the run ---

class Progress:
    """Documents, tokens, MB/s and ETA: a tqdm bar on a terminal, a log line every 10 s otherwise."""

    def __init__(self, total_bytes: int, enabled: bool | None):
        self.total, self.started, self.last_log = max(total_bytes, 1), time.monotonic(), 0.0
        self.docs = self.tokens = self.text_bytes = 0
        self.bar = None
        if enabled or (enabled is None and sys.stderr.isatty()):
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)

    def update(self, docs: int, tokens: int, text_bytes: int, finished_bytes: int) -> None:
        """finished_bytes: the input files read to their end; text read so far estimates the rest."""
        self.docs, self.tokens, self.text_bytes = self.docs + docs, self.tokens + tokens, self.text_bytes + text_bytes
        done = min(max(finished_bytes, self.text_bytes), self.total)
        elapsed = time.monotonic() - self.started
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix(docs=self.docs, tokens=self.tokens, refresh=False)
            self.bar.refresh()
        elif time.monotonic() - self.last_log >= 10:
            self.last_log = time.monotonic()
            rate = done / elapsed if elapsed else 0.0
            log.info("preparing", documents=self.docs, tokens=self.tokens, mb_per_s=round(rate / 1e6, 2),
                     eta_s=round((self.total - done) / rate) if rate else None)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


CHAT_OPTIONS = ("format", "train_on", "seq_len", "overlong")


def fingerprint(inputs: list[sources.Source], opts: Options, tokenizer_id: str, template_id: str | None = None) -> str:
    what = {"format": mf.FORMAT, "inputs": [(s.url, s.size, s.mtime) for s in inputs], "tokenizer": tokenizer_id,
            "text_field": opts.text_field, "val_fraction": opts.val_fraction, "val_docs": opts.val_docs,
            "seed": opts.seed, "shard_tokens": opts.shard_tokens, "on_error": opts.on_error,
            "max_doc_bytes": opts.max_doc_bytes}
    if opts.chat:  # only then: text datasets prepared before chat data existed stay up to date
        what |= {"chat": {key: getattr(opts, key) for key in CHAT_OPTIONS} | {"template": template_id}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _template(opts: Options) -> chat.Template | None:
    if not opts.chat:
        return None
    if tk.parse_spec(opts.tokenizer) is not None:
        raise PrepareError(f"--tokenizer {opts.tokenizer}: chat data needs the model's own tokenizer (a tokenizer "
                           f"trained here would learn its special tokens from nothing)")
    return chat.Template.load(opts.tokenizer, opts.chat_template)


def _tokenizer_id(spec: str) -> str:
    if spec == "bytes" or tk.parse_spec(spec) is not None:
        return spec
    return tk.load(spec).sha256


def prepare(opts: Options) -> mf.Manifest:
    """Prepare the dataset `opts` describes; its manifest. PrepareError on bad input."""
    try:
        inputs = sources.discover(opts.inputs, exclude=None if opts.out.startswith("gs://") else opts.out)
        tokenizer_id = _tokenizer_id(opts.tokenizer)
        template = _template(opts)
    except (sources.InputError, tk.TokenizerError, chat.ChatError) as e:
        raise PrepareError(str(e)) from None
    digest = fingerprint(inputs, opts, tokenizer_id, template and template.sha256)
    if opts.out.startswith("gs://"):
        return _prepare_remote(inputs, opts, digest, template)
    return _prepare_local(inputs, opts, digest, Path(opts.out), template)


def _prepare_remote(inputs: list[sources.Source], opts: Options, digest: str,
                    template: chat.Template | None) -> mf.Manifest:
    from engine.data import remote

    existing = remote.read_manifest(opts.out)
    if existing is not None and existing.fingerprint == digest and not opts.overwrite:
        log.info("dataset is up to date", out=opts.out, identity=existing.identity)
        return existing
    if existing is not None and not opts.overwrite:
        raise PrepareError(f"{opts.out}: already holds a dataset prepared from other inputs or options "
                           f"(--overwrite replaces it)")
    root = Path(opts.work_dir or tempfile.gettempdir())
    local = root / f"tpud-prepare-{hashlib.sha256(opts.out.encode()).hexdigest()[:16]}"
    manifest = _prepare_local(inputs, opts, digest, local, template)
    log.info("uploading dataset", out=opts.out, files=len(manifest.files))
    remote.upload(local, opts.out, manifest)
    log.info("dataset uploaded", out=opts.out, identity=manifest.identity)
    return manifest


def _prepare_local(inputs: list[sources.Source], opts: Options, digest: str, out: Path,
                   template: chat.Template | None) -> mf.Manifest:
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".prepare.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrepareError(f"{out}: another tpud prepare is writing there") from None
        if (out / mf.MANIFEST).exists():
            try:
                existing = mf.read(out)
            except mf.DatasetError:
                existing = None
            if existing is not None and existing.fingerprint == digest and not opts.overwrite:
                log.info("dataset is up to date", out=str(out), identity=existing.identity)
                return existing
            if not opts.overwrite:
                raise PrepareError(f"{out}: already holds a dataset prepared from other inputs or options "
                                   f"(--overwrite replaces it)")
            (out / mf.MANIFEST).unlink()  # from here on it is not a dataset
            fsync_path(out)
        _clear(out)
        staging = out / STAGING
        staging.mkdir()
        try:
            manifest = _write(inputs, opts, digest, staging, template)
        except BaseException:  # bad input, a full disk, Ctrl-C: free the space, leave no half dataset
            shutil.rmtree(staging, ignore_errors=True)
            raise
        for entry in manifest.files:
            os.replace(staging / entry.path, out / entry.path)
        fsync_path(out)
        atomic_write(out / mf.MANIFEST, manifest.to_json())
        shutil.rmtree(staging, ignore_errors=True)
    log.info("dataset prepared", out=str(out), identity=manifest.identity,
             **{f"{name}_tokens": split.tokens for name, split in manifest.splits.items()},
             documents=sum(s.documents for s in manifest.splits.values()), skipped=manifest.skipped.count)
    return manifest


def _ours(name: str) -> bool:
    stem = name.removesuffix(".npy")
    return (name == STAGING or name == "tokenizer.json" or name.startswith(".prepare")
            or (name.endswith(".npy") and stem.split("-")[0] in mf.SPLITS))


def _clear(out: Path) -> None:
    """Remove an earlier, unfinished run's files; refuse a directory holding anything else."""
    foreign = [p.name for p in out.iterdir() if not _ours(p.name)]
    if foreign:
        raise PrepareError(f"{out}: not empty and not a tpud dataset (holds {', '.join(sorted(foreign)[:5])}); "
                           f"choose an empty or new directory")
    for path in out.iterdir():
        if path.name == STAGING:
            shutil.rmtree(path)
        elif not path.name.startswith(".prepare"):
            path.unlink()


def _write(inputs: list[sources.Source], opts: Options, digest: str, staging: Path,
           template: chat.Template | None) -> mf.Manifest:
    """The dataset written into `staging`; `template` (chat data) is the one the fingerprint hashed."""
    reader = Reader(inputs, opts)
    tokenizer = _resolve_tokenizer(opts.tokenizer, reader)
    is_val = _val_selector(opts, reader)
    workers = opts.workers or os.cpu_count() or 1
    writers = {name: SplitWriter(staging, name, tokenizer.dtype, opts.shard_tokens, opts.chat) for name in mf.SPLITS}
    progress = Progress(sum(s.size for s in inputs), opts.progress)
    conversations = None if template is None else ConversationEncoder(template, opts.train_on, opts.seq_len + 1,
                                                                       opts.overlong)
    packing = Packing(writers, reader, opts.seq_len + 1, tokenizer.eos_id) if opts.chat else None
    encoder = Encoder(tokenizer, workers, conversations)

    def store(result: tuple[np.ndarray, np.ndarray] | Encoded, tag: tuple[np.ndarray, int, int, list[str]]) -> None:
        val, text_bytes, finished_bytes, wheres = tag
        if packing is not None:
            packing.add(result, val, wheres)
            progress.update(len(wheres), len(result.ids), text_bytes, finished_bytes)
            return
        ids, lengths = result
        ends = np.cumsum(lengths)
        starts = ends - lengths
        if not val.any():
            writers["train"].add(ids, lengths)
        else:  # route each document; consecutive documents of one split are written together
            for name, mask in (("train", ~val), ("val", val)):
                if mask.any():
                    writers[name].add(np.concatenate([ids[s:e] for s, e in zip(starts[mask], ends[mask])]),
                                      lengths[mask])
        progress.update(len(lengths), len(ids), text_bytes, finished_bytes)

    try:
        ordinal = 0
        for texts, text_bytes, wheres in _chunks(reader.records()):
            val = is_val(np.arange(ordinal, ordinal + len(texts)))
            ordinal += len(texts)
            for result in encoder.submit(texts, (val, text_bytes, reader.bytes_done, wheres),
                                         _span(wheres[0], wheres[-1])):
                store(*result)
        for result in encoder.drain():
            store(*result)
        if packing is not None:
            packing.finish()
    finally:
        encoder.close()
        progress.close()
    splits = {name: writer.close() for name, writer in writers.items()}
    if splits["train"].documents == 0:
        raise PrepareError("no documents to train on: every record was skipped or went to the validation split")
    return _manifest(inputs, opts, digest, staging, tokenizer, reader, splits,
                     None if packing is None else packing.entry(opts, template))


def _manifest(inputs: list[sources.Source], opts: Options, digest: str, staging: Path, tokenizer, reader: Reader,
              splits: dict, chat_entry) -> mf.Manifest:
    """The dataset's manifest: its tokenizer (the file written beside the shards), splits, sources
    and the options that shaped it."""
    token_file = None
    if tokenizer.json is not None:
        (staging / "tokenizer.json").write_text(tokenizer.json)
        token_file = mf.FileEntry(path="tokenizer.json", bytes=(staging / "tokenizer.json").stat().st_size,
                                  crc32c=file_crc32c(staging / "tokenizer.json"))
    entry = mf.Tokenizer(kind=tokenizer.kind, file=token_file, sha256=tokenizer.sha256,
                         vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id)
    files = [f for split in splits.values() for f in (*split.shards, *split.masks, split.index)]
    return mf.Manifest(
        identity=mf.identity(tokenizer.sha256, files), fingerprint=digest, dtype=tokenizer.dtype.name,
        tokenizer=entry, splits=splits,
        sources=[mf.SourceEntry(url=s.url, bytes=s.size, mtime=s.mtime, documents=reader.per_source[s.url][0],
                                skipped=reader.per_source[s.url][1]) for s in inputs],
        skipped=reader.skips,
        options={k: v for k, v in asdict(opts).items() if k in ("text_field", "val_fraction", "val_docs", "seed",
                                                                "shard_tokens", "on_error", "tokenizer",
                                                                "max_doc_bytes", *(CHAT_OPTIONS if opts.chat else ()))},
        chat=chat_entry)


def _chunks(records: Iterator[sources.Record]) -> Iterator[tuple[list[str], int, list[str]]]:
    """Texts in chunks of about CHUNK_CHARS, each with its size and where each record came from."""
    texts, size, wheres = [], 0, []
    for record in records:
        texts.append(record.text)
        wheres.append(record.where)
        size += len(record.text)
        if size >= CHUNK_CHARS:
            yield texts, size, wheres
            texts, size, wheres = [], 0, []
    if texts:
        yield texts, size, wheres


class Packing:
    """Encoded conversations routed to their split's packer, and the windows packed into its writer;
    a conversation the template refuses is a bad record (--on-error)."""

    def __init__(self, writers: dict[str, SplitWriter], reader: Reader, window: int, pad_id: int):
        self.writers, self.reader = writers, reader
        self.packers = {name: Packer(window, pad_id) for name in writers}
        self.outcomes: collections.Counter = collections.Counter()

    def add(self, encoded: Encoded, val: np.ndarray, wheres: list[str]) -> None:
        for i, kind, reason in encoded.notes:
            if kind == "error":
                self.reader.rejected(sources.Problem(wheres[i], reason, "bad conversation"))
            self.outcomes[kind] += 1
        ends = np.cumsum(encoded.lengths)
        for i in np.flatnonzero(encoded.lengths):
            name = "val" if val[i] else "train"
            start = ends[i] - encoded.lengths[i]
            self._write(name, self.packers[name].add(encoded.ids[start:ends[i]], encoded.masks[start:ends[i]]))

    def finish(self) -> None:
        for name, packer in self.packers.items():
            self._write(name, packer.finish())

    def _write(self, name: str, windows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        for ids, masks, lengths in windows:
            self.writers[name].add(ids, lengths, masks)

    def entry(self, opts: Options, template: chat.Template) -> mf.Chat:
        return mf.Chat(format=opts.format, template_sha256=template.sha256, template=template.origin,
                       train_on=opts.train_on, window=opts.seq_len + 1, overlong=opts.overlong,
                       conversations=sum(p.conversations for p in self.packers.values()),
                       dropped=self.outcomes["dropped"], truncated=self.outcomes["truncated"],
                       padding_tokens=sum(p.padding for p in self.packers.values()))


def _span(first: str, last: str) -> str:
    return first if first == last else f"{first} to {last}"


def _resolve_tokenizer(spec: str, reader: Reader) -> tk.Tokenizer:
    try:
        if spec == "bytes":
            return tk.byte_tokenizer()
        if (vocab := tk.parse_spec(spec)) is not None:
            log.info("training a byte-level BPE tokenizer on the inputs", vocab_size=vocab)
            tokenizer = tk.train(reader.texts(), vocab)
            log.info("tokenizer trained", vocab_size=tokenizer.vocab_size)
            return tokenizer
        return tk.load(spec)
    except tk.TokenizerError as e:
        raise PrepareError(str(e)) from None


def _val_selector(opts: Options, reader: Reader) -> Callable[[np.ndarray], np.ndarray]:
    """Which documents (by ordinal among the valid ones) form the validation split."""
    key = order.key_of(VAL_KEY, opts.seed)
    if opts.val_docs is None:
        return lambda ordinals: order.unit(ordinals, key) < opts.val_fraction
    total = sum(1 for _ in reader.records())  # the count decides which N; one extra read of the inputs
    if opts.val_docs >= total:
        raise PrepareError(f"--val-docs {opts.val_docs}: the inputs hold only {total} documents")
    chosen = np.sort(np.random.default_rng(key % (1 << 63)).choice(total, opts.val_docs, replace=False))
    return lambda ordinals: np.isin(ordinals, chosen, assume_unique=True)

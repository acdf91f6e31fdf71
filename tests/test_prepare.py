"""tpud prepare: every input format, the tokenizer's exact ids, bad input, determinism, interruption, gs://."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.data import manifest as mf
from engine.prepare.pipeline import prepare
from engine.prepare.options import Options, PrepareError
from testkit import corpus
from tests.conftest import PYTHON, REPO, python_env

TEXTS = corpus.docstrings(120)


def run(out: Path, *inputs, tokenizer="bytes", **options) -> mf.Manifest:
    return prepare(Options(inputs=tuple(map(str, inputs)), tokenizer=str(tokenizer), out=str(out), workers=1,
                           progress=False, **options))


def documents(out: Path, split: str = "train") -> list[list[int]]:
    manifest = mf.read(out)
    tokens = np.concatenate([np.load(out / s.path) for s in manifest.splits[split].shards])
    offsets = np.load(out / manifest.splits[split].index.path)
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "tpud", "prepare", *args], cwd=REPO, env=python_env(), text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Path:
    return corpus.make_tokenizer(tmp_path_factory.mktemp("tok"), TEXTS)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "tsv", "txt"])
@pytest.mark.parametrize("compression", ["", ".gz", ".zst"])
def test_every_format_holds_exactly_the_tokenizers_ids_framed(tmp_path, hf_tokenizer, fmt, compression):
    texts = TEXTS[:9]
    source = corpus.write(tmp_path / f"in.{fmt}", texts, fmt)
    if compression and fmt == "txt":
        for path in sorted(source.iterdir()):
            corpus.compress(path, compression)
    elif compression:
        source = corpus.compress(source, compression)
    manifest = run(tmp_path / "out", source, tokenizer=hf_tokenizer)
    tok = Tokenizer.from_file(str(hf_tokenizer / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    expected = [[bos, *tok.encode(t, add_special_tokens=False).ids, eos] for t in texts]
    assert documents(tmp_path / "out") == expected
    assert manifest.tokenizer.eos_id == eos and manifest.tokenizer.bos_id == bos and manifest.dtype == "uint16"
    assert manifest.splits["train"].documents == len(texts) and manifest.skipped.count == 0
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (hf_tokenizer / "tokenizer.json").read_text()


def test_bytes_and_trained_tokenizers_and_a_large_vocabulary_in_uint32(tmp_path):
    src = corpus.write(tmp_path / "in.jsonl", TEXTS[:20], "jsonl")
    run(tmp_path / "b", src)
    assert documents(tmp_path / "b")[0] == [*TEXTS[0].encode(), 256]
    trained = run(tmp_path / "t", src, tokenizer="train:400")
    tok = Tokenizer.from_file(str(tmp_path / "t" / "tokenizer.json"))
    assert trained.tokenizer.vocab_size == tok.get_vocab_size() <= 400
    assert documents(tmp_path / "t")[1] == [*tok.encode(TEXTS[1]).ids, tok.token_to_id("<|endoftext|>")]
    # A vocabulary above 65536 needs four bytes a token.
    big = tmp_path / "big"
    big.mkdir()
    vocab = {f"t{i}": i for i in range(70_000)}
    vocab.update({"</s>": 70_000, "[UNK]": 70_001})
    from tokenizers import models, pre_tokenizers

    wide = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    wide.pre_tokenizer = pre_tokenizers.Whitespace()
    wide.save(str(big / "tokenizer.json"))
    words = corpus.write(tmp_path / "w.jsonl", ["t1 t69999 t5"], "jsonl")
    manifest = run(tmp_path / "w", words, tokenizer=big)
    assert manifest.dtype == "uint32" and documents(tmp_path / "w") == [[1, 69_999, 5, 70_000]]


BAD = {
    "malformed.jsonl": (b'{"text": "fine"}\n{"text": oops}\n', r"malformed.jsonl:2: malformed JSON"),
    "missing.jsonl": (b'{"text": "fine"}\n{"body": "x"}\n', r"missing.jsonl:2: no field 'text'"),
    "number.jsonl": (b'{"text": 3}\n', r"number.jsonl:1: field 'text' is int, not a string"),
    "null.jsonl": (b'{"text": null}\n', r"null.jsonl:1: field 'text' is null"),
    "utf8.jsonl": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"utf8.jsonl:2: invalid UTF-8"),
    "utf8.txt": (b"line one\nline \xff two\n", r"utf8.txt:2: invalid UTF-8"),
    "empty.jsonl": (b"", r"empty.jsonl: empty file"),
    "empty.csv": (b"", r"empty.csv: empty file"),
    "broken.parquet": (b"PAR1 this is not parquet", r"broken.parquet: not a readable parquet file"),
    "short.csv": (b"id,text\n1,fine\n2\n", r"short.csv:3: row has 1 columns"),
    "truncated.jsonl.gz": (b"\x1f\x8b\x08\x00\x00\x00", r"truncated.jsonl.gz: cannot read"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_names_the_file_and_line_and_skip_counts_it(tmp_path, name):
    data, message = BAD[name]
    bad = tmp_path / name
    bad.write_bytes(data)
    good = corpus.write(tmp_path / "good.jsonl", TEXTS[:3], "jsonl")
    with pytest.raises(PrepareError, match=message):
        run(tmp_path / "out", good, bad)
    assert not (tmp_path / "out" / mf.MANIFEST).exists()
    manifest = run(tmp_path / "out", good, bad, on_error="skip")
    assert manifest.skipped.count >= 1 and any(message.split(": ", 1)[0] in e for e in manifest.skipped.examples)
    by_source = {s.url: s for s in manifest.sources}
    assert by_source[str(bad)].skipped >= 1 and by_source[str(good)].documents == 3


def test_the_command_line_reports_bad_input_and_bad_arguments(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n{"text": [1]}\n')
    done = cli(str(tmp_path / "a.jsonl"), "--tokenizer", "bytes", "--out", str(tmp_path / "o"))
    assert done.returncode == 1 and "a.jsonl:2: field 'text' is list, not a string" in done.stderr
    assert "--on-error skip" in done.stderr
    for args, message in [
        (["nowhere/*.jsonl"], "no input files there"),
        ([str(tmp_path / "missing.jsonl")], "no such file or directory"),
        ([str(tmp_path / "a.jsonl"), "--tokenizer", str(tmp_path)], "no tokenizer.json there"),
        ([str(tmp_path / "a.jsonl"), "--tokenizer", "train:x"], "train:VOCAB_SIZE"),
        ([str(tmp_path / "a.jsonl"), "--val-fraction", "1.5"], "--val-fraction 1.5"),
        ([str(tmp_path / "a.jsonl"), "--max-doc-bytes", "0k"], "--max-doc-bytes 0: must be from 1 byte to 1T"),
        ([str(tmp_path / "a.jsonl"), "--max-doc-bytes", "1e30"], "must be from 1 byte to 1T"),
    ]:
        full = [*args] if "--tokenizer" in args else [*args, "--tokenizer", "bytes"]
        done = cli(*full, "--out", str(tmp_path / "o2"))
        assert done.returncode == 1 and message in done.stderr, (args, done.stderr)
    (tmp_path / "dir-out").mkdir()
    (tmp_path / "dir-out" / "precious.txt").write_text("keep me")
    done = cli(str(tmp_path / "a.jsonl"), "--tokenizer", "bytes", "--on-error", "skip", "--out", str(tmp_path / "dir-out"))
    assert done.returncode == 1 and "not empty and not a tpud dataset" in done.stderr
    assert (tmp_path / "dir-out" / "precious.txt").read_text() == "keep me"


def test_same_inputs_same_bytes_and_a_rerun_has_nothing_to_do(tmp_path, hf_tokenizer):
    src = corpus.write(tmp_path / "in.jsonl", TEXTS, "jsonl")
    a = run(tmp_path / "a", src, tokenizer=hf_tokenizer, val_fraction=0.2, shard_tokens=2000)
    b = run(tmp_path / "b", src, tokenizer=hf_tokenizer, val_fraction=0.2, shard_tokens=2000)
    assert len(a.splits["train"].shards) > 2 and a.identity == b.identity
    for entry in a.files:
        assert (tmp_path / "a" / entry.path).read_bytes() == (tmp_path / "b" / entry.path).read_bytes()
    written = (tmp_path / "a" / mf.MANIFEST).stat().st_mtime_ns
    assert run(tmp_path / "a", src, tokenizer=hf_tokenizer, val_fraction=0.2, shard_tokens=2000) == a
    assert (tmp_path / "a" / mf.MANIFEST).stat().st_mtime_ns == written
    with pytest.raises(PrepareError, match="--overwrite"):
        run(tmp_path / "a", src, tokenizer=hf_tokenizer, val_fraction=0.3, shard_tokens=2000)
    assert run(tmp_path / "a", src, tokenizer=hf_tokenizer, val_fraction=0.3, shard_tokens=2000,
               overwrite=True).identity != a.identity


def test_the_validation_split_is_chosen_by_document(tmp_path):
    src = corpus.write(tmp_path / "in.jsonl", TEXTS, "jsonl")
    frac = run(tmp_path / "f", src, val_fraction=0.25)
    exact = run(tmp_path / "n", src, val_docs=7)
    assert exact.splits["val"].documents == 7 and exact.splits["train"].documents == len(TEXTS) - 7
    assert 0.1 < frac.splits["val"].documents / len(TEXTS) < 0.4
    everything = {bytes(d[:-1]).decode() for split in ("train", "val") for d in documents(tmp_path / "f", split)}
    assert everything == set(TEXTS)  # every document lands in exactly one split, whole
    with pytest.raises(PrepareError, match="only"):
        run(tmp_path / "x", src, val_docs=len(TEXTS))


def test_an_interrupted_prepare_leaves_no_dataset_and_a_rerun_finishes_it(tmp_path):
    big = corpus.write(tmp_path / "big.jsonl", list(TEXTS) * 150, "jsonl")  # ~10 MB
    out = tmp_path / "out"
    args = [PYTHON, "-m", "engine.prepare.command", str(big), "--tokenizer", "bytes", "--out", str(out),
            "--shard-tokens", "100000", "--workers", "1", "--no-progress"]
    proc = subprocess.Popen(args, cwd=REPO, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not list((out / ".incomplete").glob("train-0000[2-9].npy")):  # a few shards written
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before it could be interrupted"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with pytest.raises(mf.DatasetError, match="interrupted"):
        mf.read(out)
    assert subprocess.run(args, cwd=REPO, env=python_env(), capture_output=True).returncode == 0
    clean = run(tmp_path / "clean", big, shard_tokens=100_000)
    assert mf.read(out).identity == clean.identity
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        [e.path for e in clean.files] + [mf.MANIFEST])


def test_gs_inputs_and_output_against_fake_gcs(tmp_path, gcs_server):
    from engine.data import remote

    bucket = gcs_server.client().bucket("tpud-test")
    for fmt, name in (("jsonl", "raw/a.jsonl"), ("csv", "raw/b.csv")):
        path = corpus.write(tmp_path / Path(name).name, TEXTS[:5] if fmt == "jsonl" else TEXTS[5:8], fmt)
        bucket.blob(name).upload_from_filename(str(path))
    manifest = run("gs://tpud-test/data/ds", "gs://tpud-test/raw", val_docs=2, work_dir=str(tmp_path / "work"))
    assert manifest.splits["train"].documents + manifest.splits["val"].documents == 8
    assert [s.url for s in manifest.sources] == ["gs://tpud-test/raw/a.jsonl", "gs://tpud-test/raw/b.csv"]
    assert remote.read_manifest("gs://tpud-test/data/ds") == manifest
    local = remote.fetch("gs://tpud-test/data/ds", tmp_path / "cache")
    assert mf.read(local) == manifest and remote.fetch("gs://tpud-test/data/ds", tmp_path / "cache") == local
    assert documents(local)[0] in ([*t.encode(), 256] for t in TEXTS[:8])
    # A corrupted object never reaches the cache.
    shard = manifest.splits["train"].shards[0].path
    bucket.blob(f"data/ds/{shard}").upload_from_string(b"\x93NUMPY garbage")
    with pytest.raises(remote.RemoteDataError, match="CRC32C|match"):
        remote.fetch("gs://tpud-test/data/ds", tmp_path / "cache2")
    assert not any((tmp_path / "cache2").glob("*/manifest.json"))
    with pytest.raises(remote.RemoteDataError, match="not a prepared dataset"):
        remote.fetch("gs://tpud-test/raw", tmp_path / "cache3")


def test_an_output_inside_an_input_directory_is_not_read_back(tmp_path):
    corpus.write(tmp_path / "in" / "a.jsonl", TEXTS[:4], "jsonl")
    corpus.write(tmp_path / "in" / ".hidden.jsonl", ["not this"], "jsonl")
    first = run(tmp_path / "in" / "ds", tmp_path / "in", tokenizer="train:300")
    assert [s.url for s in first.sources] == [str(tmp_path / "in" / "a.jsonl")]
    again = run(tmp_path / "in" / "ds", tmp_path / "in", tokenizer="train:300")  # tokenizer.json is there now
    assert again == first


# --- memory bounded whatever the input: --max-doc-bytes, and a tokenizer process that dies ---

LIMIT = 1000


def _bomb(path: Path, size: int, compression: str) -> Path:
    """One jsonl line of `size` bytes, then a fine record, compressed."""
    path.write_bytes(b'{"text": "' + b"a" * size + b'"}\n{"text": "after"}\n')
    return corpus.compress(path, compression)


def _parquet(path: Path, texts) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": list(texts)}), path)
    return path


TOO_LONG = {
    "line.jsonl.gz": (lambda p: _bomb(p.with_suffix(""), 5 * LIMIT, ".gz"), "line.jsonl.gz:1: a line of more than"),
    "line.jsonl.zst": (lambda p: _bomb(p.with_suffix(""), 5 * LIMIT, ".zst"), "line.jsonl.zst:1: a line of more than"),
    # A quoted field may span lines, so after an over-long line or field the rest of the file is lost.
    "line.csv": (lambda p: p.write_text("text\nafter\n" + "b" * 5 * LIMIT + "\nlost\n") and p,
                 "line.csv:3: a line of more"),
    # Each line of this quoted field is short, the field is not.
    "field.csv": (lambda p: p.write_text('text\nafter\n"' + ("c" * 99 + "\n") * 50 + '"\nlost\n') and p,
                  "field.csv:3: a field of more than"),
    "value.parquet": (lambda p: _parquet(p, ["ok", "d" * 5 * LIMIT, "after"]), "value.parquet:row 2: field 'text'"),
}


@pytest.mark.parametrize("name", TOO_LONG)
def test_a_record_past_max_doc_bytes_is_a_named_problem_and_skip_keeps_the_rest(tmp_path, name):
    make, message = TOO_LONG[name]
    bad = make(tmp_path / name)
    with pytest.raises(PrepareError, match=f"{message}.*--max-doc-bytes"):
        run(tmp_path / "out", bad, max_doc_bytes=LIMIT)
    assert not (tmp_path / "out" / mf.MANIFEST).exists() and not (tmp_path / "out" / ".incomplete").exists()
    manifest = run(tmp_path / "out", bad, max_doc_bytes=LIMIT, on_error="skip")
    assert manifest.skipped.count == 1 and manifest.skipped.by_reason == {"too long": 1}
    assert [bytes(d[:-1]).decode() for d in documents(tmp_path / "out")][-1] == "after"
    # The same record is fine under the default limit.
    assert run(tmp_path / "whole", bad).skipped.count == 0


def test_reading_a_decompression_bomb_holds_no_more_than_the_limit(tmp_path):
    import tracemalloc

    from engine.prepare import sources

    bomb = _bomb(tmp_path / "bomb.jsonl", 64 << 20, ".gz")  # 64 MiB in one line, 64 KiB on disk
    [source] = sources.discover([str(bomb)])
    tracemalloc.start()
    try:
        items = list(sources.read(source, "text", 1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [type(i).__name__ for i in items] == ["Problem", "Record"] and items[0].kind == "too long"
    assert peak < 8 << 20, f"reading held {peak >> 20} MiB"


def test_a_text_file_past_the_limit_is_cut_into_documents_at_line_breaks(tmp_path):
    lines = "".join(f"line {i} " + "é" * 100 + "\n" for i in range(40))  # 212 bytes a line
    (tmp_path / "lines.txt").write_text(lines)
    (tmp_path / "oneline.txt").write_text("ü" * 3 * LIMIT)  # no break: cut between characters
    for name, whole in [("lines.txt", lines), ("oneline.txt", "ü" * 3 * LIMIT)]:
        run(tmp_path / name[:-4], tmp_path / name, max_doc_bytes=LIMIT)
        docs = [bytes(d[:-1]) for d in documents(tmp_path / name[:-4])]
        assert len(docs) > 1 and all(len(d) <= LIMIT for d in docs)
        assert b"".join(docs).decode() == whole
        if name == "lines.txt":
            assert all(d.endswith(b"\n") for d in docs)


def test_a_long_document_encodes_in_pieces_to_the_same_ids(hf_tokenizer):
    from engine.prepare import tokenizer as tk

    tok = tk.load(str(hf_tokenizer))
    texts = [" ".join(TEXTS[:40]), TEXTS[0], "\n\n".join(TEXTS[40:60])]
    whole_ids, whole_lengths = tok.encode_batch(texts, piece_chars=1 << 30)
    ids, lengths = tok.encode_batch(texts, piece_chars=300)
    assert len(texts[0]) > 10 * 300 and lengths.tolist() == whole_lengths.tolist()
    assert np.array_equal(ids, whole_ids)
    assert all(len(p) <= 300 for p in tk.pieces(texts[0], 300)) and "".join(tk.pieces(texts[0], 300)) == texts[0]


@pytest.mark.slow
def test_a_tokenizer_process_that_dies_fails_prepare_at_once_naming_the_records(tmp_path):
    big = corpus.write(tmp_path / "big.jsonl", list(TEXTS) * 300, "jsonl")  # ~20 MB
    out = tmp_path / "out"
    proc = subprocess.Popen([PYTHON, "-m", "tpud", "prepare", str(big), "--tokenizer", "bytes", "--out", str(out),
                             "--workers", "2", "--no-progress"], cwd=REPO, env=python_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (workers := _workers(proc.pid)) or not (out / ".incomplete").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    os.kill(workers[0], signal.SIGKILL)  # as the kernel's out-of-memory killer does
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr
    assert "a tokenizer process died (killed by SIGKILL" in stderr and f"while encoding {big}:" in stderr
    assert not (out / mf.MANIFEST).exists() and not (out / ".incomplete").exists()


def _workers(pid: int) -> list[int]:
    """The pool's worker processes among `pid`'s children (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in _cmdline(int(c)) and b"resource_tracker" not in _cmdline(int(c))]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""

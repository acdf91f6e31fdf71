"""Small text corpora for the data tests, written in every input format, and a tokenizer.json
made with the `tokenizers` library (no model hub here)."""

from __future__ import annotations

import ast
import csv
import gzip
import json
import sysconfig
from functools import cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard


@cache
def docstrings(limit: int = 600) -> tuple[str, ...]:
    """Docstrings of the local Python installation's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    found.append(doc)
                    if len(found) == limit:
                        return tuple(found)
    return tuple(found)


def compress(path: Path, suffix: str) -> Path:
    """path + suffix (.gz or .zst), the original removed."""
    data = path.read_bytes()
    out = path.with_name(path.name + suffix)
    out.write_bytes(gzip.compress(data, mtime=0) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data))
    path.unlink()
    return out


def write(path: Path, texts, fmt: str, field: str = "text") -> Path:
    """texts in one input format: jsonl, json, parquet, csv, tsv; txt writes one file per text into path/."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt in ("jsonl", "json"):
        path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    elif fmt == "parquet":
        pq.write_table(pa.table({"id": list(range(len(texts))), field: list(texts)}), path)
    elif fmt in ("csv", "tsv"):
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, delimiter="," if fmt == "csv" else "\t")
            writer.writerow(["id", field])
            writer.writerows(enumerate(texts))
    elif fmt == "txt":
        path.mkdir(exist_ok=True)
        for i, text in enumerate(texts):
            (path / f"{i:04d}.txt").write_text(text)
    return path


def make_tokenizer(directory: Path, texts, vocab_size: int = 600, bos: bool = True) -> Path:
    """A byte-level BPE tokenizer.json trained here, with <s> and </s>, and a tokenizer_config.json
    naming them, as a model directory on the hub would have."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(texts), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "</s>", "bos_token": "<s>" if bos else None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory

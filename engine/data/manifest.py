"""A prepared dataset's manifest.json: what the directory holds, written last. Torch-free.

    DIR/manifest.json         this file; a directory without it is not a dataset
    DIR/tokenizer.json        the tokenizer (absent for `bytes`)
    DIR/train-00000.npy ...   token shards: the split's documents' tokens in source order,
    DIR/val-00000.npy ...     each followed by end-of-text (and led by BOS where defined)
    DIR/train-docs.npy        document offsets into the split's token stream (uint64, docs + 1)
    DIR/train-mask-00000.npy  chat and prompt/completion data: which tokens are trained targets
                              (uint8, one per token, shard for shard beside the token shards)
    DIR/train-topk-ids.npy    an offline teacher's top-k predictions (`tpud prepare --teacher`):
    DIR/train-topk-logp.npy   [windows, window - 1, k] token ids (int32) and log-probabilities
                              (float32) of each window's every position, as training cuts them

A split's tokens are one stream cut into shards of a fixed number of tokens, so a document
may straddle two shards; shards are storage, documents and windows are positions in the
stream. `identity` hashes everything that decides the tokens (the tokenizer and every data
file's CRC32C): the same data prepared twice has the same identity, and a checkpoint
records it to notice a resume on different data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.files import Refused, read_regular_file

FORMAT = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Model):
    path: str  # relative to the dataset directory
    bytes: int
    crc32c: str  # base64, as GCS reports it
    tokens: int = 0  # a shard's token count; 0 for other files


class Split(_Model):
    documents: int
    tokens: int
    shards: list[FileEntry]
    index: FileEntry  # the document offsets
    masks: list[FileEntry] = []  # loss masks, aligned with the shards (chat data only)
    targets: int | None = Field(None, description="Tokens trained on (the masks' sum); None: every token.")


class Chat(_Model):
    """How conversations became windows (`tpud prepare --format chat|prompt-completion`)."""

    format: Literal["chat", "prompt-completion"]
    template_sha256: str
    template: str  # where the template came from
    train_on: Literal["assistant", "all", "last"]
    window: int = Field(description="Tokens per packed window: the job's data.seq_len + 1.")
    overlong: Literal["drop", "truncate"]
    conversations: int = Field(0, description="Conversations packed, over both splits.")
    dropped: int = Field(0, description="Conversations longer than a window, dropped (or left with no target).")
    truncated: int = 0
    padding_tokens: int = 0


class TeacherTopK(_Model):
    """An offline teacher's top-k log-probabilities beside the tokens (engine.distill.offline)."""

    identity: str = Field(description="The teacher's (engine.distill.teacher), with k and the temperature.")
    source: str
    top_k: int
    window: int = Field(description="Tokens per window: the job's data.seq_len + 1, as training cuts them.")
    temperature: float
    document_mask: bool = Field(description="Whether the teacher saw each document of a window alone.")
    splits: dict[str, list[FileEntry]] = Field(description="Per split: the ids file, then the log-probabilities'.")


class Tokenizer(_Model):
    kind: Literal["bytes", "huggingface"]
    file: FileEntry | None  # tokenizer.json, when kind is huggingface
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int | None


class SourceEntry(_Model):
    url: str
    bytes: int
    mtime: float
    documents: int
    skipped: int


class Skips(_Model):
    count: int = 0
    by_reason: dict[str, int] = {}
    examples: list[str] = Field([], description="The first few skipped records, FILE:LINE: reason.")


class Manifest(_Model):
    format: Literal[1] = FORMAT
    identity: str
    fingerprint: str = Field(description="Hash of the inputs (names, sizes, times) and options: a rerun with the "
                             "same fingerprint has nothing to do.")
    dtype: Literal["uint16", "uint32"]
    tokenizer: Tokenizer
    splits: dict[str, Split]
    sources: list[SourceEntry]
    skipped: Skips
    options: dict
    chat: Chat | None = None
    teacher: TeacherTopK | None = None

    @property
    def files(self) -> list[FileEntry]:
        """Every data file, the tokenizer's and an offline teacher's included: what a copy must carry."""
        entries = [entry for split in self.splits.values() for entry in (*split.shards, *split.masks, split.index)]
        if self.teacher:
            entries += [entry for files in self.teacher.splits.values() for entry in files]
        if self.tokenizer.file:
            entries.append(self.tokenizer.file)
        return entries

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)


def identity(tokenizer_sha256: str, files: list[FileEntry]) -> str:
    digest = hashlib.sha256(tokenizer_sha256.encode())
    for entry in sorted(files, key=lambda e: e.path):
        digest.update(f"\n{entry.path} {entry.bytes} {entry.crc32c}".encode())
    return digest.hexdigest()[:32]


class DatasetError(ValueError):
    """A path that is not a usable prepared dataset."""


MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists shards; millions of them would still fit
MAX_TOKENIZER_BYTES = 256 << 20  # published tokenizer.json files are up to a few tens of MB


def read(directory: str | Path) -> Manifest:
    """The manifest of a prepared dataset directory; DatasetError naming what is wrong."""
    path = Path(directory) / MANIFEST
    try:
        text = read_regular_file(path, limit=MAX_MANIFEST_BYTES).decode("utf-8")
    except FileNotFoundError:
        hint = " (an interrupted `tpud prepare`? run it again)" if Path(directory).is_dir() else ""
        raise DatasetError(f"{directory}: not a prepared dataset: no {MANIFEST}{hint}") from None
    except (OSError, UnicodeDecodeError, Refused) as e:  # a FIFO or a device is refused unopened
        raise DatasetError(f"{path}: unreadable: {e}") from None
    return parse(text, str(path))


def parse(text: str, where: str) -> Manifest:
    try:
        return Manifest.model_validate(json.loads(text))
    except (ValueError, RecursionError) as e:  # json and pydantic errors are ValueErrors
        first = str(e).splitlines()[:3]
        raise DatasetError(f"{where}: not a tpud dataset manifest (format {FORMAT}): {' '.join(first)}") from None


def check_vocab(manifests: list[tuple[str, Manifest]], vocab_size: int,
                model_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(key, message) for each way the datasets and the model disagree about tokens; model_dir is
    model.init_from's local directory, whose tokenizer.json (if any) the datasets must have used."""
    found = []
    model_tokenizer = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if model_tokenizer is not None and model_tokenizer.is_file():
        try:
            # As `tpud prepare` hashes it (engine/prepare/tokenizer.py): the file's text.
            text = read_regular_file(model_tokenizer, limit=MAX_TOKENIZER_BYTES).decode()
            sha = hashlib.sha256(text.replace("\r\n", "\n").encode()).hexdigest()
        except (OSError, ValueError, Refused) as e:
            found.append(("model.init_from", f"{model_tokenizer}: unreadable: {e}"))
        else:
            found += [(key, f"prepared with another tokenizer ({m.tokenizer.sha256[:12]}) than model.init_from's "
                       f"{model_tokenizer} ({sha[:12]}): its token ids would mean other tokens to the model; "
                       f"prepare it with --tokenizer {model_tokenizer.parent}")
                      for key, m in manifests if m.tokenizer.sha256 != sha]
    for key, manifest in manifests:
        if manifest.tokenizer.vocab_size > vocab_size:
            found.append(("model.vocab_size", f"{vocab_size} is smaller than the vocabulary of {key}'s tokenizer "
                          f"({manifest.tokenizer.vocab_size}); set model.vocab_size to at least that"))
    tokenizers = {m.tokenizer.sha256 for _, m in manifests}
    if len(tokenizers) > 1:
        found.append(("data.mixture", "its datasets were prepared with different tokenizers: "
                      + ", ".join(f"{key} ({m.tokenizer.sha256[:12]})" for key, m in manifests)))
    return found


def check_window(manifests: list[tuple[str, Manifest]], seq_len: int) -> list[tuple[str, str]]:
    """Chat data is packed into windows of its --seq-len + 1 tokens: a job must cut the same windows."""
    return [("data.seq_len", f"{seq_len}, but {key} packs its conversations into windows of {m.chat.window} "
             f"tokens: set data.seq_len to {m.chat.window - 1} (or prepare it again with --seq-len {seq_len})")
            for key, m in manifests if m.chat is not None and m.chat.window != seq_len + 1]


def check_teacher(manifests: list[tuple[str, Manifest]], seq_len: int, temperature: float,
                  document_mask: bool) -> list[tuple[str, str]]:
    """distill.teacher offline: every dataset must carry the same teacher's top-k, cut as this job cuts its windows."""
    found = []
    for key, m in manifests:
        t = m.teacher
        if t is None:
            found.append((key, "has no offline teacher (distill.teacher: offline): prepare it with --teacher DIR "
                          f"--top-k K --seq-len {seq_len}"))
        elif t.window != seq_len + 1:
            found.append(("data.seq_len", f"{seq_len}, but {key}'s teacher predicted windows of {t.window} tokens: "
                          f"set data.seq_len to {t.window - 1} (or prepare the teacher again with --seq-len {seq_len})"))
        elif t.temperature != temperature:
            found.append(("distill.temperature", f"{temperature}, but {key}'s teacher was stored at temperature "
                          f"{t.temperature}"))
        elif t.document_mask != document_mask:
            found.append(("data.document_mask", f"{document_mask}, but {key}'s teacher was run with document "
                          f"masking {'on' if t.document_mask else 'off'}: its predictions saw other contexts"))
    if len({m.teacher.identity for _, m in manifests if m.teacher}) > 1:
        found.append(("data.mixture", "its datasets carry different offline teachers"))
    return found


def local_problems(datasets: list[tuple[str, float]], mixture: bool, vocab_size: int,
                   model_dir: str | None = None, seq_len: int | None = None,
                   offline_teacher: tuple[float, bool] | None = None) -> list[tuple[str, str]]:
    """What `tpud validate` can tell without the network: local datasets exist and fit the model
    (and, given the job's seq_len, its windows; given (temperature, document_mask), their offline teacher)."""
    found, manifests = [], []
    for i, (path, _) in enumerate(datasets):
        key = f"data.mixture.{i}.dataset" if mixture else "data.dataset"
        if path.startswith("gs://"):
            continue  # checked by the worker when it fetches the dataset
        try:
            manifests.append((key, read(path)))
        except DatasetError as e:
            found.append((key, str(e)))
    local_model = model_dir if model_dir and not model_dir.startswith("gs://") else None
    windows = check_window(manifests, seq_len) if seq_len is not None else []
    if offline_teacher is not None and seq_len is not None:
        windows += check_teacher(manifests, seq_len, *offline_teacher)
    return found + check_vocab(manifests, vocab_size, local_model) + windows

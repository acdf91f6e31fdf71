"""The frozen teacher of a distillation run: its model, weights, identity and tokenizer check.

The teacher is an engine Transformer built from its source's model section (engine.distill.source),
frozen before it is placed, so the backend shards and places it as it does the student (FSDP2 or
SPMD) while nothing about it takes a gradient, an optimizer state or a place in a checkpoint.

Its identity is a digest of its weight files' names, sizes and CRC32C: a tpud checkpoint's manifest
lists them already; a Hugging Face directory's are computed once per start (files read at the
disk's speed). Every checkpoint of the student records it (`distill.teacher_identity` in the
manifest's fingerprint), and a resume with another teacher is refused unless the job allows it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch

from engine.checkpoint import manifest as mf
from engine.distill.source import TeacherError, TeacherSource, resolve
from engine.errors import ConfigError
from engine.hf.local import local_model
from engine.hf.weights import hf_values
from engine.models.llama import Transformer
from engine.spec.schema import DistillConfig, ModelConfig

log = structlog.get_logger()

KEY = "distill.teacher"
IDENTITY = "distill.teacher_identity"  # the fingerprint key a checkpoint records it under
GROUP_BYTES = 256 << 20  # checkpoint tensors read per DCP load
_WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json")


class Teacher:
    """The teacher's source, model section and identity, opened before any weight is read."""

    def __init__(self, cfg: DistillConfig, models_cache: Path, seq_len: int):
        try:
            self.source: TeacherSource = resolve(str(local_model(cfg.teacher, models_cache, KEY)))
        except (TeacherError, OSError) as e:
            raise ConfigError(KEY, str(e)) from None
        fields = dict(self.source.model)
        fields["max_seq_len"] = max(fields.get("max_seq_len", seq_len), seq_len)
        try:
            self.config = ModelConfig.model_validate(fields)
        except ValueError as e:
            raise ConfigError(KEY, f"{self.source.path}: not a model the engine can build: {e}") from None
        self.identity = self._identity()

    def build(self, attention, mask_fn) -> Transformer:
        """The teacher on the meta device, frozen and in eval mode, for the backend to shard and place."""
        with torch.device("meta"):
            model = Transformer(self.config, attention, None, mask_fn)
        return model.requires_grad_(False).eval()

    def values(self, model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, host tensor) pairs, one group at a time (backend.materialise's input)."""
        if self.source.kind == "hf":
            yield from hf_values(model, self.source.path, key=KEY)
        else:
            yield from _checkpoint_values(model, Path(self.source.path))
        log.info("teacher loaded", teacher=self.source.path, kind=self.source.kind, identity=self.identity,
                 params=sum(p.numel() for p in model.parameters()))

    def check_tokenizer(self, student: Path | None) -> None:
        """ConfigError when the student's tokenizer.json and the teacher's, both known, disagree on
        their vocabularies or special tokens."""
        if student is None or self.source.tokenizer is None:
            return
        if (problem := tokenizer_difference(student, self.source.tokenizer)) is not None:
            raise ConfigError(KEY, f"{self.source.tokenizer}: the teacher's tokenizer is not the student's "
                              f"({student}): {problem}; token ids would mean other tokens to the two models")

    def _identity(self) -> str:
        if self.source.manifest is not None:
            entries = [(f.path, f.size, f.crc32c) for f in self.source.manifest.files]
        else:
            root = Path(self.source.path)
            paths = sorted({p for pattern in _WEIGHT_FILES for p in root.glob(pattern) if p.is_file()})
            entries = [(p.name, p.stat().st_size, mf.file_crc32c(p)) for p in paths]
        return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()[:16]


def tokenizer_difference(a: Path, b: Path) -> str | None:
    """How two tokenizer.json files differ in what the models see (ids of tokens, special tokens);
    None when they agree. Formatting and normalisation details are not compared."""
    from tokenizers import Tokenizer

    try:
        left, right = Tokenizer.from_file(str(a)), Tokenizer.from_file(str(b))
    except Exception as e:  # tokenizers raises its own Exception for unreadable files
        return f"unreadable tokenizer: {e}"
    vocab_a, vocab_b = left.get_vocab(with_added_tokens=True), right.get_vocab(with_added_tokens=True)
    if vocab_a != vocab_b:
        differing = sorted(set(vocab_a.items()) ^ set(vocab_b.items()), key=lambda item: item[1])
        shown = ", ".join(f"{token!r}={index}" for token, index in differing[:3])
        return f"{len(vocab_a)} and {len(vocab_b)} tokens, {len(differing)} (token, id) pairs in one only ({shown})"
    special_a, special_b = (sorted((i, t.content) for i, t in tok.get_added_tokens_decoder().items() if t.special)
                            for tok in (left, right))
    if special_a != special_b:
        return f"special tokens {special_a[:5]} and {special_b[:5]}"
    return None


def _checkpoint_values(model: Transformer, step_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors from a committed tpud checkpoint, read on the host with DCP (whatever
    backend wrote them), checked against the manifest's checksums first."""
    import torch.distributed.checkpoint as dcp

    manifest = mf.read_manifest(step_dir)
    if manifest is None or (found := mf.problems(step_dir, manifest, checksums=True)):
        raise ConfigError(KEY, f"{step_dir}: damaged, not loaded: {'; '.join(found[:3]) if manifest else 'no manifest'}")
    reader = dcp.FileSystemReader(str(step_dir))
    saved = reader.read_metadata().state_dict_metadata
    params = dict(model.named_parameters())
    group, size = [], 0
    for name, param in params.items():
        meta = saved.get(f"model.{name}")
        if meta is None or not hasattr(meta, "size") or tuple(meta.size) != tuple(param.shape):
            raise ConfigError(KEY, f"{step_dir}: holds no tensor model.{name} of shape {list(param.shape)}")
        group.append((name, meta.properties.dtype))
        size += param.numel() * param.element_size()
        if size >= GROUP_BYTES:
            yield from _load_group(dcp, reader, group, params)
            group, size = [], 0
    if group:
        yield from _load_group(dcp, reader, group, params)


def _load_group(dcp, reader, group: list, params: dict) -> Iterator[tuple[str, torch.Tensor]]:
    state = {"model": {name: torch.empty(params[name].shape, dtype=dtype) for name, dtype in group}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # a host-side read, by design
        dcp.load(state, storage_reader=reader, no_dist=True)
    for name, _ in group:
        yield name, state["model"][name].to(params[name].dtype)

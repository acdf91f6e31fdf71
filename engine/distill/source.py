"""Where a distillation teacher comes from (`distill.teacher`), torch-free: the daemon validates
job files with it.

A teacher is either a Hugging Face model directory (local, gs:// or a hub id), whose config.json gives its
shape as `model.init_from`'s does, or a tpud checkpoint: a job's checkpoint directory (its newest
committed step) or one committed step directory. A checkpoint's manifest records the job spec it
was made with (engine.spec.fingerprint), so its model section is read from there, and the
tokenizer is the one of that job's first local dataset, when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.checkpoint import manifest as mf
from engine.hf import hub
from engine.hf.config import HfConfigError, model_fields

# Model keys that are how a model is trained, not what it computes.
_TRAINING_ONLY = {"init_from", "activation_checkpointing", "init_std"}


class TeacherError(ValueError):
    """The teacher cannot be used; the message names the file and why."""


@dataclass(frozen=True)
class TeacherSource:
    kind: Literal["hf", "checkpoint"]
    path: str                 # the model directory, or the committed step directory
    model: dict               # its ModelConfig fields
    tokenizer: Path | None    # a local tokenizer.json it was trained with, if known
    manifest: mf.Manifest | None = None  # a checkpoint's

    @property
    def vocab_size(self) -> int | None:
        return self.model.get("vocab_size")


def resolve(teacher: str) -> TeacherSource:
    """The teacher that `distill.teacher` names; TeacherError when it names none."""
    path = Path(teacher)
    if teacher.startswith("gs://") or (hub.parse(teacher) is not None and not path.is_absolute()):
        return _hf(teacher)  # a hub id: its config.json alone is read here (engine.hf.hub)
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise TeacherError(f"{teacher}: {what} (expected a Hugging Face model directory or a tpud checkpoint)")
    if (path / "config.json").exists():
        return _hf(teacher)
    return _checkpoint(path)


def _hf(directory: str) -> TeacherSource:
    try:
        fields = model_fields(directory)
    except HfConfigError as e:
        raise TeacherError(str(e)) from None
    tokenizer = Path(directory) / "tokenizer.json" if Path(directory).is_absolute() else None  # not gs://, a hub id
    return TeacherSource("hf", directory, fields, tokenizer if tokenizer and tokenizer.is_file() else None)


def _checkpoint(path: Path) -> TeacherSource:
    if (path / mf.MANIFEST).exists():
        manifest = mf.read_manifest(path)
        if manifest is None or not mf.is_global(path, manifest):
            raise TeacherError(f"{path}: not a committed checkpoint (its manifest.json is unreadable, or the "
                               "step was never committed by every host)")
        step_dir = path
    else:
        committed = mf.committed_steps(path)
        if not committed:
            raise TeacherError(f"{path}: holds neither config.json (a Hugging Face model directory) nor a "
                               "committed tpud checkpoint (step_N directories with a manifest.json)")
        _, step_dir, manifest = committed[-1]
    if manifest.micro_step:
        raise TeacherError(f"{step_dir}: a partial-step checkpoint (part of step {manifest.step + 1}); name a "
                           "step boundary's directory")
    if manifest.hosts > 1:
        raise TeacherError(f"{step_dir}: one host's part of a gang's checkpoint; a teacher is read whole from "
                           "one host's step directory only when its job ran on one host")
    fingerprint = manifest.fingerprint
    if not fingerprint:
        raise TeacherError(f"{step_dir}: its manifest records no job spec (written by an older tpud), so the "
                           "teacher's model is unknown; export it with `tpud export` and name that directory")
    model = {key.removeprefix("model."): value for key, value in fingerprint.items() if key.startswith("model.")}
    for key in _TRAINING_ONLY:
        model.pop(key, None)
    return TeacherSource("checkpoint", str(step_dir), model, _dataset_tokenizer(fingerprint), manifest)


def _dataset_tokenizer(fingerprint: dict) -> Path | None:
    """The tokenizer.json of the checkpointed job's first dataset, where that is a local directory."""
    dataset = fingerprint.get("data.dataset")
    if dataset is None and isinstance(mixture := fingerprint.get("data.mixture"), list) and mixture:
        dataset = mixture[0].get("dataset") if isinstance(mixture[0], dict) else None
    if not isinstance(dataset, str) or dataset.startswith("gs://"):
        return None
    tokenizer = Path(dataset) / "tokenizer.json"
    return tokenizer if tokenizer.is_file() else None

"""A committed checkpoint as a Hugging Face model directory, written a few tensors at a time.

The output is what `transformers` writes for the model's family (engine.hf.config.family:
LlamaForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM, each expert's
weights a tensor of their own, as save_pretrained writes them): config.json,
generation_config.json, the weights as safetensors (one model.safetensors, or shards of at
most `max_shard_bytes` with model.safetensors.index.json) and the tokenizer files the run had.

The checkpoint is read with torch.distributed.checkpoint on the CPU, whatever backend wrote
it: DCP joins the chunks an SPMD run saved per device. Its manifest's CRC32C is checked first.
Tensors are loaded in groups of about `GROUP_BYTES` and streamed into the shard being written;
the safetensors header is written first from the checkpoint's metadata (names, shapes and
dtypes are known before any data is read), because the safetensors library writes a file only
from a dict holding all of its tensors, which would hold up to 5 GB at once.

Everything goes to a staging directory beside the output, renamed into place at the end: an
interrupted export leaves no half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.distributed.checkpoint as dcp

from engine.checkpoint import manifest as mf
from engine.files import Refused, read_regular_file
from engine.hf.config import MAX_CONFIG_BYTES, config_json, family
from engine.hf.weights import INDEX, hf_expert_name, hf_name
from engine.layout import fsync_path
from engine.models.llama import Transformer
from engine.spec.schema import JobSpec

log = structlog.get_logger()

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32"}
_CONFIG_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
GROUP_BYTES = 256 << 20      # checkpoint tensors loaded per DCP read
# The files a Hugging Face tokenizer may consist of; copied when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja")


class ExportError(Exception):
    """The checkpoint or the output directory cannot be used; the message says why."""


@dataclass(frozen=True)
class Tensor:
    name: str        # the engine's parameter name (the checkpoint's key under "model.")
    hf_name: str
    shape: tuple[int, ...]
    saved_dtype: torch.dtype
    expert: int | None = None  # one expert's slice of the engine's [experts, ...] tensor
    saved_shape: tuple[int, ...] = ()  # the engine tensor's, when a slice

    def nbytes(self, dtype: torch.dtype) -> int:
        return dtype.itemsize * int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class TokenizerFiles:
    """Where the run's tokenizer files are, and its special ids."""

    files: list[Path]
    bos: int | None
    eos: int | None


def plan(spec: JobSpec, step_dir: Path) -> list[Tensor]:
    """The model's tensors, in Hugging Face order, as the checkpoint holds them."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    kind = family(spec.model)
    with torch.device("meta"):
        expected = dict(Transformer(spec.model, lambda *a: None).named_parameters())
    tensors = []
    for name, param in expected.items():
        saved = metadata.get(f"model.{name}")
        if saved is None or not hasattr(saved, "size"):
            raise ExportError(f"{step_dir}: holds no tensor model.{name}; was it written by another model section?")
        if tuple(saved.size) != tuple(param.shape):
            raise ExportError(f"{step_dir}: model.{name} has shape {list(saved.size)}, the job's model section "
                              f"gives {list(param.shape)}; was the job file changed since?")
        if name.split(".")[-1] in ("w1", "w2", "w3"):  # an expert tensor (a dense one ends in .weight)
            tensors += [Tensor(name, hf_expert_name(name, e, kind), tuple(saved.size)[1:], saved.properties.dtype, e,
                               tuple(saved.size)) for e in range(saved.size[0])]
        else:
            tensors.append(Tensor(name, hf_name(name, kind), tuple(saved.size), saved.properties.dtype))
    return tensors


def pack(tensors: list[Tensor], size: Callable[[Tensor], int], limit: int) -> list[list[Tensor]]:
    """Tensors packed in order into groups of at most `limit` bytes (a larger tensor is a group of its own)."""
    out: list[list[Tensor]] = [[]]
    total = 0
    for t in tensors:
        if out[-1] and total + size(t) > limit:
            out.append([])
            total = 0
        out[-1].append(t)
        total += size(t)
    return out


def _header(tensors: list[Tensor], dtype: torch.dtype) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        n = t.nbytes(dtype)
        entries[t.hf_name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data that follows starts 8-byte aligned, as the library writes it
    return struct.pack("<Q", len(header)) + header


def _write_shard(path: Path, tensors: list[Tensor], step_dir: Path, dtype: torch.dtype,
                 advance: Callable[[int], None]) -> None:
    reader = dcp.FileSystemReader(str(step_dir))
    with open(path, "wb") as f:
        f.write(_header(tensors, dtype))
        for group in pack(tensors, lambda t: t.nbytes(t.saved_dtype), GROUP_BYTES):
            # An expert tensor is read whole, once for the group its slices fall in.
            state = {"model": {t.name: torch.empty(t.saved_shape or t.shape, dtype=t.saved_dtype) for t in group}}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process, by design
                dcp.load(state, storage_reader=reader, no_dist=True)
            for t in group:
                saved = state["model"][t.name]
                data = (saved if t.expert is None else saved[t.expert]).to(dtype).contiguous()
                f.write(data.view(torch.uint8).numpy().data if data.numel() else b"")
                advance(t.nbytes(dtype))
        f.flush()
        os.fsync(f.fileno())


def tokenizer_of(spec: JobSpec, scratch: Path) -> TokenizerFiles | None:
    """The run's tokenizer: the init_from directory's files, else the first dataset's tokenizer.json
    (from gs://, only those files are downloaded, into `scratch`). Unreadable: a warning, and the
    model is exported without it."""
    init_from = spec.model.init_from
    source = init_from or (spec.data.datasets[0][0] if spec.data.datasets else None)
    try:
        if init_from and init_from.startswith("gs://"):
            from engine.hf import remote as hf_remote

            files = hf_remote.fetch_tokenizer(init_from, scratch)
            config = _json_object(hf_remote.read_config(init_from, MAX_CONFIG_BYTES))
            if files:
                return TokenizerFiles(files, config.get("bos_token_id"), config.get("eos_token_id"))
        elif init_from:
            from engine.hf import hub

            is_hub = hub.parse(init_from) is not None and not Path(init_from).is_absolute()
            directory = hub.snapshot(init_from) if is_hub else Path(init_from)
            files = [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]
            if files:
                config = _local_json(directory / "config.json")
                return TokenizerFiles(files, config.get("bos_token_id"), config.get("eos_token_id"))
        if not spec.data.datasets:
            return None
        from engine.data import manifest as data_manifest
        from engine.data import remote

        url = source = spec.data.datasets[0][0]
        found = remote.read_manifest(url) if url.startswith("gs://") else data_manifest.read(url)
        if found is None:
            return None
        bos, eos = found.tokenizer.bos_id, found.tokenizer.eos_id
        if found.tokenizer.file is None:  # the byte tokenizer: ids, no files
            return TokenizerFiles([], bos, eos)
        name = Path(found.tokenizer.file.path).name  # never a path out of the directory
        if url.startswith("gs://"):
            with remote.open_blob(f"{url.rstrip('/')}/{name}") as src, open(scratch / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
            return TokenizerFiles([scratch / name], bos, eos)
        return TokenizerFiles([Path(url) / name], bos, eos)
    except Exception as e:  # OSError, a refused special file, bad JSON, GCS unreachable: the message says which
        log.warning("the tokenizer cannot be read; no tokenizer files exported", source=source, error=str(e))
        return None


def _mb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def _local_json(path: Path) -> dict:
    """A JSON object file, or {} when it is absent, unreadable or special (bounded, never blocking)."""
    try:
        return _json_object(read_regular_file(path, MAX_CONFIG_BYTES))
    except (OSError, Refused):
        return {}


def _json_object(data: bytes) -> dict:
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tokenizer_config(tokenizer_json: Path, bos: int | None, eos: int | None) -> dict:
    """A tokenizer_config.json naming the special tokens, so AutoTokenizer loads the bare tokenizer.json."""
    vocab = {}
    try:
        from tokenizers import Tokenizer as HfTokenizer

        hf = HfTokenizer.from_file(str(tokenizer_json))
        vocab = {i: hf.id_to_token(i) for i in (bos, eos) if i is not None}
    except Exception:  # the file is copied as is; the config then names no special tokens
        pass
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key, i in (("bos_token", bos), ("eos_token", eos)):
        if vocab.get(i) is not None:
            config[key] = vocab[i]
    return config


def export(spec: JobSpec, step_dir: Path, out: Path, *, dtype: str = "bf16", max_shard_bytes: int = MAX_SHARD_BYTES,
           overwrite: bool = False,
           progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Write `step_dir` (a committed checkpoint of `spec`'s job) to `out`; the files written."""
    out = Path(out).resolve()
    if out == Path(step_dir).resolve() or out in Path(step_dir).resolve().parents:
        raise ExportError(f"{out}: holds the checkpoint being exported; choose another directory")
    manifest = mf.read_manifest(step_dir)
    if manifest is None:
        raise ExportError(f"{step_dir}: not a committed checkpoint (no valid manifest.json)")
    if found := mf.problems(step_dir, manifest, checksums=True):
        raise ExportError(f"{step_dir}: damaged, not exported: {'; '.join(found[:3])}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out}: not empty (pass --overwrite to replace it)")
    target = DTYPES[dtype]
    tensors = plan(spec, step_dir)
    total = sum(t.nbytes(target) for t in tensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total:
        raise ExportError(f"{out.parent}: {_mb(free)} free, the weights need {_mb(total)}")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # a model directory others may read, not mkdtemp's private 0700
    try:
        scratch = Path(tempfile.mkdtemp(dir=staging))
        tokenizer = tokenizer_of(spec, scratch)
        files = _write(spec, step_dir, staging, tensors, target, max_shard_bytes, tokenizer, progress or (lambda *_: None))
        shutil.rmtree(scratch)
        fsync_path(staging)
        if out.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(aside / out.name)
            staging.rename(out)
            shutil.rmtree(aside)
        else:
            staging.rename(out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("exported", step=manifest.step, out=str(out), dtype=dtype, tensors=len(tensors), bytes=total)
    return [out / name for name in files]


def _write(spec: JobSpec, step_dir: Path, staging: Path, tensors: list[Tensor], dtype: torch.dtype,
           max_shard_bytes: int, tokenizer: TokenizerFiles | None, progress: Callable[[int, int], None]) -> list[str]:
    total, done = sum(t.nbytes(dtype) for t in tensors), 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    groups = pack(tensors, lambda t: t.nbytes(dtype), max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1
             else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])
    for name, group in zip(names, groups):
        _write_shard(staging / name, group, step_dir, dtype, advance)
    if len(groups) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.hf_name: name for name, group in zip(names, groups) for t in group}}
        names.append(INDEX)
        (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    bos, eos = (tokenizer.bos, tokenizer.eos) if tokenizer else (None, None)
    (staging / "config.json").write_text(json.dumps(config_json(spec.model, _CONFIG_DTYPE[dtype], bos, eos),
                                                    indent=2) + "\n")
    generation = {"_from_model_config": True, **{k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos))
                                                 if v is not None}}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    names += ["config.json", "generation_config.json"]
    for path in tokenizer.files if tokenizer else ():
        shutil.copyfile(path, staging / path.name)
        names.append(path.name)
    if tokenizer and "tokenizer.json" in names and "tokenizer_config.json" not in names:
        config = _tokenizer_config(staging / "tokenizer.json", bos, eos)
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        names.append("tokenizer_config.json")
    for name in names:
        fsync_path(staging / name)
    return names

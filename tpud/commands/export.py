"""`tpud export`: a job's committed checkpoint as a Hugging Face model directory.

This side picks the checkpoint (the local tier, or the GCS tier downloaded beside the output)
and reports progress; engine/hf/export.py writes the model, and is imported only when the
command runs, so `tpud --help` stays free of torch.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

DESCRIPTION = (
    "Write a job's committed checkpoint as a Hugging Face Llama model directory: config.json "
    "(LlamaForCausalLM), generation_config.json, the weights as safetensors (sharded with an index "
    "above --max-shard-size) and the tokenizer files of the job's init_from directory or dataset. "
    "Checkpoints of every backend load on the CPU (an SPMD run's shards are joined), a few tensors at a "
    "time. The newest committed step unless --step; the local tier unless --tier gcs. The output appears "
    "complete or not at all. Exit 0 ok, 1 failed.")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def size(text: str) -> int:
    """'5GB', '200MiB', '1000000' -> bytes (transformers' max_shard_size spelling)."""
    match = _SIZE.match(text)
    if not match or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)")
    return int(float(match[1]) * _UNITS[(match[2] or "B").lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB.yaml", help="the job file whose checkpoint to export")
    parser.add_argument("out", metavar="OUT_DIR", type=Path, help="the model directory to write")
    parser.add_argument("--step", type=int, metavar="N", help="export step N (default: the newest committed)")
    parser.add_argument("--tier", choices=("local", "gcs"), default="local",
                        help="read from the local checkpoints (default) or from checkpoint.remote")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="weights' dtype in the output (default bf16, as models are published; "
                        "fp32 keeps the training weights exactly)")
    parser.add_argument("--max-shard-size", type=size, default="5GB", metavar="SIZE",
                        help="largest safetensors file (default 5GB, as transformers writes)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")


def _pick(steps: list, wanted: int | None, where: str):
    """The entry for step `wanted` (its whole-step checkpoint first), else the newest."""
    if not steps:
        raise LookupError(f"no committed checkpoint in {where}")
    if wanted is None:
        return steps[-1]
    matches = sorted((s for s in steps if s[0] == wanted), key=lambda s: s[1])
    if not matches:
        have = ", ".join(str(s[0]) for s in steps[-10:])
        raise LookupError(f"no committed checkpoint of step {wanted} in {where} (committed: {have})")
    return matches[0]


class _Progress:
    """A tqdm bar on a terminal; otherwise a line every 10 s."""

    def __init__(self) -> None:
        self.bar, self.last = None, time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="export", file=sys.stderr)
            self.bar.update(done - self.bar.n)
        elif time.monotonic() - self.last >= 10:
            self.last = time.monotonic()
            print(f"tpud export: {done / 1e9:.2f} of {total / 1e9:.2f} GB written", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    import logging

    import structlog

    from engine.spec.loader import SpecError, load_spec

    try:
        spec = load_spec(args.job)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 1
    # stdout is the summary line; the engine's warnings go to stderr. Restored afterwards: the
    # command may run inside another program (tests call main() in-process).
    saved = structlog.get_config()
    structlog.configure(processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        return _export(args, spec)
    finally:
        structlog.configure(**saved)


def _export(args: argparse.Namespace, spec) -> int:
    from engine.checkpoint.manifest import committed_steps
    from engine.hf.export import ExportError, export  # torch: only once the job file is known to be good
    from tpud.paths import Paths

    job_dir = Paths.resolve(args.home).layout.checkpoints(spec.name, spec.checkpoint.dir)
    download, progress = None, _Progress()
    try:
        if args.tier == "local":
            steps = [(step, m.micro_step, path) for step, path, m in committed_steps(job_dir)]
            _, _, step_dir = _pick(steps, args.step, str(job_dir))
        else:
            step_dir, download = _download(spec, args)
        files = export(spec, step_dir, args.out, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                       overwrite=args.overwrite, progress=progress)
    except (LookupError, OSError, ExportError) as e:
        print(f"tpud export: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tpud export: interrupted; {args.out} was left as it was", file=sys.stderr)
        return 130
    finally:
        progress.close()
        if download is not None:
            shutil.rmtree(download, ignore_errors=True)
    print(f"exported {step_dir.name} of {spec.name} to {args.out}: " + ", ".join(f.name for f in files))
    return 0


def _download(spec, args: argparse.Namespace) -> tuple[Path, Path]:
    """The chosen GCS step downloaded (and verified) into a temporary directory beside OUT_DIR."""
    from tpud.gcs.tier import GcsTier, RemoteError

    tier = GcsTier.for_spec(spec)
    if tier is None:
        raise LookupError(f"{args.job}: checkpoint.remote is not set; there is no GCS tier to export from")
    try:
        steps = [(s.step, s.micro_step, s) for s in tier.committed_steps() if s.complete]
        step, micro_step, _ = _pick(steps, args.step, tier.url)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.download-", dir=args.out.parent))
        try:
            return tier.download_step(step, scratch, micro_step), scratch
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    except RemoteError as e:
        raise LookupError(f"cannot read the GCS tier: {e}") from None

"""`tpud prepare INPUT... --tokenizer SPEC --out DIR|gs://...`: texts -> tokens -> a prepared dataset.

Also `python -m engine.prepare`. This module is the command: its arguments, turned into
Options (engine.prepare.options, validated there), and its exit codes; the work is
engine.prepare.pipeline's, imported only when it runs, so that building the `tpud` parser stays
cheap. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.prepare.options import Options, PrepareError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="files, directories or globs (quote them), local or gs://: .jsonl/.json (one object "
                        "per line), .parquet, .csv, .tsv (a header row), .txt (one document per file); each "
                        "optionally .gz or .zst")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC",
                        help="a tokenizer.json, a directory holding one (its tokenizer_config.json names BOS/EOS), "
                        "a Hugging Face Hub id org/name[@revision] (its tokenizer files, through huggingface_hub's "
                        "cache), train:VOCAB_SIZE (a byte-level BPE trained on the inputs, saved with the data), or "
                        "bytes")
    parser.add_argument("--out", required=True, metavar="DIR|gs://bucket/prefix",
                        help="the dataset directory (new or empty, or an earlier run's)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the JSON field or parquet/csv column holding the text (default: text)")
    chat = parser.add_argument_group(
        "chat and prompt/completion data (fine-tuning)",
        "Each .jsonl/.json line or parquet row is one conversation, rendered with the tokenizer's chat template; "
        "a loss mask beside the tokens says which are trained, and whole conversations are packed into windows of "
        "--seq-len + 1 tokens (none crosses a window).")
    chat.add_argument("--format", choices=("text", "chat", "prompt-completion"), default="text",
                      help="text (default): one document per record; chat: {\"messages\": [{\"role\", "
                      "\"content\"}, ...]} or ShareGPT {\"conversations\": [{\"from\", \"value\"}, ...]}; "
                      "prompt-completion: {\"prompt\", \"completion\"} (strings or message lists)")
    chat.add_argument("--chat-template", metavar="PATH",
                      help="a Jinja chat template file (default: the tokenizer's, from tokenizer_config.json or "
                      "chat_template.jinja beside tokenizer.json)")
    chat.add_argument("--train-on", choices=("assistant", "all", "last"), default="assistant",
                      help="which tokens are trained: every assistant turn with its end-of-turn token (default), "
                      "the last assistant turn only, or all tokens")
    chat.add_argument("--seq-len", type=int, metavar="N",
                      help="the data.seq_len of the jobs that train on it (required for chat data)")
    chat.add_argument("--overlong", choices=("drop", "truncate"), default="drop",
                      help="a conversation longer than a window: drop it (default) or keep its first window's "
                      "tokens; either way counted in the manifest")
    _teacher_arguments(parser)
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                     help="hold out this fraction of documents for validation, chosen by document (default 0)")
    val.add_argument("--val-docs", type=int, default=None, metavar="N",
                     help="hold out exactly N documents (reads the inputs once more to count them)")
    parser.add_argument("--seed", type=int, default=0, help="decides which documents are held out (default 0)")
    parser.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                        help="a bad record (malformed JSON, missing or non-string text, invalid UTF-8, an empty or "
                        "unreadable file): fail stops naming FILE:LINE (default); skip skips it and counts it in "
                        "the manifest")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="tokenizer processes (default: one per core)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 27, metavar="N",
                        help="tokens per shard file (default 2^27: 256 MiB of uint16)")
    parser.add_argument("--max-doc-bytes", type=_size, default=Options.max_doc_bytes, metavar="SIZE",
                        help="the longest document read, in bytes of UTF-8 (e.g. 64M, 1G; default 64M), which bounds "
                        "memory whatever the input: a longer jsonl/json line, csv/tsv field or parquet value is a bad "
                        "record (too long; see --on-error), and a longer .txt file is cut into documents of at most "
                        "this size at line breaks")
    parser.add_argument("--work-dir", metavar="DIR", help="where a gs:// output is staged (default: $TMPDIR)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a dataset prepared from other inputs or options")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                        help="log lines instead of a progress bar, even on a terminal")


def _teacher_arguments(parser: argparse.ArgumentParser) -> None:
    teacher = parser.add_argument_group(
        "an offline teacher (distillation without a teacher in memory: distill.teacher: offline)",
        "After the tokens, a teacher model reads the windows training will cut (--seq-len + 1 tokens) and its k "
        "likeliest next tokens at each position are stored beside them with their log-probabilities (k x 8 bytes "
        "a token); resumable, and needs torch. Local output only.")
    teacher.add_argument("--teacher", metavar="MODEL", help="a Hugging Face model directory, gs://, a hub id, or a "
                         "tpud checkpoint; its tokenizer must be the dataset's")
    teacher.add_argument("--top-k", type=int, default=32, metavar="K", help="predictions stored per token (default 32)")
    teacher.add_argument("--temperature", type=float, default=1.0, metavar="T",
                         help="the log-probabilities' temperature: the jobs' distill.temperature (default 1)")
    teacher.add_argument("--document-mask", action="store_true",
                         help="the teacher sees each document of a window alone: for jobs with data.document_mask")


def _size(text: str) -> int:
    """A byte count: 1048576, 1M, 1MiB, 512K, 2G."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in units else ""
    try:
        return int(float(number.removesuffix(unit)) * units[unit])
    except (ValueError, OverflowError):  # not a number, nan, inf
        raise argparse.ArgumentTypeError(f"{text!r}: a size in bytes, e.g. 67108864, 64M or 1G") from None


def options(args: argparse.Namespace) -> Options:
    return Options(inputs=tuple(args.inputs), tokenizer=args.tokenizer, out=args.out, text_field=args.text_field,
                   val_fraction=args.val_fraction, val_docs=args.val_docs, seed=args.seed,
                   shard_tokens=args.shard_tokens, max_doc_bytes=args.max_doc_bytes, on_error=args.on_error,
                   workers=max(0, args.workers),
                   work_dir=args.work_dir, overwrite=args.overwrite, progress=args.progress, format=args.format,
                   chat_template=args.chat_template, train_on=args.train_on,
                   # Text is windowed by the jobs; --seq-len with text data is the offline teacher's.
                   seq_len=args.seq_len if args.format != "text" or args.teacher is None else None,
                   overlong=args.overlong)


def run(args: argparse.Namespace) -> int:
    """The command's handler: 0 when the dataset is ready, 1 on bad input (the message on stderr).

    Stdout gets one JSON line describing the dataset; the log goes to stderr."""
    from google.api_core.exceptions import GoogleAPIError

    from engine import logs
    from engine.data.manifest import DatasetError
    from engine.prepare.pipeline import prepare

    from engine.hf import hub

    logs.configure(stream=sys.stderr)
    try:
        if args.teacher is not None:
            _check_teacher_arguments(args)
        if hub.is_hub_id(args.tokenizer, Path.cwd()):
            args.tokenizer = str(hub.tokenizer(args.tokenizer))
        manifest = prepare(options(args))
    except (PrepareError, DatasetError, OSError, GoogleAPIError, hub.HubError) as e:  # bad input, a full disk, a bucket
        print(f"tpud prepare: {e}", file=sys.stderr)
        return 1
    if args.teacher is not None:
        try:
            manifest = _annotate(args)
        except (ValueError, OSError) as e:  # OfflineError and ConfigError are ValueErrors; a full disk
            print(f"tpud prepare: --teacher {args.teacher}: {e}", file=sys.stderr)
            return 1
    summary = {name: {"documents": s.documents, "tokens": s.tokens,
                      **({"targets": s.targets} if s.targets is not None else {})}
               for name, s in manifest.splits.items()}
    print(json.dumps({"out": args.out, "identity": manifest.identity, "vocab_size": manifest.tokenizer.vocab_size,
                      "splits": summary, "skipped": manifest.skipped.count,
                      **({"chat": manifest.chat.model_dump(include={"conversations", "dropped", "truncated",
                                                                    "padding_tokens"})} if manifest.chat else {}),
                      **({"teacher": manifest.teacher.model_dump(include={"identity", "top_k", "window"})}
                         if manifest.teacher else {})}))
    return 0


def _check_teacher_arguments(args: argparse.Namespace) -> None:
    if args.seq_len is None:
        raise PrepareError("--teacher reads the windows the jobs train on: give --seq-len, their data.seq_len")
    if args.out.startswith("gs://"):
        raise PrepareError("--teacher writes beside a local dataset: prepare it to a directory, then copy it")
    if args.top_k < 1 or not args.temperature > 0:
        raise PrepareError(f"--top-k {args.top_k} --temperature {args.temperature}: both must be above 0")


def _annotate(args: argparse.Namespace):
    """The teacher's pass (engine.distill.offline); the dataset's manifest with its teacher section."""
    import tempfile

    from engine.data import manifest as mf
    from engine.distill.offline import annotate

    def progress(split: str, done: int, total: int) -> None:
        if done == total or done % max(1, total // 20) < 8:  # about every 5 %
            print(f"tpud prepare: teacher: {split} {done}/{total} windows", file=sys.stderr)

    annotate(Path(args.out), args.teacher, args.top_k, args.seq_len, temperature=args.temperature,
             document_mask=args.document_mask, models_cache=Path(args.work_dir or tempfile.gettempdir()) / "tpud-models",
             device="cuda" if _cuda() else "cpu", progress=progress)
    return mf.read(args.out)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


DESCRIPTION = (
    "Prepare a dataset once, off the accelerator hosts: read texts, tokenize them on every core, and write "
    "token shards, a document index, the tokenizer and manifest.json (last) to DIR or gs://. Jobs train on it "
    "with data.dataset: DIR. Running it again with the same inputs and options does nothing; after an "
    "interruption it starts over cleanly.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.prepare", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""What a `tpud prepare` run is asked to do, validated once: the command (engine.prepare.command)
builds it from its arguments and the work (engine.prepare.pipeline) reads it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


class PrepareError(Exception):
    """Bad input or options; the message names the file and line, or the option."""


@dataclass(frozen=True)
class Options:
    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    text_field: str = "text"
    val_fraction: float = 0.0
    val_docs: int | None = None
    seed: int = 0
    shard_tokens: int = 1 << 27
    max_doc_bytes: int = 64 << 20  # far past any real document, far below a host's memory
    on_error: str = "fail"  # or "skip"
    workers: int = 0  # 0: every core
    work_dir: str | None = None  # where a gs:// output is staged
    overwrite: bool = False
    progress: bool | None = None  # None: a bar on a terminal, log lines otherwise
    format: str = "text"  # or "chat", "prompt-completion"
    # Chat and prompt/completion data only:
    chat_template: str | None = None  # a Jinja file; default: the tokenizer's own template
    train_on: str = "assistant"  # or "all", "last"
    seq_len: int | None = None  # the job's data.seq_len: conversations are packed into seq_len + 1 tokens
    overlong: str = "drop"  # or "truncate": a conversation longer than a window

    @property
    def chat(self) -> bool:
        return self.format != "text"

    def __post_init__(self) -> None:
        if self.format not in ("text", "chat", "prompt-completion"):
            raise PrepareError(f"--format {self.format}: text, chat or prompt-completion")
        if self.chat and self.seq_len is None:
            raise PrepareError(f"--format {self.format} packs whole conversations into windows: give --seq-len, "
                               f"the data.seq_len of the jobs that will train on it")
        if not self.chat and (self.seq_len is not None or self.chat_template is not None):
            raise PrepareError("--seq-len and --chat-template are for --format chat or prompt-completion")
        if self.seq_len is not None and not 1 <= self.seq_len <= 1 << 24:
            raise PrepareError(f"--seq-len {self.seq_len}: must be from 1 to {1 << 24}")
        if self.train_on not in ("assistant", "all", "last"):
            raise PrepareError(f"--train-on {self.train_on}: assistant, all or last")
        if self.overlong not in ("drop", "truncate"):
            raise PrepareError(f"--overlong {self.overlong}: drop or truncate")
        if not 0 <= self.val_fraction < 1:
            raise PrepareError(f"--val-fraction {self.val_fraction}: must be in [0, 1)")
        if self.val_docs is not None and self.val_docs < 1:
            raise PrepareError(f"--val-docs {self.val_docs}: must be positive")
        if self.val_docs is not None and self.val_fraction:
            raise PrepareError("--val-fraction and --val-docs: give one of them")
        if self.shard_tokens < 1:
            raise PrepareError(f"--shard-tokens {self.shard_tokens}: must be positive")
        if not 1 <= self.max_doc_bytes <= 1 << 40:  # the csv module's limit is a C long
            raise PrepareError(f"--max-doc-bytes {self.max_doc_bytes}: must be from 1 byte to 1T")
        if self.on_error not in ("fail", "skip"):
            raise PrepareError(f"--on-error {self.on_error}: fail or skip")

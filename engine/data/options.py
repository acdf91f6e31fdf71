"""What a `tpud prepare` run is asked to do, validated once: the command (engine.data.prepare)
builds it from its arguments and the work (engine.data.pipeline) reads it. Torch-free.
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

    def __post_init__(self) -> None:
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

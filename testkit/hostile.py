"""A corpus of hostile job files: what a careless or malicious operator might drop into jobs.d/.

Each is small on disk (but the 50 MB one) and would, read naively, block a reader, exhaust
memory or recurse without end. `write_corpus(directory)` creates them all and returns
{file name: a phrase its error must contain}.
"""

from __future__ import annotations

import os
import random
from pathlib import Path


def _alias_chain(levels: int, width: int, flow: str) -> str:
    """The classic 'billion laughs': each anchor is `width` aliases of the previous one."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * width)
        body = f"[{refs}]" if flow == "list" else "{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(width)) + "}"
        lines.append(f"a{i}: &a{i} {body}")
    return "\n".join(lines) + "\n"


def _merge_chain(levels: int) -> str:
    """Merge keys doubling at every level: PyYAML's own flattening would build 2**levels pairs."""
    lines = ["m0: &m0 {x: 1, y: 2}"]
    lines += [f"m{i}: &m{i} {{<<: [*m{i - 1}], k{i}: [*m{i - 1}, *m{i - 1}]}}" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


TOO_MANY = "more than 20,000 values"
TOO_DEEP = "nested more than 64 levels deep"


def write_corpus(directory: Path) -> dict[str, str]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    expect: dict[str, str] = {}

    def text(name: str, content: str | bytes, phrase: str) -> None:
        (directory / name).write_bytes(content.encode() if isinstance(content, str) else content)
        expect[name] = phrase

    text("bomb-lists.yaml", _alias_chain(10, 9, "list"), TOO_MANY)
    text("bomb-maps.yaml", _alias_chain(10, 9, "map"), TOO_MANY)
    text("bomb-merge.yaml", _merge_chain(40), TOO_MANY)
    text("bomb-in-a-section.yaml", _alias_chain(10, 9, "list") + "train: {batch_ramp: *a9}\n", TOO_MANY)
    text("bomb-recursive.yaml", "a: &a [*a, *a]\n", TOO_DEEP)
    text("deep-lists.yaml", "a: " + "[" * 10_000 + "]" * 10_000 + "\n", TOO_DEEP)
    text("deep-maps.yaml", "a: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n", TOO_DEEP)
    with open(directory / "huge.yaml", "wb") as f:  # 50 MB, sparse where the file system allows
        f.write(b"name: huge\n# ")
        f.truncate(50 << 20)
    expect["huge.yaml"] = "too large"
    rng = random.Random(0)
    text("binary.yaml", bytes(rng.randrange(256) for _ in range(64 << 10)), "not a YAML text file")
    text("latin1.yaml", "name: caf\xe9\n".encode("latin-1"), "not a YAML text file")
    text("huge-number.yaml", "train:\n  max_steps: " + "9" * 100_000 + "\n", "cannot read the value")
    os.mkfifo(directory / "fifo.yaml")
    expect["fifo.yaml"] = "a FIFO, not a regular file"
    os.symlink("/dev/zero", directory / "zero.yaml")
    expect["zero.yaml"] = "a symlink to /dev/zero, a character device"
    (directory / "dir.yaml").mkdir()
    expect["dir.yaml"] = "a directory, not a regular file"
    return expect

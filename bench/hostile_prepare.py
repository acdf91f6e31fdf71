"""Hostile inputs to `tpud prepare`: is its memory bounded whatever the input?

Each case runs `tpud prepare` as a real command (default `--max-doc-bytes`, `--on-error skip`,
one worker per core) while the whole process tree's RSS (the main process and its tokenizer
workers, summed) is sampled every 20 ms:
1. baseline: 10 MB of ordinary jsonl (the tool's own footprint);
2. bomb: a .jsonl.gz of a few MB whose first line decompresses to --bomb-gb GB of one
   document (before the bound: a worker grew to 24 GB and the OOM killer took it);
3. ordinary: --ordinary-gb GB of ordinary jsonl;
4. long document: one 48 MiB document, under the default limit, through a byte-level BPE (a
   Hugging Face encoding costs ~300 bytes a token, so a document must be encoded in pieces).
Target: every case's peak below 2 GB; the ratio to the baseline is reported.

    .venv/bin/python bench/hostile_prepare.py
Results: a table on stdout and bench/results/hostile_prepare.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from machine import describe
from supervised import ENV, REPO

sys.path.insert(0, str(REPO))
from testkit import corpus  # noqa: E402

TARGET_PEAK_MB = 2048.0
CHUNK = 64 << 20


def tree_rss_mb(root: int) -> float:
    """RSS of `root` and all its descendants, summed."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        todo.extend(map(int, children))
    return total / 1024


def measure(args: list[str]) -> dict:
    """Run `tpud prepare ARGS`, sampling its tree's RSS: peak MB, seconds, exit status, last stderr line."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tpud", "prepare", *args, "--on-error", "skip", "--no-progress"],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()
    while proc.poll() is None:
        peak = max(peak, tree_rss_mb(proc.pid))
        time.sleep(0.02)
    reader.join()
    return {"peak_mb": peak, "seconds": time.monotonic() - started, "exit": proc.returncode,
            "last_line": stderr[-1].strip() if stderr else ""}


def write_bomb(path: Path, size: int) -> None:
    """One gzip member: a `size`-byte document in one line, then a fine one."""
    pack = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"a" * CHUNK
    with path.open("wb") as f:
        f.write(pack.compress(b'{"text": "'))
        for _ in range(size // CHUNK):
            f.write(pack.compress(block))
        f.write(pack.compress(b'"}\n{"text": "a fine document after the bomb"}\n'))
        f.write(pack.flush())


def write_ordinary(path: Path, size: int) -> None:
    lines = "".join(json.dumps({"text": t}) + "\n" for t in corpus.docstrings()).encode()
    with path.open("wb") as f:
        for _ in range(max(1, size // len(lines))):
            f.write(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bomb-gb", type=float, default=1.5)
    parser.add_argument("--ordinary-gb", type=float, default=1.0)
    parser.add_argument("--work", type=Path, help="where inputs and outputs go (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "hostile_prepare.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hostile-prepare-", dir=args.work))
    try:
        write_ordinary(work / "small.jsonl", 10 << 20)
        write_bomb(work / "bomb.jsonl.gz", int(args.bomb_gb * (1 << 30)))
        write_ordinary(work / "ordinary.jsonl", int(args.ordinary_gb * (1 << 30)))
        long_doc = "".join(corpus.docstrings())
        long_doc = long_doc * (48 * (1 << 20) // len(long_doc.encode()))  # its JSON line under the 64 MiB default
        (work / "long.jsonl").write_text(json.dumps({"text": long_doc}, ensure_ascii=False) + "\n")
        tokenizer = corpus.make_tokenizer(work / "tok", corpus.docstrings(200))
        inputs = {name: (work / name).stat().st_size for name in
                  ("small.jsonl", "bomb.jsonl.gz", "ordinary.jsonl", "long.jsonl")}

        cases = {
            "baseline: 10 MB jsonl": ["small.jsonl", "bytes"],
            f"bomb: {args.bomb_gb:g} GB line in .gz": ["bomb.jsonl.gz", "bytes"],
            f"ordinary: {args.ordinary_gb:g} GB jsonl": ["ordinary.jsonl", "bytes"],
            "long document: 48 MiB, BPE": ["long.jsonl", str(tokenizer)],
        }
        results = {}
        for i, (case, (source, tok)) in enumerate(cases.items()):
            results[case] = measure([str(work / source), "--tokenizer", tok, "--out", str(work / f"out{i}")])
            shutil.rmtree(work / f"out{i}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = results["baseline: 10 MB jsonl"]["peak_mb"]
    for r in results.values():
        r["ratio"] = r["peak_mb"] / base
    passed = all(r["exit"] == 0 and r["peak_mb"] < TARGET_PEAK_MB for r in results.values())
    print(f"{'tpud prepare on':<32} {'peak RSS MB':>12} {'x baseline':>11} {'seconds':>8} {'exit':>5}")
    for case, r in results.items():
        print(f"{case:<32} {r['peak_mb']:>12.0f} {r['ratio']:>11.2f} {r['seconds']:>8.1f} {r['exit']:>5}")
    print(f"\nRSS of the whole process tree (main + {os.cpu_count()} tokenizer workers), sampled every 20 ms; "
          f"target: every peak < {TARGET_PEAK_MB:.0f} MB: {'met' if passed else 'MISSED'}")
    for case, r in results.items():
        print(f"{case}: {r['last_line'][:200]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "hostile_prepare", "target_peak_mb": TARGET_PEAK_MB,
                                    "inputs_bytes": inputs, "results": results, "passed": passed,
                                    "machine": describe()}, indent=2))


if __name__ == "__main__":
    main()

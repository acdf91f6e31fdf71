"""The data pipeline: `tpud prepare` throughput, and the loader's start-up, memory and data wait.

Prepare, on a jsonl corpus of --mb MB (the local Python installation's source files, each
file a document, repeated with a distinct first line until the size is reached) and a
byte-level BPE tokenizer.json of 8192 tokens trained on it, all three with --workers
processes, measured in this run on this machine:

- tpud:     engine.prepare.pipeline.prepare, end to end: reading and parsing the jsonl,
            tokenizing in worker processes, writing shards, the index and the manifest.
- limit:    the same tokenizer's own batch encode (`encode_batch_fast`, as tpud calls it)
            over the same texts in the same number of processes, each holding its share in
            memory before the clock starts: no reading, no parsing, no writing.
- datasets: what users do today: Hugging Face `datasets` `load_dataset("json")`, then
            `map(tokenize, batched=True, num_proc=N)`, then the ids flattened into one numpy
            array and saved (a fresh cache directory, so nothing is reused).

Targets: tpud >= 0.8x the limit's MB/s, and faster than datasets.

Loader, each number from a fresh process (median of --repeats):
- time to the first batch (opening the dataset, building the loader, reading one batch) when
  resuming at step 0 and at step 10^9: equal within noise;
- the process's RSS with the loader open on a 1 GB and a 50 GB dataset (sparse shards with
  valid headers and a manifest): they differ by less than 50 MB;
- data wait as a share of step time for the 125m preset training on CPU from the prepared
  corpus (the trainer's own `data` badput over the steps' time): below 1%.

    .venv/bin/pip install -e '.[bench]'      # Hugging Face datasets, for the comparison
    .venv/bin/python bench/data.py           # ~6 min on 2 cores
    .venv/bin/python bench/data.py --mb 20 --skip-datasets --train-steps 3   # quick look

Results: a table on stdout and bench/results/data.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.machine import describe  # noqa: E402
from engine.data import manifest as mf  # noqa: E402
from engine.data import tokenizer as tk  # noqa: E402
from engine.data.shards import npy_header  # noqa: E402

VOCAB = 8192


# --- the corpus and tokenizer ---

def make_corpus(directory: Path, megabytes: int, files: int = 8) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for path in sorted(root.rglob("*.py")):
        try:
            sources.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    target, written, copy = megabytes * 1_000_000, 0, 0
    paths = [directory / f"part-{i:02d}.jsonl" for i in range(files)]
    handles = [open(p, "w") for p in paths]
    while written < target:
        for i, text in enumerate(sources):
            line = json.dumps({"text": f"# copy {copy} of document {i}\n{text}"}) + "\n"
            handles[(copy * len(sources) + i) % files].write(line)
            written += len(line)
            if written >= target:
                break
        copy += 1
    for h in handles:
        h.close()
    return paths


def texts_of(paths: list[Path]) -> list[str]:
    return [json.loads(line)["text"] for p in paths for line in open(p)]


def make_tokenizer(directory: Path, paths: list[Path]) -> Path:
    sample = texts_of(paths[:1])[:3000]
    tokenizer = tk.train(sample, VOCAB)
    (directory / "tokenizer.json").write_text(tokenizer.json)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": tk.TRAINED_EOS}))
    return directory


# --- prepare: tpud, the limit, datasets ---

def run_tpud(paths: list[Path], tokenizer: Path, out: Path, workers: int) -> dict:
    from engine.prepare.pipeline import prepare
    from engine.prepare.options import Options

    started = time.perf_counter()
    manifest = prepare(Options(inputs=tuple(map(str, paths)), tokenizer=str(tokenizer), out=str(out),
                               workers=workers, progress=False))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": manifest.splits["train"].tokens}


_limit_tokenizer = None


def _limit_worker(args: tuple[str, list[Path], int, int]) -> tuple[float, int]:
    """One process's share: loaded before the clock starts, then encoded in 1 MB chunks."""
    tokenizer_json, paths, index, count = args
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    texts = texts_of(paths)[index::count]
    chunks, chunk, size = [], [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= 1 << 20:
            chunks.append(chunk)
            chunk, size = [], 0
    chunks.append(chunk)
    started = time.perf_counter()
    tokens = sum(len(e.ids) for c in chunks for e in tok.encode_batch_fast(c, add_special_tokens=False))
    return time.perf_counter() - started, tokens


def run_limit(paths: list[Path], tokenizer: Path, workers: int) -> dict:
    text = (tokenizer / "tokenizer.json").read_text()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_limit_worker, [(text, paths, i, workers) for i in range(workers)])
    return {"seconds": max(s for s, _ in results), "tokens": sum(t for _, t in results)}


_hf_tokenizer = None


def _hf_tokenize(batch: dict) -> dict:
    global _hf_tokenizer
    if _hf_tokenizer is None:
        from tokenizers import Tokenizer

        _hf_tokenizer = Tokenizer.from_file(os.environ["BENCH_TOKENIZER"])
    return {"ids": [e.ids for e in _hf_tokenizer.encode_batch(batch["text"])]}


def run_datasets(paths: list[Path], tokenizer: Path, out: Path, workers: int) -> dict:
    import datasets
    import pyarrow.compute as pc

    os.environ["BENCH_TOKENIZER"] = str(tokenizer / "tokenizer.json")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    datasets.disable_progress_bars()
    started = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train",
                               cache_dir=str(out / "cache"))
    ds = ds.map(_hf_tokenize, batched=True, num_proc=workers, remove_columns=["text"])
    ids = pc.list_flatten(ds.data.table.column("ids")).to_numpy().astype(np.uint16)
    np.save(out / "ids.npy", ids)
    return {"seconds": time.perf_counter() - started, "tokens": len(ids)}


# --- the loader ---

def fake_dataset(directory: Path, gigabytes: float) -> Path:
    """A dataset of sparse uint16 shards (valid headers, zeros inside) and its manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    shard_tokens, total = 1 << 28, int(gigabytes * 1e9) // 2
    shards, left, i = [], total, 0
    while left > 0:
        n = min(shard_tokens, left)
        path = directory / f"train-{i:05d}.npy"
        with open(path, "wb") as f:
            f.write(npy_header(np.dtype(np.uint16), n))
            f.truncate(len(npy_header(np.dtype(np.uint16), n)) + 2 * n)
        shards.append(mf.FileEntry(path=path.name, bytes=path.stat().st_size, crc32c="sparse", tokens=n))
        left, i = left - n, i + 1
    index = directory / "train-docs.npy"
    np.save(index, np.array([0, total], dtype=np.uint64))
    split = mf.Split(documents=1, tokens=total, shards=shards,
                     index=mf.FileEntry(path=index.name, bytes=index.stat().st_size, crc32c="x", tokens=2))
    manifest = mf.Manifest(identity=f"fake-{gigabytes}", fingerprint="fake", dtype="uint16",
                           tokenizer=mf.Tokenizer(kind="bytes", file=None, sha256="bytes", vocab_size=257, eos_id=256,
                                                  bos_id=None),
                           splits={"train": split}, sources=[], skipped=mf.Skips(), options={})
    (directory / mf.MANIFEST).write_text(manifest.to_json())
    return directory


def loader_probe(dataset: str, step: int) -> dict:
    """In a fresh process: time to the first batch at `step`, and the RSS with the loader open."""
    from engine.data.dataset import open_data
    from engine.data.loader import PackedLoader
    from engine.spec.schema import DataConfig

    started = time.perf_counter()
    data = open_data(DataConfig(dataset=dataset, seq_len=2048, micro_batch_size=8), seed=0,
                     cache_root=Path(tempfile.gettempdir()), vocab_size=32768)
    loader = PackedLoader(data.train, 8, 1, seed=0, identity=data.identity)
    batch = loader.batch(step, 0)
    seconds = time.perf_counter() - started
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"first_batch_s": seconds, "rss_mb": int(status["VmRSS"].split()[0]) / 1024, "shape": list(batch.inputs.shape),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def probe(dataset: Path, step: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, __file__, "--probe", str(dataset), "--probe-step", str(step)],
                             capture_output=True, text=True, check=True, cwd=REPO)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
            "rss_mb": statistics.median(r["rss_mb"] for r in runs), "runs": runs}


def data_wait(dataset: Path, steps: int) -> dict:
    """The 125m preset training on the prepared corpus on CPU: the data badput over the steps' time."""
    import torch
    import yaml

    from engine import events
    from engine.spec.loader import load_spec
    from engine.train import Trainer
    from testkit.recorders import Recorder

    torch.set_num_threads(os.cpu_count() or 1)
    model = yaml.safe_load((REPO / "configs" / "models" / "125m.yaml").read_text())["model"]
    spec = load_spec(REPO / "configs" / "jobs" / "tiny-cpu.yaml", [
        f"model={json.dumps(model)}", f"data.dataset={dataset}", "data.seq_len=256", "data.micro_batch_size=8",
        f"train.max_steps={steps + 1}", "train.log_interval=1", "scheduler.warmup_steps=1",
        "checkpoint.interval_steps=0", "logging.level=warning"])
    with tempfile.TemporaryDirectory() as home:
        hooks = Recorder()
        Trainer(spec, Path(home), hooks).run()
    reports = hooks.of(events.Step)[1:]  # the first step compiles and warms up
    step_seconds = sum(e.step_time_s for e in reports)
    data_seconds = reports[-1].badput.data - hooks.of(events.Step)[0].badput.data
    return {"steps": len(reports), "step_s": step_seconds / len(reports), "data_s": data_seconds / len(reports),
            "share": data_seconds / step_seconds}


# --- the report ---

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="corpus size in MB (default 200)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--skip-datasets", action="store_true", help="leave out the Hugging Face datasets baseline")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the corpus goes (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "data.json")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--probe-step", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(loader_probe(args.probe, args.probe_step)))
        return
    from engine import logs

    logs.configure("warning")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        print(f"corpus: {args.mb} MB of jsonl ...", flush=True)
        paths = make_corpus(work, args.mb)
        text_mb = sum(p.stat().st_size for p in paths) / 1e6
        tokenizer = make_tokenizer(work, paths)
        results = {}
        print("prepare: tpud ...", flush=True)
        results["tpud"] = run_tpud(paths, tokenizer, work / "tpud", args.workers)
        print("prepare: the limit (encode_batch_fast, no I/O) ...", flush=True)
        results["limit"] = run_limit(paths, tokenizer, args.workers)
        if not args.skip_datasets:
            print("prepare: Hugging Face datasets ...", flush=True)
            (work / "hf").mkdir()
            results["datasets"] = run_datasets(paths, tokenizer, work / "hf", args.workers)
        for r in results.values():
            r["mb_per_s"] = text_mb / r["seconds"]
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
        print("loader: first batch at step 0 and 10^9, RSS at 1 GB and 50 GB ...", flush=True)
        small, large = fake_dataset(work / "fake-1g", 1), fake_dataset(work / "fake-50g", 50)
        loader = {"step_0": probe(work / "tpud", 0, args.repeats), "step_1e9": probe(work / "tpud", 10**9, args.repeats),
                  "rss_1gb": probe(small, 0, args.repeats), "rss_50gb": probe(large, 0, args.repeats)}
        print("loader: data wait of the 125m preset on CPU ...", flush=True)
        wait = data_wait(work / "tpud", args.train_steps)

    ratios = {"tpud_vs_limit": results["tpud"]["mb_per_s"] / results["limit"]["mb_per_s"]}
    if "datasets" in results:
        ratios["tpud_vs_datasets"] = results["tpud"]["mb_per_s"] / results["datasets"]["mb_per_s"]
    checks = {
        "prepare >= 0.8x limit": ratios["tpud_vs_limit"] >= 0.8,
        "prepare faster than datasets": ratios.get("tpud_vs_datasets", 0) > 1 if "datasets" in results else None,
        "first batch at 1e9 ~ at 0": abs(loader["step_1e9"]["first_batch_s"] - loader["step_0"]["first_batch_s"])
        < max(0.05, 0.25 * loader["step_0"]["first_batch_s"]),
        "RSS 50 GB - 1 GB < 50 MB": loader["rss_50gb"]["rss_mb"] - loader["rss_1gb"]["rss_mb"] < 50,
        "data wait < 1% of step": wait["share"] < 0.01,
    }
    report = {"machine": describe(workers=args.workers), "corpus_mb": text_mb, "prepare": results, "ratios": ratios,
              "loader": loader, "data_wait_125m_cpu": wait, "checks": checks}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")

    print(f"\nprepare, {text_mb:.0f} MB of jsonl, {args.workers} processes")
    print(f"{'':<34}{'seconds':>9}{'MB/s':>8}{'Mtok/s':>8}{'vs tpud':>9}")
    for name, r in results.items():
        print(f"{name:<34}{r['seconds']:>9.1f}{r['mb_per_s']:>8.2f}{r['tokens_per_s'] / 1e6:>8.2f}"
              f"{results['tpud']['mb_per_s'] / r['mb_per_s']:>8.2f}x")
    print("\nloader (median of fresh processes)")
    for name, r in loader.items():
        print(f"{name:<34}first batch {r['first_batch_s'] * 1000:>7.1f} ms   RSS {r['rss_mb']:>7.1f} MB")
    print(f"\n125m on CPU: step {wait['step_s']:.2f} s, data {wait['data_s'] * 1000:.2f} ms "
          f"= {wait['share']:.3%} of the step")
    print("\nchecks:", ", ".join(f"{k}: {'ok' if v else ('n/a' if v is None else 'MISSED')}" for k, v in checks.items()))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()

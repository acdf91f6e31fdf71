"""Checkpoint I/O: the engine's save, async staging, restore and GCS upload against plain baselines.

State (~1.1 GB): a transformer-shaped nn.Module (vocab 32768, d 768, 6 blocks with biased
q/k/v/o and a 4x MLP, LayerNorms, untied embedding and head: 100 fp32 tensors, 92.8M
parameters, 371 MB) and a real torch.optim.AdamW after one step (exp_avg, exp_avg_sq and
step per parameter: 742 MB more). All four measurements run on it in one process:

1. sync save: a real engine.checkpoint.checkpointer.Checkpointer (TorchBackend("cpu"),
   checkpoint.async false), save(Progress(step=N), wait=True): stage (clone), dcp.save with
   FileSystemWriter(sync_files=True) into .tmp-step_N, manifest with CRC32C, atomic rename.
   Baseline: the same files with the same bytes (read back from a warm-up save) written with
   plain os.write of a bytes buffer into the same directory, then fsync (files and directory).
   Target: ours >= 80% of the baseline's GB/s.
2. async blocking: the same Checkpointer with checkpoint.async true; the time save() takes
   to return (staging), against the median sync save time. Target <= 15%.
3. restore: Checkpointer.restore() as the engine runs it: CRC32C of every file against the
   manifest (newest_valid), then dcp.load and set_state_dict. The page cache is dropped
   before each restore (echo 3 > /proc/sys/vm/drop_caches, needs root; the JSON says whether
   it worked). The CRC phase is timed separately, and the CRC computation alone over the same
   bytes in memory. Reference: a plain read of the same files from a cold cache. Target >= 1 GB/s.
4. GCS upload: tpud.gcs.tier.GcsTier.upload_step of the committed step directory to a local
   fake-gcs-server (testkit/gcs_server.py's GcsServer, filesystem backend, fresh bucket)
   against transfer_manager.upload_many_from_filenames of the same files to the same bucket
   under another prefix, with the tier's settings (threads, 8 workers). Target >= 90%.

5. memory tier: the 125m preset (configs/models/125m.yaml) training on CPU with the data bench's
   geometry (seq_len 256, micro-batch 8) for --memory-steps steps, with checkpoint.memory every
   step (TPUD_MEMORY_DIR in /dev/shm) and without it. Blocking: how long each memory save holds
   the loop (the step events' checkpoint badput), against the median step time without the tier.
   Target <= 5%. The cost: the median step with the tier against the one without (the checksums
   and manifest run beside training).

Every measurement is repeated (--repeats, default 3; ours and baseline alternate, the order
flipping each round) and the median is reported (time.perf_counter). Before each one: files
of the previous one deleted, os.sync(), page cache dropped when possible. GB = 1e9 bytes.
Before measuring, the script waits (up to --quiet-wait s, polling every 15 s) for a 1-minute
load average below --quiet-load; the loads and the CPU share other processes took in each
phase are recorded. Missed targets are printed; the exit status is 0 (this is a report).

    .venv/bin/python bench/checkpoint.py               # ~4 min on 2 idle cores (+ the wait), ~4 GB of disk
    .venv/bin/python bench/checkpoint.py --repeats 2 --quiet-wait 0 --dir /some/disk

The fake server is CPU-bound (~20 s of its CPU per GB uploaded), so the GCS row compares the
tier's overhead with a plain client's, not with real GCS bandwidth; it takes most of the run.

Results: a table on stdout and bench/results/checkpoint.json (machine, sizes, raw timings).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import google_crc32c
import torch
import torch.distributed.checkpoint as dcp
from google.cloud.storage import transfer_manager
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # testkit.gcs_server (tests/ is not an installed package)

from engine.layout import fsync_path  # noqa: E402
from engine import logs  # noqa: E402
from engine.backends.torch_native import TorchBackend  # noqa: E402
from engine.checkpoint import state as ckstate  # noqa: E402
from engine.checkpoint import manifest as mf  # noqa: E402
from engine.checkpoint.checkpointer import Checkpointer, Progress  # noqa: E402
from engine.spec.schema import CheckpointConfig  # noqa: E402
from testkit.gcs_server import GcsServer  # noqa: E402
from tpud.gcs.tier import GcsTier  # noqa: E402
from machine import describe  # noqa: E402

TARGETS = {"save_ratio": 0.80, "async_blocking_ratio": 0.15, "restore_gb_s": 1.0, "upload_ratio": 0.90,
           "memory_blocking_ratio": 0.05}
VOCAB, DIM, LAYERS = 32768, 768, 6


# -----------------------------------------------------------------------------
# The state: a transformer-shaped module and AdamW with its state materialised.


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class StateModel(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)


def build_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = StateModel(VOCAB, DIM, LAYERS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # exp_avg, exp_avg_sq, step now exist (non-zero)
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


# -----------------------------------------------------------------------------
# Machine hygiene: page cache, load, other processes' CPU.


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cpu_ticks(extra_pid: int | None = None) -> tuple[int, int, int] | None:
    """(all cores' busy ticks, all cores' total ticks, ticks of this process [+ extra_pid])."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        own = 0
        for pid in ("self", extra_pid) if extra_pid else ("self",):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            own += int(fields[11]) + int(fields[12])
    except OSError:
        return None
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks), own


def others_share(start, end) -> float | None:
    if start is None or end is None or end[1] == start[1]:
        return None
    busy, total, own = (e - s for e, s in zip(end, start))
    return round(max(0.0, (busy - own) / total), 4)


def wait_quiet(threshold: float, max_wait: float, poll: float = 15.0) -> dict:
    start, first = time.monotonic(), os.getloadavg()
    while os.getloadavg()[0] >= threshold and time.monotonic() - start < max_wait:
        print(f"waiting for a quiet machine: load {os.getloadavg()[0]:.2f} >= {threshold}", flush=True)
        time.sleep(poll)
    return {"threshold": threshold, "load_at_start": first, "waited_s": round(time.monotonic() - start, 1),
            "load_when_started": os.getloadavg(), "quiet": os.getloadavg()[0] < threshold}


@contextlib.contextmanager
def timing(parts: dict[str, tuple[object, str]]):
    """Time every call of each owner.attr (the checkpointer looks these up at call time) while
    inside; yields {part: [seconds per call]}. On a class: plain, class and static methods."""
    times: dict[str, list[float]] = defaultdict(list)
    undo = []
    for part, (owner, attr) in parts.items():
        original = getattr(owner, attr)
        raw = owner.__dict__[attr] if isinstance(owner, type) else original

        def timed(*a, _fn=original, _part=part, **k):
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times[_part].append(time.perf_counter() - start)
        setattr(owner, attr, staticmethod(timed) if isinstance(raw, (classmethod, staticmethod)) else timed)
        undo.append((owner, attr, raw))
    try:
        yield times
    finally:
        for owner, attr, raw in reversed(undo):
            setattr(owner, attr, raw)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def files_of(step_dir: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(step_dir)), p.stat().st_size) for p in step_dir.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


# -----------------------------------------------------------------------------
# Baselines.


def raw_write(directory: Path, contents: dict[str, bytes]) -> float:
    """Plain os.write of each file's bytes, fsync each, fsync the directory; seconds."""
    directory.mkdir(parents=True)
    start = time.perf_counter()
    for rel, data in contents.items():
        fd = os.open(directory / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_path(directory)
    return time.perf_counter() - start


def raw_read(step_dir: Path, buffer: bytearray) -> float:
    """Plain reads (8 MiB blocks, as file_crc32c) of every file into one buffer; seconds."""
    view = memoryview(buffer)
    start = time.perf_counter()
    for rel, _ in files_of(step_dir):
        with open(step_dir / rel, "rb", buffering=0) as f:
            while f.readinto(view[: 8 << 20]):
                pass
    return time.perf_counter() - start


# -----------------------------------------------------------------------------


def memory_tier(steps: int) -> dict:
    """Section 5 (module docstring): the 125m preset with and without the memory tier."""
    import yaml

    from engine import events
    from engine.runtime import Runtime
    from engine.spec.loader import load_spec
    from engine.train import Trainer
    from testkit.recorders import Recorder

    model = yaml.safe_load((REPO / "configs" / "models" / "125m.yaml").read_text())["model"]
    common = [f"model={json.dumps(model)}", "data.seq_len=256", "data.micro_batch_size=8",
              f"train.max_steps={steps + 2}", "train.log_interval=1", "scheduler.warmup_steps=1",
              "checkpoint.interval_steps=0", "logging.level=warning"]
    arms = {}
    for arm, memory in (("without", "checkpoint.memory=null"), ("with", "checkpoint.memory.interval_steps=1")):
        spec = load_spec(REPO / "configs" / "jobs" / "tiny-cpu.yaml", [*common, memory])
        with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            hooks = Recorder()
            Trainer(spec, Path(home), hooks, runtime=Runtime(memory_dir=Path(shm))).run()
        reports = hooks.of(events.Step)
        # A save at step N's end holds the loop before step N + 1; the first two steps warm up (and
        # the first save maps and allocates its slot).
        blocked = [b.badput.checkpoint - a.badput.checkpoint for a, b in zip(reports[1:], reports[2:])]
        commits = [e for e in hooks.of(events.CheckpointCommitted) if e.tier == "memory"]
        arms[arm] = {"step_s": [e.step_time_s for e in reports[2:]], "blocked_s": blocked,
                     "memory_commits": len(commits), "state_bytes": commits[-1].bytes if commits else 0,
                     "commit_s": [e.seconds for e in commits]}
    return arms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--quiet-load", type=float, default=0.8)
    parser.add_argument("--quiet-wait", type=float, default=600.0, help="max seconds to wait for a quiet machine")
    parser.add_argument("--memory-steps", type=int, default=8, help="125m steps per arm of section 5")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "checkpoint.json")
    args = parser.parse_args()
    logs.configure("warning")  # the checkpointer's info lines would interleave with the table
    began = time.monotonic()

    load = wait_quiet(args.quiet_load, args.quiet_wait)
    torch.set_num_threads(os.cpu_count())
    work = Path(tempfile.mkdtemp(prefix="tpud-bench-ckpt-", dir=args.dir))
    server = None
    try:
        model, optimizer = build_state()
        backend = TorchBackend("cpu")

        def checkpointer(job: str, async_: bool) -> Checkpointer:
            cfg = CheckpointConfig.model_validate({"dir": str(work), "async": async_, "keep": 2})
            return Checkpointer(cfg, job, work / job, {}, backend, model, optimizer, {}, lambda event: None)

        sync_ck, async_ck = checkpointer("sync", False), checkpointer("async", True)
        n_params = sum(p.numel() for p in model.parameters())
        state_info = {
            "model": f"StateModel(vocab={VOCAB}, d={DIM}, layers={LAYERS}), fp32", "params": n_params,
            "model_tensors": len(list(model.parameters())), "model_bytes": n_params * 4,
            "optimizer": "torch.optim.AdamW after one step (exp_avg, exp_avg_sq, step per parameter)",
            "optimizer_bytes": sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                   for t in s.values() if isinstance(t, torch.Tensor)),
        }
        step = iter(range(1, 10_000))
        dropped = drop_caches()

        # Warm-up save (untimed in the table): one-time costs, and the bytes the raw baseline writes.
        start = time.perf_counter()
        s = next(step)
        sync_ck.save(Progress(step=s), "bench", wait=True)
        warmup_s = time.perf_counter() - start
        warm_dir = sync_ck.job_dir / mf.step_dir_name(s)
        files = files_of(warm_dir)
        total = sum(size for _, size in files)
        contents = {rel: (warm_dir / rel).read_bytes() for rel, _ in files}
        state_info.update(files=dict(files), checkpoint_bytes=total, warmup_save_s=round(warmup_s, 3))
        remove(warm_dir)
        print(f"state: {n_params / 1e6:.1f}M params, {len(files)} files, {total / 1e9:.3f} GB "
              f"(warm-up save {warmup_s:.2f} s); page cache dropping: {'yes' if dropped else 'NO (not root?)'}",
              flush=True)

        phases: dict[str, dict] = {}

        def phase(name: str, ticks, extra=None) -> None:
            phases[name] = {"others_cpu_share": others_share(ticks, cpu_ticks(extra)), "load_after": os.getloadavg()}

        # 1. sync save vs raw write ----------------------------------------------------------
        ours_save, raw_save = [], []
        ticks = cpu_ticks()
        save_parts = timing({"stage (clone)": (backend, "stage"), "dcp.save (write+fsync)": (dcp, "save"),
                             "manifest CRC32C": (mf.Manifest, "describe"), "write_manifest": (mf, "write_manifest")})
        with save_parts as save_times:
            for r in range(args.repeats):
                for side in (("ours", "raw") if r % 2 == 0 else ("raw", "ours")):
                    drop_caches()
                    gc.collect()
                    if side == "raw":
                        target = sync_ck.job_dir / "raw"
                        raw_save.append(raw_write(target, contents))
                        remove(target)
                    else:
                        s = next(step)
                        start = time.perf_counter()
                        sync_ck.save(Progress(step=s), "bench", wait=True)
                        ours_save.append(time.perf_counter() - start)
                        last_sync_dir = sync_ck.job_dir / mf.step_dir_name(s)
                # keep only the newest committed step (restore and upload use it)
                for _, path, _ in mf.committed_steps(sync_ck.job_dir)[:-1]:
                    remove(path)
        phase("sync_save", ticks)

        # 2. async blocking -------------------------------------------------------------------
        blocked, async_total = [], []
        ticks = cpu_ticks()
        with timing({"stage (clone)": (backend, "stage")}) as async_times:
            for r in range(args.repeats):
                drop_caches()
                gc.collect()
                s = next(step)
                start = time.perf_counter()
                async_ck.save(Progress(step=s), "bench")
                blocked.append(time.perf_counter() - start)
                async_ck.wait()
                async_total.append(time.perf_counter() - start)
                remove(async_ck.job_dir / mf.step_dir_name(s))
        phase("async_save", ticks)

        # 3. restore (cold cache) vs plain read ------------------------------------------------
        step_dir = last_sync_dir
        saved_step = mf.read_manifest(step_dir).step
        probe = next(iter(model.parameters()))
        expected = probe.detach().clone()
        buffer = bytearray(8 << 20)
        restore_s, read_s = [], []
        ticks = cpu_ticks()
        with timing({"CRC32C verify (cold read)": (mf, "problems"), "dcp.load": (dcp, "load"),
                     "set_state_dict": (ckstate, "set_state_dict")}) as restore_times:
            for r in range(args.repeats):
                for side in (("ours", "raw") if r % 2 == 0 else ("raw", "ours")):
                    drop_caches()
                    gc.collect()
                    if side == "raw":
                        read_s.append(raw_read(step_dir, buffer))
                    else:
                        with torch.no_grad():
                            probe.zero_()
                        start = time.perf_counter()
                        progress = sync_ck.restore()
                        restore_s.append(time.perf_counter() - start)
                        assert progress is not None and progress.step == saved_step, progress
                        assert torch.equal(probe, expected), "restore did not bring the parameters back"
        phase("restore", ticks)
        crc_compute = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for data in contents.values():
                google_crc32c.value(data)
            crc_compute.append(time.perf_counter() - start)

        # 4. GCS upload vs plain transfer_manager ---------------------------------------------
        server = GcsServer(work / "gcs-root")
        server.start()
        os.environ["STORAGE_EMULATOR_HOST"] = server.url
        client = server.client()
        bucket_name = f"bench-{uuid.uuid4().hex[:12]}"
        bucket = client.create_bucket(bucket_name)
        names = [rel for rel, _ in files_of(step_dir)]
        upload_total = sum(size for _, size in files_of(step_dir))  # data files + manifest.json

        def clear(prefix: str) -> None:
            for blob in client.list_blobs(bucket_name, prefix=prefix):
                blob.delete()
            drop_caches()

        # Warm-up upload (untimed): the server's first large upload grows its heap.
        start = time.perf_counter()
        transfer_manager.upload_many_from_filenames(
            bucket, names, source_directory=str(step_dir), blob_name_prefix="warmup/",
            worker_type=transfer_manager.THREAD, max_workers=8, raise_exception=True)
        upload_warmup_s = time.perf_counter() - start
        clear("warmup/")

        ours_up, plain_up = [], []
        ticks = cpu_ticks(server.proc.pid)
        for r in range(args.repeats):
            for side in (("ours", "plain") if r % 2 == 0 else ("plain", "ours")):
                drop_caches()
                gc.collect()
                if side == "ours":
                    tier = GcsTier(f"gs://{bucket_name}/ours{r}", "bench", client=client)
                    start = time.perf_counter()
                    transfer = tier.upload_step(step_dir)
                    ours_up.append(time.perf_counter() - start)
                    assert transfer.files == len(names) - 1 and transfer.skipped_bytes == 0, transfer
                    clear(f"ours{r}/")
                else:
                    start = time.perf_counter()
                    results = transfer_manager.upload_many_from_filenames(
                        bucket, names, source_directory=str(step_dir), blob_name_prefix=f"plain{r}/",
                        worker_type=transfer_manager.THREAD, max_workers=8, raise_exception=True)
                    plain_up.append(time.perf_counter() - start)
                    assert all(x is None for x in results), results
                    clear(f"plain{r}/")
        phase("gcs_upload", ticks, server.proc.pid)

        # 5. the memory tier: its blocking against a 125m step ------------------------------------
        del model, optimizer, sync_ck, async_ck, contents
        gc.collect()
        print("memory tier: the 125m preset on CPU, with and without ...", flush=True)
        ticks = cpu_ticks()
        memory = memory_tier(args.memory_steps)
        phase("memory_tier", ticks)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)

    # -- report ---------------------------------------------------------------------------
    gb = total / 1e9
    save_ours, save_raw = gb / med(ours_save), gb / med(raw_save)
    block_ratio = med(blocked) / med(ours_save)
    restore_gbs, read_gbs = gb / med(restore_s), gb / med(read_s)
    up_gb = upload_total / 1e9
    up_ours, up_plain = up_gb / med(ours_up), up_gb / med(plain_up)
    memory_ratio = med(memory["with"]["blocked_s"]) / med(memory["without"]["step_s"])
    memory_cost = med(memory["with"]["step_s"]) / med(memory["without"]["step_s"])
    rows = [
        ("sync save GB/s", f"{save_ours:.3f}", f"{save_raw:.3f} raw write", save_ours / save_raw,
         f">= {TARGETS['save_ratio']:.2f}", save_ours / save_raw >= TARGETS["save_ratio"]),
        ("async blocking s", f"{med(blocked):.3f}", f"{med(ours_save):.3f} sync save", block_ratio,
         f"<= {TARGETS['async_blocking_ratio']:.2f}", block_ratio <= TARGETS["async_blocking_ratio"]),
        ("restore GB/s (cold)", f"{restore_gbs:.3f}", f"{read_gbs:.3f} raw read", restore_gbs / read_gbs,
         f">= {TARGETS['restore_gb_s']:.1f} GB/s", restore_gbs >= TARGETS["restore_gb_s"]),
        ("GCS upload GB/s", f"{up_ours:.3f}", f"{up_plain:.3f} plain tm", up_ours / up_plain,
         f">= {TARGETS['upload_ratio']:.2f}", up_ours / up_plain >= TARGETS["upload_ratio"]),
        ("memory save block s", f"{med(memory['with']['blocked_s']):.3f}",
         f"{med(memory['without']['step_s']):.3f} 125m step", memory_ratio,
         f"<= {TARGETS['memory_blocking_ratio']:.2f}", memory_ratio <= TARGETS["memory_blocking_ratio"]),
    ]
    print(f"\n{'measurement':<20} {'ours':>7}  {'baseline':<20} {'ratio':>6}  {'target':<12} result")
    for name, ours, base, ratio, target, ok in rows:
        print(f"{name:<20} {ours:>7}  {base:<20} {ratio:>6.3f}  {target:<12} {'pass' if ok else 'MISS'}")

    def breakdown(times: dict[str, list[float]]) -> str:
        return " + ".join(f"{part} {med(t):.3f}" for part, t in times.items())

    print(f"sync save {med(ours_save):.3f} s (medians): {breakdown(save_times)}; raw write {med(raw_save):.3f} s")
    print(f"async save: blocked {med(blocked):.3f} s ({breakdown(async_times)}), committed after "
          f"{med(async_total):.3f} s")
    print(f"restore {med(restore_s):.3f} s: {breakdown(restore_times)}; CRC32C alone over the same bytes in "
          f"memory {med(crc_compute):.3f} s; raw cold read {med(read_s):.3f} s; page cache "
          + ("dropped before each: read from disk" if dropped else "NOT dropped (not root?): may be from cache"))
    print(f"memory tier: {memory['with']['memory_commits']} saves of {memory['with']['state_bytes'] / 1e9:.2f} GB, "
          f"blocked {med(memory['with']['blocked_s']):.3f} s (max {max(memory['with']['blocked_s']):.3f}), committed "
          f"{med(memory['with']['commit_s']):.3f} s after; step {med(memory['with']['step_s']):.2f} s with the tier, "
          f"{med(memory['without']['step_s']):.2f} s without ({memory_cost:.3f}x)")
    print(f"{args.repeats} repeats; load {load['load_when_started'][0]:.2f} when measuring began "
          f"(waited {load['waited_s']:.0f} s); other processes' CPU share: "
          + ", ".join(f"{k} {v['others_cpu_share']}" for k, v in phases.items()))
    missed = [name for name, *_, ok in rows if not ok]
    print("targets: " + ("all met" if not missed else "MISSED: " + ", ".join(missed)))
    print(f"elapsed {time.monotonic() - began:.0f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "checkpoint", "targets": TARGETS, "gb": 1e9, "repeats": args.repeats,
        "machine": describe(mem_total_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                            scratch_dir=str(work), crc32c_implementation=google_crc32c.implementation),
        "load": load, "phases": phases, "page_cache_dropped": dropped, "state": state_info,
        "sync_save": {"bytes": total, "ours_s": ours_save, "raw_write_s": raw_save, "ours_parts_s": save_times,
                      "ours_gb_s": save_ours, "raw_gb_s": save_raw, "ratio": save_ours / save_raw},
        "async_save": {"blocking_s": blocked, "total_s": async_total, "parts_s": async_times, "sync_save_median_s": med(ours_save),
                       "ratio": block_ratio},
        "restore": {"bytes": total, "ours_s": restore_s, "parts_s": restore_times, "crc_in_memory_s": crc_compute,
                    "raw_read_s": read_s, "ours_gb_s": restore_gbs, "raw_read_gb_s": read_gbs,
                    "from": "disk" if dropped else "possibly page cache"},
        "gcs_upload": {"bytes": upload_total, "files": names, "ours_s": ours_up, "plain_s": plain_up,
                       "ours_gb_s": up_ours, "plain_gb_s": up_plain, "ratio": up_ours / up_plain,
                       "warmup_plain_s": upload_warmup_s,
                       "server": "fake-gcs-server (testkit/gcs_server.py), filesystem backend, loopback; "
                                 "others_cpu_share of this phase counts the server as ours"},
        "memory_tier": {**memory, "preset": "125m", "geometry": "seq_len 256, micro_batch_size 8, CPU",
                        "ratio": memory_ratio, "step_cost_ratio": memory_cost},
        "missed": missed,
    }, indent=2))


if __name__ == "__main__":
    main()

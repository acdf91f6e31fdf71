"""Hostile job files dropped beside a training job: does the daemon stay responsive and small?

One run against a real `tpud daemon --home TMP` supervising the tiny demo job:
1. baseline: `status` over the control socket every 50 ms for --seconds, daemon RSS sampled;
2. the corpus of testkit/hostile.py (alias bombs, 10,000-deep nesting, a 50 MB file, binary,
   invalid UTF-8, a FIFO, a symlink to /dev/zero, a directory) written into jobs.d/ at once,
   then the same polling for --seconds: status latency (targets: every answer < 100 ms),
   peak daemon RSS (target < 300 MB), and the time from the drop until each file shows
   INVALID with its reason;
3. `tpud validate FILE` on each file, wall time of the whole command (target < 2 s), against
   `tpud validate` of the valid demo job (the interpreter's start-up is in both).

    .venv/bin/python bench/hostile_files.py
Results: a table on stdout and bench/results/hostile_files.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import describe
from supervised import ENV, REPO, supervised_job
from testkit.hostile import write_corpus
from tpud.control import ControlClient

TARGETS = {"status_max_ms": 100.0, "rss_peak_mb": 300.0, "validate_max_s": 2.0}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def poll(client: ControlClient, pid: int, seconds: float, names: set[str] = frozenset(), since: float = 0.0):
    """Latencies (ms), peak RSS (MB), and when each of `names` was first shown INVALID (s after `since`)."""
    latencies, peak, seen = [], 0.0, {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        jobs = client.call("status")["jobs"]
        latencies.append((time.monotonic() - started) * 1000)
        peak = max(peak, rss_mb(pid))
        for job in jobs:
            if job["name"] in names and job["state"] == "INVALID" and job["name"] not in seen:
                seen[job["name"]] = time.monotonic() - since
        time.sleep(0.05)
    return latencies, peak, seen


def summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"n": len(ordered), "p50_ms": statistics.median(ordered),
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_ms": ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="polling time of each phase")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "hostile_files.json")
    args = parser.parse_args()

    with supervised_job() as run:
        client, pid, jobs_dir = run.client, run.process.pid, run.home / "jobs.d"
        base_lat, base_rss, _ = poll(client, pid, args.seconds)
        step_before = client.call("status")["jobs"][0]["step"]

        dropped = time.monotonic()
        corpus = write_corpus(jobs_dir)
        names = {Path(name).stem for name in corpus}
        hostile_lat, hostile_rss, rejected = poll(client, pid, args.seconds, names, dropped)
        jobs = {j["name"]: j for j in client.call("status")["jobs"]}
        reasons = {name: jobs.get(Path(name).stem, {}).get("error") for name in corpus}
        still_training = jobs["bench"]["state"] == "RUNNING" and jobs["bench"]["step"] > step_before

    def validate(path: Path) -> float:
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "tpud", "validate", str(path)], capture_output=True, env=ENV,
                       timeout=60)
        return time.monotonic() - started

    valid_s = statistics.median(validate(REPO / "configs" / "jobs" / "tiny-cpu.yaml") for _ in range(3))
    validate_s = {name: validate(jobs_dir / name) for name in corpus}

    base, hostile = summary(base_lat), summary(hostile_lat)
    results = {
        "status_baseline": base, "status_hostile": hostile,
        "status_p99_ratio": hostile["p99_ms"] / base["p99_ms"],
        "status_max_ms": hostile["max_ms"], "rss_baseline_mb": base_rss, "rss_peak_mb": hostile_rss,
        "rejected_after_s": rejected, "all_rejected": len(rejected) == len(corpus),
        "validate_valid_s": valid_s, "validate_s": validate_s, "validate_max_s": max(validate_s.values()),
        "validate_max_ratio": max(validate_s.values()) / valid_s,
        "job_kept_training": still_training, "reasons": reasons,
    }
    passed = (results["status_max_ms"] < TARGETS["status_max_ms"] and hostile_rss < TARGETS["rss_peak_mb"]
              and results["validate_max_s"] < TARGETS["validate_max_s"] and results["all_rejected"]
              and still_training)

    print(f"{'status over the control socket':<34} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'RSS MB':>8}")
    print(f"{'  baseline (one job training)':<34} {base['p50_ms']:>8.2f} {base['p99_ms']:>8.2f} "
          f"{base['max_ms']:>8.2f} {base_rss:>8.1f}")
    print(f"{'  with the hostile corpus':<34} {hostile['p50_ms']:>8.2f} {hostile['p99_ms']:>8.2f} "
          f"{hostile['max_ms']:>8.2f} {hostile_rss:>8.1f}")
    print(f"  p99 ratio hostile/baseline {results['status_p99_ratio']:.2f}x; targets: max < "
          f"{TARGETS['status_max_ms']:.0f} ms, RSS < {TARGETS['rss_peak_mb']:.0f} MB")
    print(f"\n{'file':<26} {'INVALID after s':>16} {'validate s':>11}  reason")
    for name in corpus:
        shown = rejected.get(Path(name).stem)
        reason = (reasons[name] or "-").split(": ", 1)[-1][:70]
        print(f"{name:<26} {'-' if shown is None else f'{shown:.2f}':>16} {validate_s[name]:>11.2f}  {reason}")
    print(f"{'(valid demo job)':<26} {'':>16} {valid_s:>11.2f}")
    print(f"\nthe training job kept stepping: {still_training}; "
          f"{'all targets met' if passed else 'targets MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "hostile_files", "targets": TARGETS, "results": results, "passed": passed,
        "raw": {"status_baseline_ms": base_lat, "status_hostile_ms": hostile_lat}, "machine": describe(),
    }, indent=2))


if __name__ == "__main__":
    main()

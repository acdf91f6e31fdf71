"""The daemon's own cost while it supervises one running job (the tiny demo on CPU).

Measured in one run against a real `tpud daemon --home TMP`:
- status round trip: a ControlClient `status` request over <runtime>/control.sock, median
  of 100 (target <= 50 ms). The full `tpud status` command is also timed; it adds the
  Python interpreter's start-up, which is not the daemon's cost.
- metrics scrape: HTTP GET of /metrics, median of 100 (target <= 50 ms).
- daemon CPU: the daemon process's own user+system time (from /proc, its workers
  excluded) over a 30 s window while the job trains, as a share of one core
  (target <= 1%).

    .venv/bin/python bench/daemon.py
Results: a table on stdout and bench/results/daemon.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from machine import describe
from supervised import ENV, REPO, supervised_job

TARGETS = {"status_ms": 50.0, "scrape_ms": 50.0, "cpu_percent": 1.0}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--cpu-window", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "daemon.json")
    args = parser.parse_args()

    with supervised_job() as run:
        client, home = run.client, run.home
        url = f"http://{(home / 'run' / 'metrics.addr').read_text().strip()}/metrics"

        start_cpu, start = cpu_seconds(run.process.pid), time.monotonic()
        time.sleep(args.cpu_window)
        cpu_percent = 100 * (cpu_seconds(run.process.pid) - start_cpu) / (time.monotonic() - start)

        status_ms = timed(lambda: client.call("status"), args.repeats)
        scrape_ms = timed(lambda: urllib.request.urlopen(url, timeout=5).read(), args.repeats)
        cli = [sys.executable, "-m", "tpud", "status", "--home", str(home)]
        cli_ms = timed(lambda: subprocess.run(cli, capture_output=True, env=ENV, check=True), 10)

    results = {
        "status_ms": statistics.median(status_ms), "scrape_ms": statistics.median(scrape_ms),
        "cpu_percent": cpu_percent, "cli_status_ms": statistics.median(cli_ms),
    }
    print(f"{'measurement':<34} {'value':>9} {'target':>8}  result")
    rows = [("status round trip (median, ms)", "status_ms"), ("metrics scrape (median, ms)", "scrape_ms"),
            ("daemon CPU, one running job (%)", "cpu_percent")]
    met = True
    for label, key in rows:
        ok = results[key] <= TARGETS[key]
        met &= ok
        print(f"{label:<34} {results[key]:>9.2f} {TARGETS[key]:>8.1f}  {'pass' if ok else 'MISS'}")
    print(f"{'tpud status command (median, ms)':<34} {results['cli_status_ms']:>9.1f} {'-':>8}  "
          "(interpreter start-up included; not a daemon cost)")
    print("all targets met" if met else "targets MISSED")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "daemon", "targets": TARGETS, "results": results, "passed": met,
        "raw": {"status_ms": status_ms, "scrape_ms": scrape_ms, "cli_status_ms": cli_ms},
        "machine": describe(),
    }, indent=2))


if __name__ == "__main__":
    main()

"""The reference a campaign's training is held to: the same job, trained to the same step by one
`tpud run` with nothing struck. The data spikes are kept (the same poisoned batches, so the same
rollbacks and the same skip ledger); bit flips and host spikes are left out (a lone replica has
no peer to be found out by, and a transient spike changes nothing once healed). The global batch
is fixed, but a gang whose membership changed trains other batches (each host's share of the data
follows the world size), hence a loss curve compared window by window rather than bitwise weights."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path

from testkit import PYTHON, python_env
from tpud.paths import Paths

WINDOW = 100  # steps per compared window, at least (a twentieth of the run where that is more)
BOUND = 0.01  # the largest relative difference of a window's mean loss that passes


def losses(job_text: str, home: Path, timeout: float) -> dict[int, float]:
    """step -> loss of the reference run (the last record of each step: a rollback's replay wins)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "tpud.yaml").write_text("allow_fault_injection: true\n")  # the data spikes
    job = home / "reference.yaml"
    job.write_text(job_text)
    try:
        done = subprocess.run([PYTHON, "-m", "tpud", "run", str(job), "--home", str(home)], capture_output=True,
                              text=True, timeout=timeout, env=python_env(OMP_NUM_THREADS="1"))
    finally:
        shutil.rmtree(Paths.resolve(home).memory, ignore_errors=True)  # its memory tier, in /dev/shm
    if done.returncode != 0:
        raise RuntimeError(f"the reference run exited {done.returncode}: {done.stdout[-2000:]}")
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("{") and '"event": "step"' in line:
            record = json.loads(line)
            found[record["step"]] = record["loss"]
    return found


def lineage(steps: dict[int, list[tuple[float, int, float]]]) -> dict[int, float]:
    """step -> the median over hosts of each host's last loss of that step (each host logs its own
    micro-batches' loss; the median leaves out a replica that went wrong before it was found)."""
    per_host = []
    for records in steps.values():
        last = {}
        for _, step, loss in sorted(records):
            last[step] = loss
        per_host.append(last)
    every = sorted({s for last in per_host for s in last})
    return {s: statistics.median(last[s] for last in per_host if s in last) for s in every}


def compare(chaos: dict[int, float], reference: dict[int, float]) -> dict:
    """Window by window. A gang that changed its membership trains other batches from then on (each
    host's share of the data follows the world size), so the curves agree in level, not step by step."""
    common = sorted(set(chaos) & set(reference))
    worst, at, size = 0.0, None, max(WINDOW, len(common) // 20)
    for start in range(0, len(common) - size + 1, size):
        window = common[start:start + size]
        ours = statistics.fmean(chaos[s] for s in window)
        theirs = statistics.fmean(reference[s] for s in window)
        gap = abs(ours - theirs) / abs(theirs)
        if gap > worst:
            worst, at = gap, (window[0], window[-1])
    return {"steps_compared": len(common), "window": size, "max_rel_diff": round(worst, 5), "worst_window": at,
            "within": worst <= BOUND, "final_loss": chaos.get(common[-1]) if common else None,
            "reference_final_loss": reference.get(common[-1]) if common else None}

"""The reference a campaign's training is held to: the same job, trained to the same step by one
`tpud run` with nothing struck and fed the campaign's skip ledger (`data.skip`: the sample ranges
its rollbacks left out, whichever fault caused them), so that every step trains the same samples
(the loader's global batches depend on the global batch only, not on the world size). What
differs is the order of the sums (each membership splits the batch its own way) and nothing
else, so the curves agree closely but not bitwise: they are compared window by window."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
from pathlib import Path

from engine.data.skips import merge_skips
from testkit import PYTHON, python_env
from tpud.paths import Paths

WINDOW = 100  # steps per compared window, at least (a twentieth of the run where that is more)
BOUND = 0.01  # the largest relative difference of a window's mean loss that passes


def ledger(paths: dict[int, Path]) -> tuple[list[list[int]], dict[int, tuple[tuple[int, int], ...]]]:
    """The sample ranges the skip ledgers at `paths` (by host) left out, their union, and each
    host's (every host of a gang skips the same: it rolls back in lockstep or adopts a peer's ranges)."""
    found = {}
    for host, path in paths.items():
        try:
            found[host] = _covered(e["samples"] for e in json.loads(path.read_text())["entries"])
        except FileNotFoundError:
            found[host] = ()  # nothing skipped on this host
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the skip ledger {path} cannot be read: {e}") from e
    return [list(r) for r in _covered(r for ranges in found.values() for r in ranges)], found


def _covered(ranges) -> tuple[tuple[int, int], ...]:
    """The samples the (first, count) ranges cover, as the fewest ranges: a peer's ranges adopted
    in another geometry cover the same samples in other pieces."""
    out: list[list[int]] = []
    for first, count in merge_skips(ranges):
        if out and first <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], first + count - out[-1][0])
        else:
            out.append([first, count])
    return tuple((first, count) for first, count in out)


def losses(job_text: str, home: Path, timeout: float) -> dict[int, float]:
    """step -> loss of the reference run (the last record of each step)."""
    home.mkdir(parents=True, exist_ok=True)
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
    """step -> the median over hosts of each host's last loss of that step (every host logs the
    gang's loss; a host's last record may still be of a lineage the others abandoned)."""
    per_host = []
    for records in steps.values():
        last = {}
        for _, step, loss in sorted(records):
            last[step] = loss
        per_host.append(last)
    every = sorted({s for last in per_host for s in last})
    return {s: statistics.median(last[s] for last in per_host if s in last) for s in every}


def compare(chaos: dict[int, float], reference: dict[int, float]) -> dict:
    """Window by window: the same samples each step, but each membership sums them in its own
    order, and the difference grows over thousands of steps into other weights of the same quality."""
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

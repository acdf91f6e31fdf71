"""The skip ledger: every range of the run's data it left out, and why.

A rollback (engine.health.healing) or the supervisor's restart after a bad step skips the
micro-batches of the bad steps. Each skip is an entry here, persisted in the job's state
directory (<state>/jobs/<job>/data_skips.json) before the loop goes on, and its ranges go into
every later checkpoint's manifest (`data_skips`), so a checkpoint carries them to another host.

Ranges are in global micro-batches of the unskipped stream (engine.data.loader), and each entry
gives the same range in samples, global indices into the run's stream: geometry-independent,
what `tpud status` shows and what `data.skip` takes. A run started from scratch with a ledger's
sample ranges in `data.skip` skips the same micro-batches, so it trains on exactly the samples
the run that healed itself kept. Torch-free: the daemon reads it for `tpud status` (`summary_of`).

The file: {"format": 2, "skips": [[first, count], ...], "entries": [{"first", "count",
"samples": [first, count], "reason", "step", "loss", "unix"}, ...]}; format 1 (skips alone) is
read as entries of reason "unknown".
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.data.skips import Skips, merge_skips, sample_ranges_to_micro_batches
from engine.files import Refused, read_regular_file
from engine.layout import atomic_write

if TYPE_CHECKING:
    from engine.data.loader import PackedLoader

FORMAT = 2
MAX_BYTES = 16 << 20  # the daemon's bound on what it reads of a ledger


@dataclass(frozen=True)
class Skipped:
    first: int                   # global micro-batch index, unskipped stream
    count: int                   # micro-batches
    samples: tuple[int, int]     # (first, count): the same range in samples
    reason: str                  # spike | nonfinite | operator | unknown
    step: int | None = None      # the logged step that met it
    loss: float | None = None
    unix: float | None = None

    def to_json(self) -> dict:
        entry = asdict(self)
        entry["samples"] = list(self.samples)
        if entry["loss"] is not None and not math.isfinite(entry["loss"]):
            entry["loss"] = str(entry["loss"])  # JSON has no NaN
        return entry


class SkipLedger:
    def __init__(self, path: Path, per_micro_batch: int, operator: Iterable[tuple[int, int]] = ()):
        """per_micro_batch: samples in one global micro-batch (ranks x micro_batch_size);
        operator: the job's data.skip sample ranges."""
        self.path, self.per_micro_batch = Path(path), per_micro_batch
        # The file's: what this job skipped, in micro-batches of this geometry (a micro-batch made
        # smaller to fit, engine.fitting, or a global batch over another number of hosts).
        self.entries: list[Skipped] = [self._now(e) for e in self._read()]
        # The job file's, never written to the ledger: they leave with the setting.
        self.operator = [self._entry(first, count, "operator")
                         for first, count in sample_ranges_to_micro_batches(operator, per_micro_batch)]

    @property
    def ranges(self) -> Skips:
        return merge_skips((e.first, e.count) for e in self.entries + self.operator)

    def skip(self, loader: PackedLoader, step: int, steps: int, reason: str, loss: float | None) -> tuple[int, int]:
        """Skip the micro-batches of logged steps step - steps + 1 .. step as `loader` assigns them now;
        recorded durably, then given to the loader. The first range, (first, count)."""
        found = [loader.skip_range(s) for s in range(max(0, step - steps), step)]
        ranges: list[tuple[int, int]] = []
        for first, count in found:  # one step's range follows the last: one entry
            if ranges and ranges[-1][0] + ranges[-1][1] == first:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + count)
            else:
                ranges.append((first, count))
        self.entries += [self._entry(first, count, reason, step, loss) for first, count in ranges]
        self._write()
        loader.skips = merge_skips(loader.skips, self.ranges)
        return ranges[0]

    def adopt(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Ranges a checkpoint carried (from another host, say) that this ledger lacks."""
        known = {(e.first, e.count) for e in self.entries}
        new = [self._entry(first, count, "unknown") for first, count in merge_skips(ranges) if (first, count) not in known]
        if new:
            self.entries += new
            self._write()

    def recent(self, step: int, window: int) -> int:
        """Rollbacks recorded within `window` steps before `step`."""
        return sum(1 for e in self.entries if e.step is not None and e.reason in ("spike", "nonfinite")
                   and step - e.step < window)

    def summary(self) -> dict:
        """What status shows: the entries, and the samples left out in all."""
        every = self.entries + self.operator
        return {"ranges": len(every), "samples": sum(e.samples[1] for e in every),
                "entries": [e.to_json() for e in every]}

    def _entry(self, first: int, count: int, reason: str, step: int | None = None,
               loss: float | None = None) -> Skipped:
        samples = (first * self.per_micro_batch, count * self.per_micro_batch)
        return Skipped(first, count, samples, reason, step, loss, time.time() if step is not None else None)

    def _now(self, entry: Skipped) -> Skipped:
        """The entry in micro-batches of this ledger's size, from its samples (geometry-independent)."""
        first, count = entry.samples
        if (first, count) == (entry.first * self.per_micro_batch, entry.count * self.per_micro_batch):
            return entry
        (mb_first, mb_count), = sample_ranges_to_micro_batches([(first, count)], self.per_micro_batch)
        return replace(entry, first=mb_first, count=mb_count)

    def _read(self) -> list[Skipped]:
        try:
            data = json.loads(read_regular_file(self.path, MAX_BYTES))
            if "entries" not in data:
                return [self._entry(first, count, "unknown") for first, count in merge_skips(data["skips"])]
            entries = []
            for e in data["entries"]:
                loss = e.get("loss")
                entries.append(Skipped(int(e["first"]), int(e["count"]), (int(e["samples"][0]), int(e["samples"][1])),
                                       str(e["reason"]), e.get("step"), None if loss is None else float(loss),
                                       e.get("unix")))
            return entries
        except FileNotFoundError:
            return []
        except (OSError, Refused, ValueError, KeyError, TypeError, IndexError) as e:
            # Damaged: set aside rather than stop the job. The checkpoints' manifests carry the ranges
            # (adopt), so what is lost is their reasons.
            import structlog  # here: `tpud checkpoints` reads ledgers without structlog's imports

            aside = self.path.with_name(self.path.name + ".damaged")
            structlog.get_logger().error("the skip ledger is damaged; set aside", path=str(self.path), aside=str(aside), error=str(e))
            with contextlib.suppress(OSError):
                self.path.replace(aside)
            return []

    def _write(self) -> None:
        ranges = merge_skips((e.first, e.count) for e in self.entries)
        atomic_write(self.path, json.dumps({"format": FORMAT, "skips": [list(s) for s in ranges],
                                            "entries": [e.to_json() for e in self.entries]}))


def summary_of(path: Path) -> dict | None:
    """The ledger as `tpud status` shows it, read by the daemon: how many ranges, how many samples,
    and the newest entry; None without one, or when it cannot be read (the worker sets a damaged
    one aside; the daemon never touches it)."""
    try:
        data = json.loads(read_regular_file(path, MAX_BYTES))
        entries = [e for e in data.get("entries", []) if isinstance(e, dict)]
        samples = sum(int(e["samples"][1]) for e in entries)
    except (OSError, Refused, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    last = entries[-1] if entries else None
    return {"ranges": len(entries), "samples": samples,
            "last": None if last is None else {k: last.get(k) for k in ("reason", "step", "samples", "loss")}}

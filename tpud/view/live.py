"""`tpud run` on a terminal: the job's panel redrawn in place under the log, which shows only
warnings and errors (the worker's and the supervisor's); a summary when the run ends.

The daemon's loop owns it: `relay` takes the worker's JSON lines (the panel already shows what
the step lines say), `update` redraws from the job's snapshot at most REFRESH_HZ times a
second, `close` prints the summary. Nothing here runs on another thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tpud.view import summary
from tpud.view.format import age, duration, percent, rate
from tpud.view.status import device_line, useful_mfu

REFRESH_HZ = 4
SHOWN_LEVELS = ("warning", "error", "critical")
STYLES = {"warning": "yellow", "error": "bold red", "critical": "bold red"}


class LiveView:
    def __init__(self, job_file: str, console: Console | None = None, clock: Callable[[], float] = time.monotonic):
        self.console = console or Console()
        self.job_file, self.clock = job_file, clock
        self.started = clock()
        self.history = summary.History()
        self._snapshot: dict = {}
        self._drawn_at = 0.0
        self._partial = b""
        self.metrics_address: str | None = None  # the supervisor's Prometheus listener, once serving
        # stdout is redirected through the display, so the supervisor's own log lines print above it.
        self.live = Live(console=self.console, auto_refresh=False, redirect_stdout=True, redirect_stderr=True)

    def start(self) -> None:
        self.live.start()

    # --- the log ---

    def relay(self, chunk: bytes) -> None:
        """The worker's output: its warnings and errors scroll above the panel; lines that are not
        JSON (a traceback, a native library's message) too."""
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self._partial = self._partial[-65536:]
        shown: list[Text] = []
        for raw in lines:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                shown.append(Text(line))
                continue
            self.history.record(record)
            if record.get("level") in SHOWN_LEVELS:
                shown.append(log_line(record))
        if shown:  # one print: the panel is redrawn once per chunk, not per line, however chatty the worker
            self.console.print(Text("\n").join(shown))

    # --- the panel ---

    def update(self, snapshot: Callable[[], dict], force: bool = False) -> None:
        """Redraw from snapshot() (the job's, taken only when a redraw is due)."""
        now = self.clock()
        if force or now - self._drawn_at >= 1 / REFRESH_HZ:
            self._drawn_at = now
            self._snapshot = snapshot()
            self.history.loss(self._snapshot.get("loss"))
            self.live.update(self.panel(self._snapshot, now - self.started), refresh=True)

    def panel(self, job: dict, elapsed: float) -> Group:
        step, max_steps = job.get("step") or 0, job.get("max_steps") or 0
        head = Table.grid(padding=(0, 2))
        head.add_row(Text(str(job.get("name", "?")), style="bold"), Text(str(job.get("state", "-")), style="cyan"),
                     Text(f"step {step}/{max_steps}"),
                     ProgressBar(total=max(max_steps, 1), completed=step, width=40),
                     Text(percent(step / max_steps if max_steps else None)))
        eval_loss = job.get("eval_loss")
        best = self.history.best_loss
        lines = [
            f"loss {_num(job.get('loss'))}" + ("" if best is None else f" (best {best:.4g})")
            + f"   val loss {_num(eval_loss)}" + ("" if eval_loss is None else f" @{job.get('eval_step')}")
            + f"   tokens/s {rate(job.get('tokens_per_second'))}   MFU {percent(job.get('mfu'))}",
            f"elapsed {duration(elapsed)}   remaining {duration(remaining(job))}   "
            f"restarts {job.get('restarts', 0)}   goodput {percent((job.get('goodput') or {}).get('ratio'))}"
            f"   useful MFU {percent(useful_mfu(job))}",
            "checkpoints  " + "   ".join(
                f"{tier} {c['step']} ({age(c.get('age_seconds'))} ago)" if c else f"{tier} -"
                for tier, c in tiers(job).items()),
        ]
        if device := job.get("device"):
            lines.append(device_line(device))
        if self.metrics_address:
            lines.append(f"metrics      http://{self.metrics_address}/metrics")
        return Group(head, *(Text(line) for line in lines))

    def close(self, snapshot: Callable[[], dict] | None, exit_status: int | None) -> None:
        """Stop redrawing, leave the last panel on screen, and print the summary."""
        if snapshot is not None:
            self.update(snapshot, force=True)
        self.live.stop()
        if self._snapshot:
            self.console.print(summary.render(self._snapshot, self.history, self.clock() - self.started,
                                              self.job_file, exit_status))


def tiers(job: dict) -> dict[str, dict | None]:
    """The newest checkpoint on each tier the job has (local always; memory and GCS when seen)."""
    seen = job.get("checkpoints") or {}
    return {"local": seen.get("local"), **{t: seen[t] for t in ("memory", "gcs") if t in seen}}


def remaining(job: dict) -> float | None:
    step, max_steps, step_time = job.get("step"), job.get("max_steps"), job.get("step_time_s")
    if step is None or not max_steps or not step_time:
        return None
    return max(0, max_steps - step) * step_time


def log_line(record: dict) -> Text:
    """A JSON log record as one console line: time, level, event, then its fields."""
    level = str(record.get("level", ""))
    stamp = str(record.get("timestamp", ""))[11:19]
    fields = " ".join(f"{k}={v}" for k, v in record.items() if k not in ("event", "level", "timestamp"))
    text = Text(f"{stamp} ")
    text.append(f"{level:<7}", style=STYLES.get(level, ""))
    text.append(f" {record.get('event', '')}", style="bold")
    if fields:
        text.append(f"  {fields}")
    return text


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"

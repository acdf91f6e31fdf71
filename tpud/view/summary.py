"""What `tpud run` prints when the job ends: how far it got, what it cost, what went wrong, and
where its newest checkpoints are (with the commands that resume or export them)."""

from __future__ import annotations

import shlex

from rich.table import Table
from rich.text import Text

from tpud.view.format import age, duration, percent


class History:
    """What the end needs and a snapshot does not keep: the best losses, the tokens trained."""

    def __init__(self):
        self.best_loss: float | None = None
        self.best_eval_loss: float | None = None
        self.final_loss: float | None = None
        self.tokens = 0.0
        self.resumed_from: int | None = None  # the step the run's first worker restored
        self._last_step: int | None = None

    def record(self, record: dict) -> None:
        """A worker's log record (its step, eval and restore lines)."""
        try:
            event = record.get("event")
            if event == "step":
                step = int(record["step"])
                self.loss(float(record["loss"]))
                # A line stands for the steps since the last one (log_interval), or since a restore.
                done = max(0, step - (self._last_step or 0))
                self.tokens += float(record["tokens_per_s"]) * float(record["step_time_s"]) * done
                self._last_step = step
            elif event == "eval":
                loss = float(record["eval_loss"])
                if self.best_eval_loss is None or loss < self.best_eval_loss:
                    self.best_eval_loss = loss
            elif event == "checkpoint restored":
                if self.resumed_from is None and self._last_step is None:
                    self.resumed_from = int(record["step"])
                self._last_step = int(record["step"])  # a restart redoes the steps after it
        except (KeyError, TypeError, ValueError):
            pass  # a record of another shape: nothing to learn from it

    def loss(self, loss: float | None) -> None:
        if loss is None:
            return
        self.final_loss = loss
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss = loss


def render(job: dict, history: History, wall_s: float, job_file: str, exit_status: int | None) -> Table:
    job_file = shlex.quote(job_file)  # the commands below are for pasting into a shell
    name, step, max_steps = job.get("name", "?"), job.get("step"), job.get("max_steps")
    goodput = job.get("goodput") or {}
    badput = {k: v for k, v in (goodput.get("badput_seconds") or {}).items() if v >= 0.05}
    out = Table.grid(padding=(0, 2))
    out.add_column(style="bold")
    out.add_column()
    out.add_row("job", f"{name}: {job.get('state', '-')}"
                + ("" if exit_status is None else f" (exit {exit_status})"))
    trained = "" if step is None else f", {step - (history.resumed_from or 0)} in this run"
    out.add_row("steps", f"{step if step is not None else '-'}/{max_steps if max_steps is not None else '-'}{trained}")
    out.add_row("tokens", f"{history.tokens:,.0f} in this run")
    out.add_row("wall time", duration(wall_s))
    out.add_row("loss", f"final {_num(job.get('loss') or history.final_loss)}, best {_num(history.best_loss)}")
    if job.get("eval_loss") is not None:
        out.add_row("val loss", f"final {_num(job.get('eval_loss'))} at step {job.get('eval_step')}, "
                                f"best {_num(history.best_eval_loss)}")
    out.add_row("goodput", percent(goodput.get("ratio"))
                + ("" if not badput else "; badput " + ", ".join(f"{k} {v:.1f}s" for k, v in
                                                                 sorted(badput.items(), key=lambda kv: -kv[1]))))
    reasons = job.get("restart_reasons") or {}
    out.add_row("restarts", str(job.get("restarts", 0))
                + ("" if not reasons else " (this run: " + ", ".join(f"{k} {n}" for k, n in sorted(reasons.items())) + ")"))
    if job.get("error"):
        out.add_row("error", Text(str(job["error"]).splitlines()[0], style="red"))
    checkpoints = job.get("checkpoints") or {}
    for tier in ("local", "memory", "gcs"):
        if c := checkpoints.get(tier):
            out.add_row(f"checkpoint ({tier})", f"step {c['step']}, {age(c.get('age_seconds'))} ago")
    if any(t in checkpoints for t in ("local", "gcs")):
        if job.get("state") != "SUCCEEDED":
            out.add_row("resume", f"tpud run {job_file}")
        out.add_row("export", f"tpud export {job_file} OUT_DIR"
                    + (" --tier gcs" if "local" not in checkpoints else ""))
    elif not checkpoints:
        out.add_row("checkpoint", "none committed in this run")
    return out


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"

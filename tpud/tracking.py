"""Weights & Biases logging for one job, owned by the daemon (torch-free; wandb imported lazily),
and beside it TensorBoard's (logging.tensorboard: tpud/tensorboard_log.py), under the same tags.

Design (logging.wandb in the job spec):
- Only the daemon logs, from the host-side scalars of the worker's `step` events (rank 0's
  stream). Values must be plain ints/floats: anything else (a string, a tensor) is dropped here,
  so a device tensor can never reach wandb.
- One run id per job (`new_run_id()`), created once and kept in the job state and the checkpoint
  manifest. Every WandbRun opens it with resume="allow", so worker restarts (one WandbRun spans
  them), daemon restarts and another host resuming from GCS all continue the same run.
- wandb's step is monotonic: after a rollback the engine's steps go back, wandb's do not.
  wandb step = max(last_step + 1, engine step); the engine's step is logged as "train/step",
  which define_metric makes the x-axis of the train/, perf/ and memory/ charts.
- Every wandb call runs on the WandbRun's own thread, behind a bounded queue: a slow network,
  a slow import or a stuck wandb.init never blocks the daemon's loop, and wandb errors are
  logged, never raised. A failed init is retried with backoff on later rows (rows that arrive
  meanwhile are dropped: the metrics are a view, the checkpoints are the truth).
- Several jobs' runs live in one process: reinit="create_new", and only the run object that
  init returns is used (never the global wandb.log / wandb.run).

Offline mode writes <directory>/wandb/offline-run-<time>-<id>/run-<id>.wandb, one directory per
WandbRun; `wandb sync` uploads the directories of one run id in order into the one run.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from engine import events
from tpud.tensorboard_log import TensorBoardLog

if TYPE_CHECKING:
    from engine.spec.schema import WandbConfig

log = structlog.get_logger()

# Engine `step` event keys -> wandb metric names. Keys not listed are logged as "train/<key>".
METRIC_NAMES = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "rss_bytes": "memory/host_rss_bytes",
    "device_memory_bytes": "memory/device_bytes",
    "device_memory_in_use_bytes": "memory/device_in_use_bytes",
    "compilations": "compile/graphs",
    "compile_seconds": "compile/seconds",
    "eval_loss": "eval/loss",
    "aux_loss": "moe/aux_loss",
    "z_loss": "moe/z_loss",
    "expert_load_max": "moe/expert_load_max",
    "expert_load_cv": "moe/expert_load_cv",
    "dropped_fraction": "moe/dropped_fraction",
    "distill_divergence": "distill/divergence",
    "distill_ce": "distill/hard_ce",
    "distill_hidden": "distill/hidden",
    "eval_perplexity": "eval/perplexity",
}
ENGINE_STEP = "train/step"
_PREFIXES = ("train/*", "perf/*", "memory/*", "compile/*", "eval/*", "moe/*", "distill/*")
# Event fields that are not metrics: the step comes as log()'s own argument.
_NOT_METRICS = frozenset({"step", "type", "event"})

MAX_QUEUED = 10_000          # rows; ~3 h of steps at 1/s before rows are dropped while wandb is stuck
RETRY_INITIAL_S = 30.0       # a failed wandb.init is retried with the next row after this, doubling
RETRY_MAXIMUM_S = 900.0
# wandb.init's own limit (its default is 90 s). Online only: offline init never touches the network.
INIT_TIMEOUT_S = 90.0
# Bounds run.finish()'s upload wait, and wandb's atexit teardown, which would otherwise wait for
# every byte to upload and could hold up the daemon's exit on a dead network. Data not uploaded
# by then stays in the run directory for `wandb sync`.
FINISH_TIMEOUT_S = 60.0


def new_run_id() -> str:
    """A wandb-compatible run id: 8 characters of [a-z0-9], like wandb's own generate_id()."""
    import secrets
    import string

    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def metric_name(key: str) -> str:
    return METRIC_NAMES.get(key) or f"train/{key}"


def _is_scalar(value: object) -> bool:
    # bool is an int subclass but not a metric; everything that is not a host number is dropped.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class WandbRun:
    """One job's wandb run. wandb calls happen on this object's own thread: a slow network or wandb
    itself never blocks the daemon's loop; errors are logged (structlog), never raised into the daemon."""

    def __init__(self, cfg: WandbConfig, *, job: str, run_id: str, directory: Path, config: dict,
                 last_step: int = 0, init_timeout: float = INIT_TIMEOUT_S):
        """last_step: the highest wandb step logged before (job state), so a daemon restart goes on after it."""
        self.cfg = cfg
        self.job = job
        self.run_id = run_id
        self.directory = Path(directory)
        self._config = dict(config)
        self._init_timeout = init_timeout
        self._cond = threading.Condition()
        self._rows: deque[tuple[int, int, dict[str, float | int]]] = deque()
        self._last_step = int(last_step)
        self._closing = False
        self._exit_code: int | None = None
        self._dropped = 0            # rows dropped because the queue was full
        self._thread = threading.Thread(target=self._main, name=f"wandb-{job}", daemon=True)
        self._thread.start()

    # --- the daemon's side: never blocks on wandb ---

    def log(self, scalars: dict[str, float | int | None], step: int) -> None:
        """Queue one step's scalars; `step` is the engine's optimizer step. None and non-numbers are skipped."""
        values = {metric_name(k): v for k, v in scalars.items() if k not in _NOT_METRICS and _is_scalar(v)}
        with self._cond:
            if self._closing:
                return
            if len(self._rows) >= MAX_QUEUED:
                # wandb is stuck (init or network): drop the new row, warn once per episode.
                if self._dropped == 0:
                    log.warning("wandb queue full, dropping rows", job=self.job, queued=len(self._rows))
                self._dropped += 1
                return
            self._dropped = 0
            wandb_step = max(self._last_step + 1, int(step))
            self._last_step = wandb_step
            self._rows.append((wandb_step, int(step), values))
            self._cond.notify()

    @property
    def last_step(self) -> int:
        """The highest wandb step handed to log() (or, online, the step the resumed run was already at)."""
        with self._cond:
            return self._last_step

    def close(self, timeout: float = 30.0, *, exit_code: int | None = None) -> None:
        """Flush the queued rows and finish the run, waiting at most `timeout` seconds. Past that the
        thread goes on in the background (daemon thread); nothing is raised. exit_code != 0 marks the
        run failed in wandb. Calling close() again just waits again."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._exit_code = exit_code
                self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("wandb did not finish in time, leaving it in the background", job=self.job,
                        timeout=timeout)

    # --- the wandb thread ---

    def _main(self) -> None:
        try:
            self._serve()
        except Exception:  # a bug here must not pass silently, nor reach the daemon
            log.exception("wandb thread failed, not logging", job=self.job)
            self._discard()

    def _serve(self) -> None:
        try:
            # Before wandb's first setup in this process, which snapshots the environment:
            # silent means no banners in the daemon's journal and never an interactive login
            # prompt (wandb only prompts when not silent and on a terminal).
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb
        except Exception as e:
            log.error("wandb import failed, not logging", job=self.job, error=repr(e))
            self._discard()
            return
        run = self._init(wandb)
        retry_s, retry_at = RETRY_INITIAL_S, time.monotonic() + RETRY_INITIAL_S
        # Online, a resumed run knows its own next step (another host, or a lost job state):
        # rows below it would be dropped by wandb, so they are moved up to it.
        floor = self._next_step(run)
        while True:
            with self._cond:
                while not self._rows and not self._closing:
                    self._cond.wait()
                if not self._rows:
                    break
                wandb_step, engine_step, values = self._rows.popleft()
                closing = self._closing
            # No new init attempt once closing: it could outlast close()'s timeout for rows being dropped.
            if run is None and not closing and time.monotonic() >= retry_at:
                run = self._init(wandb)
                retry_s = min(retry_s * 2, RETRY_MAXIMUM_S)
                retry_at = time.monotonic() + retry_s
                floor = self._next_step(run)
            if run is None:
                continue
            wandb_step = max(wandb_step, floor)
            try:
                run.log({ENGINE_STEP: engine_step, **values}, step=wandb_step)
            except Exception as e:
                log.warning("wandb log failed", job=self.job, step=wandb_step, error=repr(e))
            floor = wandb_step + 1
            with self._cond:
                self._last_step = max(self._last_step, wandb_step)
        if run is not None:
            try:
                run.finish(exit_code=self._exit_code)
            except Exception as e:
                log.warning("wandb finish failed", job=self.job, error=repr(e))

    def _init(self, wandb: Any) -> Any:
        """wandb.init for this job's run id, or None (logged) when it fails."""
        cfg = self.cfg
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            settings = wandb.Settings(
                console="off",                # never capture (wrap) the daemon's own stdout/stderr
                x_disable_stats=True,         # no system-metrics sampler: the daemon is not the training
                x_disable_meta=True,          # no metadata about the daemon process (args, host, git, ...)
                x_disable_machine_info=True,  # and no probing of the accelerators from the daemon
                disable_git=True,
                save_code=False,
                x_save_requirements=False,    # the daemon's pip freeze says nothing about the run
                silent=True,
                init_timeout=self._init_timeout,
                finish_timeout=FINISH_TIMEOUT_S,
            )
            run = wandb.init(
                id=self.run_id, resume="allow", project=cfg.project, entity=cfg.entity,
                name=cfg.name or self.job, group=cfg.group, tags=list(cfg.tags) or None, job_type="train",
                config=self._config, dir=str(self.directory), mode=cfg.mode,
                reinit="create_new",          # several jobs' runs in one daemon, each its own object
                settings=settings,
            )
            run.define_metric(ENGINE_STEP)
            for prefix in _PREFIXES:
                run.define_metric(prefix, step_metric=ENGINE_STEP)
        except Exception as e:
            log.warning("wandb init failed, rows are dropped until a retry succeeds", job=self.job,
                        run_id=self.run_id, mode=cfg.mode, error=repr(e))
            return None
        log.info("wandb run started", job=self.job, run_id=self.run_id, mode=cfg.mode, dir=str(self.directory))
        return run

    def _next_step(self, run: Any) -> int:
        if run is None:
            return 0
        try:
            return int(run.step)
        except Exception as e:
            log.warning("wandb run.step failed", job=self.job, error=repr(e))
            return 0

    def _discard(self) -> None:
        """Give up on wandb for this WandbRun: later log() calls return at once."""
        with self._cond:
            self._closing = True
            self._rows.clear()


class JobTracker:
    """The wandb side of one job: one run whatever restarts, whose steps never go back; and its
    TensorBoard event files.

    The run id is created once per job and kept in job.json and in every checkpoint manifest,
    so a restart, a daemon restart or another host continues the same run. Only the host of
    rank 0 logs.
    """

    def __init__(self, cfg: WandbConfig | None, *, job: str, directory: Path, saved: dict,
                 newest_run_id: Callable[[], str | None], config: Callable[[], dict] = dict,
                 tensorboard: str | None = None, goodput: Callable[[], dict] = dict):
        """saved: the job record's {run_id, step}; newest_run_id(): the run id in the newest local checkpoint;
        config(): the job's spec as plain data, for a run that starts; tensorboard: logging.tensorboard;
        goodput(): the job's goodput snapshot (tpud/job/goodput.py), logged to TensorBoard with each step."""
        self.cfg, self.job, self.directory, self.config = cfg, job, directory, config
        self.tensorboard, self.goodput = tensorboard, goodput
        self.board: TensorBoardLog | None = None
        self._run_id: str | None = saved.get("run_id")
        self.step: int = saved.get("step", 0)
        self._newest_run_id = newest_run_id
        self.run: WandbRun | None = None
        self.rank = 0  # the worker's: one wandb logger per job, the host of rank 0

    def run_id(self) -> str:
        if self._run_id is None:
            self._run_id = self._newest_run_id() or new_run_id()
        return self._run_id

    def worker_env(self) -> dict[str, str]:
        """The run id for the worker's checkpoint manifests, when the job logs to wandb."""
        return {} if self.cfg is None else {"TPUD_WANDB_RUN_ID": self.run_id()}

    def log(self, event: events.Step, config: Callable[[], dict]) -> None:
        """A step event; config() is the job's spec as plain data, for a run that starts now."""
        if self.cfg is None:
            return
        if self.run is None:
            self.run = WandbRun(self.cfg, job=self.job, run_id=self.run_id(), directory=self.directory,
                                config=config(), last_step=self.step)
        self.run.log({k: getattr(event, k) for k in events.STEP_SCALARS}, step=event.step)
        self.step = self.run.last_step

    def log_eval(self, event: events.Eval) -> None:
        """A validation loss, plotted against the engine step like the step's scalars."""
        if self.run is not None:
            self.run.log({"eval_loss": event.loss, "eval_perplexity": event.perplexity}, step=event.step)
            self.step = self.run.last_step

    # --- the worker's events (tpud/job/routing.py) ---

    def on_hello(self, event: events.Hello) -> None:
        self.rank = event.rank

    def on_gang(self, event: events.Gang) -> None:
        """A gang formed: its first member logs (host 0, unless the gang formed without it)."""
        if event.members:
            self.rank = event.members.index(event.host) if event.host in event.members else -1

    def on_step(self, event: events.Step) -> None:
        if self.rank == 0:
            self.log(event, self.config)
            if (board := self._board()) is not None:
                scalars = {metric_name(k): v for k in events.STEP_SCALARS if _is_scalar(v := getattr(event, k))}
                goodput = self.goodput()
                scalars.update({f"goodput/badput_{kind}_seconds": v for kind, v in goodput.get("badput_seconds", {}).items()})
                if _is_scalar(goodput.get("ratio")):
                    scalars["goodput/ratio"] = goodput["ratio"]
                board.scalars(scalars, event.step)

    def on_eval(self, event: events.Eval) -> None:
        if self.rank == 0:
            self.log_eval(event)
            if (board := self._board()) is not None:
                board.scalars({"eval/loss": event.loss, "eval/perplexity": event.perplexity}, event.step)

    def on_started(self, event: events.Started) -> None:
        """A worker's loop begins at this step: TensorBoard forgets what was logged after it."""
        if self.rank == 0 and (board := self._board()) is not None:
            board.begins_at(event.step)

    def on_rolled_back(self, event: events.RolledBack) -> None:
        if self.rank == 0 and (board := self._board()) is not None:
            board.begins_at(event.restored_step)

    def _board(self) -> TensorBoardLog | None:
        if self.board is None and self.tensorboard is not None:
            self.board = TensorBoardLog(self.tensorboard, self.job, self.directory / "tensorboard")
        return self.board

    def adopt(self, cfg: WandbConfig | None, tensorboard: str | None) -> None:
        """The job file changed: a TensorBoard directory of its own from now on."""
        self.cfg = cfg
        if tensorboard != self.tensorboard:
            if self.board is not None:
                threading.Thread(target=self.board.close, name=f"tensorboard-{self.job}", daemon=True).start()
            self.board, self.tensorboard = None, tensorboard

    def finish_in_background(self) -> None:
        """The job ended: finish the run and the event files without waiting (a restart resumes them)."""
        for sink, name in ((self.run, "wandb"), (self.board, "tensorboard")):
            if sink is not None:
                threading.Thread(target=sink.close, name=f"{name}-{self.job}", daemon=True).start()
        self.run = self.board = None

    def close(self, timeout: float) -> None:
        for sink in (self.run, self.board):
            if sink is not None:
                sink.close(timeout)
        self.run = self.board = None

    def to_dict(self) -> dict:
        return {"run_id": self._run_id, "step": self.step}

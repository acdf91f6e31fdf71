"""TensorBoard event files for one job, written by the daemon (logging.tensorboard).

Torch-free: tensorboard's own event writer and protocol buffers, no TensorFlow, no torch (the
daemon never imports torch; tensorboardX would).

- `logging.tensorboard: DIR` writes DIR/<job>/events.out.tfevents.*: the job is TensorBoard's
  run. With `gs://bucket/prefix` the files are written under the job's state directory
  (`<state>/jobs/<job>/tensorboard/`) and each one is uploaded whole to gs://bucket/prefix/<job>/
  after it changes, at most every UPLOAD_EVERY_S and when the job's run ends (event files are
  appended to; GCS objects are not).
- The scalars are the wandb run's, under the same tags (tpud/tracking.py): train/, perf/,
  memory/, compile/, eval/, moe/, and goodput/ (the ratio, and each badput kind's seconds).
- Steps never go backward on screen: when a worker starts at step S (after a restore, or from
  nothing after a crash) or a rollback in place goes back to step S, a new event file begins with
  a SessionLog START at step S + 1, from which TensorBoard purges what was logged at S + 1 and
  later before it (its purge of orphaned data).
- The daemon's loop only queues; one thread writes. Past MAX_QUEUED rows the newest are dropped,
  warned once (the metrics are a view; the checkpoints are the truth). Errors are logged, never
  raised into the daemon.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path

import structlog

log = structlog.get_logger()

MAX_QUEUED = 10_000
UPLOAD_EVERY_S = 30.0


class TensorBoardLog:
    def __init__(self, directory: str, job: str, staging: Path):
        """directory: logging.tensorboard; staging: where a gs:// directory's files are written first."""
        self.job = job
        self.remote = directory.rstrip("/") + f"/{job}" if directory.startswith("gs://") else None
        self.local = staging if self.remote else Path(directory) / job
        self._rows: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._dropped = 0
        self._sizes: dict[str, int] = {}  # each event file's size at its last upload
        self._thread = threading.Thread(target=self._main, name=f"tensorboard-{job}", daemon=True)
        self._thread.start()

    # --- the daemon's side: never blocks ---

    def scalars(self, values: dict[str, float | int], step: int) -> None:
        self._queue(("scalars", step, values, time.time()))

    def begins_at(self, step: int) -> None:
        """Training goes on from `step` (its state restored, or from nothing): what was logged after it is purged."""
        self._queue(("begin", step, None, time.time()))

    def _queue(self, row: tuple) -> None:
        with self._cond:
            if self._closing:
                return
            if len(self._rows) >= MAX_QUEUED:
                if self._dropped == 0:
                    log.warning("tensorboard queue full, dropping rows", job=self.job, queued=len(self._rows))
                self._dropped += 1
                return
            self._dropped = 0
            self._rows.append(row)
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, upload, and end the thread, waiting at most `timeout` seconds."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tensorboard did not finish in time, leaving it in the background", job=self.job)

    # --- the writer thread ---

    def _main(self) -> None:
        writer, uploaded_at = None, time.monotonic()
        while True:
            with self._cond:
                while not self._rows and not self._closing:
                    self._cond.wait(UPLOAD_EVERY_S if self.remote else None)
                rows, closing = list(self._rows), self._closing
                self._rows.clear()
            try:
                writer = self._write(writer, rows)
                if self.remote and (closing or time.monotonic() - uploaded_at >= UPLOAD_EVERY_S):
                    self._upload()
                    uploaded_at = time.monotonic()
            except Exception as e:  # a full disk, a lost bucket: the view suffers, never the daemon
                log.warning("tensorboard write failed", job=self.job, error=repr(e))
            if closing:
                if writer is not None:
                    writer.close()
                return

    def _write(self, writer, rows: list[tuple]):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        for kind, step, values, wall in rows:
            if kind == "begin":
                if writer is not None:
                    writer.close()
                self.local.mkdir(parents=True, exist_ok=True)
                writer = EventFileWriter(str(self.local))
                writer.add_event(Event(wall_time=wall, step=step + 1, session_log=SessionLog(status=SessionLog.START)))
                continue
            if writer is None:
                self.local.mkdir(parents=True, exist_ok=True)
                writer = EventFileWriter(str(self.local))
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
            writer.add_event(Event(wall_time=wall, step=step, summary=summary))
        if writer is not None and rows:
            writer.flush()
        return writer

    def _upload(self) -> None:
        """Every event file changed since its last upload, whole, to the job's gs:// directory."""
        from tpud.gcs.tier import make_client, parse_remote

        bucket_name, prefix = parse_remote(self.remote)
        bucket = make_client().bucket(bucket_name)
        for path in sorted(self.local.glob("events.out.tfevents.*")):
            size = path.stat().st_size
            if self._sizes.get(path.name) != size:
                bucket.blob(f"{prefix}/{path.name}").upload_from_filename(str(path))
                self._sizes[path.name] = size

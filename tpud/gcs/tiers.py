"""The supervisor's side of a job's checkpoints: the GCS tier beside the worker's local one.

It lives in the daemon rather than in the worker so that an upload outlives a worker crash.
It also hands each worker the disruption rate its auto intervals assume, the rate the GCS
tier's own auto interval follows too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from engine import events
from engine.checkpoint import manifest as mf
from engine.checkpoint.policy import Interval, SecondsPolicy
from engine.spec.schema import JobSpec
from tpud.gcs.tier import GcsTier, Transfer
from tpud.gcs.uploader import Key, Uploader, ensure_newest_local
from tpud.paths import Paths


class CheckpointTiers:
    """The GCS tier of one job, when it has one: its uploader, and the download before a start."""

    def __init__(self, spec: JobSpec, paths: Paths,
                 on_upload: Callable[[Key, Transfer | None, str | None, Interval | None], None], *,
                 uploads: Callable[[], bool] = lambda: True):
        """on_upload(key, transfer, error, policy) after each upload attempt, from the uploader's
        thread: transfer None and the uploader's error when the attempt failed; policy, the auto
        interval now in force (None unless remote_interval_seconds is auto).

        `uploads()`, asked at each commit: whether this host uploads it. Every host's part of a
        multi-host job restores the whole replicated state, so one host uploads it (the gang's
        first member: tpud.job.gang.GangView.uploads); every host downloads.
        """
        self.paths, self.on_upload, self.uploads = paths, on_upload, uploads
        self.local_job_dir = paths.layout.checkpoints(spec.name, spec.checkpoint.dir)
        self.remote, self.keep = spec.checkpoint.remote, spec.checkpoint.keep
        self.tier = GcsTier.for_spec(spec)
        self.uploader = (Uploader(self.tier, self.local_job_dir, spec.checkpoint.keep, interval=self._interval(spec),
                                  on_result=lambda key, transfer: on_upload(key, transfer, self._error(transfer),
                                                                           self.policy()))
                         if self.tier else None)

    @staticmethod
    def _interval(spec: JobSpec, old: float | SecondsPolicy | None = None) -> float | SecondsPolicy:
        """The uploader's interval for `spec`; an auto one it had keeps what it measured."""
        ckpt = spec.checkpoint
        if ckpt.remote_interval_seconds != "auto":
            return ckpt.remote_interval_seconds
        if isinstance(old, SecondsPolicy):
            old.max_seconds, old.max_overhead = ckpt.max_interval_seconds, ckpt.max_overhead
            return old
        return SecondsPolicy(ckpt.disruptions_per_hour, max_seconds=ckpt.max_interval_seconds,
                             max_overhead=ckpt.max_overhead)

    def adopt(self, spec: JobSpec) -> CheckpointTiers:
        """The tiers of the job's new spec: these, or new ones when the GCS tier changed."""
        if spec.checkpoint.remote == self.remote and spec.checkpoint.keep == self.keep:
            if self.uploader is not None:
                self.uploader.interval = self._interval(spec, self.uploader.interval)
            return self
        # The old uploader finishes its upload in flight in the background, then stops.
        threading.Thread(target=self.close, name=f"close-uploads-{spec.name}", daemon=True).start()
        return CheckpointTiers(spec, self.paths, self.on_upload, uploads=self.uploads)

    @staticmethod
    def names(spec: JobSpec) -> list[str]:
        """The tiers a job's checkpoints go to."""
        return ["local"] + ["memory"] * (spec.checkpoint.memory is not None) + ["gcs"] * bool(spec.checkpoint.remote)

    def worker_env(self, disruptions_per_hour: float) -> dict[str, str]:
        """The rate the next worker's auto intervals assume (tpud.job.health.Restarts), which the
        GCS tier's auto interval follows from now on too."""
        if self.uploader is not None and isinstance(self.uploader.interval, SecondsPolicy):
            self.uploader.interval.disruptions_per_hour = disruptions_per_hour
        return {"TPUD_DISRUPTIONS_PER_HOUR": f"{disruptions_per_hour:.6g}"}

    def policy(self) -> Interval | None:
        """The GCS tier's auto interval, when it has one."""
        return None if self.uploader is None else self.uploader.policy()

    def _error(self, transfer) -> str | None:
        return None if transfer is not None else self.uploader.stats.last_error or "upload failed"

    def on_checkpoint_committed(self, event: events.CheckpointCommitted) -> None:
        # The memory tier stays on this host; another host of the gang may be the one uploading.
        if event.tier != "memory" and self.uploader is not None and self.uploads():
            self.uploader.submit(Path(event.path), urgent=event.reason != "interval")

    def newest_run_id(self) -> str | None:
        """The wandb run id in the newest local checkpoint."""
        newest = mf.committed_steps(self.local_job_dir)
        return newest[-1][2].wandb_run_id if newest else None

    def prepare(self) -> None:
        """Before a worker starts: bring the newest committed step here if only GCS has it."""
        if self.tier:
            self.local_job_dir.mkdir(parents=True, exist_ok=True)
            ensure_newest_local(self.tier, self.local_job_dir)
            if self.uploader is not None:
                self.uploader.start()

    def close(self) -> bool:
        """Wait for pending uploads; True when everything committed locally is also remote."""
        return self.uploader.close(timeout=None) if self.uploader else True

"""The supervisor's side of a job's checkpoints: the GCS tier beside the worker's local one.

It lives in the daemon rather than in the worker so that an upload outlives a worker crash.
"""

from __future__ import annotations

from engine.spec.schema import JobSpec
from tpud.checkpoints.gcs import GcsTier
from tpud.checkpoints.uploader import Uploader, ensure_newest_local
from tpud.paths import Paths


class CheckpointTiers:
    """The GCS tier of one job, when it has one: its uploader, and the download before a start."""

    def __init__(self, spec: JobSpec, paths: Paths, on_upload=None, *, uploads: bool = True):
        """on_upload(key, transfer or None) after each upload attempt, from the uploader's thread.

        `uploads` False: a host of a multi-host job other than host 0. Every host's part restores
        the whole replicated state, so one host uploads it; every host downloads.
        """
        self.local_job_dir = paths.layout.checkpoints(spec.name, spec.checkpoint.dir)
        self.keep = spec.checkpoint.keep
        self.tier = GcsTier.for_spec(spec)
        self.uploader = (Uploader(self.tier, self.local_job_dir, spec.checkpoint.keep, on_result=on_upload)
                         if self.tier and uploads else None)

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

"""What `tpud status` and the metrics read of a job: one dict gathered from the parts that own
each figure (the worker's report, the restarts, the checkpoints, the goodput ledger, the gang)."""

from __future__ import annotations

import time


def snapshot(job) -> dict:
    """job: a tpud.job.job.Job (not imported: it imports this)."""
    first, spec = job.record.first_started, job.spec
    return {
        "name": job.name, "state": job.state.value, "file": str(job.file),
        "pid": None if job.worker is None else job.worker.pid,
        "pids": [process.pid for process in job.current.processes],  # every local rank's
        **job.report.snapshot(spec.train.max_steps, spec.data.micro_batch_size),
        "restarts": job.restarts.total, "restart_reasons": dict(job.restarts.reasons),
        "error": job.error, "error_detail": job.error_detail, **job.checkpoints.snapshot(),
        "age_seconds": None if first is None else round(time.time() - first, 1),
        "goodput": job.ledger.snapshot(), "gang": job.gang.snapshot(),
    }

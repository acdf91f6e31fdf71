"""What a worker needs from GCS before it starts: the newest checkpoint (from the job's GCS
tier, when this host's disk lacks it), and the job's gs:// datasets and init_from model
(verified, shared by the host's jobs). Listing and downloading can take minutes: the job runs
`fetch` on a thread of its own, never on the loop thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.layout import StateLayout
from engine.spec.schema import JobSpec
from tpud.gcs.tiers import CheckpointTiers


def remote_urls(spec: JobSpec) -> list[str]:
    """The job's gs:// datasets and model."""
    urls = [url for url, _ in spec.data.datasets if url.startswith("gs://")]
    if (spec.model.init_from or "").startswith("gs://"):
        urls.append(spec.model.init_from)
    return urls


def fetch_in_background(tiers: CheckpointTiers, urls: list[str], spec: JobSpec, layout: StateLayout,
                        done: Callable[[tuple[str, str] | None], None]) -> None:
    """fetch() on a thread of its own, then done(its result) on that thread."""
    threading.Thread(target=lambda: done(fetch(tiers, urls, spec, layout)), name=f"prepare-{spec.name}",
                     daemon=True).start()


def fetch(tiers: CheckpointTiers, urls: list[str], spec: JobSpec, layout: StateLayout) -> tuple[str, str] | None:
    """Bring everything here; None when it is, else why not and the restart reason (an unreachable
    tier or an unprepared dataset is retried like a crash)."""
    from engine.data import remote
    from engine.hf import remote as hf_remote

    try:
        tiers.prepare()
    except Exception as e:  # noqa: BLE001
        return f"cannot prepare checkpoints: {e}", "checkpoint_tier"
    for url in urls:
        model = url == spec.model.init_from
        try:
            if model:
                hf_remote.fetch(url, layout.models())
            else:
                remote.fetch(url, layout.datasets())
        except Exception as e:  # noqa: BLE001  (unreachable, not prepared, or corrupt in transit)
            return f"cannot fetch the {'model' if model else 'dataset'} {url}: {e}", "model" if model else "dataset"
    return None

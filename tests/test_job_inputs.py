"""What a job brings from GCS before its worker starts (tpud/job/inputs.py): which URLs, and why
a start fails, with the restart reason the job books it under."""

from __future__ import annotations

from engine.layout import StateLayout
from tpud.job import inputs


class Tier:
    """The job's checkpoint tiers, as far as fetching is concerned."""

    def __init__(self, error: Exception | None = None):
        self.error, self.prepared = error, 0

    def prepare(self) -> None:
        self.prepared += 1
        if self.error:
            raise self.error


def test_only_gs_datasets_and_model_are_fetched(tiny_spec):
    assert inputs.remote_urls(tiny_spec()) == []
    spec = tiny_spec("data.dataset=gs://b/data/docs")
    assert inputs.remote_urls(spec) == ["gs://b/data/docs"]


def test_an_unreachable_tier_or_a_missing_dataset_is_named_with_its_restart_reason(tmp_path, tiny_spec, gcs_server):
    spec = tiny_spec()
    layout = StateLayout(tmp_path / "state")
    assert inputs.fetch(Tier(RuntimeError("gs://b/ckpt: 503")), ["gs://tpud-test/data/docs"], spec, layout) == (
        "cannot prepare checkpoints: gs://b/ckpt: 503", "checkpoint_tier")  # nothing fetched after that
    tier = Tier()
    error, reason = inputs.fetch(tier, ["gs://tpud-test/data/none"], spec, layout)
    assert tier.prepared == 1 and reason == "dataset" and error.startswith("cannot fetch the dataset gs://tpud-test/data/none: ")
    assert inputs.fetch(Tier(), [], spec, layout) is None

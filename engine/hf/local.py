"""A model directory named in a job (local, gs://, or a Hugging Face Hub id) as a local directory."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ConfigError
from engine.hf import hub
from engine.hf import remote as hf_remote


def local_model(value: str, cache_root: Path, key: str) -> Path:
    """The local directory of the model `value` names: itself, a verified copy of a gs:// directory
    under `cache_root` (a no-op when the daemon fetched it), or a hub id's snapshot in huggingface_hub's
    cache. ConfigError naming `key` when it cannot be had."""
    try:
        if value.startswith("gs://"):
            return hf_remote.fetch(value, cache_root)
        if hub.parse(value) is not None and not Path(value).is_absolute():
            return hub.snapshot(value)
    except (hub.HubError, hf_remote.RemoteDataError, OSError) as e:
        raise ConfigError(key, str(e)) from None
    return Path(value)

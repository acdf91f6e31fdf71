"""The daemon's own settings: tpud.yaml in the configuration directory (optional)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_METRICS_ADDR = "127.0.0.1:9477"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metrics_addr: str = Field(DEFAULT_METRICS_ADDR, description="HOST:PORT of the Prometheus listener; port 0 = any.")
    stop_budget_seconds: float = Field(
        240.0, gt=0, description="On SIGTERM: time for every job's checkpoint and pending uploads before exiting.")
    job_stop_timeout_seconds: float = Field(
        120.0, gt=0, description="A worker asked to checkpoint and stop is killed after this long.")
    rescan_seconds: float = Field(30.0, gt=0, description="Full rescan of jobs.d as a backstop to file events.")


def load_settings(config_dir: Path) -> tuple[Settings, str | None]:
    """Settings from <config>/tpud.yaml; defaults and an error message when it is invalid."""
    path = config_dir / "tpud.yaml"
    if not path.exists():
        return Settings(), None
    try:
        return Settings.model_validate(yaml.safe_load(path.read_text()) or {}), None
    except (OSError, yaml.YAMLError, ValidationError) as e:
        return Settings(), f"{path}: {e}"

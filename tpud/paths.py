"""Where tpud keeps job files, state and sockets.

Precedence: --home DIR (or $TPUD_HOME) puts jobs.d/, state/ and run/ under DIR; else
systemd's $CONFIGURATION_DIRECTORY, $STATE_DIRECTORY, $RUNTIME_DIRECTORY; else the
system paths for root and the XDG paths for an unprivileged user.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.layout import StateLayout


@dataclass(frozen=True)
class Paths:
    config: Path   # tpud.yaml and jobs.d/
    state: Path    # jobs/<name>/ (job state, XLA cache), checkpoints/
    runtime: Path  # control.sock, per-job sockets, metrics.addr

    @property
    def jobs_dir(self) -> Path:
        return self.config / "jobs.d"

    @property
    def layout(self) -> StateLayout:
        """Where each job's files are in the state directory (engine/layout.py)."""
        return StateLayout(self.state)

    def job_dir(self, job: str) -> Path:
        return self.layout.job_dir(job)

    def channel(self, job: str) -> Path:
        return self.runtime / "jobs" / f"{job}.sock"

    @classmethod
    def resolve(cls, home: str | os.PathLike | None = None) -> Paths:
        home = home or os.environ.get("TPUD_HOME")
        if home:
            root = Path(home).absolute()
            return cls(config=root, state=root / "state", runtime=root / "run")
        env = os.environ

        def first(var: str, root_default: str, user_default: Path) -> Path:
            value = env.get(var, "").split(":")[0]  # systemd may list several
            if value:
                return Path(value)
            return Path(root_default) if os.geteuid() == 0 else user_default

        xdg_state = Path(env.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "tpud"
        xdg_config = Path(env.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "tpud"
        xdg_runtime = Path(env.get("XDG_RUNTIME_DIR", xdg_state / "run")) / "tpud"
        return cls(
            config=first("CONFIGURATION_DIRECTORY", "/etc/tpud", xdg_config),
            state=first("STATE_DIRECTORY", "/var/lib/tpud", xdg_state),
            runtime=first("RUNTIME_DIRECTORY", "/run/tpud", xdg_runtime),
        )

"""Where tpud keeps job files, state and sockets.

Precedence: --home DIR (or $TPUD_HOME) puts jobs.d/, state/ and run/ under DIR; else
systemd's $CONFIGURATION_DIRECTORY, $STATE_DIRECTORY, $RUNTIME_DIRECTORY; else the
system paths for root and the XDG paths for an unprivileged user.
"""

from __future__ import annotations

import hashlib
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

    @property
    def remote_jobs(self) -> Path:
        """remote_jobs' mirror (tpud/jobfiles/remote.py): the job files of the GCS prefix, as last listed."""
        return self.state / "remote-jobs"

    def watches(self, job_file: Path) -> bool:
        """Whether the daemon runs this job file from the directories it watches (jobs.d/, or
        remote_jobs' mirror), not from `tpud run`'s command line."""
        return job_file.parent in (self.jobs_dir, self.remote_jobs)

    def job_dir(self, job: str) -> Path:
        return self.layout.job_dir(job)

    def channel(self, job: str) -> Path:
        return self.runtime / "jobs" / f"{job}.sock"

    @property
    def memory(self) -> Path:
        """The memory tier's root: the runtime directory's memory/ when it is a tmpfs (systemd's
        /run/tpud), else a directory of this runtime's own in /dev/shm. Either way its states
        survive a worker, not the host."""
        if _on_tmpfs(self.runtime):
            return self.runtime / "memory"
        key = hashlib.sha256(str(self.runtime.absolute()).encode()).hexdigest()[:12]
        return Path("/dev/shm") / f"tpud-{key}"

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


def _on_tmpfs(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (the mount with the longest prefix of it, in /proc/self/mounts)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    path, best, kind = os.path.realpath(path), "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind == "tmpfs"

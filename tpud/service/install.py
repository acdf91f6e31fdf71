"""`tpud install-service`: the systemd unit, tpud.yaml and the directories, written and enabled.

What it writes, under `--root` (default /):

    etc/systemd/system/tpud.service                     the unit (tpud.service beside this file), its
                                                        ExecStart the tpud of this installation
    etc/systemd/system/multi-user.target.wants/tpud.service -> /etc/systemd/system/tpud.service
    etc/tpud/tpud.yaml                                  the daemon's settings, validated before written
    etc/tpud/jobs.d/                                    (0755)
    var/lib/tpud/                                       the state directory (0750, root's)

The settings come from the flags, or, with `--from-metadata`, from the VM's metadata attributes
(ATTRIBUTES: on a TPU VM, what `gcloud ... --metadata` set), the flags winning. An existing
tpud.yaml that differs is kept unless `--overwrite`: nothing an operator wrote is lost. Into the
real root, `systemctl daemon-reload` and `systemctl enable` (`--now`: and start) follow; under
another root the enabling symlink is made by hand, as systemctl would (images, tests).
Torch-free.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import yaml

UNIT = Path(__file__).with_name("tpud.service")
# Metadata attribute -> tpud.yaml key (instance/attributes/<name>).
ATTRIBUTES = {"tpud-remote-jobs": "remote_jobs", "tpud-gang-port": "gang_port", "tpud-metrics-addr": "metrics_addr",
              "tpud-remote-jobs-poll-seconds": "remote_jobs_poll_seconds"}


class InstallError(Exception):
    pass


def settings(flags: dict[str, object], metadata_host: str | None) -> dict[str, object]:
    """tpud.yaml's keys: the metadata's attributes (when a host is given), then the flags over them;
    validated as the daemon validates them (InstallError naming what is wrong)."""
    from pydantic import ValidationError

    from tpud.settings import Settings

    chosen: dict[str, object] = {}
    if metadata_host is not None:
        chosen.update(from_metadata(metadata_host))
    chosen.update({key: value for key, value in flags.items() if value is not None})
    try:
        Settings.model_validate(chosen)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise InstallError(f"the settings would not be valid: {problems}") from None
    return chosen


def from_metadata(host: str) -> dict[str, object]:
    """The ATTRIBUTES this VM's metadata sets (absent ones left out)."""
    from tpud.metadata import FLAVOR, FLAVOR_HEADER

    found: dict[str, object] = {}
    for attribute, key in ATTRIBUTES.items():
        request = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/attributes/{attribute}",
                                         headers={FLAVOR_HEADER: FLAVOR})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                value = response.read(1 << 16).decode().strip()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                continue
            raise InstallError(f"metadata server {host}: {attribute}: HTTP {e.code}") from None
        except OSError as e:
            raise InstallError(f"metadata server {host} cannot be read ({e}): not a GCE/TPU VM? give the "
                               "settings as flags instead") from None
        found[key] = yaml.safe_load(value) if key in ("gang_port", "remote_jobs_poll_seconds") else value
    return found


def install(root: Path, chosen: dict[str, object], executable: str, overwrite: bool = False) -> list[str]:
    """Write everything under `root`; what was done, a line each."""
    done = []
    unit_dir = root / "etc/systemd/system"
    unit = UNIT.read_text().replace("ExecStart=/usr/local/bin/tpud daemon", f"ExecStart={executable} daemon")
    done.append(_write(unit_dir / "tpud.service", unit, 0o644, overwrite=True))
    config = root / "etc/tpud"
    text = "# tpud's settings (docs/architecture.md, Settings), written by tpud install-service\n"
    text += yaml.safe_dump(chosen, sort_keys=True) if chosen else ""
    done.append(_write(config / "tpud.yaml", text, 0o644, overwrite=overwrite))
    for directory, mode in ((config / "jobs.d", 0o755), (root / "var/lib/tpud", 0o750)):
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(mode)
        if os.geteuid() == 0:
            os.chown(directory, 0, 0)
        done.append(f"{directory}: ready (mode {mode:o})")
    wants = unit_dir / "multi-user.target.wants" / "tpud.service"
    wants.parent.mkdir(parents=True, exist_ok=True)
    if not wants.is_symlink():
        wants.symlink_to("/etc/systemd/system/tpud.service")
    done.append(f"{wants}: enabled")
    return done


def _write(path: Path, text: str, mode: int, overwrite: bool) -> str:
    if path.exists() and path.read_text() != text and not overwrite:
        return f"{path}: kept as it is (it differs from what would be written: --overwrite replaces it)"
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.part")
    temporary.write_text(text)
    temporary.chmod(mode)
    os.replace(temporary, path)
    return f"{path}: written"


def executable() -> str:
    """The tpud command of this installation (the unit must start the one installed here)."""
    beside = Path(sys.executable).parent / "tpud"
    found = str(beside) if beside.exists() else shutil.which("tpud")
    if found is None:
        raise InstallError("no tpud command found beside this Python or on PATH: give it with --exec PATH")
    return str(Path(found).absolute())


def enable(start: bool) -> None:
    """systemctl daemon-reload, then enable (and start): the real root only."""
    for command in (["systemctl", "daemon-reload"], ["systemctl", "enable", *(["--now"] if start else []), "tpud"]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise InstallError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")

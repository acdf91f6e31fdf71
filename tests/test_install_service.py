"""`tpud install-service --root DIR`: from a bare VM's metadata to a unit systemd accepts, a tpud.yaml the
daemon accepts, the directories it needs, and nothing an operator wrote lost."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import PYTHON
from testkit.helpers import python_env


def install(root, *args, **env):
    return subprocess.run([PYTHON, "-m", "tpud", "install-service", "--root", str(root), *args], capture_output=True,
                          text=True, env=python_env(**env), timeout=60)


def test_a_bare_vm_gets_a_verified_unit_and_settings_from_its_metadata(tmp_path, metadata_server):
    metadata_server.set("instance/attributes/tpud-remote-jobs", "gs://fleet-bucket/jobs/")
    metadata_server.set("instance/attributes/tpud-gang-port", "9000")
    done = install(tmp_path, "--from-metadata", "--metrics-addr", "0.0.0.0:9477", GCE_METADATA_HOST=metadata_server.host)
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "etc/systemd/system/tpud.service"
    text = unit.read_text()
    assert f"ExecStart={Path(PYTHON).parent / 'tpud'} daemon" in text
    for setting in ("Type=notify", "KillMode=mixed", "WatchdogSec=", "Restart=on-failure", "RuntimeDirectory=tpud",
                    "StateDirectory=tpud", "ConfigurationDirectory=tpud", "TimeoutStopSec="):
        assert setting in text
    verified = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    assert os.readlink(tmp_path / "etc/systemd/system/multi-user.target.wants/tpud.service") == \
        "/etc/systemd/system/tpud.service"
    settings = tmp_path / "etc/tpud/tpud.yaml"
    valid = subprocess.run([PYTHON, "-m", "tpud", "validate", str(settings)], capture_output=True, text=True,
                           env=python_env())
    assert valid.returncode == 0, valid.stderr
    from tpud.settings import load_settings

    loaded, error = load_settings(settings.parent)
    assert error is None and loaded.remote_jobs == "gs://fleet-bucket/jobs/" and loaded.gang_port == 9000
    assert loaded.metrics_addr == "0.0.0.0:9477"  # a flag, beside the metadata's
    assert (tmp_path / "etc/tpud/jobs.d").is_dir()
    assert (tmp_path / "var/lib/tpud").stat().st_mode & 0o777 == 0o750


def test_an_operators_settings_are_kept_and_bad_ones_never_written(tmp_path, metadata_server):
    settings = tmp_path / "etc/tpud/tpud.yaml"
    settings.parent.mkdir(parents=True)
    settings.write_text("rescan_seconds: 10\n")
    kept = install(tmp_path, "--remote-jobs", "gs://b/jobs/")
    assert kept.returncode == 0 and "kept as it is" in kept.stdout and settings.read_text() == "rescan_seconds: 10\n"
    assert install(tmp_path, "--remote-jobs", "gs://b/jobs/", "--overwrite").returncode == 0
    assert "remote_jobs: gs://b/jobs/" in settings.read_text()
    bad = install(tmp_path / "other", "--remote-jobs", "s3://nope")
    assert bad.returncode == 1 and "remote_jobs" in bad.stderr and not (tmp_path / "other").exists()
    metadata_server.set("instance/attributes/tpud-gang-port", "not a port")
    refused = install(tmp_path / "vm", "--from-metadata", GCE_METADATA_HOST=metadata_server.host)
    assert refused.returncode == 1 and "gang_port" in refused.stderr
    unreachable = install(tmp_path / "off-cloud", "--from-metadata", GCE_METADATA_HOST="127.0.0.1:9")
    assert unreachable.returncode == 1 and "cannot be read" in unreachable.stderr

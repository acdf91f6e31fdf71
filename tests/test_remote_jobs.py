"""remote_jobs (tpud/jobfiles/remote.py) and `tpud submit` / `tpud cancel` against a real GCS server
(fake-gcs-server): the mirror follows the bucket, downloads only what changed, refuses what a
local file would be refused for, and keeps what it has while the bucket cannot be reached."""

from __future__ import annotations

import subprocess

import pytest

from engine.spec.loader import LIMITS
from testkit.helpers import job_text, python_env, wait_until
from tests.conftest import PYTHON, REPO
from tpud.jobfiles.offloop import read_jobs
from tpud.jobfiles.remote import RemoteJobs, split_url
from tpud.settings import Settings

URL = "gs://tpud-test/fleet/jobs/"


def put(gcs_server, name: str, data: bytes | str) -> int:
    blob = gcs_server.client().bucket("tpud-test").blob(f"fleet/jobs/{name}")
    blob.upload_from_string(data)
    return blob.generation


def test_urls_name_a_bucket_and_a_prefix():
    assert split_url("gs://b/jobs") == ("b", "jobs/") and split_url("gs://b/a/b/") == ("b", "a/b/")
    assert split_url("gs://b") == ("b", "") and split_url("gs://b/") == ("b", "")
    for bad in ("s3://b/x", "gs://", "/local/jobs"):
        with pytest.raises(ValueError):
            split_url(bad)


def test_the_mirror_follows_the_bucket_and_downloads_only_what_changed(tmp_path, gcs_server):
    mirror = tmp_path / "mirror"
    remote = RemoteJobs(URL, mirror, lambda: None)
    mirror.mkdir()
    first = put(gcs_server, "alpha.yaml", job_text("alpha"))
    put(gcs_server, "notes.txt", "not a job file")
    gcs_server.client().bucket("tpud-test").blob("fleet/jobs/deeper/beta.yaml").upload_from_string(job_text("beta"))
    assert remote.poll() and sorted(p.name for p in mirror.iterdir()) == [".generations.json", "alpha.yaml"]
    assert remote.status()["generations"] == {"alpha.yaml": first}
    inode = (mirror / "alpha.yaml").stat().st_ino
    assert not remote.poll() and (mirror / "alpha.yaml").stat().st_ino == inode  # nothing fetched again

    second = put(gcs_server, "alpha.yaml", job_text("alpha", max_steps=7))
    assert remote.poll() and "max_steps: 7" in (mirror / "alpha.yaml").read_text()
    # A restarted daemon knows what it holds: nothing to fetch, and a stray file is cleared.
    (mirror / "stray.yaml").write_text(job_text("stray"))
    again = RemoteJobs(URL, mirror, lambda: None)
    again.start()
    again.stop()
    assert again.generations == {"alpha.yaml": second} and not (mirror / "stray.yaml").exists()

    gcs_server.client().bucket("tpud-test").blob("fleet/jobs/alpha.yaml").delete()
    assert again.poll() and not (mirror / "alpha.yaml").exists() and again.generations == {}


def test_hostile_remote_files_are_refused_as_local_ones_are_naming_their_url(tmp_path, gcs_server):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    put(gcs_server, "huge.yaml", b"# " + b"x" * (50 << 20))  # 50 MB: never read whole
    put(gcs_server, "binary.yaml", bytes(range(256)) * 64)
    put(gcs_server, "bomb.yaml", "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(12)))
    put(gcs_server, "good.yaml", job_text("good"))
    RemoteJobs(URL, mirror, lambda: None).poll()
    assert (mirror / "huge.yaml").stat().st_size == LIMITS.file_bytes + 1
    files = read_jobs(tmp_path / "jobs.d", Settings(), tmp_path, (mirror, URL))
    errors = {path.name: job.error for path, job in files.items()}
    assert errors["good.yaml"] is None
    for name in ("huge.yaml", "binary.yaml", "bomb.yaml"):
        assert errors[name] and errors[name].startswith(f"{URL}{name}"), errors[name]
        assert str(mirror) not in errors[name]


def test_a_job_in_jobs_d_and_one_of_the_same_name_in_the_bucket_are_not_both_run(tmp_path, gcs_server):
    jobs_dir, mirror = tmp_path / "jobs.d", tmp_path / "mirror"
    jobs_dir.mkdir()
    mirror.mkdir()
    (jobs_dir / "alpha.yaml").write_text(job_text("alpha"))
    put(gcs_server, "again.yaml", job_text("alpha"))
    RemoteJobs(URL, mirror, lambda: None).poll()
    files = read_jobs(jobs_dir, Settings(), tmp_path, (mirror, URL))
    assert files[jobs_dir / "alpha.yaml"].error is None
    assert "job alpha is already defined in" in files[mirror / "again.yaml"].error


def test_an_unreachable_bucket_keeps_the_mirror_reports_once_and_recovers(tmp_path, gcs_server):
    mirror = tmp_path / "mirror"
    put(gcs_server, "alpha.yaml", job_text("alpha"))
    changes = []
    remote = RemoteJobs(URL, mirror, lambda: changes.append(1), poll_s=0.2)
    remote.start()
    try:
        wait_until(lambda: changes, "the first listing")
        gcs_server.stop()
        wait_until(lambda: remote.error is not None, "the failed listing reported", timeout=30)
        assert (mirror / "alpha.yaml").exists() and remote.status()["generations"]  # the jobs go on as they are
        gcs_server.start()
        put(gcs_server, "beta.yaml", job_text("beta"))
        wait_until(lambda: remote.error is None and (mirror / "beta.yaml").exists(), "listed again", timeout=90)
        assert (mirror / "alpha.yaml").exists()
    finally:
        remote.stop()


def tpud(gcs_server, home, *args) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "tpud", *args, "--home", str(home)], capture_output=True, text=True,
                          env=python_env(**gcs_server.env()), timeout=120)


def test_submit_validates_uploads_and_replaces_and_cancel_removes(tmp_path, gcs_server):
    home = tmp_path / "home"
    home.mkdir()
    (home / "tpud.yaml").write_text(f"remote_jobs: {URL}\n")
    bucket = gcs_server.client().bucket("tpud-test")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: broken\ntrain: {max_stepz: 3}\n")
    refused = tpud(gcs_server, home, "submit", str(broken))
    assert refused.returncode == 1 and f"{broken}:2: train.max_stepz" in refused.stderr
    assert not list(bucket.list_blobs(prefix="fleet/"))  # nothing uploaded

    # A file with includes goes up as the job it makes: the hosts cannot read this machine's files.
    job = tmp_path / "alpha.yaml"
    job.write_text(job_text("alpha"))
    done = tpud(gcs_server, home, "submit", str(job), "train.max_steps=9")
    assert done.returncode == 0 and "submitted" in done.stdout, done.stderr
    uploaded = tmp_path / "uploaded.yaml"
    uploaded.write_text(bucket.blob("fleet/jobs/alpha.yaml").download_as_text())
    from engine.spec.loader import load_job

    assert load_job(uploaded).spec == load_job(job, ["train.max_steps=9"]).spec
    assert "unchanged" in tpud(gcs_server, home, "submit", str(job), "train.max_steps=9").stdout
    replaced = tpud(gcs_server, home, "submit", "train.max_steps=10", str(job))  # overrides in any order
    assert replaced.returncode == 0 and "replaced generation" in replaced.stdout

    assert tpud(gcs_server, home, "cancel", "../alpha").returncode == 1  # no job name: nothing touched
    unknown = tpud(gcs_server, home, "cancel", "nope")
    assert unknown.returncode == 3 and "no job file nope.yaml" in unknown.stderr and "alpha.yaml" in unknown.stderr
    gone = tpud(gcs_server, home, "cancel", "alpha")
    assert gone.returncode == 0 and "removed" in gone.stdout and bucket.get_blob("fleet/jobs/alpha.yaml") is None
    nowhere = tpud(gcs_server, tmp_path / "bare", "submit", str(job))
    assert nowhere.returncode == 1 and "sets no remote_jobs" in nowhere.stderr


def test_of_two_operators_writing_at_once_one_wins_and_the_other_is_told(tmp_path, gcs_server, monkeypatch, capsys):
    """The second writer read the object before the first one's write landed: its precondition fails."""
    import argparse

    from tpud.commands import remote

    job = tmp_path / "alpha.yaml"
    job.write_text(job_text("alpha"))
    put(gcs_server, "alpha.yaml", job_text("alpha", max_steps=5))
    bucket_of = remote._bucket

    def stale(directory):
        bucket, prefix = bucket_of(directory)
        read = bucket.get_blob

        def read_then_the_other_writes(name):
            blob = read(name)  # its generation is the one this submit writes against
            put(gcs_server, "alpha.yaml", job_text("alpha", max_steps=6))  # the other operator, meanwhile
            return blob

        bucket.get_blob = read_then_the_other_writes
        return bucket, prefix

    monkeypatch.setattr(remote, "_bucket", stale)
    args = argparse.Namespace(job=str(job), overrides=[], to=URL, home=str(tmp_path))
    assert remote.submit(args) == 1
    assert "changed since it was read (another operator?): nothing written" in capsys.readouterr().err
    text = gcs_server.client().bucket("tpud-test").blob("fleet/jobs/alpha.yaml").download_as_text()
    assert "max_steps: 6" in text  # the other operator's write stands


@pytest.mark.slow
def test_a_daemon_runs_what_is_submitted_stops_what_is_cancelled_and_outlives_the_bucket(tmp_path, gcs_server):
    import time

    from engine.checkpoint import manifest as mf
    from testkit.helpers import Daemon
    from tpud.control import ControlClient
    from tpud.paths import Paths

    (tmp_path / "tpud.yaml").write_text(f"remote_jobs: {URL}\nremote_jobs_poll_seconds: 0.5\n")
    daemon = Daemon(tmp_path, env=gcs_server.env())
    try:
        job = tmp_path / "alpha.yaml"
        job.write_text(job_text("alpha"))
        assert tpud(gcs_server, tmp_path, "submit", str(job)).returncode == 0
        put(gcs_server, "bomb.yaml", "a: &a [x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
            for i in range(12)))
        jobs = daemon.wait_for(lambda j: (j.get("alpha", {}).get("step") or 0) >= 2 and "bomb" in j,
                               "alpha running, the bomb refused")
        assert jobs["alpha"]["file"].startswith(f"{URL}alpha.yaml#") and jobs["bomb"]["error"].startswith(URL)

        gcs_server.stop()  # the bucket gone: status answers, the job trains on
        control = ControlClient(Paths.resolve(tmp_path).runtime / "control.sock")
        wait_until(lambda: control.call("status")["remote_jobs"]["error"], "the listing's failure shown", timeout=30)
        step = daemon.status()["alpha"]["step"]
        started = time.monotonic()
        status = daemon.cli("status")
        assert status.returncode == 0 and "remote jobs: gs://tpud-test/fleet/jobs/: cannot list" in status.stdout
        assert time.monotonic() - started < 5
        daemon.wait_for(lambda j: j["alpha"]["step"] > step + 3 and j["alpha"]["state"] == "RUNNING",
                        "alpha training without its bucket")
        gcs_server.start()

        before = {s for s, _, _ in mf.committed_steps(tmp_path / "state" / "checkpoints" / "alpha")}
        assert tpud(gcs_server, tmp_path, "cancel", "alpha").returncode == 0
        daemon.wait_for(lambda j: j["alpha"]["state"] == "STOPPED", "alpha stopped", timeout=60)
        after = {s for s, _, _ in mf.committed_steps(tmp_path / "state" / "checkpoints" / "alpha")}
        assert after and max(after) > max(before, default=0)  # with a final checkpoint
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()

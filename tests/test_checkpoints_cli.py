"""`tpud checkpoints JOB.yaml`: committed steps per tier (local, and gcs against a real server)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, python_env
from testkit.gcs_server import free_port
from testkit.helpers import tpud_imports
from engine.checkpoint.hosts import record_holdings
from engine.checkpoint.manifest import read_manifest, write_global, write_manifest
from tests.test_gcs import BUCKET, FAST, make_step
from tpud.gcs.tier import GcsTier


def tpud(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "tpud", *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=python_env(**(env or {})))


def job_file(tmp_path, remote: str | None = None, name: str = "job") -> str:
    lines = [f"name: {name}", "checkpoint:", f"  dir: {tmp_path / 'ckpt'}", "  keep: 3"]
    if remote:
        lines.append(f"  remote: {remote}")
    path = tmp_path / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def local_steps(tmp_path):
    job_dir = tmp_path / "ckpt" / "job"
    steps = [make_step(job_dir, 10, sizes=(2048, 1024)), make_step(job_dir, 20, sizes=(4096,)),
             make_step(job_dir, 20, micro_step=3, sizes=(4096,))]
    broken = make_step(job_dir, 30, sizes=(100, 100))
    (broken / "__1_0.distcp").unlink()
    (job_dir / ".tmp-step_000000040").mkdir()  # an unfinished save: not listed
    return steps + [broken]


def test_json_lists_local_steps(tmp_path, local_steps):
    result = tpud("checkpoints", job_file(tmp_path), "-o", "json", "--home", str(tmp_path / "home"))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["job"] == "job" and list(out["tiers"]) == ["local"]
    local = out["tiers"]["local"]
    assert [(s["step"], s["micro_step"]) for s in local] == [(10, 0), (20, 0), (20, 3), (30, 0)]
    assert [s["ok"] for s in local] == [True, True, True, False]
    assert local[0]["bytes"] == 2048 + 1024 + 512 and local[0]["files"] == 3  # + .metadata
    assert "__1_0.distcp: missing" in local[3]["problems"]
    assert all(0 <= s["age_seconds"] < 600 for s in local)
    assert local[2]["location"].endswith("step_000000020.0003")


def test_a_local_listing_starts_without_structlog(tmp_path, local_steps):
    """Only the GCS tier logs: listing a local tier does without structlog's 0.2 s of imports."""
    result, imported = tpud_imports("checkpoints", job_file(tmp_path), "--home", str(tmp_path / "home"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "engine.checkpoint.manifest" in imported and "structlog" not in imported


def test_table_lists_local_steps_newest_first(tmp_path, local_steps):
    result = tpud("checkpoints", job_file(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("job job: local ") and lines[1].split() == [
        "TIER", "STEP", "MICRO", "SIZE", "FILES", "AGE", "REASON", "HOSTS", "SKIPPED", "STATUS"]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("local", "30", "0"), ("local", "20", "3"),
                                                  ("local", "20", "0"), ("local", "10", "0")]
    assert rows[3][3:5] == ["3.5", "KiB"] and rows[3][-1] == "ok"
    assert "damaged" in lines[2]


def test_default_root_is_under_the_home_state_dir(tmp_path):
    home = tmp_path / "home"
    make_step(home / "state" / "checkpoints" / "job", 5, sizes=(10,))
    path = tmp_path / "job.yaml"
    path.write_text("name: job\n")
    result = tpud("checkpoints", str(path), "--home", str(home), "-o", "json")
    assert result.returncode == 0, result.stderr
    assert [s["step"] for s in json.loads(result.stdout)["tiers"]["local"]] == [5]
    empty = tpud("checkpoints", str(path), "--home", str(tmp_path / "elsewhere"))
    assert empty.returncode == 0 and "no committed steps" in empty.stdout


def test_invalid_spec_exits_1(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ncheckpoint:\n  remote: s3://nope\n")
    result = tpud("checkpoints", str(path))
    assert result.returncode == 1
    assert "checkpoint.remote" in result.stderr and result.stdout == ""


def test_gcs_tier_is_listed(tmp_path, gcs_server, local_steps):
    remote = f"gs://{BUCKET}/runs"
    tier = GcsTier(remote, "job", retry=FAST)
    for step_dir in local_steps[:3]:
        tier.upload_step(step_dir)
    # An interrupted upload (no manifest) is not a committed step.
    gcs_server.client().bucket(BUCKET).blob("runs/job/step_000000050/__0_0.distcp").upload_from_string(b"x")

    result = tpud("checkpoints", job_file(tmp_path, remote), "-o", "json", env=gcs_server.env())
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert list(out["tiers"]) == ["local", "gcs"]
    gcs = out["tiers"]["gcs"]
    assert [(s["step"], s["micro_step"], s["ok"]) for s in gcs] == [(10, 0, True), (20, 0, True), (20, 3, True)]
    assert gcs[0]["bytes"] == out["tiers"]["local"][0]["bytes"]
    assert gcs[2]["location"] == f"{remote}/job/step_000000020.0003/"

    table = tpud("checkpoints", job_file(tmp_path, remote), env=gcs_server.env())
    assert table.returncode == 0, table.stderr
    assert [line.split()[:2] for line in table.stdout.splitlines() if line.startswith("gcs")] == [
        ["gcs", "20"], ["gcs", "20"], ["gcs", "10"]]


def test_unreachable_gcs_exits_1_and_says_what_failed(tmp_path, local_steps):
    server_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = tpud("checkpoints", job_file(tmp_path, f"gs://{BUCKET}/runs"), "-o", "json", "--timeout", "1",
                  env={"STORAGE_EMULATOR_HOST": server_url})
    assert result.returncode == 1
    assert "cannot read the GCS tier" in result.stderr and f"gs://{BUCKET}/runs/job/" in result.stderr
    out = json.loads(result.stdout)  # the local tier is still reported
    assert len(out["tiers"]["local"]) == 4 and out["tiers"]["gcs"] == [] and "gcs" in out["errors"]


def test_a_job_on_several_hosts_shows_global_commits_and_who_holds_each_part(tmp_path):
    job_dir = tmp_path / "ckpt" / "job"
    for step in (3, 6, 9):  # host 1's parts of a job on 3 hosts; step 9's global commit never completed
        directory = make_step(job_dir, step, sizes=(100,))
        manifest = dataclasses.replace(read_manifest(directory), host=1, hosts=3)
        write_manifest(directory, manifest)
        if step != 9:
            write_global(directory, manifest)
    # As the hosts told each other at the last exchange: host 2's disk had lost step 3.
    record_holdings(job_dir, [{(3, 0), (6, 0), (9, 0)}, {(3, 0), (6, 0), (9, 0)}, {(6, 0)}])

    out = json.loads(tpud("checkpoints", job_file(tmp_path), "-o", "json").stdout)["tiers"]["local"]
    assert [(s["step"], s["global"], s["host"], s["hosts"], s["held_by"]) for s in out] == [
        (3, True, 1, 3, [0, 1]), (6, True, 1, 3, [0, 1, 2]), (9, False, 1, 3, [0, 1])]
    rows = [re.split(r"\s{2,}", line) for line in tpud("checkpoints", job_file(tmp_path)).stdout.splitlines()[2:]]
    assert [(r[1], r[7:]) for r in rows] == [
        ("9", ["0,1 of 3", "-", "not globally committed: a host's part was never durable"]),
        ("6", ["0,1,2 of 3", "-", "ok"]), ("3", ["0,1 of 3", "-", "ok"])]

    (job_dir / "hosts.json").write_text("{not json")  # never recorded, or garbled: each part's own host
    rows = [re.split(r"\s{2,}", line) for line in tpud("checkpoints", job_file(tmp_path)).stdout.splitlines()[2:]]
    assert [r[7] for r in rows] == ["1 of 3"] * 3


def test_special_files_in_place_of_markers_are_no_commits_and_never_block(tmp_path):
    import os

    job_dir = tmp_path / "ckpt" / "job"
    for step in (3, 6):
        directory = make_step(job_dir, step, sizes=(100,))
        write_manifest(directory, dataclasses.replace(read_manifest(directory), host=0, hosts=2))
    os.mkfifo(job_dir / "step_000000003" / "global.json")  # a reader would wait forever on it
    (job_dir / "step_000000006" / "global.json").mkdir()
    os.mkfifo(job_dir / "hosts.json")
    make_step(job_dir, 9, sizes=(100,))
    (job_dir / "step_000000009" / "manifest.json").unlink()
    os.mkfifo(job_dir / "step_000000009" / "manifest.json")

    result = tpud("checkpoints", job_file(tmp_path), "-o", "json")  # within tpud()'s timeout, not hanging
    assert result.returncode == 0, result.stderr
    assert [(s["step"], s["global"], s["held_by"]) for s in json.loads(result.stdout)["tiers"]["local"]] == [
        (3, False, None), (6, False, None)]  # step 9 has no readable manifest: not listed


@pytest.mark.parametrize("field, value", [("step", "12"), ("micro_step", None), ("created_unix", "yesterday"),
                                          ("files", [{"path": 7, "size": 1, "crc32c": "x"}]), ("step", -12),
                                          ("created_unix", float("nan")), ("members", [0, "2"])])
def test_a_hand_edited_manifest_with_a_wrong_type_is_no_commit_and_breaks_no_listing(tmp_path, field, value):
    job_dir = tmp_path / "ckpt" / "job"
    make_step(job_dir, 6, sizes=(100,))
    edited = make_step(job_dir, 12, sizes=(100,))
    data = json.loads((edited / "manifest.json").read_text())
    (edited / "manifest.json").write_text(json.dumps({**data, field: value}))

    assert read_manifest(edited) is None
    result = tpud("checkpoints", job_file(tmp_path), "-o", "json")
    assert result.returncode == 0, result.stderr
    assert [s["step"] for s in json.loads(result.stdout)["tiers"]["local"]] == [6]

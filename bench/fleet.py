"""A fleet's watched directory in GCS: three daemons, one bucket, `tpud submit` and `tpud cancel`.

Three `tpud daemon`s on this machine (their own homes, each tpud.yaml naming the same
`remote_jobs: gs://fleet/jobs/` on one fake-gcs-server, the default 5 s poll) and the tiny job:
- submit: `tpud submit` to the third host's first step (every host's time reported);
- hostile files: a 50 MB file, a binary one and a YAML alias bomb put beside it are shown invalid
  by every host, naming their URL, while the job trains on;
- change: `tpud submit` of the job with another max_steps until every host runs the new spec;
- unreachable: the GCS server stopped for `--outage` s (60 by default): `tpud status` is asked on
  every host every second meanwhile (its slowest answer reported) and every job must keep
  training; then the server is back;
- cancel: `tpud cancel` until every host has stopped the job with a checkpoint newer than before.
With `--gang` the three daemons are one gang (tpud.yaml `gang:`, a coordinator on loopback): the
job is one run over three hosts, and a changed file, fetched by each host within its own poll,
must still bring the gang together on the new spec (the hosts' copies differ meanwhile).

    .venv/bin/python bench/fleet.py            # ~2 min
    .venv/bin/python bench/fleet.py --gang     # the same as one gang: bench/results/fleet-gang.json
Results: a table on stdout and bench/results/fleet.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.checkpoint import manifest as mf  # noqa: E402
from machine import describe  # noqa: E402
from testkit.gcs_server import GcsServer  # noqa: E402
from testkit.helpers import Daemon, job_text, python_env  # noqa: E402
from tpud.control import ControlClient  # noqa: E402
from tpud.paths import Paths  # noqa: E402

URL = "gs://fleet/jobs/"
HOSTILE = {"huge.yaml": b"# " + b"x" * (50 << 20), "binary.yaml": bytes(range(256)) * 64,
           "bomb.yaml": ("a: &a [x, x, x, x]\n" + "".join(
               f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
               for i in range(12))).encode()}


def tpud(server: GcsServer, home: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tpud", *args, "--home", str(home)], capture_output=True, text=True,
                          env=python_env(**server.env()), timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"tpud {' '.join(args)}: {done.stderr}")
    return done


def until(daemons: list[Daemon], predicate, what: str, timeout: float = 120) -> list[float]:
    """Seconds from now until each daemon's status met `predicate` (polled every 0.1 s)."""
    started, met = time.monotonic(), {}
    while len(met) < len(daemons):
        for i, daemon in enumerate(daemons):
            if i not in met and predicate(daemon.status()):
                met[i] = round(time.monotonic() - started, 2)
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"timed out waiting for {what}: {[d.status() for d in daemons]}")
        time.sleep(0.1)
    return [met[i] for i in range(len(daemons))]


def newest(home: Path) -> int:
    return max((s for s, _, _ in mf.committed_steps(home / "state" / "checkpoints" / "alpha")), default=0)


def outage(server: GcsServer, daemons: list[Daemon], seconds: float) -> dict:
    """The server stopped for `seconds`: status latencies, and each job's steps meanwhile."""
    clients = [ControlClient(Paths.resolve(d.home).runtime / "control.sock") for d in daemons]
    before = [d.status()["alpha"]["step"] for d in daemons]
    server.stop()
    latencies, errors_shown, end = [], set(), time.monotonic() + seconds
    while time.monotonic() < end:
        for i, client in enumerate(clients):
            asked = time.monotonic()
            result = client.call("status")
            latencies.append(time.monotonic() - asked)
            if result["remote_jobs"]["error"]:
                errors_shown.add(i)
        time.sleep(1.0)
    after = [d.status()["alpha"] for d in daemons]
    server.start()
    back = time.monotonic()
    while any(client.call("status")["remote_jobs"]["error"] for client in clients):
        time.sleep(0.2)
    return {"seconds": seconds, "status_answers": len(latencies), "status_max_s": round(max(latencies), 4),
            "steps_during": [a["step"] - b for a, b in zip(after, before)],
            "states_after": [a["state"] for a in after], "hosts_showing_the_error": len(errors_shown),
            "listed_again_s": round(time.monotonic() - back, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outage", type=float, default=60.0, help="seconds the bucket is unreachable")
    parser.add_argument("--gang", action="store_true", help="the three daemons are one gang")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/fleet[-gang].json")
    args = parser.parse_args()
    args.out = args.out or REPO / "bench" / "results" / f"fleet{'-gang' if args.gang else ''}.json"
    from testkit.helpers import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tpud-fleet-") as scratch:
        root = Path(scratch)
        server = GcsServer(root / "gcs")
        server.start()
        daemons = []
        try:
            server.client().create_bucket("fleet")
            for host in range(3):
                home = root / f"host{host}"
                home.mkdir()
                gang = f"gang: {{host_index: {host}, host_count: 3, coordinator: '127.0.0.1:{port}'}}\n"
                (home / "tpud.yaml").write_text(f"remote_jobs: {URL}\n" + (gang if args.gang else ""))
                daemons.append(Daemon(home, env=server.env()))
            try:
                result = run(server, daemons, root, args)
            except Exception:
                kept = Path(tempfile.mkdtemp(prefix="tpud-fleet-failed-"))
                for daemon in daemons:
                    (kept / f"{daemon.home.name}.log").write_bytes((daemon.home / "daemon.log").read_bytes())
                print(f"failed: the daemons' logs are kept in {kept}", file=sys.stderr)
                raise
        finally:
            for daemon in daemons:
                daemon.proc.kill()
                daemon.proc.wait()
            server.close()
    result["machine"] = describe()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'phase':<12} {'host 0':>8} {'host 1':>8} {'host 2':>8}")
    for phase in ("submit", "hostile", "change", "cancel"):
        print(f"{phase:<12} " + " ".join(f"{s:>7.2f}s" for s in result[phase]["seconds"]))
    o = result["outage"]
    print(f"bucket unreachable {o['seconds']:.0f} s: {o['status_answers']} status answers, slowest "
          f"{o['status_max_s'] * 1000:.1f} ms; steps meanwhile {o['steps_during']}; after: {o['states_after']}; "
          f"every host listing again {o['listed_again_s']:.1f} s after it was back")
    print(f"all held: {result['passed']}  ({args.out})")


def run(server: GcsServer, daemons: list[Daemon], root: Path, args) -> dict:
    job = root / "alpha.yaml"
    job.write_text(job_text("alpha"))
    home = daemons[0].home
    until(daemons, lambda j: True, "every daemon answering")
    tpud(server, home, "submit", str(job))
    submit = until(daemons, lambda j: (j.get("alpha", {}).get("step") or 0) >= 1, "the first step everywhere")

    bucket = server.client().bucket("fleet")
    for name, data in HOSTILE.items():
        bucket.blob(f"jobs/{name}").upload_from_string(data)
    stems = [name.removesuffix(".yaml") for name in HOSTILE]
    hostile = until(daemons, lambda j: all((j.get(s) or {}).get("error", "").startswith(URL) for s in stems),
                    "the hostile files refused")
    training = all(d.status()["alpha"]["state"] == "RUNNING" for d in daemons)

    tpud(server, home, "submit", str(job), "train.max_steps=90000")
    change = until(daemons, lambda j: j["alpha"]["max_steps"] == 90000 and j["alpha"]["state"] == "RUNNING",
                   "the new spec everywhere")
    down = outage(server, daemons, args.outage)

    before = [newest(d.home) for d in daemons]
    tpud(server, home, "cancel", "alpha")
    cancel = until(daemons, lambda j: j["alpha"]["state"] == "STOPPED", "stopped everywhere")
    checkpointed = [newest(d.home) > b for d, b in zip(daemons, before)]
    passed = (training and all(s > 0 for s in down["steps_during"]) and down["status_max_s"] < 1.0
              and all(s == "RUNNING" for s in down["states_after"]) and all(checkpointed))
    return {"hosts": len(daemons), "gang": args.gang, "poll_s": 5.0, "submit": {"seconds": submit, "third_host_s": max(submit)},
            "hostile": {"seconds": hostile, "files": list(HOSTILE), "job_kept_training": training},
            "change": {"seconds": change}, "outage": down,
            "cancel": {"seconds": cancel, "final_checkpoint_newer": checkpointed}, "passed": passed}


if __name__ == "__main__":
    main()

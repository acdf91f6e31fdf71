"""tpud.metrics.series: every series scraped over HTTP and parsed, and one scrape by a real Prometheus."""

from __future__ import annotations

import enum
import re
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import tpud
from tpud.metrics import listener as exporter
from tpud.metrics.series import (
    CHECKPOINT_BUCKETS,
    JOB_STATES,
    Metrics,
    format_address,
    parse_address,
    write_address_file,
)
from tests import prometheus as prometheus_helper


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def metrics(clock):
    m = Metrics(clock=clock)
    m.serve("127.0.0.1:0")
    yield m
    m.close()


def scrape(m: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET /metrics and parse it: sample name -> [(labels, value)]."""
    host, port = m.address
    with urllib.request.urlopen(f"http://{format_address(host, port)}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return samples


def value(samples, name: str, **labels: str) -> float:
    found = [v for lab, v in samples.get(name, []) if lab == labels]
    assert len(found) == 1, f"{name}{labels}: {found}; have {samples.get(name)}"
    return found[0]


def series_of_job(samples, job: str) -> list[str]:
    return [name for name, items in samples.items() for lab, _ in items if lab.get("job") == job]


def test_build_info():
    m = Metrics()
    samples = {s.name: (s.labels, s.value) for f in text_string_to_metric_families(
        m.exposition().decode()) for s in f.samples}
    assert samples["tpud_build_info"] == ({"version": tpud.__version__}, 1.0)


def test_job_state_is_one_hot(metrics):
    metrics.job_state("llm", "STARTING")
    metrics.job_state("llm", "RUNNING")
    metrics.job_state("other", "BACKOFF")
    s = scrape(metrics)
    llm = {lab["state"]: v for lab, v in s["tpud_job_state"] if lab["job"] == "llm"}
    assert llm == {state: (1.0 if state == "RUNNING" else 0.0) for state in JOB_STATES}
    other = {lab["state"]: v for lab, v in s["tpud_job_state"] if lab["job"] == "other"}
    assert sum(other.values()) == 1.0 and other["BACKOFF"] == 1.0


def test_job_state_accepts_enum_and_rejects_unknown(metrics):
    class State(enum.Enum):
        CHECKPOINTING = "checkpointing"

    metrics.job_state("llm", State.CHECKPOINTING)
    assert value(scrape(metrics), "tpud_job_state", job="llm", state="CHECKPOINTING") == 1.0
    with pytest.raises(ValueError, match="unknown job state"):
        metrics.job_state("llm", "DANCING")


def test_job_progress_sets_only_what_is_given(metrics):
    metrics.job_progress("llm", step=10, loss=2.5, tokens_per_second=12345.0, mfu=0.41)
    metrics.job_progress("llm", step=11)
    s = scrape(metrics)
    assert value(s, "tpud_job_step", job="llm") == 11
    assert value(s, "tpud_job_loss", job="llm") == 2.5
    assert value(s, "tpud_job_tokens_per_second", job="llm") == 12345.0
    assert value(s, "tpud_job_mfu_ratio", job="llm") == pytest.approx(0.41)

    metrics.job_progress("fresh", loss=3.0)
    s = scrape(metrics)
    assert value(s, "tpud_job_loss", job="fresh") == 3.0
    assert "fresh" not in {lab["job"] for lab, _ in s["tpud_job_step"]}


def test_heartbeat_age_grows_with_the_clock(metrics, clock):
    assert "tpud_heartbeat_age_seconds" not in scrape(metrics)
    metrics.heartbeat("llm", clock.now)
    assert value(scrape(metrics), "tpud_heartbeat_age_seconds", job="llm") == 0.0
    clock.now += 7.5
    assert value(scrape(metrics), "tpud_heartbeat_age_seconds", job="llm") == 7.5
    clock.now += 30
    assert value(scrape(metrics), "tpud_heartbeat_age_seconds", job="llm") == 37.5
    metrics.heartbeat("llm", clock.now - 1)
    assert value(scrape(metrics), "tpud_heartbeat_age_seconds", job="llm") == 1.0


def test_restarts_and_preemption_notices(metrics):
    metrics.restart("llm", "crash")
    metrics.restart("llm", "crash")
    metrics.restart("llm", "hang")
    metrics.preemption_notice("gce-metadata")
    s = scrape(metrics)
    assert value(s, "tpud_job_restarts_total", job="llm", reason="crash") == 2
    assert value(s, "tpud_job_restarts_total", job="llm", reason="hang") == 1
    assert value(s, "tpud_preemption_notices_total", source="gce-metadata") == 1
    assert not [n for n in s if n.endswith("_created")], "no *_created series are exported"


def test_checkpoint_histogram_bytes_step_and_failures(metrics):
    metrics.checkpoint("llm", tier="local", reason="periodic", seconds=0.3, bytes=1000, step=100)
    metrics.checkpoint("llm", tier="local", reason="periodic", seconds=45.0, bytes=500, step=200)
    metrics.checkpoint("llm", tier="gcs", reason="preemption", seconds=1500.0, bytes=1500, step=200)
    metrics.checkpoint_failure("llm", "gcs")
    s = scrape(metrics)

    local = dict(job="llm", tier="local", reason="periodic")
    buckets = {lab["le"]: v for lab, v in s["tpud_checkpoint_duration_seconds_bucket"]
               if {k: lab[k] for k in local} == local}
    assert [float(le) for le in buckets if le != "+Inf"] == list(CHECKPOINT_BUCKETS)
    assert CHECKPOINT_BUCKETS[0] == 0.1 and CHECKPOINT_BUCKETS[-1] == 1800.0
    assert buckets["0.25"] == 0 and buckets["0.5"] == 1 and buckets["30.0"] == 1
    assert buckets["60.0"] == 2 and buckets["+Inf"] == 2
    assert value(s, "tpud_checkpoint_duration_seconds_count", **local) == 2
    assert value(s, "tpud_checkpoint_duration_seconds_sum", **local) == pytest.approx(45.3)
    gcs = dict(job="llm", tier="gcs", reason="preemption")
    assert value(s, "tpud_checkpoint_duration_seconds_count", **gcs) == 1

    assert value(s, "tpud_checkpoint_bytes_total", job="llm", tier="local") == 1500
    assert value(s, "tpud_checkpoint_bytes_total", job="llm", tier="gcs") == 1500
    assert value(s, "tpud_checkpoint_last_committed_step", job="llm", tier="local") == 200
    assert value(s, "tpud_checkpoint_last_committed_step", job="llm", tier="gcs") == 200
    assert value(s, "tpud_checkpoint_failures_total", job="llm", tier="gcs") == 1
    # A committed checkpoint makes its tier's failure counter exist at 0 (rate() needs it).
    assert value(s, "tpud_checkpoint_failures_total", job="llm", tier="local") == 0


def test_a_jobs_counters_exist_at_zero_and_commits_carry_their_time(metrics):
    metrics.job_series("llm", tiers=["local", "gcs"], restart_reasons=["crash", "hang"])
    metrics.checkpoint("llm", tier="local", reason="interval", seconds=1.0, bytes=10, step=5, at=1234.5)
    metrics.checkpoint_interval("llm", 60.0)
    s = scrape(metrics)
    assert value(s, "tpud_job_restarts_total", job="llm", reason="hang") == 0
    assert value(s, "tpud_checkpoint_failures_total", job="llm", tier="gcs") == 0
    assert value(s, "tpud_preemption_notices_total", source="sigterm") == 0  # the daemon's, from the start
    assert value(s, "tpud_checkpoint_last_committed_timestamp_seconds", job="llm", tier="local") == 1234.5
    assert value(s, "tpud_job_checkpoint_interval_seconds", job="llm") == 60.0
    metrics.remove_job("llm")
    assert not series_of_job(scrape(metrics), "llm")


def test_goodput_and_badput(metrics):
    metrics.goodput("llm", 0.93)
    metrics.badput("llm", "restart", 12.0)
    metrics.badput("llm", "restart", 3.0)
    metrics.badput("llm", "checkpoint", 1.5)
    s = scrape(metrics)
    assert value(s, "tpud_goodput_ratio", job="llm") == pytest.approx(0.93)
    assert value(s, "tpud_badput_seconds_total", job="llm", kind="restart") == 15.0
    assert value(s, "tpud_badput_seconds_total", job="llm", kind="checkpoint") == 1.5


def feed(m: Metrics, job: str, at: float) -> None:
    m.job_state(job, "RUNNING")
    m.job_progress(job, step=5, loss=1.0, tokens_per_second=10.0, mfu=0.5)
    m.heartbeat(job, at)
    m.restart(job, "crash")
    m.checkpoint(job, tier="local", reason="periodic", seconds=1.0, bytes=10, step=5)
    m.checkpoint_failure(job, "gcs")
    m.goodput(job, 0.9)
    m.badput(job, "restart", 2.0)


def test_remove_job_drops_every_series_of_that_job_only(metrics, clock):
    feed(metrics, "gone", clock.now)
    feed(metrics, "kept", clock.now)
    metrics.preemption_notice("sigterm")
    before = scrape(metrics)
    assert set(series_of_job(before, "gone")) == set(series_of_job(before, "kept"))
    assert len(set(series_of_job(before, "gone"))) >= 15  # every per-job name, _bucket etc.

    metrics.remove_job("gone")
    after = scrape(metrics)
    assert series_of_job(after, "gone") == []
    assert set(series_of_job(after, "kept")) == set(series_of_job(before, "kept"))
    assert value(after, "tpud_preemption_notices_total", source="sigterm") == 1
    assert value(after, "tpud_build_info", version=tpud.__version__) == 1

    metrics.remove_job("gone")  # again: a no-op
    metrics.remove_job("never-seen")
    metrics.restart("gone", "crash")  # a job that comes back starts from zero
    assert value(scrape(metrics), "tpud_job_restarts_total", job="gone", reason="crash") == 1


def test_private_registry():
    a, b = Metrics(), Metrics()
    a.restart("x", "crash")
    assert b"tpud_job_restarts_total{" not in b.exposition()
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("tpud_")]


def test_concurrent_updates_lose_nothing(metrics):
    def work(i: int) -> None:
        for _ in range(500):
            metrics.restart("llm", "crash")
            metrics.job_state(f"j{i}", "RUNNING")
            metrics.remove_job(f"j{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = scrape(metrics)
    assert value(s, "tpud_job_restarts_total", job="llm", reason="crash") == 4000
    assert {lab["job"] for lab, _ in s.get("tpud_job_state", [])} == set()


def test_serve_port_zero_address_file_and_close(tmp_path):
    m = Metrics()
    host, port = m.serve("127.0.0.1:0")
    assert host == "127.0.0.1" and port > 0
    with pytest.raises(RuntimeError, match="already running"):
        m.serve("127.0.0.1:0")
    addr_file = tmp_path / "run" / "metrics.addr"
    write_address_file(addr_file, host, port)
    assert addr_file.read_text() == f"127.0.0.1:{port}\n"
    assert list(addr_file.parent.iterdir()) == [addr_file]  # no temporary left behind
    assert parse_address(addr_file.read_text()) == (host, port)
    with urllib.request.urlopen(f"http://{addr_file.read_text().strip()}/metrics", timeout=5) as r:
        assert b"tpud_build_info" in r.read()

    m.close()
    m.close()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=2).close()
    # The port is free again: serve on it once more.
    assert m.serve(f"127.0.0.1:{port}") == (host, port)
    m.close()


def test_serve_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    m = Metrics()
    host, port = m.serve("[::1]:0")
    try:
        assert host == "::1" and port > 0
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as r:
            assert b"tpud_build_info" in r.read()
    finally:
        m.close()


def test_address_parsing():
    assert parse_address("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address(":9477") == ("", 9477)
    assert parse_address("localhost:80") == ("localhost", 80)
    for bad in ("9477", "127.0.0.1", "::1:80", "[::1]80", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)
    assert format_address("::1", 5) == "[::1]:5"
    assert format_address("10.0.0.1", 5) == "10.0.0.1:5"


def test_missing_prometheus_skips_locally_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_BIN", raising=False)
    monkeypatch.setattr(prometheus_helper.shutil, "which", lambda name: None)
    monkeypatch.setattr(prometheus_helper.os.path, "exists", lambda path: False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install prometheus"):
        prometheus_helper.prometheus_binary()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        prometheus_helper.prometheus_binary()


@pytest.mark.slow
def test_real_prometheus_scrapes_the_exporter(prometheus):  # noqa: F811
    m = Metrics()
    host, port = m.serve("127.0.0.1:0")
    try:
        m.job_state("llm", "RUNNING")
        m.job_progress("llm", step=42)
        server = prometheus([f"{host}:{port}"])
        samples = server.wait_for("tpud_job_step", lambda s: [x.value for x in s] == [42.0],
                                  timeout=20)
        assert samples[0].labels["job"] == "llm"  # honor_labels: tpud's job label wins
        assert samples[0].labels["__name__"] == "tpud_job_step"
        running = server.query('tpud_job_state{state="RUNNING"}')
        assert [(x.labels["job"], x.value) for x in running] == [("llm", 1.0)]
        assert server.query("up")[0].value == 1.0
    finally:
        m.close()


# --- the HTTP listener (tpud/metrics/listener.py) ------------------------------------------------------------

def http(address: tuple[str, int], request: bytes, timeout: float = 10) -> bytes:
    """Send `request` raw and read the whole answer (the listener closes after it)."""
    with socket.create_connection(address, timeout=timeout) as s:
        s.sendall(request)
        answer = bytearray()
        while chunk := s.recv(1 << 16):
            answer += chunk
    return bytes(answer)


GET = b"GET /metrics HTTP/1.1\r\nHost: tpud\r\n\r\n"


def test_a_scrape_storm_is_served_by_one_thread_at_a_bounded_rate(metrics):
    """20 clients scraping back to back: every answer is whole, no thread is started per scrape,
    and no more than the exporter's rate are answered (what a storm can cost the daemon)."""
    feed(metrics, "llm", 0.0)
    threads_before = {t.name for t in threading.enumerate()}
    stop, answers, errors = threading.Event(), [], []

    def scrape() -> None:
        while not stop.is_set():
            try:
                answers.append(http(metrics.address, GET))
            except OSError as e:
                errors.append(e)

    clients = [threading.Thread(target=scrape, name=f"client-{i}") for i in range(20)]
    started = time.monotonic()
    for t in clients:
        t.start()
    time.sleep(2)
    servers = {t.name for t in threading.enumerate()} - threads_before - {t.name for t in clients}
    stop.set()
    for t in clients:
        t.join(30)
    elapsed = time.monotonic() - started
    assert not servers, f"threads started to serve scrapes: {sorted(servers)[:5]}"
    assert not errors and answers
    assert all(a.startswith(b"HTTP/1.0 200 OK\r\n") and a.endswith(b"tpud_heartbeat_age_seconds{job=\"llm\"} 1000.0\n")
               for a in answers)
    assert len(answers) <= exporter.RATE * elapsed + 2  # +2: the first answer is due at once, and rounding


def test_silent_clients_are_dropped_and_at_the_limit_make_way(clock):
    m = Metrics(clock=clock)
    server = exporter.Exporter(m.exposition, max_connections=3, timeout=0.5)
    address = server.start("127.0.0.1", 0)
    try:
        silent = [socket.create_connection(address, timeout=5) for _ in range(3)]
        silent[2].sendall(b"GET /metrics HTTP/1.0\r\n")  # half a head
        assert http(address, GET).startswith(b"HTTP/1.0 200 OK")  # the first silent one made way
        assert silent[0].recv(1) == b""
        started = time.monotonic()
        assert silent[1].recv(1) == b"" and silent[2].recv(1) == b""  # and the others timed out
        assert time.monotonic() - started < 5  # a stall guard: dropped after 0.5 s
        for s in silent:
            s.close()
    finally:
        server.close()


def test_head_and_what_is_not_a_get(metrics):
    head = http(metrics.address, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert int(re.search(rb"Content-Length: (\d+)", head).group(1)) == len(metrics.exposition())
    assert http(metrics.address, b"POST /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 405 ")
    assert http(metrics.address, b"\x16\x03\x01 not http\r\n\r\n").startswith(b"HTTP/1.0 400 ")
    huge = b"GET /metrics HTTP/1.0\r\nX: " + b"a" * 20000 + b"\r\n\r\n"
    try:
        assert http(metrics.address, huge).startswith(b"HTTP/1.0 431 ")
    except ConnectionResetError:
        pass  # the answer was sent, then the unread rest of the head reset the connection
    assert scrape(metrics)  # still serving


def test_the_auto_intervals_of_the_worker_and_the_uploader_reach_status_and_metrics(metrics):
    """A step event's auto tiers and the GCS uploader's policy, as JobCheckpoints keeps them: each
    in `tpud status` (json and its line) and in the gauges."""
    from engine import events
    from engine.checkpoint.policy import Interval
    from tpud.job.commits import JobCheckpoints
    from tpud.view.status import lines

    posted = []
    checkpoints = JobCheckpoints("llm", metrics, posted.append)
    memory = Interval(12, 0.6, 0.004, 2.0, 0.304).as_dict()
    checkpoints.on_step(events.Step(step=40, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1e4, step_time_s=0.05,
                                    checkpoint_intervals={"memory": memory}))
    gcs = Interval(None, 268.3, 10.0, 2.0, 144.2)
    checkpoints.upload_result((40, 0), None, "down", gcs)
    for fn in posted:
        fn()
    checkpoints.on_step(events.Step(step=41, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1e4, step_time_s=0.05,
                                    checkpoint_intervals={"memory": memory}))
    snapshot = checkpoints.snapshot()
    assert snapshot["checkpoint_intervals"] == {"memory": memory, "gcs": gcs.as_dict()}  # the uploader's stays
    line = [x for x in lines([{"name": "llm", "state": "RUNNING", **snapshot}]) if "auto checkpoints" in x]
    assert line == ["llm: auto checkpoints: gcs every 268s, an upload 10s, ~144s lost per disruption; memory every "
                    "12 steps (0.6s), a save 4ms, ~0.304s lost per disruption; assuming 2 disruptions/h"]
    s = scrape(metrics)
    assert value(s, "tpud_checkpoint_auto_interval_steps", job="llm", tier="memory") == 12
    assert value(s, "tpud_checkpoint_auto_interval_seconds", job="llm", tier="gcs") == pytest.approx(268.3)
    assert value(s, "tpud_checkpoint_save_cost_seconds", job="llm", tier="gcs") == 10.0
    assert value(s, "tpud_checkpoint_expected_loss_seconds", job="llm", tier="memory") == pytest.approx(0.304)
    assert value(s, "tpud_job_assumed_disruptions_per_second", job="llm") == pytest.approx(2 / 3600)
    assert [lab["tier"] for lab, _ in s["tpud_checkpoint_auto_interval_steps"]] == ["memory"]  # gcs: in seconds


def test_rollbacks_reach_the_counters_and_status_with_the_skip_ledger(metrics, tmp_path):
    from engine import events
    from engine.health.ledger import SkipLedger
    from testkit.recorders import array_loader
    from tpud.job.report import WorkerReport
    from tpud.view.status import lines

    path = tmp_path / "data_skips.json"
    report = WorkerReport("llm", metrics, lambda: 0.0, path)
    assert report.snapshot(100)["healing"] is None  # nothing healed, no ledger
    loader = array_loader(__import__("numpy").arange(8 * 50), seq_len=7, micro_batch_size=2)
    SkipLedger(path, per_micro_batch=2).skip(loader, step=30, steps=1, reason="spike", loss=7.5)
    report.on_rolled_back(events.RolledBack(step=30, kind="spike", reason="loss spike: loss 7.5 at step 30",
                                            restored_step=28, verdict="data", skip=(29, 1), samples=(58, 2),
                                            redone_steps=2, seconds=0.4))
    report.on_rolled_back(events.RolledBack(step=41, kind="nonfinite", reason="non-finite loss", restored_step=40,
                                            verdict="hardware", skip=None, samples=None, redone_steps=1,
                                            seconds=0.2))
    healing = report.snapshot(100)["healing"]
    assert (healing["rollbacks"], healing["hardware"], healing["redone_steps"]) == (2, 1, 3)
    assert healing["skipped"] == {"ranges": 1, "samples": 2,
                                  "last": {"reason": "spike", "step": 30, "samples": [58, 2], "loss": 7.5}}
    line = [x for x in lines([{"name": "llm", "state": "RUNNING", "healing": healing}]) if "healing" in x]
    assert line == ["llm: healing: 2 rollbacks (1 not reproduced: hardware suspected), 3 steps redone; 2 samples "
                    "skipped in 1 ranges (data_skips.json); last at step 41: non-finite loss"]
    s = scrape(metrics)
    assert value(s, "tpud_job_rollbacks_total", job="llm", kind="spike", verdict="data") == 1
    assert value(s, "tpud_job_rollbacks_total", job="llm", kind="nonfinite", verdict="hardware") == 1
    assert value(s, "tpud_job_skipped_samples_total", job="llm") == 2
    assert value(s, "tpud_job_redone_steps_total", job="llm") == 3
    path.write_text("{not json")  # damaged: status says what this daemon saw, and never fails
    assert report.snapshot(100)["healing"]["skipped"] is None


def test_a_straggler_reaches_its_gauge_and_a_status_line_until_cleared(metrics):
    from engine import events
    from tpud.job.report import WorkerReport
    from tpud.view.status import lines

    report = WorkerReport("llm", metrics, lambda: 0.0)
    assert report.snapshot(100)["stragglers"] == []
    reason = "rank 2 is a straggler: its forward took 1.62x the others' median at step 40 (20 steps at or over 1.5x)"
    report.on_straggler(events.Straggler(step=40, straggler=2, rank=0, ratio=1.62, flagged=True, evicted=False,
                                         reason=reason))
    (flagged,) = report.snapshot(100)["stragglers"]
    assert (flagged["host"], flagged["ratio"], flagged["flagged"]) == (2, 1.62, True)
    assert value(scrape(metrics), "tpud_job_straggler_ratio", job="llm", host="2") == pytest.approx(1.62)
    job = {"name": "llm", "state": "RUNNING", "stragglers": report.snapshot(100)["stragglers"]}
    assert [x for x in lines([job]) if "straggler" in x] == [f"llm: straggler: {reason}"]
    report.on_straggler(events.Straggler(step=60, straggler=2, rank=0, ratio=1.01, flagged=False, evicted=False,
                                         reason="rank 2 is no longer a straggler"))
    assert value(scrape(metrics), "tpud_job_straggler_ratio", job="llm", host="2") == 0
    job["stragglers"] = report.snapshot(100)["stragglers"]
    assert not [x for x in lines([job]) if "straggler" in x]  # cleared: the json keeps it, the table does not


def test_the_device_truth_of_a_step_reaches_status_and_metrics(metrics):
    """Device memory (in use, peak) and the graphs compiled so far, as a step event carries them:
    in `tpud status` (json and its device line) and in the gauges; a step that says nothing of the
    device (cpu, eager) shows no line."""
    from engine import events
    from tpud.job.report import WorkerReport
    from tpud.view.status import lines

    report = WorkerReport("llm", metrics, clock=lambda: 0.0)
    report.on_step(events.Step(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1e4, step_time_s=0.05))
    assert report.snapshot(10)["device"] is None
    report.on_step(events.Step(step=2, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1e4, step_time_s=0.05,
                               device_memory_bytes=14 << 30, device_memory_in_use_bytes=12 << 30, compilations=34,
                               compile_seconds=56.0))
    device = report.snapshot(10)["device"]
    assert device == {"memory_in_use_bytes": 12 << 30, "memory_peak_bytes": 14 << 30, "compilations": 34,
                      "compile_seconds": 56.0}
    assert "llm: device: memory 12.0 GiB in use (peak 14.0 GiB), 34 graphs compiled in 56s" in lines(
        [{"name": "llm", "state": "RUNNING", "device": device}])
    s = scrape(metrics)
    assert value(s, "tpud_job_device_memory_bytes", job="llm", kind="in_use") == 12 << 30
    assert value(s, "tpud_job_device_memory_bytes", job="llm", kind="peak") == 14 << 30
    assert value(s, "tpud_job_compilations", job="llm") == 34 and value(s, "tpud_job_compile_seconds", job="llm") == 56

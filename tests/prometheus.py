"""A real Prometheus for tests: Debian's `prometheus` binary (apt-get install prometheus).

PrometheusServer writes a config that scrapes the given targets every second (with
honor_labels, so tpud's own `job` label is kept rather than renamed to `exported_job`), starts
the binary with its TSDB in a temporary directory and its web listener on a free loopback
port, waits for /-/ready, answers instant queries through /api/v1/query, and kills the
process on close(). The `prometheus` fixture hands out servers and closes them all at the
end of the test.

A missing binary skips the test, unless $CI is set: in CI a missing binary fails it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.helpers import free_port


def prometheus_binary() -> str:
    """The binary's path; skips the test if missing (fails it when $CI is set)."""
    found = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")
    if not found and os.path.exists("/usr/bin/prometheus"):
        found = "/usr/bin/prometheus"
    if found:
        return found
    reason = "the prometheus binary is missing (Debian: apt-get install prometheus)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI is set, so this is an error, not a skip", pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float
    timestamp: float


class PrometheusServer:
    def __init__(self, workdir: Path, targets: Sequence[str], *, scrape_interval: str = "1s"):
        self.workdir = Path(workdir)
        self.targets = list(targets)
        self.scrape_interval = scrape_interval
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.url = ""
        self.log = self.workdir / "prometheus.log"

    def _write_config(self) -> Path:
        # JSON is YAML: no quoting surprises for IPv6 targets.
        config = {
            "global": {"scrape_interval": self.scrape_interval,
                       "evaluation_interval": self.scrape_interval,
                       "scrape_timeout": self.scrape_interval},
            "scrape_configs": [{"job_name": "tpud", "honor_labels": True,
                                "static_configs": [{"targets": self.targets}]}],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2) + "\n")
        return path

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        binary = prometheus_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        for attempt in range(3):  # a free port can be taken between picking and binding
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [binary, f"--config.file={config}",
                     f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}",
                     "--log.level=warn"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)  # a ^C in the terminal does not reach it first
            if self._wait_ready(timeout):
                return self
            exited = self.proc.poll() is not None
            self._kill()
            if not exited or attempt == 2:
                break
        raise RuntimeError(f"prometheus did not become ready; log:\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        return False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def query(self, expr: str) -> list[Sample]:
        """An instant query: one Sample per series (a scalar result gives one, without labels)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body.get('errorType')}: {body.get('error')}")
        data = body["data"]
        if data["resultType"] == "vector":
            return [Sample(item["metric"], float(item["value"][1]), float(item["value"][0]))
                    for item in data["result"]]
        if data["resultType"] in ("scalar", "string"):
            ts, value = data["result"]
            return [Sample({}, float(value), float(ts))]
        raise RuntimeError(f"query {expr!r}: result type {data['resultType']} is not supported")

    def wait_for(self, expr: str, predicate: Callable[[list[Sample]], bool], timeout: float = 20.0
                 ) -> list[Sample]:
        """Poll query(expr) until predicate(samples) holds; fail with the last result and the
        scrape targets' health after timeout seconds."""
        deadline = time.monotonic() + timeout
        samples: list[Sample] = []
        while True:
            samples = self.query(expr)
            if predicate(samples):
                return samples
            if time.monotonic() >= deadline:
                raise AssertionError(f"{expr!r} after {timeout} s: {samples}; targets: "
                                     f"{self.targets_health()}; log:\n{self.log_tail()}")
            time.sleep(0.2)

    def targets_health(self) -> list[dict]:
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5) as r:
                active = json.load(r)["data"]["activeTargets"]
        except Exception as e:  # diagnostics only
            return [{"error": repr(e)}]
        return [{k: t.get(k) for k in ("scrapeUrl", "health", "lastError")} for t in active]

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self._kill()

    def __enter__(self) -> PrometheusServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def prometheus(tmp_path) -> Iterator[Callable[..., PrometheusServer]]:
    """prometheus(targets) -> a started PrometheusServer scraping them every second."""
    servers: list[PrometheusServer] = []

    def start(targets: Sequence[str], **kw) -> PrometheusServer:
        server = PrometheusServer(tmp_path / f"prometheus-{len(servers)}", targets, **kw)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.close()

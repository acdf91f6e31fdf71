"""The fork server (restart.standby): workers forked warm train as cold ones do, their exits are
relayed, a stop asked at once is not fatal, and nothing outlives the server. Real processes."""

from __future__ import annotations

import os
import select
import signal
from pathlib import Path

import pytest

from tests.conftest import REPO
from testkit.helpers import committed, exited, wait_until
from tpud.paths import Paths
from tpud.worker.forkserver import ForkServer
from tpud.children.process import WorkerProcess

pytestmark = pytest.mark.slow  # real worker processes importing torch


class Loop:
    """The daemon's loop as the fork server uses it: watched sockets, posted calls."""

    def __init__(self):
        self.watched, self.posted = {}, []

    def watch(self, fileobj, callback):
        self.watched[fileobj] = callback

    def unwatch(self, fileobj):
        self.watched.pop(fileobj, None)

    def post(self, fn):
        self.posted.append(fn)

    def turn(self, timeout=0.1) -> None:
        readable = select.select(list(self.watched), [], [], timeout)[0] if self.watched else []
        for fileobj in readable:
            if fileobj in self.watched:
                self.watched[fileobj]()
        posted, self.posted = self.posted, []
        for fn in posted:
            fn()


@pytest.fixture(scope="module")
def warm():
    """One warm server for the module (its imports are the seconds a cold worker pays each time)."""
    loop = Loop()
    server = ForkServer(loop)
    woken = []
    assert not server.ready()  # started now; importing
    server.when_ready(lambda: woken.append(True))
    wait_until(lambda: (loop.turn(), server.warm)[1], "the fork server's imports", timeout=120)
    loop.turn()
    assert woken == [True] and server.ready()
    yield loop, server
    server.close()


def spawn(server, spec, tmp_path) -> WorkerProcess:
    return WorkerProcess(spec, Paths.resolve(tmp_path), "json", extra_env={"PYTHONPATH": str(REPO)},
                         forkserver=server)


def output(worker) -> str:
    os.set_blocking(worker.stdout.fileno(), True)
    return worker.stdout.read().decode(errors="replace")


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (/proc's SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_forked_worker_trains_as_a_cold_one_and_its_exit_is_relayed(warm, tiny_spec, tmp_path):
    loop, server = warm
    spec = tiny_spec("train.max_steps=3", "scheduler.warmup_steps=1", "checkpoint.interval_steps=3")
    worker = spawn(server, spec, tmp_path)
    assert worker.forked and worker.pid != server.proc.pid
    # What `ps` shows is the worker's own command line; its parent is the server, in a session of its own.
    spec_file = str(Paths.resolve(tmp_path).layout.spec_file(spec.name))
    wait_until(lambda: f"-m tpud.worker {spec_file}" in Path(f"/proc/{worker.pid}/cmdline").read_bytes()
               .replace(b"\0", b" ").decode(), "the worker's command line", timeout=10)
    assert os.getsid(worker.pid) == worker.pid
    text = output(worker)
    assert worker.wait() == 0, text[-3000:]
    assert '"event": "training finished"' in text  # stdout and stderr reached the daemon's pipe
    assert committed(Paths.resolve(tmp_path).layout.checkpoints(spec.name)) == [(3, 0)]


def test_a_worker_killed_by_a_signal_reports_128_plus_it(warm, tiny_spec, tmp_path):
    loop, server = warm
    worker = spawn(server, tiny_spec("train.max_steps=100000"), tmp_path)
    worker.signal(signal.SIGKILL)
    output(worker)
    assert worker.wait() == 128 + signal.SIGKILL


def test_a_stop_asked_the_instant_a_worker_is_forked_is_a_checkpoint_and_exit_75(warm, tiny_spec, tmp_path):
    """SIGTERM before the worker's hooks exist is recorded, not fatal: it checkpoints and exits 75."""
    loop, server = warm
    spec = tiny_spec("train.max_steps=100000", "checkpoint.interval_steps=0")
    worker = spawn(server, spec, tmp_path)
    worker.signal(signal.SIGTERM)
    text = output(worker)
    assert worker.wait() == 75, text[-3000:]
    assert committed(Paths.resolve(tmp_path).layout.checkpoints(spec.name)) == [(0, 0)]  # no step trained


def test_a_cold_worker_asked_to_stop_while_it_imports_stops_as_asked(tiny_spec, tmp_path):
    """The cold start (no fork server) records a SIGTERM from its first instant too."""
    spec = tiny_spec("train.max_steps=100000", "checkpoint.interval_steps=0")
    worker = WorkerProcess(spec, Paths.resolve(tmp_path), "json", extra_env={"PYTHONPATH": str(REPO)})
    assert not worker.forked
    wait_until(lambda: catches(worker.pid, signal.SIGTERM), "a SIGTERM handler from the start", timeout=60)
    worker.signal(signal.SIGTERM)
    text = output(worker)
    assert worker.wait() == 75, text[-3000:]
    assert committed(Paths.resolve(tmp_path).layout.checkpoints(spec.name)) == [(0, 0)]


def test_a_killed_server_takes_its_workers_and_the_next_start_brings_a_new_one(tiny_spec, tmp_path):
    loop = Loop()
    server = ForkServer(loop)
    try:
        server.ready()
        wait_until(lambda: (loop.turn(), server.warm)[1], "the fork server's imports", timeout=120)
        worker = spawn(server, tiny_spec("train.max_steps=100000"), tmp_path)
        first = server.proc.pid
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: (loop.turn(), server.proc is None)[1], "the server's death seen", timeout=30)
        wait_until(lambda: exited(worker.pid), "its worker gone with it (parent-death signal)", timeout=30)
        output(worker)
        assert worker.wait() == 128 + signal.SIGKILL
        # It had lived: the next worker wanted starts a new server at once (and waits for its imports).
        assert not server.ready() and server.proc.pid != first
        assert server.fork(["spec.json"], {}) is None  # while it imports: the caller starts a worker cold
    finally:
        server.close()

"""The control socket (tpud.control) and its CLI commands (status, checkpoint-now, stop, start),
against a real ControlServer on a Unix socket with a stub handler; then fuzzing the server."""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import threading
import time

import pytest

from testkit.helpers import tpud_imports
from tpud.cli import main
from tpud.control import MAX_CONNECTIONS, MAX_LINE, ControlClient, ControlError, ControlServer, DaemonUnreachable

JOBS = {
    "llama": {"name": "llama", "state": "RUNNING", "step": 1200, "max_steps": 5000, "loss": 2.3456789,
              "tokens_per_second": 123456.0, "mfu": 0.41234, "restarts": 1,
              "last_checkpoint": {"step": 1000, "tier": "local", "age_seconds": 301.0}, "error": None,
              "age_seconds": 3 * 3600 + 5, "goodput": {"ratio": 0.9234}},
    "broken": {"name": "broken", "state": "PENDING", "step": None, "max_steps": None, "loss": None,
               "tokens_per_second": None, "mfu": None, "restarts": 0, "last_checkpoint": None,
               "error": "/etc/tpud/jobs.d/broken.yaml:3: optim.lr: Input should be a valid number\n"
                        "/etc/tpud/jobs.d/broken.yaml:7: train.max_steps: Input should be greater than 0",
               "age_seconds": 42},
}


class Stub:
    """The daemon's side: canned results, every request recorded, one deliberately slow job."""

    def __init__(self):
        self.requests: list[dict] = []
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self, request: dict) -> dict:
        self.requests.append(request)
        command = request["command"]
        if command == "status":
            if "slow" in request["jobs"]:
                self.entered.set()
                assert self.release.wait(5)
            if "explode" in request["jobs"]:
                raise RuntimeError("boom")
            if "nan" in request["jobs"]:
                return {"jobs": [{**JOBS["llama"], "loss": float("nan")}]}
            if "big" in request["jobs"]:
                return {"jobs": [], "padding": "x" * (8 << 20)}
            unknown = [j for j in request["jobs"] if j not in JOBS]
            if unknown:
                raise ControlError("unknown_job", f"no job named {unknown[0]}")
            return {"jobs": [JOBS[j] for j in request["jobs"] or JOBS]}
        if command == "checkpoint_now":
            results = []
            for job in request["jobs"] or ["llama"]:
                if job == "idle":
                    raise ControlError("not_running", "job idle is not running (STOPPED)")
                if not request["wait"]:
                    results.append({"job": job, "ok": True, "step": None, "micro_step": None, "tier": None,
                                    "path": None, "seconds": None, "error": None})
                elif job == "bad":
                    results.append({"job": job, "ok": False, "step": None, "micro_step": None, "tier": None,
                                    "path": None, "seconds": 1.5, "error": "disk full"})
                else:
                    results.append({"job": job, "ok": True, "step": 1201, "micro_step": 0, "tier": "local",
                                    "path": f"/ckpt/{job}/step_000001201", "seconds": 3.25, "error": None})
            return {"results": results}
        if request["job"] not in ("llama", "broken"):
            raise ControlError("unknown_job", f"no job named {request['job']}")
        return {"job": request["job"], "state": "STOPPING" if command == "stop" else "STARTING"}


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture
def sock_path(home):
    return home / "run" / "control.sock"


@pytest.fixture
def stub():
    return Stub()


@pytest.fixture
def server(sock_path, stub):
    server = ControlServer(sock_path, stub, idle_timeout=5.0)
    server.start()
    yield server
    stub.release.set()
    # whatever a test threw at it, the server still answers a valid request
    assert ControlClient(sock_path, timeout=5).call("status", jobs=["llama"]) == {"jobs": [JOBS["llama"]]}
    server.close()
    assert not sock_path.exists()


def connect(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def read_line(s: socket.socket, buffer: bytearray | None = None) -> dict | None:
    """One reply line, or None at EOF."""
    buffer = bytearray() if buffer is None else buffer
    while b"\n" not in buffer:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return None
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


def ask(s: socket.socket, line: bytes) -> dict | None:
    s.sendall(line + b"\n")
    return read_line(s)


STATUS = json.dumps({"version": 1, "command": "status", "jobs": ["llama"]}).encode()


# --- CLI round trips -------------------------------------------------------------------------------

def test_status_table(server, home, capsys):
    assert main(["status", "--home", str(home)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["JOB", "STATE", "STEP/MAX", "LOSS", "TOK/S", "MFU", "LAST-CKPT", "RESTARTS",
                                "GOODPUT", "USEFUL", "AGE"]
    assert lines[1].split() == ["llama", "RUNNING", "1200/5000", "2.346", "123.5k", "41.2%", "1000@local", "5m",
                                "1", "92.3%", "38.1%", "3h"]
    assert lines[2].split() == ["broken", "PENDING", "-", "-", "-", "-", "-", "0", "-", "-", "42s"]
    assert lines[0].index("STATE") == lines[1].index("RUNNING")  # aligned columns
    error_at = lines.index("broken: error:")
    assert lines[error_at + 1:] == ["  /etc/tpud/jobs.d/broken.yaml:3: optim.lr: Input should be a valid number",
                                    "  /etc/tpud/jobs.d/broken.yaml:7: train.max_steps: Input should be greater than 0"]


def test_status_json_and_job_filter(server, home, stub, capsys):
    assert main(["status", "llama", "-o", "json", "--home", str(home)]) == 0
    assert json.loads(capsys.readouterr().out) == {"jobs": [JOBS["llama"]]}
    assert stub.requests[-1] == {"version": 1, "command": "status", "jobs": ["llama"], "gang": False}


def test_status_uses_tpud_home(server, home, monkeypatch, capsys):
    monkeypatch.setenv("TPUD_HOME", str(home))
    assert main(["status", "-o", "json"]) == 0
    assert [j["name"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["llama", "broken"]


def test_status_unknown_job_exits_3(server, home, capsys):
    assert main(["status", "nope", "--home", str(home)]) == 3
    captured = capsys.readouterr()
    assert "no job named nope" in captured.err and captured.out == ""


def test_status_non_finite_loss_is_null(server, home, capsys):
    assert main(["status", "nan", "-o", "json", "--home", str(home)]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"][0]["loss"] is None  # strict JSON for jq


def test_checkpoint_now_waits_and_prints(server, home, stub, capsys):
    assert main(["checkpoint-now", "llama", "--timeout", "30", "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert "llama: step 1201" in out and "local" in out and "/ckpt/llama/step_000001201" in out and "3.2s" in out
    assert stub.requests[-1] == {"version": 1, "command": "checkpoint_now", "jobs": ["llama"], "wait": True,
                                 "timeout": 30.0}


def test_checkpoint_now_no_wait(server, home, stub, capsys):
    assert main(["checkpoint-now", "--no-wait", "--home", str(home)]) == 0
    assert "llama: checkpoint requested" in capsys.readouterr().out
    assert stub.requests[-1]["wait"] is False and stub.requests[-1]["jobs"] == []


def test_checkpoint_now_failure_exits_1(server, home, capsys):
    assert main(["checkpoint-now", "llama", "bad", "--home", str(home)]) == 1
    out = capsys.readouterr().out
    assert "llama: step 1201" in out and "bad: checkpoint failed: disk full" in out


def test_checkpoint_now_not_running_exits_3(server, home, capsys):
    assert main(["checkpoint-now", "idle", "--home", str(home)]) == 3
    assert "not running" in capsys.readouterr().err


@pytest.mark.parametrize("command,state", [("stop", "STOPPING"), ("start", "STARTING")])
def test_stop_start(server, home, stub, capsys, command, state):
    assert main([command, "llama", "--home", str(home)]) == 0
    assert capsys.readouterr().out.strip() == f"llama: {state}"
    assert stub.requests[-1] == {"version": 1, "command": command, "job": "llama"}
    assert main([command, "ghost", "--home", str(home)]) == 3
    assert "no job named ghost" in capsys.readouterr().err


# What the control-socket commands must not import: each costs tens to hundreds of milliseconds
# (the job-spec loader with pydantic and YAML, structlog with its dev console and rich), or, torch,
# seconds; `tpud status` starts in a small part of that.
HEAVY = ("pydantic", "pydantic_core", "yaml", "structlog", "rich", "torch", "numpy", "prometheus_client")


@pytest.mark.parametrize("argv", [["status"], ["status", "llama", "-o", "json"], ["checkpoint-now", "llama"],
                                  ["checkpoint-now", "--no-wait"], ["stop", "llama"], ["start", "llama"]])
def test_control_commands_import_nothing_heavy(server, home, argv):
    done, imported = tpud_imports("--home", str(home), *argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"tpud.cli", "tpud.control"} <= imported  # the whole command ran, and -X importtime listed it
    heavy = sorted({"engine.spec" if m.startswith("engine.spec") else m.partition(".")[0] for m in imported
                    if m.partition(".")[0] in HEAVY or m.startswith("engine.spec")})
    assert not heavy, f"tpud {' '.join(argv)} imported {', '.join(heavy)}"


@pytest.mark.parametrize("argv", [["status"], ["checkpoint-now"], ["stop", "x"], ["start", "x"]])
def test_no_socket_exits_4(tmp_path, capsys, argv):
    assert main([*argv, "--home", str(tmp_path)]) == 4
    err = capsys.readouterr().err
    assert str(tmp_path / "run" / "control.sock") in err and "no such socket" in err
    assert "--home" in err and "TPUD_HOME" in err and "not be running" in err


def test_stale_socket_exits_4_then_server_replaces_it(home, sock_path, stub, capsys):
    sock_path.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock_path))
    dead.close()  # the file stays, nobody listens
    assert main(["status", "--home", str(home)]) == 4
    assert "connection refused" in capsys.readouterr().err
    with ControlServer(sock_path, stub):
        assert main(["status", "llama", "--home", str(home)]) == 0


def test_socket_modes_and_second_server_refused(server, sock_path, stub):
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o750
    with pytest.raises(OSError, match="another daemon"):
        ControlServer(sock_path, stub).start()  # a live socket is not "stale"


def test_others_are_denied(server, sock_path):
    """The 0660 socket in its 0750 directory keeps other users out (checked as nobody when root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, try to connect, report the reason
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            ControlClient(sock_path, timeout=2).call("status")
            os.write(write, b"connected")
        except DaemonUnreachable as e:
            os.write(write, e.reason.encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1000).decode().startswith("permission denied")
    os.close(read)


# --- client ---------------------------------------------------------------------------------------

def test_client_errors(server, sock_path, stub):
    client = ControlClient(sock_path)
    assert client.call("stop", job="llama") == {"job": "llama", "state": "STOPPING"}
    with pytest.raises(ControlError) as e:
        client.call("stop", job="ghost")
    assert e.value.code == "unknown_job"
    with pytest.raises(ControlError) as e:
        client.call("reboot")
    assert e.value.code == "bad_request" and "unknown command" in e.value.message
    with pytest.raises(ControlError) as e:
        client.call("status", jobs=["explode"])  # the handler raised: internal, and the server lives on
    assert e.value.code == "internal" and "boom" in e.value.message
    with pytest.raises(DaemonUnreachable) as e:
        ControlClient(sock_path, timeout=0.3).call("status", jobs=["slow"])
    assert e.value.path == sock_path and "no reply" in e.value.reason
    stub.release.set()


# --- fuzzing --------------------------------------------------------------------------------------

BAD_LINES = [
    b"", b"   ", b"{", b"}", b"[]", b"42", b'"status"', b"null", b"true", b"\xff\xfe\x00garbage", b"{'version': 1}",
    b'{"command": "status"}',                                          # no version
    b'{"version": 2, "command": "status"}', b'{"version": "1", "command": "status"}',
    b'{"version": true, "command": "status"}', b'{"version": null, "command": "status"}',
    b'{"version": NaN, "command": "status"}', b'{"version": [1], "command": "status"}',
    b'{"version": 1}', b'{"version": 1, "command": "reboot"}', b'{"version": 1, "command": ["status"]}',
    b'{"version": 1, "command": {"a": 1}}', b'{"version": 1, "command": 7}',
    b'{"version": 1, "command": "status", "jobs": "llama"}', b'{"version": 1, "command": "status", "jobs": [1]}',
    b'{"version": 1, "command": "status", "jobs": [""]}', b'{"version": 1, "command": "status", "jobs": null}',
    b'{"version": 1, "command": "status", "jobs": [], "force": true}',
    b'{"version": 1, "command": "checkpoint_now", "wait": "yes"}',
    b'{"version": 1, "command": "checkpoint_now", "wait": 1}',
    b'{"version": 1, "command": "checkpoint_now", "timeout": -1}',
    b'{"version": 1, "command": "checkpoint_now", "timeout": "5"}',
    b'{"version": 1, "command": "checkpoint_now", "timeout": 1e999}',
    b'{"version": 1, "command": "checkpoint_now", "timeout": NaN}',
    b'{"version": 1, "command": "checkpoint_now", "timeout": true}',
    b'{"version": 1, "command": "stop"}', b'{"version": 1, "command": "stop", "job": 5}',
    b'{"version": 1, "command": "start", "job": ["llama"]}', b'{"version": 1, "command": "start", "job": ""}',
    b'{"version": 1, "command": "status", "jobs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"version": 1, "command": "status"} trailing',
]


def test_bad_lines_get_errors_and_the_connection_stays_usable(server, sock_path, stub):
    with connect(sock_path) as s:
        for line in BAD_LINES:
            reply = ask(s, line)
            assert reply is not None and reply["version"] == 1 and reply["ok"] is False, line[:80]
            assert reply["code"] == "bad_request" and reply["error"], line[:80]
        assert stub.requests == []  # none reached the handler
        reply = ask(s, STATUS)
        assert reply.pop("handled_seconds") >= 0
        assert reply == {"version": 1, "ok": True, "result": {"jobs": [JOBS["llama"]]}}


def test_pipelined_requests_answered_in_order(server, sock_path):
    with connect(sock_path) as s:
        s.sendall(STATUS + b"\n" + b"nonsense\n" + json.dumps(
            {"version": 1, "command": "stop", "job": "broken"}).encode() + b"\r\n")
        buffer = bytearray()
        replies = [read_line(s, buffer) for _ in range(3)]
    assert replies[0]["result"] == {"jobs": [JOBS["llama"]]}
    assert replies[1]["code"] == "bad_request"
    assert replies[2]["result"] == {"job": "broken", "state": "STOPPING"}


def test_binary_garbage(server, sock_path, stub):
    rng = random.Random(1234)
    lines = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b"") for _ in range(200)]
    with connect(sock_path) as s:
        s.sendall(b"\n".join(lines) + b"\n")
        buffer = bytearray()
        for _ in lines:
            reply = read_line(s, buffer)
            assert reply["ok"] is False and reply["code"] == "bad_request"
        s.sendall(STATUS + b"\n")
        assert read_line(s, buffer)["ok"] is True
    assert stub.requests == [{"version": 1, "command": "status", "jobs": ["llama"], "gang": False}]


def test_huge_line_gets_an_error_and_the_connection_closed(server, sock_path, stub):
    with connect(sock_path) as s:
        try:
            s.sendall(b'{"version": 1, "command": "status", "jobs": ["' + b"a" * (MAX_LINE + 10) + b'"]}\n')
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading; its reply is still there to read
        reply = read_line(s)
        assert reply["ok"] is False and reply["code"] == "bad_request" and "longer than" in reply["error"]
        assert read_line(s) is None  # closed
    with connect(sock_path) as s:  # no newline at all: the server does not buffer more than the limit
        try:
            s.sendall(b"x" * (MAX_LINE + 10))
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_line(s)
        assert reply["code"] == "bad_request" and "longer than" in reply["error"]
        assert read_line(s) is None
    assert stub.requests == []
    with connect(sock_path) as s:  # a line just under the limit is fine
        padded = STATUS[:-1] + b" " * (MAX_LINE - len(STATUS) - 100) + b"}"
        assert len(padded) < MAX_LINE and ask(s, padded)["ok"] is True


def test_abrupt_disconnects(server, sock_path, stub):
    for partial in (b"", b"{", STATUS[:20], b'{"version": 1, "command": "status", "jobs": ["' + b"x" * 500_000):
        s = connect(sock_path)
        s.sendall(partial)
        s.close()  # mid-line
    for _ in range(5):
        s = connect(sock_path)
        s.sendall(json.dumps({"version": 1, "command": "status", "jobs": ["big"]}).encode() + b"\n")
        s.recv(10)
        s.close()  # mid-reply (8 MiB: the server is still sending)
    deadline = time.monotonic() + 2
    while server.connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.connections == 0  # all dropped long before the idle timeout
    with connect(sock_path) as s:
        assert ask(s, STATUS)["ok"] is True


def test_many_concurrent_clients(server, sock_path):
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with connect(sock_path) as s:
                for _ in range(5):
                    assert ask(s, STATUS)["result"] == {"jobs": [JOBS["llama"]]}
                    assert ask(s, b"[%d]" % i)["code"] == "bad_request"
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and not any(t.is_alive() for t in threads)


def test_slow_handler_does_not_block_other_clients(server, sock_path, stub):
    slow_reply: list[dict] = []
    slow = connect(sock_path)
    slow.sendall(json.dumps({"version": 1, "command": "status", "jobs": ["slow"]}).encode() + b"\n")
    waiter = threading.Thread(target=lambda: slow_reply.append(read_line(slow)))
    waiter.start()
    assert stub.entered.wait(5)
    started = time.monotonic()
    assert ControlClient(sock_path, timeout=2).call("status", jobs=["broken"]) == {"jobs": [JOBS["broken"]]}
    assert time.monotonic() - started < 1
    assert not slow_reply  # still held by the handler
    stub.release.set()
    waiter.join(5)
    slow.close()
    assert slow_reply[0]["code"] == "unknown_job"  # "slow" is no real job once released


def test_idle_clients_are_dropped(sock_path, stub):
    with ControlServer(sock_path, stub, idle_timeout=0.3):
        silent = connect(sock_path)
        dribbler = connect(sock_path)
        started = time.monotonic()
        try:
            for _ in range(20):  # one byte every 0.1 s never completes a line: dropped all the same
                dribbler.sendall(b" ")
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - started < 1.5
        assert read_line(silent) is None and time.monotonic() - started < 1.5
        silent.close()
        dribbler.close()
        with connect(sock_path) as s:  # an active client is not dropped between requests
            for _ in range(3):
                assert ask(s, STATUS)["ok"] is True
                time.sleep(0.2)


def flood_connect(path) -> socket.socket:
    """A connection made as a flood makes it: blocking until the listen backlog has room
    (with a timeout, connect() on a full backlog fails with EAGAIN at once)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(5)
    return s


def test_an_idle_flood_beyond_the_limit_never_locks_out_tpud_status(home, sock_path, stub, capsys):
    """More silent connections than the limit, held open well inside the idle timeout: each new
    one closes the one idle longest, and `tpud status` is answered at once."""
    flood_size = MAX_CONNECTIONS + 44
    with ControlServer(sock_path, stub) as server:  # the daemon's limit and its 60 s idle timeout
        flood = [flood_connect(sock_path) for _ in range(flood_size)]
        try:
            for s in flood[:flood_size - MAX_CONNECTIONS]:  # the oldest went, in order
                assert read_line(s) is None
            started = time.monotonic()
            assert main(["--home", str(home), "status", "llama"]) == 0
            assert time.monotonic() - started < 5  # a stall guard: refused or stuck, it would fail or wait 60 s
            assert "llama" in capsys.readouterr().out
            for s in flood[-MAX_CONNECTIONS + 1:]:  # the newest are still open (status took one place)
                s.setblocking(False)
                with pytest.raises(BlockingIOError):
                    s.recv(1)
            assert server.connections <= MAX_CONNECTIONS
        finally:
            for s in flood:
                s.close()


def test_at_the_limit_a_request_in_progress_is_kept_and_only_a_full_house_of_them_refuses(sock_path):
    inside, release = threading.Semaphore(0), threading.Event()

    def handle(request: dict) -> dict:
        if request["jobs"] == ["slow"]:
            inside.release()
            release.wait(60)
        return {"jobs": request["jobs"]}

    slow = json.dumps({"version": 1, "command": "status", "jobs": ["slow"]}).encode() + b"\n"
    with ControlServer(sock_path, handle, max_connections=2) as server:
        busy = connect(sock_path)
        busy.sendall(slow)
        assert inside.acquire(timeout=30)
        dribbler = connect(sock_path)
        dribbler.sendall(STATUS[:10])  # waiting for the rest of its line since before the next one came
        with connect(sock_path) as s:  # the dribbler makes way, not the request in progress
            assert ask(s, STATUS)["result"] == {"jobs": ["llama"]}
        assert read_line(dribbler) is None
        deadline = time.monotonic() + 30
        while server.connections > 1 and time.monotonic() < deadline:  # until the asker's thread has seen it go
            time.sleep(0.01)
        stalled = connect(sock_path)  # both places taken by requests in progress
        stalled.sendall(slow)
        assert inside.acquire(timeout=30)
        with connect(sock_path) as s:  # nothing idle to close: refused, with the reason
            reply = read_line(s)
            assert reply["ok"] is False and "too many control connections" in reply["error"]
        release.set()
        assert read_line(busy)["result"] == read_line(stalled)["result"] == {"jobs": ["slow"]}
        for s in (busy, stalled, dribbler):
            s.close()
        assert ControlClient(sock_path, timeout=5).call("status", jobs=["llama"]) == {"jobs": ["llama"]}
        assert server.connections <= 2

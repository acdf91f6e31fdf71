"""tpud.job.health.crashes: real worker-like processes die, and their merged output is classified."""

from __future__ import annotations

import json
import subprocess
import textwrap
from collections import deque

import pytest

from tests.conftest import PYTHON, python_env
from tpud.job.health import crashes
from tpud.job.health.crashes import MAX_MESSAGE, REASONS, classify, oom_kill_count


def run(tmp_path, code: str, *flags: str, **env: str) -> tuple[int, list[str]]:
    """Run code as train.py with stdout and stderr merged, as the daemon runs a worker."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code))
    proc = subprocess.run([PYTHON, *flags, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=python_env(**env), timeout=60)
    status = 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # as WorkerProcess reports it
    return status, list(deque(proc.stdout.decode(errors="replace").splitlines(), maxlen=100))


def test_uncaught_exception_names_the_innermost_frame(tmp_path):
    status, tail = run(tmp_path, """\
        def step(x):
            raise RuntimeError(f"boom at {x}")

        def main():
            step(3)

        main()
        """)
    crash = classify(status, tail)
    assert (status, crash.reason) == (1, "exception")
    assert crash.message == "RuntimeError: boom at 3 (train.py:2 in step)"
    assert crash.detail[0] == "Traceback (most recent call last):"
    assert crash.detail[-1] == "RuntimeError: boom at 3"


def test_chained_exception_reports_the_last(tmp_path):
    status, tail = run(tmp_path, """\
        try:
            {}["shard"]
        except KeyError as e:
            raise ValueError("no shard in the index") from e
        """)
    crash = classify(status, tail)
    assert crash.reason == "exception"
    assert crash.message == "ValueError: no shard in the index (train.py:4 in <module>)"
    assert "KeyError" not in "".join(crash.detail)


def test_traceback_whose_header_the_tail_cut_off(tmp_path):
    status, tail = run(tmp_path, """\
        def a(): b()
        def b(): c()
        def c(): raise OSError("disk gone")
        a()
        """)
    assert tail[0] == "Traceback (most recent call last):"
    crash = classify(status, tail[3:])
    assert crash.message == "OSError: disk gone (train.py:3 in c)"


def test_memory_error_is_oom(tmp_path):
    status, tail = run(tmp_path, "buffer = bytearray(1 << 62)\n")
    crash = classify(status, tail)
    assert crash.reason == "oom"
    assert crash.message == "MemoryError (train.py:1 in <module>)"


def test_segfault(tmp_path):
    code = "import os, signal\nprint('step 1')\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    status, tail = run(tmp_path, code)
    assert status == 139
    assert classify(status, tail) == crashes.Crash("signal", "killed by SIGSEGV", ["step 1"])
    # With faulthandler on, its report is the last error and its stack the detail.
    crash = classify(*run(tmp_path, code, "-X", "faulthandler"))
    assert crash.reason == "signal"
    assert crash.message == "killed by SIGSEGV (Fatal Python error: Segmentation fault)"
    assert any(line.startswith("Current thread") for line in crash.detail)


def test_sigkill_is_oom_only_when_the_cgroup_counted_a_kill(tmp_path):
    status, tail = run(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert status == 137
    assert classify(status, tail) == crashes.Crash("killed", "killed by SIGKILL", [])
    assert classify(status, tail, oom_kills_before=2, oom_kills_after=2).reason == "killed"
    assert classify(status, tail, oom_kills_before=None, oom_kills_after=3).reason == "killed"
    crash = classify(status, tail, oom_kills_before=2, oom_kills_after=3)
    assert (crash.reason, crash.message) == ("oom", "out of memory: killed by the kernel's OOM killer")


def test_exit_status(tmp_path):
    status, tail = run(tmp_path, """\
        import sys
        print("loading shards")
        print("ERROR: disk on fire", file=sys.stderr)
        print("cleaning up")
        sys.exit(3)
        """)
    assert classify(status, tail) == crashes.Crash(
        "crash", "exited with status 3 (ERROR: disk on fire)", ["ERROR: disk on fire", "cleaning up"])
    assert classify(*run(tmp_path, "raise SystemExit(3)\n")) == crashes.Crash("crash", "exited with status 3")


def test_structlog_json_exception(tmp_path):
    # The worker's own logging set-up (engine.logs), forced to JSON as under the daemon.
    status, tail = run(tmp_path, """\
        import sys
        import structlog
        from engine import logs

        logs.configure()
        log = structlog.get_logger()
        log.info("step", step=1)

        def load(path):
            raise FileNotFoundError(f"no shard {path}")

        try:
            load("shard-7")
        except OSError:
            log.exception("data loader failed", step=2)
        assert "torch" not in sys.modules
        sys.exit(1)
        """, TPUD_LOG_FORMAT="json")
    assert json.loads(tail[-1])["event"] == "data loader failed"
    crash = classify(status, tail)
    assert crash.reason == "exception"
    assert crash.message == "FileNotFoundError: no shard shard-7 (train.py:10 in load)"
    assert crash.detail[-1] == "FileNotFoundError: no shard shard-7"


def test_a_signal_after_a_logged_exception_is_the_signal(tmp_path):
    status, tail = run(tmp_path, """\
        import os, signal
        import structlog
        from engine import logs

        logs.configure()
        try:
            raise TimeoutError("slow shard")
        except TimeoutError:
            structlog.get_logger().exception("retrying")
        os.kill(os.getpid(), signal.SIGSEGV)
        """, TPUD_LOG_FORMAT="json")
    crash = classify(status, tail)
    assert crash.reason == "signal"
    assert crash.message.startswith("killed by SIGSEGV (TimeoutError: slow shard")


def test_an_uncaught_exception_outranks_a_crash_at_exit(tmp_path):
    # torch_xla can segfault while tearing down after an uncaught exception: the exception is the cause.
    status, tail = run(tmp_path, """\
        import atexit, os, signal
        atexit.register(lambda: os.kill(os.getpid(), signal.SIGSEGV))
        raise RuntimeError("the real cause")
        """, "-X", "faulthandler")
    assert status == 139
    crash = classify(status, tail)
    assert (crash.reason, crash.message) == ("exception", "RuntimeError: the real cause (train.py:3 in <module>)")


def test_a_thread_exception(tmp_path):
    code = """\
        import os, signal, threading
        thread = threading.Thread(target=lambda: 1 / 0)
        thread.start()
        thread.join()
        {}
        """
    crash = classify(*run(tmp_path, code.format("os._exit(3)")))
    assert crash.reason == "exception"
    assert crash.message == "ZeroDivisionError: division by zero (train.py:2 in <lambda>)"
    # The process outlived its thread: a later kill is not the exception's doing.
    crash = classify(*run(tmp_path, code.format("os.kill(os.getpid(), signal.SIGKILL)")))
    assert crash.reason == "killed"


# Failures that need an accelerator, as torch_xla, PJRT and CUDA print them.
XLA_OOM = """\
{"step": 40, "event": "step", "level": "info", "timestamp": "2025-01-01T00:00:00Z"}
Traceback (most recent call last):
  File "/opt/tpud/engine/train.py", line 210, in run
    xm.mark_step()
  File "/opt/venv/lib/python3.11/site-packages/torch_xla/core/xla_model.py", line 1056, in mark_step
    torch_xla._XLAC._xla_step_marker(
RuntimeError: Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in \
memory space hbm. Used 17.50G of 15.48G hbm. Exceeded hbm capacity by 2.02G."""
XLA_INTERNAL = """\
Traceback (most recent call last):
  File "/opt/tpud/engine/backends/xla.py", line 88, in sync
    torch_xla._XLAC._xla_sync_multi(tensors, devices)
RuntimeError: Bad StatusOr access: INTERNAL: Failed to execute XLA computation: TPU halted
{"event": "worker exiting", "level": "info"}"""
JAX_STYLE = """\
2025-01-01 00:00:00.000 W external/xla/pjrt/pjrt_client.cc:42 retrying
jaxlib.xla_extension.XlaRuntimeError: UNAVAILABLE: Connection to the coordination service was lost"""
GLOG_FATAL = """\
{"step": 7, "event": "step", "level": "info"}
F0000 00:00:1731000000.123456    4242 pjrt_stream_executor_client.cc:1234] Check failed: buffer != nullptr \
INTERNAL: device buffer was deleted
*** Check failure stack trace: ***
    @     0x7f3a2c1b2e4d  absl::log_internal::LogMessageFatal::~LogMessageFatal()
    @     0x7f3a2c0f1234  xla::PjRtStreamExecutorBuffer::AcquireHold()
*** SIGABRT received by PID 4242 (TID 4242) on cpu 3 from PID 4242; stack trace: ***"""
CUDA_OOM = """\
Traceback (most recent call last):
  File "/opt/tpud/engine/train.py", line 199, in step
    loss = self.model(batch).float().mean()
  File "/opt/tpud/engine/models/gpt.py", line 77, in forward
    return self.head(x)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.10 GiB \
of which 3.12 GiB is free. Including non-PyTorch memory, this process has 75.97 GiB memory in use. Of the allocated \
memory 74.50 GiB is allocated by PyTorch, and 1.02 MiB is reserved by PyTorch but unallocated. If reserved but \
unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  \
See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"""


@pytest.mark.parametrize("tail, status, reason, message", [
    (XLA_OOM, 1, "oom", "RuntimeError: Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error."),
    (XLA_INTERNAL, 1, "xla_error", "RuntimeError: Bad StatusOr access: INTERNAL: Failed to execute XLA computation: "
                                   "TPU halted (xla.py:88 in sync)"),
    (JAX_STYLE, 1, "xla_error", "jaxlib.xla_extension.XlaRuntimeError: UNAVAILABLE: Connection to the"),
    (GLOG_FATAL, 134, "xla_error", "Check failed: buffer != nullptr INTERNAL: device buffer was deleted "
                                   "(pjrt_stream_executor_client.cc:1234)"),
    (CUDA_OOM, 1, "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB."),
])
def test_accelerator_failures(tail, status, reason, message):
    crash = classify(status, tail.splitlines())
    assert crash.reason == reason
    assert crash.message.startswith(message)
    assert len(crash.message) <= MAX_MESSAGE and "\n" not in crash.message


def test_a_long_message_keeps_its_location():
    crash = classify(1, CUDA_OOM.splitlines())
    assert len(crash.message) == MAX_MESSAGE
    assert crash.message.endswith("... (gpt.py:77 in forward)")
    assert crash.detail[0] == "Traceback (most recent call last):"


JUNK = [
    "\ufffd\ufffd{\ufffd", '{"event": ', "{}", "[1, 2]", '{"level": 3, "event": null, "exception": [1]}',
    '{"level": "error", "event": {"nested": [[[]]]}}', "{" + "[" * 100000 + "}", b"\xff\xfe raw bytes",
    "x" * 200000, "\x1b[31mred\x1b[0m", "progress 1%\rprogress 2%", "  File \"a.py\", line 1, in f",
    "Traceback (most recent call last):", "  File \"\", line",
]


@pytest.mark.parametrize("status", [0, 1, 75, 137, 139, 255, -11, 300])
def test_junk_never_raises(status):
    for tail in ([], JUNK, JUNK[::-1], JUNK[:3] + ["ValueError: x"]):
        crash = classify(status, tail)
        assert crash.reason in REASONS
        assert 0 < len(crash.message) <= MAX_MESSAGE and "\n" not in crash.message
        assert len(crash.detail) <= 10
    # A header and a frame, then no exception line: not a traceback.
    tail = ["Traceback (most recent call last):", '  File "a.py", line 1, in f', "progress 2%"]
    assert classify(status, tail).reason != "exception"


def test_a_bug_falls_back_to_the_status(monkeypatch):
    def broken(*args):
        raise IndexError("bug")

    monkeypatch.setattr(crashes, "_classify", broken)
    assert classify(139, ["x"]) == crashes.Crash("signal", "killed by SIGSEGV")
    assert classify(2, ["x"]) == crashes.Crash("crash", "exited with status 2")


def test_oom_kill_count(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/tpud.service\n")
    events = tmp_path / "fs" / "system.slice" / "tpud.service" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    assert oom_kill_count(tmp_path / "fs", proc) == 2
    events.write_text("oom_kill many\n")
    assert oom_kill_count(tmp_path / "fs", proc) is None
    events.unlink()
    assert oom_kill_count(tmp_path / "fs", proc) is None
    proc.write_text("4:memory:/system.slice/tpud.service\n")  # cgroup v1 only
    assert oom_kill_count(tmp_path / "fs", proc) is None
    assert oom_kill_count(tmp_path / "fs", tmp_path / "missing") is None
    # This machine: whatever its cgroups, an int or None.
    count = oom_kill_count()
    assert count is None or count >= 0

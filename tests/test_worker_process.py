"""tpud.children.process without a worker: what it reads of a process from /proc."""

import os
import signal
import subprocess

from testkit.helpers import wait_until
from tpud.children.process import process_stopped


def test_a_stopped_process_is_recognised():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: process_stopped(proc.pid), "the stop")
        os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: not process_stopped(proc.pid), "the continue")
    finally:
        proc.kill()
        proc.wait()
    assert not process_stopped(proc.pid)  # gone: not stopped

"""The gang's meeting point: `python -m tpud.gang.coordinator HOST:PORT`, a child of host 0's daemon.

It holds torch.distributed's TCPStore, bound to exactly HOST:PORT (a socket made here and
handed to the store, which would otherwise listen on every interface), and nothing else. It
lives as long as its daemon (parent-death signal), so every worker generation meets in the
same store: the generation counter and membership outlive the workers. Torch is imported
here, never in the daemon.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import structlog

from engine.backoff import Backoff

log = structlog.get_logger()


class Coordinator:
    """Host 0's daemon side: keeps the coordinator process running, started again with a backoff
    if it dies (its address taken by another process, say), from 1 s to 30 s."""

    def __init__(self, address: str):
        self.address = address
        self.proc: subprocess.Popen | None = None
        self._backoff = Backoff(initial=1.0, maximum=30.0)
        self._failures = 0
        self._started = 0.0
        self._retry_at: float | None = None  # when an exited coordinator starts again

    def ensure(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        now = time.monotonic()
        if self.proc is not None and self._retry_at is None:
            self._failures = 1 if now - self._started > 60 else self._failures + 1  # a long life: no crash loop
            self._retry_at = self._started + self._backoff.delay(self._failures)
            log.error("the gang coordinator exited; starting it again", address=self.address,
                      status=self.proc.returncode, restarts=self._failures,
                      in_s=round(max(0.0, self._retry_at - now), 1))
        if self._retry_at is not None and now < self._retry_at:
            return
        self._started, self._retry_at = now, None
        self.proc = subprocess.Popen([sys.executable, "-m", "tpud.gang.coordinator", self.address,
                                      "--parent", str(os.getpid())], stdin=subprocess.DEVNULL)
        log.info("gang coordinator started", address=self.address, pid=self.proc.pid)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tpud.gang.coordinator",
                                     description="tpud's gang coordinator (internal; host 0's daemon runs it).")
    parser.add_argument("address", help="HOST:PORT to listen on")
    parser.add_argument("--parent", type=int, default=None, help="exit if this process is not our parent")
    args = parser.parse_args(argv)
    from tpud.worker.process import die_with_parent

    die_with_parent(args.parent)
    host, _, port = args.address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, int(port)))
    except OSError as e:
        print(f"tpud gang coordinator: cannot listen on {args.address}: {e}", file=sys.stderr, flush=True)
        return 1
    listener.listen(1024)
    import torch.distributed as dist

    store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.fileno(), use_libuv=True)
    print(f"tpud gang coordinator listening on {args.address}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())

"""The gang's meeting point: `python -m tpud.worker.gang.coordinator HOST:PORT`, a child of host 0's daemon.

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
from collections.abc import Callable

import structlog

from tpud.children.respawn import Respawn
from tpud.children.process import die_with_parent, exit_status

log = structlog.get_logger()


class Coordinator:
    """Host 0's daemon side: keeps the coordinator process running. Its death is seen at once (its
    pidfd in the loop) and it starts again (tpud/children/respawn.py: with a backoff from 1 s to 30 s while
    it keeps dying young, its address taken by another process, say)."""

    def __init__(self, address: str, loop, clock: Callable[[], float] = time.monotonic):
        """`loop` watches the process's pidfd (the daemon's watch and unwatch)."""
        self.address, self.loop = address, loop
        self.proc: subprocess.Popen | None = None
        self._sentinel: int | None = None
        self._respawn = Respawn(clock)

    def ensure(self) -> None:
        """Start it unless it runs or waits out its backoff (the loop calls this every turn)."""
        if self.proc is not None or not self._respawn.ready():
            return
        self._respawn.started()
        self.proc = subprocess.Popen([sys.executable, "-m", "tpud.worker.gang.coordinator", self.address,
                                      "--parent", str(os.getpid())], stdin=subprocess.DEVNULL)
        self._sentinel = os.pidfd_open(self.proc.pid)
        self.loop.watch(self._sentinel, self._exited)
        log.info("gang coordinator started", address=self.address, pid=self.proc.pid)

    def _exited(self) -> None:
        status = self._reap()
        in_s = self._respawn.died()
        log.error("the gang coordinator exited; starting it again", address=self.address, status=status,
                  restarts=self._respawn.failures, in_s=round(in_s, 1))
        self.ensure()

    def _reap(self) -> int | None:
        proc, self.proc = self.proc, None
        if self._sentinel is not None:
            self.loop.unwatch(self._sentinel)
            os.close(self._sentinel)
            self._sentinel = None
        return None if proc is None else exit_status(proc.wait())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reap()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tpud.worker.gang.coordinator",
                                     description="tpud's gang coordinator (internal; host 0's daemon runs it).")
    parser.add_argument("address", help="HOST:PORT to listen on")
    parser.add_argument("--parent", type=int, default=None, help="exit if this process is not our parent")
    args = parser.parse_args(argv)
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

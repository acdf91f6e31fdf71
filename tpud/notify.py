"""sd_notify without libsystemd: datagrams to $NOTIFY_SOCKET (systemd's Type=notify).

READY=1 once started, STATUS= one-line summaries, WATCHDOG=1 from the main loop at half
of WatchdogSec, STOPPING=1 when a stop begins, EXTEND_TIMEOUT_USEC while stop-time
checkpoints run. Outside systemd (no NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] = os.environ, clock=time.monotonic):
        address = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: a leading NUL byte on Linux.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if address else None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        ours = usec and (pid is None or pid == str(os.getpid()))
        # Ping at half the period, as sd_watchdog_enabled(3) recommends.
        self.watchdog_interval = int(usec) / 2e6 if ours else None
        self._clock, self._last_ping = clock, float("-inf")

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def send(self, **fields: object) -> None:
        if self._socket is None:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            self._socket.sendto(message.encode(), self._address)
        except OSError:
            pass  # systemd gone or socket full: never a reason to take the daemon down

    def ready(self, status: str) -> None:
        self.send(READY=1, STATUS=status)

    def status(self, text: str) -> None:
        self.send(STATUS=text)

    def watchdog(self) -> None:
        """Call from the main loop as often as convenient; pings only when due."""
        now = self._clock()
        if self.watchdog_interval is not None and now - self._last_ping >= self.watchdog_interval:
            self._last_ping = now
            self.send(WATCHDOG=1)

    def stopping(self, status: str) -> None:
        self.send(STOPPING=1, STATUS=status)

    def extend_timeout(self, seconds: float) -> None:
        self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

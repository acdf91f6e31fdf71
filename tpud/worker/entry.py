"""The worker process: `python -m tpud.worker SPEC.json --state-dir DIR`.

The supervisor validates the job file and hands the worker the resolved spec as JSON,
so the worker trains exactly what was validated even if the file changes meanwhile.
This is the one tpud module that imports torch (through engine); the supervisor runs it
as a separate process so a crash or hang here never touches the supervisor.

With --standby it is a warm spare: it imports first, at the lowest CPU priority, and
trains only when the supervisor releases it for a restart (a line on stdin).
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog

from engine import events, exit_codes, logs
from engine.errors import ConfigError
from engine.spec.fingerprint import fingerprint
from engine.spec.schema import JobSpec
from engine.hooks import Boundary, SignalHooks
from engine.requests import Action, Request, merge
from tpud.gang.member import GangMember
from tpud.worker import channel
from tpud.worker.process import die_with_parent

log = structlog.get_logger()


class ChannelHooks(SignalHooks):
    """The engine's hooks over the daemon's channel, with signals kept as the fallback.

    A thread listens to the channel, so a request is heard while a step runs: the engine may
    answer it at once (on_request), and the loop polls the rest at its next boundary."""

    def __init__(self, path: str | None, early_signals: Iterable[int] = ()):
        super().__init__(early_signals)
        # The checkpoint writer's thread emits events while the training thread polls.
        self._lock = threading.Lock()
        self.connection = channel.connect(path) if path else None
        self.heartbeats = channel.HeartbeatClock()
        self.gang: GangMember | None = None
        self._inbox: list[Request] = []
        self._answer: Callable[[Request], bool] | None = None
        # The rank tells the daemon whether this host logs the job to wandb (rank 0 only).
        self.emit(events.Hello(os.getpid(), int(os.environ.get("RANK", "0"))))
        if self.connection is not None:
            threading.Thread(target=self._listen, name="channel-listener", daemon=True).start()

    def on_request(self, answer: Callable[[Request], bool]) -> None:
        self._answer = answer

    def _listen(self) -> None:
        while (connection := self.connection) is not None:
            try:
                readable, _, _ = select.select([connection], [], [], 1.0)
            except (OSError, ValueError):  # closed under us
                return
            if not readable:
                continue
            with self._lock:
                messages = self.connection.receive() if self.connection is not None else None
            if messages is None:  # the daemon is gone: signals still work
                return
            for message in messages:
                if isinstance(message, events.CheckpointRequest):
                    self._heard(message.request())

    def _heard(self, request: Request) -> None:
        answer = self._answer
        if answer is not None and request.action is not Action.STOP:
            try:
                if answer(request):
                    return
            except Exception as e:  # noqa: BLE001  (the loop still acts on it at its boundary)
                log.warning("could not answer a request between boundaries", error=str(e))
        with self._lock:
            self._inbox.append(request)

    def emit(self, event: events.Event) -> None:
        with self._lock:
            if self.connection is not None and not self.connection.send(event):
                log.warning("lost the daemon channel; signals still work")
                self.connection = None

    def poll(self, at: Boundary) -> Request | None:
        if self.gang is not None:
            self.gang.arrived(events.Heartbeat(at.step, at.micro_step))
        if self.heartbeats.due():
            self.emit(events.Heartbeat(at.step, at.micro_step))
        return self.requests(at)

    def stop_asked(self) -> bool:
        """Before training (waiting for the other hosts): whether to exit now; nothing to checkpoint yet."""
        request = self.requests(Boundary(0, 0))
        return request is not None and request.action is not Action.CHECKPOINT

    def requests(self, at: Boundary) -> Request | None:
        """Pending requests: signals, and the daemon's messages."""
        request = super().poll(at)
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for heard in inbox:
            request = merge(request, heard)
        return request


def _warm_up(spec: JobSpec) -> None:
    """What a worker's first seconds go to: torch, the engine, torch._dynamo (which
    torch.optim's first constructor imports) and the backend's modules (torch_xla)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # the worker in charge comes first
    import torch._dynamo  # noqa: F401

    import engine.train  # noqa: F401
    from engine.backends import preload

    preload(spec.device)


def standby(spec: JobSpec) -> bool:
    """Warm up while waiting for the daemon's go (a line on stdin); False if it closes stdin instead."""
    warm = threading.Thread(target=_warm_up, args=(spec,), name="warm-up", daemon=True)
    warm.start()
    released = sys.stdin.buffer.readline() != b""
    # Threads the imports started inherited their priority; training runs at ours. Lowering a
    # niceness back needs CAP_SYS_NICE (tpud runs as root): without it, they stay low.
    for task in Path("/proc/self/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), os.getpriority(os.PRIO_PROCESS, 0))
        except OSError:
            pass
    warm.join()
    return released


def main(argv: list[str] | None = None, early_signals: Iterable[int] = ()) -> int:
    """early_signals: SIGTERM and SIGUSR1 that __main__'s handlers recorded before the hooks."""
    parser = argparse.ArgumentParser(prog="python -m tpud.worker", description="tpud training worker (internal).")
    parser.add_argument("spec", type=Path, help="resolved job spec, JSON")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--standby", action="store_true",
                        help="a warm spare: import torch and the engine, then wait for a line on stdin before "
                             "reading the spec again and training; exit 0 if stdin closes first")
    args = parser.parse_args(argv)
    parent = os.environ.get("TPUD_SUPERVISOR_PID")
    die_with_parent(int(parent) if parent else None)
    if args.standby and not standby(JobSpec.model_validate_json(args.spec.read_text())):
        return 0
    spec = JobSpec.model_validate_json(args.spec.read_text())
    logs.configure(spec.logging.level)
    structlog.contextvars.bind_contextvars(job=spec.name)
    # Before torch is imported (seconds): a stop asked meanwhile is recorded, not fatal (SIGTERM's default).
    hooks = ChannelHooks(os.environ.get("TPUD_CHANNEL"), early_signals)
    from engine.backends import resolve_backend_name
    from engine.train import train  # torch is imported here, after argument checks

    gang = GangMember.from_env(spec.name, hooks.emit)
    if gang is None:
        return train(spec, args.state_dir, hooks)
    try:
        joined = gang.join(resolve_backend_name(spec.device), hooks.stop_asked, fingerprint(spec))
    except ConfigError as e:
        log.error("job cannot run here", key=e.key, error=str(e))
        return exit_codes.BAD_INPUT
    if not joined:
        log.info("stopping on request while waiting for the other hosts")
        return exit_codes.STOPPED
    hooks.gang = gang
    try:
        code = train(spec, args.state_dir, hooks, gang.place)
    except BaseException as e:
        gang.crashed(e)
        raise
    gang.leave()
    return code


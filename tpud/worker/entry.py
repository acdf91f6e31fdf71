"""The worker process: `python -m tpud.worker SPEC.json --state-dir DIR`.

The supervisor validates the job file and hands the worker the resolved spec as JSON,
so the worker trains exactly what was validated even if the file changes meanwhile.
This is the one tpud module that imports torch (through engine); the supervisor runs it
as a separate process so a crash or hang here never touches the supervisor.

The daemon usually forks it from its fork server (tpud/worker/forkserver.py), which has done
the imports already; `python -m tpud.worker` is the cold start, the same code.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import select
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

import structlog

from engine import events, exit_codes, logs
from engine.errors import ConfigError, GangChanged
from engine.spec.fingerprint import fingerprint
from engine.spec.schema import JobSpec
from engine.hooks import Boundary, SignalHooks
from engine.requests import Action, Request, merge
from engine.runtime import Runtime
from tpud.worker.gang.member import GangMember
from tpud.worker import channel
from tpud.children.process import die_with_parent

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

    def on_request(self, answer: Callable[[Request], bool] | None) -> None:
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
        if self.gang is not None and _leaves_the_gang(event):
            # At once, not at the exit: the others restart meanwhile, and this worker's gang watch
            # must not take that for a disruption and exit 77 (restarted) instead of 79 (left out).
            self.gang.left_out(event.reason)
        with self._lock:
            if self.connection is not None and not self.connection.send(event):
                log.warning("lost the daemon channel; signals still work")
                self.connection = None

    def poll(self, at: Boundary) -> Request | None:
        if self.gang is not None:
            self.gang.arrived(events.Heartbeat(at.step, at.micro_step))
            if (why := self.gang.regroup_wanted) is not None:
                raise GangChanged(why)
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


def _leaves_the_gang(event: events.Event) -> bool:
    """A process of this host named an odd replica (by the majority or a replay), or an evicted
    straggler: this worker exits 79 next. A host's processes are consecutive ranks of its gang."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if isinstance(event, events.ReplicaMismatch):
        return event.rank // per_host in {rank // per_host for rank in event.odd}
    return isinstance(event, events.Straggler) and event.evicted and event.straggler // per_host == event.rank // per_host


def run_and_exit(run: Callable[[], int | None]) -> NoReturn:
    """Run the worker and end the process as the interpreter would (non-daemon threads joined, atexit
    handlers run, output flushed), without finalising the interpreter: C++ objects that a library
    left to static destructors (a process group's threads) abort the process there, turning a
    clean exit 75 into 134. A forked worker must end this way too, never return into its server."""
    try:
        code = run()
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001  (reported as the interpreter reports it)
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # What Py_FinalizeEx does first, in its order: executors' exit hooks, then the non-daemon
    # threads joined (an idle ThreadPoolExecutor's workers wait for that hook), then atexit.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


def share_cores() -> None:
    """OMP_NUM_THREADS as torch reads it at import: a forked worker's torch was imported by its fork
    server, under the daemon's environment, not this process's (device.processes_per_host shares the
    cores among a host's processes: each taking them all made the steps 22 % slower on 2 cores)."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def gang_fingerprint(spec: JobSpec, per_host: int) -> dict:
    """What the hosts compare as the gang forms: the spec's fingerprint with device.processes_per_host
    as resolved on this host (auto counts its own GPUs: hosts of unlike counts cannot share a mesh)."""
    return {**fingerprint(spec), "device.processes_per_host": per_host}


def newest_commit(spec: JobSpec, state_dir: Path) -> tuple[int, tuple[int, ...]]:
    """The newest step globally committed in this host's local tier (-1: none), and the hosts of
    the gang that made it."""
    from engine.checkpoint.manifest import committed_steps
    from engine.layout import StateLayout

    steps = committed_steps(StateLayout(state_dir).checkpoints(spec.name, spec.checkpoint.dir))
    return (steps[-1][0], steps[-1][2].members) if steps else (-1, ())


def main(argv: list[str] | None = None, early_signals: Iterable[int] = ()) -> int:
    """early_signals: SIGTERM and SIGUSR1 that __main__'s handlers recorded before the hooks."""
    parser = argparse.ArgumentParser(prog="python -m tpud.worker", description="tpud training worker (internal).")
    parser.add_argument("spec", type=Path, help="resolved job spec, JSON")
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    parent = os.environ.get("TPUD_SUPERVISOR_PID")
    die_with_parent(int(parent) if parent else None)
    spec = JobSpec.model_validate_json(args.spec.read_text())
    logs.configure(spec.logging.level)
    structlog.contextvars.bind_contextvars(job=spec.name)
    # Before torch is imported (seconds): a stop asked meanwhile is recorded, not fatal (SIGTERM's default).
    hooks = ChannelHooks(os.environ.get("TPUD_CHANNEL"), early_signals)
    from engine.backends import resolve_backend_name
    from engine.train import train  # torch is imported here, after argument checks

    share_cores()

    from engine.layout import StateLayout

    gang = GangMember.from_env(spec.name, hooks.emit, StateLayout(args.state_dir).gang_file(spec.name))
    runtime = Runtime.from_env()  # what the daemon told this worker, read once
    if gang is None:
        return train(spec, args.state_dir, hooks, runtime=runtime)
    backend = resolve_backend_name(spec.device)
    kept: list = []  # the model and optimizer this worker keeps when its gang changes in place
    while True:
        try:
            joined = gang.join(backend, hooks.stop_asked, gang_fingerprint(spec, gang.per_host),
                               kept[0].progress.step if kept else -1, *newest_commit(spec, args.state_dir))
        except ConfigError as e:
            log.error("job cannot run here", key=e.key, error=str(e))
            return exit_codes.BAD_INPUT
        if not joined:
            log.info("stopping on request while waiting for the other hosts")
            return exit_codes.STOPPED
        hooks.gang = gang
        # The gang's ranks, a host's processes consecutive: with one process a host and no host left
        # out, the daemon's RANK and WORLD_SIZE already.
        os.environ.update(RANK=str(gang.process_rank), WORLD_SIZE=str(gang.world))
        try:
            code = train(spec, args.state_dir, hooks, gang.place, kept if gang.in_place else None, runtime)
        except BaseException as e:
            if not gang.regroups(e):
                gang.crashed(e)
                raise
        else:
            gang.leave()
            return code
        # Out of the except block the failed trainer is garbage: collect it now. Its process groups
        # close their connections only when freed, and a peer still held in a collective with this
        # host then fails at once (and regroups in place) instead of waiting on an open socket.
        hooks.on_request(None)
        gc.collect()


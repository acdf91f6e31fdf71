"""The processes of one host in a gang (device.processes_per_host above 1).

A gang's unit is a host: one seat, one `alive` counter, one mark. The host's local rank 0 meets
the other hosts for all of its processes (tpud/worker/gang/member.py); once its gang formed it
tells the others here, through a TCPStore of the host's own at torchrun's MASTER_ADDR and
MASTER_PORT (which the daemon picked for this start), and every process joins the gang's
process group at rank host x processes + local rank: the processes of a host are consecutive
ranks, the fsdp axis of the mesh, and the hosts its data axis (HSDP: each host holds, and
checkpoints, a whole state, sharded among its processes).

The store lives in local rank 0's process: when that one dies its daemon kills the others too.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

FORMED = "gang"           # the key local rank 0 sets once its gang formed
CONNECT_TIMEOUT_S = 120.0  # local rank 0 starts beside the others: a cold start imports torch first
STOP_GRACE_S = 2.0         # how long a stop that took local rank 0 away may take to reach this process
POLL_S = 1.0               # how often a waiting process says it lives


@dataclass(frozen=True)
class Formed:
    """What local rank 0 tells its host's other processes: the gang it formed."""

    generation: int
    members: list[int]
    coordinator: int  # the index of the host whose coordinator the gang met in


class HostProcesses:
    def __init__(self, local_rank: int, count: int, address: str, port: int):
        self.local_rank, self.count, self.address, self.port = local_rank, count, address, port
        self._store = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HostProcesses | None:
        """This process's place among its host's, as the daemon gave it (torchrun's variables); None alone."""
        count = int(env.get("LOCAL_WORLD_SIZE", "1"))
        if count <= 1:
            return None
        return cls(int(env["LOCAL_RANK"]), count, env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]))

    @property
    def leads(self) -> bool:
        return self.local_rank == 0

    def store(self):
        """The host's store: served by local rank 0, a client elsewhere (waiting for it to be served)."""
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(self.address, self.port, is_master=self.leads, wait_for_workers=False,
                                        use_libuv=True, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        return self._store

    def share(self, formed: Formed) -> None:
        """Local rank 0: its gang formed."""
        self.store().set(FORMED, json.dumps({"generation": formed.generation, "members": formed.members,
                                             "coordinator": formed.coordinator}))

    def wait(self, stop_asked: Callable[[], bool], alive: Callable[[], None]) -> Formed | None:
        """Another process: wait until local rank 0's gang formed, calling `alive` every POLL_S (the
        daemon's hang watch) meanwhile; None when a stop was asked first."""
        store = self.store()
        said = time.monotonic()
        while not self._formed(store, stop_asked):
            if stop_asked():
                return None
            if time.monotonic() - said >= POLL_S:
                alive()
                said = time.monotonic()
            time.sleep(POLL_S / 4)
        record = json.loads(store.get(FORMED))
        return Formed(int(record["generation"]), [int(h) for h in record["members"]], int(record["coordinator"]))

    @staticmethod
    def _formed(store, stop_asked: Callable[[], bool]) -> bool:
        """Whether the gang formed (a blocking wait's timeouts would log a C++ warning each). Local
        rank 0 gone: on a stop it may have heard first (the same request reaches this process a
        moment later), else it failed, and its daemon ends this process too."""
        try:
            return store.check([FORMED])
        except (RuntimeError, OSError):
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline:
                if stop_asked():
                    return False
                time.sleep(0.05)
            raise


def arrival_key(host: int, local_rank: int) -> str:
    """The name of a process's arrivals counter: local rank 0's is its host's (as with one process a host)."""
    return f"arrivals/{host}" if local_rank == 0 else f"arrivals/{host}.{local_rank}"

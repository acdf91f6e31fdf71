"""Where this host stands in its gang (torch-free).

In order: tpud.yaml's `gang:` section (CPU and CUDA clusters, and tests); the TPU runtime's
environment (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES); on a TPU VM, its metadata (the attributes
agent-worker-number and worker-network-endpoints). A single host, or none of these, is no gang.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.request
from dataclasses import dataclass

import structlog

from tpud.metadata import FLAVOR, FLAVOR_HEADER, resolve_host

log = structlog.get_logger()


@dataclass(frozen=True)
class GangPlace:
    host: int          # this host's index, 0 .. hosts - 1
    hosts: int
    coordinator: str   # HOST:PORT of host 0's coordinator (a TCPStore), where the workers meet first
    peer_timeout_s: float = 3.0
    restart_peers: bool = True  # false: no peer watch (tpud.settings.GangSettings.restart_peers)
    min_hosts: int | None = None  # None: every host (tpud.settings.GangSettings.min_hosts)
    evict_stragglers: bool = False  # tpud.settings.GangSettings.evict_stragglers
    in_place: bool = True  # tpud.settings.GangSettings.in_place
    # Every host's coordinator, host order (tpud.settings.GangSettings.coordinators); () for host 0's alone.
    coordinators: tuple[str, ...] = ()

    @property
    def addresses(self) -> tuple[str, ...]:
        """The coordinators the workers may meet in, host order."""
        return self.coordinators or (self.coordinator,)

    @property
    def own_coordinator(self) -> str | None:
        """The coordinator this host's daemon runs, if any."""
        return self.addresses[self.host] if self.host < len(self.addresses) else None

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.addresses[0].rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def loopback(self) -> bool:
        """Every host on this machine (tests): gloo must then bind the loopback interface too."""
        host = self.address[0]
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host == "localhost"

    def worker_env(self) -> dict[str, str]:
        env = {"TPUD_GANG_HOST": str(self.host), "TPUD_GANG_HOSTS": str(self.hosts),
               "TPUD_GANG_COORDINATOR": ",".join(self.addresses), "TPUD_GANG_PEER_TIMEOUT": str(self.peer_timeout_s),
               "TPUD_GANG_RESTART_PEERS": "1" if self.restart_peers else "0",
               "TPUD_GANG_MIN_HOSTS": str(self.min_hosts or self.hosts),
               "TPUD_GANG_EVICT_STRAGGLERS": "1" if self.evict_stragglers else "0",
               "TPUD_GANG_IN_PLACE": "1" if self.in_place else "0"}
        if self.loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        return env


def discover(settings, env: dict[str, str] | None = None) -> GangPlace | None:
    """This host's place from the daemon's settings, the TPU environment or metadata; None for one host."""
    env = os.environ if env is None else env
    if settings.gang is not None:
        g = settings.gang
        place = GangPlace(g.host_index, g.host_count, g.addresses[0], g.peer_timeout_seconds, g.restart_peers,
                          g.min_hosts, g.evict_stragglers, g.in_place, tuple(g.coordinators or ()))
    elif env.get("TPU_WORKER_ID") and env.get("TPU_WORKER_HOSTNAMES"):
        names = [n.strip() for n in env["TPU_WORKER_HOSTNAMES"].split(",") if n.strip()]
        try:
            host = int(env["TPU_WORKER_ID"])
        except ValueError:
            host = -1
        if not names or not 0 <= host < len(names):
            log.error("TPU_WORKER_ID / TPU_WORKER_HOSTNAMES do not name this host's place; running as one host",
                      worker_id=env["TPU_WORKER_ID"], hostnames=env["TPU_WORKER_HOSTNAMES"][:200])
            return None
        addresses = tuple(f"{name}:{settings.gang_port}" for name in names)
        place = GangPlace(host, len(names), addresses[0], coordinators=addresses)
    elif any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0")):
        place = _from_metadata(resolve_host(settings.metadata_host), settings.gang_port)
    else:
        place = None
    return place if place is not None and place.hosts > 1 else None


def _from_metadata(host: str, port: int) -> GangPlace | None:
    """A TPU VM's worker number and its slice's worker endpoints (`?:?:IP,...`, in worker order)."""
    try:
        number = _get(host, "instance/attributes/agent-worker-number")
        endpoints = _get(host, "instance/attributes/worker-network-endpoints")
        ips = [e.split(":")[2] for e in endpoints.split(",") if e.count(":") >= 2]
        addresses = tuple(f"{ip}:{port}" for ip in ips)
        return GangPlace(int(number), len(ips), addresses[0], coordinators=addresses) if 0 <= int(number) < len(ips) \
            else None
    except (OSError, ValueError, IndexError) as e:
        log.warning("could not read this TPU VM's worker number and peers from its metadata", error=str(e))
        return None


def _get(host: str, key: str) -> str:
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/{key}", headers={FLAVOR_HEADER: FLAVOR})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read(1 << 16).decode()

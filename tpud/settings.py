"""The daemon's own settings: tpud.yaml in the configuration directory (optional)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.spec.loader import SpecError, load_mapping

DEFAULT_METRICS_ADDR = "127.0.0.1:9477"
DEFAULT_GANG_PORT = 8476
ADDRESS = r"^(\[[0-9a-fA-F:.]+\]|[^:\s]+):[0-9]{1,5}$"  # HOST:PORT, an IPv6 host in brackets


class GangSettings(BaseModel):
    """This host's place in a job spanning several hosts (off TPU; a TPU VM finds its own)."""

    model_config = ConfigDict(extra="forbid")

    host_index: int = Field(ge=0, description="This host's index, 0 .. host_count - 1.")
    host_count: int = Field(ge=1, description="Hosts every multi-host job spans.")
    min_hosts: int | None = Field(
        None, ge=1, description="The fewest hosts a gang goes on with. Below host_count, a host that is lost (its "
        "worker's beat stood still for peer_timeout_seconds, its coordinator gone), stopped or preempted, "
        "quarantined (a replica that differed) or evicted (a straggler) is left out while the others go on without "
        "it, as long as they are a majority of the gang they were (half of it with its lowest host), and joins "
        "again when it comes back. Default host_count: the gang waits for every host. For gangs over gloo or nccl: "
        "a TPU slice's runtime fixes its host count.")
    evict_stragglers: bool = Field(
        False, description="Evict a host flagged as a straggler from every multi-host job here that watches for "
        "stragglers (health.stragglers, on by default), as a job's health.stragglers.evict does (which a job may also "
        "set alone): it fails on that host (exit 79) and the gang goes on without it where min_hosts allows, else "
        "waits for its replacement.")
    coordinator: str | None = Field(
        None, pattern=ADDRESS,
        description="HOST:PORT where host 0's coordinator (torch.distributed's TCPStore) listens and every "
        "host's workers meet; host 0 binds exactly this address. Give it, or coordinators (then their first).")
    coordinators: list[str] | None = Field(
        None, description="Every host's coordinator address, HOST:PORT in host order: each host runs one on its "
        "own, and the workers meet in the lowest live one holding the newest generation, so losing any one host, "
        "host 0 included, leaves the gang a coordinator. Without it only host 0 runs one, and a gang loses host 0 "
        "only by waiting for it.")
    peer_timeout_seconds: float = Field(
        3.0, gt=0, description="A worker that stops beating for this long counts as failed: the gang restarts, "
        "without that host where min_hosts allows.")
    in_place: bool = Field(
        True, description="When the gang changes (a host lost, or back), the surviving workers keep their processes, "
        "model, optimizer and compiled code, and form the next gang where they stand; a host that joins takes the "
        "newest state from a peer. gloo (cpu) only; nccl and xla, and a collective held by a silent peer, take the "
        "restart path. false: every change restarts every worker from the newest global commit.")
    restart_peers: bool = Field(
        True, description="false: when a worker fails, the other hosts' workers are not stopped; each finds out "
        "through a collective's error or its hang bound, like a plain torch.distributed job (bench/multihost.py "
        "compares the two).")

    @model_validator(mode="after")
    def _index_in_range(self) -> GangSettings:
        if self.host_index >= self.host_count:
            raise ValueError(f"host_index {self.host_index} must be below host_count {self.host_count}")
        if self.min_hosts is not None and self.min_hosts > self.host_count:
            raise ValueError(f"min_hosts {self.min_hosts} must not be above host_count {self.host_count}")
        if self.coordinators is not None:
            if len(self.coordinators) != self.host_count:
                raise ValueError(f"coordinators lists {len(self.coordinators)} addresses: give one per host "
                                 f"({self.host_count})")
            if len(set(self.coordinators)) != len(self.coordinators):
                raise ValueError("coordinators: each host's address must differ")
            if self.coordinator is not None and self.coordinator != self.coordinators[0]:
                raise ValueError(f"coordinator {self.coordinator!r} is not host 0's of coordinators "
                                 f"({self.coordinators[0]!r}): give one of them")
        elif self.coordinator is None:
            raise ValueError("give coordinator (host 0's HOST:PORT) or coordinators (every host's)")
        for address in self.addresses:
            if not re.match(ADDRESS, address):
                raise ValueError(f"coordinators: {address!r} is not HOST:PORT")
            if not 1 <= int(address.rpartition(":")[2]) <= 65535:
                raise ValueError(f"coordinator {address!r}: the port must be 1 .. 65535")
        return self

    @property
    def addresses(self) -> list[str]:
        """The coordinators' addresses in host order: every host's, or host 0's alone."""
        return list(self.coordinators) if self.coordinators is not None else [self.coordinator]


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metrics_addr: str = Field(DEFAULT_METRICS_ADDR, description="HOST:PORT of the Prometheus listener; port 0 = any.")
    stop_budget_seconds: float = Field(
        240.0, gt=0, description="On SIGTERM: time for every job's checkpoint and pending uploads before exiting.")
    job_stop_timeout_seconds: float = Field(
        120.0, gt=0, description="A worker asked to checkpoint and stop is killed after this long.")
    rescan_seconds: float = Field(30.0, gt=0, description="Full rescan of jobs.d as a backstop to file events.")
    remote_jobs: str | None = Field(
        None, pattern=r"^gs://[a-z0-9][a-z0-9._-]*(/.*)?$",
        description="A watched directory in GCS, gs://bucket/prefix/, beside jobs.d: every daemon polls it and "
        "runs the job files directly under it as if they were in its jobs.d (tpud submit and tpud cancel write "
        "there). Read into <state>/remote-jobs/; a bucket that cannot be reached leaves the jobs from there as they "
        "are. Takes effect when tpud starts.")
    remote_jobs_poll_seconds: float = Field(
        5.0, ge=0.2, le=3600, description="How often remote_jobs is listed (one request; a file is downloaded only "
        "when its generation changed). Failures back off, doubling, to 30 s.")
    preemption_deadline_seconds: float = Field(
        30.0, gt=0, description="From a preemption or TERMINATE notice (or SIGTERM) to the VM's end: every job "
        "commits a checkpoint within it (Spot VMs get 30 s).")
    metadata_host: str | None = Field(
        None, description="GCE metadata server HOST[:PORT]; GCE_METADATA_HOST wins, as in google-auth. "
        "Default metadata.google.internal; off cloud the watcher stays idle.")
    metadata_timeout_seconds: int = Field(300, gt=0, description="timeout_sec of each hanging metadata GET.")
    upcoming_maintenance_poll_seconds: float = Field(
        60.0, gt=0, description="How often the TPU instance/upcoming-maintenance key is read.")
    gang: GangSettings | None = Field(
        None, description="Multi-host jobs off TPU: this host's index, the host count and the coordinator. On a "
        "TPU VM they come from TPU_WORKER_ID / TPU_WORKER_HOSTNAMES or the VM's metadata.")
    gang_port: int = Field(DEFAULT_GANG_PORT, ge=1, le=65535,
                           description="The coordinators' port on TPU VMs (every host's first address).")
    memory_tier_max_share: float = Field(
        0.25, ge=0, le=0.9, description="The most of this host's RAM every job's memory tier together may take "
        "(two training states per job, in shared memory). A job that sets checkpoint.memory and does not fit is "
        "refused with what it would need; one that has the tier by default runs without it.")
    allow_fault_injection: bool = Field(
        False, description="Run jobs with a debug.inject block (tests and drills); refused otherwise.")


def load_settings(config_dir: Path) -> tuple[Settings, str | None]:
    """Settings from <config>/tpud.yaml; defaults and an error message when it is invalid."""
    path = config_dir / "tpud.yaml"
    if not os.path.lexists(path):
        return Settings(), None
    try:
        return Settings.model_validate(load_mapping(path)), None  # bounded, as job files are
    except SpecError as e:
        return Settings(), str(e)
    except ValidationError as e:
        return Settings(), "\n".join(f"{path}: {'.'.join(map(str, error['loc'])) or '(the file)'}: {error['msg']}"
                                      for error in e.errors(include_url=False))

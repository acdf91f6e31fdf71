"""The daemon's Prometheus exporter (docs/architecture.md, "Metrics").

Every series lives on this object's own CollectorRegistry, never prometheus-client's global
one, so several Metrics (tests, a daemon and a `tpud run`) can share one process. The daemon
calls the methods below from any thread; `serve()` exposes /metrics over HTTP.

Names and units are the interface (prefix tpud_, base units, counters end in _total):
tpud_build_info{version}, tpud_job_state{job,state}, tpud_job_step{job}, tpud_job_loss{job},
tpud_job_eval_loss{job},
tpud_job_tokens_per_second{job}, tpud_job_mfu_ratio{job}, tpud_job_device_memory_bytes{job,kind},
tpud_job_compilations{job}, tpud_job_compile_seconds{job}, tpud_job_restarts_total{job,reason},
a mixture of experts' tpud_job_router_aux_loss{job}, tpud_job_router_z_loss{job},
tpud_job_expert_load_max_ratio{job}, tpud_job_expert_load_cv{job}, tpud_job_dropped_tokens_ratio{job},
tpud_preemption_notices_total{source}, tpud_checkpoint_duration_seconds{job,tier,reason}
(histogram), tpud_checkpoint_bytes_total{job,tier}, tpud_checkpoint_failures_total{job,tier},
tpud_checkpoint_last_committed_step{job,tier},
tpud_checkpoint_last_committed_timestamp_seconds{job,tier}, tpud_job_checkpoint_interval_seconds{job},
tpud_checkpoint_auto_interval_steps{job,tier}, tpud_checkpoint_auto_interval_seconds{job,tier},
tpud_checkpoint_save_cost_seconds{job,tier},
tpud_checkpoint_expected_loss_seconds{job,tier}, tpud_job_assumed_disruptions_per_second{job},
tpud_job_useful_mfu_ratio{job}, tpud_job_rollbacks_total{job,kind,verdict},
tpud_job_skipped_samples_total{job}, tpud_job_redone_steps_total{job},
tpud_job_replica_mismatches_total{job,odd}, tpud_job_quarantined{job}, tpud_job_straggler_ratio{job,host},
tpud_heartbeat_age_seconds{job},
tpud_goodput_ratio{job}, tpud_badput_seconds_total{job,kind}; a job on several hosts also
tpud_job_gang_hosts_present{job,host}, tpud_job_gang_generation{job,host}, tpud_job_gang_members{job,host},
tpud_job_gang_hosts_missing{job,host}, tpud_job_gang_shrinks_total{job,host},
tpud_job_gang_grows_total{job,host} (host: this host's index).

Every per-job series carries a `job` label, which collides with the `job` target label
Prometheus attaches on scrape: scrape tpud with `honor_labels: true`, or the tpud job name
arrives as `exported_job`.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engine.layout import atomic_write
from tpud import __version__
from tpud.metrics.listener import Exporter
from tpud.job.states import State

DEFAULT_ADDRESS = "127.0.0.1:9477"

JOB_STATES = tuple(state.value for state in State)
# tpud_preemption_notices_total{source}: created at 0 for each (tpud/metadata.py's sources, and
# the SIGTERM of a host going down).
NOTICE_SOURCES = ("preempted", "maintenance_event", "upcoming_maintenance", "sigterm")

# A checkpoint takes from a fraction of a second (a small local save) to tens of minutes
# (a large model to GCS): 0.1 s .. 30 min, then +Inf.
CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                      1200.0, 1800.0)

# Every series: the attribute that holds it, its type, its name (a counter's without the _total that
# prometheus-client appends), its help and its labels. Per-job series have `job` first (remove_job).
SERIES: tuple[tuple[str, type, str, str, tuple[str, ...]], ...] = (
    ("_build_info", Gauge, "tpud_build_info", "tpud build; the value is always 1.", ("version",)),
    ("_state", Gauge, "tpud_job_state", "1 for the job's current state, 0 for the others.", ("job", "state")),
    ("_step", Gauge, "tpud_job_step", "Last training step the job reported.", ("job",)),
    ("_loss", Gauge, "tpud_job_loss", "Last training loss the job reported.", ("job",)),
    ("_eval_loss", Gauge, "tpud_job_eval_loss", "Last validation loss the job reported (eval section).", ("job",)),
    ("_tps", Gauge, "tpud_job_tokens_per_second", "Training throughput in tokens per second.", ("job",)),
    ("_mfu", Gauge, "tpud_job_mfu_ratio", "Model FLOPs utilisation (0..1).", ("job",)),
    ("_device_memory", Gauge, "tpud_job_device_memory_bytes",
     "The worker's device memory at its last report: in use, and its peak (cuda; xla on a TPU).", ("job", "kind")),
    ("_compilations", Gauge, "tpud_job_compilations",
     "Graphs the current worker compiled so far (xla, or torch.compile): growing after warm-up is a recompiling step.",
     ("job",)),
    ("_compile_seconds", Gauge, "tpud_job_compile_seconds", "Seconds the current worker spent compiling them.",
     ("job",)),
    ("_router_aux", Gauge, "tpud_job_router_aux_loss",
     "Load-balancing loss of the last step, before its coefficient (1 when balanced; mixture of experts).", ("job",)),
    ("_router_z", Gauge, "tpud_job_router_z_loss",
     "Router z-loss of the last step, before its coefficient (mixture of experts).", ("job",)),
    ("_load_max", Gauge, "tpud_job_expert_load_max_ratio",
     "The busiest expert's share of its layer's routed tokens in the last step (1/experts when even).", ("job",)),
    ("_load_cv", Gauge, "tpud_job_expert_load_cv",
     "Coefficient of variation of the experts' shares of routed tokens, mean over layers (0 when even).", ("job",)),
    ("_dropped", Gauge, "tpud_job_dropped_tokens_ratio",
     "Routed tokens beyond their expert's capacity in the last step (capacity_factor).", ("job",)),
    ("_restarts", Counter, "tpud_job_restarts", "Worker restarts by reason.", ("job", "reason")),
    ("_rollbacks", Counter, "tpud_job_rollbacks",
     "Bad steps the worker healed in place, by kind (spike, nonfinite) and verdict (data: its batches "
     "skipped; hardware: not reproduced on replay).", ("job", "kind", "verdict")),
    ("_skipped", Counter, "tpud_job_skipped_samples", "Samples the job's rollbacks skipped.", ("job",)),
    ("_redone", Counter, "tpud_job_redone_steps",
     "Steps trained again after a rollback (their first training was lost).", ("job",)),
    ("_mismatches", Counter, "tpud_job_replica_mismatches",
     "Times the data-parallel replicas' states differed, by the ranks (hosts) named: outside the majority,"
     " or by a replay (none: none named, healed in place or all restarted).", ("job", "odd")),
    ("_quarantined", Gauge, "tpud_job_quarantined",
     "1 when this host's replica of the job's state was named the odd one (by the majority or a replay): "
     "the job is failed here until the host is replaced.", ("job",)),
    ("_stragglers", Gauge, "tpud_job_straggler_ratio",
     "A flagged straggler's forward time over the other processes' median (host: its rank, its host in a "
     "gang); 0 once cleared.", ("job", "host")),
    ("_preemptions", Counter, "tpud_preemption_notices",
     "Preemption or maintenance notices received, by source.", ("source",)),
    ("_ckpt_seconds", Histogram, "tpud_checkpoint_duration_seconds",
     "Wall time of committed checkpoints.", ("job", "tier", "reason")),
    ("_ckpt_bytes", Counter, "tpud_checkpoint_bytes", "Bytes of committed checkpoints.", ("job", "tier")),
    ("_ckpt_failures", Counter, "tpud_checkpoint_failures", "Failed checkpoints.", ("job", "tier")),
    ("_ckpt_step", Gauge, "tpud_checkpoint_last_committed_step",
     "Step of the newest committed checkpoint.", ("job", "tier")),
    ("_ckpt_time", Gauge, "tpud_checkpoint_last_committed_timestamp_seconds",
     "Unix time of the newest committed checkpoint (time() minus it: its age).", ("job", "tier")),
    ("_ckpt_interval", Gauge, "tpud_job_checkpoint_interval_seconds",
     "The job's local checkpoint interval in seconds (checkpoint.interval_seconds, else interval_steps "
     "times the recent step time).", ("job",)),
    ("_auto_steps", Gauge, "tpud_checkpoint_auto_interval_steps",
     "A tier's interval in steps when it is auto (the least lost time for its save cost and the disruption"
     " rate).", ("job", "tier")),
    ("_auto_seconds", Gauge, "tpud_checkpoint_auto_interval_seconds",
     "An auto tier's interval in seconds of training (the GCS tier's: between the starts of uploads).",
     ("job", "tier")),
    ("_save_cost", Gauge, "tpud_checkpoint_save_cost_seconds",
     "What a save of an auto tier holds the loop for (the worker's running average; the GCS tier's: an "
     "upload's time).", ("job", "tier")),
    ("_expected_loss", Gauge, "tpud_checkpoint_expected_loss_seconds",
     "Training time an auto tier expects to lose per disruption: half its interval, and a save.", ("job", "tier")),
    ("_disruption_rate", Gauge, "tpud_job_assumed_disruptions_per_second",
     "The disruption rate the auto checkpoint intervals assume (seen on this host, with the job's prior).", ("job",)),
    ("_useful_mfu", Gauge, "tpud_job_useful_mfu_ratio",
     "Goodput x MFU: the share of the devices' peak that went into training kept (0..1), the figure to "
     "maximise.", ("job",)),
    ("_goodput", Gauge, "tpud_goodput_ratio", "Productive training time over total job time (0..1).", ("job",)),
    ("_badput", Counter, "tpud_badput_seconds", "Unproductive job time by kind.", ("job", "kind")),
    ("_gang_present", Gauge, "tpud_job_gang_hosts_present",
     "Hosts whose worker has joined the job's current gang generation.", ("job", "host")),
    ("_gang_generation", Gauge, "tpud_job_gang_generation",
     "The job's gang generation: it grows by one at every gang restart.", ("job", "host")),
    ("_gang_members", Gauge, "tpud_job_gang_members",
     "Hosts in the job's newest gang (fewer than its host count: it went on without some).", ("job", "host")),
    ("_gang_missing", Gauge, "tpud_job_gang_hosts_missing",
     "Hosts the job's gang is without: left out of it, or waited for.", ("job", "host")),
    ("_gang_shrinks", Counter, "tpud_job_gang_shrinks",
     "Gangs that formed without a host of the one before.", ("job", "host")),
    ("_gang_grows", Counter, "tpud_job_gang_grows",
     "Gangs that formed with a host the one before lacked.", ("job", "host")),
)


def parse_address(address: str) -> tuple[str, int]:
    """"HOST:PORT" or "[V6]:PORT" -> (host, port). The host may be empty (all addresses)."""
    address = address.strip()
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            raise ValueError(f"bad address {address!r}: expected [IPV6]:PORT")
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            raise ValueError(f"bad address {address!r}: expected HOST:PORT")
        if ":" in host:
            raise ValueError(f"bad address {address!r}: write an IPv6 host as [HOST]:PORT")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"bad port in address {address!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in address {address!r}")
    return host, number


def format_address(host: str, port: int) -> str:
    """(host, port) -> "HOST:PORT", with an IPv6 host in brackets (the form parse_address reads)."""
    try:
        v6 = isinstance(ipaddress.ip_address(host.split("%")[0]), ipaddress.IPv6Address)
    except ValueError:
        v6 = ":" in host
    return f"[{host}]:{port}" if v6 else f"{host}:{port}"


def write_address_file(path: str | os.PathLike, host: str, port: int) -> None:
    """Write "HOST:PORT\\n" to path atomically (<runtime>/metrics.addr): a reader sees the old
    file or the whole new one, never a partial line."""
    atomic_write(path, format_address(host, port) + "\n")


class _WithoutCreated:
    """The registry as served: without the *_created series prometheus-client adds to counters
    and histograms (not among the documented names; Prometheus would store each as one more
    series). Local to this registry, unlike prometheus_client.disable_created_metrics()."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            if family.type in ("counter", "histogram", "summary", "gaugehistogram"):
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _HeartbeatCollector:
    """tpud_heartbeat_age_seconds{job}: computed at scrape time from the injected clock."""

    NAME = "tpud_heartbeat_age_seconds"
    HELP = "Seconds since the job's last heartbeat (monotonic clock)."

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def describe(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=["job"])

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["job"])
        now = self._metrics._clock()
        for job, at in self._metrics._heartbeats_snapshot():
            family.add_metric([job], max(0.0, now - at))
        yield family


class Metrics:
    """The daemon's metrics on a private registry. Every method is thread-safe.

    The exposition is a snapshot: the registry's text is rebuilt by the first exposition()
    after a change (every setter counts one), outside the lock the setters take, and only the
    heartbeat ages are written at each call. A scrape then costs a copy, whatever the registry
    holds, and never waits on (or holds up) the loop's updates. Write only through the methods
    (`registry` is there to read)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, version: str = __version__):
        self._clock = clock
        self._lock = threading.RLock()
        self._series: dict[str, set[tuple[object, tuple[str, ...]]]] = {}  # job -> (metric, labels)
        self._heartbeats: dict[str, float] = {}
        self._exporter: Exporter | None = None
        self._changes = 0  # setters' count, under _lock; the snapshot knows the count it was built at
        self._snapshot_lock = threading.Lock()
        self._snapshot, self._snapshot_of = b"", -1
        self.registry = CollectorRegistry()
        r = self.registry
        for attr, kind, name, help, labels in SERIES:
            extra = {"buckets": CHECKPOINT_BUCKETS} if kind is Histogram else {}
            setattr(self, attr, kind(name, help, list(labels), registry=r, **extra))
        self._build_info.labels(version).set(1)
        for source in NOTICE_SOURCES:
            self._preemptions.labels(source)
        self._exposed = _WithoutCreated(r)
        self._heartbeat_ages = CollectorRegistry()  # written at each exposition: they grow with the clock
        self._heartbeat_ages.register(_HeartbeatCollector(self))

    # -- per-job series -------------------------------------------------------------------

    @contextlib.contextmanager
    def _change(self) -> Iterator[None]:
        """Hold the lock for a change to the registry, and count it once made (a snapshot built
        meanwhile is then older than the count, and rebuilt)."""
        with self._lock:
            yield
            self._changes += 1

    def _child(self, metric, *labels: str):
        """metric.labels(*labels), remembered under the job (labels[0]) for remove_job."""
        labels = tuple(str(v) for v in labels)
        self._series.setdefault(labels[0], set()).add((metric, labels))
        return metric.labels(*labels)

    def job_state(self, job: str, state: str | enum.Enum) -> None:
        """tpud_job_state{job,state}: 1 for `state`, 0 for every other known state."""
        name = state.name if isinstance(state, enum.Enum) else str(state)
        name = name.upper()
        if name not in JOB_STATES:
            raise ValueError(f"unknown job state {state!r}; known: {', '.join(JOB_STATES)}")
        with self._change():
            for s in JOB_STATES:
                self._child(self._state, job, s).set(1 if s == name else 0)

    def job_progress(self, job: str, *, step: int | None = None, loss: float | None = None,
                     tokens_per_second: float | None = None, mfu: float | None = None) -> None:
        """Set whichever of step, loss, throughput and MFU are given."""
        with self._change():
            for metric, value in ((self._step, step), (self._loss, loss),
                                  (self._tps, tokens_per_second), (self._mfu, mfu)):
                if value is not None:
                    self._child(metric, job).set(float(value))

    def device(self, job: str, *, in_use: int | None, peak: int | None, compilations: int | None,
               compile_seconds: float | None) -> None:
        """What a step event says of the device: memory in use and peak, graphs compiled and their time."""
        with self._change():
            for metric, labels, value in ((self._device_memory, ("in_use",), in_use),
                                          (self._device_memory, ("peak",), peak),
                                          (self._compilations, (), compilations),
                                          (self._compile_seconds, (), compile_seconds)):
                if value is not None:
                    self._child(metric, job, *labels).set(float(value))

    def experts(self, job: str, **values: float | None) -> None:
        """A mixture of experts' router figures (tpud.job.report.experts' keys)."""
        with self._change():
            gauges = {"aux_loss": self._router_aux, "z_loss": self._router_z, "load_max": self._load_max,
                      "load_cv": self._load_cv, "dropped_fraction": self._dropped}
            for key, value in values.items():
                if value is not None:
                    self._child(gauges[key], job).set(float(value))

    def checkpoint_policy(self, job: str, intervals: dict[str, dict]) -> None:
        """The auto tiers' policies as a step event reports them (engine.checkpoint.policy.Interval)."""
        with self._change():
            for tier, interval in intervals.items():
                for metric, key in ((self._auto_steps, "steps"), (self._auto_seconds, "seconds"),
                                    (self._save_cost, "save_seconds"), (self._expected_loss, "expected_loss_seconds")):
                    if interval.get(key) is not None:
                        self._child(metric, job, tier).set(float(interval[key]))
                if interval.get("disruptions_per_hour") is not None:
                    self._child(self._disruption_rate, job).set(interval["disruptions_per_hour"] / 3600.0)

    def useful_mfu(self, job: str, ratio: float) -> None:
        with self._change():
            self._child(self._useful_mfu, job).set(float(ratio))

    def eval_loss(self, job: str, loss: float) -> None:
        with self._change():
            self._child(self._eval_loss, job).set(float(loss))

    def gang(self, job: str, host: int, present: int, generation: int, members: int = 0, missing: int = 0) -> None:
        with self._change():
            self._child(self._gang_present, job, host).set(present)
            if generation >= 0:
                self._child(self._gang_generation, job, host).set(generation)
            if members:
                self._child(self._gang_members, job, host).set(members)
            self._child(self._gang_missing, job, host).set(missing)

    def gang_changed(self, job: str, host: int, shrank: bool, grew: bool) -> None:
        with self._change():
            self._child(self._gang_shrinks, job, host).inc(int(shrank))
            self._child(self._gang_grows, job, host).inc(int(grew))

    def heartbeat(self, job: str, at: float) -> None:
        """Record a heartbeat at monotonic time `at` (the clock given to Metrics)."""
        with self._lock:
            self._heartbeats[str(job)] = float(at)

    def _heartbeats_snapshot(self) -> list[tuple[str, float]]:
        with self._lock:
            return list(self._heartbeats.items())

    def restart(self, job: str, reason: str) -> None:
        with self._change():
            self._child(self._restarts, job, reason).inc()

    def rolled_back(self, job: str, *, kind: str, verdict: str, samples: int, redone_steps: int) -> None:
        with self._change():
            self._child(self._rollbacks, job, kind, verdict).inc()
            self._child(self._skipped, job).inc(samples)
            self._child(self._redone, job).inc(redone_steps)

    def replica_mismatch(self, job: str, *, odd: str, quarantined: bool) -> None:
        with self._change():
            self._child(self._mismatches, job, odd).inc()
            self._child(self._quarantined, job).set(1 if quarantined else 0)

    def straggler(self, job: str, *, host: int, ratio: float, flagged: bool) -> None:
        with self._change():
            self._child(self._stragglers, job, str(host)).set(ratio if flagged else 0)

    def job_series(self, job: str, *, tiers: Iterable[str], restart_reasons: Iterable[str]) -> None:
        """Create the job's counters at 0, so that increase() sees the first restart or failure
        and a dashboard shows 0 rather than no data."""
        with self._change():
            for tier in tiers:
                self._child(self._ckpt_failures, job, tier)
            for reason in restart_reasons:
                self._child(self._restarts, job, reason)
            self._child(self._skipped, job)
            self._child(self._redone, job)
            for kind in ("spike", "nonfinite"):
                for verdict in ("data", "hardware"):
                    self._child(self._rollbacks, job, kind, verdict)

    def checkpoint(self, job: str, *, tier: str, reason: str, seconds: float, bytes: int,
                   step: int, at: float | None = None) -> None:
        """A committed checkpoint: duration, bytes written, its step and when (unix time), per tier."""
        with self._change():
            self._child(self._ckpt_seconds, job, tier, reason).observe(float(seconds))
            self._child(self._ckpt_bytes, job, tier).inc(bytes)
            self._child(self._ckpt_step, job, tier).set(step)
            self._child(self._ckpt_time, job, tier).set(time.time() if at is None else at)
            self._child(self._ckpt_failures, job, tier)  # exists at 0, so rate() sees the first

    def checkpoint_found(self, job: str, *, tier: str, step: int, at: float) -> None:
        """A checkpoint committed before this daemon started (its manifest's time): the newest
        step and age, so that an overdue checkpoint shows before the first new commit."""
        with self._change():
            self._child(self._ckpt_step, job, tier).set(step)
            self._child(self._ckpt_time, job, tier).set(at)

    def checkpoint_interval(self, job: str, seconds: float) -> None:
        with self._change():
            self._child(self._ckpt_interval, job).set(float(seconds))

    def checkpoint_failure(self, job: str, tier: str) -> None:
        with self._change():
            self._child(self._ckpt_failures, job, tier).inc()

    def preemption_notice(self, source: str) -> None:
        """Not per job: a notice concerns the machine. Survives remove_job."""
        with self._change():
            self._preemptions.labels(str(source)).inc()

    def goodput(self, job: str, ratio: float) -> None:
        with self._change():
            self._child(self._goodput, job).set(float(ratio))

    def badput(self, job: str, kind: str, seconds: float) -> None:
        """Add `seconds` of unproductive time of `kind` (e.g. restart, checkpoint, preemption)."""
        with self._change():
            self._child(self._badput, job, kind).inc(float(seconds))

    def remove_job(self, job: str) -> None:
        """Drop every series labelled with this job."""
        with self._change():
            for metric, labels in self._series.pop(str(job), ()):
                try:
                    metric.remove(*labels)
                except KeyError:
                    pass
            self._heartbeats.pop(str(job), None)

    def exposition(self) -> bytes:
        """The text exposition format, as /metrics serves it."""
        with self._snapshot_lock:
            changes = self._changes
            if changes != self._snapshot_of:
                self._snapshot, self._snapshot_of = generate_latest(self._exposed), changes
            snapshot = self._snapshot
        return snapshot + generate_latest(self._heartbeat_ages)

    # -- HTTP -----------------------------------------------------------------------------

    def serve(self, address: str = DEFAULT_ADDRESS) -> tuple[str, int]:
        """Serve /metrics on "HOST:PORT" (or "[V6]:PORT") in a daemon thread (tpud/metrics/listener.py);
        port 0 picks a free port. Returns the bound (host, port)."""
        host, port = parse_address(address)
        with self._lock:
            if self._exporter is not None:
                raise RuntimeError("metrics server already running")
            exporter = Exporter(self.exposition)
            bound = exporter.start(host or "0.0.0.0", port)
            self._exporter = exporter
            return bound

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound (host, port) while serving, else None."""
        with self._lock:
            return None if self._exporter is None else self._exporter.address

    def close(self) -> None:
        """Stop the HTTP server and release its port. Idempotent."""
        with self._lock:
            exporter, self._exporter = self._exporter, None
        if exporter is not None:
            exporter.close()

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

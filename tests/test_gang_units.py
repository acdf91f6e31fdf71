"""The pure parts of multi-host jobs: which step the hosts restore, the global batch on any host
count, where a host finds its place."""

import pytest

from engine.checkpoint.hosts import Holdings, Hosts, PeerSend, choose, peer_send
from engine.data.loader import PackedLoader, batch_geometry
from engine.backends.base import DataPosition
from engine.errors import ConfigError
from tpud.gang.discovery import discover
from tpud.settings import Settings


def holdings(parts, marked=()):
    return Holdings(frozenset(parts), frozenset(marked))


def test_restore_takes_the_newest_step_marked_anywhere_and_held_by_every_host():
    # Host 2 died between its part of step 9 and its marker; host 1 never wrote step 12.
    hosts = [holdings({(6, 0), (9, 0), (12, 0)}, {(6, 0), (9, 0), (12, 0)}),
             holdings({(6, 0), (9, 0)}, {(6, 0), (9, 0)}),
             holdings({(6, 0), (9, 0)}, {(6, 0)})]
    key, passed = choose(hosts, 3, {})
    assert key == (9, 0) and passed == ["step 12.0000: host(s) [1, 2] lack their part"]


def test_a_part_no_host_marked_is_never_restored():
    hosts = [holdings({(3, 0), (6, 0)}, {(3, 0)}), holdings({(3, 0), (6, 0)}, {(3, 0)})]
    assert choose(hosts, 2, {})[0] == (3, 0)
    assert choose([holdings({(6, 0)}), holdings({(6, 0)})], 2, {}) == (None, [])


def test_a_partial_step_resumes_only_on_the_host_count_that_made_it():
    hosts = [holdings({(4, 0), (5, 1)}, {(4, 0), (5, 1)})] * 2
    assert choose(hosts, 2, {(5, 1): 3, (4, 0): 3})[0] == (4, 0)
    assert choose(hosts, 3, {(5, 1): 3, (4, 0): 3})[0] == (5, 1)


def keys(*steps):
    return frozenset((s, 0) for s in steps)


def test_a_host_back_behind_takes_the_state_the_holders_of_a_newer_commit_hold():
    """The chaos campaign's seed 5: host 0 was away (disk 15300, memory 15315); hosts 1-3 went on and
    committed 15317. Every host still holds 15315 in memory, but restoring it would undo the commit."""
    disks = [holdings(keys(15300), keys(15300))] + [holdings(keys(15300, 15317), keys(15300, 15317))] * 3
    memories = [keys(15300, 15315)] + [keys(15315, 15317)] * 3
    assert choose(disks, 4, {})[0] == (15300, 0)
    assert peer_send(memories, disks, (15300, 0)) == PeerSend((15317, 0), 1, (0,))
    # A blank host (a replaced VM), the gang of two having committed steps it never saw: the same.
    disks = [holdings(keys(4, 8), keys(4, 8)), holdings(keys(4, 8), keys(4, 8)), holdings(keys(4), keys(4))]
    assert peer_send([keys(8, 9), keys(8, 9), frozenset()], disks, (4, 0)) == PeerSend((9, 0), 0, (2,))
    # Nothing newer committed: only a blank host is sent the newest state every other host holds.
    same = [holdings(keys(4), keys(4))] * 3
    assert peer_send([keys(5, 6), keys(6, 7), frozenset()], same, (4, 0)) == PeerSend((6, 0), 0, (2,))
    assert peer_send([keys(5, 6), keys(6, 7), keys(5)], same, (4, 0)) is None  # behind, nothing committed
    assert peer_send([keys(6), keys(6), keys(6)], same, (4, 0)) is None  # all hold it already


def test_a_commit_a_rollback_undid_is_no_source_and_a_holder_without_memory_is_skipped():
    # Host 1 holds global 110, which the others rolled back (and set aside) while it was away.
    disks = [holdings(keys(100, 105), keys(100, 105)), holdings(keys(100, 110), keys(100, 110)),
             holdings(keys(100, 105), keys(100, 105))]
    assert peer_send([keys(105), keys(110, 111), keys(105)], disks, (100, 0)) is None
    # Half the hosts with the lowest are a quorum; a holder whose memory tier is blank sends nothing.
    disks = [holdings(keys(4, 8), keys(4, 8)), holdings(keys(4, 8), keys(4, 8)),
             holdings(keys(4), keys(4)), holdings(keys(4), keys(4))]
    assert peer_send([frozenset(), keys(8, 9), keys(5), keys(5)], disks, (4, 0)) == PeerSend((9, 0), 1, (0, 2, 3))
    # Partial steps are never sent: their accumulated gradients are their host's own micro-batches'.
    assert peer_send([frozenset({(9, 1)}), frozenset({(9, 1)}), keys(5), keys(5)], disks, (4, 0)) is None


@pytest.mark.parametrize("world, micro, accum", [(1, 4, 3), (2, 3, 2), (3, 4, 1), (4, 3, 1), (6, 2, 1)])
def test_global_batch_size_keeps_the_batch_on_any_number_of_ranks(tiny_spec, world, micro, accum):
    spec = tiny_spec("train.global_batch_size=12", "data.micro_batch_size=4")
    fits, schedule = batch_geometry(spec.train, spec.data.micro_batch_size, world)
    assert (fits, schedule.at(0)) == (micro, accum) and fits * accum * world == 12


def test_the_samples_of_a_step_are_the_same_on_three_ranks_and_on_two(tiny_spec):
    spec = tiny_spec("train.global_batch_size=12", "data.micro_batch_size=2", "data.seq_len=16")
    from engine.data.dataset import open_data

    samples = open_data(spec.data, 0, None, spec.model.vocab_size, None).train

    def step_rows(world, step):
        micro, accum = batch_geometry(spec.train, spec.data.micro_batch_size, world)
        rows = []
        for rank in range(world):
            loader = PackedLoader(samples, micro, accum, 0, DataPosition(rank, world))
            rows += [tuple(r) for m in range(accum.at(step)) for r in loader.batch(step, m).inputs.tolist()]
        return sorted(rows)

    for step in (0, 5):
        assert step_rows(3, step) == step_rows(2, step) == step_rows(4, step)


def test_global_batch_size_refuses_an_uneven_split(tiny_spec):
    spec = tiny_spec("train.global_batch_size=12")
    with pytest.raises(ConfigError, match="do not divide evenly among 5"):
        batch_geometry(spec.train, spec.data.micro_batch_size, 5)


def test_global_batch_size_and_grad_accum_steps_are_exclusive(tiny_spec):
    from engine.spec.loader import SpecError

    with pytest.raises(SpecError, match="grad_accum_steps"):
        tiny_spec("train.global_batch_size=12", "train.grad_accum_steps=2")


def test_a_host_finds_its_place_in_settings_then_the_tpu_environment():
    settings = Settings.model_validate({"gang": {"host_index": 2, "host_count": 3, "coordinator": "127.0.0.1:5000"}})
    place = discover(settings, {})
    assert (place.host, place.hosts, place.loopback) == (2, 3, True)
    assert place.worker_env()["TPUD_GANG_HOST"] == "2"
    tpu = discover(Settings(), {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"})
    assert (tpu.host, tpu.hosts, tpu.coordinator, tpu.loopback) == (1, 2, "10.0.0.2:8476", False)
    assert discover(Settings(), {}) is None  # one host: no gang


def test_the_worker_gets_its_place_and_whether_to_watch_its_peers(monkeypatch):
    from tpud.worker.gang.member import GangMember

    for restart_peers in (True, False):
        settings = Settings.model_validate({"gang": {"host_index": 1, "host_count": 2, "coordinator": "[::1]:5000",
                                                     "peer_timeout_seconds": 1.5, "restart_peers": restart_peers}})
        for key, value in discover(settings, {}).worker_env().items():
            monkeypatch.setenv(key, value)
        member = GangMember.from_env("job", print)
        assert (member.host, member.hosts, member.coordinator, member.peer_timeout_s, member.restart_peers) == (
            1, 2, "[::1]:5000", 1.5, restart_peers)
        assert member.seating.min_hosts == 2 and member.place == Hosts(1, 2, (0, 1))  # every host, by default
    settings = Settings.model_validate({"gang": {"host_index": 2, "host_count": 3, "coordinator": "h:1", "min_hosts": 2}})
    for key, value in discover(settings, {}).worker_env().items():
        monkeypatch.setenv(key, value)
    member = GangMember.from_env("job", print)
    member.seating.members = [0, 2]  # host 1 left out: host 2 is rank 1 of 2
    assert member.seating.min_hosts == 2 and (member.rank, member.place) == (1, Hosts(1, 2, (0, 2)))


def test_gang_evict_stragglers_evicts_in_every_job_of_the_gang_as_the_jobs_own_setting_does(monkeypatch):
    from types import SimpleNamespace

    from engine.health.stragglers import StragglerWatch
    from engine.runtime import Runtime
    from engine.spec.schema import StragglerConfig

    backend = SimpleNamespace(data=SimpleNamespace(world=2), agreement_group=object())
    gang = {"host_index": 0, "host_count": 2, "coordinator": "h:1"}
    for evict_stragglers, job_evicts, evicts in ((False, False, False), (True, False, True), (False, True, True)):
        env = discover(Settings.model_validate({"gang": {**gang, "evict_stragglers": evict_stragglers}}), {}).worker_env()
        told = Runtime.from_env(env)  # as the worker reads what its daemon set
        assert StragglerWatch(StragglerConfig(evict=job_evicts), backend, print, told.evict_stragglers).evict is evicts
    assert StragglerWatch(None, backend, print).evict is False  # health.stragglers null: never judged


@pytest.mark.parametrize("worker_id, names", [("x", "a,b"), ("2", "a,b"), ("0", " , ")])
def test_a_garbled_tpu_environment_runs_as_one_host_instead_of_failing_to_start(worker_id, names):
    assert discover(Settings(), {"TPU_WORKER_ID": worker_id, "TPU_WORKER_HOSTNAMES": names}) is None


@pytest.mark.parametrize("gang", [{"host_index": 3, "host_count": 3, "coordinator": "h:1"},
                                  {"host_index": 0, "host_count": 2, "coordinator": "no-port"},
                                  {"host_index": 0, "host_count": 2, "coordinator": "h:99999"},
                                  {"host_index": 0, "host_count": 2, "coordinator": "h:1", "min_hosts": 3},
                                  {"host_index": 0, "host_count": 2, "coordinator": "h:1", "min_hosts": 0},
                                  {"host_index": 0, "host_count": 2},  # no coordinator at all
                                  {"host_index": 0, "host_count": 2, "coordinators": ["h:1"]},  # one of two
                                  {"host_index": 0, "host_count": 2, "coordinators": ["h:1", "h:1"]},
                                  {"host_index": 0, "host_count": 2, "coordinators": ["h:1", "no-port"]},
                                  {"host_index": 0, "host_count": 2, "coordinators": ["h:1", "h:0"]},
                                  {"host_index": 0, "host_count": 2, "coordinator": "h:2",
                                   "coordinators": ["h:1", "h:3"]}])  # host 0's twice, differently
def test_bad_gang_settings_are_refused(gang):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        Settings.model_validate({"gang": gang})


def test_a_tpu_vm_reads_its_worker_number_and_peers_from_the_metadata_server(metadata_server):
    from tpud.gang.discovery import _from_metadata

    key = "instance/attributes/"
    assert _from_metadata(metadata_server.host, 8476) is None  # not a TPU slice's VM: no such attributes
    metadata_server.set(key + "agent-worker-number", "1")
    metadata_server.set(key + "worker-network-endpoints", "unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3,"
                        "unknown:unknown:10.0.0.4")
    place = _from_metadata(metadata_server.host, 8476)
    assert (place.host, place.hosts, place.coordinator, place.loopback) == (1, 3, "10.0.0.2:8476", False)
    for number, endpoints in (("3", None), ("x", None), ("0", "garbage")):
        metadata_server.set(key + "agent-worker-number", number)
        if endpoints:
            metadata_server.set(key + "worker-network-endpoints", endpoints)
        assert _from_metadata(metadata_server.host, 8476) is None, (number, endpoints)


def test_the_gangs_first_member_uploads_to_gcs_and_logs_to_wandb_host_0_unless_the_gang_formed_without_it(
        tmp_path, tiny_spec):
    from structlog.testing import capture_logs

    from engine import events
    from tpud.gcs.tiers import CheckpointTiers
    from tpud.gang.discovery import GangPlace
    from tpud.job.gang import GangView
    from tpud.metrics.series import Metrics
    from tpud.paths import Paths
    from tpud.tracking import JobTracker

    metrics = Metrics()
    views = [GangView(GangPlace(host, 3, "127.0.0.1:1", min_hosts=2), "j", metrics) for host in range(3)]
    assert [v.uploads() for v in views] == [True, False, False]  # before a gang forms: host 0, as ever
    for members in ([0, 1, 2], [1, 2], [0, 2]):
        trackers = [JobTracker(None, job="j", directory=tmp_path, saved={}, newest_run_id=lambda: None)
                    for _ in views]
        for host, (view, tracker) in enumerate(zip(views, trackers)):
            formed = events.Gang(host=host, hosts=3, present=len(members), generation=1, members=members)
            view.on_gang(formed)
            tracker.on_gang(formed)
        first = min(members)
        assert [v.uploads() for v in views] == [h == first for h in range(3)], members
        assert [t.rank == 0 for t in trackers] == [h == first for h in range(3)], members

    # The GCS tier asks at each commit: a host that does not upload leaves the step alone.
    spec = tiny_spec("checkpoint.remote=gs://bucket/ckpt")
    for uploads in (False, True):
        tiers = CheckpointTiers(spec, Paths.resolve(tmp_path), lambda *a: None, uploads=lambda: uploads)
        with capture_logs() as logs:
            tiers.on_checkpoint_committed(events.CheckpointCommitted(3, 0, "interval", str(tmp_path / "nowhere")))
        assert any("not a committed step directory" in e["event"] for e in logs) is uploads


def test_every_host_runs_its_own_coordinator_when_the_gang_lists_them():
    gang = {"host_count": 3, "coordinators": ["a:1", "b:2", "[::1]:3"]}
    places = [discover(Settings.model_validate({"gang": {**gang, "host_index": i}}), {}) for i in range(3)]
    assert [p.own_coordinator for p in places] == ["a:1", "b:2", "[::1]:3"]
    assert places[2].worker_env()["TPUD_GANG_COORDINATOR"] == "a:1,b:2,[::1]:3"
    alone = discover(Settings.model_validate({"gang": {"host_index": 1, "host_count": 2, "coordinator": "a:1"}}), {})
    assert alone.own_coordinator is None  # only host 0 runs one
    tpu = discover(Settings(), {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "w0,w1"})
    assert tpu.addresses == ("w0:8476", "w1:8476") and tpu.own_coordinator == "w1:8476"


def test_a_hosts_other_processes_wait_for_the_gang_its_first_formed_or_for_a_stop(monkeypatch):
    """tpud/worker/gang/host.py: local rank 0 serves the host's store and says which gang formed; the
    others wait for it, telling their daemon they live, and give up on a stop. Local rank 0 gone
    without a stop is its failure: the wait raises (the daemon ends the host's processes anyway)."""
    import gc

    from testkit.helpers import free_port
    from tpud.worker.gang import host
    from tpud.worker.gang.host import Formed, HostProcesses

    monkeypatch.setattr(host, "POLL_S", 0.05)
    monkeypatch.setattr(host, "STOP_GRACE_S", 0.2)
    env = {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    assert HostProcesses.from_env({"LOCAL_WORLD_SIZE": "1"}) is None
    first, second = (HostProcesses.from_env({**env, "LOCAL_RANK": str(r)}) for r in (0, 1))
    assert first.leads and not second.leads
    first.store()
    beats: list[int] = []
    assert second.wait(lambda: len(beats) >= 2, lambda: beats.append(1)) is None  # a stop while waiting
    first.share(Formed(4, [0, 2], 2))
    assert second.wait(lambda: False, lambda: None) == Formed(4, [0, 2], 2)
    waiting = HostProcesses.from_env({**env, "LOCAL_RANK": "1"})
    waiting.store()
    first._store = None  # local rank 0's process is gone, and its store with it; no stop was asked
    gc.collect()
    with pytest.raises((RuntimeError, OSError)):
        waiting.wait(lambda: False, lambda: None)

"""The chaos campaign (bench/chaos.py, testkit/chaos/): its schedule and minimiser alone, and its
short form end to end: a gang of three daemons on loopback under four minutes of random faults of
every kind, at a fixed seed, then healed and trained to the end with no invariant violated."""

from __future__ import annotations

import json
import signal
import tempfile

import pytest
import structlog

from testkit.chaos import schedule as sch
from testkit.chaos.campaign import Options, run
from testkit.chaos.minimise import minimise


def test_a_schedule_is_drawn_from_its_seed_with_every_kind_and_written_out_and_back():
    drawn = sch.draw(7, 1800, 4, every_s=40)
    assert drawn == sch.draw(7, 1800, 4, every_s=40) and drawn != sch.draw(8, 1800, 4, every_s=40)
    assert len(drawn) == 45 and {f.kind for f in drawn} == set(sch.KINDS)
    assert all(0 <= f.host < 4 for f in drawn)
    timed = [f for f in drawn if f.at is not None]
    assert all(60 <= f.at <= 1620 for f in timed)  # none during start-up nor in the last 10 %
    assert sch.from_json(sch.to_json(drawn)) == drawn
    inject = sch.inject_section(drawn)
    flips = [f for f in drawn if f.kind == "bit_flip"]
    assert [(x["step"], x["rank"]) for x in inject["bit_flips"]] == [(f.step, f.host) for f in flips]
    assert all(f.step >= sch.FIRST_STEP for f in drawn if f.step is not None)  # after spike detection's warm-up
    with pytest.raises(ValueError, match="row 0: unknown fault kind 'meteor'"):
        sch.from_json([{"kind": "meteor", "host": 0}])


def test_the_minimiser_keeps_only_the_faults_that_together_cause_the_violation():
    faults = sch.draw(3, 1800, 4, every_s=40)
    culprits = [faults[4], faults[31]]
    tries = []

    def fails(schedule):
        tries.append(len(schedule))
        return all(f in schedule for f in culprits)

    assert minimise(faults, fails, say=lambda line: None) == [faults[4], faults[31]]
    assert len(tries) < 60  # far fewer campaigns than dropping one fault at a time from 45 would take


@pytest.mark.slow
@pytest.mark.timeout(900)  # four minutes of faults, the end, and 2,000 reference steps, on a loaded machine
def test_a_short_campaign_of_every_kind_of_fault_violates_no_invariant():
    lines = []

    def say(line):  # printed as it goes too: pytest shows it if the test times out
        lines.append(line)
        print(line, flush=True)

    # The campaign's own deadlines (settle, then finish) end it, saying where each host stands,
    # well inside the test's timeout.
    result = run(Options(seed=11, duration_s=240, hosts=3, min_hosts=2, every_s=15, steps_per_s=15,
                         settle_timeout_s=150, reference_steps=2000, say=say))
    report = "\n".join(lines[-40:])
    assert result["violations"] == [], report
    assert result["finished"], report
    kinds = set(result["faults_per_kind"]) | set(result["stepped_fired"])
    assert len(kinds) >= 8, (kinds, report)
    # Held to the reference over its first 2,000 steps, or all it trained (a loaded machine trains fewer).
    compared = result["loss_curve"]["steps_compared"]
    assert compared >= min(2000, result["final_steps"]) - 1 and result["checked"]["commit_lost"] >= 3, report


def test_the_reference_is_fed_the_samples_the_hosts_skipped_and_finds_hosts_that_disagree(tmp_path):
    from testkit.chaos.reference import ledger

    def write(name, *samples):
        (tmp_path / name).write_text(json.dumps({"entries": [{"samples": list(s)} for s in samples]}))
        return tmp_path / name

    # A rollback's ranges, and the same samples adopted by a host that joined later in another geometry.
    first = write("a", (120, 12), (132, 12), (600, 24))
    joined = write("b", (120, 24), (600, 12), (612, 12))
    covered = ((120, 24), (600, 24))
    assert ledger({0: first, 1: joined}) == ([[120, 24], [600, 24]], {0: covered, 1: covered})
    assert ledger({0: first, 2: tmp_path / "never-skipped"})[1] == {0: covered, 2: ()}
    (tmp_path / "torn").write_text('{"entries": [{"samp')
    with pytest.raises(ValueError, match="torn cannot be read"):
        ledger({0: first, 1: tmp_path / "torn"})


def test_the_operator_replaces_a_host_left_out_and_starts_a_job_that_spent_a_budget():
    from testkit.chaos.campaign import budget_spent, left_out

    assert left_out({"replicas": {"quarantined": True}, "error": "replica mismatch (step=40, odd=[2])"})
    assert left_out({"replicas": None, "error": "rank 0 is a straggler: ... evicted"})
    assert not left_out({"replicas": {"quarantined": False, "healed": True},
                         "error": "3 rollbacks within 1000 steps (health.max_rollbacks); then loss spike"})
    assert not left_out({"error": None})
    # Any other failure is started again too, but it is a violation: no fault may fail a job unless
    # it spends a budget.
    assert budget_spent("restart budget spent (5 restarts within 600s); last: killed: worker killed by SIGKILL")
    assert budget_spent("3 rollbacks within 1000 steps (health.max_rollbacks); then loss spike")
    assert not budget_spent("exit 78 job cannot run here (error=the hosts of the gang run different job specs: ...)")


def test_a_job_edit_reaches_the_hosts_one_after_another_and_a_newer_edit_supersedes_it():
    from testkit.chaos.faults import ROLLOUT_GAP_S, Injector

    class Files:  # the cluster's hosts' job files
        hosts = [object(), object(), object()]
        held = {}

        def write_job(self, text, host=None, *, replace=False):
            self.held[self.hosts.index(host)] = text

    cluster = Files()
    injector = Injector(cluster, lambda variant: f"variant {variant}")
    first = injector.strike(sch.Fault("job_edit", 1, at=100.0, detail={"how": "in_place"}), 100.0)
    assert cluster.held == {1: "variant 1"}  # the fault's host first, the others later
    assert [at for at, _ in first.later] == [100.0 + ROLLOUT_GAP_S, 100.0 + 2 * ROLLOUT_GAP_S]
    assert first.later[0][1]() == "copied to host 2" and cluster.held == {1: "variant 1", 2: "variant 1"}
    second = injector.strike(sch.Fault("job_edit", 0, at=103.0, detail={"how": "replace"}), 103.0)
    assert first.later[1][1]() == "host 0: superseded by a newer edit" and cluster.held[0] == "variant 0"
    for _, copy in second.later:
        copy()
    assert cluster.held == {0: "variant 0", 1: "variant 0", 2: "variant 0"}


def test_a_campaign_that_does_not_finish_says_where_each_host_stands():
    """The one look a failed short campaign leaves (a CI run): each host's state, step, error, gang
    and last events, in the results and in the lines it says."""
    from types import SimpleNamespace

    from testkit.chaos.campaign import Campaign

    rows = [{"state": "SUCCEEDED", "step": 130}, None,
            {"state": "STARTING", "step": 100, "error": None, "gang": {"state": "waiting for hosts (1 of 3)"}}]
    hosts = [SimpleNamespace(index=i, status=lambda row=row: (row, 0.001),
                             log=SimpleNamespace(records=[{"event": "job state"}, {"event": "gang formed"}]))
             for i, row in enumerate(rows)]
    lines = []
    campaign = Campaign(Options(say=lines.append), SimpleNamespace(hosts=hosts), [], {})
    campaign.unfinished("not every host finished step 130")
    (violation,) = campaign.checker.violations
    assert violation.invariant == "unfinished" and violation.detail.startswith("not every host finished step 130: ")
    said = "\n".join(lines)
    for text in ("host 0: SUCCEEDED at step 130", "host 1: None at step None",
                 "host 2: STARTING at step 100 (error None, gang 'waiting for hosts (1 of 3)'); "
                 "last: ['job state', 'gang formed']"):
        assert text in said and text in violation.detail


def test_a_gang_that_trains_past_no_new_step_for_five_minutes_is_stalled_once_per_stall():
    """chaos-12: three live hosts trained no step past about 7,280 for 20 minutes of faults, and the job
    finished once they stopped: no other invariant saw it. Steps redone below the newest (a
    rollback, a restore) are no progress; a new step ends the stall."""
    from types import SimpleNamespace

    from testkit.chaos.invariants import STALL_BOUND_S, Checker, longest_stall

    t0 = 1000.0
    checker = Checker(SimpleNamespace(hosts=[]), t0, faults_around=lambda t: [f"fault near {t:.0f}"])

    def step(host, at, n):
        checker.record(SimpleNamespace(index=host), {"event": "step", "job": "chaos", "step": n, "_t": t0 + at})

    step(0, 30.0, 1)
    step(1, 600.0, 7200)
    checker._stalled(t0 + 600.0 + STALL_BOUND_S)  # at the bound: not yet
    for at in (700.0, 800.0, 880.0):  # restored and trained again below the newest: still stuck
        step(2, at, 7190)
    checker._stalled(t0 + 901.0)
    checker._stalled(t0 + 1200.0)  # the same stall: said once
    (stalled,) = checker.violations
    assert (stalled.invariant, stalled.t, stalled.host) == ("stalled", 900.0, None)
    assert stalled.detail == "no host trained past step 7200 for 300 s (since 600.0 s)"
    assert stalled.faults == ["fault near 660"]  # those struck as it began, not at its 300th second
    step(0, 1210.0, 7201)
    checker._stalled(t0 + 1300.0)
    assert len(checker.violations) == 1 and checker.checked["stalled"] == 4
    # The campaign's figure: the longest such time while faults struck (the start counts, the end too).
    assert longest_stall(checker.steps, t0, t0 + 1300.0) == 610.0
    assert longest_stall({}, t0, t0 + 240.0) == 240.0


def test_a_campaign_that_violated_keeps_its_clusters_files_without_being_asked(monkeypatch, tmp_path):
    """Its daemons' logs are what a diagnosis reads, and a replay may not strike it again (chaos-12's
    stall did not); a campaign that violated nothing, and a minimiser's try, leave nothing behind."""
    from pathlib import Path

    from testkit.chaos import campaign

    class Cluster:
        def __init__(self, root, *args, **kwargs):
            (root / "host0").mkdir()
            (root / "host0" / "daemon.log").write_text('{"event": "step"}\n')

        def close(self):
            pass

    outcomes = iter([[{"invariant": "stalled"}], [], [{"invariant": "stalled"}]])

    class Campaign:
        def __init__(self, *args):
            pass

        def run(self):
            return {"violations": next(outcomes)}

    monkeypatch.setattr(campaign, "Cluster", Cluster)
    monkeypatch.setattr(campaign, "Campaign", Campaign)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lines = []
    kept = Path(run(Options(schedule=[], say=lines.append))["kept"])
    assert (kept / "host0" / "daemon.log").read_text() == '{"event": "step"}\n' and str(kept) in lines[-1]
    assert "kept" not in run(Options(schedule=[], say=lines.append))
    assert "kept" not in run(Options(schedule=[], keep_violating=False, say=lines.append))
    assert [p.name for p in tmp_path.iterdir()] == [kept.name]  # each cluster's own directory removed


@pytest.fixture(scope="module")
def chaos_cli():
    import importlib.util

    from testkit import REPO

    spec = importlib.util.spec_from_file_location("chaos_cli", REPO / "bench" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # main() takes SIGTERM for Ctrl-C and quiets structlog for a campaign: the test process's are given back.
    sigterm, logging = signal.getsignal(signal.SIGTERM), structlog.get_config()
    yield module
    signal.signal(signal.SIGTERM, sigterm)
    structlog.configure(**logging)


@pytest.mark.parametrize("argv, says", [
    (["--minutes", "0"], "--minutes: must be above 0"),
    (["--every", "-5"], "--every: must be above 0"),
    (["--steps-per-s", "nan"], "--steps-per-s: must be above 0"),
    (["--reference-steps", "0"], "--reference-steps: must be at least 1"),
    (["--seeds", "5-3"], "the range is empty"),
    (["--seeds", "1-2", "--out", "x.json"], "--out names one results file"),
    (["--hosts", "1"], "--hosts must be at least 2"),
    (["--kinds", "worker_kill,meteor"], "--kinds: unknown meteor"),
])
def test_the_campaign_refuses_bad_arguments_before_it_starts(chaos_cli, capsys, tmp_path, argv, says):
    with pytest.raises(SystemExit) as ended:
        chaos_cli.main(argv)
    assert ended.value.code == 2 and says in capsys.readouterr().err


def test_the_campaign_refuses_paths_it_could_not_write_and_a_schedule_it_cannot_read(chaos_cli, capsys, tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "torn.json").write_text('{"schedule": [{"kind": "worker_')
    (tmp_path / "one.json").write_text('[{"kind": "worker_kill", "host": 0, "at": 70.0}]')
    for argv, says in [(["--keep", str(tmp_path / "a-file")], "exists and is not a directory"),
                       (["--out", str(tmp_path)], "is a directory"),
                       (["--schedule", str(tmp_path / "torn.json")], "torn.json"),
                       (["--schedule", str(tmp_path / "one.json"), "--seeds", "1-2"], "without --seeds"),
                       (["--summary", str(tmp_path / "a-file")], f"--summary {tmp_path / 'a-file'}: ")]:
        with pytest.raises(SystemExit) as ended:
            chaos_cli.main(argv)
        assert ended.value.code == 2 and says in capsys.readouterr().err, argv


def test_results_that_cannot_be_written_where_asked_go_to_a_temporary_file(chaos_cli, tmp_path, capsys,
                                                                           monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    written = chaos_cli.write_results(blocked / "chaos-3.json", {"seed": 3, "violations": []})
    assert json.loads(written.read_text()) == {"seed": 3, "violations": []}
    assert "could not write" in capsys.readouterr().err
    written.unlink()
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))  # no temporary directory either: stderr, said so
    assert chaos_cli.write_results(blocked / "chaos-3.json", {"seed": 3}) == "nowhere (printed on stderr above)"
    assert '"seed": 3' in capsys.readouterr().err


def test_a_violation_seen_while_faults_struck_is_minimised_with_short_tries_of_the_faults_before_it(chaos_cli):
    faults = sch.draw(3, 1800, 4, every_s=40)
    culprits = [faults[4], faults[9]]
    t = max(chaos_cli._strikes_at(f, 12.0) for f in culprits) + 5
    original = {"violations": [{"invariant": "commit_lost", "t": t}], "schedule": sch.to_json(faults),
                "faults_end_s": 1800.0}
    tries = []

    def run(opts):
        tries.append(opts)
        hit = all(f in opts.schedule for f in culprits)
        return {"violations_per_invariant": {"commit_lost": 1} if hit else {}}

    found = chaos_cli.shrink(chaos_cli.Options(seed=3), original, run=run)
    assert sch.from_json(found["schedule"]) == culprits and found["invariant"] == "commit_lost"
    # Every try ends at its target's first violation, soon after the original's time, with no
    # reference run, and none strikes a fault that came after it.
    assert all(o.stop_on == "commit_lost" and o.duration_s == t + chaos_cli.AFTER_S and not o.reference
               for o in tries)
    assert max(len(o.schedule) for o in tries) < len(faults)
    # Where the faults before the violation do not cause it alone, the tries are whole campaigns.
    tries.clear()
    culprits.append(faults[-1])
    chaos_cli.shrink(chaos_cli.Options(seed=3), original, run=run)
    assert tries[0].stop_on == "commit_lost" and all(o.stop_on is None and o.duration_s == 1800 for o in tries[1:])


def test_an_interrupted_campaign_keeps_what_it_found_beside_a_whole_runs_results(chaos_cli, tmp_path, monkeypatch,
                                                                                   capsys):
    whole = tmp_path / "chaos-5.json"
    whole.write_text('{"seed": 5, "whole": true}')
    found = {"seed": 5, "stopped": "interrupted", "stopped_at_s": 612.0, "schedule": [],
             "struck": [{"struck": True}, {"struck": False}], "violations": [{"invariant": "status_slow"}],
             "violations_per_invariant": {"status_slow": 1}}
    monkeypatch.setattr(chaos_cli, "campaign", lambda opts: found)
    assert chaos_cli.main(["--seed", "5", "--out", str(whole), "--no-reference"]) == 130
    assert json.loads(whole.read_text()) == {"seed": 5, "whole": True}
    assert json.loads((tmp_path / "chaos-5.interrupted.json").read_text()) == found
    assert "interrupted at 612.0 s: 1 faults struck" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # and it is no whole campaign's row
        chaos_cli.main(["--summary", str(tmp_path / "chaos-5.interrupted.json")])
    assert "not a whole one" in capsys.readouterr().err


def test_ctrl_c_during_a_minimisers_try_stops_the_minimiser(chaos_cli):
    faults = sch.draw(3, 1800, 4, every_s=40)
    original = {"violations": [{"invariant": "loss_curve", "t": 1900.0}], "schedule": sch.to_json(faults),
                "faults_end_s": 1800.0}
    tries = []

    def run(opts):
        tries.append(opts)
        return {"stopped": "interrupted", "violations_per_invariant": {}}

    with pytest.raises(KeyboardInterrupt):
        chaos_cli.shrink(chaos_cli.Options(seed=3), original, run=run)
    assert len(tries) == 1  # a violation at the end: whole campaigns, and the reference run for its curve
    assert tries[0].stop_on is None and tries[0].reference

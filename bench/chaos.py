"""The chaos campaign: every fault tpud handles, at random and together, with invariants checked.

N `tpud daemon`s on loopback (default 4 hosts of one elastic gang, gang.min_hosts 2, each its own
coordinator, GCE metadata server and tmpfs state directory; one fake-gcs-server) train the tiny
model with the memory tier, the GCS tier, replica checks and spike rollback on, while a schedule
drawn from the seed strikes faults at random times, alone and overlapping (testkit/chaos/
schedule.py lists the kinds). The invariants (testkit/chaos/invariants.py) are checked all along
and at the end, after every fault is healed, the job trained to its end on every host and every
daemon stopped. Every run replays from its seed; the schedule, what each fault did and what ended
it go into the results file.

    .venv/bin/python bench/chaos.py                        # 30 min, seed 0
    .venv/bin/python bench/chaos.py --seed 11 --minutes 4 --hosts 3 --every 15  # about CI's short form
    .venv/bin/python bench/chaos.py --hours 4              # a soak
    .venv/bin/python bench/chaos.py --seeds 1-10           # one campaign per seed, a summary row each
    .venv/bin/python bench/chaos.py --replay 7 --minimise  # the smallest schedule that still violates
    .venv/bin/python bench/chaos.py --schedule FILE        # a schedule as written (results or minimiser)
    .venv/bin/python bench/chaos.py --summary              # every campaign's results so far, and per fault kind
Results: a table on stdout and bench/results/chaos-SEED.json (--out for another path); a campaign
interrupted (Ctrl-C, SIGTERM) writes what it found so far to chaos-SEED.interrupted.json and ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import structlog

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from machine import describe  # noqa: E402
from testkit.chaos import schedule as sch  # noqa: E402
from testkit.chaos.campaign import Options, run  # noqa: E402
from testkit.chaos.minimise import minimise  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=positive, default=30.0, help="how long faults are struck (default 30)")
    length.add_argument("--hours", type=positive, help="the same, in hours (a soak)")
    parser.add_argument("--seed", type=int, default=0, help="draws the schedule (default 0)")
    parser.add_argument("--seeds", help="A-B: one campaign per seed in the range, one after the other")
    parser.add_argument("--hosts", type=int, default=4, help="daemons of the gang (default 4)")
    parser.add_argument("--min-hosts", type=int, default=2, help="gang.min_hosts (default 2)")
    parser.add_argument("--every", type=positive, default=30.0, help="a fault about every this many seconds (default 30)")
    parser.add_argument("--steps-per-s", type=positive, default=12.0,
                        help="the gang's expected pace, to place the faults struck at a step (default 12: the tiny "
                        "model's on 2 cores)")
    parser.add_argument("--kinds", help=f"comma-separated fault kinds (default all: {', '.join(sch.KINDS)})")
    parser.add_argument("--replay", type=int, metavar="SEED", help="run SEED's schedule again (same as --seed)")
    parser.add_argument("--schedule", type=Path, help="run this schedule (a results file or a minimiser's output)")
    parser.add_argument("--minimise", action="store_true",
                        help="after a run that violated an invariant, drop faults while the same invariant is still "
                        "violated, and write the smallest schedule (a violation seen while faults struck: short "
                        "tries of the faults before it, each ended at the violation)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the reference run the loss curve is held to (within 1 %% per window of 100 steps or a twentieth of the run)")
    parser.add_argument("--reference-steps", type=positive_int, metavar="N",
                        help="compare the loss curve over the first N steps only (a shorter reference run)")
    parser.add_argument("--keep", type=Path, help="copy the cluster's files (logs, state) here at the end (with "
                        "--seeds, into seed-N/ under it)")
    parser.add_argument("--out", type=Path, help="results file (default bench/results/chaos-SEED.json; one seed only)")
    parser.add_argument("--summary", nargs="*", type=Path, metavar="FILE",
                        help="run nothing: a row per campaign and each fault kind over all of them, from these "
                        "results files (default bench/results/chaos-*.json)")
    args = parser.parse_args(argv)
    if args.summary is not None:
        found = [p for p in (REPO / "bench" / "results").glob("chaos-*.json") if p.stem.split("-")[1].isdigit()]
        return summarise(args.summary or sorted(found, key=lambda p: int(p.stem.split("-")[1])), parser)
    # The GCS client's own records (the end's read-back of every remote commit) are not the report.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    # SIGTERM as Ctrl-C: the campaign's cleanup runs (daemons killed, tmpfs unmounted, files removed).
    signal.signal(signal.SIGTERM, _interrupt)
    seeds = _seeds(args, parser)
    kinds = tuple(args.kinds.split(",")) if args.kinds else tuple(sch.KINDS)
    if unknown := [k for k in kinds if k not in sch.KINDS]:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(sch.KINDS)})")
    if args.hosts < 2 or not 1 <= args.min_hosts <= args.hosts:
        parser.error("--hosts must be at least 2, --min-hosts between 1 and --hosts")
    try:
        given = sch.load(args.schedule) if args.schedule else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--schedule {args.schedule}: {e}")
    _check_paths(args, seeds, parser)
    duration = (args.hours * 3600) if args.hours else args.minutes * 60
    rows, worst = [], 0
    for seed in seeds:
        keep = args.keep / f"seed-{seed}" if args.keep and len(seeds) > 1 else args.keep
        opts = Options(seed=seed, duration_s=duration, hosts=args.hosts, min_hosts=args.min_hosts, every_s=args.every,
                       steps_per_s=args.steps_per_s, kinds=kinds, schedule=given, keep=keep,
                       reference=not args.no_reference, reference_steps=args.reference_steps, say=lambda line: print(line, flush=True))
        result = campaign(opts)
        out = args.out if args.out and len(seeds) == 1 else REPO / "bench" / "results" / f"chaos-{seed}.json"
        if result.get("stopped"):  # interrupted: what it found is kept beside, never over, a whole run's results
            print(f"\nseed {seed} {result['stopped']} at {result['stopped_at_s']} s: "
                  f"{sum(1 for e in result['struck'] if e['struck'])} faults struck, "
                  f"violations so far: {len(result['violations'])} {result['violations_per_invariant']}")
            print(f"results so far: {write_results(out.with_name(out.stem + '.interrupted.json'), result)}")
            return 130
        table(result)
        written = write_results(out, result)
        print(f"results: {written}")
        if args.minimise and result["violations"]:  # the results are written first: a minimiser runs for hours
            try:
                result["minimised"] = shrink(opts, result)
            except KeyboardInterrupt:
                print(f"minimiser interrupted; the campaign's results are in {written}")
                return 130
            print(f"results, with the smallest schedule: {write_results(out, result)}")
        rows.append(result)
        worst = max(worst, len(result["violations"]))
    if len(rows) > 1:
        summary(rows)
    return 1 if worst else 0


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (got {text})")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {text})")
    return value


def _check_paths(args, seeds: list[int], parser) -> None:
    """Refused before a campaign starts rather than after it ran for half an hour."""
    if args.out is not None and len(seeds) > 1:
        parser.error("--out names one results file: with --seeds each goes to bench/results/chaos-SEED.json")
    if args.schedule is not None and len(seeds) > 1:
        parser.error("--schedule runs one schedule: give it without --seeds")
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {args.out}: is a directory, give a file's path")
    if args.keep is not None and args.keep.exists() and not args.keep.is_dir():
        parser.error(f"--keep {args.keep}: exists and is not a directory")


def write_results(out: Path, result: dict) -> Path | str:
    """The results file; where it cannot be written (a full disk, a path gone meanwhile), a file in
    the temporary directory instead, so that a campaign's figures are never lost; where neither
    can be, the results printed on stderr, and that said in place of a path."""
    text = json.dumps(result, indent=1) + "\n"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        return out
    except OSError as e:
        print(f"could not write {out} ({e})", file=sys.stderr)
    try:
        fd, name = tempfile.mkstemp(prefix=f"chaos-{result['seed']}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        print(f"wrote {name} instead", file=sys.stderr)
        return Path(name)
    except OSError as e:  # nowhere to write: the results go to stdout, the last place left
        print(f"could not write a temporary file either ({e}); the results:\n{text}", file=sys.stderr)
        return "nowhere (printed on stderr above)"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _seeds(args, parser) -> list[int]:
    if args.seeds:
        try:
            low, _, high = args.seeds.partition("-")
            seeds = list(range(int(low), int(high or low) + 1))
        except ValueError:
            parser.error(f"--seeds {args.seeds!r}: give A-B, e.g. 1-10")
        if not seeds:
            parser.error(f"--seeds {args.seeds!r}: the range is empty (A must not exceed B)")
        return seeds
    return [args.replay if args.replay is not None else args.seed]


def campaign(opts: Options) -> dict:
    started = time.time()
    result = run(opts)
    return {"machine": describe(), "wall_s": round(time.time() - started, 1), **result}


# A try whose violation came while faults struck runs this long past the time it came originally.
AFTER_S = 120.0


def shrink(opts: Options, result: dict, run=run) -> dict:
    """The smallest schedule that still violates the run's first violated invariant. Where that
    violation came while faults struck, no later fault caused it: the tries leave those out, end at
    the target's first violation (stop_on) or soon after its original time, and skip the reference
    run; if such a cut schedule no longer fails, the tries are whole campaigns."""
    first = result["violations"][0]
    target = first["invariant"]
    faults = sch.from_json(result["schedule"])
    quiet = {"keep": None, "keep_violating": False, "say": lambda line: None, "reference": opts.reference and target == "loss_curve"}

    def trying(**changes) -> Callable[[list[sch.Fault]], bool]:
        def fails(schedule: list[sch.Fault]) -> bool:
            again = run(Options(**{**opts.__dict__, **quiet, **changes, "schedule": schedule}))
            if again.get("stopped") == "interrupted":  # Ctrl-C stops the minimiser, not just this try
                raise KeyboardInterrupt
            return target in again["violations_per_invariant"]
        return fails

    fails = trying()
    if first["t"] < result.get("faults_end_s", opts.duration_s):
        before = [f for f in faults if _strikes_at(f, opts.steps_per_s) <= first["t"]]
        cut = trying(duration_s=min(opts.duration_s, first["t"] + AFTER_S), stop_on=target)
        print(f"minimise: {target} came at {first['t']:.0f} s: trying the {len(before)} faults struck before it")
        if before and cut(before):
            faults, fails = before, cut
        else:
            print("minimise: those alone do not violate it; trying whole campaigns")
    smallest = minimise(faults, fails)
    print(f"minimised: {len(smallest)} of {len(faults)} faults still violate {target}:")
    for f in smallest:
        print(f"  {f.label()}")
    return {"invariant": target, "schedule": sch.to_json(smallest)}


def _strikes_at(fault: sch.Fault, steps_per_s: float) -> float:
    """When a fault strikes, in seconds from the start (a stepped one's at the expected pace)."""
    return fault.at if fault.at is not None else fault.step / steps_per_s


def table(r: dict) -> None:
    print(f"\nseed {r['seed']}: {r['hosts']} hosts, {r['duration_s'] / 60:.0f} min of faults, job finished at step "
          f"{r['final_steps']}: {r['finished']} (settled {r['settled_s']} s after the faults)")
    print(f"{'fault kind':<20} {'struck':>6} {'recovery median s':>18} {'max s':>7}")
    for kind in sorted(set(r["faults_per_kind"]) | set(r["recovery_s"])):
        rec = r["recovery_s"].get(kind, {})
        print(f"{kind:<20} {r['faults_per_kind'].get(kind, 0):>6} {rec.get('median', '-'):>18} {rec.get('max', '-'):>7}")
    for kind, n in r["stepped_fired"].items():
        print(f"{kind + ' (at a step)':<20} {n:>6}")
    print(f"faults struck {sum(r['faults_per_kind'].values())} of {len(r['schedule'])} drawn, "
          f"{len(r['faults_per_kind']) + len(r['stepped_fired'])} kinds; goodput per host {r['goodput']}; "
          f"steps redone per host {r['steps_redone']}; status answered in median {r['status_s']['median']} s, "
          f"max {r['status_s']['max']} s")
    if "longest_stall_s" in r:  # results before the stalled invariant lack it
        print(f"longest time with no new step while faults struck: {r['longest_stall_s']} s")
    if (loss := r.get("loss_curve")) is not None:
        print(f"loss curve vs the reference run: {loss['steps_compared']} steps, worst {loss['window']}-step window "
              f"{loss['max_rel_diff']:.3%} apart {loss['worst_window']}; final loss {loss['final_loss']} vs "
              f"{loss['reference_final_loss']}")
    print(f"invariants checked: {r['checked']}")
    print(f"violations: {len(r['violations'])} {r['violations_per_invariant']}")
    for v in r["violations"][:20]:
        print(f"  {v['t']:7.1f}s {v['invariant']:<16} host {v['host']}: {v['detail'][:160]}  [faults: "
              f"{'; '.join(v['faults'][-3:])}]")


def summary(rows: list[dict]) -> None:
    """A row per campaign, then each fault kind over all of them (recovery: the campaigns' medians' median)."""
    print(f"\n{'seed':>5} {'min':>4} {'hosts':>5} {'faults':>6} {'kinds':>5} {'violations':>10} {'finished':>8} "
          f"{'step':>7} {'loss diff':>9} {'goodput':>8} {'redone':>6} {'status max s':>12}")
    for r in rows:
        good = [g for g in r["goodput"] if g is not None]
        loss = r.get("loss_curve") or {}
        print(f"{r['seed']:>5} {r['duration_s'] / 60:>4.0f} {r['hosts']:>5} "
              f"{sum(r['faults_per_kind'].values()) + sum(r['stepped_fired'].values()):>6} "
              f"{len(set(r['faults_per_kind']) | set(r['stepped_fired'])):>5} {len(r['violations']):>10} "
              f"{str(r['finished']):>8} {r['final_steps']:>7} "
              f"{format(loss['max_rel_diff'], '.2%') if 'max_rel_diff' in loss else '-':>9} "
              f"{statistics.mean(good) if good else float('nan'):>8.3f} {sum(r['steps_redone'].values()):>6} "
              f"{r['status_s']['max']:>12}")
    kinds = sorted({k for r in rows for k in (*r["faults_per_kind"], *r["stepped_fired"])})
    print(f"\n{'fault kind':<20} {'struck':>6} {'campaigns':>9} {'recovery median s':>18} {'max s':>7}")
    for kind in kinds:
        recs = [r["recovery_s"][kind] for r in rows if kind in r["recovery_s"]]
        struck = sum(r["faults_per_kind"].get(kind, 0) + r["stepped_fired"].get(kind, 0) for r in rows)
        campaigns = sum(1 for r in rows if kind in r["faults_per_kind"] or kind in r["stepped_fired"])
        median = round(statistics.median(x["median"] for x in recs), 2) if recs else "-"
        print(f"{kind:<20} {struck:>6} {campaigns:>9} {median:>18} {max((x['max'] for x in recs), default='-'):>7}")
    print(f"{len(rows)} campaigns, {sum(r['duration_s'] for r in rows) / 3600:.1f} hours of faults, "
          f"{sum(len(r['violations']) for r in rows)} violations")


SUMMARY_KEYS = ("seed", "duration_s", "hosts", "faults_per_kind", "stepped_fired", "violations", "finished",
                "final_steps", "goodput", "steps_redone", "status_s", "recovery_s")


def summarise(files: list[Path], parser: argparse.ArgumentParser) -> int:
    rows = []
    for path in files:
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            parser.error(f"--summary {path}: {e}")
        if isinstance(row, dict) and row.get("stopped"):
            parser.error(f"--summary {path}: a campaign {row['stopped']} at {row.get('stopped_at_s')} s, not a whole one")
        if not isinstance(row, dict) or (missing := [k for k in SUMMARY_KEYS if k not in row]):
            parser.error(f"--summary {path}: not a campaign's results (no {', '.join(missing) if isinstance(row, dict) else 'object'})")
        rows.append(row)
    if not rows:
        parser.error("--summary: no results files (bench/results/chaos-*.json)")
    summary(rows)
    return 1 if any(r["violations"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

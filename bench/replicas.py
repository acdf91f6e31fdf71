"""Silent data corruption drill (health.replicas): 20 bits flipped on 3 (or 2) data-parallel replicas.

Three processes (--ranks 3; gloo, DDP, one CPU thread each, tests/replica_probe.py) train the tiny job at
seq 32 x 2 with the replicas compared every --interval steps and before every save (every
--save-every steps), spike detection off (a flipped weight may spike the loss, and a rollback
would heal the flip before the comparison sees it). debug.inject.bit_flips holds --flips flips,
each at its own step, on a seeded rank, parameter, element and bit 22 (the mantissa's highest:
the value changes by up to half, silently); every other one flips the parameter's gradient (after
the all-reduce, before the update) instead of the parameter. Each flip fires once per job
(engine.health.faults).

With three the odd replica is the one outside the majority; with two (--ranks 2) the one whose
own values depart first when the steps since the last agreed state are replayed in place, which
needs a state at or before that step: give it --first past the first save (--save-every).
After each detection they exit (79 for the odd one, 77 for the others) and the drill starts
them all again, as a gang's restart with the quarantined host replaced would: they resume from
the newest commit at or before the last step they agreed on. Until a run ends at --steps.

Then a reference run of the same job with nothing injected, keeping every commit. Each commit of
the drill is restored (every model and optimizer tensor) and compared bitwise with the
reference's commit of the same step: a commit holding a corrupted state would differ.

With --gang the replicas are hosts of a gang: a `tpud run` supervisor each (tests/test_multihost.py's
setting: its own home and tpud.yaml, the coordinator on loopback). The odd host's job fails there
(exit 79) and the others restart and wait for it; the drill starts its `tpud run` again (the host
replaced), and the gang resumes from the last step all agreed on. Each host writes its own part of
each commit: every host's part is compared with the reference's part of the same host and step,
and the hosts' parts of a commit with each other.

Targets: every flip detected within the interval (its mismatch at most --interval steps after
it); the flipped rank named in at least 19 of 20; no commit different from the reference; the
run reached --steps.

    .venv/bin/python bench/replicas.py           # ~3 min on 2 idle cores
    .venv/bin/python bench/replicas.py --gang --out bench/results/replicas-gang.json   # ~6 min
    .venv/bin/python bench/replicas.py --ranks 2 --first 12 --out bench/results/replicas-2.json
    .venv/bin/python bench/replicas.py --ranks 2 --first 12 --gang --out bench/results/replicas-gang-2.json
Results: a table on stdout and bench/results/replicas.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from engine.checkpoint import manifest as mf  # noqa: E402
from goodput import kill_group, spawn  # noqa: E402
from engine.models.llama import Transformer  # noqa: E402
from engine.spec.loader import load_spec  # noqa: E402
from machine import describe  # noqa: E402
from testkit import TINY_JOB  # noqa: E402
from testkit.helpers import data_parallel, free_port  # noqa: E402
from tpud.paths import Paths  # noqa: E402


def flips(count: int, ranks: int, first: int, spacing: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    with torch.device("meta"):
        names = [n for n, _ in Transformer(load_spec(TINY_JOB, []).model, lambda *a: None).named_parameters()]
    # A gradient flip on an embedding row that no token of the step used would flip a zero into
    # a denormal that the update rounds away: the gradient flips go to the dense tensors.
    dense = [n for n in names if "embed" not in n]
    return [{"step": first + i * spacing + rng.randrange(spacing // 2), "rank": rng.randrange(ranks),
             "tensor": rng.choice(dense if i % 2 else names), "element": rng.randrange(1 << 20), "bit": 22,
             "gradient": i % 2 == 1} for i in range(count)]


def marker(flip: dict) -> str:
    """The fault's marker file (engine.health.faults): it fired."""
    return f"{'gradflip' if flip['gradient'] else 'flip'}-{flip['step'] * 1000 + flip['rank']}"


def cycle(mismatch: dict, fired: list[dict], exits: list[int] | None = None) -> dict:
    """A detection: the mismatch, and the flip that fired after the agreed step and by the mismatch's."""
    flip = next((f for f in fired if mismatch["agreed_step"] < f["step"] <= mismatch["step"]), None)
    return {"exits": exits, "mismatch_step": mismatch["step"], "agreed_step": mismatch["agreed_step"],
            "odd": mismatch["odd"], "found_by": mismatch.get("found_by", ""), "healed": mismatch.get("healed", False),
            "flip": flip, "detected_after": None if flip is None else mismatch["step"] - flip["step"],
            "named_right": flip is not None and mismatch["odd"] == [flip["rank"]]}


def flow(items: list[dict]) -> str:
    return "[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in item.items()) + "}" for item in items) + "]"


def state_of(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor a committed checkpoint holds (model, optimizer), by its flattened name."""
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.items()
             if hasattr(m, "size") and k.split(".")[0] in ("model", "optimizer")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(step_dir)), no_dist=True)
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in any bit (or that one side lacks)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)))


GANG_JOB = ["train.log_interval=1", "scheduler.warmup_steps=1", "data.seq_len=32", "data.micro_batch_size=2",
            "data.corpus_bytes=400000"]


class GangHost:
    """One host: its home (tpud.yaml: its place in a gang of `count`, fault injection allowed) and
    its `tpud run`."""

    def __init__(self, root: Path, index: int, count: int, port: int, args: list[str]):
        self.index, self.home, self.args, self.runs = index, root / f"host{index}", args, 0
        self.home.mkdir(parents=True)
        (self.home / "tpud.yaml").write_text(f"gang: {{host_index: {index}, host_count: {count}, "
                                             f"coordinator: '127.0.0.1:{port}'}}\nallow_fault_injection: true\n")
        self.proc = None

    def start(self) -> None:
        self.runs += 1
        self.proc = spawn([sys.executable, "-m", "tpud", "run", str(TINY_JOB), *self.args, "--home", str(self.home)],
                          self.home / f"run{self.runs}.log", OMP_NUM_THREADS="1")

    def mismatch(self) -> dict:
        """The replica mismatch that quarantined its last run (the run's log also holds those of its
        workers that restarted when another host was quarantined)."""
        for line in reversed((self.home / f"run{self.runs}.log").read_text().splitlines()):
            if '"replica mismatch: this process' in line:
                return json.loads(line)
        raise SystemExit(f"host {self.index} exited without a replica mismatch: see {self.home}")

    def healed(self) -> list[dict]:
        """The replica mismatches its workers healed in place (none named, the replay agreed)."""
        return [json.loads(line) for run in range(1, self.runs + 1)
                for line in (self.home / f"run{run}.log").read_text().splitlines()
                if '"replica mismatch healed in place' in line]

    @property
    def checkpoints(self) -> Path:
        return self.home / "state" / "checkpoints" / "tiny-cpu"


def gang_run(root: Path, ranks: int, args: list[str], planned: list[dict] | None) -> tuple[list[dict], bool]:
    """A gang of `ranks` hosts to its end; the quarantined host restarted after each detection."""
    port = free_port()
    hosts = [GangHost(root, i, ranks, port, args) for i in range(ranks)]
    cycles, fired = [], set()
    try:
        for h in hosts:
            h.start()
        while True:
            codes = [h.proc.poll() for h in hosts]
            if all(code == 0 for code in codes):
                return cycles + [cycle(m, planned or []) for m in hosts[0].healed()], True
            odd = [h for h, code in zip(hosts, codes) if code == 79]
            if any(code not in (None, 0, 79) for code in codes) or len(cycles) > 2 * len(planned or []):
                return cycles, False
            for h in odd:
                mismatch = h.mismatch()
                markers = {f"{p.name}" for p in (h.home / "state" / "jobs" / "tiny-cpu" / "faults").glob("*flip-*")}
                new = markers - fired
                fired |= markers
                found = cycle(mismatch, [f for f in planned or [] if marker(f) in new])
                cycles.append({"host": h.index, **found,
                               "named_right": found["named_right"] and mismatch["odd"] == [h.index]})
                print(f"  detection {len(cycles)}: flip {found['flip']} -> mismatch after step {mismatch['step']}, "
                      f"host {h.index} quarantined ({found['found_by']}), back to {mismatch['agreed_step']}; "
                      f"starting it again", flush=True)
                h.start()
            time.sleep(0.2)
    finally:
        for h in hosts:
            if h.proc is not None:
                kill_group(h.proc.pid)
            shutil.rmtree(Paths.resolve(h.home).memory, ignore_errors=True)  # the daemon's, in /dev/shm


def compare_gang(drill: Path, reference: Path, ranks: int) -> tuple[list[int], dict]:
    """Every commit of every drill host against the reference's same host and step, and the hosts'
    parts of each commit against each other (model and optimizer tensors)."""
    differing, steps = {}, []
    for step, path, _ in mf.committed_steps(drill / "host0" / "state" / "checkpoints" / "tiny-cpu"):
        steps.append(step)
        parts = []
        for h in range(ranks):
            mine = {s: p for s, p, _ in mf.committed_steps(drill / f"host{h}" / "state" / "checkpoints" / "tiny-cpu")}
            theirs = {s: p for s, p, _ in mf.committed_steps(reference / f"host{h}" / "state" / "checkpoints" /
                                                                 "tiny-cpu")}
            if step not in mine or step not in theirs:
                differing.setdefault(step, []).append(f"host {h}: no commit of this step here or in the reference")
                continue
            parts.append(state_of(mine[step]))
            if diff := same(parts[-1], state_of(theirs[step])):
                differing.setdefault(step, []).append(f"host {h} differs from the reference: {diff[:3]}")
        for h, part in enumerate(parts[1:], 1):
            if diff := same(parts[0], part):
                differing.setdefault(step, []).append(f"host {h}'s part differs from host 0's: {diff[:3]}")
    return steps, differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flips", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--interval", type=int, default=5, help="health.replicas.interval_steps")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint.interval_steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=8, help="the earliest step a flip may come at")
    parser.add_argument("--gang", action="store_true", help="hosts of a gang under `tpud run`, not processes")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "replicas.json")
    args = parser.parse_args()
    load_before, began = os.getloadavg(), time.monotonic()
    planned = flips(args.flips, args.ranks, first=args.first, spacing=7, seed=args.seed)
    steps = planned[-1]["step"] + 2 * args.save_every
    common = [f"health.replicas.interval_steps={args.interval}", f"checkpoint.interval_steps={args.save_every}",
              "checkpoint.keep=1000", "health.spikes=null"]
    print(f"{len(planned)} flips over {steps} steps on {args.ranks} replicas: {planned}", flush=True)

    with tempfile.TemporaryDirectory(prefix="tpud-replicas-") as tmp:
        drill, reference = Path(tmp) / "drill", Path(tmp) / "reference"
        if args.gang:
            args_of = [*GANG_JOB, *common, f"train.max_steps={steps}"]
            cycles, finished = gang_run(drill, args.ranks, [*args_of, f"debug.inject.bit_flips={flow(planned)}"],
                                        planned)
            print(f"  drill {'reached' if finished else 'did NOT reach'} step {steps}; the reference run", flush=True)
            _, ok = gang_run(reference, args.ranks, args_of, None)
            if not ok:
                raise SystemExit("the reference gang run failed")
            commits, differing = compare_gang(drill, reference, args.ranks)
        else:
            cycles, fired = [], set()
            while len(cycles) <= 2 * args.flips:
                ranks = data_parallel(drill, args.ranks, *common, f"debug.inject.bit_flips={flow(planned)}", steps=steps)
                markers = {p.name for p in (drill / "jobs" / "tiny-cpu" / "faults").glob("*flip-*")}
                new, fired = markers - fired, markers
                exits = [r["exit"] for r in ranks]
                for mismatch in ranks[0]["mismatches"]:  # healed ones in place, then the one it exited on
                    cycles.append(cycle(mismatch, [f for f in planned if marker(f) in new], exits))
                    print(f"  run: flip {cycles[-1]['flip']} -> mismatch after step {mismatch['step']}, odd "
                          f"{mismatch['odd']} ({mismatch['found_by'] or 'none named'}), "
                          f"{'healed in place' if mismatch['healed'] else f'exits {exits}'}, back to "
                          f"{mismatch['agreed_step']}", flush=True)
                if all(code == 0 for code in exits):
                    print(f"  reached step {steps}", flush=True)
                    break
            finished = all(code == 0 for code in exits)
            data_parallel(reference, args.ranks, *common, steps=steps)
            commits = [step for step, _, _ in mf.committed_steps(drill / "checkpoints" / "tiny-cpu")]
            reference_dirs = {step: path for step, path, _ in mf.committed_steps(reference / "checkpoints" / "tiny-cpu")}
            differing = {}
            for step, path, _ in mf.committed_steps(drill / "checkpoints" / "tiny-cpu"):
                if step not in reference_dirs:
                    differing[step] = ["no reference commit at this step"]
                elif diff := same(state_of(path), state_of(reference_dirs[step])):
                    differing[step] = diff[:5]

    detected = [c for c in cycles if c["flip"] is not None and c["detected_after"] <= args.interval]
    named = sum(c["named_right"] for c in cycles)
    met = {"every_flip_detected_within_the_interval": len(detected) == args.flips,
           "right_replica_named_in_19_of_20": named >= args.flips - 1,
           "no_commit_holds_a_corrupted_state": not differing and len(commits) > 0,
           "training_reached_the_end": finished}
    print(f"\nflips {args.flips}, detections {len(cycles)}, within {args.interval} steps {len(detected)}, "
          f"right replica named {named}")
    print(f"commits compared with the reference: {len(commits)} ({commits}); differing: {differing or 'none'}")
    for key, ok in met.items():
        print(f"target {key}: {'pass' if ok else 'MISS'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "replicas", "passed": all(met.values()), "met": met,
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "steps": steps,
        "machine": describe(load_before=load_before), "wall_s": round(time.monotonic() - began, 1),
        "flips": planned, "cycles": cycles, "commits": commits, "differing_commits": differing,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

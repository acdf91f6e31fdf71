"""Silent data corruption drill (health.replicas): 20 bits flipped on 3 data-parallel replicas.

Three processes (gloo, DDP, one CPU thread each, tests/replica_probe.py) train the tiny job at
seq 32 x 2 with the replicas compared every --interval steps and before every save (every
--save-every steps), spike detection off (a flipped weight may spike the loss, and a rollback
would heal the flip before the comparison sees it). debug.inject.bit_flips holds --flips flips,
each at its own step, on a seeded rank, parameter, element and bit 22 (the mantissa's highest:
the value changes by up to half, silently); every other one flips the parameter's gradient (after
the all-reduce, before the update) instead of the parameter. Each flip fires once per job
(engine.health.faults).

After each detection the three exit (79 for the odd one, 77 for the others) and the drill starts
all three again, as a gang's restart with the quarantined host replaced would: they resume from
the newest commit at or before the last step they agreed on. Until a run ends at --steps.

Then a reference run of the same job with nothing injected, keeping every commit. Each commit of
the drill is restored (every model and optimizer tensor) and compared bitwise with the
reference's commit of the same step: a commit holding a corrupted state would differ.

Targets: every flip detected within the interval (its mismatch at most --interval steps after
it); the flipped rank named in at least 19 of 20; no commit different from the reference; the
run reached --steps.

    .venv/bin/python bench/replicas.py           # ~8 min on 2 idle cores
Results: a table on stdout and bench/results/replicas.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from engine.models.llama import Transformer  # noqa: E402
from engine.spec.loader import load_spec  # noqa: E402
from machine import describe  # noqa: E402
from tests.conftest import TINY_JOB  # noqa: E402
from tests.helpers import data_parallel  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flips", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--interval", type=int, default=5, help="health.replicas.interval_steps")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint.interval_steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "replicas.json")
    args = parser.parse_args()
    load_before, began = os.getloadavg(), time.monotonic()
    planned = flips(args.flips, args.ranks, first=8, spacing=7, seed=args.seed)
    steps = planned[-1]["step"] + 2 * args.save_every
    common = [f"health.replicas.interval_steps={args.interval}", f"checkpoint.interval_steps={args.save_every}",
              "checkpoint.keep=1000", "health.spikes=null"]
    print(f"{len(planned)} flips over {steps} steps on {args.ranks} replicas: {planned}", flush=True)

    with tempfile.TemporaryDirectory(prefix="tpud-replicas-") as tmp:
        drill, reference = Path(tmp) / "drill", Path(tmp) / "reference"
        cycles, fired = [], set()
        while len(cycles) <= 2 * args.flips:
            ranks = data_parallel(drill, args.ranks, *common, f"debug.inject.bit_flips={flow(planned)}", steps=steps)
            markers = {p.name for p in (drill / "jobs" / "tiny-cpu" / "faults").glob("*flip-*")}
            new, fired = markers - fired, markers
            exits = [r["exit"] for r in ranks]
            if all(code == 0 for code in exits):
                print(f"  run {len(cycles) + 1}: reached step {steps}", flush=True)
                break
            mismatch = ranks[0]["mismatches"][0]
            flip = next((f for f in planned if marker(f) in new), None)
            cycle = {"exits": exits, "mismatch_step": mismatch["step"], "agreed_step": mismatch["agreed_step"],
                     "odd": mismatch["odd"], "flip": flip,
                     "detected_after": None if flip is None else mismatch["step"] - flip["step"],
                     "named_right": flip is not None and mismatch["odd"] == [flip["rank"]]}
            cycles.append(cycle)
            print(f"  run {len(cycles)}: flip {flip} -> mismatch after step {mismatch['step']}, odd {mismatch['odd']}, "
                  f"exits {exits}, back to {mismatch['agreed_step']}", flush=True)
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

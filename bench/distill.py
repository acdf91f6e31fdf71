"""Distillation's loss, chunked against the naive one: peak memory and forward+backward time, CPU or CUDA.

naive: engine.losses.distill.distill_loss, which holds the student's and the teacher's (N x V)
logits at once, with their log-softmaxes and the student's gradient. chunked:
chunked_distill_loss with its default chunks (an eighth of the tokens), each chunk's backward done
in forward. Both compute the same loss (tests/test_distill.py: within 1e-5, value and gradients);
each (case, method, divergence) runs in a process of its own (bench/isolated.py). Targets (issue
45): chunked's peak memory <= 0.25x naive's, its time <= 1.3x, at V=32k and N=8k tokens.

    .venv/bin/python bench/distill.py            # about 3 minutes on 2 cores
Results: a table on stdout and bench/results/distill.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import isolated
from machine import describe

REPO = Path(__file__).resolve().parents[1]
CASES = {  # name: (tokens N, student width D, teacher width Dt, vocab V)
    "V=32k N=8k": (8192, 256, 512, 32768),
}
DIVERGENCES = ("forward_kl", "jsd")
TARGETS = {"memory_ratio": 0.25, "time_ratio": 1.3}


def measure(case: str, method: str, kind: str, repeats: int, device: str) -> dict:
    """One case, method and divergence, in this process: peak bytes above baseline and pass times."""
    import torch

    from engine.losses.distill import chunked_distill_loss, distill_loss

    torch.set_num_threads(os.cpu_count())
    n, d, dt, v = CASES[case]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(device).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.02).to(device).requires_grad_()
    teacher_hidden = torch.randn(n, dt, generator=g).to(device)
    teacher_weight = (torch.randn(v, dt, generator=g) * 0.02).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    loss_fn = chunked_distill_loss if method == "chunked" else distill_loss

    def step() -> None:
        loss_fn(hidden, weight, targets, teacher_hidden, teacher_weight, kind=kind, temperature=2.0).backward()

    def reset() -> None:
        hidden.grad = weight.grad = None

    return {"case": case, "method": method, "kind": kind,
            **isolated.peak_and_times(step, repeats, device == "cuda", reset)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "distill.json")
    parser.add_argument("--worker", nargs=3, metavar=("CASE", "METHOD", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(*args.worker, args.repeats, args.device)))
        return

    rows, met = [], True
    print(f"{'case':<12} {'divergence':<11} {'method':<8} {'peak MiB':>9} {'time s':>7}   {'mem ratio':>9} "
          f"{'time ratio':>10}  targets")
    for case in args.cases.split(","):
        for kind in DIVERGENCES:
            results = {m: isolated.run(__file__, [case, m, kind, "--repeats", str(args.repeats), "--device",
                                                  args.device]) for m in ("naive", "chunked")}
            rows.append({"case": case, "kind": kind, "shape": dict(zip(("N", "D", "Dt", "V"), CASES[case])), **results})
            naive, chunked = results["naive"], results["chunked"]
            if "error" in naive or "error" in chunked:
                print(f"{case:<12} {kind:<11} failed: {naive.get('error') or chunked.get('error')}")
                met = False
                continue
            chunked["memory_ratio"] = chunked["peak_bytes"] / naive["peak_bytes"]
            chunked["time_ratio"] = chunked["median_s"] / naive["median_s"]
            chunked["passed"] = all(chunked[key] <= bound for key, bound in TARGETS.items())
            met &= chunked["passed"]
            print(f"{case:<12} {kind:<11} {'naive':<8} {naive['peak_bytes'] / 2**20:>9.1f} {naive['median_s']:>7.3f}")
            print(f"{case:<12} {kind:<11} {'chunked':<8} {chunked['peak_bytes'] / 2**20:>9.1f} "
                  f"{chunked['median_s']:>7.3f}   {chunked['memory_ratio']:>9.4f} {chunked['time_ratio']:>10.3f}  "
                  f"memory <= {TARGETS['memory_ratio']}, time <= {TARGETS['time_ratio']}: "
                  f"{'pass' if chunked['passed'] else 'MISS'}")
    print("targets: " + ("all met" if met else "MISSED"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "distill", "targets": TARGETS, "device": args.device,
                                    "machine": describe(), "cases": rows}, indent=2))


if __name__ == "__main__":
    main()

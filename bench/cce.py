"""The losses against the naive one: peak memory and forward+backward time, CPU or CUDA.

naive: F.cross_entropy(hidden @ weight.T, targets), which holds the (N x V) logits and their
gradient. The engine's losses (engine.losses), each with its defaults:
  ce       the full-logits loss (torch.compile'd with --compile, as device.compile does);
  chunked  the token-chunked loss, each chunk's backward done in forward (what auto picks
           when the logits outgrow loss.logits_budget_mib);
  cce      cut cross-entropy, vocabulary tiles (only by name: the least memory).

Each (case, method) runs in a fresh process so its peak memory is its own (bench/isolated.py:
above the memory held once the inputs exist and a warm-up pass is done; with --device cuda the
caching allocator's). Targets (issue 28): ce time <= 1.15x naive; chunked memory <= 0.25x
naive; cce memory <= 1/20 of naive.

    .venv/bin/python bench/cce.py            # about 5 minutes on 2 cores
    python bench/cce.py --device cuda --compile --cases "bf16 V=128k N=16k D=2048" --out /tmp/cce-cuda.json
Results: a table on stdout and bench/results/cce.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import isolated
from machine import describe

REPO = Path(__file__).resolve().parents[1]
CASES = {  # name: (tokens N, hidden D, vocab V, dtype)
    "fp32 V=64k": (4096, 512, 65536, "float32"),
    "bf16 V=64k": (4096, 512, 65536, "bfloat16"),
    "fp32 V=128k": (4096, 512, 131072, "float32"),
    "bf16 V=128k N=16k D=2048": (16384, 2048, 131072, "bfloat16"),  # a Llama 3 1B batch: GPU-sized
}
CPU_CASES = ("fp32 V=64k", "bf16 V=64k", "fp32 V=128k")
METHODS = ("ce", "chunked", "cce")
TARGETS = {"ce": ("time_ratio", 1.15), "chunked": ("memory_ratio", 0.25), "cce": ("memory_ratio", 1 / 20)}


def measure(case: str, method: str, repeats: int, device: str, compile: bool) -> dict:
    """One case and method, in this process: peak bytes above baseline and pass times."""
    import torch
    import torch.nn.functional as F

    from engine.losses import build_loss
    from engine.spec.schema import LossConfig, ModelConfig

    torch.set_num_threads(os.cpu_count())
    n, d, v, dtype = CASES[case]
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.02).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    if method != "naive":
        heads = next(h for h in (32, 16, 8, 4, 2, 1) if d % h == 0)
        loss_fn = build_loss(LossConfig(name=method), ModelConfig(vocab_size=v, dim=d, n_heads=heads), n,
                             torch.compile if compile and method == "ce" else (lambda fn: fn))

    def step() -> None:
        if method == "naive":
            loss = F.cross_entropy((hidden @ weight.T).float(), targets)
        else:
            loss = loss_fn(hidden, weight, targets)
        loss.backward()

    def reset() -> None:
        hidden.grad = weight.grad = None

    return {"case": case, "method": method, **isolated.peak_and_times(step, repeats, device == "cuda", reset)}


def run_isolated(case: str, method: str, repeats: int, device: str, compile: bool) -> dict:
    result = isolated.run(__file__, [case, method, "--repeats", str(repeats), "--device", device,
                                     *(["--compile"] if compile else [])])
    return {"case": case, "method": method, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CPU_CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the ce loss (device.compile)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cce.json")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(*args.worker, args.repeats, args.device, args.compile)))
        return

    rows, met = [], True
    print(f"{'case':<26} {'method':<8} {'peak MiB':>9} {'time s':>7}   {'mem ratio':>9} {'time ratio':>10}  target")
    for case in args.cases.split(","):
        results = {m: run_isolated(case, m, args.repeats, args.device, args.compile) for m in ("naive", *METHODS)}
        row = {"case": case, "shape": dict(zip(("N", "D", "V", "dtype"), CASES[case])), **results}
        naive = results["naive"]
        rows.append(row)
        for method, r in results.items():
            if "error" in r or "error" in naive:
                print(f"{case:<26} {method:<8} failed: {r.get('error') or naive.get('error')}")
                met = False
                continue
            if method != "naive":
                r["memory_ratio"] = r["peak_bytes"] / naive["peak_bytes"]
                r["time_ratio"] = r["median_s"] / naive["median_s"]
                key, bound = TARGETS[method]
                r["passed"] = r[key] <= bound
                met &= r["passed"]
            tail = "" if method == "naive" else (
                f"   {r['memory_ratio']:>9.4f} {r['time_ratio']:>10.3f}  {TARGETS[method][0].split('_')[0]} <= "
                f"{TARGETS[method][1]:.3g}: {'pass' if r['passed'] else 'MISS'}")
            print(f"{case:<26} {method:<8} {r['peak_bytes'] / 2**20:>9.1f} {r['median_s']:>7.3f}{tail}")
    print("targets: " + ("all met" if met else "MISSED") + f" (ce {'compiled' if args.compile else 'eager'})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        import torch  # noqa: F401  (only now, after the cases' own processes: describe() names the GPU)
    args.out.write_text(json.dumps({
        "benchmark": "cce", "targets": {m: {k: v} for m, (k, v) in TARGETS.items()}, "compile": args.compile,
        "device": args.device, "machine": describe(), "cases": rows}, indent=2))


if __name__ == "__main__":
    main()

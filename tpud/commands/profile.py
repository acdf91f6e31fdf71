"""`tpud profile JOB.yaml`: where a job's step time goes, on this host's device.

This side parses the command line and prints; engine/profiling.py runs the steps, and is
imported only when the command runs, so `tpud --help` stays free of torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = (
    "Train a job for --warmup steps, then profile --steps steps (torch.profiler; on cuda the kernels' "
    "device time), in a scratch state directory: the job's checkpoints and state are not touched, and "
    "nothing is saved. Writes OUT/trace.json (Chrome trace format: open it in https://ui.perfetto.dev or "
    "chrome://tracing) and OUT/report.json, and with a TensorBoard directory (--tensorboard, or the job's "
    "logging.tensorboard) the trace into the job's run there too (NAME.pt.trace.json.gz: TensorBoard's PyTorch "
    "Profiler plugin lists it), and prints the share of the step in data, forward, loss, "
    "backward, optimizer and host gaps, the top operations by time, and advice where a known waste shows "
    "(host syncs per step, a slow loss, a stalled loader, compilation off). Exit 0 ok, 1 failed (the trace not written to TensorBoard too), 78 invalid job.")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of steps, at least 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB.yaml", help="the job file to profile")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help="dotted overrides, value parsed as YAML (e.g. data.micro_batch_size=8)")
    parser.add_argument("--steps", type=positive, default=5, metavar="N", help="steps profiled (default 5)")
    parser.add_argument("--warmup", type=positive, default=3, metavar="N",
                        help="steps run first, not profiled: compilation and caches warm up (default 3)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where trace.json and report.json go "
                        "(default: ./tpud-profile-<job>)")
    parser.add_argument("--tensorboard", metavar="DIR", help="a TensorBoard directory, local or gs://, whose "
                        "<job>/ run receives the trace too (default: the job's logging.tensorboard; none: off)")


def _tensorboard(given: str | None, job: str | None) -> str | None:
    if given is None:
        return job
    return None if given == "none" else given


def run(args: argparse.Namespace) -> int:
    from engine import exit_codes, logs
    from engine.errors import ConfigError
    from engine.spec.loader import SpecError, load_spec

    try:
        spec = load_spec(args.job, args.overrides)
    except SpecError as e:
        print(e, file=sys.stderr)
        return exit_codes.BAD_INPUT
    logs.configure("warning")
    from engine import profiling

    out = args.out or Path(f"tpud-profile-{spec.name}")
    print(f"profiling {spec.name}: {args.warmup} warm-up steps, then {args.steps} profiled ...", file=sys.stderr)
    try:
        report = profiling.run(spec, steps=args.steps, warmup=args.warmup, out=out,
                               tensorboard=_tensorboard(args.tensorboard, spec.logging.tensorboard))
    except ConfigError as e:
        print(f"{args.job}: {e}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    except (RuntimeError, OSError) as e:
        print(f"tpud profile: {e}", file=sys.stderr)
        return 1
    print(report.table())
    if report.tensorboard_error:
        print(f"tpud profile: {report.tensorboard_error}", file=sys.stderr)
        return 1
    return 0

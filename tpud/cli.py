"""The `tpud` command line.

Each subcommand is one `_add_<name>(subparsers)` function that builds its parser and sets
`func`, the handler that returns the exit code; list it in COMMANDS. This module must not
import torch (the daemon and its clients never do).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from engine.specfile import SpecError, dump_schema, load_spec
from tpud import __version__

# Client exit codes (DESIGN.md, "Command line").
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2  # argparse exits with 2 on its own
EXIT_JOB_UNKNOWN = 3
EXIT_DAEMON_UNREACHABLE = 4

EPILOG = """\
exit codes:
  0  ok
  1  failed (e.g. an invalid job file)
  2  usage error
  3  job unknown or not running
  4  daemon unreachable
"""

Subparsers = argparse._SubParsersAction  # what add_subparsers() returns


def _validate(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            spec = load_spec(path, args.overrides)
        except SpecError as e:
            print(e, file=sys.stderr)
            status = EXIT_FAILED
        else:
            print(f"{path}: ok (job {spec.name})")
    return status


def _add_validate(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check job files",
        description="Check job files (includes and overrides applied) without running them. "
        "Each problem is printed to stderr as FILE:LINE: KEY: MESSAGE.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="job file (YAML)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a dotted key, value parsed as YAML (e.g. train.max_steps=50); repeatable",
    )
    parser.set_defaults(func=_validate)


def _schema(args: argparse.Namespace) -> int:
    print(dump_schema())
    return EXIT_OK


def _add_schema(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "schema",
        help="print the job file JSON Schema",
        description="Print the JSON Schema of job files, for editors (e.g. yaml-language-server).",
    )
    parser.set_defaults(func=_schema)


def _run(args: argparse.Namespace) -> int:
    from engine import exit_codes, logs
    from tpud.paths import Paths
    from tpud.supervisor import run_foreground

    logs.configure()
    try:
        spec = load_spec(args.job, args.overrides)
    except SpecError as e:
        print(e, file=sys.stderr)
        return exit_codes.BAD_INPUT
    return run_foreground(spec, Paths.resolve(args.home))


def _add_run(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run one job in the foreground",
        description="Validate a job file, run its training worker as a child process under the supervisor, "
        "stream its log, and exit with the worker's exit code (0 done, 75 stopped on request, "
        "76 non-finite loss, 78 invalid job, other: crash). Ctrl-C or SIGTERM asks the worker to stop "
        "at its next step boundary; a second one kills it.",
    )
    parser.add_argument("job", metavar="JOB.yaml", help="job file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, value parsed as YAML (e.g. train.max_steps=50)")
    _add_home(parser)
    parser.set_defaults(func=_run)


def _add_home(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", metavar="DIR", default=None,
                        help="keep jobs.d/, state/ and run/ under DIR (default: $TPUD_HOME, else the systemd "
                        "directories, else /etc/tpud, /var/lib/tpud, /run/tpud as root or the XDG paths)")


COMMANDS: Sequence[Callable[[Subparsers], None]] = (_add_run, _add_validate, _add_schema)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpud",
        description="Fault-tolerant training daemon for PyTorch on Cloud TPU, CUDA and CPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)

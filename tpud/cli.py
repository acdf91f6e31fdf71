"""The `tpud` command line: its parser, and dispatch to the commands' code (tpud/commands/).

Each subcommand is one `_add_<name>(subparsers)` function that builds its parser and sets
`func`, the handler that returns the exit code; list it in COMMANDS. This module must not
import torch (the daemon and its clients never do).

Building the parser imports nothing heavy, and each handler imports its module when it runs:
the control-socket commands (status, checkpoint-now, stop, start) must start in a small part
of the 0.5 s that the job-spec loader (pydantic, YAML) and structlog take to import
(tests/test_control.py keeps them out).
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable, Sequence

from tpud import __version__
from tpud.commands import EXIT_OK
from tpud.commands import control

EPILOG = """\
exit codes:
  0  ok
  1  failed (e.g. an invalid job file)
  2  usage error
  3  job unknown or not running
  4  daemon unreachable
"""

Subparsers = argparse._SubParsersAction  # what add_subparsers() returns


def _handler(target: str) -> Callable[[argparse.Namespace], int]:
    """MODULE:FUNCTION under tpud.commands, imported when its command runs: building the parser
    imports no command's code."""
    module, name = target.split(":")

    def handle(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"tpud.commands.{module}"), name)(args)

    return handle


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
    _add_home(parser)  # accepted like every command's, unused: validation needs no daemon
    parser.set_defaults(func=_handler("validate:validate"))


def _add_prepare(subparsers: Subparsers) -> None:
    from engine.prepare import command as prepare

    parser = subparsers.add_parser("prepare", help="tokenize texts into a dataset jobs train on",
                                   description=prepare.DESCRIPTION)
    prepare.add_arguments(parser)
    _add_home(parser)  # accepted like every command's, unused: preparing needs no daemon
    parser.set_defaults(func=prepare.run)


def _add_export(subparsers: Subparsers) -> None:
    from tpud.commands import export

    parser = subparsers.add_parser("export", help="write a checkpoint as a Hugging Face model",
                                   description=export.DESCRIPTION)
    export.add_arguments(parser)
    _add_home(parser)
    parser.set_defaults(func=export.run)


def _add_profile(subparsers: Subparsers) -> None:
    from tpud.commands import profile

    parser = subparsers.add_parser("profile", help="where a job's step time goes", description=profile.DESCRIPTION)
    profile.add_arguments(parser)
    _add_home(parser)  # accepted like every command's, unused: profiling runs no daemon
    parser.set_defaults(func=profile.run, overrides_anywhere=parser)


def _schema(args: argparse.Namespace) -> int:
    from engine.spec.loader import dump_schema

    print(dump_schema())
    return EXIT_OK


def _add_schema(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "schema",
        help="print the job file JSON Schema",
        description="Print the JSON Schema of job files, for editors (e.g. yaml-language-server).",
    )
    _add_home(parser)
    parser.set_defaults(func=_schema)


def _add_run(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run one job in the foreground",
        description="Validate a job file and run it in the foreground under the same supervisor as the daemon "
        "(crash restarts with backoff, GCS tier, metrics). On a terminal: a live view (progress, losses, "
        "throughput, checkpoints per tier, goodput) with warnings and errors above it, and a summary at the end; "
        "otherwise the worker's log as JSON lines. Exit with the worker's "
        "last exit code when the job ends (0 done, 75 stopped, 76 a bad step it could not heal, 78 invalid job, 79 "
        "quarantined, other: "
        "crashed beyond its restart budget). Ctrl-C or SIGTERM checkpoints and stops; a second one kills.",
    )
    parser.add_argument("job", metavar="JOB.yaml", help="job file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help="dotted overrides, value parsed as YAML (e.g. train.max_steps=50); anywhere after "
                        "the job file, options included")
    parser.add_argument("--metrics-addr", metavar="HOST:PORT", default="127.0.0.1:0",
                        help="Prometheus listener (default: a free port on 127.0.0.1, written to "
                        "<runtime>/metrics.addr)")
    _add_home(parser)
    parser.set_defaults(func=_handler("run:run"), overrides_anywhere=parser)


HOME_HELP = ("keep jobs.d/, state/ and run/ under DIR (default: $TPUD_HOME, else the systemd directories, else "
             "/etc/tpud, /var/lib/tpud, /run/tpud as root or the XDG paths); before or after the command name")


def _add_home(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand that is not given --home keeps the one given before its name.
    parser.add_argument("--home", metavar="DIR", default=argparse.SUPPRESS, help=HOME_HELP)


def _add_checkpoints(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "checkpoints",
        help="list committed checkpoints per tier",
        description="List a job's committed checkpoint steps per tier (memory: the daemon's shared-memory "
        "states of the job on this host, while it has them; local: <checkpoint.dir or "
        "<state>/checkpoints>/<job>; gcs: checkpoint.remote, when set) with micro-step, size and age. "
        "For a job on several hosts, HOSTS is the hosts that held their part of the step at their last "
        "exchange (each global commit and gang start; on GCS, the host whose part it is), and a part "
        "whose global commit never completed is listed as not globally committed. "
        "Exit 0 ok, 1 when the job file is invalid or the remote tier cannot be read.",
    )
    parser.add_argument("job", metavar="JOB.yaml", help="job file")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    parser.add_argument("--timeout", type=float, default=20.0, metavar="S",
                        help="give up on an unreachable GCS tier after S seconds of retries (default 20)")
    _add_home(parser)
    parser.set_defaults(func=_handler("checkpoints:run"))


def _add_status(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the daemon's jobs",
        description="Show jobs (all, or the named ones): state, step, loss, tokens/s, MFU, last checkpoint "
        "(step@tier age), restarts, goodput (productive share of the job's time), age; errors and warnings (e.g. "
        "checkpoints failing on a full disk) below the table (-o json adds the badput seconds by kind and a "
        "crash's traceback lines), and for a job on several hosts this host's place and the gang's state. Exit 3 "
        "when a named "
        "job is unknown, 4 when the daemon cannot be reached.",
    )
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job name (default: all)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    every = control.WATCH_DEFAULT_S
    parser.add_argument("-w", "--watch", nargs="?", const=str(every), default=None, metavar="SECONDS",
                        help=f"redraw the table in place every SECONDS (default {every:g}) until Ctrl-C")
    parser.add_argument("--gang", action="store_true",
                        help="for each job on several hosts, a row per host: state, step, newest commit per tier, "
                        "restarts, health, and the hosts missing (each host's row shared through the job's "
                        "checkpoint.remote prefix)")
    _add_home(parser)
    parser.set_defaults(func=_handler("control:status"))


def _add_checkpoint_now(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "checkpoint-now",
        help="checkpoint running jobs now",
        description="Ask running jobs (all, or the named ones) to checkpoint at their next step boundary and, "
        "unless --no-wait, wait for the local commit and print step, tier, path and duration per job. "
        "Exit 1 when a checkpoint failed, 3 when a job is unknown or not running, 4 when the daemon "
        "cannot be reached.",
    )
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job name (default: all running jobs)")
    parser.add_argument("--no-wait", action="store_true", help="return once the request is delivered")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="give up waiting for the commit after S seconds (default 600)")
    _add_home(parser)
    parser.set_defaults(func=_handler("control:checkpoint_now"))


def _add_stop(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "stop",
        help="checkpoint and stop a job",
        description="Checkpoint a job and stop it; it stays stopped (also across daemon restarts) until "
        "`tpud start`. Prints the job's new state. Exit 3 when the job is unknown or not running.",
    )
    parser.add_argument("job", metavar="JOB", help="job name")
    _add_home(parser)
    parser.set_defaults(func=_handler("control:stop_or_start"))


def _add_start(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "start",
        help="start a stopped job",
        description="Start a stopped job again (resuming from its newest checkpoint). Prints the job's new "
        "state. Exit 3 when the job is unknown.",
    )
    parser.add_argument("job", metavar="JOB", help="job name")
    _add_home(parser)
    parser.set_defaults(func=_handler("control:stop_or_start"))


def _add_daemon(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "daemon",
        help="run the service (systemd runs this)",
        description="The long-running service: watches jobs.d/ for job files, runs and supervises a worker per "
        "job (restarts, checkpoints, GCS uploads), answers tpud status/checkpoint-now/stop/start on "
        "<runtime>/control.sock and serves Prometheus metrics. SIGTERM checkpoints every job and exits 0; "
        "SIGHUP reloads tpud.yaml and rescans jobs.d/.",
    )
    parser.add_argument("--metrics-addr", metavar="HOST:PORT", default=None,
                        help="Prometheus listener (default: tpud.yaml's metrics_addr, else 127.0.0.1:9477; "
                        "port 0 picks a free port, written to <runtime>/metrics.addr)")
    _add_home(parser)
    parser.set_defaults(func=_handler("daemon:daemon"))


def _add_parser(subparsers: Subparsers, name: str, help: str, description: str,
                add_arguments: Callable[[argparse.ArgumentParser], None], func, overrides_anywhere: bool = False) -> None:
    """A command whose arguments its own module adds; --home accepted like every command's.
    overrides_anywhere: key=value arguments may follow options too (parse_args)."""
    parser = subparsers.add_parser(name, help=help, description=description)
    add_arguments(parser)
    _add_home(parser)
    parser.set_defaults(func=func, **({"overrides_anywhere": parser} if overrides_anywhere else {}))


def _add_submit_and_cancel(subparsers: Subparsers) -> None:
    from tpud.commands import remote

    _add_parser(subparsers, "submit", "put a job file in remote_jobs: every host runs it", remote.SUBMIT,
                remote.add_submit_arguments, _handler("remote:submit"), overrides_anywhere=True)
    _add_parser(subparsers, "cancel", "remove a job file from remote_jobs: every host stops it", remote.CANCEL,
                remote.add_cancel_arguments, _handler("remote:cancel"))


def _add_install_service(subparsers: Subparsers) -> None:
    from tpud.commands import install_service

    _add_parser(subparsers, "install-service", "install, configure and enable the systemd service",
                install_service.DESCRIPTION, install_service.add_arguments, _handler("install_service:run"))


COMMANDS: Sequence[Callable[[Subparsers], None]] = (
    _add_daemon, _add_run, _add_validate, _add_prepare, _add_schema, _add_checkpoints, _add_export, _add_profile,
    _add_status, _add_checkpoint_now, _add_stop, _add_start, _add_submit_and_cancel, _add_install_service,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpud",
        description="Fault-tolerant training daemon for PyTorch on Cloud TPU, CUDA and CPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--home", metavar="DIR", default=None, help=HOME_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """argparse, plus overrides (`key=value`) after options: `tpud run JOB --home D a=1`.

    argparse ends a `nargs="*"` positional at the first option and cannot resume it after;
    what is left over is kept as overrides when every piece of it looks like one.
    """
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    command_parser = getattr(args, "overrides_anywhere", None)
    if command_parser is not None and "--" in extras:  # `--` ends options (before it: argparse took it)
        extras.remove("--")
    if extras:
        if command_parser is None or any(extra.startswith("-") or "=" not in extra for extra in extras):
            (command_parser or parser).error(f"unrecognized arguments: {' '.join(extras)}")
        args.overrides = [*args.overrides, *extras]
    return _job_first(args)


def _job_first(args: argparse.Namespace) -> argparse.Namespace:
    """`tpud run a=1 JOB.yaml`: overrides before the job file are still overrides (argparse took the
    first for the job); the job is the first argument that is no key=value or names a file."""
    job, overrides = getattr(args, "job", None), getattr(args, "overrides", None)
    if job is None or overrides is None or "=" not in job or os.path.exists(job):
        return args
    pieces = [job, *overrides]
    found = next((p for p in pieces if "=" not in p or os.path.exists(p)), None)
    if found is not None:
        args.job = found
        args.overrides = [p for p in pieces if p is not found]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return args.func(args)

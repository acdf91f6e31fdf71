"""The control-socket clients: `tpud status` (and --watch), `tpud checkpoint-now`, `tpud stop`, `tpud start`.

They must start in a small part of the 0.5 s the job-spec loader and structlog take to import
(tests/test_control.py keeps those out): only the view's formatting and the socket's client here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tpud.commands import EXIT_DAEMON_UNREACHABLE, EXIT_FAILED, EXIT_JOB_UNKNOWN, EXIT_OK
from tpud.view import status as status_view

WATCH_DEFAULT_S = 2.0


def _control(args: argparse.Namespace, command: str, **request: object) -> tuple[int, dict | None]:
    """Send one control request; (exit code, result), with errors printed to stderr. The client waits
    10 s for a reply, plus the request's own timeout (checkpoint-now)."""
    from tpud.control import ControlClient, ControlError, DaemonUnreachable
    from tpud.paths import Paths

    path = Paths.resolve(args.home).runtime / "control.sock"
    name = command.replace("_", "-")
    try:
        return EXIT_OK, ControlClient(path).call(command, **request)
    except DaemonUnreachable as e:
        where = (f"from --home {args.home}" if args.home else f"from TPUD_HOME={os.environ['TPUD_HOME']}"
                 if os.environ.get("TPUD_HOME") else "the default path; no --home or TPUD_HOME given")
        print(f"tpud {name}: {e}\n  ({where}) the daemon may not be running; if it runs with another home, "
              "pass the same --home DIR or set TPUD_HOME", file=sys.stderr)
        return EXIT_DAEMON_UNREACHABLE, None
    except ControlError as e:
        print(f"tpud {name}: {e.message} ({e.code})", file=sys.stderr)
        return (EXIT_JOB_UNKNOWN if e.code in ("unknown_job", "not_running") else EXIT_FAILED), None


def status(args: argparse.Namespace) -> int:
    import json

    interval, jobs = watch_interval(args)
    if interval is not None:
        return watch(args, jobs, interval)
    if args.gang:
        code, result = _control(args, "status", jobs=jobs, gang=True)
        if result is not None:
            print(json.dumps(result, indent=2) if args.output == "json"
                  else "\n".join(status_view.gang_table(result.get("gangs", []))))
        return code
    code, result = _control(args, "status", jobs=jobs)
    if result is None:
        return code
    if args.output == "json":
        print(json.dumps(result, indent=2))
        return EXIT_OK
    print("\n".join(status_view.lines(result.get("jobs", [])) + status_view.remote_line(result.get("remote_jobs"),
                                                                                      time.time())))
    return EXIT_OK


def watch_interval(args: argparse.Namespace) -> tuple[float | None, list[str]]:
    """--watch's seconds, and the job names: `--watch JOB` means the default interval and a job."""
    jobs, watch = list(args.jobs), args.watch
    if watch is None:
        return None, jobs
    try:
        seconds = float(watch)
    except ValueError:
        return WATCH_DEFAULT_S, [watch, *jobs]
    if not 0.1 <= seconds <= 86400:
        raise SystemExit(f"tpud status: --watch takes seconds between 0.1 and 86400, not {watch}")
    return seconds, jobs


def watch(args: argparse.Namespace, jobs: list[str], interval: float) -> int:
    """The table (or -o json) redrawn in place every `interval` seconds until Ctrl-C; a daemon
    that stops answering is shown, and watched for, not fatal. Piped, each one is printed after
    the last, as vmstat does."""
    import io
    import json
    from contextlib import redirect_stderr, nullcontext
    from datetime import datetime

    from rich.live import Live
    from rich.text import Text

    def screen() -> str:
        errors = io.StringIO()
        with redirect_stderr(errors):
            _, result = _control(args, "status", jobs=jobs)
        if result is None:
            body = errors.getvalue().rstrip().splitlines()
        elif args.output == "json":
            body = json.dumps(result, indent=2).splitlines()
        else:
            body = status_view.lines(result.get("jobs", [])) + status_view.remote_line(result.get("remote_jobs"),
                                                                                       time.time())
        head = f"every {interval:g}s: tpud status {' '.join(jobs)}".rstrip()
        return "\n".join([f"{head}   {datetime.now():%H:%M:%S}", "", *body])

    live = Live(auto_refresh=False, transient=False) if sys.stdout.isatty() else None
    try:
        with live or nullcontext():
            while True:
                if live is not None:
                    live.update(Text(screen()), refresh=True)
                else:
                    print(screen() + "\n", flush=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # `tpud status --watch | head`: done; nothing more to flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK



def checkpoint_now(args: argparse.Namespace) -> int:
    code, result = _control(args, "checkpoint_now", jobs=args.jobs, wait=not args.no_wait, timeout=args.timeout)
    if result is None:
        return code
    status = EXIT_OK
    for r in result.get("results", []):
        job = r.get("job", "?")
        if not r.get("ok"):
            print(f"{job}: checkpoint failed: {r.get('error') or 'unknown error'}")
            status = EXIT_FAILED
        elif r.get("step") is None:
            print(f"{job}: checkpoint requested" + (" (not waiting)" if args.no_wait else ""))
        else:
            micro = f" micro-step {r['micro_step']}" if r.get("micro_step") else ""
            took = f" in {r['seconds']:.1f}s" if isinstance(r.get("seconds"), (int, float)) else ""
            print(f"{job}: step {r['step']}{micro} committed to {r.get('tier') or '-'} {r.get('path') or '-'}{took}")
    return status


def stop_or_start(args: argparse.Namespace) -> int:
    code, result = _control(args, args.command, job=args.job)
    if result is None:
        return code
    print(f"{result.get('job', args.job)}: {result.get('state', '?')}")
    return EXIT_OK

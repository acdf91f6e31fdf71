"""`tpud install-service`: from a bare VM to an enabled daemon (tpud/service/install.py does the work)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tpud.commands import EXIT_FAILED, EXIT_OK

DESCRIPTION = (
    "Write the systemd unit (ExecStart: this installation's tpud), tpud.yaml (from the flags, or with "
    "--from-metadata from this VM's metadata attributes tpud-remote-jobs, tpud-gang-port, tpud-metrics-addr, "
    "tpud-remote-jobs-poll-seconds, the flags winning), jobs.d/ and the state directory /var/lib/tpud (0750), and "
    "enable the unit (systemctl; --now starts it too). An existing tpud.yaml that differs is kept unless "
    "--overwrite. --root DIR writes under DIR instead (an image, a test) and makes the enabling link by hand. "
    "Exit 0 installed, 1 refused (invalid settings, an unreadable metadata server, systemctl failing).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root", type=Path, default=Path("/"), metavar="DIR",
                        help="write under DIR, not / (no systemctl call)")
    parser.add_argument("--from-metadata", action="store_true",
                        help="read the settings from this VM's metadata attributes (GCE_METADATA_HOST, else "
                        "metadata.google.internal)")
    parser.add_argument("--remote-jobs", metavar="gs://BUCKET/PREFIX/", help="tpud.yaml's remote_jobs")
    parser.add_argument("--gang-port", type=int, metavar="PORT", help="tpud.yaml's gang_port")
    parser.add_argument("--metrics-addr", metavar="HOST:PORT", help="tpud.yaml's metrics_addr")
    parser.add_argument("--exec", dest="executable", metavar="PATH",
                        help="the tpud command the unit starts (default: this installation's)")
    parser.add_argument("--overwrite", action="store_true", help="replace a tpud.yaml that differs")
    parser.add_argument("--now", action="store_true", help="start the daemon too (the real root only)")


def run(args: argparse.Namespace) -> int:
    from tpud.metadata import resolve_host
    from tpud.service.install import InstallError, enable, executable, install, settings

    flags = {"remote_jobs": args.remote_jobs, "gang_port": args.gang_port, "metrics_addr": args.metrics_addr}
    try:
        chosen = settings(flags, resolve_host(None) if args.from_metadata else None)
        done = install(args.root, chosen, args.executable or executable(), overwrite=args.overwrite)
        if args.root.resolve() == Path("/"):
            enable(start=args.now)
            done.append("systemctl: enabled" + (" and started" if args.now else ""))
    except (InstallError, OSError) as e:
        print(f"tpud install-service: {e}", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(done))
    return EXIT_OK

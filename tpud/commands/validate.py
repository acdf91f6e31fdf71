"""`tpud validate FILE ...`: job files checked (includes and overrides applied) without running them;
a file named tpud.yaml is checked as the daemon's settings."""

from __future__ import annotations

import argparse
import sys

from pathlib import Path

from tpud.commands import EXIT_FAILED, EXIT_OK


def validate(args: argparse.Namespace) -> int:
    from engine.data.manifest import local_problems
    from engine.spec.loader import SpecError, load_job

    status = EXIT_OK
    for path in args.files:
        if Path(path).name == "tpud.yaml":
            status = max(status, _settings(Path(path)))
            continue
        try:
            loaded = load_job(path, args.overrides)
            data, distill = loaded.spec.data, loaded.spec.distill
            offline = (distill.temperature, data.document_mask) if distill and distill.offline else None
            problems = [loaded.problem(key, message) for key, message in
                        local_problems(data.datasets, bool(data.mixture), loaded.spec.model.vocab_size,
                                       loaded.spec.model.init_from, data.seq_len, offline)]
            if problems:
                raise SpecError(problems)
        except SpecError as e:
            print(e, file=sys.stderr)
            status = EXIT_FAILED
        else:
            print(f"{path}: ok (job {loaded.spec.name})")
    return status


def _settings(path: Path) -> int:
    from tpud.settings import load_settings

    if not path.is_file():
        print(f"{path}: not a file", file=sys.stderr)
        return EXIT_FAILED
    _, error = load_settings(path.parent)
    if error:
        print(error, file=sys.stderr)
        return EXIT_FAILED
    print(f"{path}: ok (daemon settings)")
    return EXIT_OK

"""`tpud validate FILE ...`: job files checked (includes and overrides applied) without running them."""

from __future__ import annotations

import argparse
import sys

from tpud.commands import EXIT_FAILED, EXIT_OK


def validate(args: argparse.Namespace) -> int:
    from engine.data.manifest import local_problems
    from engine.spec.loader import SpecError, load_job

    status = EXIT_OK
    for path in args.files:
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

"""`tpud checkpoints JOB.yaml`: every committed step of a job in each tier (memory, local, GCS),
newest first, as a table or JSON, with the job's skip ledger. Reads files and the bucket only:
no daemon needed, and nothing is changed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tpud.commands import EXIT_FAILED as FAILED
from tpud.commands import EXIT_OK as OK
from tpud.view import format as fmt


def run(args: argparse.Namespace) -> int:
    from engine.spec.loader import SpecError, load_spec
    from tpud.paths import Paths

    try:
        spec = load_spec(args.job)
    except SpecError as e:
        print(e, file=sys.stderr)
        return FAILED
    paths = Paths.resolve(args.home)
    job_dir = paths.layout.checkpoints(spec.name, spec.checkpoint.dir)
    memory_dir = paths.memory / spec.name
    tiers = local_tiers(memory_dir, job_dir, time.time())
    errors: dict[str, str] = {}
    if spec.checkpoint.remote:
        tiers["gcs"] = remote_tier(spec, args.timeout, errors)
    from engine.health.ledger import summary_of

    ledger = summary_of(paths.layout.skips_file(spec.name))
    if args.output == "json":
        print(json.dumps({"job": spec.name, "tiers": tiers, "skip_ledger": ledger,
                          **({"errors": errors} if errors else {})}, indent=2))
    else:
        print(f"job {spec.name}: " + (f"memory {memory_dir}, " if "memory" in tiers else "") + f"local {job_dir}"
              + (f", gcs {spec.checkpoint.remote}" if spec.checkpoint.remote else ""))
        print_table(tiers, errors)
        if ledger:
            print(f"skip ledger: {ledger['samples']} samples skipped in {ledger['ranges']} ranges "
                  f"({paths.layout.skips_file(spec.name)}; data.skip takes its samples ranges)")
    return FAILED if errors else OK


def local_tiers(memory_dir: Path, job_dir: Path, now: float) -> dict[str, list[dict]]:
    """The memory tier's steps (when it exists) and the local disk's, oldest first."""
    from engine.checkpoint.hosts import holders
    from engine.checkpoint.manifest import is_global, parts, problems

    tiers: dict[str, list[dict]] = {"memory": []} if memory_dir.is_dir() else {}
    tiers["local"] = []
    held = holders(job_dir)
    for tier_name, directory_of_tier in (("memory", memory_dir), ("local", job_dir)):
        for step, directory, manifest in parts(directory_of_tier) if tier_name in tiers else ():
            issues = problems(directory, manifest, checksums=False)
            # A memory state is its host's own: it restores only when every host holds the step.
            committed = tier_name == "memory" or is_global(directory, manifest)
            tiers[tier_name].append(_row(step, manifest, now, not issues, issues, str(directory),
                                         held if tier_name == "local" else {}, committed))
    return tiers


def remote_tier(spec, timeout: float, errors: dict[str, str]) -> list[dict]:
    """The GCS tier's committed steps; a bucket that cannot be read is named in `errors`."""
    import logging

    import structlog  # only the GCS tier logs: 0.2 s of imports a local listing need not wait for

    from tpud.gcs.tier import GcsTier, RemoteError, RetryPolicy

    # Only errors are logged, to stderr: stdout is the table or the JSON; retries are quiet.
    structlog.configure(processors=[structlog.processors.add_log_level,
                                    structlog.dev.ConsoleRenderer(colors=False)],
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    tier = GcsTier(spec.checkpoint.remote, spec.name,
                   retry=RetryPolicy(initial=0.2, maximum=2.0, deadline=timeout, request_timeout=max(1.0, timeout)))
    steps, now = [], time.time()
    try:
        for remote in tier.committed_steps():
            steps.append(_row(remote.step, remote.manifest, now, remote.complete, list(remote.problems), remote.url,
                              {}, True))
    except RemoteError as e:
        errors["gcs"] = str(e) if tier.url in str(e) else f"{tier.url}: {e}"
        print(f"tpud checkpoints: cannot read the GCS tier: {errors['gcs']}", file=sys.stderr)
    return steps


def _row(step: int, m, now: float, ok: bool, issues: list[str], location: str, held: dict,
         committed: bool) -> dict:
    return dict(step=step, micro_step=m.micro_step, bytes=m.total_bytes, files=len(m.files), reason=m.reason,
                created_unix=m.created_unix, age_seconds=round(now - m.created_unix, 1), ok=ok, problems=issues,
                location=location, data_skips=[list(r) for r in m.data_skips], **_hosts_of(m, held, committed))


def _hosts_of(manifest, held: dict, is_global: bool) -> dict:
    """A step's place in a job on several hosts: its part's host, whether it is globally
    committed, and which hosts held their part at the hosts' last exchange (None: not known)."""
    return dict(host=manifest.host, hosts=manifest.hosts, held_by=held.get((manifest.step, manifest.micro_step))
                if manifest.hosts > 1 else None, **{"global": is_global})


def print_table(tiers: dict[str, list[dict]], errors: dict[str, str]) -> None:
    rows = [("TIER", "STEP", "MICRO", "SIZE", "FILES", "AGE", "REASON", "HOSTS", "SKIPPED", "STATUS")]
    for tier_name, steps in tiers.items():
        for s in reversed(steps):  # newest first
            status = "ok" if s["global"] else "not globally committed: a host's part was never durable"
            if not s["ok"]:
                status = f"damaged: {s['problems'][0]}" + (
                    f" (+{len(s['problems']) - 1} more)" if len(s["problems"]) > 1 else "")
            skipped = sum(count for _, count in s["data_skips"])  # micro-batches a rollback left out
            rows.append((tier_name, str(s["step"]), str(s["micro_step"]), fmt.size(s["bytes"]), str(s["files"]),
                         fmt.age(s["age_seconds"]), s["reason"], _holders_column(s),
                         str(skipped) if skipped else "-", status))
        if not steps:
            rows.append((tier_name, "-", "-", "-", "-", "-", "-", "-", "-", "no committed steps"
                         if tier_name not in errors else "error (see stderr)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def _holders_column(s: dict) -> str:
    if s["hosts"] <= 1:
        return "-"
    if s["held_by"] is None:
        return f"{s['host']} of {s['hosts']}"
    return f"{','.join(map(str, s['held_by']))} of {s['hosts']}"

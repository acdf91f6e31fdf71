"""`tpud status`'s table: a row per job, then each job's errors, warnings and gang, as lines."""

from __future__ import annotations

import time

from tpud.view.format import age, percent, rate, size

HEADER = ("JOB", "STATE", "STEP/MAX", "LOSS", "TOK/S", "MFU", "LAST-CKPT", "RESTARTS", "GOODPUT", "USEFUL", "AGE")


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def row(job: dict) -> tuple[str, ...]:
    step, max_steps = job.get("step"), job.get("max_steps")
    ckpt, in_memory = job.get("last_checkpoint"), job.get("memory_checkpoint")
    last = f"{ckpt.get('step')}@{ckpt.get('tier')} {age(ckpt.get('age_seconds'))}" if ckpt else "-"
    if in_memory:
        last += f" ({in_memory.get('step')}@memory)"
    loss = job.get("loss")
    return (
        str(job.get("name", "?")),
        _dash(job.get("state")),
        "-" if step is None and max_steps is None else f"{_dash(step)}/{_dash(max_steps)}",
        "-" if loss is None else f"{loss:.4g}",
        rate(job.get("tokens_per_second")),
        percent(job.get("mfu")),
        last,
        _dash(job.get("restarts")),
        percent((job.get("goodput") or {}).get("ratio")),
        percent(useful_mfu(job)),
        age(job.get("age_seconds")),
    )


def useful_mfu(job: dict) -> float | None:
    """Goodput x MFU: the share of the devices' peak that went into training kept."""
    ratio, mfu = (job.get("goodput") or {}).get("ratio"), job.get("mfu")
    return None if ratio is None or mfu is None else ratio * mfu


def policy_line(intervals: dict) -> str:
    """The auto checkpoint tiers' intervals, costs and the disruption rate they assume, in a line."""
    tiers = []
    for tier, i in sorted(intervals.items()):
        span = "" if i.get("seconds") is None else f" ({i['seconds']:.3g}s)"
        what, cost = "an upload" if tier == "gcs" else "a save", i.get("save_seconds")
        cost = "" if cost is None else f", {what} " + (f"{cost * 1e3:.3g}ms" if cost < 1 else f"{cost:.3g}s")
        loss = "" if i.get("expected_loss_seconds") is None else f", ~{i['expected_loss_seconds']:.3g}s lost per disruption"
        every = f"every {i['seconds']:.3g}s" if i.get("steps") is None else f"every {i.get('steps')} steps{span}"
        tiers.append(f"{tier} {every}{cost}{loss}")
    rate = next(iter(intervals.values())).get("disruptions_per_hour")
    return "auto checkpoints: " + "; ".join(tiers) + ("" if rate is None else f"; assuming {rate:.3g} disruptions/h")


def device_line(d: dict) -> str:
    """The worker's device memory and compilations (tpud.job.report.device), in a line."""
    def bytes_(n: int | None) -> str:
        return "-" if n is None else size(n)

    parts = []
    if d.get("memory_in_use_bytes") is not None or d.get("memory_peak_bytes") is not None:
        parts.append(f"memory {bytes_(d.get('memory_in_use_bytes'))} in use (peak {bytes_(d.get('memory_peak_bytes'))})")
    if d.get("compilations") is not None:
        seconds = d.get("compile_seconds")
        parts.append(f"{d['compilations']} graphs compiled" + ("" if seconds is None else f" in {seconds:.3g}s"))
    return "device: " + ", ".join(parts)


def healing_line(h: dict) -> str:
    """Rollbacks healed in place and the skip ledger (tpud.job.report.WorkerReport.healing), in a line."""
    parts = []
    if h.get("rollbacks"):
        hardware = f" ({h['hardware']} not reproduced: hardware suspected)" if h.get("hardware") else ""
        parts.append(f"{h['rollbacks']} rollbacks{hardware}, {h.get('redone_steps', 0)} steps redone")
    if skipped := h.get("skipped"):
        parts.append(f"{skipped['samples']} samples skipped in {skipped['ranges']} ranges (data_skips.json)")
    if last := h.get("last"):
        parts.append(f"last at step {last['step']}: {last['reason']}")
    return "healing: " + "; ".join(parts)


def lines(jobs: list[dict]) -> list[str]:
    rows = [HEADER, *(row(job) for job in jobs)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if not jobs:
        out.append("(no jobs)")
    for job in jobs:
        name = job.get("name", "?")
        if job.get("error"):
            out += ["", f"{name}: error:", *(f"  {line}" for line in str(job["error"]).splitlines())]
        for line in job.get("warnings") or []:
            out += ["", f"{name}: warning: {line}"]
        if intervals := job.get("checkpoint_intervals"):
            out += ["", f"{name}: {policy_line(intervals)}"]
        if experts := job.get("experts"):
            dropped = experts.get("dropped_fraction")
            out += ["", f"{name}: experts: busiest {percent(experts.get('load_max'))} of its layer's tokens, "
                    f"spread (cv) {experts.get('load_cv') or 0:.3g}, aux loss {experts.get('aux_loss') or 0:.4g}, "
                    f"z loss {experts.get('z_loss') or 0:.4g}"
                    + ("" if not dropped else f", {percent(dropped)} dropped")]
        if device := job.get("device"):
            out += ["", f"{name}: {device_line(device)}"]
        if fitted := job.get("micro_batch"):
            out += ["", f"{name}: micro-batch {fitted['size']} (data.micro_batch_size {fitted['configured']}): "
                    f"{fitted['reason']}"]
        if healing := job.get("healing"):
            out += ["", f"{name}: {healing_line(healing)}"]
        if replicas := job.get("replicas"):
            here = "; this host is quarantined" if replicas.get("quarantined") else ""
            back = "" if replicas.get("healed") else f"; back to step {replicas['agreed_step']}"
            out += ["", f"{name}: replicas: {replicas['reason']}{back}{here}"]
        for straggler in job.get("stragglers") or []:
            if straggler.get("flagged") or straggler.get("evicted"):
                out += ["", f"{name}: straggler: {straggler['reason']}"]
        if gang := job.get("gang"):
            out += ["", gang_line(name, gang)]
    return out


def gang_line(name: str, gang: dict, now: float | None = None) -> str:
    """A job's gang in a line: its state, members, who is missing and since when, the coordinator,
    and how its membership changed."""
    now = time.time() if now is None else now
    parts = [f"{name}: host {gang.get('host')} of {gang.get('hosts')}: {gang.get('state')}"]
    if gang.get("generation") is not None:
        parts.append(f"generation {gang['generation']}")
    if gang.get("members"):
        parts.append(f"members {', '.join(map(str, gang['members']))}")
    for missing in gang.get("missing") or []:
        parts.append(f"host {missing['host']} missing for {age(now - missing['since_unix'])}")
    if gang.get("coordinator"):
        parts.append(f"coordinator {gang['coordinator']}")
    if gang.get("shrinks") or gang.get("grows"):
        parts.append(f"{gang.get('shrinks', 0)} shrinks, {gang.get('grows', 0)} grows ({gang.get('path')} path)")
    parts.append(f"{gang.get('peer_restarts', 0)} restarts caused by other hosts")
    return ", ".join(parts)



def remote_line(remote: dict | None, now: float) -> list[str]:
    """remote_jobs' state under the table: where it is read from, and how the last listing went."""
    if not remote:
        return []
    if remote.get("error"):
        return [f"remote jobs: {remote['url']}: cannot list ({remote['error']}); the jobs from there go on as they are"]
    listed = remote.get("last_listed")
    when = "not listed yet" if listed is None else f"listed {max(0.0, now - listed):.0f}s ago"
    return [f"remote jobs: {remote['url']}: {len(remote.get('generations') or {})} job files, {when}"]


def gang_table(gangs: list[dict]) -> list[str]:
    """`tpud status --gang`: per job on several hosts, a line about the gang and a row per host."""
    if not gangs:
        return ["no job here spans several hosts"]
    out = []
    for g in gangs:
        missing = f", missing: {', '.join(map(str, g['missing']))}" if g["missing"] else ""
        shared = g["shared"] or "no checkpoint.remote: the other hosts' rows are not shared"
        out.append(f"{g['name']}: {g['hosts']} hosts, generation {_dash(g['generation'])}, members "
                   f"{_dash(', '.join(map(str, g['members'] or [])) or None)}{missing} ({shared}"
                   + (f"; cannot reach it: {g['board_error']}" if g.get("board_error") else "") + ")")
        header = ("HOST", "STATE", "STEP/MAX", "MEMORY", "LOCAL", "GCS", "RESTARTS", "HEALTH", "SEEN")
        rows = [header]
        for r in g["rows"]:
            commits = r.get("commits") or {}
            state = f"missing ({r['missing']})" if r.get("missing") else _dash(r.get("state"))
            rows.append((f"{r['host']}{'*' if r['here'] else ''}", state,
                         f"{_dash(r.get('step'))}/{_dash(r.get('max_steps'))}",
                         *(_dash(commits.get(tier)) for tier in ("memory", "local", "gcs")),
                         _dash(r.get("restarts")), _dash(r.get("health")),
                         "now" if r["here"] else (f"{r['age_seconds']:.0f}s ago" if r.get("age_seconds") is not None
                                                  else "-")))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        out += ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        out.append("")
    return out[:-1]

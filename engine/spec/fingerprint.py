"""A job spec's fingerprint: what the hosts of a gang must agree on, and what a checkpoint records.

The fingerprint is the resolved spec as dotted keys and their JSON values, less the settings
that are each host's own (HOST_ONLY). A key's value is compared whole unless the key is a
section that every spec has: `optimizer.lr` and `optimizer.betas` are keys, and so is `eval`
(present or not) and `model.rope_scaling`.

- The gang's hosts compare their fingerprints as the gang forms (tpud.worker.gang.member): any
  difference refuses the job on every host, naming the keys and each host's value.
- Every checkpoint's manifest records the fingerprint it was made with. A job on several hosts
  resumes one only when what differs is a change a checkpoint is made to survive (RESUMABLE) or
  one the job allows (checkpoint.allow_spec_changes). The host count is no part of a spec: a job
  resumes on another number of hosts as before (train.global_batch_size keeps its batch).

A key that only one side has came with another tpud version (a rolling upgrade): it is not
compared. Torch-free and pure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from engine.errors import ConfigError

_HANG_BOUNDS = "this host's supervisor's bounds for judging its own worker hung"
# Keys (and sections) that may differ between hosts: none of them changes what is trained.
HOST_ONLY: dict[str, str] = {
    "checkpoint.dir": "this host's disk",
    "device.compile_cache": "this host's compilation cache: the same program either way",
    "device.peak_flops": "this host's MFU figure",
    "logging": "what this host logs; wandb is logged by host 0's supervisor alone",
    "restart": "this host's supervisor's crash budget and warm starts; a peer's restart spends none of it",
    **dict.fromkeys([f"health.{key}" for key in (
        "heartbeat_timeout_seconds", "hang_step_multiple", "startup_timeout_seconds", "startup_steps",
        "checkpoint_timeout_seconds", "kill_grace_seconds")], _HANG_BOUNDS),
    "debug": "fault-injection drills, aimed at one host",
}
# Keys (and sections) a job on several hosts may change and still resume its checkpoint.
RESUMABLE: dict[str, str] = {
    "train.max_steps": "training longer or shorter is what a reload is for",
    "train.log_interval": "how often values are read and reported",
    "device.deterministic": "the order kernels sum in, not what is trained",
    "checkpoint": "how and where states are saved, not what they hold",
    "eval": "evaluation reads the model and never changes it",
    "health": "what the supervisor does about a non-finite loss",
    "data.skip": "samples left out, as a rollback leaves them out",
    **dict.fromkeys(("data.dataset", "data.mixture", "data.allow_change"),
                    "other data: judged by its identity on resume, under data.allow_change"),
    "model.init_from": "a resume takes the checkpoint's weights instead",
    "model.activation_checkpointing": "the same activations, kept or computed again",
    "attention": "the same attention, computed by another kernel or in other blocks",
}
SHOWN_KEYS = 8      # differing keys a message names; the count of the rest follows
SHOWN_CHARS = 60    # of one value in a message


def fingerprint(spec: BaseModel) -> dict[str, Any]:
    """The spec's dotted keys (as job files spell them) and JSON values, host-only keys left out."""
    values: dict[str, Any] = {}
    _flatten(spec, "", values)
    return values


def _flatten(section: BaseModel, prefix: str, into: dict[str, Any]) -> None:
    for name, field in type(section).model_fields.items():
        key = f"{prefix}{field.alias or name}"
        if _under(key, HOST_ONLY):
            continue
        value = getattr(section, name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            _flatten(value, key + ".", into)
        else:
            into[key] = to_jsonable_python(value, by_alias=True)


def canonical(values: Mapping[str, Any]) -> str:
    """One text for equal fingerprints, whatever their key order: what hosts exchange."""
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def digest(values: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical(values).encode()).hexdigest()[:16]


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Difference:
    key: str
    values: tuple[Any, ...]  # one per party, in the parties' order


def differences(parties: Sequence[Mapping[str, Any]], ignore: Iterable[str] = ()) -> list[Difference]:
    """The keys every party has, outside `ignore` (keys or sections), whose values differ."""
    ignore = tuple(ignore)
    shared = set.intersection(*(set(p) for p in parties)) if parties else set()
    return [Difference(key, tuple(p[key] for p in parties)) for key in sorted(shared)
            if not _under(key, ignore) and len({canonical({"": p[key]}) for p in parties}) > 1]


def describe(found: Sequence[Difference], label: Callable[[list[int]], str]) -> str:
    """`optimizer.lr: 0.001 (host 0), 0.01 (host 1)`: per key, each value and the parties that
    hold it (`label` names a list of party indices)."""
    parts = []
    for d in found[:SHOWN_KEYS]:
        holders: dict[str, list[int]] = {}
        for i, value in enumerate(d.values):
            holders.setdefault(_shown(value), []).append(i)
        parts.append(f"{d.key}: " + ", ".join(f"{value} ({label(ix)})" for value, ix in holders.items()))
    if len(found) > SHOWN_KEYS:
        parts.append(f"and {len(found) - SHOWN_KEYS} more keys")
    return "; ".join(parts)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def hosts(indices: list[int]) -> str:
    """`host 1`, `hosts 0, 2-5`: host indices for a message, runs collapsed."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"host {text}" if len(indices) == 1 else f"hosts {text}"


def keys(found: Sequence[Difference]) -> str:
    return ", ".join(d.key for d in found)


HOSTS_DIFFER = "the hosts of the gang run different job specs"  # the daemon waits on it for shared files


def check_hosts(by_host: Mapping[int, Mapping[str, Any]]) -> None:
    """Raise ConfigError naming every key on which the hosts' fingerprints differ (by host index)."""
    indices = list(by_host)
    if found := differences(list(by_host.values())):
        where = describe(found, lambda ix: hosts([indices[i] for i in ix]))
        raise ConfigError(keys(found), f"{HOSTS_DIFFER}: {where}; "
                          "give every host the same job file")


def check_resume(saved: Mapping[str, Any] | None, now: Mapping[str, Any], allowed: Iterable[str], step: int) -> None:
    """Raise ConfigError when a checkpoint of step `step`, made with fingerprint `saved`, may not
    resume the spec whose fingerprint is `now` (a manifest older than fingerprints: it may)."""
    if saved is None:
        return
    if found := differences([saved, now], ignore=(*RESUMABLE, *allowed)):
        names = ("the checkpoint", "now")
        raise ConfigError(keys(found), f"the checkpoint at step {step} was made with another job spec: "
                          f"{describe(found, lambda ix: ' and '.join(names[i] for i in ix))}; set them back, or "
                          "list them in checkpoint.allow_spec_changes to resume with the new values")

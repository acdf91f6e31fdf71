"""Which parts of a job each worker event goes to (engine/events.py).

An event goes to every part that owns something it reports, in the order listed. A part is
named by the Job attribute that holds it ("job" is the Job itself: the state changes an event
may cause) and has a method `on_<the event's TYPE>` taking the event. A new kind of event is a
row here and a handler on each owner; the Job changes only if the event can change its state.
tests/test_jobs.py checks that every kind a worker sends has a row, and every handler a row.
"""

from __future__ import annotations

from engine import events

ROUTES: dict[type[events.Event], tuple[str, ...]] = {
    events.Hello: ("tracker", "report", "watch"),
    events.Heartbeat: ("report", "watch", "job"),
    events.Started: ("watch", "ledger", "tracker", "job"),
    events.Step: ("watch", "checkpoints", "report", "ledger", "tracker", "restarts", "job"),
    events.Eval: ("report", "tracker"),
    events.CheckpointStarted: ("watch",),
    events.CheckpointCommitted: ("restarts", "checkpoints", "watch", "tiers", "job"),
    events.CheckpointFailed: ("checkpoints", "watch", "job"),
    events.CheckpointRestored: ("report",),
    events.NonFinite: ("report",),
    events.RolledBack: ("report", "ledger", "tracker"),
    events.ReplicaMismatch: ("report",),
    events.Straggler: ("report",),
    events.Gang: ("gang", "tracker"),
}


def handler_name(kind: type[events.Event]) -> str:
    return f"on_{kind.TYPE}"


def route(job: object, event: events.Event) -> None:
    """Hand `event` to each of `job`'s parts that owns it; an event no row names is ignored.
    The parts are looked up at each event: a reload of the job file replaces some (the GCS tier)."""
    name = handler_name(type(event))
    for owner in ROUTES.get(type(event), ()):
        getattr(job if owner == "job" else getattr(job, owner), name)(event)

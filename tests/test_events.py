"""The worker's events and the daemon's requests on a real channel socket: every type arrives as
itself, and what this version does not know never reaches the daemon's handlers."""

import json
import math
import select
import socket
import threading

import pytest

from engine import events
from engine.requests import Action
from tpud.worker import channel

EVERY_MESSAGE = [
    events.Hello(pid=42, rank=3),
    events.Heartbeat(step=7, micro_step=2),
    events.Started(step=4, micro_step=1, badput=events.Badput(startup=2.5, restore=0.5)),
    events.Step(step=5, loss=float("nan"), grad_norm=1.5, lr=3e-4, tokens_per_s=1234.5, step_time_s=0.25,
                mfu=0.41, rss_bytes=1 << 30, device_memory_bytes=None, badput=events.Badput(data=0.1)),
    events.CheckpointStarted(step=8, micro_step=0, reason="interval", blocking_s=0.01),
    events.CheckpointCommitted(step=8, micro_step=0, reason="interval", path="/c/step_8", bytes=99, seconds=1.5),
    events.CheckpointFailed(step=9, micro_step=3, reason="request", error="No space left on device (ENOSPC)",
                            failures=2, path="/c"),
    events.CheckpointRestored(step=8, micro_step=0, path="/c/step_8", seconds=0.7),
    events.NonFinite(step=6, loss=float("inf"), grad_norm=None, policy="rollback", skip=(4, 2)),
    events.CheckpointRequest(Action.CHECKPOINT_AND_EXIT, deadline_s=12.5),
]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    worker, daemon = channel.Connection(a), channel.Connection(b)
    yield worker, daemon
    worker.close()
    daemon.close()


def same(a, b) -> bool:  # NaN is not equal to itself
    return json.dumps(a.to_json(), sort_keys=True) == json.dumps(b.to_json(), sort_keys=True)


def test_every_message_arrives_as_its_own_type(pair):
    worker, daemon = pair
    for message in EVERY_MESSAGE:
        assert worker.send(message)
    received = daemon.receive()
    assert [type(m) for m in received] == [type(m) for m in EVERY_MESSAGE]
    assert all(same(a, b) for a, b in zip(received, EVERY_MESSAGE))
    assert math.isnan(received[3].loss) and received[8].skip == (4, 2)


def test_unknown_malformed_and_newer_messages(pair):
    worker, daemon = pair
    lines = [b"not json", b"[1, 2]", b'{"type": "finished", "step": 3}', b'{"type": "step", "step": "seven"}',
             b'{"type": ["heartbeat"], "step": 1}', b'{"type": {"a": 1}}', b"[" * 100_000 + b"]" * 100_000,
             b'{"type": "heartbeat"}',  # a required field missing
             b'{"type": "heartbeat", "step": 5, "micro_step": 1, "added_in_v2": true}']
    data = b"\n".join(lines) + b"\n"
    sender = threading.Thread(target=worker.sock.sendall, args=(data,), daemon=True)
    worker.sock.setblocking(True)
    sender.start()
    received = []
    while not received:  # the bracket line takes several reads
        select.select([daemon], [], [], 5)
        received += daemon.receive()
    assert received == [events.Heartbeat(step=5, micro_step=1)]


def test_a_line_split_across_reads_arrives_whole(pair):
    worker, daemon = pair
    line = json.dumps(events.Heartbeat(step=1).to_json()).encode() + b"\n"
    worker.sock.sendall(line[:5])
    assert daemon.receive() == []
    worker.sock.sendall(line[5:])
    assert daemon.receive() == [events.Heartbeat(step=1)]


def test_an_endless_line_or_a_closed_peer_ends_the_connection():
    raw, theirs = socket.socketpair()
    daemon = channel.Connection(theirs)
    sender = threading.Thread(target=raw.sendall, args=(b"x" * (channel.MAX_LINE + 70000),), daemon=True)
    sender.start()
    for _ in range(1000):
        select.select([daemon], [], [], 5)
        if (got := daemon.receive()) != []:
            break
    assert got is None
    raw.close()
    a, b = socket.socketpair()
    a.close()
    assert channel.Connection(b).receive() is None


def test_the_lists_other_modules_use_come_from_the_types():
    assert events.BADPUT_KINDS == ("startup", "restore", "checkpoint", "data", "eval", "rollback")
    assert "loss" in events.STEP_SCALARS and "badput" not in events.STEP_SCALARS and "step" not in events.STEP_SCALARS

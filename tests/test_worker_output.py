"""A worker's output as the job sees it (tpud/job/output.py): relayed whole, its tail kept for
crash reports however the bytes arrive."""

from __future__ import annotations

from tpud.job.output import LINE_CHARS, TAIL_LINES, WorkerOutput


def test_lines_split_across_chunks_are_kept_whole_and_everything_is_relayed():
    relayed: list[bytes] = []
    out = WorkerOutput(relayed.append)
    for chunk in (b'{"event": "st', b'ep"}\nTraceback (most', b" recent call last):\nValueError: bad\nno newline"):
        out.feed(chunk)
    # Whole lines only (processes of one job share the relay), the rest once the output closes.
    assert relayed == [b'{"event": "step"}\n', b"Traceback (most recent call last):\nValueError: bad\n"]
    assert list(out.tail) == ['{"event": "step"}', "Traceback (most recent call last):", "ValueError: bad"]
    out.ended()  # the last line counts once the output closes, ended as a line: the next is not spliced on
    assert relayed[-1] == b"no newline\n"
    assert out.tail[-1] == "no newline" and out.last_error() == "ValueError: bad"


def test_two_processes_sharing_the_relay_never_splice_their_lines():
    relayed: list[bytes] = []
    first, second = WorkerOutput(relayed.append), WorkerOutput(relayed.append)
    first.feed(b'{"step": 1, "lo')
    second.feed(b'{"step": 1, "loss": 2.0}\n{"st')
    first.feed(b'ss": 2.0}\n')
    second.feed(b'ep": 2}\n')
    assert b"".join(relayed).splitlines() == [b'{"step": 1, "loss": 2.0}'] * 2 + [b'{"step": 2}']


def test_the_tail_is_bounded_by_lines_and_line_length_and_starts_afresh_per_worker():
    out = WorkerOutput(lambda chunk: None)
    out.feed(b"x" * (LINE_CHARS + 10) + b"END\n" + b"\xff\xfe invalid utf-8\n" * (TAIL_LINES + 5))
    assert len(out.tail) == TAIL_LINES and out.tail[0].endswith("invalid utf-8")
    out.feed(b"a line without end " * 10_000)  # never an unbounded buffer
    out.new_worker()
    out.feed(b'{"level": "error", "event": "boom"}\n')
    assert list(out.tail) == ['{"level": "error", "event": "boom"}'] and out.last_error() == "boom"
    out.new_worker()
    assert out.last_error() is None


def test_the_last_error_reads_as_its_event_and_fields_not_as_a_json_line():
    """`tpud status` shows it under the job: a quarantine's record, a refusal naming its key."""
    out = WorkerOutput(lambda chunk: None)
    out.feed(b'{"event": "replica mismatch: this process\'s state is the odd one; quarantined", "step": 40, '
             b'"level": "error", "timestamp": "2026-11-28T08:00:00Z"}\n{"event": "exiting", "level": "info"}\n')
    assert out.last_error() == "replica mismatch: this process's state is the odd one; quarantined (step=40)"
    out.feed(b'{"event": "job cannot run here", "key": "attention.kernel", "error": "no flash here", '
             b'"level": "error", "exception": "Traceback (most recent call last):\\n  File \\"x\\"\\nValueError: no"}\n')
    assert out.last_error() == ("job cannot run here (key=attention.kernel, error=no flash here, "
                                "exception=ValueError: no)")
    for junk in (b'{"level": "error", "event": {"nested": 1}}', b'{"level": "error", "event": "cut',
                 b"{" + b"[" * 1500 + b'"level": "error"'):
        out.new_worker()
        out.feed(junk + b"\n")
        assert out.last_error() == junk.decode()  # shown as it came, never a crash


def test_a_worker_writes_each_log_record_with_its_newline_in_one_write():
    """A worker's output is unbuffered: were a record and its newline two writes, a worker killed
    between them would leave a record without its line's end."""
    import structlog

    from engine import logs

    class Writes:
        def __init__(self):
            self.calls: list[str] = []

        def write(self, text: str) -> None:
            self.calls.append(text)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    stream = Writes()
    before = structlog.get_config()
    try:
        logs.configure(fmt="json", stream=stream)
        structlog.get_logger().info("checkpoint committed", step=4)
    finally:
        structlog.configure(**before)
    assert len(stream.calls) == 1 and stream.calls[0].endswith("}\n")

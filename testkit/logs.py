"""A JSON-lines log (a daemon's, with its workers' records relayed) read as it grows."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path


class Tail:
    """The arm's log (JSON lines, ours and relayed), read as it grows; each record gets `_t`, epoch seconds.
    `records` keeps every record read, or those `keep(record)` accepts (read() returns them all)."""

    def __init__(self, path: Path, keep: Callable[[dict], bool] | None = None):
        self.path, self.offset, self.partial, self.records = path, 0, b"", []
        self.keep = keep

    def read(self) -> list[dict]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        if not chunk:
            return []
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        new = []
        for line in lines:
            try:  # a relayed chunk may split a line: such lines are skipped
                record = json.loads(line)
                record["_t"] = datetime.fromisoformat(record["timestamp"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            new.append(record)
        self.records += new if self.keep is None else [r for r in new if self.keep(r)]
        return new

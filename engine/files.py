"""Reading a file this process cannot trust, bounded and never blocking: a job file, a dataset's
manifest, a model's config.json or tokenizer. A FIFO or a device in its place could block a
read forever, and a huge file could exhaust memory. Torch-free: the daemon reads job files
with it.
"""

from __future__ import annotations

import os
import stat


class Refused(Exception):
    """A path that is not a file to read: not a regular file, or too large. str() says why."""


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), never blocking on it.

    Raises Refused when it is not a regular file or is larger than `limit` bytes, OSError
    when it cannot be read. Anything else is refused before it is opened (opening a device
    can have effects of its own); the check is repeated on the open descriptor, opened
    non-blocking, in case the path was replaced in between.
    """
    def check(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "a special file")
            link = f"a symlink to {os.path.realpath(path)}, " if os.path.islink(path) else ""
            raise Refused(f"{link}{kind}, not a regular file")
        if st.st_size > limit:
            raise Refused(f"too large: {st.st_size:,} bytes (the limit is {limit:,})")

    check(os.stat(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    with open(fd, "rb") as f:
        check(os.fstat(fd))
        data = f.read(limit + 1)  # the file may have grown since fstat
    if len(data) > limit:
        raise Refused(f"too large: more than {limit:,} bytes")
    return data

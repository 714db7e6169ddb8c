"""Files a user names (a chat template, a config file), read once and bounded."""

from __future__ import annotations

import os

from ..errors import UsageError

__all__ = ["read_user_file"]


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} bytes"


def read_user_file(path: str, label: str, limit: int, expected: str) -> bytes:
    """The bytes of the file ``path`` that the user named (``label`` names it in messages: the option and the path),
    read once and bounded: a FIFO, a device or a folder is refused before it is read (``/dev/zero`` or a FIFO would
    never end), and so is a file of more than ``limit`` bytes.

    Raises:
        UsageError: naming ``label``, what it is and ``expected`` (what to pass instead).
    """
    import stat

    try:  # O_NONBLOCK: opening a FIFO returns at once, and the fd's own stat decides (no race with a stat before)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except IsADirectoryError:
        raise UsageError(f"{label} is a directory; expected {expected}.") from None
    except OSError as err:
        raise UsageError(f"{label} cannot be read ({err.strerror or err}); expected {expected}.") from None
    try:
        mode, size = os.fstat(fd)[stat.ST_MODE], os.fstat(fd)[stat.ST_SIZE]
        if stat.S_ISDIR(mode):
            raise UsageError(f"{label} is a directory; expected {expected}.")
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise UsageError(f"{label} is {kind}, not a regular file; expected {expected}.")
        if size > limit:
            raise UsageError(f"{label} is {_size(size)}, more than the {_size(limit)} such a file may hold; "
                             f"expected {expected}.")
        chunks, left = [], limit + 1  # bounded even if the file grows while it is read
        while left > 0:
            chunk = os.read(fd, min(left, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise UsageError(f"{label} holds more than the {_size(limit)} such a file may hold; expected {expected}.")
    return data

"""One ``hf-lisa train`` run per ``--output_dir`` at a time: a lock on the folder for the whole run (issue 23).

Two runs writing into one folder would mix their checkpoints and final models without a word. The main process takes
an exclusive ``flock`` on :data:`LOCK_NAME` in ``--output_dir`` once the folder has been checked and holds it until
``run()`` returns or raises; a second run is refused with exit status 2, naming the first (pid, host, start time).

The kernel drops a ``flock`` when its process dies, however it dies (SIGKILL, OOM killer, power loss of a client), so
a lock file that a killed run left behind is stale by construction: the next run takes it. The pid, host and start
time written in the file are only there for the message. A run that ends removes the file, so a finished folder holds
no trace of it. Where ``fcntl`` does not exist (Windows) the folder is not locked.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import datetime
from typing import Optional

from ..errors import UsageError

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not locked there
    fcntl = None

logger = logging.getLogger("hf_lisa.train")

#: the lock file in ``--output_dir`` (hidden; never counted as content of the folder, never a model file)
LOCK_NAME = ".hf-lisa.lock"
#: how often, 0.1 s apart, a lock held by someone else is tried again: a run checking the folder
#: (:func:`check_not_in_use`) holds it for microseconds, a running run for the whole run
_ATTEMPTS = 5


def _holder(path: str) -> str:
    """``pid 123 on host h, started 2025-01-01 12:00:00``, from the lock file (whatever part of it can be read)."""
    try:
        with open(path) as f:
            info = json.load(f)
        started = datetime.fromtimestamp(float(info["started"])).strftime("%Y-%m-%d %H:%M:%S")
        return f"pid {int(info['pid'])} on host {info['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):  # being written at this very moment, or not ours
        return "a process that is still running"


def _in_use(output_dir: str, path: str) -> UsageError:
    return UsageError(
        f"--output_dir={output_dir} is in use by another hf-lisa train run ({_holder(path)}): two runs in one folder "
        "would mix their checkpoints and final models. Wait until it ends (or stop it), or choose another "
        "--output_dir."
    )


def check_not_in_use(output_dir: str) -> None:
    """Refuse ``output_dir`` while a run holds its lock (:class:`OutputDirLock`); writes nothing, creates nothing."""
    path = os.path.join(output_dir, LOCK_NAME)
    if fcntl is None or not os.path.isfile(path):
        return
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return  # removed by the run that just ended
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(output_dir, path) from None
    finally:
        os.close(descriptor)  # drops the shared lock this probe may hold


class OutputDirLock:
    """The exclusive lock of ``output_dir`` for one run: :meth:`acquire` once the folder is checked, released when the
    ``with`` block ends, however it ends.

    Example:
        ```py
        >>> with OutputDirLock("out") as lock:  # doctest: +SKIP
        ...     lock.acquire()  # UsageError naming the other run while one holds "out"
        ...     ...  # write into "out"
        ```
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._descriptor: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def acquire(self) -> None:
        """Create ``output_dir`` if missing and take its lock, or raise :class:`~hf_lisa.errors.UsageError` naming the
        run that holds it. A lock file whose process died is taken over (the kernel dropped its lock)."""
        if self.held or fcntl is None:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        for attempt in range(_ATTEMPTS):
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                if attempt == _ATTEMPTS - 1:
                    raise _in_use(self.output_dir, self.path) from None
                time.sleep(0.1)
                continue
            try:  # the run that held it may have removed the file between our open and our flock: lock the one there
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current != os.fstat(descriptor).st_ino:
                os.close(descriptor)
                continue
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.ftruncate(descriptor, 0)
            os.write(descriptor, json.dumps(info).encode())
            self._descriptor = descriptor
            return
        raise _in_use(self.output_dir, self.path)

    def release(self) -> None:
        """Remove the lock file and drop the lock (the file goes first, so that no run ever locks a removed file)."""
        if self._descriptor is None:
            return
        try:
            os.remove(self.path)
        except OSError as err:  # the folder was removed or made read-only meanwhile: the kernel drops the lock anyway
            logger.debug("Could not remove %s: %s", self.path, err)
        finally:
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> "OutputDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

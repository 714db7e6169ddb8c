"""One ``hf-lisa train`` run per ``--output_dir`` at a time: a lock on the folder for the whole run (issue 23).

Two runs writing into one folder would mix their checkpoints and final models without a word. The main process takes
an exclusive ``flock`` on :data:`LOCK_NAME` in ``--output_dir`` before the folder is checked and holds it until
``run()`` returns or raises; a second run is refused with exit status 2, naming the first (pid, host, start time).

The lock comes first: the folder's content (empty, a run to resume or overwrite) is checked under it
(:func:`~hf_lisa.train.run_folder.output_dir.check_output_dir`), so that no other run can write between the check and this run's
first write (issue 33). Taking it writes the lock file, which is also the real test that ``--output_dir`` can be written
(a read-only or full file system is refused there, before any weight loads). A run that fails leaves no folder that its
lock created, provided it holds nothing but the lock and the run's own bookkeeping.

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

from ...errors import UsageError

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


def _missing_folders(folder: str) -> list[str]:
    """The folders that ``os.makedirs(folder)`` would create, outermost first."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.exists(path):
        missing.insert(0, path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _cannot_write(output_dir: str, err: OSError) -> UsageError:
    reason = err.strerror or str(err)
    where = f" ({err.filename})" if err.filename and os.path.abspath(str(err.filename)) != os.path.abspath(
        output_dir) else ""
    return UsageError(
        f"--output_dir={output_dir} cannot be written: {reason}{where}. hf-lisa train checks this before any weight "
        "loads (it writes the folder's lock file first). Give a folder on a writable file system with free space."
    )


class OutputDirLock:
    """The exclusive lock of ``output_dir`` for one run: :meth:`acquire` before the folder is checked, released when
    the ``with`` block ends, however it ends. A block that raises also removes the folders :meth:`acquire` created,
    if nothing but the lock and ``bookkeeping`` (names this run writes for itself, e.g. the manifest) is in them.

    Example:
        ```py
        >>> with OutputDirLock("out") as lock:  # doctest: +SKIP
        ...     lock.acquire()  # UsageError naming the other run while one holds "out"
        ...     ...  # check and write into "out"
        ```
    """

    def __init__(self, output_dir: str, bookkeeping: tuple[str, ...] = ()) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.bookkeeping = tuple(bookkeeping)
        #: the folders :meth:`acquire` created (outermost first): the only ones a failed run may remove
        self.created: list[str] = []
        self._descriptor: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    @property
    def created_folder(self) -> bool:
        """Whether :meth:`acquire` created ``output_dir`` (it did not exist before this run)."""
        return os.path.abspath(self.output_dir) in self.created

    def acquire(self) -> None:
        """Create ``output_dir`` if missing and take its lock, or raise :class:`~hf_lisa.errors.UsageError` naming the
        run that holds it, or saying why the folder cannot be written (read-only, full, not permitted). A lock file
        whose process died is taken over (the kernel dropped its lock)."""
        if self.held or fcntl is None:
            return
        try:
            self._acquire()
        except OSError as err:  # the lock file is the first thing written: a read-only or full disk shows here
            self._remove_created()
            raise _cannot_write(self.output_dir, err) from None
        except UsageError:
            self._remove_created()
            raise

    def _acquire(self) -> None:
        for attempt in range(_ATTEMPTS):
            missing = _missing_folders(self.output_dir)
            os.makedirs(self.output_dir, exist_ok=True)
            self.created += [folder for folder in missing if folder not in self.created]
            try:
                descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # a failed run removed the folder it had created, just now: create it again
                continue
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
            try:
                os.ftruncate(descriptor, 0)
                os.write(descriptor, json.dumps(info).encode())
            except OSError:
                self._descriptor = descriptor
                self.release(remove_created=True)
                raise
            self._descriptor = descriptor
            return
        raise _in_use(self.output_dir, self.path)

    def release(self, remove_created: bool = False) -> None:
        """Remove the lock file and drop the lock (the file goes first, so that no run ever locks a removed file).

        With ``remove_created`` (a run that failed), the folders :meth:`acquire` created go too, innermost first, while
        the lock is still held, if they hold nothing but the lock file and ``bookkeeping``; never a folder that
        existed before, never anything else."""
        if self._descriptor is None:
            return
        try:
            if remove_created and self.created and self._only_ours():
                for name in self.bookkeeping:
                    if os.path.isfile(os.path.join(self.output_dir, name)):
                        os.remove(os.path.join(self.output_dir, name))
            os.remove(self.path)
            if remove_created:
                self._remove_created()
        except OSError as err:  # the folder was removed or made read-only meanwhile: the kernel drops the lock anyway
            logger.debug("Could not remove %s: %s", self.path, err)
        finally:
            os.close(self._descriptor)
            self._descriptor = None

    def _only_ours(self) -> bool:
        try:
            names = set(os.listdir(self.output_dir))
        except OSError:
            return False
        return names <= {LOCK_NAME, *self.bookkeeping}

    def _remove_created(self) -> None:
        """``rmdir`` the folders :meth:`acquire` created, innermost first; stops at the first one not empty."""
        for folder in reversed(self.created):
            try:
                os.rmdir(folder)
            except OSError:
                break
        self.created = []

    def __enter__(self) -> "OutputDirLock":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.release(remove_created=exc_type is not None)

"""What keeps ``hf-lisa chat`` and ``hf-lisa generate`` from harming what they read: the output never lands on a file
of the model, the adapter or its base; loading never reads stdin (transformers' "run the custom code? [y/N]" prompt
would take a chat's first line as the answer); a chat template's rendering is bounded in time and size; the staged
output of ``generate`` carries its process id and holds a lock, so that a later run removes what a killed one left.

Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time
from typing import IO, Callable, Iterator, Optional, Sequence

from .errors import RunError, UsageError

logger = logging.getLogger(__name__)

#: how long one prompt's chat template may render, and how long its text may be
RENDER_SECONDS = 10.0
MAX_RENDERED_CHARS = 4_000_000
#: the staged output of ``hf-lisa generate``: ``.partial-generate-<stem>-<pid>-<random><suffix>``
STAGING_PREFIX = ".partial-generate-"
_STAGED = re.compile(re.escape(STAGING_PREFIX) + r".*-(?P<pid>[0-9]+)-[0-9a-f]{8}(\.[^./]*)?")
#: most entries of a source folder compared with an existing ``--output`` (hard links, symbolic links)
MAX_COMPARED_FILES = 20_000


# ----------------------------------------------------------------------------------------------------------------------
# The output is never a file of what was loaded
# ----------------------------------------------------------------------------------------------------------------------
def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _same_file_in(path: str, folder: str) -> Optional[str]:
    """A file under ``folder`` (a symbolic link followed) that is ``path`` itself (a hard link, a link target)."""
    try:
        target = os.stat(path)
    except OSError:
        return None
    seen = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            seen += 1
            if seen > MAX_COMPARED_FILES:
                return None
            candidate = os.path.join(parent, name)
            try:
                st = os.stat(candidate)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                return candidate
    return None


def check_output_outside_sources(output: str, sources: Sequence[tuple[str, Optional[str]]]) -> None:
    """Refuse an ``--output`` that is a file of a loaded folder: ``sources`` are ``(what, folder or Hub id)`` pairs
    (``("the model", path)``, ...); Hub ids and ``None`` are passed over. A new ``.jsonl`` file inside such a folder
    is allowed (e.g. ``outputs/generations.jsonl``); an existing file of it, one that is the same file through a hard
    or symbolic link, a file with another suffix there (it could shadow what loads: ``config.json``, weights), and
    anything in the Hugging Face cache are not.

    Raises:
        UsageError: naming ``--output``, the folder and what it holds.
    """
    if output == "-":
        return
    real = os.path.realpath(output)
    exists = os.path.lexists(output)
    folders = [(what, os.path.realpath(folder)) for what, folder in sources if folder and os.path.isdir(folder)]
    advice = "choose a path outside it (generate never writes into what it loads)."
    from huggingface_hub.constants import HF_HUB_CACHE

    cache = os.path.realpath(HF_HUB_CACHE)
    if _inside(real, cache):  # where Hub models are kept: only the folder is compared, never walked
        raise UsageError(f"--output={output!r} is in the Hugging Face cache ({cache!r}); {advice}")
    for what, folder in folders:
        if _inside(real, folder) and (exists or not real.endswith(".jsonl")):
            kind = "is a file of" if exists else "would be a new non-.jsonl file in"
            raise UsageError(f"--output={output!r} {kind} {what} ({folder!r}); {advice}")
    if exists:
        for what, folder in folders:
            same = _same_file_in(real, folder)
            if same is not None:
                raise UsageError(f"--output={output!r} is the same file as {same!r} of {what} (a hard or symbolic "
                                 f"link); {advice}")


# ----------------------------------------------------------------------------------------------------------------------
# Loading never reads stdin
# ----------------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def no_stdin() -> Iterator[None]:
    """No question is asked while a model or tokenizer loads: transformers' "Do you wish to run the custom code?
    [y/N]" (its ``TIME_OUT_REMOTE_CODE`` set to 0 refuses at once), and ``sys.stdin`` is empty, so that any other
    prompt for input ends instead of reading the user's conversation as its answer."""
    try:
        import transformers.dynamic_module_utils as dynamic
    except ImportError:  # pragma: no cover - transformers is a dependency
        dynamic = None
    timeout = getattr(dynamic, "TIME_OUT_REMOTE_CODE", None)
    if timeout is not None:
        dynamic.TIME_OUT_REMOTE_CODE = 0
    previous = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = previous
        if timeout is not None:
            dynamic.TIME_OUT_REMOTE_CODE = timeout


# ----------------------------------------------------------------------------------------------------------------------
# Chat templates render bounded
# ----------------------------------------------------------------------------------------------------------------------
class _RenderTimeout(BaseException):
    """Raised by the alarm in the middle of a template's rendering (a ``BaseException``: nothing in between catches
    it)."""


def render_bounded(render: Callable[[], str], template: str) -> str:
    """``render()`` (a chat template applied to one prompt), stopped after :data:`RENDER_SECONDS` (by ``SIGALRM``, in
    the main thread where signals can be used) and refused when its text is longer than :data:`MAX_RENDERED_CHARS`.
    ``template`` says which template and where it came from.

    Raises:
        UsageError: the template ran too long, rendered too much, or failed (a Jinja error), naming ``template``.
    """
    from jinja2 import TemplateError

    fix = "fix it, or pass --chat_template with another template (a built-in name or a Jinja file)"
    timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    outer = signal.getitimer(signal.ITIMER_REAL) if timed else (0.0, 0.0)  # an alarm someone else set
    timed = timed and not 0 < outer[0] <= RENDER_SECONDS  # theirs rings first: their handler stays
    previous, started = None, time.monotonic()
    if timed:
        def stop(signum, frame):
            raise _RenderTimeout()

        previous = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)
    try:
        text = render()
    except _RenderTimeout:
        raise UsageError(f"{template} did not finish rendering a prompt within {RENDER_SECONDS:g} s (a loop that runs "
                         f"too long?), so it was stopped; {fix}.") from None
    except TemplateError as exc:
        raise UsageError(f"{template} fails on this prompt ({type(exc).__name__}: {exc}); {fix}.") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer[0] > 0:  # re-armed with what was left of it
                signal.setitimer(signal.ITIMER_REAL, max(outer[0] - (time.monotonic() - started), 1e-3), outer[1])
    if len(text) > MAX_RENDERED_CHARS:
        raise UsageError(f"{template} rendered a prompt of {len(text):,} characters (more than {MAX_RENDERED_CHARS:,});"
                         f" {fix}.")
    return text


def template_origin(tokenizer, choice: str, installed: bool) -> str:
    """Which chat template renders the prompts and where it came from, for messages: ``--chat_template=<choice>`` when
    that was installed, else the tokenizer's own (its ``chat_template.jinja`` or ``tokenizer_config.json``)."""
    if installed:
        return f"the chat template --chat_template={choice!r}"
    origin = str(getattr(tokenizer, "name_or_path", "") or "")
    if os.path.isdir(origin):
        jinja = os.path.join(origin, "chat_template.jinja")
        path = jinja if os.path.isfile(jinja) else os.path.join(origin, "tokenizer_config.json")
        return f"the tokenizer's chat template {path!r}"
    return f"the chat template of the tokenizer {origin!r}" if origin else "the tokenizer's chat template"


# ----------------------------------------------------------------------------------------------------------------------
# The staged output of generate
# ----------------------------------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process, or no way to tell: treat as alive
        return True
    return True


def remove_stale_partials(folder: str) -> list[str]:
    """Remove what killed ``generate`` runs left in ``folder``: only files named as :func:`staged_output` names them,
    whose process is gone and whose lock nobody holds; returns their paths."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Windows
        fcntl = None
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _STAGED.fullmatch(name)
        if match is None or _alive(int(match["pid"])):
            continue
        path = os.path.join(folder, name)
        try:
            descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if fcntl is not None:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
                removed.append(path)
        except OSError:  # locked: its writer still runs (in another PID namespace, or on another machine)
            continue
        finally:
            os.close(descriptor)
    for path in removed:
        logger.info("Removed %s, left by a generate run that was killed.", path)
    return removed


@contextlib.contextmanager
def staged_output(out_file: str) -> Iterator[IO[str]]:
    """A text file beside ``out_file`` to write to, renamed to ``out_file`` (mode following the umask) when the block
    completes, removed when it raises. Its name holds this process's id and it stays locked (``flock``) while open, so
    that :func:`remove_stale_partials`, run here first, removes only what a killed run left."""
    from .export.common import apply_umask

    out_file = os.path.abspath(out_file)
    parent = os.path.dirname(out_file)
    os.makedirs(parent, exist_ok=True)
    remove_stale_partials(parent)
    stem, suffix = os.path.splitext(os.path.basename(out_file))
    staging = os.path.join(parent, f"{STAGING_PREFIX}{stem}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        import fcntl

        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # pragma: no cover - not on Windows
        pass
    handle = os.fdopen(descriptor, "w", encoding="utf-8")
    try:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
        apply_umask(staging)
        os.replace(staging, out_file)
    finally:
        with contextlib.suppress(OSError):  # on a full disk closing fails again (its flush): the staged file still goes
            handle.close()
        if os.path.lexists(staging):
            os.remove(staging)


def no_space_error(exc: OSError, output: str) -> Optional[RunError]:
    """A ``RunError`` naming ``--output`` for a full disk (or quota) while writing it; ``None`` for other errors."""
    if exc.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return None
    where = "stdout" if output == "-" else f"--output={output!r} (staged beside it, so nothing was replaced)"
    return RunError(f"no space left on the device while writing {where}: free some space, or choose another --output, "
                    "and run again.")


def check_not_meant_locally(value: str, option: str) -> None:
    """Refuse a Hub-id-shaped ``value`` that is a missing local folder: ``runs/typo`` where ``./runs`` exists, or
    any id under ``HF_HUB_OFFLINE`` that the Hub cache does not hold (the Hub would say "empty repo", or retry for
    a minute, instead of "no such folder")."""
    first = value.split("/")[0]
    if "/" in value and os.path.isdir(first):
        raise UsageError(f"{option}={value!r}: no such folder ({first}/ exists, {value} does not). A Hub id with the "
                         f"same spelling would be read as ./{first}/... first; rename the local folder to use one.")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() not in ("1", "ON", "YES", "TRUE"):
        return
    from huggingface_hub import try_to_load_from_cache

    if not any(isinstance(try_to_load_from_cache(value, name), str) for name in ("config.json", "adapter_config.json")):
        raise UsageError(f"{option}={value!r}: no such folder, and HF_HUB_OFFLINE is set: it is not in the Hub "
                         "cache either, so it cannot be loaded as a Hub repo.")

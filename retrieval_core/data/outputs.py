"""Who owns an output folder, and what a failed write means: the one implementation every job uses.

- :func:`run_lock`: a job holds ``<output>/_RUN_LOCK`` (host, pid, start time, command) while it writes there,
  so a second run into the same folder is refused naming the first, instead of the two deleting each other's
  temp files. A lock is stale when its pid is gone on this host, or, written on another host, when it is older
  than ``stale_after_s`` (we cannot see another host's processes); a stale lock is taken over with a warning.
- :func:`write_failure`: a full disk (ENOSPC), an exhausted quota (EDQUOT) or a read-only filesystem (EROFS)
  as one line naming the cause and the path, whether the error came as an OSError or as the text Beam and
  h5py wrap it in.
- :class:`FailSafeFile`: the raw file under h5py's writer. h5py cannot fail cleanly once a write failed (its
  handle crashes the interpreter with a segfault when freed), so this file keeps the first write error and
  discards later writes: h5py closes normally and the caller raises the kept error.
"""
from __future__ import annotations

import errno
import functools
import io
import json
import logging
import os
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from retrieval_core.data.paths import is_url
from retrieval_core.errors import OutputBusy, OutputWriteFailed, as_write_failure

log = logging.getLogger(__name__)

LOCK_FILE = "_RUN_LOCK"
#: A lock written on another host is stale after this long (its pid cannot be checked from here).
STALE_AFTER_S = 24 * 3600
#: A lock that cannot be parsed is one being written (a few ms) or a damaged one: stale after this long.
UNREADABLE_STALE_S = 60
# ------------------------------------------------------------------------------------------- lock
def _holder_text(h: dict) -> str:
    return (f"pid {h.get('pid')} on {h.get('host')} since {h.get('started')} ({h.get('command', '?')})")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def stale_reason(holder: dict, now: float, stale_after_s: float = STALE_AFTER_S) -> Optional[str]:
    """Why ``holder`` (a lock's content) no longer owns its folder, or None while it may still run."""
    if holder.get("host") == socket.gethostname():
        pid = holder.get("pid")
        if not isinstance(pid, int) or not _pid_alive(pid):
            return f"its process {pid} is gone on this host"
        return None
    age = now - float(holder.get("started_s", 0))
    if holder.get("command") == "unreadable lock" and age > UNREADABLE_STALE_S:
        return f"it is unreadable and {age:.0f} s old"
    if age > stale_after_s:
        return f"it was written on another host {age / 3600:.1f} h ago (stale after {stale_after_s / 3600:.1f} h)"
    return None


def _read_holder(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        # being written right now (busy for a while), or damaged: it names no process, so its age decides
        try:
            mtime = os.path.getmtime(path)
        except OSError:
            mtime = 0.0
        return {"host": "?", "pid": None, "started_s": mtime, "started": "?", "command": "unreadable lock"}


def _create(path: str, content: bytes) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        if os.write(fd, content) != len(content):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.remove(path)  # an empty lock would read as another run's
        raise
    os.close(fd)
    return True


@contextmanager
def run_lock(output: str, job: str, stale_after_s: float = STALE_AFTER_S) -> Iterator[Optional[str]]:
    """Hold ``<output>/_RUN_LOCK`` while the body runs (created here, removed on exit, also on an error).

    Raises OutputBusy naming the holder when a live run owns the folder. URL outputs (gs://) get no lock:
    object stores have no atomic create-if-absent through Beam's FileSystems, which is said in the log."""
    if is_url(output):
        log.info("%s: no run lock on %s (object stores offer no atomic create); keep one run per folder", job, output)
        yield None
        return
    created = not os.path.isdir(output)
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as exc:
        raise (as_write_failure(exc, output) or exc) from None
    path = os.path.join(output, LOCK_FILE)
    now = time.time()
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started_s": now, "job": job,
          "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
          "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])[:500], "token": uuid.uuid4().hex}
    content = (json.dumps(me, indent=2) + "\n").encode("utf-8")
    try:
        acquired = _create(path, content)
        if not acquired:
            holder = _read_holder(path)
            why = stale_reason(holder, now, stale_after_s)
            if why is None:
                raise OutputBusy(f"{output} is in use by another run: {_holder_text(holder)}; wait for it, or "
                                 f"write elsewhere (if that run is gone for good, delete {path})")
            log.warning("%s: taking over the stale lock %s of %s: %s", job, path, _holder_text(holder), why)
            # Move the stale lock aside (atomic) so two runs taking it over at once cannot both succeed.
            aside = f"{path}.stale-{me['token']}"
            try:
                os.rename(path, aside)
                os.remove(aside)
            except FileNotFoundError:
                pass  # another run moved it first; the create below decides
            acquired = _create(path, content)
            if not acquired:
                raise OutputBusy(f"{output} was taken over by another run: {_holder_text(_read_holder(path))}")
    except OSError as exc:
        raise (as_write_failure(exc, path) or exc) from None
    try:
        yield path
    finally:
        if _read_holder(path).get("token") == me["token"]:
            os.remove(path)
        if created and not os.listdir(output):
            os.rmdir(output)  # a run refused before writing anything leaves no folder behind


def holds_output(job: str, output_of: Callable = lambda plan: plan.output) -> Callable:
    """Decorate a job's ``run(plan, ...)`` to hold :func:`run_lock` on ``output_of(plan)`` while it runs."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(plan, *args, **kwargs):
            with run_lock(output_of(plan), job):
                return fn(plan, *args, **kwargs)
        return run
    return decorate


class FailSafeFile(io.RawIOBase):
    """A local file for h5py's file-object driver that never lets a failed write reach h5py: the first
    OSError is kept in :attr:`error` and later writes are dropped (the file is deleted by its owner)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self._f = open(path, "w+b", buffering=0)  # unbuffered: a seek never flushes (and fails) behind h5py
        self.error: Optional[OutputWriteFailed | OSError] = None

    def _failed(self, exc: OSError) -> None:
        if self.error is None:
            self.error = as_write_failure(exc, self.path) or exc

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self._f.readinto(b)

    def write(self, b) -> int:
        n = len(memoryview(b).cast("B"))
        view = memoryview(b).cast("B")
        while self.error is None and view:
            try:
                view = view[self._f.write(view):]  # a raw write may take part of the bytes
            except OSError as exc:
                self._failed(exc)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def truncate(self, size: Optional[int] = None) -> int:
        if self.error is None:
            try:
                return self._f.truncate(size)
            except OSError as exc:
                self._failed(exc)
        return self._f.tell() if size is None else size

    def flush(self) -> None:
        if self.error is None and not self._f.closed:
            try:
                self._f.flush()
            except OSError as exc:
                self._failed(exc)

    def close(self) -> None:
        if not self._f.closed:
            self.flush()
            try:
                self._f.close()
            except OSError as exc:
                self._failed(exc)
        super().close()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

"""The failures a job reports to its user in one line instead of a traceback, and how a failed write is
recognised however deep a runner or h5py wrapped it. The bottom floor of the library: it imports nothing of
the project, so the CLI kit (cli.py) and every sub-package can raise and name these."""
from __future__ import annotations

import errno
import os
import re
from typing import Optional


class UsageFault(ValueError):
    """The command line itself is wrong (a flag no one knows, two options that exclude each other): the CLI
    reports it as click's usage error (exit 2); everything else the library refuses is a plain ValueError
    (exit 1)."""


class StagedDataError(RuntimeError):
    """The staged directory is missing, incomplete or inconsistent."""


#: The errno values that mean "this output cannot be written", and how each is named to the user.
WRITE_ERRNOS = {
    errno.ENOSPC: "no space left on device (ENOSPC)",
    errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno.EROFS: "read-only file system (EROFS)",
}


class OutputFault(Exception):
    """An output folder that cannot be used (owned by another run, full, read-only): one line for the user."""


class OutputBusy(OutputFault):
    """Another live run holds the output folder's lock."""


class MemoryCapTooLow(RuntimeError):
    """The process's memory limit (RLIMIT_DATA) is below what the job needs to start (retrieval_core.memory)."""


class OutputWriteFailed(OutputFault, OSError):
    """A write into an output failed for want of space or permission (keeps the errno and the path)."""

    def __init__(self, err: int, path: str):
        super().__init__(err, f"{WRITE_ERRNOS.get(err, os.strerror(err))} writing {path}: free space (or make "
                              f"it writable) and rerun; finished shards are kept, partial ones are not counted")
        self.filename = path

    def __str__(self) -> str:
        return self.strerror


# ------------------------------------------------------------------------------------- write errors
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]|errno = (\d+)")
_PATH_TEXT = re.compile(r"filename = '([^']+)'|\[Errno \d+\] [^:']*: '([^']+)'")


def _errno_and_path(exc: BaseException) -> tuple[Optional[int], Optional[str]]:
    """The first write errno in ``exc``'s chain (attributes, or the text a wrapper kept) and its path."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        err = getattr(exc, "errno", None)
        if err in WRITE_ERRNOS:
            return err, getattr(exc, "filename", None) or _path_in(str(exc))
        text = str(exc)
        for m in _ERRNO_TEXT.finditer(text):
            code = int(m.group(1) or m.group(2))
            if code in WRITE_ERRNOS:
                return code, _path_in(text)
        exc = exc.__cause__ or exc.__context__
    return None, None


def _path_in(text: str) -> Optional[str]:
    m = _PATH_TEXT.search(text)
    return (m.group(1) or m.group(2)) if m else None


def as_write_failure(exc: BaseException, path: Optional[str] = None) -> Optional[OutputWriteFailed]:
    """``exc`` as an OutputWriteFailed when it is a full disk, a quota or a read-only filesystem, else None."""
    if isinstance(exc, OutputWriteFailed):
        return exc
    err, where = _errno_and_path(exc)
    return None if err is None else OutputWriteFailed(err, where or path or "the output")


def write_failure(exc: BaseException) -> Optional[str]:
    """The one-line message for a full disk / quota / read-only filesystem in ``exc``, else None."""
    failed = as_write_failure(exc)
    return None if failed is None else str(failed)

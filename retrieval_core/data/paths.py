"""Local paths and URLs (gs://...), and how files are reached: the one place that tells them apart.

This library opens local paths itself and leaves URLs to the file access its caller passes (the pipelines:
Beam FileSystems, ``pipelines.files.BEAM_FILES``), so every module that handles paths asks :func:`is_url`,
joins with :func:`join_path` and reads through a :class:`FileAccess` (default :data:`LOCAL_FILES`, which
refuses URLs in one line instead of treating ``gs://b/x`` as the local file ``gs:/b/x``).
"""
from __future__ import annotations

import glob
import hashlib
import os
from typing import BinaryIO, Optional, Protocol, Sequence


def is_url(path) -> bool:
    """``gs://bucket/x.tsv`` and other ``scheme://`` paths: not reachable with Python's own file access."""
    return "://" in os.fspath(path)


def join_path(base: str, name: str) -> str:
    """``base/name``; URLs always join with "/" (os.path.join would use the local separator)."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else os.path.join(base, name)


def split_path(path: str) -> tuple[str, str]:
    """(parent, last name) of a path or URL, ignoring a trailing separator (os.path.normpath would turn
    ``gs://b/x`` into ``gs:/b/x``)."""
    if is_url(path):
        parent, _, name = path.rstrip("/").rpartition("/")
        return parent, name
    return os.path.split(os.path.normpath(path))


class FileAccess(Protocol):
    """How the library reaches files. Paths are local paths or URLs (``scheme://...``).

    ``open`` raises FileNotFoundError for a missing file (the readers add the path to the message);
    ``match`` and ``listdir`` list files only (never directories), sorted."""

    def open(self, path: str) -> BinaryIO:
        """A binary read handle, the bytes exactly as stored (no transparent gunzip: the readers detect
        gzip by its magic bytes themselves)."""

    def match(self, pattern: str) -> list[str]:
        """The files a glob pattern (``*``, ``?``, ``[...]``) matches."""

    def exists(self, path: str) -> bool:
        """Whether a file is at ``path``."""

    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (object stores: a prefix that holds files)."""

    def listdir(self, path: str) -> list[str]:
        """Full paths of the files directly in directory ``path`` (not recursive)."""

    def walk(self, path: str) -> list[tuple[str, int, str]]:
        """(full path, size, version) of every file under directory ``path``, recursively, sorted; the version
        is a string that changes when the file is rewritten (modification time, and the store's checksum
        where it keeps one): what the model-folder cache (``checkpoints.local_model_folder``) is keyed by."""


class URLAccessError(ValueError):
    """A URL path reached the local file access: the caller must pass a FileAccess for URLs. Readers let it
    propagate (it is a setup error, never one record's reject)."""


class LocalFileAccess:
    """Python's own file access; refuses URLs with a message saying what to pass instead (rather than
    treating ``gs://b/x`` as the local file ``gs:/b/x``)."""

    @staticmethod
    def _local(path: str) -> str:
        path = os.fspath(path)
        if is_url(path):
            raise URLAccessError(f"{path} is a URL: the readers' default (local) file access cannot reach it; pass "
                             f"files=<a FileAccess for URLs> (pipelines.stage passes pipelines.files.BEAM_FILES, "
                             f"Beam FileSystems)")
        return path

    def open(self, path: str) -> BinaryIO:
        return open(self._local(path), "rb")

    def match(self, pattern: str) -> list[str]:
        return sorted(p for p in glob.glob(self._local(pattern)) if os.path.isfile(p))

    def exists(self, path: str) -> bool:
        return os.path.isfile(self._local(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(self._local(path))

    def listdir(self, path: str) -> list[str]:
        path = self._local(path)
        return sorted(p for p in (os.path.join(path, n) for n in os.listdir(path)) if os.path.isfile(p))

    def walk(self, path: str) -> list[tuple[str, int, str]]:
        found = []
        for root, _, names in os.walk(self._local(path)):
            for name in names:
                st = os.stat(os.path.join(root, name))
                found.append((os.path.join(root, name), int(st.st_size), str(st.st_mtime_ns)))
        return sorted(found)


#: The default file access of every reader.
LOCAL_FILES = LocalFileAccess()


def read_file(path: str, files: Optional[FileAccess] = None) -> bytes:
    """The whole file at ``path``, its bytes as stored, through ``files`` (default: local)."""
    with (files or LOCAL_FILES).open(path) as f:
        return f.read()


def file_exists(path: str, files: Optional[FileAccess] = None) -> bool:
    """Whether a file is at ``path``; a URL the file access cannot reach counts as absent (for optional
    cross-checks, e.g. the embeddings an index manifest records, which may live elsewhere)."""
    try:
        return (files or LOCAL_FILES).exists(path)
    except URLAccessError:
        return False


def local_sha256(path: str) -> str:
    """sha256 hex digest of a local file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def local_folder_sha256(folder: str, suffix: str = "") -> str:
    """sha256 over a local folder's files ending in ``suffix`` (relative names and bytes; ``__pycache__``
    skipped): what a cached output was built from (a base checkpoint, the code of a job)."""
    h = hashlib.sha256()
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")  # os.walk follows this order
        for name in sorted(n for n in names if n.endswith(suffix)):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, folder).encode("utf-8") + b"\0")
            h.update(local_sha256(path).encode("ascii"))
    return h.hexdigest()


def write_local_atomic(path: str, data: bytes) -> None:
    """Write a local file through a temporary name and a rename: a killed process never leaves half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ confinement
def _within(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def escapes_roots(path: str, roots: Sequence[str]) -> Optional[str]:
    """None when ``path`` stays inside one of ``roots``, else where it leads (one line's worth).

    A local path is judged by where it resolves, ``..`` and symlinks followed (``os.path.realpath``, roots
    too); glob characters are kept as written, so a pattern is judged by the folders before them. A URL (an
    object store: no symlinks) escapes only by a ``..`` segment, which Beam's file systems would pass on."""
    path = os.fspath(path)
    if is_url(path):
        return path if ".." in path.split("://", 1)[1].split("/") else None
    real = os.path.realpath(os.path.expanduser(path))
    local = [os.path.realpath(r) for r in roots if r and not is_url(r)]
    return None if any(_within(real, r) for r in local) else real

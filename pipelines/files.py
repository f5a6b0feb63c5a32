"""File access for the Beam jobs: Beam FileSystems behind retrieval_core's ``FileAccess``, atomic writes, checksums.

Writes go through ``apache_beam.io.filesystems.FileSystems`` so that the same code writes local paths on
DirectRunner/DaskRunner and gs:// paths on Dataflow; the readers' inputs are reached through
:data:`BEAM_FILES`, the same FileSystems behind retrieval_core's ``FileAccess`` interface. A shard is written
to a temporary name and renamed, so a killed job never leaves a half-written file under a final name; a rerun
recognises finished shards by their checksum and skips them.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import uuid
from typing import Iterable, Optional

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from retrieval_core.data.paths import LOCAL_FILES, is_url
from retrieval_core.errors import as_write_failure

log = logging.getLogger(__name__)


def join(*parts: str) -> str:
    return FileSystems.join(*parts)


def exists(path: str) -> bool:
    return FileSystems.exists(path)


def makedirs(path: str) -> None:
    # Object stores have no directories; locally FileSystems.mkdirs raises if it exists.
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with FileSystems.open(path) as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()



class BeamFileAccess:
    """retrieval_core.data.paths.FileAccess over Beam FileSystems: the readers reach URL inputs (gs://, or any
    scheme a registered Beam FileSystem serves) on the launcher (planning) and on the workers (reading), and
    so do the embeddings, index and model-folder readers.

    Local paths go to the readers' local access unchanged, so local staging keeps its exact glob semantics
    and error messages (Beam's local match differs: ``*`` skips no dot files, a directory matches itself)."""
    @staticmethod
    def _local():
        return LOCAL_FILES

    def open(self, path: str):
        if not is_url(path):
            return self._local().open(path)
        try:
            # UNCOMPRESSED: FileSystems would gunzip *.gz by name; the readers detect gzip by its magic bytes.
            return FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
        except FileNotFoundError:
            raise
        except Exception:  # object stores raise their own "not found" errors: normalise it for the readers
            if not FileSystems.exists(path):
                raise FileNotFoundError(path) from None
            raise

    def match(self, pattern: str) -> list[str]:
        if not is_url(pattern):
            return self._local().match(pattern)
        return sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list)

    def exists(self, path: str) -> bool:
        return self._local().exists(path) if not is_url(path) else FileSystems.exists(path)

    def isdir(self, path: str) -> bool:
        if not is_url(path):
            return self._local().isdir(path)
        # Object stores have no directories: a "directory" is a prefix that holds at least one object.
        prefix = path.rstrip("/") + "/"
        return bool(FileSystems.match([prefix + "**"], limits=[1])[0].metadata_list)

    def listdir(self, path: str) -> list[str]:
        if not is_url(path):
            return self._local().listdir(path)
        return self.match(path.rstrip("/") + "/*")  # Beam's "*" stops at "/": not recursive

    def walk(self, path: str) -> list[tuple[str, int, str]]:
        if not is_url(path):
            return self._local().walk(path)
        found = []
        for m in FileSystems.match([path.rstrip("/") + "/**"])[0].metadata_list:
            if m.path.endswith("/"):  # a zero-byte "folder" placeholder some bucket tools create
                continue
            try:  # the store's own checksum (GCS: the CRC32C of the object), no file read
                checksum = FileSystems.checksum(m.path)
            except NotImplementedError:
                checksum = ""
            found.append((m.path, int(m.size_in_bytes), f"{checksum}@{m.last_updated_in_seconds}"))
        return sorted(found)


#: The file access every pipeline passes to the readers.
BEAM_FILES = BeamFileAccess()


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path) as f:
        return f.read()


def write_atomic(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` via a temp name + rename; returns the sha256 of ``data``."""
    return write_atomic_stream(path, io.BytesIO(data))


def write_json_atomic(path: str, obj) -> str:
    return write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8"))


def read_json(path: str):
    return json.loads(read_bytes(path).decode("utf-8"))


def write_jsonl_atomic(path: str, rows: Iterable[dict]) -> int:
    lines = [json.dumps(r, sort_keys=True, default=str) for r in rows]
    write_atomic(path, ("\n".join(lines) + ("\n" if lines else "")).encode("utf-8"))
    return len(lines)


def shard_is_valid(path: str, expected_sha256: Optional[str]) -> bool:
    """True when ``path`` exists and matches the checksum recorded by an earlier run."""
    if not expected_sha256 or not FileSystems.exists(path):
        return False
    try:
        return sha256_file(path) == expected_sha256
    except OSError as exc:  # unreadable counts as corrupt: it will be rewritten
        log.warning("cannot read %s (%s); it will be rewritten", path, exc)
        return False


def shard_name(prefix: str, index: int, total: int, suffix: str) -> str:
    """Deterministic shard file name, e.g. ``coco-00003-of-00010.parquet``."""
    return f"{prefix}-{index:05d}-of-{total:05d}{suffix}"



def write_atomic_stream(path: str, src, chunk: int = 1 << 22) -> str:
    """The one atomic write: copies the binary stream ``src`` to a temp name and renames it to ``path`` (a
    killed job never leaves a partial file under a final name); returns the sha256 of what was written."""
    parent = path.rsplit("/", 1)[0] if "/" in path else "."
    makedirs(parent)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    h = hashlib.sha256()
    try:
        with FileSystems.create(tmp) as f:
            while block := src.read(chunk):
                h.update(block)
                f.write(block)
    except OSError as exc:
        with contextlib.suppress(Exception):  # no partial file left behind (a full disk has no room for it)
            FileSystems.delete([tmp])
        failed = as_write_failure(exc, path)
        if failed is None:
            raise
        raise failed from None
    if FileSystems.exists(path):
        FileSystems.delete([path])
    FileSystems.rename([tmp], [path])
    return h.hexdigest()


#: Per-run scratch folder under a pipeline's output for data on its way through a shuffle (stage: region
#: features; encode: encoded batches): the shuffle carries file names, the files hold the bulk. Beam's local
#: runners keep a GroupByKey's whole input in memory, so bulk data must never be shuffled.
SPILL_DIR = "_spill"


def remove_tree(root: str) -> None:
    """Delete the folder ``root`` and everything under it; on an object store (gs://), every object under the
    prefix (a "folder" is no object there: FileSystems.exists says no and deleting it deletes nothing)."""
    if not is_url(root):
        shutil.rmtree(root, ignore_errors=True)
        return
    found = [m.path for m in FileSystems.match([join(root, "**")])[0].metadata_list]
    if found:
        FileSystems.delete(found)


def list_files(folder: str) -> dict[str, float]:
    """{name: modification time (epoch s)} of the files directly under ``folder``; {} when it does not exist."""
    if not is_url(folder):
        try:
            with os.scandir(folder) as entries:
                return {e.name: e.stat().st_mtime for e in entries if e.is_file()}
        except FileNotFoundError:
            return {}
    found = FileSystems.match([folder.rstrip("/") + "/*"])[0].metadata_list  # "*" stops at "/"
    return {m.path.rsplit("/", 1)[1]: float(m.last_updated_in_seconds) for m in found if not m.path.endswith("/")}


def remove_spill(output: str) -> None:
    """Delete ``<output>/_spill`` (this run's spill files, or those a killed run left behind)."""
    remove_tree(join(output, SPILL_DIR))

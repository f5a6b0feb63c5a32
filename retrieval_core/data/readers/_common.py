"""Small helpers shared by the feature and caption readers: file access, line iteration, text decoding,
source-id conventions and input listing.

All file access (opening, listing a directory, globbing, existence checks) goes through a
:class:`FileAccess` object passed as ``files``. The default, :data:`LOCAL_FILES`, is Python's own file
access (local paths only). This library does not import Beam (layering), so URL inputs (gs://...) need the
caller's file access: the stage pipeline passes ``pipelines.files.BEAM_FILES`` (Beam FileSystems).
"""
from __future__ import annotations

import gzip
import io
import os
import re
from typing import Iterator, Optional, Sequence

# The file access lives in paths (embeddings, index and checkpoints use it too); re-exported for the readers.
from ..paths import LOCAL_FILES, FileAccess, LocalFileAccess, URLAccessError, escapes_roots, is_url  # noqa: F401

_GZIP_MAGIC = b"\x1f\x8b"
_GLOB_CHARS = re.compile(r"[*?\[]")


def _open_binary(path: str, files: Optional[FileAccess] = None):
    """Open ``path`` for binary reading through ``files`` (default: local); a missing file is a
    FileNotFoundError naming it, any other OS failure a ValueError naming it."""
    try:
        return (files or LOCAL_FILES).open(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"input file not found: {path}") from None
    except OSError as e:
        raise ValueError(f"cannot read input file {path}: {e}") from None


def read_bytes(path: str, files: Optional[FileAccess] = None) -> bytes:
    """The whole file, gunzipped when it starts with the gzip magic bytes."""
    with _open_binary(path, files) as f:
        data = f.read()
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: corrupt or truncated gzip data: {e}") from None
    return data


def iter_lines(path: str, files: Optional[FileAccess] = None) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes without the line ending) of a text file, gzip or not.

    Streams (rows of feature TSVs are megabytes and files gigabytes). Only ``\\n`` ends a line (a stray
    ``\\r`` inside a caption does not split it); a trailing ``\\r`` is dropped. A final newline does not
    make an extra empty line.
    """
    with _open_binary(path, files) as raw:
        head = raw.read(2)
        raw.seek(0)
        f = gzip.GzipFile(fileobj=raw) if head == _GZIP_MAGIC else raw
        try:
            for lineno, line in enumerate(f, start=1):
                if line.endswith(b"\n"):
                    line = line[:-1]
                if line.endswith(b"\r"):
                    line = line[:-1]
                yield lineno, line
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: corrupt or truncated gzip data: {e}") from None


def read_lines(path: str, files: Optional[FileAccess] = None) -> list[bytes]:
    """All lines of a (small) text file, as :func:`iter_lines` splits them."""
    return [line for _, line in iter_lines(path, files)]


def decode_text(data: bytes) -> str | bytes:
    """UTF-8 text, or the raw bytes unchanged when they are not valid UTF-8.

    Convention of every caption reader: an undecodable caption is yielded as a RawCaption whose ``text``
    is ``bytes``; the stager rejects it with its locator. Nothing is silently replaced.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data


#: Reject reason category of a record whose id is not valid UTF-8.
R_ID_NOT_UTF8 = "id not UTF-8"


def decode_id(data: bytes) -> Optional[str]:
    """An id field's text (UTF-8, surrounding whitespace stripped), or None when its bytes are not valid UTF-8.

    Ids are never decoded with replacement characters: two different ids would become equal, and one of them
    would then be rejected as a duplicate of the other. Callers reject the record (:func:`bad_id_reason`)."""
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None


def is_unicode_text(text: str) -> bool:
    """False for a str holding lone surrogates: undecodable bytes of a file name (os.listdir's
    surrogateescape) or of a surrogateescape-decoded JSON file. Such an id has no UTF-8 form to hash."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def bad_id_reason(what: str, raw: bytes | str) -> str:
    """The reject reason of an id that is not valid UTF-8, showing its bytes."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape" if _only_escaped(raw) else "surrogatepass")
    return f"{R_ID_NOT_UTF8}: {what} {raw!r} is not valid UTF-8 (replacing its bytes could make it equal to " \
           f"another id)"


def str_or_bytes(text: str) -> str | bytes:
    """A str that came out of a surrogateescape-decoded JSON file: back to bytes when it is not valid
    Unicode (undecodable source bytes or lone surrogate escapes), else unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape" if _only_escaped(text) else "surrogatepass")


def _only_escaped(text: str) -> bool:
    return all(not (0xD800 <= ord(c) <= 0xDFFF) or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


def file_stem(name: str) -> str:
    """``/a/b/coco_test2014_000000391895.npz`` -> ``coco_test2014_000000391895``; a ``#suffix`` (Multi30k
    COCO image lists write ``COCO_train2014_000000117071.jpg#367178``) is dropped first."""
    base = os.path.basename(name.split("#", 1)[0].strip())
    stem, _ = os.path.splitext(base)
    return stem


def apply_source_id_pattern(raw_id: str, pattern: Optional[str]) -> Optional[str]:
    """Apply ``source_id_pattern`` (a regex with one group, searched in ``raw_id``) to a raw id.

    The group's text is the source id; a purely numeric group loses its leading zeros
    (``coco_test2014_000000391895`` with ``(\\d+)$`` -> ``391895``). No pattern: ``raw_id`` unchanged.
    Returns None when the pattern does not match (callers reject the record).
    """
    if not pattern:
        return raw_id
    m = re.search(pattern, raw_id)
    if m is None:
        return None
    value = m.group(1) if m.groups() else m.group(0)
    if value is None:
        return None
    return str(int(value)) if value.isdigit() else value


#: File name endings a directory input is expanded to, per format.
DIR_EXTENSIONS = {
    "butd_tsv": (".tsv",),
    "bua_npz": (".npz",),
    "uniter_npz": (".npz",),
    "plain_npz": (".npz",),
    "oscar_pt": (".pt", ".pth"),
    "karpathy_json": (".json",),
    "caption_lines": ("_caps.txt",),
    "flickr30k_entities": (".txt",),
    "cc_tsv": (".tsv",),
    "multi30k": (".gz", ".en", ".de", ".fr", ".cs"),
}


def glob_root(pattern: str) -> str:
    """The folder before a glob pattern's first glob character (``/d/im*/x.jpg`` -> ``/d``)."""
    from ..paths import split_path

    return split_path(_GLOB_CHARS.split(pattern, 1)[0] + "x")[0]


def list_inputs(path: str | Sequence[str], format: str = "", files: Optional[FileAccess] = None,
                confine: bool = True) -> list[str]:
    """Expand a file, a directory (files with the format's extensions, non-recursive), a glob pattern,
    or a list of those, into a sorted, de-duplicated list of files; ``files`` lists them (default: local).

    Raises FileNotFoundError naming the first entry that matches nothing. With ``confine``, a file a folder
    or a glob yields must resolve inside that folder (the glob's: before its first glob character): a
    symlink out of it is a ValueError naming the file, where it leads and the folder (the manifest's own
    paths are confined when it loads; image_files judges each file as a record instead).
    """
    files = files or LOCAL_FILES
    entries = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not entries:
        raise FileNotFoundError("no input path given")
    found: set[str] = set()
    for entry in entries:
        entry = os.fspath(entry)
        if _GLOB_CHARS.search(entry):
            matches = files.match(entry)
        elif files.isdir(entry):
            exts = DIR_EXTENSIONS.get(format, ("",))
            matches = [p for p in files.listdir(entry) if p.endswith(exts)]
        elif files.exists(entry):
            matches = [entry]
        else:
            matches = []
        if not matches:
            what = f"directory with {'/'.join(DIR_EXTENSIONS.get(format, ('',)))} files" if files.isdir(entry) \
                else "file or glob pattern"
            raise FileNotFoundError(f"input {entry!r} ({format or 'input'}) matches no {what}")
        if confine and (_GLOB_CHARS.search(entry) or files.isdir(entry)):
            root = glob_root(entry) if _GLOB_CHARS.search(entry) else entry
            for m in matches:
                leads = escapes_roots(m, [root])
                if leads is not None:
                    raise ValueError(f"input {m} (from {entry}) resolves to {leads}, outside its folder {root}: "
                                     f"name the file itself, or its folder, in the manifest")
        found.update(matches)
    return sorted(found)


def npz_bytes(path: str, files: Optional[FileAccess] = None) -> io.BytesIO:
    """The bytes of an npz file in memory (zip needs seeking; remote file objects may not seek)."""
    with _open_binary(path, files) as f:
        return io.BytesIO(f.read())

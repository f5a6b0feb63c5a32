"""Readers of the region-feature and caption formats users have, plus a picklable dispatch API for the
Beam stager.

``plan_read_tasks`` turns one manifest entry (collection, kind, format, path, options) into a sorted,
deterministic list of :class:`ReadTask` (one per input file, or one per chunk of a synthetic collection);
``read_task`` runs one task and yields ``RawImage`` / ``RawCaption`` / ``Reject``. Readers never raise for
one bad record (they yield a Reject with locator and reason); a missing input is a FileNotFoundError, an
unreadable whole file or a bad option a ValueError, and an input file that yields no record at all an
:class:`EmptySourceError` (unless the caller allows empty inputs: ``read_task(..., allow_empty=True)``).

Both take ``files`` (a :class:`FileAccess`: open, match, exists, isdir, listdir), default local
(:data:`LOCAL_FILES`). It is not part of a ReadTask: planning and reading may run on different machines,
and the caller on each says how files are reached (the stage pipeline: Beam FileSystems, so gs:// works).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..schema import KIND_CAPTION, KIND_IMAGE, RawCaption, RawImage, Reject, Skipped
from ..synthetic.captions import generate_captions
from ..synthetic.regions import generate_images
from ..synthetic.spec import SyntheticSpec
from ._common import (
    LOCAL_FILES,
    FileAccess,
    LocalFileAccess,
    URLAccessError,
    _open_binary,
    apply_source_id_pattern,
    file_stem,
    is_url,
    list_inputs,
)
from .captions import (
    read_caption_lines,
    read_cc_tsv,
    read_flickr30k_entities,
    read_karpathy_json,
    read_multi30k,
    strip_entities_markup,
)
from .features import (
    BUTD_COLUMNS,
    detector_frame_size,
    image_size,
    read_bua_npz,
    read_butd_tsv,
    read_oscar_pt,
    read_plain_npz,
    read_uniter_npz,
)
from .images import FORMAT as IMAGE_FILES
from .images import image_file_entries, list_image_files, read_image_files

SYNTHETIC = "synthetic"


class EmptySourceError(ValueError):
    """An input file yielded no record at all (no image, caption or reject): a wrong path, an empty download
    or an option (a Karpathy ``split``) that selects nothing. Staging it would silently stage nothing."""

IMAGE_READERS: dict[str, Callable[..., Iterator[RawImage | Reject]]] = {
    "butd_tsv": read_butd_tsv,
    "bua_npz": read_bua_npz,
    "uniter_npz": read_uniter_npz,
    "oscar_pt": read_oscar_pt,
    "plain_npz": read_plain_npz,
    IMAGE_FILES: read_image_files,
}
CAPTION_READERS: dict[str, Callable[..., Iterator[RawCaption | Reject]]] = {
    "karpathy_json": read_karpathy_json,
    "caption_lines": read_caption_lines,
    "flickr30k_entities": read_flickr30k_entities,
    "cc_tsv": read_cc_tsv,
    "multi30k": read_multi30k,
}


@dataclass(frozen=True)
class ReadTask:
    """One unit of reading work: a whole input file, images [start, stop) of a synthetic collection, or a chunk
    of image files (``path``: a tuple of them).

    ``options`` are sorted (name, value) pairs with lists turned into tuples (hashable, picklable).
    ``feature_dim`` is only used by the synthetic format.
    """
    kind: str
    format: str
    path: Optional[str | tuple[str, ...]]
    options: tuple
    start: int = 0
    stop: Optional[int] = None
    collection: str = ""
    feature_dim: int = 0
    refused: tuple = ()  # image files: (file, reason) of the chunk's files that resolve outside their root


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _readers(kind: str) -> dict:
    if kind == KIND_IMAGE:
        return IMAGE_READERS
    if kind == KIND_CAPTION:
        return CAPTION_READERS
    raise ValueError(f"kind must be {KIND_IMAGE!r} or {KIND_CAPTION!r}, got {kind!r}")


def _check_options(format: str, reader: Callable, options: dict) -> None:
    params = inspect.signature(reader).parameters
    allowed = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"format {format!r} does not take option(s) {unknown}; it takes {sorted(allowed)}")
    required = sorted(n for n in allowed if params[n].default is inspect.Parameter.empty and n not in options)
    if required:
        raise ValueError(f"format {format!r} needs option(s) {required}")


def plan_read_tasks(collection: str, kind: str, format: str, path, options: Optional[dict], feature_dim: int,
                    chunk_size: int = 500, files: Optional[FileAccess] = None) -> list[ReadTask]:
    """The read tasks of one manifest entry, in a deterministic order.

    File formats: ``path`` (a file, a directory, a glob, or a list of those) expands to one task per file,
    sorted (listed through ``files``, default local); a pattern matching nothing is a FileNotFoundError
    naming it. Format "synthetic": no files;
    [0, num_images) of ``SyntheticSpec.from_options(collection, options, feature_dim)`` is split into
    chunks of ``chunk_size`` images, one task each (for captions too: a caption task covers the captions
    of its images).
    """
    options = dict(options or {})
    frozen = _freeze(options)
    if format == SYNTHETIC:
        _readers(kind)

        spec = SyntheticSpec.from_options(collection, options, feature_dim)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return [ReadTask(kind, format, None, frozen, start, min(start + chunk_size, spec.num_images), collection,
                         feature_dim) for start in range(0, spec.num_images, chunk_size)]
    readers = _readers(kind)
    if format not in readers:
        raise ValueError(f"unknown {kind} format {format!r}; known: {sorted(readers) + [SYNTHETIC]}")
    _check_options(format, readers[format], options)
    if path is None:
        raise ValueError(f"format {format!r} needs a path")
    if format == IMAGE_FILES:  # chunks of files: the backbone runs on batches, not one image per task
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        entries = image_file_entries(path, files)
        images = [p for p, _ in entries]
        return [ReadTask(kind, format, tuple(images[i:i + chunk_size]), frozen, i, min(i + chunk_size, len(images)),
                         collection, feature_dim, tuple((p, why) for p, why in entries[i:i + chunk_size] if why))
                for i in range(0, len(images), chunk_size)]
    return [ReadTask(kind, format, p, frozen, 0, None, collection, feature_dim)
            for p in list_inputs(path, format, files)]


def read_task(task: ReadTask, files: Optional[FileAccess] = None, *, allow_empty: bool = False,
              device: str = "cpu", wanted: Optional[Callable[[str], bool]] = None
              ) -> Iterator[RawImage | RawCaption | Reject | Skipped]:
    """Run one task: yields its records (RawImage / RawCaption) and Rejects; files are read through
    ``files`` (default local); ``device`` runs the image backbone of image files. ``wanted`` (image source id ->
    stage it?): image files whose id it refuses are not read, yielded as :class:`Skipped` (other formats read
    every record; the stager filters those). A file task that yields
    nothing raises :class:`EmptySourceError` naming the
    file once the file is read, unless ``allow_empty`` (pipelines.stage ``--allow-empty``)."""
    count = 0
    for record in _read(task, files, device, wanted):
        count += 1
        yield record
    if count == 0 and not allow_empty and task.format != SYNTHETIC:
        options = ", ".join(f"{k}={v!r}" for k, v in task.options)
        raise EmptySourceError(f"{task.path}: the {task.format} reader found no {task.kind} records in it"
                               f"{f' (options: {options})' if options else ''}; check the path and options, or "
                               f"allow empty inputs (pipelines.stage --allow-empty)")


def caption_image_splits(collection: str, format: str, path, options: Optional[dict],
                         files: Optional[FileAccess] = None, *, allow_empty: bool = False) -> dict[str, frozenset]:
    """{image source id: the splits of its captions} over one caption source (every file of ``path``), for
    staging only the images the captions name (manifest ``uncaptioned_images: skip``): an image's split is
    then its captions' split. Rejected caption records name no image; a file with no record is an error
    (EmptySourceError), as when the captions are staged, unless ``allow_empty``."""
    if format == SYNTHETIC:
        raise ValueError("synthetic captions describe every generated image: there is nothing to select")
    found: dict[str, set] = {}
    for task in plan_read_tasks(collection, KIND_CAPTION, format, path, options, 0, files=files):
        for rec in read_task(task, files, allow_empty=allow_empty):
            if isinstance(rec, RawCaption):
                found.setdefault(rec.image_source_id, set()).add(rec.split)
    return {sid: frozenset(splits) for sid, splits in found.items()}


def _read(task: ReadTask, files: Optional[FileAccess], device: str = "cpu",
          wanted: Optional[Callable[[str], bool]] = None) -> Iterator[RawImage | RawCaption | Reject | Skipped]:
    options = {k: v for k, v in task.options}
    if task.format == SYNTHETIC:

        spec = SyntheticSpec.from_options(task.collection, options, task.feature_dim)
        stop = spec.num_images if task.stop is None else task.stop
        generate = generate_images if task.kind == KIND_IMAGE else generate_captions
        yield from generate(spec, task.start, stop)
        return
    readers = _readers(task.kind)
    if task.format not in readers:
        raise ValueError(f"unknown {task.kind} format {task.format!r}; known: {sorted(readers)}")
    if task.format == IMAGE_FILES:
        yield from read_image_files(task.path, files, device, wanted, dict(task.refused), **options)
        return
    yield from readers[task.format](task.path, files, **options)


__all__ = [
    "BUTD_COLUMNS", "CAPTION_READERS", "caption_image_splits",
    "EmptySourceError", "FileAccess", "IMAGE_FILES", "IMAGE_READERS", "LOCAL_FILES",
    "list_image_files", "read_image_files",
    "LocalFileAccess", "ReadTask", "SYNTHETIC", "URLAccessError", "apply_source_id_pattern", "detector_frame_size",
    "file_stem", "image_size", "is_url", "list_inputs", "plan_read_tasks", "read_bua_npz", "read_butd_tsv",
    "read_caption_lines", "read_cc_tsv", "read_flickr30k_entities", "read_karpathy_json", "read_multi30k",
    "read_oscar_pt", "read_plain_npz", "read_task", "read_uniter_npz", "strip_entities_markup", "_open_binary"
]

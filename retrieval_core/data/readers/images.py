"""Image files (JPEG, PNG, anything Pillow reads) -> grid-region RawImages through a pretrained backbone
(``retrieval_core.data.pixels``), or a Reject per file that cannot be staged, with its reason.

The input is a folder (every file in it but hidden ones, not recursive), a glob, a list file (``.txt`` /
``.lst``: one path per line, relative to the list file's folder) or a ``gs://`` prefix; a read task is a chunk
of those files, decoded one by one and run through the backbone in batches of ``batch_size``.

Each file must resolve (``..`` and symlinks followed) inside its root: the list file's folder for a line of a
list, the folder for a folder's file, the folder before the first glob character for a glob's match. One that
leads elsewhere (``../x.jpg``, ``/etc/x.jpg``, a symlink out) is not opened: it is a Reject with that reason,
counted like every other (in = staged + rejected).
"""
from __future__ import annotations

import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from ..paths import escapes_roots, join_path, split_path
from ..pixels import decode
from ..schema import RawImage, Reject, Skipped
from ._common import FileAccess, _open_binary, apply_source_id_pattern, file_stem, glob_root, list_inputs, read_lines

FORMAT = "image_files"
LIST_SUFFIXES = (".txt", ".lst")
_GLOB = re.compile(r"[*?\[]")


def list_image_files(path: str | Sequence[str], files: Optional[FileAccess] = None) -> list[str]:
    """The image files of ``path`` (a folder, glob, list file, gs:// prefix, or a list of those), sorted."""
    return [p for p, _ in image_file_entries(path, files)]


def image_file_entries(path: str | Sequence[str], files: Optional[FileAccess] = None
                       ) -> list[tuple[str, Optional[str]]]:
    """(file, None) for each image file of ``path`` as :func:`list_image_files` lists them, or (file, the
    reason it is refused) for one that resolves outside its root (the module docstring), sorted by file."""
    entries = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    found: dict[str, str] = {}  # file -> its root
    for entry in map(os.fspath, entries):
        if entry.endswith(LIST_SUFFIXES) and not (files and files.isdir(entry)):
            base = split_path(entry)[0]
            for line in read_lines(entry, files):
                name = line.decode("utf-8").strip()
                if name and not name.startswith("#"):
                    found[name if os.path.isabs(name) or "://" in name else join_path(base, name)] = base
            continue
        root = glob_root(entry) if _GLOB.search(entry) else entry
        found.update((p, root) for p in list_inputs(entry, FORMAT, files, confine=False)
                     if not os.path.basename(p.rstrip("/")).startswith("."))
    if not found:
        raise FileNotFoundError(f"input {path!r} ({FORMAT}) lists no image file")
    out = []
    for p in sorted(found):
        leads = escapes_roots(p, [found[p]])
        out.append((p, None if leads is None else f"outside its root: {p} resolves to {leads}, not under "
                                                  f"{found[p]}"))
    return out


def read_image_files(paths: Sequence[str], files: Optional[FileAccess] = None, device: str = "cpu",
                     wanted: Optional[Callable[[str], bool]] = None,
                     refused: Optional[Mapping[str, str]] = None, *,
                     grids: int | list[int] | str = 7, batch_size: int = 32, source_id_pattern: Optional[str] = None,
                     max_pixels: int = decode.DEFAULT_MAX_PIXELS, decode_threads: int = 1,
                     precision: str = "float32", layers: str | list[str] = "head",
                     cell_norm: str = "none", input_size: int = 224) -> Iterator[RawImage | Reject]:
    """One RawImage (normalised grid boxes, the file's size after EXIF rotation, its ``conversions``) per
    decodable file of ``paths``, else a Reject naming the file and why. ``grids``: the grid sizes (e.g. [3, 7]);
    ``source_id_pattern``: a regex whose group, searched in the file's stem, is the image id (default the stem).
    ``device`` is where the backbone runs (pipelines.stage --device), not a manifest option; ``wanted`` (image
    id -> stage it?): a file whose id it refuses is neither read nor run through the backbone, yielded as a
    :class:`Skipped` (``uncaptioned_images: skip``); ``refused`` (file -> reason, from
    :func:`image_file_entries`): files never opened, each a Reject with its reason. ``decode_threads``
    decode files in parallel (Pillow releases the GIL while decoding and resizing): what feeds a GPU backbone;
    they decode ahead (at most two batches) while the backbone runs; 0 decodes in the backbone's thread, between
    batches. ``precision``: the backbone's arithmetic
    (float32, or bfloat16: other features, another fingerprint); ``layers``: the backbone's maps whose cells
    make a region's features (``pixels.backbone.LAYERS``; the head by default); ``cell_norm``: each map's cell
    vector as it is (none) or centred over its channels and scaled to unit length (unit); ``input_size``: the
    square every picture is resized to (a multiple of 32; 224 by default, the final map 7 x 7; 288 gives 9 x 9, so
    a 3 x 3 grid's cells are exact thirds of the picture)."""
    from ..pixels.backbone import GridSpec, cached_backbone, parse_grids, parse_layers

    if int(batch_size) < 1 or int(decode_threads) < 0:
        raise ValueError(f"{FORMAT} batch_size must be >= 1 and decode_threads >= 0, got {batch_size!r}, "
                         f"{decode_threads!r}")
    spec = GridSpec(parse_grids(grids), str(precision), parse_layers(layers), str(cell_norm), input_size)
    backbone = cached_backbone(spec.grids, device, spec.precision, spec.layers, spec.cell_norm, spec.input_size)
    paths = [paths] if isinstance(paths, str) else list(paths)
    batch: list[tuple[str, str, decode.Decoded]] = []

    def flush():
        feats = backbone.regions(np.stack([d.pixels for _, _, d in batch]))
        for (path, sid, d), f in zip(batch, feats):
            yield RawImage(sid, f, backbone.boxes.copy(), d.width, d.height, box_format="normalized6",
                           locator=path, conversions=d.conversions)
        batch.clear()

    def load(path: str) -> tuple[str, Optional[str], Optional[decode.Decoded], str]:
        if refused and path in refused:
            return path, None, None, refused[path]
        sid = apply_source_id_pattern(file_stem(path), source_id_pattern)
        if sid is None:
            return path, None, None, f"id pattern does not match: {source_id_pattern!r} in {file_stem(path)!r}"
        if wanted is not None and not wanted(sid):
            return path, sid, None, ""
        try:
            with _open_binary(path, files) as f:
                data = f.read()
        except (FileNotFoundError, ValueError) as exc:
            return path, sid, None, f"unreadable file: {exc}"
        return (path, sid, *decode.decode_or_reason(data, backbone.input_size, int(max_pixels)))

    with ThreadPoolExecutor(max(int(decode_threads), 1)) as pool:
        loaded = _ahead(pool, load, paths, 2 * int(batch_size)) if int(decode_threads) else map(load, paths)
        for path, sid, decoded, reason in loaded:
            if decoded is None:
                yield Reject(path, path, reason) if reason else Skipped(sid, path)
                continue
            batch.append((path, sid, decoded))
            if len(batch) >= int(batch_size):
                yield from flush()
        if batch:
            yield from flush()


def _ahead(pool: ThreadPoolExecutor, fn, items: Sequence, depth: int) -> Iterator:
    """``map(fn, items)`` in order, with at most ``depth`` items decoded ahead in ``pool`` (while the caller runs
    the backbone), not the whole chunk's pictures held at once as ``pool.map`` would."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) > depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()

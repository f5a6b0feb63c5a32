"""The regions a training run reads, as one flat file beside the staged shards, read by position with ``os.pread``.

Staged Parquet list columns cannot be read by row, and loading a split's regions whole takes its float32 bytes
(COCO's train split with 36 boxes of 2,048-d: 33 GB). This file holds, per staged image (every collection and
split, in staged shard order), only the regions a model reads: the first ``max_regions`` (the stager keeps them
most-confident first), in the precision they were staged in. Layout, inside the staged folder (nothing the stager
wrote changes, so staged content, its checksums and the models trained on it stay as they were)::

    <staged>/regions/<fingerprint>/regions.json  fingerprint, version, max_regions, feature dim and dtype, the
                                                 staged image content it was made from, sizes
    <staged>/regions/<fingerprint>/index.npz     item_id (file order), rows (n + 1 row offsets of the kept
                                                 regions), staged_regions (each image's staged region count)
    <staged>/regions/<fingerprint>/regions.bin   per image: boxes (r, 6) float32, then features (r, F) in the
                                                 staged dtype, r = min(staged count, max_regions)
    <staged>/regions/<fingerprint>/pooled.bin    (n, F) float32: the mean of each image's *staged* regions (all
                                                 of them: what ``training.train_data.feature_neighbours`` pools)

``fingerprint`` (:func:`region_file_fingerprint`) is a digest of the staged images' content (the sha256s
``summary.json`` records, per collection), ``max_regions`` and the layout version: re-staged data or another cap
gets another folder, and :func:`ensure_region_file` builds the one asked for (one pass over the staged shards,
one shard in memory at a time) and deletes the folders of content that is no longer staged. A folder whose
record or sizes do not match is refused by :class:`RegionFile` in one line and rebuilt by ``ensure_region_file``.

:class:`StreamedImages` reads it with the read API of ``schema.ImageTable`` (``regions(i)``, ``num_boxes()``,
``take``, ``item_ids``), so the model's batched loops and the trainer take either; only the regions asked for are
in memory. Reads are positional (``os.pread``), not mapped: a mapped file's pages would count towards the
process's resident memory, and reads from several threads need no shared file position.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Callable, Optional, Sequence

import numpy as np

from retrieval_core.data import schema
from retrieval_core.data.paths import is_url, write_local_atomic
from retrieval_core.data.store import StagedDataset
from retrieval_core.errors import StagedDataError

REGIONS_DIR = "regions"
META_FILE = "regions.json"
INDEX_FILE = "index.npz"
DATA_FILE = "regions.bin"
POOLED_FILE = "pooled.bin"
VERSION = 1
BOX_BYTES = schema.BOX_DIM * 4  # float32
#: One image's (features (r, F), boxes (r, 6)), as ``model.collate.Regions``.
Regions = tuple[np.ndarray, np.ndarray]


class RegionFileError(StagedDataError):
    """A derived region file that does not belong to the staged data or region cap asked for, or is damaged."""


def mean_region_feature(feats: np.ndarray) -> np.ndarray:
    """An image's mean region feature in float32: what the near-image neighbours pool (the in-memory table's and
    this file's alike, so both give the same bits)."""
    return np.asarray(feats, dtype=np.float32).mean(0)


def region_file_fingerprint(staged: StagedDataset, max_regions: int) -> str:
    """16 hex digits of sha256 over the staged images' content (every collection), the region cap and the layout."""
    content = {c: staged.content_sha256("images", c) for c in staged.collections}
    key = {"version": VERSION, "max_regions": int(max_regions), "feature_dim": staged.feature_dim,
           "feature_dtype": staged.feature_dtype, "images": content}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def region_file_dir(staged: StagedDataset, max_regions: int) -> str:
    return os.path.join(staged.root, REGIONS_DIR, region_file_fingerprint(staged, max_regions))


def _check_cap(max_regions) -> int:
    if isinstance(max_regions, bool) or not isinstance(max_regions, (int, np.integer)) or max_regions < 1:
        raise ValueError(f"a region file keeps max_regions >= 1 regions per image, got {max_regions!r}")
    return int(max_regions)


def _feature_dtype(staged: StagedDataset) -> np.dtype:
    return np.dtype(np.float16 if staged.feature_dtype == "float16" else np.float32)


class RegionFile:
    """One staged folder's derived region file for one region cap (module docstring); refuses, in one line, a
    folder that was made from other staged content or another cap, or whose files are short."""

    def __init__(self, staged: StagedDataset, max_regions: int):
        self.max_regions = _check_cap(max_regions)
        if is_url(staged.root):
            raise RegionFileError(f"{staged.root} is a URL: a region file is read by position from a local disk")
        self.fingerprint = region_file_fingerprint(staged, self.max_regions)
        self.root = os.path.join(staged.root, REGIONS_DIR, self.fingerprint)
        path = os.path.join(self.root, META_FILE)
        try:
            with open(path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise RegionFileError(f"no region file {self.root}: build it with ensure_region_file") from None
        except (OSError, ValueError) as exc:
            raise RegionFileError(f"cannot read {path}: {exc}") from None
        want = {"fingerprint": self.fingerprint, "version": VERSION, "max_regions": self.max_regions,
                "feature_dim": staged.feature_dim, "feature_dtype": staged.feature_dtype}
        wrong = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
        if wrong:
            raise RegionFileError(f"{path} records {wrong}, the staged data and cap ask for "
                                  f"{ {k: want[k] for k in wrong} }: delete {self.root} and rebuild it")
        self.meta = meta
        self.feature_dim = int(staged.feature_dim)
        self.dtype = _feature_dtype(staged)
        self.row_bytes = BOX_BYTES + self.feature_dim * self.dtype.itemsize
        try:
            with np.load(os.path.join(self.root, INDEX_FILE), allow_pickle=False) as z:
                self.item_ids, self.rows = z["item_id"].astype(np.int64), z["rows"].astype(np.int64)
                self.staged_regions = z["staged_regions"].astype(np.int64)
        except (OSError, KeyError, ValueError) as exc:
            raise RegionFileError(f"cannot read {os.path.join(self.root, INDEX_FILE)} ({exc}): delete {self.root} "
                                  f"and rebuild it") from None
        n = len(self.item_ids)
        sizes = {DATA_FILE: int(self.rows[-1]) * self.row_bytes if n else 0, POOLED_FILE: n * self.feature_dim * 4}
        for name, size in sizes.items():
            have = os.path.getsize(os.path.join(self.root, name)) if os.path.exists(os.path.join(self.root, name)) \
                else -1
            if have != size or len(self.rows) != n + 1 or len(self.staged_regions) != n:
                raise RegionFileError(f"{os.path.join(self.root, name)} holds {have} bytes, its index says {size}: "
                                      f"delete {self.root} and rebuild it")
        self._order = np.argsort(self.item_ids, kind="stable")
        self._fd = os.open(os.path.join(self.root, DATA_FILE), os.O_RDONLY)
        self._pooled_fd = os.open(os.path.join(self.root, POOLED_FILE), os.O_RDONLY)

    def __repr__(self) -> str:
        return f"RegionFile({self.root!r}, {len(self.item_ids)} images, max_regions={self.max_regions})"

    @property
    def nbytes(self) -> int:
        """Bytes on disk (regions and pooled vectors)."""
        return int(self.rows[-1]) * self.row_bytes + len(self.item_ids) * self.feature_dim * 4

    def close(self) -> None:
        for name in ("_fd", "_pooled_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def __del__(self):
        self.close()

    def images(self, item_ids: Sequence[int]) -> "StreamedImages":
        """The images of ``item_ids`` in that order (every id must be staged, else KeyError naming the missing),
        as StagedDataset.load_images would return them, read on demand."""
        req = np.asarray(list(item_ids), dtype=np.int64)
        at = np.searchsorted(self.item_ids, req, sorter=self._order)
        at = np.minimum(at, max(len(self.item_ids) - 1, 0))
        rows = self._order[at] if len(self.item_ids) else np.zeros(len(req), dtype=np.int64)
        missing = req[self.item_ids[rows] != req] if len(self.item_ids) else req
        if len(missing):
            raise KeyError(f"{len(missing)} item_id(s) not staged: {missing[:10].tolist()}")
        return StreamedImages(self, rows)

    def read(self, row: int) -> Regions:
        """(features (r, F) in the staged dtype, boxes (r, 6) float32) of the image at file row ``row``: one pread."""
        a, b = int(self.rows[row]), int(self.rows[row + 1])
        n, size = b - a, (b - a) * self.row_bytes
        buf = os.pread(self._fd, size, a * self.row_bytes)
        if len(buf) != size:
            raise RegionFileError(f"{os.path.join(self.root, DATA_FILE)} is shorter than its index: delete "
                                  f"{self.root} and rebuild it")
        boxes = np.frombuffer(buf, np.float32, n * schema.BOX_DIM).reshape(n, schema.BOX_DIM)
        feats = np.frombuffer(buf, self.dtype, n * self.feature_dim, n * BOX_BYTES).reshape(n, self.feature_dim)
        return feats, boxes

    def pooled(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), F) float32: the mean staged region feature of each image at those file rows."""
        out = np.empty((len(rows), self.feature_dim), dtype=np.float32)
        width = self.feature_dim * 4
        for i, row in enumerate(np.asarray(rows, dtype=np.int64).tolist()):
            if os.preadv(self._pooled_fd, [out[i]], row * width) != width:
                raise RegionFileError(f"{os.path.join(self.root, POOLED_FILE)} is short: delete {self.root} and "
                                      f"rebuild it")
        return out


class StreamedImages:
    """Images of a :class:`RegionFile`, read by position when asked for: the read API of ``schema.ImageTable``.

    ``regions(i)`` gives the first ``max_regions`` regions (features in the staged dtype: the collation widens
    them exactly, as loading does), ``num_boxes()`` the staged region counts (the key batched loops sort images
    by, as for the table), ``take`` a view of other positions (nothing read)."""

    streamed = True

    def __init__(self, file: RegionFile, rows: np.ndarray):
        self.file = file
        self.rows = np.asarray(rows, dtype=np.int64)
        self.item_ids = file.item_ids[self.rows]
        self.meta: dict = {"feature_dim": file.feature_dim}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def feature_dim(self) -> int:
        return self.file.feature_dim

    @property
    def max_regions(self) -> int:
        return self.file.max_regions

    def num_boxes(self) -> np.ndarray:
        return self.file.staged_regions[self.rows]

    def regions(self, i: int) -> Regions:
        return self.file.read(int(self.rows[i]))

    def read(self, positions: Sequence[int]) -> list[Regions]:
        """The regions of the images at ``positions``, in that order."""
        return [self.file.read(int(r)) for r in self.rows[np.asarray(positions, dtype=np.int64)]]

    def take(self, indices) -> "StreamedImages":
        return StreamedImages(self.file, self.rows[np.asarray(list(indices), dtype=np.int64)])

    def position_of(self) -> dict[int, int]:
        return {int(v): i for i, v in enumerate(self.item_ids)}

    def pooled(self, positions: Optional[Sequence[int]] = None) -> np.ndarray:
        """(n, F) float32 mean of all staged regions of the images at ``positions`` (default all)."""
        rows = self.rows if positions is None else self.rows[np.asarray(positions, dtype=np.int64)]
        return self.file.pooled(rows)


def _build(staged: StagedDataset, max_regions: int, folder: str) -> None:
    """Writes the region file of ``staged`` at ``max_regions`` into ``folder``, one staged image shard at a time."""
    dtype = _feature_dtype(staged)
    ids, rows, counts = [], [0], []
    with open(os.path.join(folder, DATA_FILE), "wb") as data, open(os.path.join(folder, POOLED_FILE), "wb") as pool:
        for rel in staged.shard_names("images"):
            table = staged.read_image_shard(rel, dtype=dtype)
            if table is None:
                continue
            for i in range(len(table)):
                feats, boxes = table.regions(i)
                if len(feats) == 0:
                    raise RegionFileError(f"staged image {int(table.item_ids[i])} of {rel} has no regions")
                kept = min(len(feats), max_regions)
                data.write(np.ascontiguousarray(boxes[:kept], dtype=np.float32).tobytes())
                data.write(np.ascontiguousarray(feats[:kept], dtype=dtype).tobytes())
                pool.write(mean_region_feature(feats).tobytes())
                rows.append(rows[-1] + kept)
                counts.append(len(feats))
            ids.append(table.item_ids)
            del table
    item_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if len(np.unique(item_ids)) != len(item_ids):
        raise RegionFileError(f"{staged.root}: an item id is staged twice")
    np.savez(os.path.join(folder, INDEX_FILE), item_id=item_ids.astype(np.int64),
             rows=np.asarray(rows, dtype=np.int64), staged_regions=np.asarray(counts, dtype=np.int64))


def ensure_region_file(staged: StagedDataset, max_regions: int,
                       log: Optional[Callable[[str], object]] = None) -> RegionFile:
    """The region file of ``staged`` at ``max_regions``, built when missing or refused (one pass over the staged
    image shards), after deleting the region files of image content that is no longer staged."""
    max_regions = _check_cap(max_regions)
    if is_url(staged.root):
        raise RegionFileError(f"{staged.root} is a URL: a region file is read by position from a local disk")
    folder = region_file_dir(staged, max_regions)
    if os.path.exists(os.path.join(folder, META_FILE)):
        try:
            return RegionFile(staged, max_regions)
        except RegionFileError as exc:
            if log is not None:
                log(f"note: {exc}; rebuilding it")
            shutil.rmtree(folder, ignore_errors=True)
    _remove_stale(staged, log)
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _build(staged, max_regions, tmp)
        content = {c: staged.content_sha256("images", c) for c in staged.collections}
        meta = {"fingerprint": os.path.basename(folder), "version": VERSION, "max_regions": max_regions,
                "feature_dim": staged.feature_dim, "feature_dtype": staged.feature_dtype, "images": content}
        write_local_atomic(os.path.join(tmp, META_FILE), (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished the same file first: keep theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = RegionFile(staged, max_regions)
    if log is not None:
        log(f"region file: {len(out.item_ids)} images, up to {max_regions} regions each in {staged.feature_dtype}, "
            f"{out.nbytes / 1e6:.0f} MB at {out.root}")
    return out


def _remove_stale(staged: StagedDataset, log) -> None:
    """Deletes the region files made from image content that is no longer staged (they can never be used again;
    at COCO size each is ~18 GB); files of the same content at other caps are kept."""
    root = os.path.join(staged.root, REGIONS_DIR)
    if not os.path.isdir(root):
        return
    content = {c: staged.content_sha256("images", c) for c in staged.collections}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, META_FILE)) as f:
                stale = json.load(f).get("images") != content
        except (OSError, ValueError):  # a half-built folder: left to its process while that one lives
            stale = not _builder_alive(name)
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            if log is not None:
                log(f"note: removed region file {path}: made from image shards that are no longer staged")


def _builder_alive(name: str) -> bool:
    """Whether the process that builds the folder ``<fingerprint>.tmp<pid>`` still runs."""
    pid = name.rpartition(".tmp")[2]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

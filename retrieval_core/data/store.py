"""Read staged data back: the one API the model, encode and evaluation code use (no Beam).

A staged directory is what ``python -m pipelines.stage`` writes::

    summary.json                                  what was staged, shard list with sha256, reject counts
    images/<collection>-00000-of-00010.parquet    image rows (schema.image_schema), sorted by item_id
    features/<collection>-00000-of-00010.h5       HDF5 layout only: features/boxes, rows via feature_row
    captions/<collection>-00000-of-00010.parquet  caption rows (schema.CAPTION_SCHEMA)
    rejects/<collection>-{images,captions}.jsonl  every record that was not staged, with its reason

Only the shards listed in summary.json are read (stale or half-written files are never picked up), and each
is checked against the sha256 summary.json records for it when it is first read: a folder whose shards come
from another staging run than its summary (a re-stage killed midway) is refused, in one line, never read
as a mixture. So is a folder holding ``_INCOMPLETE`` (:data:`INCOMPLETE_FILE`), which the stager writes
before it replaces the first shard and deletes once summary.json is written. Results are identical whether
features are stored inline in Parquet or in HDF5 shards.

Local paths are read with Python's own file access. A URL path (gs://...) is read through the ``files`` given
(a ``retrieval_core.data.paths.FileAccess``): this library does not import Beam, so the pipelines pass theirs.

Example::

    from retrieval_core.data.store import StagedDataset
    ds = StagedDataset("/data/staged/demo")
    ds.collections                       # ['demo']
    meta = ds.images_meta(split="test")  # pandas: item_id, collection, source_id, split, image_w, ...
    caps = ds.captions(split="test")     # pandas: caption_id, image_item_id, text, ...
    table = ds.load_images(meta.item_id.tolist()[:8])   # schema.ImageTable in that order
    feats, boxes = table.regions(0)      # (n0, F) float32, (n0, 6) float32
    for batch in ds.iter_image_batches(256, split="test"):   # bounded memory
        ...
    cap2img, img2caps = ds.gold(split="test")   # fresh dict / dict of frozensets
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from typing import BinaryIO, Collection, Iterator, Optional, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import StagedDataError
from . import schema
from .paths import LOCAL_FILES, FileAccess, is_url, join_path
from .schema import SUMMARY_FILE

#: Present while a staging run is replacing a folder's shards (pipelines.stage writes it before the first shard
#: and deletes it after summary.json): a folder that holds it may mix two runs' shards.
INCOMPLETE_FILE = "_INCOMPLETE"
_META_COLUMNS = [c for c in schema.IMAGE_COLUMNS if c not in ("boxes", "features")]


# Local shards already checked in this process, as (path, size, mtime_ns, sha256): several StagedDatasets over
# one folder (benchmark suites, Beam workers sharing a process) hash each shard once.
_VERIFIED_LOCAL: set[tuple] = set()
_VERIFIED_LOCK = threading.Lock()


def _local_key(path: str, sha256: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, sha256)


def _restage_hint(staged_dir: str) -> str:
    return f"re-stage it (python -m pipelines.stage --output {staged_dir} with the manifest it came from)"


def _unpack_nested(col: pa.ChunkedArray | pa.Array, width: int) -> tuple[np.ndarray, np.ndarray]:
    """list<fixed_size_list<x, width>> -> (flat (total, width) numpy, per-row counts), without Python
    floats; handles sliced / multi-chunk arrays."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    counts = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    inner = arr.flatten()  # respects offsets and slicing
    values = inner.flatten().to_numpy(zero_copy_only=False)
    return values.reshape(-1, width), counts


class StagedDataset:
    """Staged images and captions of one staged directory: a local path, or a URL (gs://...) read through
    ``files`` (the pipelines pass Beam's; the default, LOCAL_FILES, refuses URLs)."""

    def __init__(self, staged_dir: str, files: Optional[FileAccess] = None):
        self.root = staged_dir
        self.files = files or LOCAL_FILES
        if self._file_exists(join_path(staged_dir, INCOMPLETE_FILE)):
            raise StagedDataError(f"{staged_dir} holds {INCOMPLETE_FILE}: a staging run into it stopped before it "
                                  f"finished, so its shards may mix two runs; {_restage_hint(staged_dir)}")
        path = join_path(staged_dir, SUMMARY_FILE)
        try:
            with self._open(path) as f:
                self.summary: dict = json.loads(f.read())
        except FileNotFoundError:
            raise StagedDataError(f"{path} not found: {staged_dir!r} is not a staged directory (run "
                                  f"`python -m pipelines.stage --output {staged_dir}` first)") from None
        except (OSError, ValueError) as exc:
            raise StagedDataError(f"cannot read {path}: {exc}") from None
        if not self.summary.get("complete"):
            raise StagedDataError(f"{path} is from an unfinished staging run; rerun pipelines.stage")
        try:
            self.feature_dim: int = int(self.summary["feature_dim"])
            self.feature_format: str = self.summary.get("feature_format", "parquet")
            self.feature_dtype: str = self.summary.get("feature_dtype", "float32")
            self.collections: list[str] = sorted(self.summary["collections"])
            #: the fingerprint of the backbone that made the features from pixels; "" = extracted elsewhere
            self.image_backbone: str = str((self.summary.get("image_backbone") or {}).get("fingerprint", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise StagedDataError(f"{path} lacks a required field: {exc}") from None
        # rel path -> the sha256 the stager recorded (hand-made folders without checksums are read unchecked)
        self._sha256: dict[str, str] = {}
        for coll in self.summary["collections"].values():
            for kind in ("images", "captions"):
                block = coll.get(kind) or {}
                for shard in list(block.get("shards") or []) + list(block.get("feature_shards") or []):
                    if shard.get("sha256"):
                        self._sha256[shard["name"]] = shard["sha256"]
        self._verified: set[str] = set()

    def __repr__(self) -> str:
        return f"StagedDataset({self.root!r}, collections={self.collections}, F={self.feature_dim})"

    def images_cut_below(self, regions: int) -> Optional[int]:
        """How many staged images the stager's region cap cut to fewer than ``regions`` regions (0 when its cap
        is at least that); None when the summary predates the per-collection cap counts (unknown)."""
        cap = int(self.summary.get("max_regions") or schema.DEFAULT_MAX_REGIONS)
        if cap >= regions:
            return 0
        counts = [((c.get("images") or {}).get("region_cap") or {}).get("capped_images")
                  for c in self.summary["collections"].values()]
        return None if any(n is None for n in counts) else sum(int(n) for n in counts)

    def content_sha256(self, kind: str, collection: str) -> str:
        """sha256 over the (name, sha256) of one collection's staged shards of ``kind`` ("images", with their
        HDF5 feature shards, or "captions"): what an artifact made from them records, and what its consumers
        compare (re-staging byte-identical shards keeps it; summary.json itself records timings). A shard the
        summary lists without a checksum is hashed here."""
        if collection not in self.summary["collections"]:
            raise StagedDataError(f"collection {collection!r} is not staged in {self.root} (have {self.collections})")
        block = self.summary["collections"][collection].get(kind) or {}
        parts = []
        for shard in list(block.get("shards") or []) + list(block.get("feature_shards") or []):
            sha = shard.get("sha256")
            if not sha:
                with self._open(join_path(self.root, shard["name"])) as f:
                    sha = hashlib.sha256(f.read()).hexdigest()
            parts.append(f"{shard['name']}:{sha}")
        return hashlib.sha256("\n".join(sorted(parts)).encode("utf-8")).hexdigest()

    def shard_sha256(self, rel: str) -> str:
        """The sha256 of one staged shard: the one summary.json records, else hashed here."""
        if rel not in self._sha256:
            with self._open(join_path(self.root, rel)) as f:
                self._sha256[rel] = hashlib.sha256(f.read()).hexdigest()
        return self._sha256[rel]

    def _file_exists(self, path: str) -> bool:
        return os.path.exists(path) if not is_url(path) else bool(self.files.exists(path))

    def _verify(self, rel: str, data: Optional[bytes] = None) -> None:
        """Checks a shard against the sha256 summary.json records for it, the first time it is read (``data``:
        its bytes, when the caller already holds them)."""
        expected = self._sha256.get(rel)
        if expected is None or rel in self._verified:
            return
        path = join_path(self.root, rel)
        key = None if is_url(path) else _local_key(path, expected)
        if key is None or key not in _VERIFIED_LOCAL:
            digest = hashlib.sha256(data) if data is not None else hashlib.sha256()
            if data is None:
                with self._open(path) as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
            if digest.hexdigest() != expected:
                raise StagedDataError(f"{path} does not match the sha256 that {SUMMARY_FILE} records for it: "
                                      f"{self.root} mixes shards of different staging runs (or a shard was "
                                      f"modified); {_restage_hint(self.root)}")
            if key is not None:
                with _VERIFIED_LOCK:
                    _VERIFIED_LOCAL.add(key)
        self._verified.add(rel)

    def _open(self, path: str) -> BinaryIO:
        return open(path, "rb") if not is_url(path) else self.files.open(path)

    # ------------------------------------------------------------------------------- shard lists
    def _colls(self, collection: Optional[str]) -> list[str]:
        if collection is None:
            return self.collections
        if collection not in self.summary["collections"]:
            raise KeyError(f"collection {collection!r} is not staged here (have {self.collections})")
        return [collection]

    def _shards(self, kind: str, collection: Optional[str]) -> list[str]:
        out = []
        for c in self._colls(collection):
            out += [s["name"] for s in self.summary["collections"][c][kind]["shards"]]
        return out

    def _read_parquet(self, rel: str, columns: Optional[list[str]] = None, filters=None) -> pa.Table:
        path = join_path(self.root, rel)
        try:
            if is_url(path):  # one remote read serves the checksum and the table
                with self._open(path) as f:
                    data = f.read()
                self._verify(rel, data)
                return pq.read_table(io.BytesIO(data), columns=columns, filters=filters)
            self._verify(rel)
            return pq.read_table(path, columns=columns, filters=filters)
        except FileNotFoundError:
            raise StagedDataError(f"shard {path} listed in summary.json is missing; rerun pipelines.stage") from None

    @staticmethod
    def _split_filter(split: Optional[str]):
        return [("split", "=", split)] if split is not None else None

    # ------------------------------------------------------------------ one shard at a time (pipelines)
    def shard_names(self, kind: str, collection: Optional[str] = None) -> list[str]:
        """Staged shard paths (relative to the staged dir) of ``kind`` ("images" or "captions")."""
        return self._shards(kind, collection)

    def read_image_shard(self, rel: str, item_ids: Optional[np.ndarray] = None, split: Optional[str] = None,
                         dtype=np.float32) -> Optional[schema.ImageTable]:
        """The images of one staged image shard (all, or those in sorted ``item_ids``), sorted by id; None if
        none match. Parquet and HDF5 layouts alike; lets a Beam worker read only its own shard."""
        return self._shard_images(rel, item_ids, split, dtype)

    def read_shard_columns(self, rel: str, columns: Sequence[str], split: Optional[str] = None) -> pa.Table:
        """Selected non-feature columns of one staged shard (captions, or image metadata such as item_id)."""
        return self._read_parquet(rel, list(columns), self._split_filter(split))

    # ------------------------------------------------------------------------------------ tables
    def images_meta(self, collection: Optional[str] = None, split: Optional[str] = None) -> pd.DataFrame:
        """One row per image, every image column except boxes/features, sorted by item_id."""
        tables = [self._read_parquet(s, _META_COLUMNS, self._split_filter(split))
                  for s in self._shards("images", collection)]
        if not tables:
            return pd.DataFrame({c: [] for c in _META_COLUMNS})
        return pa.concat_tables(tables).sort_by("item_id").to_pandas().reset_index(drop=True)

    def captions(self, collection: Optional[str] = None, split: Optional[str] = None) -> pd.DataFrame:
        """One row per caption (schema.CAPTION_COLUMNS), sorted by caption_id."""
        tables = [self._read_parquet(s, list(schema.CAPTION_COLUMNS), self._split_filter(split))
                  for s in self._shards("captions", collection)]
        if not tables:
            return pd.DataFrame({c: [] for c in schema.CAPTION_COLUMNS})
        return pa.concat_tables(tables).sort_by("caption_id").to_pandas().reset_index(drop=True)

    def gold(self, collection: Optional[str] = None, split: Optional[str] = None,
             captions: Optional[Collection[int]] = None, images: Optional[Collection[int]] = None,
             lang: Optional[str] = None) -> tuple[dict[int, int], dict[int, frozenset[int]]]:
        """(caption_id -> its image's item_id, image item_id -> frozenset of its caption ids). Freshly built
        on every call: callers may modify the dicts without affecting anybody else.

        Reads two id columns per caption shard (never the text). ``captions`` / ``images`` keep only those
        keys in the first / second dict (the queries a run ranked): the dicts are then as small as the query
        set, whatever the collection size. ``lang``: the captions of that language only (the per-language
        evaluation of a multilingual collection)."""
        parts = [self._read_parquet(s, ["caption_id", "image_item_id", "lang"], self._split_filter(split))
                 for s in self._shards("captions", collection)]
        if lang is not None:
            parts = [p.filter(pc.equal(p.column("lang"), lang)) for p in parts]
        cap_ids = np.concatenate([p.column("caption_id").to_numpy() for p in parts]).astype(np.int64) if parts \
            else np.zeros(0, dtype=np.int64)
        img_ids = np.concatenate([p.column("image_item_id").to_numpy() for p in parts]).astype(np.int64) if parts \
            else np.zeros(0, dtype=np.int64)
        order = np.argsort(cap_ids, kind="stable")  # caption_id order, as captions() returns them
        cap_ids, img_ids = cap_ids[order], img_ids[order]
        keep_c = np.ones(len(cap_ids), bool) if captions is None else np.isin(cap_ids, np.fromiter(captions, np.int64))
        cap2img = {int(c): int(i) for c, i in zip(cap_ids[keep_c], img_ids[keep_c])}
        keep_i = np.ones(len(cap_ids), bool) if images is None else np.isin(img_ids, np.fromiter(images, np.int64))
        groups: dict[int, list[int]] = {}
        for c, i in zip(cap_ids[keep_i].tolist(), img_ids[keep_i].tolist()):
            groups.setdefault(i, []).append(c)
        return cap2img, {i: frozenset(cs) for i, cs in groups.items()}

    # ------------------------------------------------------------------------------------ images
    def _shard_images(self, rel: str, wanted: Optional[np.ndarray], split: Optional[str], dtype
                      ) -> Optional[schema.ImageTable]:
        """The images of one image shard (all, or those whose id is in sorted ``wanted``), sorted by id."""
        if self.feature_format == "hdf5":
            meta = self._read_parquet(rel, ["item_id", "feature_shard", "feature_row"], self._split_filter(split))
        else:
            meta = self._read_parquet(rel, ["item_id"], self._split_filter(split))
        ids = meta.column("item_id").to_numpy()
        keep = np.ones(len(ids), dtype=bool) if wanted is None else np.isin(ids, wanted)
        if not keep.any():
            return None
        if self.feature_format == "hdf5":
            return self._hdf5_images(meta.filter(pa.array(keep)), dtype)
        table = self._read_parquet(rel, ["item_id", "split", "features", "boxes"], self._split_filter(split))
        if not keep.all():
            table = table.filter(pa.array(keep))
        feats, counts = _unpack_nested(table.column("features"), self.feature_dim)
        boxes, _ = _unpack_nested(table.column("boxes"), schema.BOX_DIM)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return schema.ImageTable(table.column("item_id").to_numpy().astype(np.int64), offsets,
                                 feats.astype(dtype, copy=False), boxes.astype(np.float32, copy=False))

    def _hdf5_images(self, meta: pa.Table, dtype) -> schema.ImageTable:
        import h5py

        shard_names = meta.column("feature_shard").to_pylist()
        rows = meta.column("feature_row").to_numpy()
        ids = meta.column("item_id").to_numpy().astype(np.int64)
        feats_out, boxes_out, counts = [], [], np.zeros(len(ids), dtype=np.int64)
        for shard in sorted(set(shard_names)):
            sel = np.flatnonzero(np.array([s == shard for s in shard_names]))
            path = join_path(self.root, shard)
            try:
                self._verify(shard)
                handle = self._open(path)
            except FileNotFoundError:
                raise StagedDataError(f"feature shard {path} is missing; rerun pipelines.stage") from None
            with handle, h5py.File(handle, "r") as f:
                offsets = f[schema.H5_OFFSETS][:]
                h5_ids = f[schema.H5_ITEM_ID][:]
                if not np.array_equal(h5_ids[rows[sel]], ids[sel]):
                    raise StagedDataError(f"{path}: item ids do not match the Parquet meta rows")
                whole = len(sel) * 2 >= len(h5_ids)  # mostly wanted: one contiguous read is cheaper
                all_f = f[schema.H5_FEATURES][:] if whole else None
                all_b = f[schema.H5_BOXES][:] if whole else None
                for j in sel:
                    a, b = int(offsets[rows[j]]), int(offsets[rows[j] + 1])
                    counts[j] = b - a
                    feats_out.append((j, all_f[a:b] if whole else f[schema.H5_FEATURES][a:b]))
                    boxes_out.append((j, all_b[a:b] if whole else f[schema.H5_BOXES][a:b]))
        feats_out.sort(key=lambda t: t[0])
        boxes_out.sort(key=lambda t: t[0])
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        feats = np.concatenate([a for _, a in feats_out]) if feats_out else np.zeros((0, self.feature_dim))
        boxes = np.concatenate([a for _, a in boxes_out]) if boxes_out else np.zeros((0, schema.BOX_DIM))
        return schema.ImageTable(ids, offsets, feats.astype(dtype, copy=False), boxes.astype(np.float32, copy=False))

    def _concat(self, parts: list[schema.ImageTable], dtype) -> schema.ImageTable:
        if not parts:
            return schema.ImageTable(np.zeros(0, np.int64), np.zeros(1, np.int64),
                                     np.zeros((0, self.feature_dim), dtype), np.zeros((0, schema.BOX_DIM), np.float32))
        ids = np.concatenate([p.item_ids for p in parts])
        counts = np.concatenate([p.num_boxes() for p in parts])
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return schema.ImageTable(ids, offsets, np.concatenate([p.features for p in parts]),
                                 np.concatenate([p.boxes for p in parts]))

    def load_images(self, item_ids: Optional[Sequence[int]] = None, collection: Optional[str] = None,
                    split: Optional[str] = None, dtype=np.float32) -> schema.ImageTable:
        """Images (features + normalised boxes) as one ImageTable: in ``item_ids`` order when given (every id
        must exist, else KeyError naming the missing ones), otherwise sorted by item_id. Features are
        returned as ``dtype`` (float32 by default, also when stored as float16)."""
        wanted = None
        if item_ids is not None:
            req = np.asarray(list(item_ids), dtype=np.int64)
            wanted = np.unique(req)
        parts = [p for s in self._shards("images", collection)
                 if (p := self._shard_images(s, wanted, split, dtype)) is not None]
        table = self._concat(parts, dtype)
        # Drop the per-shard arrays (views of Arrow buffers) and hand Arrow's freed memory back to the OS
        # before the reordering copy below: otherwise the peak is about 3x the collection
        # (docs/log/PERFORMANCE-2026-11.md).
        del parts
        pa.default_memory_pool().release_unused()
        pos = table.position_of()
        if item_ids is None:
            order = np.argsort(table.item_ids, kind="stable")
        else:
            missing = [int(i) for i in wanted if int(i) not in pos]
            if missing:
                raise KeyError(f"{len(missing)} item_id(s) not staged (collection={collection}, split={split}): "
                               f"{missing[:10]}")
            order = np.array([pos[int(i)] for i in req], dtype=np.int64)
        out = table.take(order)
        out.meta = {"feature_dim": self.feature_dim, "collection": collection, "split": split}
        return out

    def iter_image_batches(self, batch_size: int, collection: Optional[str] = None,
                           split: Optional[str] = None, dtype=np.float32) -> Iterator[schema.ImageTable]:
        """ImageTables of ``batch_size`` images (the last may be smaller), streamed one shard at a time:
        memory stays around one shard. Order: shard by shard, sorted by item_id within a shard."""
        if batch_size <= 0:
            raise ValueError("batch_size must be positive")
        pending: list[schema.ImageTable] = []  # leftovers smaller than one batch
        for rel in self._shards("images", collection):
            part = self._shard_images(rel, None, split, dtype)
            if part is None:
                continue
            if pending:
                part = self._concat(pending + [part], dtype)
                pending = []
            start = 0
            while len(part) - start >= batch_size:
                yield _slice(part, start, start + batch_size)
                start += batch_size
            if start < len(part):
                pending = [_slice(part, start, len(part))]
        if pending:
            yield pending[0]


def _slice(table: schema.ImageTable, a: int, b: int) -> schema.ImageTable:
    """Images a:b of a table (views into its arrays, offsets rebased)."""
    lo, hi = int(table.offsets[a]), int(table.offsets[b])
    return schema.ImageTable(table.item_ids[a:b], table.offsets[a:b + 1] - lo, table.features[lo:hi],
                             table.boxes[lo:hi], dict(table.meta))


def to_torch(table: schema.ImageTable) -> dict:
    """The table's arrays as torch tensors sharing memory (item_ids, offsets, features, boxes)."""
    import torch

    return {"item_ids": torch.from_numpy(np.ascontiguousarray(table.item_ids)),
            "offsets": torch.from_numpy(np.ascontiguousarray(table.offsets)),
            "features": torch.from_numpy(np.ascontiguousarray(table.features)),
            "boxes": torch.from_numpy(np.ascontiguousarray(table.boxes))}

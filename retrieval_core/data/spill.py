"""The stager's spill: each read task's staged rows (and an image task's regions) written once to a temporary
HDF5 file, so the staging pipeline shuffles only (id, row number) references into it.

Beam's local runners keep a shuffle's whole input in memory, so shuffling region features or staged rows grows
with the collection (docs/ARCHITECTURE.md, the stage job's memory). A shard writer reads back the rows (and
regions) of its own ids: memory per worker is one task's write buffer plus one shard, whatever the collection
size.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterable, Optional, Sequence

import h5py
import numpy as np

from . import schema
from .outputs import FailSafeFile, as_write_failure

K_SPILL = "_spill"  # spill file path
K_SPILL_AT = "_spill_at"  # first region row of this image in that file


class FeatureSpill:
    """Append-only HDF5 file of one read task's staged rows (JSON, ``rows``) and, for images, region features
    (``feature_dtype``) and boxes (float32), written in blocks so a task of any size streams through bounded
    memory. :meth:`append` spills an image's regions and returns the row that points to them; :meth:`add_row`
    stores a row and returns its number, which :func:`load_spilled_rows` reads back."""

    def __init__(self, path: str, spill_name: str, feature_dim: int, feature_dtype: str = "float32",
                 flush_regions: int = 8192, flush_rows: int = 512, compression: Optional[str] = None):

        self.name = spill_name  # what the reference rows record (may be a remote path)
        self._dtype = np.float16 if feature_dtype == "float16" else np.float32
        try:
            self._raw = FailSafeFile(path)  # h5py crashes when a handle whose write failed is freed: never let it
        except OSError as exc:
            raise (as_write_failure(exc, path) or exc) from None
        self._f = h5py.File(self._raw, "w")
        # Small chunks: a reader pulls one image (~10-50 regions) at a time, and HDF5 reads whole chunks.
        self._feats = self._f.create_dataset("features", (0, feature_dim), dtype=self._dtype,
                                             maxshape=(None, feature_dim), chunks=(32, feature_dim),
                                             compression=compression)  # "lzf": a big collection's disk peak
        self._boxes = self._f.create_dataset("boxes", (0, schema.BOX_DIM), dtype=np.float32,
                                             maxshape=(None, schema.BOX_DIM), chunks=(256, schema.BOX_DIM))
        self._rows = self._f.create_dataset("rows", (0,), dtype=h5py.string_dtype("utf-8"), maxshape=(None,),
                                            chunks=(64,))
        self._buf_f: list[np.ndarray] = []
        self._buf_b: list[np.ndarray] = []
        self._buf_rows: list[str] = []
        self._buffered = 0
        self._flush_regions = flush_regions
        self._flush_rows = flush_rows
        self.regions = 0  # regions appended so far (flushed or not)
        self.rows = 0  # rows added so far (flushed or not)

    def append(self, row: dict) -> dict:
        at = self.regions
        self._buf_f.append(np.asarray(row["features"], dtype=self._dtype))
        self._buf_b.append(np.asarray(row["boxes"], dtype=np.float32))
        n = int(row["features"].shape[0])
        self.regions += n
        self._buffered += n
        if self._buffered >= self._flush_regions:
            self._flush()
        ref = {k: v for k, v in row.items() if k not in ("features", "boxes")}
        ref[K_SPILL], ref[K_SPILL_AT] = self.name, at
        return ref

    def add_row(self, row: dict) -> int:
        """Store a row without arrays (JSON: ints, strings, None round-trip exactly); returns its number."""

        self._buf_rows.append(json.dumps(row, separators=(",", ":"), sort_keys=True))
        self.rows += 1
        if len(self._buf_rows) >= self._flush_rows:
            self._flush_row_block()
        return self.rows - 1

    def _flush(self) -> None:
        if not self._buf_f:
            return
        start = self._feats.shape[0]
        for ds, buf in ((self._feats, self._buf_f), (self._boxes, self._buf_b)):
            block = np.concatenate(buf)
            ds.resize(start + len(block), axis=0)
            ds[start:start + len(block)] = block
        self._buf_f, self._buf_b, self._buffered = [], [], 0
        self._check()

    def _flush_row_block(self) -> None:
        if not self._buf_rows:
            return
        start = self._rows.shape[0]
        self._rows.resize(start + len(self._buf_rows), axis=0)
        self._rows[start:] = self._buf_rows
        self._buf_rows = []
        self._check()

    def _check(self) -> None:
        """A write that failed (disk full, read-only): close and delete the file (a retried task writes it
        anew), then raise the kept error (OutputWriteFailed names the cause and the path)."""
        if self._raw.error is None:
            return
        self._f.close()
        self._raw.close()
        with contextlib.suppress(OSError):
            os.remove(self._raw.path)
        self._raw.raise_error()

    def close(self) -> None:
        self._flush()
        self._flush_row_block()
        self._f.close()
        self._raw.close()
        self._check()


def load_spilled_rows(refs: Iterable[tuple[str, int]], open_file=None) -> list[dict]:
    """The rows ``refs`` = [(spill file, row number)] name, in that order; each file is opened once and read in
    row order. ``open_file(name)`` returns an open ``h5py.File`` (default: opens the local path)."""

    import h5py

    refs = list(refs)
    by_file: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(refs):
        by_file.setdefault(name, []).append(i)
    out: list = [None] * len(refs)
    for name, idx in sorted(by_file.items()):
        idx = sorted(idx, key=lambda j: refs[j][1])
        at = [int(refs[j][1]) for j in idx]
        with (open_file(name) if open_file is not None else h5py.File(name, "r")) as f:
            ds = f["rows"]
            # h5py fancy indexing wants strictly increasing rows: read each distinct row once
            uniq = sorted(set(at))
            texts = ds[uniq] if len(uniq) > 1 else [ds[uniq[0]]]
            by_row = {r: json.loads(t.decode("utf-8") if isinstance(t, bytes) else t) for r, t in zip(uniq, texts)}
        for j, r in zip(idx, at):
            out[j] = dict(by_row[r])
    return out


def load_spilled(rows: Sequence[dict], open_file=None) -> list[dict]:
    """Rows with ``features``/``boxes`` restored from their spill files (rows that still carry their arrays
    pass unchanged). ``open_file(name)`` returns an open ``h5py.File`` (default: opens the local path); each
    file is opened once per call and read in region order."""

    by_file: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if K_SPILL in r:
            by_file.setdefault(r[K_SPILL], []).append(i)
    out = list(rows)
    for name, idx in by_file.items():
        with (open_file(name) if open_file is not None else h5py.File(name, "r")) as f:
            for i in sorted(idx, key=lambda j: rows[j][K_SPILL_AT]):
                r = rows[i]
                a, b = int(r[K_SPILL_AT]), int(r[K_SPILL_AT]) + int(r["num_boxes"])
                restored = {k: v for k, v in r.items() if k not in (K_SPILL, K_SPILL_AT)}
                restored["features"] = f["features"][a:b]
                restored["boxes"] = f["boxes"][a:b]
                out[i] = restored
    return out

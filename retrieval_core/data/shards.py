"""Staged shards as bytes: Parquet image shards (features inline, or their meta rows beside an HDF5 feature shard)
and Parquet caption shards, rows sorted by id.

The encoders return bytes, so a Beam DoFn can write them atomically through FileSystems. Encodings are
deterministic (same rows -> same bytes), which is what lets a rerun recognise a finished shard by its sha256.
"""
from __future__ import annotations

import io
import math
from typing import Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import schema


def _packed(rows: Sequence[dict], key: str, width: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate each row's (n_i, width) array into one (total, width) buffer + (n+1,) offsets."""
    counts = np.fromiter((r[key].shape[0] for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.empty((int(offsets[-1]), width), dtype=dtype)
    for r, a, b in zip(rows, offsets[:-1], offsets[1:]):
        flat[a:b] = r[key]
    return flat, offsets


def _nested_fixed(flat: np.ndarray, offsets: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """list<fixed_size_list<value, width>> built from one flat numpy buffer (no Python floats)."""
    width = flat.shape[1]
    values = pa.array(flat.reshape(-1), type=value_type)
    inner = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), inner)


def _sorted(rows: Iterable[dict], key: str) -> list[dict]:
    return sorted(rows, key=lambda r: int(r[key]))


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    # no statistics on the big nested columns: they cost time and say nothing useful
    pq.write_table(table, sink, compression="zstd", write_statistics=["item_id", "caption_id", "image_item_id"],
                   use_dictionary=schema.dictionary_columns(table.schema))
    return sink.getvalue()


def _image_meta_columns(rows: Sequence[dict]) -> dict:
    return {
        "item_id": pa.array([int(r["item_id"]) for r in rows], pa.int64()),
        "collection": pa.array([r["collection"] for r in rows], pa.string()),
        "source_id": pa.array([r["source_id"] for r in rows], pa.string()),
        "split": pa.array([r["split"] for r in rows], pa.string()),
        "image_w": pa.array([int(r["image_w"]) for r in rows], pa.int32()),
        "image_h": pa.array([int(r["image_h"]) for r in rows], pa.int32()),
        "num_boxes": pa.array([int(r["num_boxes"]) for r in rows], pa.int32()),
    }


def image_shard_parquet(rows: Iterable[dict], feature_dim: int, feature_dtype: str = "float32") -> bytes:
    """One Parquet image shard (features inline), rows sorted by item_id."""
    rows = _sorted(rows, "item_id")
    sch = schema.image_schema(feature_dim, feature_dtype)
    np_dtype = np.float16 if feature_dtype == "float16" else np.float32
    feats, offsets = _packed(rows, "features", feature_dim, np_dtype)
    boxes, _ = _packed(rows, "boxes", schema.BOX_DIM, np.float32)
    cols = _image_meta_columns(rows)
    cols["boxes"] = _nested_fixed(boxes, offsets, pa.float32())
    cols["features"] = _nested_fixed(feats, offsets, sch.field("features").type.value_type.value_type)
    cols["feature_shard"] = pa.nulls(len(rows), pa.string())
    cols["feature_row"] = pa.nulls(len(rows), pa.int64())
    return _parquet_bytes(pa.table([cols[c] for c in schema.IMAGE_COLUMNS], schema=sch))


def image_shard_hdf5(rows: Iterable[dict], feature_dtype: str = "float32", *, feature_dim: Optional[int] = None,
                     feature_shard: str = "") -> tuple[bytes, bytes]:
    """(HDF5 feature shard bytes, Parquet meta shard bytes) for one shard, rows sorted by item_id.

    The HDF5 file holds ``schema.H5_ITEM_ID`` (n,), ``H5_OFFSETS`` (n+1,), ``H5_FEATURES`` (total, F) and
    ``H5_BOXES`` (total, 6); the meta rows point at it by ``feature_shard`` (its path relative to the
    staged dir) and ``feature_row``, with null boxes/features. Built in memory (no temp file), with
    object timestamps off so that the same rows always give the same bytes.
    """
    import h5py

    rows = _sorted(rows, "item_id")
    np_dtype = np.float16 if feature_dtype == "float16" else np.float32
    if feature_dim is None:
        if not rows:
            raise ValueError("feature_dim is needed for an empty HDF5 shard")
        feature_dim = int(rows[0]["features"].shape[1])
    feats, offsets = _packed(rows, "features", feature_dim, np_dtype)
    boxes, _ = _packed(rows, "boxes", schema.BOX_DIM, np.float32)
    item_ids = np.array([int(r["item_id"]) for r in rows], dtype=np.int64)

    buf = io.BytesIO()
    with h5py.File(buf, "w", libver="latest", track_order=False) as f:
        f.attrs["schema_version"] = schema.SCHEMA_VERSION
        f.attrs["feature_dim"] = int(feature_dim)
        f.attrs["feature_dtype"] = feature_dtype
        for name, arr in ((schema.H5_ITEM_ID, item_ids), (schema.H5_OFFSETS, offsets),
                          (schema.H5_FEATURES, feats), (schema.H5_BOXES, boxes)):
            f.create_dataset(name, data=arr, track_times=False)
    h5_bytes = buf.getvalue()

    sch = schema.image_schema(feature_dim, feature_dtype)
    cols = _image_meta_columns(rows)
    cols["boxes"] = pa.nulls(len(rows), sch.field("boxes").type)
    cols["features"] = pa.nulls(len(rows), sch.field("features").type)
    cols["feature_shard"] = pa.array([feature_shard] * len(rows), pa.string())
    cols["feature_row"] = pa.array(np.arange(len(rows), dtype=np.int64), pa.int64())
    meta = _parquet_bytes(pa.table([cols[c] for c in schema.IMAGE_COLUMNS], schema=sch))
    return h5_bytes, meta


def caption_shard_parquet(rows: Iterable[dict]) -> bytes:
    """One caption shard, rows sorted by caption_id."""
    rows = _sorted(rows, "caption_id")
    cols = {
        "caption_id": pa.array([int(r["caption_id"]) for r in rows], pa.int64()),
        "image_item_id": pa.array([int(r["image_item_id"]) for r in rows], pa.int64()),
        "collection": pa.array([r["collection"] for r in rows], pa.string()),
        "source_id": pa.array([r["source_id"] for r in rows], pa.string()),
        "text": pa.array([r["text"] for r in rows], pa.string()),
        "lang": pa.array([r["lang"] for r in rows], pa.string()),
        "split": pa.array([r["split"] for r in rows], pa.string()),
    }
    return _parquet_bytes(pa.table([cols[c] for c in schema.CAPTION_COLUMNS], schema=schema.CAPTION_SCHEMA))


def num_shards_for(count: int, images_per_shard: int) -> int:
    return max(1, math.ceil(max(int(count), 0) / max(int(images_per_shard), 1)))

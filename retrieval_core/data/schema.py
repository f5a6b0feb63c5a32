"""The one schema every stage shares: ids, column names, dtypes, Arrow schemas and in-memory containers.

Every pipeline stage (stage -> encode -> build_index -> rerank -> evaluate) reads and writes the tables
defined here, so a column is renamed in exactly one place.

Ids
---
Every image and caption gets a deterministic int64 ``item_id`` derived from ``(collection, kind,
source_id)`` with a 64-bit BLAKE2b hash (top bit cleared, so ids are non-negative int64). Ids never depend
on row positions or file order: a missing shard cannot shift anybody's id (docs/CONVENTIONS.md#id-namespaces).
The 20k distractor benchmark mixes COCO integer ids, Flickr file names and CC line numbers; namespacing by
collection keeps them apart, and :class:`IdRegistry` detects the (astronomically rare) hash collision.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = "1"
#: A staged folder's summary: its shards, their sha256 and counts (pipelines.stage writes it last).
SUMMARY_FILE = "summary.json"

#: Box encoding of every staged region: normalised [x1/W, y1/H, x2/W, y2/H, w/W, h/H] (OSCAR convention).
BOX_DIM = 6
#: Default region cap (OSCAR's max image sequence length).
DEFAULT_MAX_REGIONS = 50
#: Default text cap in word pieces, [CLS] and [SEP] included (OSCAR / MMT).
DEFAULT_MAX_TEXT_TOKENS = 70

KIND_IMAGE = "image"
KIND_CAPTION = "caption"

#: Embedding modalities (encode, build_index, rerank) and the staged kind each is encoded from.
MODALITY_IMAGE = KIND_IMAGE
MODALITY_TEXT = "text"
MODALITIES = (MODALITY_IMAGE, MODALITY_TEXT)
STAGED_KIND = {MODALITY_IMAGE: "images", MODALITY_TEXT: "captions"}

# Parquet schema-metadata keys (bytes, as Arrow stores them).
META_SCHEMA_VERSION = b"rr.schema_version"
META_FEATURE_DIM = b"rr.feature_dim"
META_EMBEDDING_DIM = b"rr.embedding_dim"
META_FEATURE_DTYPE = b"rr.feature_dtype"


# --------------------------------------------------------------------------------------------- ids
def make_item_id(collection: str, kind: str, source_id: str) -> int:
    """Deterministic non-negative int64 id of one image or caption.

    >>> make_item_id("coco", "image", "391895") == make_item_id("coco", "image", "391895")
    True
    """
    if kind not in (KIND_IMAGE, KIND_CAPTION):
        raise ValueError(f"kind must be {KIND_IMAGE!r} or {KIND_CAPTION!r}, got {kind!r}")
    key = f"{collection}\x1f{kind}\x1f{source_id}".encode("utf-8")
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF


def caption_source_id(image_source_id: str, caption_key: str | int) -> str:
    """Source id of a caption: its image's source id plus the caption's own key within the source
    (a sentence id where the format has one, else its index among the image's captions)."""
    return f"{image_source_id}#{caption_key}"


class IdCollisionError(ValueError):
    pass


class IdRegistry:
    """Remembers which (collection, kind, source_id) produced each item_id and reports collisions."""

    def __init__(self) -> None:
        self._owner: dict[int, tuple[str, str, str]] = {}
        self.collisions: list[tuple[int, tuple[str, str, str], tuple[str, str, str]]] = []

    def add(self, collection: str, kind: str, source_id: str) -> int:
        item_id = make_item_id(collection, kind, source_id)
        key = (collection, kind, source_id)
        owner = self._owner.setdefault(item_id, key)
        if owner != key:
            self.collisions.append((item_id, owner, key))
        return item_id

    def check(self) -> None:
        if self.collisions:
            lines = [f"  {i}: {a} vs {b}" for i, a, b in self.collisions[:20]]
            raise IdCollisionError(f"{len(self.collisions)} item_id collision(s):\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------ Arrow schemas
# Images (one row per image). Features live either inline (Parquet) or in HDF5 shards (then
# feature_shard/feature_row point at them and boxes/features are null).
#: The int64 id column of staged images, embedding shards and id lists (``pipelines.build_index --ids``).
ITEM_ID = "item_id"

IMAGE_COLUMNS = (
    "item_id", "collection", "source_id", "split", "image_w", "image_h", "num_boxes",
    "boxes", "features", "feature_shard", "feature_row",
)
CAPTION_COLUMNS = ("caption_id", "image_item_id", "collection", "source_id", "text", "lang", "split")
EMBEDDING_COLUMNS = ("item_id", "embedding")
RANKING_COLUMNS = ("direction", "query_id", "rank", "item_id", "be_rank", "be_score", "ce_score", "final_score")
#: Version of the rankings table and of pipelines.rerank's rankings_manifest.json, apart from SCHEMA_VERSION
#: (staged data, embeddings, indexes): 2 added ``be_rank`` and stores every query's whole BE top-n, so
#: benchmarks.evaluate can re-derive other modes, k and lam from the stored scores.
RANKINGS_SCHEMA_VERSION = "2"

DIRECTION_T2I = "t2i"  # a caption is the query, images are ranked
DIRECTION_I2T = "i2t"  # an image is the query, captions are ranked


def image_schema(feature_dim: int, feature_dtype: str = "float32") -> pa.Schema:
    """Arrow schema of the staged image table; ``feature_dim`` is also recorded in the metadata."""
    value_type = pa.float16() if feature_dtype == "float16" else pa.float32()
    fields = [
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("collection", pa.string(), nullable=False),
        pa.field("source_id", pa.string(), nullable=False),
        pa.field("split", pa.string()),
        pa.field("image_w", pa.int32()),  # 0 = unknown (OSCAR / UNITER files carry no size)
        pa.field("image_h", pa.int32()),
        pa.field("num_boxes", pa.int32(), nullable=False),
        pa.field("boxes", pa.list_(pa.list_(pa.float32(), BOX_DIM))),
        pa.field("features", pa.list_(pa.list_(value_type, feature_dim))),
        pa.field("feature_shard", pa.string()),  # HDF5 layout only: shard file name
        pa.field("feature_row", pa.int64()),  # HDF5 layout only: row in that shard's item_id/offsets
    ]
    return pa.schema(fields, metadata={
        META_SCHEMA_VERSION: SCHEMA_VERSION.encode(),
        META_FEATURE_DIM: str(feature_dim).encode(),
        META_FEATURE_DTYPE: feature_dtype.encode(),
    })


CAPTION_SCHEMA = pa.schema([
    pa.field("caption_id", pa.int64(), nullable=False),
    pa.field("image_item_id", pa.int64(), nullable=False),  # the gold image
    pa.field("collection", pa.string(), nullable=False),
    pa.field("source_id", pa.string(), nullable=False),
    pa.field("text", pa.string(), nullable=False),
    pa.field("lang", pa.string()),
    pa.field("split", pa.string()),
], metadata={META_SCHEMA_VERSION: SCHEMA_VERSION.encode()})


def embedding_schema(dim: int) -> pa.Schema:
    return pa.schema([
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32(), dim), nullable=False),
    ], metadata={META_SCHEMA_VERSION: SCHEMA_VERSION.encode(), META_EMBEDDING_DIM: str(dim).encode()})


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns a Parquet writer should dictionary-encode: the scalar ones. On float arrays (region
    features, boxes, embeddings) the writer builds a dictionary, overflows it and falls back to plain pages;
    for a 100k-benchmark image shard (~500 images x 50 regions x 1,024 float16) that made the write 1.8x and
    every read 3.5x slower at the same zstd size (measured on a 2-core AMD EPYC: 1.45 -> 0.80 s and
    0.69 -> 0.19 s per shard)."""
    return [f.name for f in schema if not pa.types.is_list(f.type) and not pa.types.is_fixed_size_list(f.type)]


RANKING_SCHEMA = pa.schema([
    pa.field("direction", pa.string(), nullable=False),  # DIRECTION_T2I or DIRECTION_I2T
    pa.field("query_id", pa.int64(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),  # 1 = best
    pa.field("item_id", pa.int64(), nullable=False),
    pa.field("be_rank", pa.int32(), nullable=False),  # 1-based position in the BE (retrieval) order
    pa.field("be_score", pa.float32()),
    pa.field("ce_score", pa.float32()),  # null outside the CE-scored BE top-k
    pa.field("final_score", pa.float32(), nullable=False),
], metadata={META_SCHEMA_VERSION: RANKINGS_SCHEMA_VERSION.encode()})

# HDF5 feature shard layout (option --feature-format hdf5): datasets of one shard file.
H5_ITEM_ID = "item_id"  # (n,) int64
H5_OFFSETS = "offsets"  # (n+1,) int64 into the two below
H5_FEATURES = "features"  # (total_boxes, F) float32 or float16
H5_BOXES = "boxes"  # (total_boxes, 6) float32


# ----------------------------------------------------------------------------- in-memory records
@dataclass
class RawImage:
    """One image as a feature-file reader yields it, before validation and normalisation.

    ``boxes`` is (N,4) pixel x1,y1,x2,y2 when ``box_format == "xyxy"`` (needs image_w/h), or (N,6)
    already normalised when ``box_format == "normalized6"``. ``confidences`` is (N,) or None.
    ``locator`` says where the record came from (file:line, file:key) for rejects.
    """
    source_id: str
    features: np.ndarray
    boxes: np.ndarray
    image_w: int = 0
    image_h: int = 0
    box_format: str = "xyxy"
    confidences: Optional[np.ndarray] = None
    num_boxes: Optional[int] = None  # as declared by the file, checked against the arrays
    split: Optional[str] = None
    locator: str = ""
    #: what decoding an image file did to it (greyscale -> RGB, EXIF rotation, ...), counted by the stager
    conversions: tuple[str, ...] = ()


@dataclass
class RawCaption:
    """One caption as a caption reader yields it. ``text`` may be bytes when the reader could not decode it
    (the stager rejects it as non-UTF-8)."""
    image_source_id: str
    text: str | bytes
    caption_key: str  # sentence id in the source, or index among the image's captions
    lang: str = "en"
    split: Optional[str] = None
    locator: str = ""


@dataclass
class Reject:
    """A record that could not be staged, with where it came from and why."""
    source: str  # source file (or collection:format for generated sources)
    locator: str  # line number, key, byte offset...
    reason: str
    kind: str = KIND_IMAGE

    def to_dict(self) -> dict:
        return {"source": self.source, "locator": self.locator, "reason": self.reason, "kind": self.kind}


@dataclass
class Skipped:
    """An image a reader left unread because the stager does not want its id (``uncaptioned_images: skip``: no
    caption names it): counted as skipped, neither staged nor rejected, and never run through a backbone."""
    source_id: str
    locator: str


@runtime_checkable
class ImageReader(Protocol):
    """What the model's batched loops and the trainer read images through: :class:`ImageTable` (in memory) and
    ``data.region_file.StreamedImages`` (read from disk by position when asked for)."""
    item_ids: np.ndarray

    def __len__(self) -> int: ...

    def num_boxes(self) -> np.ndarray: ...

    def regions(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...

    def read(self, positions: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]: ...

    def take(self, indices: Iterable[int]) -> "ImageReader": ...

    def position_of(self) -> dict[int, int]: ...


@dataclass
class ImageTable:
    """Images with variable region counts, packed CSR-style: the regions of image ``i`` are rows
    ``offsets[i]:offsets[i+1]`` of ``features`` (total, F) and ``boxes`` (total, 6)."""
    item_ids: np.ndarray  # (n,) int64
    offsets: np.ndarray  # (n+1,) int64
    features: np.ndarray  # (total, F) float32 (or float16 on disk; converted by readers on request)
    boxes: np.ndarray  # (total, 6) float32
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    def num_boxes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def regions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.features[a:b], self.boxes[a:b]

    def read(self, positions: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The regions of the images at ``positions``, in that order (views)."""
        return [self.regions(int(p)) for p in positions]

    def take(self, indices: Iterable[int]) -> "ImageTable":
        """A new table with the images at ``indices`` (positions, not ids), in that order."""
        idx = np.asarray(list(indices), dtype=np.int64)
        counts = np.diff(self.offsets)[idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx]) if len(idx) else \
            np.zeros(0, dtype=np.int64)
        return ImageTable(self.item_ids[idx].copy(), offsets, self.features[rows], self.boxes[rows], dict(self.meta))

    def position_of(self) -> dict[int, int]:
        """item_id -> position."""
        return {int(v): i for i, v in enumerate(self.item_ids)}

    @staticmethod
    def from_lists(item_ids, features_list, boxes_list, meta: Optional[dict] = None) -> "ImageTable":
        counts = np.array([len(f) for f in features_list], dtype=np.int64)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        feats = np.concatenate(features_list).astype(np.float32, copy=False)
        boxes = np.concatenate(boxes_list).astype(np.float32, copy=False)
        return ImageTable(np.asarray(item_ids, dtype=np.int64), offsets, feats, boxes, meta or {})


"""Embedding shards (Parquet, ``schema.embedding_schema(d)``) and the embeddings manifest.

Layout of an embeddings directory (written by ``pipelines.encode``)::

    embeddings_manifest.json
    embeddings/image/<collection>-00000-of-00004.parquet
    embeddings/text/<collection>-00000-of-00004.parquet

The manifest lists every shard with its row count and sha256, so a reader notices a missing, truncated or
replaced shard instead of silently returning fewer vectors. Shard ``name`` is the file name inside
``embeddings/<modality>/``.

Writing is byte-oriented (``embedding_shard_bytes``) so that Beam code can put the bytes anywhere through
FileSystems; reading accepts a local path, bytes or a binary file object. The directory readers take
``files`` (a ``paths.FileAccess``, default local): the pipelines pass ``pipelines.files.BEAM_FILES``, so an
embeddings directory can be a URL (gs://).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import BinaryIO, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from retrieval_core.data import schema
from retrieval_core.data.paths import FileAccess, is_url, join_path, read_file

EMBEDDINGS_MANIFEST = "embeddings_manifest.json"
EMBEDDINGS_SUBDIR = "embeddings"
MODALITIES = schema.MODALITIES

Source = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO]


class EmbeddingsError(ValueError):
    """A shard or manifest does not match what was recorded."""


# --------------------------------------------------------------------------------------------- shards
def embedding_table(ids: np.ndarray, vectors: np.ndarray) -> pa.Table:
    """Arrow table with ``schema.embedding_schema(d)``, built from flat buffers (no per-row Python)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise EmbeddingsError(f"vectors must be 2-D (n, d), got shape {vectors.shape}")
    if ids.shape != (vectors.shape[0],):
        raise EmbeddingsError(f"{ids.shape[0] if ids.ndim else ids} ids for {vectors.shape[0]} vectors")
    if not np.all(np.isfinite(vectors)):
        bad = ids[~np.isfinite(vectors).all(axis=1)][:5].tolist()
        raise EmbeddingsError(f"non-finite embedding values for item_id(s) {bad}")
    d = vectors.shape[1]
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), type=pa.float32()), d)
    return pa.Table.from_arrays([pa.array(ids, type=pa.int64()), emb], schema=schema.embedding_schema(d))


def embedding_shard_bytes(ids: np.ndarray, vectors: np.ndarray) -> bytes:
    """One embedding shard as Parquet bytes."""
    buf = io.BytesIO()
    table = embedding_table(ids, vectors)
    pq.write_table(table, buf, compression="zstd", use_dictionary=schema.dictionary_columns(table.schema))
    return buf.getvalue()


def _as_parquet_source(source: Source):
    if isinstance(source, (bytes, bytearray, memoryview)):
        return pa.BufferReader(bytes(source))
    return source


def read_embedding_shard(source: Source) -> tuple[np.ndarray, np.ndarray]:
    """``(ids (n,) int64, vectors (n, d) float32)`` of one shard."""
    table = pq.read_table(_as_parquet_source(source))
    missing = [c for c in schema.EMBEDDING_COLUMNS if c not in table.column_names]
    if missing:
        raise EmbeddingsError(f"embedding shard lacks column(s) {missing}; has {table.column_names}")
    ids_col = table.column("item_id")
    emb = table.column("embedding").combine_chunks()
    if ids_col.null_count or emb.null_count:
        raise EmbeddingsError("embedding shard has null item_id or embedding values")
    if not pa.types.is_fixed_size_list(emb.type):
        raise EmbeddingsError(f"embedding column must be fixed_size_list<float32, d>, got {emb.type}")
    d = emb.type.list_size
    flat = emb.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    ids = ids_col.to_numpy().astype(np.int64, copy=False)
    return ids, flat.reshape(len(ids), d)


def read_embedding_ids(source: Source) -> np.ndarray:
    """Only the item_id column of one shard (cheap: Parquet reads one column)."""
    table = pq.read_table(_as_parquet_source(source), columns=["item_id"])
    return table.column("item_id").to_numpy().astype(np.int64, copy=False)


def shard_relpath(modality: str, name: str) -> str:
    """Path of a shard relative to the embeddings directory (``/``-separated, FileSystems friendly)."""
    return f"{EMBEDDINGS_SUBDIR}/{modality}/{name}"


def shard_info(name: str, data: bytes, rows: int) -> dict:
    """Manifest entry of one shard written from ``data``."""
    return {"name": name, "rows": int(rows), "sha256": hashlib.sha256(data).hexdigest()}


# ------------------------------------------------------------------------------------------- manifest
def make_embeddings_manifest(model_path: str, model_sha256: str, dim: int,
                             modalities: Mapping[str, Sequence[dict]], created_by: str) -> dict:
    """The manifest dict; ``modalities`` maps "image"/"text" to their shard entries (``shard_info``)."""
    manifest = {
        "schema_version": schema.SCHEMA_VERSION,
        "model": {"path": str(model_path), "sha256": model_sha256},
        "dim": int(dim),
        "modalities": {
            m: {"shards": sorted((dict(s) for s in shards), key=lambda s: s["name"]),
                "count": int(sum(int(s["rows"]) for s in shards))}
            for m, shards in modalities.items()
        },
        "created_by": created_by,
    }
    validate_embeddings_manifest(manifest)
    return manifest


def validate_embeddings_manifest(manifest: dict, where: str = "embeddings manifest") -> dict:
    for key in ("schema_version", "model", "dim", "modalities"):
        if key not in manifest:
            raise EmbeddingsError(f"{where}: missing key {key!r}")
    for modality, entry in manifest["modalities"].items():
        if modality not in MODALITIES:
            raise EmbeddingsError(f"{where}: unknown modality {modality!r} (expected one of {MODALITIES})")
        shards = entry.get("shards")
        if not isinstance(shards, list):
            raise EmbeddingsError(f"{where}: modality {modality!r} has no shard list")
        for s in shards:
            if not {"name", "rows", "sha256"} <= set(s):
                raise EmbeddingsError(f"{where}: {modality} shard entry {s} needs name, rows and sha256")
        total = sum(int(s["rows"]) for s in shards)
        if int(entry.get("count", -1)) != total:
            raise EmbeddingsError(f"{where}: {modality} count {entry.get('count')} != sum of shard rows {total}")
    return manifest


def manifest_path(emb_dir: str) -> str:
    return join_path(emb_dir, EMBEDDINGS_MANIFEST)


def load_embeddings_manifest(emb_dir: str, files: Optional[FileAccess] = None) -> dict:
    path = manifest_path(emb_dir)
    try:
        data = read_file(path, files)
    except FileNotFoundError:
        raise EmbeddingsError(f"no {EMBEDDINGS_MANIFEST} in {emb_dir}") from None
    return validate_embeddings_manifest(json.loads(data.decode("utf-8")), where=path)


def modality_entry(manifest: dict, modality: str) -> dict:
    try:
        return manifest["modalities"][modality]
    except KeyError:
        raise EmbeddingsError(f"embeddings manifest has no {modality!r} modality; "
                              f"has {sorted(manifest['modalities'])}") from None


def verify_shard_bytes(data: bytes, entry: dict, where: str) -> None:
    """Raise when ``data`` is not the shard recorded in ``entry``."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise EmbeddingsError(f"{where}: sha256 {digest[:12]}... does not match the manifest "
                              f"({entry['sha256'][:12]}...); the shard was changed or truncated")


def iter_embedding_shards(emb_dir: str, modality: str, verify: bool = True, files: Optional[FileAccess] = None,
                          manifest: Optional[dict] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) of each shard of one modality in manifest order, one shard in memory at a time, each
    checked against the manifest (checksum, rows, dimension)."""
    manifest = manifest or load_embeddings_manifest(emb_dir, files)
    dim = int(manifest["dim"])
    for s in modality_entry(manifest, modality)["shards"]:
        path = join_path(emb_dir, shard_relpath(modality, s["name"]))
        try:
            data = read_file(path, files)
        except FileNotFoundError:
            raise EmbeddingsError(f"embedding shard listed in the manifest is missing: {path}") from None
        if verify:
            verify_shard_bytes(data, s, path)
        ids, vecs = read_embedding_shard(data)
        check_shard_contents(ids, vecs, s, dim, path)
        yield ids, vecs


def read_embeddings(emb_dir: str, modality: str, verify: bool = True, progress: bool = False,
                    files: Optional[FileAccess] = None) -> tuple[np.ndarray, np.ndarray]:
    """All shards of one modality, concatenated in manifest order, checked against the manifest
    (checksums, per-shard rows, total count, dimension, unique ids)."""
    manifest = load_embeddings_manifest(emb_dir, files)
    entry = modality_entry(manifest, modality)
    dim = int(manifest["dim"])
    shards = iter_embedding_shards(emb_dir, modality, verify, files, manifest)
    if progress:
        shards = tqdm(shards, desc=f"read {modality} embeddings", unit="shard", total=len(entry["shards"]))
    parts = list(shards)
    ids = np.concatenate([i for i, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
    vecs = np.concatenate([v for _, v in parts]) if parts else np.zeros((0, dim), dtype=np.float32)
    if len(ids) != int(entry["count"]):
        raise EmbeddingsError(f"{emb_dir}: {modality} has {len(ids)} rows, manifest says {entry['count']}")
    check_unique_ids(ids, f"{emb_dir} ({modality})")
    return ids, vecs


def check_shard_contents(ids: np.ndarray, vectors: np.ndarray, entry: dict, dim: int, where: str) -> None:
    if len(ids) != int(entry["rows"]):
        raise EmbeddingsError(f"{where}: {len(ids)} rows, manifest says {entry['rows']}")
    if vectors.shape[1] != dim:
        raise EmbeddingsError(f"{where}: embedding dim {vectors.shape[1]}, manifest says {dim}")


def check_unique_ids(ids: np.ndarray, where: str) -> None:
    uniq, counts = np.unique(ids, return_counts=True)
    if len(uniq) != len(ids):
        dup = uniq[counts > 1][:5].tolist()
        raise EmbeddingsError(f"{where}: duplicate item_id(s) {dup}")


def read_modality_ids(emb_dir: str, modality: str, files: Optional[FileAccess] = None) -> np.ndarray:
    """Ids of all shards of one modality (item_id column only; no checksum pass), in manifest order."""
    entry = modality_entry(load_embeddings_manifest(emb_dir, files), modality)
    paths = [join_path(emb_dir, shard_relpath(modality, s["name"])) for s in entry["shards"]]
    # a local shard is read by path (Parquet reads the one column); a URL's bytes come through ``files``
    parts = [read_embedding_ids(read_file(p, files) if is_url(p) else p) for p in paths]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def manifest_sha256(emb_dir: str, files: Optional[FileAccess] = None) -> str:
    """sha256 of an embeddings manifest's bytes ("missing" without one): what consumers fingerprint."""
    try:
        return hashlib.sha256(read_file(manifest_path(emb_dir), files)).hexdigest()
    except FileNotFoundError:
        return "missing"


def check_encoded_from(emb_dir: str, manifest: dict, staged, flag: str = "--embeddings",
                       staged_flag: str = "--staged") -> bool:
    """Refuse embeddings encoded from other staged shards than ``staged`` (a ``StagedDataset``): their ids could
    match while the captions and regions a CE reads are other ones (a silently wrong ranking). False when the
    manifest records no staged fingerprint (encoded before fingerprints: not checked), True when checked."""
    recorded = (manifest.get("inputs") or {}).get("staged_sha256")
    if not recorded:
        return False
    for key, sha in sorted(recorded.items()):
        modality, collection = key.split("/", 1)
        if collection not in staged.collections:
            continue  # a collection the staged folder lacks: its ids would be missing, which callers report
        here = staged.content_sha256(schema.STAGED_KIND[modality], collection)
        if here != sha:
            raise EmbeddingsError(f"{flag} {emb_dir} were encoded from other {key} shards (sha256 {sha[:12]}...) "
                                  f"than {staged_flag} {staged.root} holds ({here[:12]}...); re-encode, or pass the "
                                  f"staged folder they were encoded from")
    return True

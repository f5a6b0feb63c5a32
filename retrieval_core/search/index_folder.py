"""An index folder on disk: its manifest, its shards read and verified (whole: ``load_sharded_index``, or one
at a time: ``StreamedIndex``) and ``StreamedExact``, exact search over embedding shards behind the same interface.

Index directory layout::

    index_manifest.json      factory, d, metric, ntotal, shards [{name, rows, sha256, source...}],
                             the embeddings manifest it came from (+ its sha256), the trained index, and
                             for a sub-pool index the id list it holds (``ids``: path, sha256, count)
    trained.faiss            the trained empty index every shard started from
    shards/<name>.faiss      one serialized index per embedding shard

Readers take ``files`` (a ``paths.FileAccess``, default local): index folders (and the embeddings and id
list a manifest records) may be URLs when the caller passes one (the pipelines: Beam FileSystems). Shards are
always deserialized from bytes (``faiss.read_index`` takes local paths only).
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Callable, Iterator, Optional, Sequence

import faiss
import numpy as np

from retrieval_core.data import schema
from retrieval_core.data.paths import FileAccess, file_exists, join_path, read_file
from retrieval_core.search import embeddings, exact
from retrieval_core.search.index import (
    IndexIntegrityError,
    ShardedIndex,
    index_from_bytes,
    index_ids,
    metric_type,
    read_id_list,
    sorted_unique_ids,
)

log = logging.getLogger(__name__)

INDEX_MANIFEST = "index_manifest.json"
TRAINED_INDEX = "trained.faiss"
SHARDS_SUBDIR = "shards"


def shard_file_name(embedding_shard_name: str) -> str:
    """Index shard file for an embedding shard: same stem, ``.faiss``."""
    stem = embedding_shard_name.rsplit(".", 1)[0] if embedding_shard_name.endswith(".parquet") else embedding_shard_name
    return f"{stem}.faiss"


def make_index_manifest(factory: str, d: int, metric: str, modality: str, shards: Sequence[dict],
                        embeddings: dict, trained: dict, created_by: str, ids: Optional[dict] = None) -> dict:
    """``shards``: [{name, rows, sha256, source, source_sha256}]; ``embeddings``: {dir, manifest_sha256,
    count}; ``trained``: {name, sha256, train_sample, seed}; ``ids`` (a sub-pool index only): {path, sha256,
    count} of the id list it was built from (None: the index holds every embedding)."""
    shards = sorted((dict(s) for s in shards), key=lambda s: s["name"])
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "factory": factory, "d": int(d), "metric": metric, "modality": modality,
        "ntotal": int(sum(int(s["rows"]) for s in shards)),
        "shards": shards, "embeddings": dict(embeddings), "trained": dict(trained),
        "ids": dict(ids) if ids else None, "created_by": created_by,
    }


def load_index_manifest(index_dir: str, files: Optional[FileAccess] = None) -> dict:
    path = join_path(index_dir, INDEX_MANIFEST)
    try:
        manifest = json.loads(read_file(path, files).decode("utf-8"))
    except FileNotFoundError:
        raise IndexIntegrityError(f"no {INDEX_MANIFEST} in {index_dir}") from None
    for key in ("factory", "d", "metric", "ntotal", "shards", "embeddings"):
        if key not in manifest:
            raise IndexIntegrityError(f"{path}: missing key {key!r}")
    return manifest


def iter_index_shards(index_dir: str, manifest: dict, verify: bool = True,
                      files: Optional[FileAccess] = None) -> Iterator[faiss.Index]:
    """The shards ``manifest`` lists, read one at a time (with ``verify``: checksum and row count)."""
    for s in manifest["shards"]:
        path = join_path(index_dir, f"{SHARDS_SUBDIR}/{s['name']}")
        try:
            data = read_file(path, files)
        except FileNotFoundError:
            raise IndexIntegrityError(f"index shard listed in the manifest is missing: {path}") from None
        if verify:
            digest = hashlib.sha256(data).hexdigest()
            if digest != s["sha256"]:
                raise IndexIntegrityError(f"{path}: sha256 {digest[:12]}... does not match the manifest "
                                          f"({s['sha256'][:12]}...); the shard was changed or truncated")
        index = index_from_bytes(data)
        del data
        if verify and index.ntotal != int(s["rows"]):
            raise IndexIntegrityError(f"{path}: holds {index.ntotal} vectors, manifest says {s['rows']}")
        yield index


def load_sharded_index(index_dir: str, verify: bool = True, embeddings_dir: Optional[str] = None,
                       check_id_set: bool = True, files: Optional[FileAccess] = None) -> ShardedIndex:
    """Load every shard listed in the index manifest (the whole index in memory; :class:`StreamedIndex`
    searches one shard at a time).

    With ``verify``: shard checksums, per-shard and total counts, d and metric, and the ids against the
    embeddings the index was built from — the count always; when the embeddings directory (recorded in the
    manifest, or ``embeddings_dir``) is readable, also its manifest checksum and, with ``check_id_set``,
    the exact id set (one Parquet column per shard, cheap). Any mismatch raises IndexIntegrityError.
    """
    manifest = load_index_manifest(index_dir, files)
    sharded = ShardedIndex(list(iter_index_shards(index_dir, manifest, verify, files)))
    if verify:
        _verify_whole(index_dir, manifest, sharded.ntotal, sharded.d, sharded.metric_type, sharded.all_ids,
                      embeddings_dir, check_id_set, files)
    return sharded


def _verify_whole(index_dir: str, manifest: dict, ntotal: int, d: int, metric: int, all_ids,
                  embeddings_dir: Optional[str], check_id_set: bool, files: Optional[FileAccess]) -> None:
    """The whole-index checks of load_sharded_index (``all_ids()``: the sorted ids of every shard)."""
    if ntotal != int(manifest["ntotal"]):
        raise IndexIntegrityError(f"{index_dir}: shards hold {ntotal} vectors, manifest says "
                                  f"{manifest['ntotal']}")
    if d != int(manifest["d"]) or metric != metric_type(manifest["metric"]):
        raise IndexIntegrityError(f"{index_dir}: shards have d={d}, metric={metric}; "
                                  f"manifest says d={manifest['d']}, metric={manifest['metric']}")
    src, subset = manifest["embeddings"], manifest.get("ids")
    if subset and int(subset.get("count", -1)) != ntotal:
        raise IndexIntegrityError(f"{index_dir}: index holds {ntotal} vectors but its id list "
                                  f"{subset.get('path')} holds {subset.get('count')}")
    if not subset and int(src.get("count", -1)) != ntotal:
        raise IndexIntegrityError(f"{index_dir}: index holds {ntotal} vectors but the embeddings it was "
                                  f"built from hold {src.get('count')}")
    emb_dir = embeddings_dir or src.get("dir")
    if emb_dir and file_exists(embeddings.manifest_path(emb_dir), files):
        digest = hashlib.sha256(read_file(embeddings.manifest_path(emb_dir), files)).hexdigest()
        if src.get("manifest_sha256") and digest != src["manifest_sha256"]:
            raise IndexIntegrityError(f"{index_dir}: the embeddings manifest in {emb_dir} changed since the index "
                                      f"was built (sha256 {digest[:12]}... != {src['manifest_sha256'][:12]}...)")
        if check_id_set:
            expected = _expected_ids(index_dir, manifest, emb_dir, files)
            got = all_ids()
            if expected is not None and (len(expected) != len(got) or not np.array_equal(expected, got)):
                missing = np.setdiff1d(expected, got)[:5].tolist()
                extra = np.setdiff1d(got, expected)[:5].tolist()
                raise IndexIntegrityError(f"{index_dir}: index ids differ from the embeddings' ids "
                                          f"(missing e.g. {missing}, unexpected e.g. {extra})")
    else:
        log.warning("embeddings of %s not readable (%s); checked the id count only", index_dir, emb_dir)


class StreamedIndex:
    """A sharded index searched without holding it: a search reads the shards one at a time (checksums
    verified), searches each and merges as :meth:`ShardedIndex.search` does, so the results are the same
    bits. Memory: one shard and the results, whatever the collection size (a Flat index is every vector of
    the collection). Opening it runs load_sharded_index's checks, reading one shard at a time."""

    def __init__(self, index_dir: str, embeddings_dir: Optional[str] = None, check_id_set: bool = True,
                 files: Optional[FileAccess] = None):
        self.index_dir, self.files = index_dir, files
        self.manifest = load_index_manifest(index_dir, files)
        ntotal, dims, ids = 0, set(), []
        for shard in iter_index_shards(index_dir, self.manifest, files=files):
            ntotal += int(shard.ntotal)
            dims.add((int(shard.d), int(shard.metric_type)))
            if check_id_set:
                ids.append(index_ids(shard))
        if len(dims) != 1:
            raise IndexIntegrityError(f"{index_dir}: shards disagree on (d, metric): {sorted(dims)}")
        (self.d, self.metric_type), = dims
        _verify_whole(index_dir, self.manifest, ntotal, self.d, self.metric_type, lambda: sorted_unique_ids(ids),
                      embeddings_dir, check_id_set, files)
        self.ntotal = ntotal
        self._params: dict = {}

    @property
    def keep_max(self) -> bool:
        return self.metric_type == faiss.METRIC_INNER_PRODUCT

    def set_params(self, nprobe: Optional[int] = None, efSearch: Optional[int] = None) -> None:
        """Search-time parameters, set on every shard as it is read (see ShardedIndex.set_params)."""
        self._params = {name: v for name, v in (("nprobe", nprobe), ("efSearch", efSearch)) if v is not None}

    def search_batches(self, batches: Sequence[np.ndarray], k: int,
                       on_shard: Optional[Callable[[int], None]] = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """ShardedIndex.search of every query batch, in one pass over the shards: [(scores, ids)] per batch.
        ``on_shard(1)`` after each shard searched (a progress bar's advance)."""
        batches = [np.ascontiguousarray(q, dtype=np.float32) for q in batches]
        for q in batches:
            if q.ndim != 2 or q.shape[1] != self.d:
                raise ValueError(f"queries must be (Q, {self.d}), got {q.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        # Each batch keeps its best k so far, merged shard by shard: memory is queries x k, not x shards too
        # (a pass of 5,000 queries x 100 candidates over 500 shards would hold 3 GB of partial lists). The
        # running list sits first in each merge, so ties still go to the earlier shard, as in one merge of all.
        best: list = [None] * len(batches)
        for shard in iter_index_shards(self.index_dir, self.manifest, files=self.files):
            ShardedIndex([shard]).set_params(**self._params)
            for b, q in enumerate(batches):
                found = shard.search(q, k)
                best[b] = found if best[b] is None else faiss.merge_knn_results(
                    np.stack([best[b][0], found[0]]), np.stack([best[b][1], found[1]]), keep_max=self.keep_max)
            del shard
            if on_shard:
                on_shard(1)
        return best

    def search_scores_batches(self, batches: Sequence[np.ndarray], k: int,
                              on_shard: Optional[Callable[[int], None]] = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`search_batches` with higher-is-better scores (L2 distances negated, as ShardedIndex.search_scores)."""
        return [(s if self.keep_max else -s, i) for s, i in self.search_batches(batches, k, on_shard)]


class StreamedExact:
    """Exact inner-product search over one modality's embeddings, read one shard at a time on every search
    (checksums verified): the pool without an index, in StreamedIndex's interface. Ties: smaller id first."""

    keep_max = True

    def __init__(self, emb_dir: str, modality: str, files: Optional[FileAccess] = None):
        self.emb_dir, self.modality, self.files = emb_dir, modality, files
        self.manifest = embeddings.load_embeddings_manifest(emb_dir, files)
        self.ntotal = int(embeddings.modality_entry(self.manifest, modality)["count"])

    def search_scores_batches(self, batches: Sequence[np.ndarray], k: int,
                              on_shard: Optional[Callable[[int], None]] = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(scores, ids)] of every query batch, in one pass over the shards (``on_shard(1)`` after each)."""
        shards = embeddings.iter_embedding_shards(self.emb_dir, self.modality, files=self.files, manifest=self.manifest)
        return exact.exact_topk_shards(batches, _counted(shards, on_shard) if on_shard else shards, k)


def _counted(shards, on_shard: Callable[[int], None]):
    """``shards``, calling ``on_shard(1)`` once each has been used (when the next is asked for, or at the end)."""
    for shard in shards:
        yield shard
        on_shard(1)


def _expected_ids(index_dir: str, manifest: dict, emb_dir: str, files: Optional[FileAccess]) -> Optional[np.ndarray]:
    """Sorted ids the index must hold: its id list's (when readable) or every embedding's."""
    subset = manifest.get("ids")
    if not subset:
        return np.sort(embeddings.read_modality_ids(emb_dir, manifest.get("modality", schema.KIND_IMAGE), files))
    path = subset.get("path")
    if not path or not file_exists(path, files):
        log.warning("id list %s of %s not readable; checked the id count only", path, index_dir)
        return None
    data = read_file(path, files)
    if hashlib.sha256(data).hexdigest() != subset.get("sha256"):
        raise IndexIntegrityError(f"{index_dir}: its id list {path} changed since the index was built")
    return read_id_list(data, path)


def check_index_source(flag: str, index_dir: str, index_manifest: dict, emb_dir: str, emb_manifest: dict,
                       modality: str, files: Optional[FileAccess] = None, emb_flag: str = "--embeddings") -> None:
    """Refuse an index built from other embeddings than ``emb_dir``: its vectors would be compared with query
    embeddings of another model or encoding (before this check such a run exited 0 and scored R@1 0.00).
    build_index records each index shard's source embedding shard and its sha256: they must be ``emb_dir``'s
    shards of that modality; and the index must hold that modality."""
    if index_manifest.get("modality", modality) != modality:
        raise IndexIntegrityError(f"{flag} {index_dir} indexes {index_manifest.get('modality')}, not {modality}")
    built_from = {s.get("source"): s.get("source_sha256") for s in index_manifest.get("shards", [])}
    have = {s["name"]: s["sha256"] for s in embeddings.modality_entry(emb_manifest, modality)["shards"]}
    if built_from != have:
        src = index_manifest.get("embeddings", {})
        differ = len(set(built_from.items()) ^ set(have.items()))
        raise IndexIntegrityError(
            f"{flag} {index_dir} was built from the {modality} embeddings in {src.get('dir')} (embeddings manifest "
            f"sha256 {str(src.get('manifest_sha256'))[:12]}...), not from {emb_flag} {emb_dir} "
            f"(sha256 {embeddings.manifest_sha256(emb_dir, files)[:12]}...; {differ} shard entries differ): rebuild "
            f"the index from {emb_flag} or pass the embeddings it was built from")

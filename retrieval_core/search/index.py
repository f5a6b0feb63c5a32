"""Sharded FAISS indexes: train once, add each embedding shard with its GLOBAL int64 ids, search all shards
and merge (NOTES.md section 5).

Plain functions over numpy arrays and bytes (faiss.contrib style); ``pipelines.build_index`` is the Beam
graph around them. Why not ``faiss.IndexShards``: with its default ``successive_ids=True`` it adds a
per-shard offset to the returned ids, which silently corrupts global ids; searching each shard and merging
with ``faiss.merge_knn_results`` is explicit and keeps ids as stored.

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
import os
import warnings
from typing import Iterator, Optional, Sequence

import faiss
import numpy as np

from retrieval_core.data import schema
from retrieval_core.data.paths import FileAccess, file_exists, join_path, read_file
from retrieval_core.search import embeddings as emb
from retrieval_core.search import exact

log = logging.getLogger(__name__)

INDEX_MANIFEST = "index_manifest.json"
TRAINED_INDEX = "trained.faiss"
SHARDS_SUBDIR = "shards"
METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}
#: faiss k-means warns below this many training points per centroid.
MIN_POINTS_PER_CENTROID = 39
#: Environment variable read by :func:`set_threads` when no explicit count is given.
THREADS_ENV = "RR_FAISS_THREADS"


class IndexIntegrityError(ValueError):
    """An index shard or manifest does not match what was recorded."""


# ------------------------------------------------------------------------------------------- threads
def set_threads(n: Optional[int] = None) -> int:
    """Set faiss' own OpenMP pool (faiss bundles its OpenMP; torch's setting does not reach it).
    ``n`` None -> $RR_FAISS_THREADS, else leave faiss' default. Returns the count in effect."""
    if n is None and os.environ.get(THREADS_ENV):
        n = int(os.environ[THREADS_ENV])
    if n is not None and n > 0:
        faiss.omp_set_num_threads(int(n))
    return faiss.omp_get_max_threads()


# ------------------------------------------------------------------------------------------ training
def metric_type(metric: str) -> int:
    try:
        return METRICS[metric]
    except KeyError:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}") from None


def _new_index(factory: str, d: int, metric: str) -> faiss.Index:
    try:
        index = faiss.index_factory(int(d), factory, metric_type(metric))
    except RuntimeError as exc:
        raise ValueError(f"faiss cannot build index factory {factory!r} for d={d}: {exc}") from None
    if not _supports_ids(index):
        # Flat, HNSW, PQ, Refine... ignore add_with_ids: IDMap2 keeps the global ids (and can map back).
        index = faiss.index_factory(int(d), "IDMap2," + factory, metric_type(metric))
    return index


def _supports_ids(index: faiss.Index) -> bool:
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2, faiss.IndexIVF)):
        return True
    if isinstance(index, faiss.IndexPreTransform):  # PCA/OPQ in front: ids go to the wrapped index
        return _supports_ids(index.index)
    return False


def check_search_params(factory: str, d: int, metric: str, nprobe: Optional[int] = None,
                        efSearch: Optional[int] = None) -> None:
    """Raise ValueError when nprobe / efSearch cannot be set on an index made by ``factory`` (e.g. nprobe on
    HNSW): a launcher can refuse them before its job loads the shards."""
    ShardedIndex([_new_index(factory, d, metric)]).set_params(nprobe=nprobe, efSearch=efSearch)


def needs_training(factory: str, d: int = 64, metric: str = "ip") -> bool:
    """Whether an index made by ``factory`` must be trained before vectors can be added."""
    return not _new_index(factory, d, metric).is_trained


def nlist_of(index: faiss.Index) -> int:
    ivf = faiss.try_extract_index_ivf(index)
    return int(ivf.nlist) if ivf is not None else 0


def select_training_ids(ids: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """The ``n`` ids of a deterministic sample, in sample order.

    Ids are ordered by a seeded 64-bit hash of the id (splitmix64), so the sample depends on the id set and
    the seed only, never on shard order or row positions.
    """
    ids = np.asarray(ids, dtype=np.int64)
    keys = _mix64(ids.view(np.uint64) ^ np.uint64(_mix64(np.array([seed], dtype=np.uint64))[0]))
    order = np.lexsort((ids, keys))
    return ids[order[:max(0, int(n))]]


def training_sample(ids: np.ndarray, vectors: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """(min(n, N), d) float32 training vectors chosen by :func:`select_training_ids`."""
    ids = np.asarray(ids, dtype=np.int64)
    chosen = select_training_ids(ids, n, seed)
    position = np.argsort(ids, kind="stable")
    rows = position[np.searchsorted(ids[position], chosen)]
    return np.ascontiguousarray(vectors[rows], dtype=np.float32)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def train_index(factory: str, d: int, metric: str, sample: Optional[np.ndarray], seed: int = 0) -> bytes:
    """Serialized trained EMPTY index. Factories that need no training (Flat, HNSW) return the empty index."""
    index = _new_index(factory, d, metric)
    if index.is_trained:
        return index_bytes(index)
    if sample is None or len(sample) == 0:
        raise ValueError(f"index factory {factory!r} needs training vectors, got none")
    sample = np.ascontiguousarray(sample, dtype=np.float32)
    if sample.ndim != 2 or sample.shape[1] != d:
        raise ValueError(f"training sample must be (n, {d}), got {sample.shape}")
    nlist = nlist_of(index)
    if nlist and len(sample) < nlist:
        raise ValueError(f"{factory!r} has {nlist} lists but only {len(sample)} training vectors")
    if nlist and len(sample) < MIN_POINTS_PER_CENTROID * nlist:
        warnings.warn(f"training {factory!r} on {len(sample)} vectors: fewer than "
                      f"{MIN_POINTS_PER_CENTROID} per list ({MIN_POINTS_PER_CENTROID * nlist}); "
                      f"centroids will be poor", RuntimeWarning, stacklevel=2)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.cp.seed = int(seed)
        ivf = faiss.downcast_index(ivf)  # try_extract_index_ivf hands back the IndexIVF base class
        if isinstance(ivf, faiss.IndexIVFPQ):
            # polysemous training (simulated annealing over PQ code orderings) serves only polysemous
            # Hamming-filtered search, which nothing here uses; it took minutes on 500 vectors of d=384
            ivf.do_polysemous_training = False
    index.train(sample)
    return index_bytes(index)


# ------------------------------------------------------------------------------------------- shards
def index_bytes(index: faiss.Index) -> bytes:
    return faiss.serialize_index(index).tobytes()


def index_from_bytes(data: bytes) -> faiss.Index:
    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))


def build_shard(trained: bytes, ids: np.ndarray, vectors: np.ndarray) -> faiss.Index:
    """A copy of the trained index holding ``vectors`` under their global ``ids``."""
    index = index_from_bytes(trained)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != index.d:
        raise ValueError(f"vectors must be (n, {index.d}), got {vectors.shape}")
    if ids.shape != (vectors.shape[0],):
        raise ValueError(f"{ids.shape} ids for {vectors.shape[0]} vectors")
    if not index.is_trained:
        raise ValueError("the index passed to build_shard is not trained")
    emb.check_unique_ids(ids, "shard")
    if len(ids):
        index.add_with_ids(vectors, ids)
    return index


def index_ids(index: faiss.Index) -> np.ndarray:
    """All ids stored in ``index`` (IDMap / IVF; unsorted)."""
    index = faiss.downcast_index(index)
    if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)):
        return faiss.vector_to_array(index.id_map).astype(np.int64)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        from faiss.contrib.inspect_tools import get_invlist
        parts = [get_invlist(ivf.invlists, lno)[0] for lno in range(ivf.nlist)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    raise ValueError(f"cannot list the ids of a {type(index).__name__}")


class ShardedIndex:
    """Several indexes holding disjoint global ids, searched as one."""

    def __init__(self, shards: Sequence[faiss.Index]):
        if not shards:
            raise ValueError("ShardedIndex needs at least one shard")
        self.shards = list(shards)
        self.d = int(self.shards[0].d)
        self.metric_type = int(self.shards[0].metric_type)
        for i, s in enumerate(self.shards):
            if s.d != self.d or s.metric_type != self.metric_type:
                raise ValueError(f"shard {i} has d={s.d}, metric={s.metric_type}; "
                                 f"shard 0 has d={self.d}, metric={self.metric_type}")

    @property
    def ntotal(self) -> int:
        return int(sum(s.ntotal for s in self.shards))

    @property
    def keep_max(self) -> bool:
        """Larger is better for inner product, smaller for L2."""
        return self.metric_type == faiss.METRIC_INNER_PRODUCT

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), both (Q, k), best first over all shards. When fewer than k vectors exist the
        tail holds id -1 (faiss' convention) with the worst possible score."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.d:
            raise ValueError(f"queries must be (Q, {self.d}), got {queries.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        results = [s.search(queries, k) for s in self.shards]
        if len(results) == 1:
            return results[0]
        all_d = np.stack([r[0] for r in results])
        all_i = np.stack([r[1] for r in results])
        return faiss.merge_knn_results(all_d, all_i, keep_max=self.keep_max)

    def search_scores(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` with higher-is-better scores for every metric: L2 distances come back negated.
        Use this where the scores are BE scores (``retrieval_core.search.rerank`` wants the best, i.e. the largest,
        first); the order of the results is the same as :meth:`search`'s."""
        scores, ids = self.search(queries, k)
        return (scores if self.keep_max else -scores), ids

    def set_params(self, nprobe: Optional[int] = None, efSearch: Optional[int] = None) -> None:
        """Set search-time parameters on every shard through faiss.ParameterSpace."""
        ps = faiss.ParameterSpace()
        for name, value in (("nprobe", nprobe), ("efSearch", efSearch)):
            if value is None:
                continue
            for s in self.shards:
                try:
                    ps.set_index_parameter(s, name, value)
                except RuntimeError as exc:
                    raise ValueError(f"cannot set {name}={value} on a {type(faiss.downcast_index(s)).__name__} "
                                     f"shard: {exc}") from None

    def all_ids(self) -> np.ndarray:
        """Sorted ids of all shards; raises on an id stored in more than one place."""
        return _sorted_unique_ids([index_ids(s) for s in self.shards])

    def id_set(self) -> frozenset:
        return frozenset(self.all_ids().tolist())


# ------------------------------------------------------------------------------------------ id lists
def read_id_list(source, where: str = "id list") -> np.ndarray:
    """The sorted ids of an id-list Parquet file (one int64 column ``schema.ITEM_ID``; path, bytes or file
    object): the items a sub-pool index holds (a 1k fold of a 5k collection). Nulls, another dtype and
    duplicates are errors naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(bytes(source)) if isinstance(source, (bytes, bytearray)) else source,
                              columns=[schema.ITEM_ID])
    except (KeyError, ValueError, OSError) as exc:  # pyarrow: missing column / not Parquet
        raise ValueError(f"{where}: cannot read an int64 {schema.ITEM_ID!r} column from it ({exc})") from None
    col = table.column(schema.ITEM_ID)
    if col.type != pa.int64():
        raise ValueError(f"{where}: column {schema.ITEM_ID!r} must be int64, got {col.type}")
    if col.null_count:
        raise ValueError(f"{where}: {col.null_count} null {schema.ITEM_ID}(s)")
    ids = np.sort(col.to_numpy().astype(np.int64, copy=False))
    dup = np.unique(ids[1:][ids[1:] == ids[:-1]])
    if len(dup):
        raise ValueError(f"{where}: {len(dup)} {schema.ITEM_ID}(s) listed more than once (e.g. {dup[:5].tolist()})")
    return ids


# ----------------------------------------------------------------------------------------- manifest
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


def _sorted_unique_ids(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Sorted ids of several shards; raises on an id stored in more than one place."""
    ids = np.sort(np.concatenate(parts)) if len(parts) else np.zeros(0, dtype=np.int64)
    if len(ids) > 1 and np.any(ids[1:] == ids[:-1]):
        dup = np.unique(ids[1:][ids[1:] == ids[:-1]])[:5].tolist()
        raise IndexIntegrityError(f"item_id(s) {dup} are stored more than once across shards")
    return ids


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
    if emb_dir and file_exists(emb.manifest_path(emb_dir), files):
        digest = hashlib.sha256(read_file(emb.manifest_path(emb_dir), files)).hexdigest()
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
        _verify_whole(index_dir, self.manifest, ntotal, self.d, self.metric_type, lambda: _sorted_unique_ids(ids),
                      embeddings_dir, check_id_set, files)
        self.ntotal = ntotal
        self._params: dict = {}

    @property
    def keep_max(self) -> bool:
        return self.metric_type == faiss.METRIC_INNER_PRODUCT

    def set_params(self, nprobe: Optional[int] = None, efSearch: Optional[int] = None) -> None:
        """Search-time parameters, set on every shard as it is read (see ShardedIndex.set_params)."""
        self._params = {name: v for name, v in (("nprobe", nprobe), ("efSearch", efSearch)) if v is not None}

    def search_batches(self, batches: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """ShardedIndex.search of every query batch, in one pass over the shards: [(scores, ids)] per batch."""
        batches = [np.ascontiguousarray(q, dtype=np.float32) for q in batches]
        for q in batches:
            if q.ndim != 2 or q.shape[1] != self.d:
                raise ValueError(f"queries must be (Q, {self.d}), got {q.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        found: list[list] = [[] for _ in batches]
        for shard in iter_index_shards(self.index_dir, self.manifest, files=self.files):
            ShardedIndex([shard]).set_params(**self._params)
            for b, q in enumerate(batches):
                found[b].append(shard.search(q, k))
            del shard
        out = []
        for results in found:
            if len(results) == 1:
                out.append(results[0])
            else:
                out.append(faiss.merge_knn_results(np.stack([r[0] for r in results]), np.stack([r[1] for r in results]),
                                                   keep_max=self.keep_max))
        return out

    def search_scores_batches(self, batches: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`search_batches` with higher-is-better scores (L2 distances negated, as ShardedIndex.search_scores)."""
        return [(s if self.keep_max else -s, i) for s, i in self.search_batches(batches, k)]


class StreamedExact:
    """Exact inner-product search over one modality's embeddings, read one shard at a time on every search
    (checksums verified): the pool without an index, in StreamedIndex's interface. Ties: smaller id first."""

    keep_max = True

    def __init__(self, emb_dir: str, modality: str, files: Optional[FileAccess] = None):
        self.emb_dir, self.modality, self.files = emb_dir, modality, files
        self.manifest = emb.load_embeddings_manifest(emb_dir, files)
        self.ntotal = int(emb.modality_entry(self.manifest, modality)["count"])

    def search_scores_batches(self, batches: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(scores, ids)] of every query batch, in one pass over the shards."""
        shards = emb.iter_embedding_shards(self.emb_dir, self.modality, files=self.files, manifest=self.manifest)
        return exact.exact_topk_shards(batches, shards, k)


def _expected_ids(index_dir: str, manifest: dict, emb_dir: str, files: Optional[FileAccess]) -> Optional[np.ndarray]:
    """Sorted ids the index must hold: its id list's (when readable) or every embedding's."""
    subset = manifest.get("ids")
    if not subset:
        return np.sort(emb.read_modality_ids(emb_dir, manifest.get("modality", schema.KIND_IMAGE), files))
    path = subset.get("path")
    if not path or not file_exists(path, files):
        log.warning("id list %s of %s not readable; checked the id count only", path, index_dir)
        return None
    data = read_file(path, files)
    if hashlib.sha256(data).hexdigest() != subset.get("sha256"):
        raise IndexIntegrityError(f"{index_dir}: its id list {path} changed since the index was built")
    return read_id_list(data, path)

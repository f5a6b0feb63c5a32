"""Sharded FAISS indexes: train once, add each embedding shard with its GLOBAL int64 ids, search all shards
and merge (docs/CONVENTIONS.md#sharded-faiss-indexes).

Plain functions over numpy arrays and bytes (faiss.contrib style); ``pipelines.build_index`` is the Beam
graph around them. Why not ``faiss.IndexShards``: with its default ``successive_ids=True`` it adds a
per-shard offset to the returned ids, which silently corrupts global ids; searching each shard and merging
with ``faiss.merge_knn_results`` is explicit and keeps ids as stored. An index folder on disk (its manifest,
loading and verifying it) is ``search.index_folder``'s.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence

import faiss
import numpy as np

from retrieval_core.data import schema
from retrieval_core.search import embeddings

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
            # Hamming-filtered search, which nothing here uses, and is slow (docs/log/PERFORMANCE-2026-11.md)
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
    embeddings.check_unique_ids(ids, "shard")
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


#: Below this many queries ShardedIndex.search scans its shards in parallel threads (faiss' own BLAS threshold,
#: distance_compute_blas_threshold: fewer queries get one thread per query).
SMALL_BATCH = 20


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
        workers = min(len(self.shards), faiss.omp_get_max_threads())
        if len(queries) < SMALL_BATCH and workers > 1:
            # a few queries scan each shard on one thread (faiss splits queries, not vectors, across threads
            # below its BLAS threshold): the shards side by side use the others; faiss releases the GIL
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(lambda s: s.search(queries, k), self.shards))
        else:
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
        return sorted_unique_ids([index_ids(s) for s in self.shards])

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


def sorted_unique_ids(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Sorted ids of several shards; raises on an id stored in more than one place."""
    ids = np.sort(np.concatenate(parts)) if len(parts) else np.zeros(0, dtype=np.int64)
    if len(ids) > 1 and np.any(ids[1:] == ids[:-1]):
        dup = np.unique(ids[1:][ids[1:] == ids[:-1]])[:5].tolist()
        raise IndexIntegrityError(f"item_id(s) {dup} are stored more than once across shards")
    return ids

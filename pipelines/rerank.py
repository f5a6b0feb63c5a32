"""Distributed retrieve-and-rerank: ``python -m pipelines.rerank``.

Graph (one per wave of output shards, see *Resume*)::

    query embeddings (captions for t2i, images for i2t; read per embedding shard, keeping the wave's ids)
      -> deterministic query batches -> Search (loads the index once per worker process) -> BE top-n,
         n = max(k, 10) (whole pool for --mode ce)
      EMB: -> rank_query
      CO/ADD/NORM_ADD/CE:
         -> each query's top-k as (caption_id, image_id) pairs (rr.query_pairs) -> GroupByKey on the pair, so
            a t2i and an i2t request for the same pair are scored once (rr.merge_requesters)
         -> route each pair to the staged caption shard holding its text (RouteToShard: an id -> shard table
            per worker, built from the shards' id columns) -> GroupByKey -> read the asked-for texts; then
            the same to the group of image shards holding its regions (~8 CE batches of pairs per group):
            each needed shard is read once
         -> per group: its images' regions -> deterministic length-sorted CE batches ->
            RunInference(KeyedModelHandler(score_pairs)) -> scores back to every query that asked
            (CoGroupByKey with the candidate lists)
         -> rr.ce_scores_of + rr.rank_query
      -> key by (direction, query_id % N) -> GroupByKey -> rankings/<direction>-0000x-of-0000N.parquet + its
         _progress/<shard>.json record
      -> one run report (common.WriteRunReport); after the last wave the launcher writes
         rankings_manifest.json and deletes ranking files it does not list

Stored rows (score once, evaluate many): every query keeps its whole BE top-n in final order, each row with
its ``be_rank``, ``be_score`` and, for CE modes, the ``ce_score`` of the BE top-k; ``rank`` / ``final_score``
follow the run's own mode. ``benchmarks.evaluate`` re-derives any k' <= k, mode and lam from them
(``retrieval_core.rerank.derive_rankings``).

Modes: ``emb`` BE only; ``co`` CE rerank of the BE top-k (items below k keep BE order); ``add`` / ``norm_add``
fuse BE and CE scores in the top-k (--lam); ``ce`` exhaustive CE over the whole pool (refused above
--max-exhaustive-pairs query x pool pairs); ``auto`` (with --tune-on DEV_RUN) picks co, add_lam or norm_add_lam by
the best mR on a CE-scored dev run of the same models (``benchmarks.evaluate.choose_fusion``; CO wins ties), runs
as that mode and records the choice and every candidate's dev mR in the manifest's ``fusion_choice``.

Candidate pools: t2i searches --index (a FAISS image index from pipelines.build_index, refused when it was
built from other embeddings than --embeddings); i2t searches --text-index when given, otherwise an exact
inner-product search over all text embeddings in --embeddings (``retrieval_core.metrics.exact_topk_shards``).
Without --index, t2i is also an exact search over all image embeddings.

Memory: no worker holds the pool. Both kinds of search read the index (``retrieval_core.index.StreamedIndex``)
or embedding shards one at a time, once per query group (~4 x --search-batch-size queries), and keep each
query's best n; the pairs meet their caption text and image regions through shuffles of the pairs only, and
the regions are read where they are scored, one group of image shards at a time (no shuffle carries them).
A worker's id -> staged shard tables take 12 bytes per caption and per image.
--nprobe (IVF) and --ef-search (HNSW) are set on every shard of an index and recorded in the manifest's
``search_params``; without them the parameters the index manifest records (``build_index --index-factory
auto`` tunes them) are used, else faiss' defaults; ``search_params_used`` says which, per direction.
--queries restricts the run to the queries a Parquet file lists (columns direction, query_id).

Resume: output shards hold ~--queries-per-shard queries each (query_id % N) and are computed in waves of at
most --shards-per-wave shards and --pairs-per-wave CE pairs (``plan_waves``), one Beam job per wave (a
GroupByKey is a barrier: within one job no shard is finished before all are; a local runner holds a wave's
CE pairs with their texts and scores, hence the pair cap). Each written shard gets a small
``_progress/<shard>.json`` (sha256, plan fingerprint). A rerun of the same plan keeps every shard whose record
matches the plan and whose file matches its checksum, and computes only the others; any difference in the plan (inputs by checksum, mode, k, lam,
queries, batch sizes...) recomputes everything.

Determinism (DirectRunner and DaskRunner give identical rankings): queries and CE pairs are batched by a
GroupByKey on a fixed key (queries: a hash of the id mod G; pairs: their image's staged shard group) and
sorted inside the group (queries by id; pairs by length, then ids),
so every batch has the same members on every runner; RunInference gets pre-batched input
(``with_no_batching``). Float results then depend only on the batch, not on bundle boundaries. Ties keep
the searcher's order (exact search: smaller id first), rank_query's ties keep BE order. Measured: the
same CE batch gives bit-identical scores with 1 or 2 torch threads, while moving a pair to another batch
changes its score by ~3e-8 (padding/GEMM shapes) -- hence the fixed batches and waves. (A wave resumed
after a kill in the middle of its writes recomputes its missing shards in smaller batches: their CE scores
can differ in the last bits; --batch-size 1 makes them batch-independent.)

DaskRunner (Beam 2.77) computes only the last transform's graph and does not separate tagged outputs, so
this graph has single-output steps only and ends in one report step that every write feeds. A CE batch that
fails fails the job (no silent gaps in a ranking).

    python -m pipelines.rerank --staged S --embeddings E --index I --ce-model M --mode co --k 20 --output OUT
    python -m pipelines.rerank ... --runner=apache_beam.runners.dask.dask_runner.DaskRunner \\
        --dask_client_address=127.0.0.1:8786
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

import apache_beam as beam
import click
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference

from pipelines import common
from pipelines.handlers import TASK_SCORE_PAIRS, VLModelHandler, element_length
from retrieval_core import embeddings as emb
from retrieval_core import rerank as rr
from retrieval_core import schema
from retrieval_core.paths import is_url

log = logging.getLogger(__name__)

T2I, I2T = schema.DIRECTION_T2I, schema.DIRECTION_I2T
DIRECTIONS = (T2I, I2T)
#: "auto": the fusion (co, add_lam, norm_add_lam) with the best mR on a dev run (--tune-on), then run as that mode
AUTO = "auto"
CLI_MODES = rr.RUN_MODES + (AUTO,)
FUSION_MODES = rr.FUSION_MODES
RANK_MODE = rr.RUN_TO_RANK_MODE  # "co" and exhaustive "ce" both rank by the CE score
DEVICES = ("cpu", "cuda")
_HANDLER_DEVICE = {"cpu": "CPU", "cuda": "GPU"}  # pipelines.handlers' spelling
RANKINGS_SUBDIR = rr.RANKINGS_SUBDIR
RANKINGS_MANIFEST = rr.RANKINGS_MANIFEST
PROGRESS_DIR = "_progress"  # <output>/_progress/<shard>.json: one record per finished ranking shard
CREATED_BY = "pipelines.rerank"
#: Beam counters (namespace "rerank"): queries_searched, ce_pairs_scored (unique pairs), ce_pair_requests,
#: queries_ranked, ranking_shards_written.
METRICS_NAMESPACE = "rerank"
_SEARCHED = Metrics.counter(METRICS_NAMESPACE, "queries_searched")
_PAIRS_SCORED = Metrics.counter(METRICS_NAMESPACE, "ce_pairs_scored")
_PAIR_REQUESTS = Metrics.counter(METRICS_NAMESPACE, "ce_pair_requests")
_RANKED = Metrics.counter(METRICS_NAMESPACE, "queries_ranked")
_SHARDS_WRITTEN = Metrics.counter(METRICS_NAMESPACE, "ranking_shards_written")
_MIX = 0x9E3779B97F4A7C15  # 64-bit golden-ratio multiplier: spreads ids over groups deterministically
CE_BATCHES_PER_GROUP = 8  # CE batches per group of image shards (length sorting needs a few batches' pairs)


class RerankError(RuntimeError):
    pass


def group_of(a: int, b: int, groups: int) -> int:
    """Deterministic group of an id or an id pair (never Python's salted hash())."""
    return int(((int(a) * _MIX) ^ int(b)) % (1 << 61) % groups)


# ------------------------------------------------------------------------------------------- plan
def _check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise RerankError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class RerankPlan:
    """Every parameter of one rerank run as typed values, validated when built (a one-line RerankError
    naming the value). ``run(plan)`` executes it; the CLI only builds it."""
    staged: str
    embeddings: str
    output: str
    mode: str = "co"
    k: int = 20
    lam: float = 0.5  # ADD / NORM_ADD weight of the BE score (ignored by the other modes)
    directions: tuple[str, ...] = DIRECTIONS
    index: Optional[str] = None  # FAISS image index for t2i (default: exact search over image embeddings)
    text_index: Optional[str] = None  # FAISS caption index for i2t (default: exact search)
    ce_model: Optional[str] = None
    be_model: Optional[str] = None  # the CE of a JOIN model when ce_model is not given
    collection: Optional[str] = None
    split: Optional[str] = "test"
    queries: Optional[str] = None  # Parquet (direction, query_id) restricting the run to those queries
    batch_size: int = 64  # CE pairs per batch
    search_batch_size: int = 256
    device: str = "cpu"
    threads: Optional[int] = None  # torch / faiss threads per worker process (None: leave as is)
    model_copies: Optional[int] = None
    max_exhaustive_pairs: int = 200_000
    queries_per_shard: int = 1_000
    shards_per_wave: int = 10
    pairs_per_wave: int = 20_000
    nprobe: Optional[int] = None
    ef_search: Optional[int] = None
    tune_on: Optional[str] = None  # --mode auto: the dev run (CE-scored, same models) the fusion is chosen on
    quantize: str = "none"  # schema.QUANTIZE_CHOICES for the CE: int8 Linear layers (CPU) or bf16 autocast

    def __post_init__(self):
        for name in ("staged", "embeddings", "output"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RerankError(f"{name} must be a non-empty path, got {getattr(self, name)!r}")
        mode = str(self.mode).lower()
        if mode not in CLI_MODES:
            raise RerankError(f"mode must be one of {CLI_MODES}, got {self.mode!r}")
        object.__setattr__(self, "mode", mode)
        device = str(self.device).lower()
        if device not in DEVICES:
            raise RerankError(f"device must be one of {DEVICES}, got {self.device!r}")
        object.__setattr__(self, "device", device)
        if isinstance(self.directions, str) or not self.directions \
                or any(d not in DIRECTIONS for d in self.directions):
            raise RerankError(f"directions must be a non-empty tuple of {DIRECTIONS}, got {self.directions!r}")
        object.__setattr__(self, "directions", tuple(dict.fromkeys(self.directions)))
        for name in ("k", "batch_size", "search_batch_size", "max_exhaustive_pairs", "queries_per_shard",
                     "shards_per_wave", "pairs_per_wave"):
            _check_int(name, getattr(self, name), 1)
        for name in ("threads", "model_copies", "nprobe", "ef_search"):
            _check_int(name, getattr(self, name), 1, optional=True)
        if isinstance(self.lam, bool) or not isinstance(self.lam, (int, float)) or not 0.0 <= self.lam <= 1.0:
            raise RerankError(f"lam must be a number in [0, 1], got {self.lam!r}")
        if (mode == AUTO) != bool(self.tune_on):
            raise RerankError("--mode auto chooses the fusion on a dev run: pass --tune-on DEV_RUN (a pipelines.rerank "
                              "--mode co run of the same models on a held-out split)" if mode == AUTO else
                              f"--tune-on applies to --mode auto only, not to --mode {mode}")
        if mode != "emb" and not (self.ce_model or self.be_model):
            raise RerankError(f"mode {mode!r} needs --ce-model (or --be-model for a JOIN model)")
        try:
            schema.check_quantize(self.quantize, device)
        except ValueError as exc:
            raise RerankError(str(exc)) from None
        if self.quantize != "none" and mode == "emb":
            raise RerankError(f"--quantize {self.quantize} quantises the CE: --mode emb scores nothing with it")
        if (self.nprobe is not None or self.ef_search is not None) and not self.uses_index:
            raise RerankError("--nprobe / --ef-search tune a FAISS index: pass --index (t2i) or --text-index "
                              "(i2t); the default exact search has no parameters")

    @property
    def cross_encoder(self) -> Optional[str]:
        """The CE model folder (None for EMB): --ce-model, else the JOIN model given as --be-model."""
        return None if self.mode == "emb" else (self.ce_model or self.be_model)

    @property
    def rank_mode(self) -> str:
        return RANK_MODE[self.mode]

    @property
    def applied_lam(self) -> Optional[float]:
        return float(self.lam) if self.mode in FUSION_MODES else None

    @property
    def uses_index(self) -> bool:
        return bool((T2I in self.directions and self.index) or (I2T in self.directions and self.text_index))

    def index_of(self, direction: str) -> Optional[str]:
        return self.index if direction == T2I else self.text_index


# ------------------------------------------------------------------------------------- searchers
@dataclass(frozen=True)
class SearcherSpec:
    """How a worker finds one direction's candidates: a FAISS index dir or exact search over embeddings."""
    kind: str  # "index" | "exact"
    path: str
    modality: str
    fingerprint: str  # sha256 of the index / embeddings manifest: a changed input is another searcher
    params: tuple[tuple[str, int], ...] = ()  # faiss search parameters (nprobe, efSearch) set on every shard


_SEARCHERS: dict = {}  # per worker process: SearcherSpec -> loaded searcher


class ExactSearcher:
    """Exact inner-product top-n over all embeddings of one modality (ties: smaller id first), read one
    embedding shard at a time on every search (checksums verified): a worker never holds the collection's
    embeddings (``retrieval_core.metrics.exact_topk_shards``)."""

    def __init__(self, emb_dir: str, modality: str):
        self.emb_dir, self.modality = emb_dir, modality
        manifest = emb.load_embeddings_manifest(emb_dir, common.BEAM_FILES)
        self.dim = int(manifest["dim"])
        self.shards = emb.modality_entry(manifest, modality)["shards"]
        self.ntotal = sum(int(s["rows"]) for s in self.shards)

    def _read(self):
        for s in self.shards:
            path = common.join(self.emb_dir, emb.shard_relpath(self.modality, s["name"]))
            data = common.read_bytes(path)
            emb.verify_shard_bytes(data, s, path)
            ids, vectors = emb.read_embedding_shard(data)
            emb.check_shard_contents(ids, vectors, s, self.dim, path)
            yield ids, vectors

    def search_scores_batches(self, batches, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(scores, ids)] per query batch, in one pass over the shards (inner products: higher is better)."""
        from retrieval_core.metrics import exact_topk, merge_topk

        best: list = [None] * len(batches)
        for ids, vectors in self._read():
            for b, q in enumerate(batches):
                part = exact_topk(q, vectors, ids, n)
                best[b] = part if best[b] is None else merge_topk([best[b], part], n)
        return best


def get_searcher(spec: SearcherSpec):
    """The searcher of ``spec``, opened (and checked) once per process; neither kind holds the pool's vectors:
    a search reads them one shard at a time."""
    if spec not in _SEARCHERS:
        if spec.kind == "index":
            from retrieval_core.index import StreamedIndex
            searcher = StreamedIndex(spec.path, files=common.BEAM_FILES)
            searcher.set_params(**dict(spec.params))  # otherwise faiss' defaults: nprobe=1, efSearch=16
            _SEARCHERS[spec] = searcher
        else:
            _SEARCHERS[spec] = ExactSearcher(spec.path, spec.modality)
    return _SEARCHERS[spec]


class SearchBatch(beam.DoFn):
    """((direction, group), [(query_id, vector)]) -> ((direction, query_id), (candidate ids, BE scores)).

    Queries are searched in fixed sub-batches of the id-sorted group, so batches never depend on bundles."""

    def __init__(self, searchers: Mapping[str, SearcherSpec], candidates: Mapping[str, int], batch_size: int,
                 faiss_threads: Optional[int]):
        self.searchers = dict(searchers)
        self.candidates = dict(candidates)
        self.batch_size = batch_size
        self.faiss_threads = faiss_threads

    def setup(self):
        if self.faiss_threads:
            from retrieval_core.index import set_threads
            set_threads(self.faiss_threads)
        self._loaded = {d: get_searcher(s) for d, s in self.searchers.items()}

    def process(self, element):
        (direction, _group), queries = element
        queries = sorted(queries, key=lambda q: q[0])
        chunks = [queries[start:start + self.batch_size] for start in range(0, len(queries), self.batch_size)]
        # One pass over the pool's shards for the whole group; higher-is-better BE scores (an L2 index's
        # distances come back negated).
        found = self._loaded[direction].search_scores_batches(
            [np.stack([v for _, v in chunk]).astype(np.float32) for chunk in chunks], self.candidates[direction])
        for chunk, (scores, ids) in zip(chunks, found):
            _SEARCHED.inc(len(chunk))
            for (qid, _), s, i in zip(chunk, scores, ids):
                valid = i >= 0  # faiss pads with -1 when the pool is smaller than n
                yield (direction, qid), (i[valid].astype(np.int64), s[valid].astype(np.float32))


# ------------------------------------------------------------------------------------- reading
def read_query_vectors(task, emb_dir: str, wanted: Mapping[str, frozenset]):
    """(direction, modality, shard name, sha256, groups) -> ((direction, group), (query_id, vector)) for the
    wanted ids."""
    direction, modality, name, sha256, groups = task
    path = common.join(emb_dir, emb.shard_relpath(modality, name))
    data = common.read_bytes(path)
    emb.verify_shard_bytes(data, {"sha256": sha256}, path)
    ids, vecs = emb.read_embedding_shard(data)
    keep = wanted[direction]
    for i, qid in enumerate(ids.tolist()):
        if qid in keep:
            yield (direction, group_of(qid, 0, groups)), (qid, vecs[i])


class StagedReader:
    """Staged captions (caption_id, text) and images (image_id, (features, boxes)), one shard per call."""

    def __init__(self, staged_dir: str):
        self.staged_dir = staged_dir
        self._ds = None

    def _dataset(self):
        if self._ds is None:
            from retrieval_core.store import StagedDataset
            self._ds = StagedDataset(self.staged_dir, opener=common.open_file)
        return self._ds

    def id_column(self, rel: str, column: str) -> np.ndarray:
        """One id column of one staged shard (no text, no features)."""
        return self._dataset().read_shard_columns(rel, (column,)).column(column).to_numpy().astype(np.int64)

    def texts_for_pairs(self, element):
        """(caption shard group, [(shard, caption_id, (pair, requesters))]) -> (image_id, (pair, requesters,
        text)): each shard's text is read for the requested captions only."""
        _group, wanted = element
        for rel, in_shard in _by_shard(wanted):
            table = self._dataset().read_shard_columns(rel, ("caption_id", "text"))
            need = {cid for cid, _ in in_shard}
            text_of = {int(cid): text for cid, text in zip(table.column("caption_id").to_pylist(),
                                                           table.column("text").to_pylist()) if int(cid) in need}
            for caption_id, (pair, requesters) in sorted(in_shard, key=lambda w: w[1][0]):
                yield pair[1], (pair, requesters, text_of[caption_id])

    def regions_for_pairs(self, element, max_regions: int):
        """(image shard group, [(shard, image_id, (pair, requesters, text))]) -> (image_id, features, boxes,
        its pairs sorted) per image, shard by shard.

        Regions are read once per image, not once per pair, and only the ``max_regions`` the CE model uses
        (the stager keeps regions in confidence order, so the cut is lossless), in the staged dtype (collate
        widens float16 to float32 exactly as reading them would)."""
        _group, requested = element
        ds = self._dataset()
        for rel, in_shard in _by_shard(requested):
            by_image: dict[int, list] = {}
            for image_id, pair in in_shard:
                by_image.setdefault(int(image_id), []).append(pair)
            ids = np.array(sorted(by_image), dtype=np.int64)
            table = ds.read_image_shard(rel, ids, dtype=np.dtype(ds.feature_dtype))
            pos = table.position_of() if table is not None else {}
            for image_id in ids.tolist():
                if image_id not in pos:
                    raise RerankError(f"image {image_id} vanished from staged shard {rel}")
                feats, boxes = table.regions(pos[image_id])
                yield image_id, feats[:max_regions].copy(), boxes[:max_regions].copy(), \
                    sorted(by_image[image_id], key=lambda p: p[0])

    def ce_batches_for_pairs(self, element, batch_size: int, max_regions: int):
        """(image shard group, its pairs) -> the group's CE batches (``ce_batches``), scored as they come.

        Batches are made here, from one group of image shards at a time, so a worker holds one group's regions
        (~--batch-size x 8 pairs' images), never a wave's: a GroupByKey of the regions themselves made a
        local runner hold every image of the wave, in three copies (encoded, re-partitioned, decoded)."""
        return ce_batches(self.regions_for_pairs(element, max_regions), batch_size)


def _by_shard(routed):
    """[(shard, id, value)] -> [(shard, [(id, value)])], shards in name order."""
    out: dict[str, list] = {}
    for rel, item_id, value in routed:
        out.setdefault(rel, []).append((item_id, value))
    return sorted(out.items())


# ----------------------------------------------------------------------------------- pair steps
def pair_requests(element, k: int):
    """Candidates of one query -> ((caption_id, image_id), (direction, query_id)) for its top-k."""
    (direction, qid), (ids, _scores) = element
    for pair in rr.query_pairs(direction, qid, ids, k):
        yield pair, (direction, qid)


def by_caption(element):
    pair, requesters = element
    return pair[0], (pair, rr.merge_requesters(requesters))


class RouteToShard(beam.DoFn):
    """(id, value) -> (group of the staged shard holding that caption / image, (shard, id, value)).

    The id -> shard table is built once per worker from one id column per staged shard (12 bytes per item),
    so the pairs reach the shards that hold their text and regions without a join: a CoGroupByKey with the
    staged side shuffled every caption's text (or every image id) of the collection, and Beam's local
    runners keep a GroupByKey's whole input in memory. Shards are grouped in the order of ``rels``,
    ``shards_per_group`` at a time (group = shard position // shards_per_group): the unit one step reads."""

    def __init__(self, staged: "StagedReader", rels: tuple[str, ...], column: str, what: str,
                 shards_per_group: int = 1):
        self.staged, self.rels, self.column, self.what = staged, tuple(rels), column, what
        self.shards_per_group = shards_per_group

    def setup(self):
        ids = [self.staged.id_column(rel, self.column) for rel in self.rels]
        where = [np.full(len(part), n, dtype=np.int32) for n, part in enumerate(ids)]
        ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]
        self._where = np.concatenate(where)[order] if where else np.zeros(0, dtype=np.int32)

    def process(self, element):
        item_id, value = element
        pos = int(np.searchsorted(self._ids, item_id))
        found = pos < len(self._ids) and self._ids[pos] == item_id
        if not found or (pos + 1 < len(self._ids) and self._ids[pos + 1] == item_id):
            raise RerankError(f"{self.what} {item_id} is {'staged twice' if found else 'not staged'} in --staged; "
                              f"its CE pairs cannot be scored")
        shard = int(self._where[pos])
        yield shard // self.shards_per_group, (self.rels[shard], item_id, value)


def shards_per_group(shards: int, pairs: int, pairs_per_group: int) -> int:
    """Consecutive staged shards per group so that a group holds ~``pairs_per_group`` of a wave's ``pairs``
    (pairs spread over the shards; at least one shard per group)."""
    if pairs <= 0 or shards <= 0:
        return 1
    return max(1, min(shards, (shards * pairs_per_group) // pairs))


def ce_batches(images, batch_size: int):
    """Images with their pairs [(image_id, features, boxes, [(pair, requesters, text)])] -> keyed CE examples
    in batches sorted by (padded length, pair): little padding, and the same batches on every runner."""
    keyed = [((pair, requesters), (text, feats, boxes))
             for _image_id, feats, boxes, pairs in images for pair, requesters, text in pairs]
    keyed = sorted(keyed, key=lambda kv: (element_length(TASK_SCORE_PAIRS, kv[1]), kv[0][0]))
    for start in range(0, len(keyed), batch_size):
        yield keyed[start:start + batch_size]


def scores_to_queries(element):
    (pair, requesters), prediction = element
    caption_id, image_id = pair
    score = float(prediction.inference)  # float32 from the handler: stored exactly in the rankings
    _PAIRS_SCORED.inc()
    _PAIR_REQUESTS.inc(len(requesters))
    common.Progress.advance(len(requesters))  # CE modes count (query, pair) requests: the launcher's total
    for direction, qid in requesters:
        yield (direction, qid), (image_id if direction == T2I else caption_id, score)


# ---------------------------------------------------------------------------------------- ranking
def rank_emb(element, k: int):
    key, (ids, scores) = element
    _RANKED.inc()
    common.Progress.advance(1)  # EMB counts queries
    return key, rr.rank_query(ids, scores, None, k, "emb", keep=len(ids))


def rank_with_ce(element, k: int, mode: str, lam: float):
    """Every candidate of the query (its whole BE top-n), in final order, with the CE scores of its top k."""
    (direction, qid), grouped = element
    cands = list(grouped["cands"])
    if len(cands) != 1:
        raise RerankError(f"{direction} query {qid}: {len(cands)} candidate lists")
    ids, be = cands[0]
    ce = rr.ce_scores_of(ids, k, dict(grouped["ce"]), f"{direction} query {qid}")
    _RANKED.inc()
    return (direction, qid), rr.rank_query(ids, be, ce, k, mode, lam=lam, keep=len(ids))


def shard_key(element, shards: Mapping[str, int]):
    (direction, qid), result = element
    return (direction, qid % shards[direction]), (qid, result)


def write_shard(output: str, name: str, direction: str, query_ids, results, fingerprint: str) -> dict:
    """Write one rankings shard, then its progress record (what a resumed run trusts); the shard's info."""
    import pyarrow.parquet as pq

    table = rr.rankings_table(direction, query_ids, results)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    sha = common.write_atomic(common.join(output, RANKINGS_SUBDIR, name), buf.getvalue())
    info = {"kind": "shard", "direction": direction, "name": name, "queries": len(query_ids),
            "rows": table.num_rows, "sha256": sha}
    common.write_json_atomic(common.join(output, PROGRESS_DIR, name + ".json"), {**info, "plan": fingerprint})
    return info


def write_rankings_shard(element, output: str, shards: Mapping[str, int], fingerprint: str) -> dict:
    (direction, index), rows = element
    rows = sorted(rows, key=lambda r: r[0])
    name = common.shard_name(direction, index, shards[direction], ".parquet")
    _SHARDS_WRITTEN.inc()
    return write_shard(output, name, direction, [q for q, _ in rows], [r for _, r in rows], fingerprint)


# ----------------------------------------------------------------------------------------- graph
@dataclass(frozen=True)
class Resolved:
    """A plan resolved against its inputs, as plain typed values that pickle to the workers."""
    plan: RerankPlan
    query_ids: Mapping[str, np.ndarray]  # every query of the run per direction (sorted int64)
    pools: Mapping[str, int]  # candidate pool size per direction
    candidates: Mapping[str, int]  # BE candidates retrieved and stored per query (n)
    ce_k: int  # BE top-k the CE scores (the whole pool for --mode ce; 0 for emb)
    searchers: Mapping[str, SearcherSpec]
    described: Mapping[str, str]
    query_shards: tuple[tuple[str, str, str, str], ...]  # (direction, modality, embedding shard, sha256)
    out_shards: Mapping[str, int]  # ranking shards per direction
    caption_shards: tuple[str, ...]
    image_shards: tuple[str, ...]
    ce_max_regions: int
    be_model: Mapping[str, str]  # the embeddings manifest's model entry
    queries_file: Optional[Mapping]  # {path, sha256, counts} of --queries
    fingerprint: str  # what a finished shard must have been computed under to be reused
    staged_sha256: Mapping[str, str] = None  # staged_fingerprints(): recorded for benchmarks.evaluate


def build_graph(p: beam.Pipeline, res: Resolved, wave: Mapping[str, frozenset]) -> None:
    """The Beam graph ranking the queries ``wave`` ({direction: query ids}) of a resolved plan."""
    plan = res.plan
    query_groups = {d: max(1, math.ceil(len(q) / plan.search_batch_size / 4)) for d, q in wave.items()}
    query_tasks = [(d, m, name, sha, query_groups[d]) for d, m, name, sha in res.query_shards if wave.get(d)]
    cands = (p | "query shards" >> beam.Create(query_tasks)
             | "read queries" >> beam.FlatMap(read_query_vectors, plan.embeddings, dict(wave))
             | "group queries" >> beam.GroupByKey()
             | "search" >> beam.ParDo(SearchBatch({d: res.searchers[d] for d in wave}, res.candidates,
                                                  plan.search_batch_size, plan.threads)))
    report_parts = []
    if plan.mode == "emb":
        ranked = cands | "rank" >> beam.Map(rank_emb, plan.k)
    else:
        requested = sum(_shard_pairs(res, d, q) for d, q in wave.items())
        # ~8 length-sorted batches per group of image shards: little padding, one group's regions in memory
        image_group = shards_per_group(len(res.image_shards), requested, plan.batch_size * CE_BATCHES_PER_GROUP)
        staged = StagedReader(plan.staged)
        requests = cands | "pairs" >> beam.FlatMap(pair_requests, res.ce_k)
        unique = requests | "dedupe pairs" >> beam.GroupByKey()
        # Pairs go to the caption shard holding their text, then to the group of image shards holding their
        # regions: each staged shard is read once, for the items asked for, and shuffles carry pairs (with
        # text), never the collection or the regions.
        with_text = (unique | "key by caption" >> beam.Map(by_caption)
                     | "route to caption shard" >> beam.ParDo(RouteToShard(staged, res.caption_shards,
                                                                           "caption_id", "caption"))
                     | "group by caption shard" >> beam.GroupByKey()
                     | "read texts" >> beam.FlatMap(staged.texts_for_pairs))
        batches = (with_text
                   | "route to image shards" >> beam.ParDo(RouteToShard(staged, res.image_shards, "item_id", "image",
                                                                        image_group))
                   | "group by image shards" >> beam.GroupByKey()
                   | "read regions, CE batches" >> beam.FlatMap(staged.ce_batches_for_pairs, plan.batch_size,
                                                                res.ce_max_regions))
        handler = VLModelHandler(plan.cross_encoder, TASK_SCORE_PAIRS, device=_HANDLER_DEVICE[plan.device],
                                 max_batch_size=plan.batch_size, num_threads=plan.threads,
                                 model_copies=plan.model_copies, quantize=plan.quantize)
        scored = batches | "CE score" >> RunInference(KeyedModelHandler(handler).with_no_batching())
        ce_scores = scored | "scores to queries" >> beam.FlatMap(scores_to_queries)
        ranked = ({"cands": cands, "ce": ce_scores}
                  | "join scores" >> beam.CoGroupByKey()
                  | "rank" >> beam.Map(rank_with_ce, res.ce_k, plan.rank_mode, plan.lam))
        # Counts via CombinePerKey: CombineGlobally's default value is a side input, which DaskRunner
        # evaluates in a second graph submission (dask then warns about conflicting task keys).
        report_parts += [
            scored | "one per pair" >> beam.Map(lambda _: ("ce_pairs_scored", 1)),
            requests | "one per request" >> beam.Map(lambda _: ("ce_pairs_requested", 1)),
        ]
    written = (ranked
               | "key by output shard" >> beam.Map(shard_key, res.out_shards)
               | "group output shards" >> beam.GroupByKey()
               | "write rankings" >> beam.Map(write_rankings_shard, plan.output, res.out_shards, res.fingerprint))
    counts = ((report_parts or [p | "no CE" >> beam.Create([("ce_pairs_scored", 0)])])
              | "flatten counts" >> beam.Flatten() | "sum counts" >> beam.CombinePerKey(sum)
              | "count report" >> beam.MapTuple(lambda name, n: {"kind": "count", "name": name, "value": n}))
    common.WriteRunReport.apply((written, counts), plan.output)  # last step: DaskRunner computes only its graph


# ------------------------------------------------------------------------------------- launcher
def _ce_model_folder(model_dir: str):
    """The CE model folder (retrieval_core.checkpoints: ours, MMT-Retrieval, OSCAR), refused without a CE head."""
    from retrieval_core.checkpoints import CheckpointError, inspect_model_folder
    try:
        return inspect_model_folder(model_dir, files=common.BEAM_FILES).require(("ce",))
    except CheckpointError as exc:
        raise RerankError(f"CE model: {exc}") from None


def _model_max_regions(model_dir: str) -> int:
    """Regions per image the CE model reads; more would be cut by its collator anyway."""
    return _ce_model_folder(model_dir).max_regions


def _model_fingerprint(model_dir: str) -> str:
    from pipelines.encode import EncodeError, model_fingerprint
    _ce_model_folder(model_dir)
    try:
        return model_fingerprint(model_dir)
    except EncodeError as exc:
        raise RerankError(str(exc)) from None


def _file_fingerprint(path: str) -> str:
    return common.sha256_file(path) if common.exists(path) else "missing"


def _searcher_spec(plan: RerankPlan, direction: str, emb_manifest: dict) -> tuple[SearcherSpec, int, str]:
    """(spec, pool size, description) of one direction's candidate search."""
    pool_modality = schema.KIND_IMAGE if direction == T2I else "text"
    index_dir = plan.index_of(direction)
    if index_dir:
        from retrieval_core.index import INDEX_MANIFEST, check_search_params, load_index_manifest
        manifest = load_index_manifest(index_dir, common.BEAM_FILES)
        if manifest.get("modality", pool_modality) != pool_modality:
            raise RerankError(f"{direction} needs a {pool_modality} index; {index_dir} indexes "
                              f"{manifest.get('modality')}")
        _check_index_source("--index" if direction == T2I else "--text-index", index_dir, manifest,
                            plan.embeddings, emb_manifest, pool_modality)
        params = {name: v for name, v in (("nprobe", plan.nprobe), ("efSearch", plan.ef_search)) if v is not None}
        if not params:  # the parameters build_index --index-factory auto tuned and recorded, if any
            params = {name: int(v) for name, v in (manifest.get("search_params") or {}).items()}
        try:  # refuse a parameter the index lacks now, not in a worker after the job started
            check_search_params(manifest["factory"], int(manifest["d"]), manifest["metric"], **params)
        except ValueError as exc:
            raise RerankError(f"{index_dir} ({manifest['factory']}): {exc}") from None
        spec = SearcherSpec("index", index_dir, pool_modality,
                            _file_fingerprint(common.join(index_dir, INDEX_MANIFEST)), tuple(sorted(params.items())))
        metric = manifest["metric"]
        scored = "; be_score = -squared L2 distance" if metric == "l2" else ""
        return spec, int(manifest["ntotal"]), f"FAISS index {index_dir} ({manifest['factory']}, {metric}{scored})"
    entry = emb.modality_entry(emb_manifest, pool_modality)
    spec = SearcherSpec("exact", plan.embeddings, pool_modality, _file_fingerprint(emb.manifest_path(plan.embeddings)))
    return spec, int(entry["count"]), f"exact search over {pool_modality} embeddings in {plan.embeddings}"


def _check_index_source(flag: str, index_dir: str, index_manifest: dict, emb_dir: str, emb_manifest: dict,
                        modality: str) -> None:
    """Refuse an index built from other embeddings than --embeddings: its vectors would be compared with
    query embeddings of another model or encoding (issue 14: such a run exited 0 and scored R@1 0.00).
    build_index records each index shard's source embedding shard and its sha256: they must be the
    --embeddings shards of that modality."""
    built_from = {s.get("source"): s.get("source_sha256") for s in index_manifest.get("shards", [])}
    have = {s["name"]: s["sha256"] for s in emb.modality_entry(emb_manifest, modality)["shards"]}
    if built_from != have:
        src = index_manifest.get("embeddings", {})
        differ = len(set(built_from.items()) ^ set(have.items()))
        raise RerankError(f"{flag} {index_dir} was built from the {modality} embeddings in {src.get('dir')} "
                          f"(embeddings manifest sha256 {str(src.get('manifest_sha256'))[:12]}...), not from "
                          f"--embeddings {emb_dir} (sha256 {_file_fingerprint(emb.manifest_path(emb_dir))[:12]}...;"
                          f" {differ} shard entries differ): rebuild the index from --embeddings or pass the "
                          f"embeddings it was built from")


def _split_query_ids(ds, direction: str, collection: Optional[str], split: Optional[str]) -> np.ndarray:
    """Sorted ids of the split's queries (captions for t2i, images for i2t), read one id column per shard:
    the launcher never holds the captions' text."""
    kind, column = ("captions", "caption_id") if direction == T2I else ("images", "item_id")
    parts = [ds.read_shard_columns(rel, (column,), split).column(column).to_numpy()
             for rel in ds.shard_names(kind, collection)]
    return np.sort(np.concatenate(parts).astype(np.int64)) if parts else np.zeros(0, dtype=np.int64)


def _read_queries_file(plan: RerankPlan, split_ids: Mapping[str, np.ndarray]
                       ) -> tuple[dict[str, np.ndarray], Optional[dict]]:
    """The queries of the run per direction: every query of the collection/split, or those --queries lists
    (a Parquet file with columns direction, query_id), which must all be queries of that collection/split.
    Also returns the manifest's record of the file (path, sha256, per-direction counts)."""
    if plan.queries is None:
        return dict(split_ids), None
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = plan.queries
    if not common.exists(path):
        raise RerankError(f"--queries {path}: file not found")
    data = common.read_bytes(path)
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        raise RerankError(f"--queries {path}: not a Parquet file ({exc})") from None
    missing = [c for c in ("direction", "query_id") if c not in table.column_names]
    if missing:
        raise RerankError(f"--queries {path}: missing column(s) {missing} (needs direction, query_id)")
    if not pa.types.is_integer(table.schema.field("query_id").type) or table.column("query_id").null_count             or table.column("direction").null_count:
        raise RerankError(f"--queries {path}: query_id must be non-null integers (int64) and direction non-null, "
                          f"got {table.schema.field('query_id').type}")
    directions = np.asarray(table.column("direction").to_pylist(), dtype=object)
    ids = table.column("query_id").to_numpy().astype(np.int64)
    unknown = sorted(set(directions.tolist()) - set(DIRECTIONS))
    if unknown:
        raise RerankError(f"--queries {path}: unknown direction(s) {unknown} (expected {T2I!r} / {I2T!r})")
    extra = sorted(set(directions.tolist()) - set(plan.directions))
    if extra:
        raise RerankError(f"--queries {path} lists {extra} queries but --directions is {','.join(plan.directions)}")
    out, what = {}, {T2I: "captions", I2T: "images"}
    for d in plan.directions:
        wanted = ids[directions == d]
        if len(wanted) == 0:
            raise RerankError(f"--queries {path} lists no {d} queries; leave {d} out of --directions")
        uniq = np.unique(wanted)
        if len(uniq) != len(wanted):
            raise RerankError(f"--queries {path}: duplicate {d} query id(s)")
        strangers = np.setdiff1d(uniq, split_ids[d])
        if len(strangers):
            raise RerankError(f"--queries {path}: {len(strangers)} {d} query id(s) are not {what[d]} of "
                              f"collection={plan.collection}, split={plan.split} in {plan.staged} "
                              f"(e.g. {strangers[:5].tolist()})")
        out[d] = uniq
    return out, {"path": path, "sha256": common.sha256_bytes(data), "counts": {d: len(q) for d, q in out.items()}}


def staged_fingerprints(ds) -> dict[str, str]:
    """{"<images|captions>/<collection>": content sha256} of a staged folder: what a rankings manifest records
    and benchmarks.evaluate compares with the --staged it is given."""
    return {f"{kind}/{c}": ds.content_sha256(kind, c) for c in ds.collections for kind in ("images", "captions")}


def _pool_collections(ds, emb_manifest: dict) -> list[str]:
    """The staged collections whose items can be candidates: those the embeddings were encoded from (the
    pools), not only --collection's (which picks the queries): in a distractor run the CE scores the other
    collections' images and captions too. Embeddings that record no inputs: every staged collection."""
    encoded = (emb_manifest.get("inputs") or {}).get("collections")
    return [c for c in ds.collections if c in encoded] if encoded else list(ds.collections)


def _check_embeddings_match_staged(plan: RerankPlan, ds, emb_manifest: dict) -> None:
    """Refuse embeddings encoded from other staged shards than --staged: their ids could match while the
    captions and regions the CE reads are other ones (a silently wrong ranking)."""
    from pipelines.encode import staged_inputs_sha256

    recorded = (emb_manifest.get("inputs") or {}).get("staged_sha256")
    if not recorded:
        log.warning("%s records no staged fingerprint (encoded before fingerprints): not checked against %s",
                    plan.embeddings, plan.staged)
        return
    for key, sha in sorted(recorded.items()):
        modality, collection = key.split("/", 1)
        if collection not in ds.collections:
            continue  # a collection --staged lacks: its ids would be missing, which resolve reports
        here = staged_inputs_sha256(ds, modality, collection)
        if here != sha:
            raise RerankError(f"--embeddings {plan.embeddings} were encoded from other {key} shards (sha256 "
                              f"{sha[:12]}...) than --staged {plan.staged} holds ({here[:12]}...); re-encode, or "
                              f"pass the staged folder they were encoded from")


def resolve(plan: RerankPlan) -> Resolved:
    """Check the plan against its inputs (staged dir, embeddings, indexes, models, --queries) and fix
    everything the graph needs; every inconsistency is a one-line RerankError / ValueError here, before
    anything runs."""
    from retrieval_core.store import StagedDataset

    ds = StagedDataset(plan.staged, opener=common.open_file)
    if plan.collection is not None and plan.collection not in ds.collections:
        raise RerankError(f"collection {plan.collection!r} is not staged in {plan.staged} (have {ds.collections})")
    split_ids = {d: _split_query_ids(ds, d, plan.collection, plan.split) for d in plan.directions}
    query_ids, queries_file = _read_queries_file(plan, split_ids)

    emb_manifest_path = emb.manifest_path(plan.embeddings)
    emb_manifest = emb.load_embeddings_manifest(plan.embeddings, common.BEAM_FILES)
    _check_embeddings_match_staged(plan, ds, emb_manifest)
    searchers, pools, described, query_shards = {}, {}, {}, []
    for d in plan.directions:
        if len(query_ids[d]) == 0:
            raise RerankError(f"{d}: no queries in {plan.staged} (collection={plan.collection}, split={plan.split})")
        q_modality = "text" if d == T2I else schema.KIND_IMAGE
        have = emb.read_modality_ids(plan.embeddings, q_modality, common.BEAM_FILES)
        missing = np.setdiff1d(query_ids[d], have)
        if len(missing):
            raise RerankError(f"{d}: {len(missing)} query id(s) have no {q_modality} embedding in "
                              f"{plan.embeddings} (e.g. {missing[:5].tolist()}); encode that split first")
        searchers[d], pools[d], described[d] = _searcher_spec(plan, d, emb_manifest)
        query_shards += [(d, q_modality, s["name"], s["sha256"])
                         for s in emb.modality_entry(emb_manifest, q_modality)["shards"]]

    keep = max(plan.k, 10)
    if plan.mode == "ce":  # exhaustive: every pool item is a candidate and CE-scored
        total_pairs = sum(len(query_ids[d]) * pools[d] for d in plan.directions)
        if total_pairs > plan.max_exhaustive_pairs:
            raise RerankError(f"--mode ce would cross-encode {total_pairs:,} pairs (queries x pool), above "
                              f"--max-exhaustive-pairs {plan.max_exhaustive_pairs:,}; use --mode co")
        candidates = {d: pools[d] for d in plan.directions}
        ce_k = max(pools.values())
    else:
        candidates = {d: keep for d in plan.directions}
        ce_k = 0 if plan.mode == "emb" else plan.k
    ce_model = plan.cross_encoder
    ce_max_regions = _model_max_regions(ce_model) if ce_model else 0
    pool_collections = _pool_collections(ds, emb_manifest)
    out_shards = {d: max(1, math.ceil(len(q) / plan.queries_per_shard)) for d, q in query_ids.items()}
    fingerprint_of = {
        "rankings_schema": schema.RANKINGS_SCHEMA_VERSION, "mode": plan.mode, "k": plan.k,
        "lam": plan.applied_lam, "directions": list(plan.directions),
        "queries": {d: hashlib.sha256(q.tobytes()).hexdigest() for d, q in query_ids.items()},
        "candidates": candidates, "ce_k": ce_k, "embeddings": _file_fingerprint(emb_manifest_path),
        "search": {d: {"kind": s.kind, "fingerprint": s.fingerprint, "params": s.params} for d, s in searchers.items()},
        "ce_model": _model_fingerprint(ce_model) if ce_model else None, "ce_max_regions": ce_max_regions,
        "ce_score": _ce_model_folder(ce_model).ce_score if ce_model else None,
        "staged": _file_fingerprint(common.join(plan.staged, "summary.json")),
        "batch_size": plan.batch_size, "search_batch_size": plan.search_batch_size, "device": plan.device,
        "queries_per_shard": plan.queries_per_shard, "shards_per_wave": plan.shards_per_wave,
        "pairs_per_wave": plan.pairs_per_wave,
        **({"quantize": plan.quantize} if plan.quantize != "none" else {}),  # fp32 runs keep their fingerprint
    }
    fingerprint = hashlib.sha256(json.dumps(fingerprint_of, sort_keys=True).encode()).hexdigest()
    return Resolved(
        plan=plan, query_ids=query_ids, pools=pools, candidates=candidates, ce_k=ce_k, searchers=searchers,
        described=described, query_shards=tuple(query_shards), out_shards=out_shards,
        caption_shards=tuple(s for c in pool_collections for s in ds.shard_names("captions", c)) if ce_model else (),
        image_shards=tuple(s for c in pool_collections for s in ds.shard_names("images", c)) if ce_model else (),
        ce_max_regions=ce_max_regions, be_model=emb_manifest["model"], queries_file=queries_file,
        fingerprint=fingerprint, staged_sha256=staged_fingerprints(ds))


def resolve_auto(plan: RerankPlan) -> tuple[RerankPlan, Optional[dict]]:
    """--mode auto: the plan with the mode and lam that give the best mR on the --tune-on dev run
    (benchmarks.evaluate.choose_fusion, derived from the dev run's stored BE and CE scores at this run's k),
    and the record of that choice for the manifest. Other plans pass through unchanged (record None).

    The dev run must rank another split (or collection) than this run - a fusion tuned on the evaluated
    queries would report an optimistic recall - with the same bi-encoder (embeddings model sha256) and
    cross-encoder (folder fingerprint), at a depth >= k."""
    if plan.mode != AUTO:
        return plan, None
    from benchmarks.evaluate import EvaluationError, choose_fusion, read_run_manifest

    try:
        _, dev = read_run_manifest(plan.tune_on)
    except EvaluationError as exc:
        raise RerankError(f"--tune-on: {exc}") from None
    if (dev.get("split"), dev.get("collection")) == (plan.split, plan.collection) and \
            _same_path(str(dev.get("staged")), plan.staged):
        raise RerankError(f"--tune-on {plan.tune_on} ranked the same queries (split {plan.split!r}) this run "
                          f"evaluates: choose the fusion on a held-out split (e.g. a --split dev run)")
    emb_model = emb.load_embeddings_manifest(plan.embeddings, common.BEAM_FILES)["model"]
    if dev.get("be_model", {}).get("sha256") != emb_model.get("sha256"):
        raise RerankError(f"--tune-on {plan.tune_on} was retrieved by another bi-encoder "
                          f"({dev.get('be_model', {}).get('path')}) than --embeddings ({emb_model.get('path')})")
    if not dev.get("ce_model") or _model_fingerprint(dev["ce_model"]) != _model_fingerprint(plan.cross_encoder):
        raise RerankError(f"--tune-on {plan.tune_on} was reranked by another cross-encoder ({dev.get('ce_model')}) "
                          f"than {plan.cross_encoder}")
    if dev.get("quantize", "none") != plan.quantize:
        raise RerankError(f"--tune-on {plan.tune_on} scored with --quantize {dev.get('quantize', 'none')}, this run "
                          f"with {plan.quantize}: the fusion would be chosen on other CE scores")
    try:
        choice = choose_fusion(plan.tune_on, dev["staged"], plan.k)
    except EvaluationError as exc:
        raise RerankError(f"--tune-on: {exc}") from None
    print(f"--mode auto: {choice['label']} (dev mR {choice['dev_mR'][choice['label']]:.2f} on {plan.tune_on}, "
          f"split {choice['dev_split']}; co {choice['dev_mR']['co']:.2f})", flush=True)
    chosen = replace(plan, mode=choice["mode"], lam=choice["lam"] if choice["lam"] is not None else plan.lam,
                     tune_on=None)
    return chosen, choice


def _same_path(a: str, b: str) -> bool:
    """The same folder: local paths compared absolute, URLs as written (abspath would mangle them)."""
    norm = lambda p: p.rstrip("/") if is_url(p) else os.path.abspath(p)  # noqa: E731
    return norm(a) == norm(b)


def _expected_shards(res: Resolved) -> dict[str, tuple[str, np.ndarray]]:
    """{shard name: (direction, its query ids)} of every ranking shard of the run, in name order."""
    out = {}
    for d, ids in res.query_ids.items():
        n = res.out_shards[d]
        shard = ids % n
        order = np.argsort(shard, kind="stable")  # ids stay sorted within a shard
        parts = np.split(ids[order], np.cumsum(np.bincount(shard, minlength=n))[:-1])
        for i, part in enumerate(parts):
            out[common.shard_name(d, i, n, ".parquet")] = (d, part)
    return dict(sorted(out.items()))


def _shard_pairs(res: Resolved, direction: str, ids) -> int:
    """CE pairs the queries ``ids`` of one direction request."""
    return len(ids) * min(res.ce_k, res.pools[direction])


def plan_waves(names: Sequence[str], pairs_of: Callable[[str], int], shards_per_wave: int,
               pairs_per_wave: int) -> list[list[str]]:
    """The shards, in order, cut into waves (one Beam job each) of at most ``shards_per_wave`` shards and
    ``pairs_per_wave`` CE pairs (a wave of one shard may hold more). A local runner holds a wave's CE pairs,
    with their texts, candidates and scores, in memory: capping pairs, not just shards, keeps a rerank
    process's memory flat in the number of queries (when the regions still travelled with the pairs, 10,000
    queries at k = 20 in one wave held 7.6 GB at 100k images)."""
    waves: list[list[str]] = []
    pairs = 0
    for name in names:
        n = pairs_of(name)
        if not waves or len(waves[-1]) >= shards_per_wave or pairs + n > pairs_per_wave:
            waves.append([])
            pairs = 0
        waves[-1].append(name)
        pairs += n
    return waves


def _finished_shards(res: Resolved, expected: Mapping[str, tuple[str, np.ndarray]]) -> dict[str, dict]:
    """The shards an earlier run of the same plan finished: a progress record with this plan's fingerprint
    and the shard's query count, and a shard file that still matches its sha256."""
    output = res.plan.output
    done = {}
    for name, (d, ids) in expected.items():
        record = common.join(output, PROGRESS_DIR, name + ".json")
        if not common.exists(record):
            continue
        try:
            info = common.read_json(record)
        except (OSError, ValueError):
            continue
        if info.get("plan") == res.fingerprint and info.get("queries") == len(ids) and \
                common.shard_is_valid(common.join(output, RANKINGS_SUBDIR, name), info.get("sha256")):
            done[name] = {key: info[key] for key in ("kind", "direction", "name", "queries", "rows", "sha256")}
    return done


def run(plan: RerankPlan, beam_args: tuple[str, ...] = ()) -> Optional[dict]:
    """Run the plan's Beam job(s), one per wave of unfinished shards, and write rankings_manifest.json;
    returns the manifest, or None for a dry run (--dry_run: DataflowRunner translated the first wave's graph
    and nothing ran; no output is read or written)."""
    t0 = time.time()
    options = common.pipeline_options(beam_args)
    plan, fusion_choice = resolve_auto(plan)
    res = resolve(plan)
    expected = _expected_shards(res)
    dry_run = common.is_dry_run(options)
    finished = {} if dry_run else _finished_shards(res, expected)
    names = list(expected)
    waves = plan_waves(names, lambda name: _shard_pairs(res, *expected[name]), plan.shards_per_wave,
                       plan.pairs_per_wave)

    if not dry_run:
        common.makedirs(plan.output)
        manifest_path = common.join(plan.output, RANKINGS_MANIFEST)
        if common.exists(manifest_path):  # until this run finishes, the directory holds no complete run
            from apache_beam.io.filesystems import FileSystems
            FileSystems.delete([manifest_path])
    shards, counts, waves_run = dict(finished), {"ce_pairs_requested": 0, "ce_pairs_scored": 0}, 0
    progress = contextlib.nullcontext() if dry_run else \
        common.Progress.running(*_progress_total(res, expected, finished), options)
    beam_counters = None  # summed over the waves; None when the runner reports no metrics
    with progress:
        for wave_names in waves:
            todo = [name for name in wave_names if name not in finished]
            for name in [n for n in todo if len(expected[n][1]) == 0]:  # no query hashed here (tiny runs)
                if not dry_run:
                    shards[name] = write_shard(plan.output, name, expected[name][0], [], [], res.fingerprint)
            todo = [name for name in todo if len(expected[name][1])]
            if not todo:
                continue
            wave: dict[str, set] = {}
            for name in todo:
                d, ids = expected[name]
                wave.setdefault(d, set()).update(ids.tolist())
            ran = _run_wave(options, res, {d: frozenset(ids) for d, ids in wave.items()})
            if ran is None:
                return None
            report, wave_counters = ran
            beam_counters = common.add_counters(beam_counters, wave_counters)
            waves_run += 1
            for item in report:
                if item["kind"] == "count":
                    counts[item["name"]] += int(item["value"])
                elif item["kind"] == "shard":
                    shards[item["name"]] = item
            for name in todo:
                got = shards.get(name, {}).get("queries")
                if got != len(expected[name][1]):
                    raise RerankError(f"{name}: {got} queries ranked, {len(expected[name][1])} expected")
    if dry_run:
        print("dry run: no shard has queries; nothing to translate")
        return None
    if waves_run:
        print(common.counter_line(METRICS_NAMESPACE, beam_counters, common.runner_name(options)))

    manifest = _manifest(res, [shards[name] for name in names], len(finished), waves_run, counts,
                         common.runner_name(options), time.time() - t0)
    manifest["fusion_choice"] = fusion_choice
    common.write_json_atomic(common.join(plan.output, RANKINGS_MANIFEST), manifest)
    _delete_unlisted(plan.output, set(names))
    for d in plan.directions:
        print(f"{d}: {manifest['queries'][d]} queries ranked ({res.described[d]}, pool {res.pools[d]})")
    if plan.mode != "emb":
        overlap = " (t2i/i2t overlap scored once)" if len(plan.directions) == 2 else ""
        print(f"CE: {counts['ce_pairs_scored']} unique pairs scored for {counts['ce_pairs_requested']} "
              f"requested{overlap}")
    print(f"rankings: {common.join(plan.output, RANKINGS_SUBDIR)} ({len(names)} shard(s): {len(finished)} kept from "
          f"an earlier run of this plan, {len(names) - len(finished)} computed in {waves_run} wave(s)); "
          f"wall time {manifest['wall_s']:.1f} s")
    return manifest


def _progress_total(res: Resolved, expected: Mapping[str, tuple[str, np.ndarray]],
                    finished: Mapping[str, dict]) -> tuple[int, str, str]:
    """(total, unit, label) of the terminal bar over every wave: queries for EMB, else the (query, pair) CE
    requests of the unfinished shards (an upper bound when an index returns fewer than k candidates)."""
    todo = [expected[name] for name in expected if name not in finished]
    if res.plan.mode == "emb":
        return sum(len(ids) for _, ids in todo), "queries", "rerank"
    return sum(_shard_pairs(res, d, ids) for d, ids in todo), "pairs", "rerank CE"


def _run_wave(options, res: Resolved, wave: Mapping[str, frozenset]) -> Optional[tuple[list[dict], Optional[dict]]]:
    """One Beam job over the queries ``wave``: its run report and Beam counters, or None for a dry run."""
    output = res.plan.output
    p = beam.Pipeline(options=options)
    build_graph(p, res, wave)
    if common.is_dry_run(options):
        print(f"dry run: the rerank graph of {sum(len(v) for v in wave.values())} queries is translated for "
              f"{common.runner_name(options)}; nothing runs")
    else:
        common.clear_run_dir(output)  # a killed run's report must not be read as this one's
    result = common.run_pipeline(p)
    if result is None:
        return None
    report = common.read_run_report(output)
    common.clear_run_dir(output)
    counters = common.counter_values(result, METRICS_NAMESPACE)
    del p, result
    # a local runner ran the wave in this process: hand what it freed back before the next one (at 100k,
    # RSS between waves 0.9-1.2 GB instead of 1.4-1.8; the job's peak, inside its image->text waves, did not move)
    common.release_memory()
    return report, counters


def _params_used(plan: RerankPlan, spec: SearcherSpec) -> dict:
    if spec.kind != "index":
        source = "exact search"
    elif plan.nprobe is not None or plan.ef_search is not None:
        source = "command line"
    else:
        source = "index manifest" if spec.params else "faiss defaults"
    return {"params": dict(spec.params), "source": source}


def _manifest(res: Resolved, shards: list[dict], reused: int, waves_run: int, counts: dict, runner: str,
              wall_s: float) -> dict:
    plan = res.plan
    return {
        "schema_version": schema.RANKINGS_SCHEMA_VERSION, "created_by": CREATED_BY,
        "mode": plan.mode, "k": plan.k, "lam": plan.applied_lam, "directions": list(plan.directions),
        "candidates": {d: min(res.candidates[d], res.pools[d]) for d in plan.directions},
        "ce_depth": {d: min(res.ce_k, res.pools[d]) for d in plan.directions},
        "collection": plan.collection, "split": plan.split, "staged": plan.staged,
        "staged_sha256": dict(res.staged_sha256 or {}), "embeddings": plan.embeddings,
        "be_model": dict(res.be_model), "ce_model": plan.cross_encoder,
        # the CE score key the ce_score column holds (model.CE_SCORES: logit_diff = log-odds, logit1 = MMT's)
        "ce_score_key": _ce_model_folder(plan.cross_encoder).ce_score if plan.cross_encoder else None,
        "quantize": plan.quantize,  # the serving precision of the CE scores (schema.QUANTIZE_CHOICES)
        "search": dict(res.described),
        "search_params": {"nprobe": plan.nprobe, "efSearch": plan.ef_search},
        # what each direction's search ran with, and where it came from
        "search_params_used": {d: _params_used(plan, res.searchers[d]) for d in plan.directions},
        "pool_size": dict(res.pools),
        "queries": {d: len(q) for d, q in res.query_ids.items()}, "queries_file": res.queries_file,
        "plan_fingerprint": res.fingerprint,
        "shards": [{key: s[key] for key in ("direction", "name", "queries", "rows", "sha256")} for s in shards],
        "shards_reused": reused, "waves_run": waves_run,
        "queries_per_shard": plan.queries_per_shard, "shards_per_wave": plan.shards_per_wave,
        "pairs_per_wave": plan.pairs_per_wave,
        # CE work of this invocation (a resumed run scores only the pairs of the shards it computed)
        "ce_pairs_requested": counts["ce_pairs_requested"], "ce_pairs_scored": counts["ce_pairs_scored"],
        "runner": runner, "wall_s": round(wall_s, 3),
    }


def _delete_unlisted(output: str, keep: set[str]) -> None:
    """Delete ranking files and progress records the new manifest does not list: shards of an earlier run
    with another shard count or other directions, and temp files of a killed run. Called only after the new
    shards and manifest are written, so the directory never lacks a shard the manifest on disk lists."""
    from apache_beam.io.filesystems import FileSystems

    for sub, suffix in ((RANKINGS_SUBDIR, ""), (PROGRESS_DIR, ".json")):
        pattern = common.join(output, sub, "*")
        found = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]
        stale = sorted(path for path in found if path.rsplit("/", 1)[-1] not in {n + suffix for n in keep})
        if stale:
            FileSystems.delete(stale)
            log.info("deleted %d file(s) of an earlier run: %s", len(stale), stale[:5])


# ------------------------------------------------------------------------------------------- CLI
@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--staged", required=True, help="staged directory (queries, captions, regions)")
@click.option("--embeddings", required=True, help="embeddings directory (pipelines.encode output)")
@click.option("--index", help="image FAISS index for t2i, built from --embeddings (default: exact search)")
@click.option("--text-index", help="caption FAISS index for i2t, built from --embeddings (default: exact search)")
@click.option("--be-model", help="BE model folder (not needed: embeddings exist; used as CE for JOIN models)")
@click.option("--ce-model", help="CE model folder (SEP+CO): ours, MMT-Retrieval or OSCAR; default --be-model "
                                 "(JOIN+CO)")
@click.option("--mode", type=click.Choice(CLI_MODES, case_sensitive=False), default="co", show_default=True)
@click.option("--lam", type=float, default=0.5, show_default=True, help="ADD/NORM_ADD weight of the BE score")
@click.option("--tune-on", help="--mode auto: a CE-scored rerank run of the same models on a held-out split; "
                                "the fusion (co, add_lam, norm_add_lam) with its best mR is used and recorded")
@click.option("--k", type=int, default=20, show_default=True,
              help="rerank depth; every query stores its BE top max(k, 10)")
@click.option("--directions", default="t2i,i2t", show_default=True)
@click.option("--collection", help="queries of this collection only")
@click.option("--split", default="test", show_default=True, help="queries of this split")
@click.option("--queries", "queries_file",
              help="Parquet file (direction, query_id): rank only these queries of the collection/split")
@click.option("--output", required=True, help="run directory: rankings/ and rankings_manifest.json")
@click.option("--batch-size", type=int, default=64, show_default=True, help="CE batch size")
@click.option("--search-batch-size", type=int, default=256, show_default=True)
@click.option("--device", type=click.Choice(DEVICES, case_sensitive=False), default="cpu", show_default=True)
@click.option("--threads", type=int, help="pin torch/faiss threads per worker process (default: leave as is)")
@click.option("--nprobe", type=click.IntRange(min=1),
              help="IVF lists searched per query in every index shard (default: the index manifest's, recorded "
                   "by build_index --index-factory auto; else faiss' 1)")
@click.option("--ef-search", type=click.IntRange(min=1),
              help="HNSW search breadth (efSearch) in every index shard (default: the index manifest's; "
                   "else faiss' 16)")
@click.option("--model-copies", type=int, help="CE model copies per machine (Dataflow GPU: 1)")
@click.option("--quantize", type=click.Choice(schema.QUANTIZE_CHOICES), default="none", show_default=True,
              help="int8: dynamic int8 quantisation of the CE's Linear layers (CPU only); bf16: matrix products "
                   "in bfloat16 (CUDA, or a CPU with native bf16: avx512_bf16/AMX, where it is ~2x faster). Scores "
                   "differ slightly from float32; recorded in the rankings manifest.")
@click.option("--max-exhaustive-pairs", type=int, default=200_000, show_default=True)
@click.option("--queries-per-shard", type=int, default=1_000, show_default=True,
              help="queries per ranking shard (the unit a rerun of a killed job keeps)")
@click.option("--shards-per-wave", type=int, default=10, show_default=True,
              help="ranking shards per Beam job: a killed run loses at most its current wave "
                   "(on Dataflow, where each job starts workers, raise it)")
@click.option("--pairs-per-wave", type=int, default=20_000, show_default=True,
              help="CE pairs per Beam job (but at least one shard): what a local runner holds in memory, "
                   "with the images' regions")
@click.pass_context
def main(ctx, staged, embeddings, index, text_index, be_model, ce_model, mode, lam, tune_on, k, directions, collection,
         split, queries_file, output, batch_size, search_batch_size, device, threads, nprobe, ef_search,
         model_copies, quantize, max_exhaustive_pairs, queries_per_shard, shards_per_wave, pairs_per_wave):
    """BE retrieval (+ CE reranking) of every query of a split, in both directions, as Beam jobs.
    Unknown --flags go to Beam (--runner, --dask_client_address, ...).

    Counters namespace: rerank (queries_searched, ce_pairs_scored, ce_pair_requests, queries_ranked,
    ranking_shards_written)."""
    common.configure_logging()
    common.check_beam_flags(ctx.args)
    with common.cli_errors(RerankError):
        plan = RerankPlan(
            staged=staged, embeddings=embeddings, output=output, mode=mode, k=k, lam=lam,
            directions=tuple(d.strip() for d in directions.split(",") if d.strip()), index=index,
            text_index=text_index, ce_model=ce_model, be_model=be_model, collection=collection, split=split,
            queries=queries_file, batch_size=batch_size, search_batch_size=search_batch_size, device=device,
            threads=threads, model_copies=model_copies, max_exhaustive_pairs=max_exhaustive_pairs,
            queries_per_shard=queries_per_shard, shards_per_wave=shards_per_wave, pairs_per_wave=pairs_per_wave,
            nprobe=nprobe, ef_search=ef_search, tune_on=tune_on, quantize=quantize)
        run(plan, tuple(ctx.args))


common.add_progress_help(main)

if __name__ == "__main__":
    common.main_as_module("pipelines.rerank")  # workers import pipelines.rerank, not __main__

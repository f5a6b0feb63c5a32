"""Distributed retrieve-and-rerank: ``python -m pipelines.rerank``.

Graph::

    query embeddings (captions for t2i, images for i2t; read per embedding shard, keeping the split's ids)
      -> deterministic query batches -> Search (loads the index once per worker process) -> BE top-n,
         n = max(k, 10) (whole pool for --mode ce)
      EMB: -> rank_query
      CO/ADD/NORM_ADD/CE:
         -> explode each query's top-k to (caption_id, image_id) pairs -> GroupByKey on the pair, so a t2i and
            an i2t request for the same pair are scored once
         -> join the caption text (CoGroupByKey on caption_id); route pairs to the staged shard of their image
            (CoGroupByKey on image_id with the shards' id columns) and read each needed shard once
         -> deterministic length-sorted CE batches -> RunInference(KeyedModelHandler(score_pairs)) ->
            scores back to every query that asked (CoGroupByKey with the candidate lists) -> rank_query
      -> key by (direction, query_id % N) -> GroupByKey -> rankings_table -> rankings/<direction>-0000x-of-0000N.parquet
      -> one run report -> rankings_manifest.json (then ranking files it does not list, e.g. shards of an earlier
         run with another shard count, are deleted)

Modes: ``emb`` BE only; ``co`` CE rerank of the BE top-k (items below k keep BE order); ``add`` / ``norm_add``
fuse BE and CE scores in the top-k (--lam); ``ce`` exhaustive CE over the whole pool (refused above
--max-exhaustive-pairs query x pool pairs).

Candidate pools: t2i searches --index (a FAISS image index from pipelines.build_index); i2t searches
--text-index when given, otherwise an exact inner-product search over all text embeddings in --embeddings
(``retrieval_core.metrics.exact_topk``; exact and cheap up to ~100k captions). Without --index, t2i is also
an exact search over all image embeddings in --embeddings. --nprobe (IVF) and --ef-search (HNSW) are set on
every shard of an index (faiss' defaults otherwise: nprobe=1 searches a single list) and recorded in the
manifest's ``search_params``.

Determinism (DirectRunner and DaskRunner give identical rankings): queries and CE pairs are batched by a
GroupByKey on a fixed key (id mod G) and sorted inside the group (queries by id; pairs by length, then ids),
so every batch has the same members on every runner; RunInference gets pre-batched input
(``with_no_batching``). Float results then depend only on the batch, not on bundle boundaries. Ties keep
the searcher's order (exact search: smaller id first), rank_query's ties keep BE order. Measured: the
same CE batch gives bit-identical scores with 1 or 2 torch threads, while moving a pair to another batch
changes its score by ~3e-8 (padding/GEMM shapes) -- hence the fixed batches. Dask workers run with one
OpenMP thread; pass --num-threads to pin torch/faiss threads everywhere if a platform's kernels ever
depend on the thread count.

DaskRunner (Beam 2.77) computes only the last transform's graph and does not separate tagged outputs, so
this graph has single-output steps only and ends in one report step that every write feeds. A CE batch that
fails fails the job (no silent gaps in a ranking).

    python -m pipelines.rerank --staged S --embeddings E --index I --ce-model M --mode co --k 20 --output OUT
    python -m pipelines.rerank ... --runner=apache_beam.runners.dask.dask_runner.DaskRunner \\
        --dask_client_address=127.0.0.1:8786
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Iterable, Optional

import apache_beam as beam
import click
import numpy as np
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference

from pipelines import common
from pipelines.handlers import TASK_SCORE_PAIRS, VLModelHandler, element_length
from retrieval_core import embeddings as emb
from retrieval_core import rerank as rr
from retrieval_core import schema

log = logging.getLogger(__name__)

T2I, I2T = schema.DIRECTION_T2I, schema.DIRECTION_I2T
CLI_MODES = ("emb", "co", "ce", "add", "norm_add")
#: CLI mode -> retrieval_core.rerank mode ("co" and exhaustive "ce" both rank by the CE score).
RANK_MODE = {"emb": "emb", "co": "ce", "ce": "ce", "add": "add", "norm_add": "norm_add"}
RANKINGS_SUBDIR = rr.RANKINGS_SUBDIR
RANKINGS_MANIFEST = rr.RANKINGS_MANIFEST
RUN_REPORT = "_run/report.json"
CREATED_BY = "pipelines.rerank"
_MIX = 0x9E3779B97F4A7C15  # 64-bit golden-ratio multiplier: spreads ids over groups deterministically


class RerankError(RuntimeError):
    pass


def group_of(a: int, b: int, groups: int) -> int:
    """Deterministic group of an id or an id pair (never Python's salted hash())."""
    return int(((int(a) * _MIX) ^ int(b)) % (1 << 61) % groups)


# ------------------------------------------------------------------------------------- searchers
_SEARCHERS: dict = {}  # per worker process: (kind, path, fingerprint) -> searcher


class ExactSearcher:
    """Exact inner-product top-n over all embeddings of one modality (ties: smaller id first)."""

    def __init__(self, emb_dir: str, modality: str):
        self.ids, self.vectors = emb.read_embeddings(emb_dir, modality)

    @property
    def ntotal(self) -> int:
        return len(self.ids)

    def search(self, queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        from retrieval_core.metrics import exact_topk
        return exact_topk(queries, self.vectors, self.ids, n)

    search_scores = search  # inner products are already higher-is-better


def get_searcher(spec: dict):
    """spec: {"kind": "index"|"exact", "path", "modality", "fingerprint"[, "params"]}; loaded once per process.
    ``params`` (index only): faiss search parameters ({"nprobe": .., "efSearch": ..}) set on every shard."""
    params = spec.get("params") or {}
    key = (spec["kind"], spec["path"], spec["modality"], spec["fingerprint"], tuple(sorted(params.items())))
    if key not in _SEARCHERS:
        if spec["kind"] == "index":
            from retrieval_core.index import load_sharded_index
            searcher = load_sharded_index(spec["path"])
            searcher.set_params(**params)  # otherwise faiss' defaults: nprobe=1 (IVF), efSearch=16 (HNSW)
            _SEARCHERS[key] = searcher
        else:
            _SEARCHERS[key] = ExactSearcher(spec["path"], spec["modality"])
    return _SEARCHERS[key]


class SearchBatch(beam.DoFn):
    """((direction, group), [(query_id, vector)]) -> ((direction, query_id), (candidate ids, BE scores)).

    Queries are searched in fixed sub-batches of the id-sorted group, so batches never depend on bundles."""

    def __init__(self, searchers: dict[str, dict], n: int, batch_size: int, faiss_threads: Optional[int]):
        self.searchers = searchers
        self.n = n
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
        searcher = self._loaded[direction]
        for start in range(0, len(queries), self.batch_size):
            chunk = queries[start:start + self.batch_size]
            # search_scores: BE scores are higher-is-better (an L2 index's distances come back negated).
            scores, ids = searcher.search_scores(np.stack([v for _, v in chunk]).astype(np.float32), self.n)
            for (qid, _), s, i in zip(chunk, scores, ids):
                valid = i >= 0  # faiss pads with -1 when the pool is smaller than n
                yield (direction, qid), (i[valid].astype(np.int64), s[valid].astype(np.float32))


# ------------------------------------------------------------------------------------- reading
def read_query_vectors(task, emb_dir: str, wanted: dict[str, frozenset]):
    """(direction, modality, shard entry) -> ((direction, group), (query_id, vector)) for the wanted ids."""
    direction, modality, entry, groups = task
    path = common.join(emb_dir, emb.shard_relpath(modality, entry["name"]))
    data = common.read_bytes(path)
    emb.verify_shard_bytes(data, entry, path)
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

    def captions(self, rel: str):
        table = self._dataset().read_shard_columns(rel, ("caption_id", "text"))
        for cid, text in zip(table.column("caption_id").to_pylist(), table.column("text").to_pylist()):
            yield int(cid), text

    def image_ids(self, rel: str):
        """(image_id, shard) of every image of one shard: only the id column is read."""
        table = self._dataset().read_shard_columns(rel, ("item_id",))
        for item_id in table.column("item_id").to_pylist():
            yield int(item_id), rel

    def regions_for_pairs(self, element, batch_groups: int, max_regions: int):
        """(shard, [(image_id, pairs)]) -> one keyed CE group item per image: (image_id, features, boxes, pairs).

        Regions travel once per image, not once per pair (a pair copy of every image's regions was ~200 KB x
        the number of pairs, which exhausted memory on the demo), and only the ``max_regions`` the CE model
        uses (the stager keeps regions in confidence order, so the cut is lossless)."""
        rel, wanted = element
        wanted = sorted(wanted, key=lambda w: w[0])
        ids = np.array([i for i, _ in wanted], dtype=np.int64)
        table = self._dataset().read_image_shard(rel, ids)
        pos = table.position_of() if table is not None else {}
        for image_id, pairs in wanted:
            if image_id not in pos:
                raise RerankError(f"image {image_id} vanished from staged shard {rel}")
            feats, boxes = table.regions(pos[image_id])
            yield group_of(image_id, 0, batch_groups), (image_id, feats[:max_regions].copy(),
                                                        boxes[:max_regions].copy(), pairs)


# ----------------------------------------------------------------------------------- pair steps
def pair_requests(element, k: int):
    """Candidates of one query -> ((caption_id, image_id), (direction, query_id)) for its top-k."""
    (direction, qid), (ids, _scores) = element
    for cand in ids[:k].tolist():
        pair = (qid, cand) if direction == T2I else (cand, qid)
        yield pair, (direction, qid)


def by_caption(element):
    pair, requesters = element
    return pair[0], (pair, tuple(sorted(set(requesters))))


def attach_text(element):
    caption_id, grouped = element
    pairs, texts = list(grouped["pairs"]), list(grouped["text"])
    if not pairs:
        return
    if len(texts) != 1:
        raise RerankError(f"caption {caption_id} is {'not staged' if not texts else 'staged twice'} in --staged; "
                          f"its CE pairs cannot be scored")
    for pair, requesters in pairs:
        yield pair[1], (pair, requesters, texts[0])


def route_to_shard(element):
    """(image_id, {"pairs", "shard"}) -> (staged shard, (image_id, its pairs)): regions are then read per
    shard for the images that are needed, instead of shuffling every staged feature through a join."""
    image_id, grouped = element
    pairs, shard = list(grouped["pairs"]), list(grouped["shard"])
    if not pairs:
        return
    if len(shard) != 1:
        raise RerankError(f"image {image_id} is {'not staged' if not shard else 'staged twice'} in --staged; "
                          f"its CE pairs cannot be scored")
    yield shard[0], (image_id, sorted(pairs, key=lambda p: p[0]))


def ce_batches(element, batch_size: int):
    """One group of images with their pairs -> keyed CE examples in batches sorted by (padded length, pair):
    little padding, and the same batches on every runner."""
    _group, images = element
    keyed = [((pair, requesters), (text, feats, boxes))
             for _image_id, feats, boxes, pairs in images for pair, requesters, text in pairs]
    keyed = sorted(keyed, key=lambda kv: (element_length(TASK_SCORE_PAIRS, kv[1]), kv[0][0]))
    for start in range(0, len(keyed), batch_size):
        yield keyed[start:start + batch_size]


def scores_to_queries(element):
    (pair, requesters), prediction = element
    caption_id, image_id = pair
    score = float(prediction.inference)
    for direction, qid in requesters:
        yield (direction, qid), (image_id if direction == T2I else caption_id, score)


# ---------------------------------------------------------------------------------------- ranking
def rank_emb(element, k: int, keep: int):
    key, (ids, scores) = element
    return key, rr.rank_query(ids, scores, None, k, "emb", keep=keep)


def rank_with_ce(element, k: int, keep: int, mode: str, lam: float):
    key, grouped = element
    cands = list(grouped["cands"])
    if len(cands) != 1:
        raise RerankError(f"query {key}: {len(cands)} candidate lists")
    ids, be = cands[0]
    kk = min(k, len(ids))
    got = dict(grouped["ce"])
    missing = [int(i) for i in ids[:kk].tolist() if int(i) not in got]
    if missing:
        raise RerankError(f"query {key}: no CE score for candidate(s) {missing[:5]}")
    ce = np.array([got[int(i)] for i in ids[:kk].tolist()], dtype=np.float64)
    return key, rr.rank_query(ids, be, ce, k, mode, lam=lam, keep=keep)


def shard_key(element, shards: dict[str, int]):
    (direction, qid), result = element
    return (direction, qid % shards[direction]), (qid, result)


def write_rankings_shard(element, output: str, shards: dict[str, int]) -> dict:
    import io

    import pyarrow.parquet as pq

    (direction, index), rows = element
    rows = sorted(rows, key=lambda r: r[0])
    table = rr.rankings_table(direction, [q for q, _ in rows], [r for _, r in rows])
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data = buf.getvalue()
    name = common.shard_name(direction, index, shards[direction], ".parquet")
    common.write_atomic(common.join(output, RANKINGS_SUBDIR, name), data)
    return {"kind": "shard", "direction": direction, "name": name, "queries": len(rows), "rows": table.num_rows,
            "sha256": common.sha256_bytes(data)}


def write_report(items: list, path: str) -> int:
    common.write_json_atomic(path, sorted(items, key=lambda r: json.dumps(r, sort_keys=True)))
    return len(items)


# ----------------------------------------------------------------------------------------- graph
def build_pipeline(p: beam.Pipeline, cfg: dict) -> None:
    """cfg: the plan made by run_rerank (all plain values, so it pickles to workers)."""
    k, keep, n = cfg["k"], cfg["keep"], cfg["n"]
    query_tasks = [(d, m, e, cfg["query_groups"][d]) for d, m, e in cfg["query_shards"]]
    cands = (p | "query shards" >> beam.Create(query_tasks)
             | "read queries" >> beam.FlatMap(read_query_vectors, cfg["embeddings"], cfg["query_ids"])
             | "group queries" >> beam.GroupByKey()
             | "search" >> beam.ParDo(SearchBatch(cfg["searchers"], n, cfg["search_batch_size"],
                                                  cfg["faiss_threads"])))
    report_parts = []
    if cfg["mode"] == "emb":
        ranked = cands | "rank" >> beam.Map(rank_emb, k, keep)
    else:
        kk = cfg["ce_k"]
        staged = StagedReader(cfg["staged"])
        requests = cands | "pairs" >> beam.FlatMap(pair_requests, kk)
        unique = requests | "dedupe pairs" >> beam.GroupByKey()
        texts = (p | "caption shards" >> beam.Create(cfg["caption_shards"])
                 | "read captions" >> beam.FlatMap(staged.captions))
        with_text = ({"pairs": unique | "key by caption" >> beam.Map(by_caption), "text": texts}
                     | "join text" >> beam.CoGroupByKey() | "attach text" >> beam.FlatMap(attach_text))
        image_shard_of = (p | "image shards" >> beam.Create(cfg["image_shards"])
                          | "read image ids" >> beam.FlatMap(staged.image_ids))
        examples = ({"pairs": with_text, "shard": image_shard_of}
                    | "join image shards" >> beam.CoGroupByKey()
                    | "route to shard" >> beam.FlatMap(route_to_shard)
                    | "group by shard" >> beam.GroupByKey()
                    | "read regions" >> beam.FlatMap(staged.regions_for_pairs, cfg["ce_groups"],
                                                  cfg["ce_max_regions"]))
        handler = VLModelHandler(cfg["ce_model"], TASK_SCORE_PAIRS, device=cfg["device"],
                                 max_batch_size=cfg["batch_size"], num_threads=cfg["num_threads"],
                                 model_copies=cfg["model_copies"])
        scored = (examples
                  | "group CE pairs" >> beam.GroupByKey()
                  | "CE batches" >> beam.FlatMap(ce_batches, cfg["batch_size"])
                  | "CE score" >> RunInference(KeyedModelHandler(handler).with_no_batching()))
        ce_scores = scored | "scores to queries" >> beam.FlatMap(scores_to_queries)
        ranked = ({"cands": cands, "ce": ce_scores}
                  | "join scores" >> beam.CoGroupByKey()
                  | "rank" >> beam.Map(rank_with_ce, kk, keep, cfg["rank_mode"], cfg["lam"]))
        # Counts via CombinePerKey: CombineGlobally's default value is a side input, which DaskRunner
        # evaluates in a second graph submission (dask then warns about conflicting task keys).
        report_parts += [
            scored | "one per pair" >> beam.Map(lambda _: ("ce_pairs_scored", 1)),
            requests | "one per request" >> beam.Map(lambda _: ("ce_pairs_requested", 1)),
        ]
    written = (ranked
               | "key by output shard" >> beam.Map(shard_key, cfg["out_shards"])
               | "group output shards" >> beam.GroupByKey()
               | "write rankings" >> beam.Map(write_rankings_shard, cfg["output"], cfg["out_shards"]))
    # Last step on purpose: DaskRunner computes only the final transform's graph.
    counts = ((report_parts or [p | "no CE" >> beam.Create([("ce_pairs_scored", 0)])])
              | "flatten counts" >> beam.Flatten() | "sum counts" >> beam.CombinePerKey(sum)
              | "count report" >> beam.MapTuple(lambda name, n: {"kind": "count", "name": name, "value": n}))
    _ = ((written, counts) | "all results" >> beam.Flatten()
         | "one report" >> beam.Map(lambda r: (None, r)) | "collect" >> beam.GroupByKey()
         | "write run report" >> beam.MapTuple(lambda _, items: write_report(list(items),
                                                                               common.join(cfg["output"], RUN_REPORT))))


# ------------------------------------------------------------------------------------- launcher
def _model_max_regions(model_dir: str) -> int:
    """Regions per image the CE model reads (rr_model.json); more would be cut by its collator anyway."""
    from retrieval_core.model import MODEL_JSON, VLModelConfig

    cfg = VLModelConfig.from_json(common.read_json(common.join(model_dir, MODEL_JSON)))
    return int(cfg.max_regions)


def _file_fingerprint(path: str) -> str:
    return common.sha256_file(path) if common.exists(path) else "missing"


def _searcher_spec(direction: str, index_dir: Optional[str], emb_dir: str,
                   search_params: dict) -> tuple[dict, int, str]:
    """(spec, pool size, description) of one direction's candidate search; ``search_params`` (nprobe,
    efSearch: None = faiss' default) apply to a FAISS index."""
    pool_modality = schema.KIND_IMAGE if direction == T2I else "text"
    if index_dir:
        from retrieval_core.index import INDEX_MANIFEST, check_search_params, load_index_manifest
        manifest = load_index_manifest(index_dir)
        if manifest.get("modality", pool_modality) != pool_modality:
            raise RerankError(f"{direction} needs a {pool_modality} index; {index_dir} indexes "
                              f"{manifest.get('modality')}")
        params = {name: v for name, v in search_params.items() if v is not None}
        try:  # refuse a parameter the index lacks now, not in a worker after the job started
            check_search_params(manifest["factory"], int(manifest["d"]), manifest["metric"], **params)
        except ValueError as exc:
            raise RerankError(f"{index_dir} ({manifest['factory']}): {exc}") from None
        spec = {"kind": "index", "path": index_dir, "modality": pool_modality, "params": params,
                "fingerprint": _file_fingerprint(os.path.join(index_dir, INDEX_MANIFEST))}
        metric = manifest["metric"]
        scored = "; be_score = -squared L2 distance" if metric == "l2" else ""
        return spec, int(manifest["ntotal"]), f"FAISS index {index_dir} ({manifest['factory']}, {metric}{scored})"
    entry = emb.modality_entry(emb.load_embeddings_manifest(emb_dir), pool_modality)
    spec = {"kind": "exact", "path": emb_dir, "modality": pool_modality,
            "fingerprint": _file_fingerprint(emb.manifest_path(emb_dir))}
    return spec, int(entry["count"]), f"exact search over {pool_modality} embeddings in {emb_dir}"


def run_rerank(staged: str, embeddings: str, output: str, mode: str = "co", k: int = 20, lam: float = 0.5,
               directions: tuple[str, ...] = (T2I, I2T), index: Optional[str] = None,
               text_index: Optional[str] = None, ce_model: Optional[str] = None, be_model: Optional[str] = None,
               collection: Optional[str] = None, split: Optional[str] = "test", batch_size: int = 64,
               search_batch_size: int = 256, device: str = "CPU", num_threads: Optional[int] = None,
               model_copies: Optional[int] = None, max_exhaustive_pairs: int = 200_000,
               queries_per_shard: int = 50_000, nprobe: Optional[int] = None, ef_search: Optional[int] = None,
               beam_args: tuple[str, ...] = ()) -> dict:
    """Plan, run the Beam graph, write rankings_manifest.json; returns the manifest dict.

    ``nprobe`` / ``ef_search``: IVF lists probed / HNSW search breadth of every shard of --index and
    --text-index (None: faiss' defaults, nprobe=1 and efSearch=16)."""
    from retrieval_core.store import StagedDataset

    t0 = time.time()
    if mode not in CLI_MODES:
        raise RerankError(f"mode must be one of {CLI_MODES}, got {mode!r}")
    if k < 1:
        raise RerankError(f"k must be >= 1, got {k}")
    directions = tuple(dict.fromkeys(directions))
    if not directions or any(d not in (T2I, I2T) for d in directions):
        raise RerankError(f"directions must be a non-empty subset of t2i,i2t, got {directions}")
    if mode != "emb":
        ce_model = ce_model or be_model
        if not ce_model:
            raise RerankError(f"mode {mode!r} needs --ce-model (or --be-model for a JOIN model)")
    if mode in ("add", "norm_add") and not 0.0 <= lam <= 1.0:
        raise RerankError(f"lam must be in [0, 1], got {lam}")
    search_params = {"nprobe": nprobe, "efSearch": ef_search}
    uses_index = (T2I in directions and index) or (I2T in directions and text_index)
    if any(v is not None for v in search_params.values()) and not uses_index:
        raise RerankError("--nprobe / --ef-search tune a FAISS index: pass --index (t2i) or --text-index (i2t); "
                          "the default exact search has no parameters")

    ds = StagedDataset(staged, opener=common.open_file)
    query_ids: dict[str, np.ndarray] = {}
    if T2I in directions:
        query_ids[T2I] = ds.captions(collection, split)["caption_id"].to_numpy(np.int64)
    if I2T in directions:
        query_ids[I2T] = ds.images_meta(collection, split)["item_id"].to_numpy(np.int64)

    emb_manifest = emb.load_embeddings_manifest(embeddings)
    searchers, pools, described, query_shards = {}, {}, {}, []
    for d in directions:
        if len(query_ids[d]) == 0:
            raise RerankError(f"{d}: no queries in {staged} (collection={collection}, split={split})")
        q_modality = "text" if d == T2I else schema.KIND_IMAGE
        have = emb.read_modality_ids(embeddings, q_modality)
        missing = np.setdiff1d(query_ids[d], have)
        if len(missing):
            raise RerankError(f"{d}: {len(missing)} query id(s) have no {q_modality} embedding in {embeddings} "
                              f"(e.g. {missing[:5].tolist()}); encode that split first")
        searchers[d], pools[d], described[d] = _searcher_spec(d, index if d == T2I else text_index, embeddings,
                                                              search_params)
        query_shards += [(d, q_modality, s) for s in emb.modality_entry(emb_manifest, q_modality)["shards"]]

    keep = max(k, 10)
    if mode == "ce":  # exhaustive: every pool item is a candidate and CE-scored
        total_pairs = sum(len(query_ids[d]) * pools[d] for d in directions)
        if total_pairs > max_exhaustive_pairs:
            raise RerankError(f"--mode ce would cross-encode {total_pairs:,} pairs (queries x pool), above "
                              f"--max-exhaustive-pairs {max_exhaustive_pairs:,}; use --mode co")
        n = ce_k = max(pools.values())
    else:
        n, ce_k = keep, k
    requested_upper = sum(len(query_ids[d]) * min(ce_k, pools[d]) for d in directions)
    cfg = {
        "staged": staged, "embeddings": embeddings, "output": output, "mode": mode, "rank_mode": RANK_MODE[mode],
        "k": k, "keep": keep, "n": n, "ce_k": ce_k, "lam": lam, "ce_model": ce_model, "device": device,
        "batch_size": batch_size, "search_batch_size": search_batch_size, "num_threads": num_threads,
        "faiss_threads": num_threads, "model_copies": model_copies, "searchers": searchers,
        "query_shards": query_shards,
        "query_ids": {d: frozenset(q.tolist()) for d, q in query_ids.items()},
        "query_groups": {d: max(1, math.ceil(len(q) / max(search_batch_size, 1) / 4)) for d, q in query_ids.items()},
        "ce_groups": max(1, math.ceil(requested_upper / max(batch_size, 1) / 8)),
        "ce_max_regions": _model_max_regions(ce_model) if ce_model else 0,
        "out_shards": {d: max(1, math.ceil(len(q) / queries_per_shard)) for d, q in query_ids.items()},
        "caption_shards": ds.shard_names("captions"),
        "image_shards": ds.shard_names("images"),
    }

    common.makedirs(output)
    p = beam.Pipeline(options=common.pipeline_options(beam_args))
    build_pipeline(p, cfg)
    result = p.run()
    result.wait_until_finish()
    client = getattr(result, "client", None)  # DaskRunner leaves its distributed.Client open
    if client is not None:
        client.close()

    report_path = common.join(output, RUN_REPORT)
    report = common.read_json(report_path)
    shards = [r for r in report if r["kind"] == "shard"]
    counts = {d: sum(s["queries"] for s in shards if s["direction"] == d) for d in directions}
    for d in directions:
        if counts[d] != len(query_ids[d]):
            raise RerankError(f"{d}: {counts[d]} queries ranked, {len(query_ids[d])} expected")
        expected = {common.shard_name(d, i, cfg["out_shards"][d], ".parquet") for i in range(cfg["out_shards"][d])}
        got = {s["name"] for s in shards if s["direction"] == d}
        if got != expected:  # a shard that got no query (tiny runs): write it empty so the set is complete
            for name in sorted(expected - got):
                table = rr.rankings_table(d, [], [])
                import io

                import pyarrow.parquet as pq
                buf = io.BytesIO()
                pq.write_table(table, buf, compression="zstd")
                data = buf.getvalue()
                common.write_atomic(common.join(output, RANKINGS_SUBDIR, name), data)
                shards.append({"kind": "shard", "direction": d, "name": name, "queries": 0, "rows": 0,
                               "sha256": common.sha256_bytes(data)})
    count = {r["name"]: r["value"] for r in report if r["kind"] == "count"}
    ce_pairs, ce_requests = count.get("ce_pairs_scored", 0), count.get("ce_pairs_requested", 0)
    manifest = {
        "schema_version": schema.SCHEMA_VERSION, "created_by": CREATED_BY,
        "mode": mode, "k": k, "keep": keep, "candidates": n, "lam": lam if mode in ("add", "norm_add") else None,
        "collection": collection, "split": split, "staged": staged, "embeddings": embeddings,
        "be_model": emb_manifest["model"], "ce_model": ce_model,
        "search": {d: described[d] for d in directions}, "search_params": search_params, "pool_size": pools,
        "queries": counts, "ce_pairs_requested": ce_requests, "ce_pairs_scored": ce_pairs,
        "shards": sorted(({kk: s[kk] for kk in ("direction", "name", "queries", "rows", "sha256")} for s in shards),
                         key=lambda s: s["name"]),
        "runner": next((a.split("=", 1)[1] for a in beam_args if a.startswith("--runner=")), "DirectRunner"),
        "wall_s": round(time.time() - t0, 3),
    }
    common.write_json_atomic(common.join(output, RANKINGS_MANIFEST), manifest)
    from apache_beam.io.filesystems import FileSystems
    FileSystems.delete([common.join(output, "_run")])
    _delete_stale_shards(output, {s["name"] for s in shards})
    for d in directions:
        print(f"{d}: {counts[d]} queries ranked ({described[d]}, pool {pools[d]})")
    if mode != "emb":
        print(f"CE: {ce_pairs} unique pairs scored for {ce_requests} requested (t2i/i2t overlap scored once)")
    print(f"rankings: {common.join(output, RANKINGS_SUBDIR)} ({len(shards)} shard(s)); "
          f"wall time {manifest['wall_s']:.1f} s")
    return manifest


def _delete_stale_shards(output: str, keep: set[str]) -> None:
    """Delete ranking files the new manifest does not list: shards of an earlier run with another shard count
    or other directions, and temp files of a killed run. Called only after the new shards and manifest are
    written, so the directory never lacks a shard the manifest on disk lists."""
    from apache_beam.io.filesystems import FileSystems

    pattern = common.join(output, RANKINGS_SUBDIR, "*.parquet*")  # shards and their .parquet.tmp-* files
    found = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]
    stale = sorted(path for path in found if path.rsplit("/", 1)[-1] not in keep)
    if stale:
        FileSystems.delete(stale)
        log.info("deleted %d ranking file(s) of an earlier run: %s", len(stale), stale[:5])


# ------------------------------------------------------------------------------------------- CLI
@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--staged", required=True, help="staged directory (queries, captions, regions)")
@click.option("--embeddings", required=True, help="embeddings directory (pipelines.encode output)")
@click.option("--index", help="image FAISS index for t2i (default: exact search over image embeddings)")
@click.option("--text-index", help="caption FAISS index for i2t (default: exact search over text embeddings)")
@click.option("--be-model", help="BE model folder (not needed: embeddings exist; used as CE for JOIN models)")
@click.option("--ce-model", help="CE model folder (SEP+CO); default --be-model (JOIN+CO)")
@click.option("--mode", type=click.Choice(CLI_MODES), default="co", show_default=True)
@click.option("--lam", type=float, default=0.5, show_default=True, help="ADD/NORM_ADD weight of the BE score")
@click.option("--k", type=int, default=20, show_default=True, help="rerank depth; output keeps max(k, 10)")
@click.option("--directions", default="t2i,i2t", show_default=True)
@click.option("--collection", help="queries of this collection only")
@click.option("--split", default="test", show_default=True, help="queries of this split")
@click.option("--output", required=True, help="run directory: rankings/ and rankings_manifest.json")
@click.option("--batch-size", type=int, default=64, show_default=True, help="CE batch size")
@click.option("--search-batch-size", type=int, default=256, show_default=True)
@click.option("--device", type=click.Choice(["CPU", "GPU"], case_sensitive=False), default="CPU", show_default=True)
@click.option("--num-threads", type=int, help="pin torch/faiss threads per worker process (default: leave as is)")
@click.option("--nprobe", type=click.IntRange(min=1),
              help="IVF lists searched per query in every index shard (default: faiss' 1)")
@click.option("--ef-search", type=click.IntRange(min=1),
              help="HNSW search breadth (efSearch) in every index shard (default: faiss' 16)")
@click.option("--model-copies", type=int, help="CE model copies per machine (Dataflow GPU: 1)")
@click.option("--max-exhaustive-pairs", type=int, default=200_000, show_default=True)
@click.option("--queries-per-shard", type=int, default=50_000, show_default=True)
@click.pass_context
def main(ctx, staged, embeddings, index, text_index, be_model, ce_model, mode, lam, k, directions, collection,
         split, output, batch_size, search_batch_size, device, num_threads, nprobe, ef_search, model_copies,
         max_exhaustive_pairs, queries_per_shard):
    """BE retrieval (+ CE reranking) of every query of a split, in both directions, as a Beam job.
    Unknown --flags go to Beam (--runner, --dask_client_address, ...)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with common.cli_errors(RerankError):
        run_rerank(staged, embeddings, output, mode=mode, k=k, lam=lam,
                   directions=tuple(d.strip() for d in directions.split(",") if d.strip()), index=index,
                   text_index=text_index, ce_model=ce_model, be_model=be_model, collection=collection, split=split,
                   batch_size=batch_size, search_batch_size=search_batch_size, device=device.upper(),
                   num_threads=num_threads, model_copies=model_copies, max_exhaustive_pairs=max_exhaustive_pairs,
                   queries_per_shard=queries_per_shard, nprobe=nprobe, ef_search=ef_search,
                   beam_args=tuple(ctx.args))


if __name__ == "__main__":
    main()

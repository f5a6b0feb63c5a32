"""The rerank job's Beam graph: the DoFns and steps the workers import (see docs/ARCHITECTURE.md for the graph:
search, CE pairs routed to the staged shards that hold their text and regions, scoring, ranking, writing)."""
from __future__ import annotations

import io
from typing import Mapping, Optional

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference

from pipelines import beam_kit, files
from pipelines.handlers import TASK_SCORE_PAIRS, CaptionTexts, VLModelHandler, element_length
from pipelines.rerank.plan import (
    CANDIDATES_DIR,
    T2I,
    RerankError,
    Resolved,
    SearcherSpec,
    candidates_ledger,
    progress_ledger,
    shard_pairs,
)
from retrieval_core.data.store import StagedDataset
from retrieval_core.search import embeddings, rerank
from retrieval_core.search.index import set_threads
from retrieval_core.search.index_folder import StreamedExact, StreamedIndex, load_index_manifest

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


def group_of(a: int, b: int, groups: int) -> int:
    """Deterministic group of an id or an id pair (never Python's salted hash())."""
    return int(((int(a) * _MIX) ^ int(b)) % (1 << 61) % groups)


_SEARCHERS: dict = {}  # per worker process: SearcherSpec -> loaded searcher


def get_searcher(spec: SearcherSpec):
    """The searcher of ``spec``, opened (and checked) once per process; neither kind holds the pool's vectors:
    a search reads them one shard at a time."""
    if spec not in _SEARCHERS:
        if spec.kind == "index":
            searcher = StreamedIndex(spec.path, files=files.BEAM_FILES)
            searcher.set_params(**dict(spec.params))  # otherwise faiss' defaults: nprobe=1, efSearch=16
            _SEARCHERS[spec] = searcher
        else:
            _SEARCHERS[spec] = StreamedExact(spec.path, spec.modality, files=files.BEAM_FILES)
    return _SEARCHERS[spec]


class SearchBatch(beam.DoFn):
    """((direction, group), [(query_id, vector)]) -> ((direction, group), [(query_id, candidate ids, BE scores)]).

    A group is one pass over the pool's shards; its queries are searched in fixed sub-batches of the id-sorted
    group, so batches never depend on bundles (nor on which waves or shards of the run are left to do)."""

    def __init__(self, searchers: Mapping[str, SearcherSpec], candidates: Mapping[str, int], batch_size: int,
                 faiss_threads: Optional[int]):
        self.searchers = dict(searchers)
        self.candidates = dict(candidates)
        self.batch_size = batch_size
        self.faiss_threads = faiss_threads

    def setup(self):
        if self.faiss_threads:
            set_threads(self.faiss_threads)
        self._loaded = {d: get_searcher(s) for d, s in self.searchers.items()}

    def process(self, element):
        (direction, group), queries = element
        queries = sorted(queries, key=lambda q: q[0])
        chunks = [queries[start:start + self.batch_size] for start in range(0, len(queries), self.batch_size)]
        # One pass over the pool's shards for the whole group; higher-is-better BE scores (an L2 index's
        # distances come back negated).
        found = self._loaded[direction].search_scores_batches(
            [np.stack([v for _, v in chunk]).astype(np.float32) for chunk in chunks], self.candidates[direction],
            on_shard=beam_kit.Progress.advance)
        out = []
        for chunk, (scores, ids) in zip(chunks, found):
            _SEARCHED.inc(len(chunk))
            for (qid, _), s, i in zip(chunk, scores, ids):
                valid = i >= 0  # faiss pads with -1 when the pool is smaller than n
                out.append((qid, i[valid].astype(np.int64), s[valid].astype(np.float32)))
        yield (direction, group), out


def pool_shard_count(spec: SearcherSpec) -> int:
    """Shards one pass over ``spec``'s pool reads (from its manifest only: the search job's progress total)."""
    if spec.kind == "index":
        return len(load_index_manifest(spec.path, files.BEAM_FILES)["shards"])
    manifest = embeddings.load_embeddings_manifest(spec.path, files.BEAM_FILES)
    return len(embeddings.modality_entry(manifest, spec.modality)["shards"])


# ---------------------------------------------------------------------------------- candidates
def candidates_name(direction: str, group: int, groups: int) -> str:
    return files.shard_name(direction, group, groups, ".parquet")


def write_candidates(element, output: str, groups: Mapping[str, int], fingerprint: str) -> dict:
    """One search group's candidates -> <output>/_candidates/<name> (then its record, what a resumed run
    trusts); the file's info for the run report."""
    (direction, group), found = element
    found = sorted(found, key=lambda f: f[0])
    table = pa.table({"query_id": pa.array([f[0] for f in found], pa.int64()),
                      "candidate_ids": pa.array([f[1] for f in found], pa.list_(pa.int64())),
                      "be_scores": pa.array([f[2] for f in found], pa.list_(pa.float32()))})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    name = candidates_name(direction, group, groups[direction])
    sha = files.write_atomic(files.join(output, CANDIDATES_DIR, name), buf.getvalue())
    info = {"kind": "candidates", "direction": direction, "name": name, "queries": len(found), "sha256": sha}
    candidates_ledger(output, fingerprint).record(info)
    return info


def read_candidates(task, output: str, wanted: Mapping[str, frozenset]):
    """(direction, candidates file, sha256) -> ((direction, query_id), (candidate ids, BE scores)) for the
    wanted ids (a wave's queries)."""
    direction, name, sha256 = task
    path = files.join(output, CANDIDATES_DIR, name)
    data = files.read_bytes(path)
    if files.sha256_bytes(data) != sha256:
        raise RerankError(f"{path} changed since the search wrote it (sha256); delete {CANDIDATES_DIR}/ to search "
                          f"again")
    table = pq.read_table(io.BytesIO(data))
    keep = wanted[direction]
    for qid, ids, scores in zip(table.column("query_id").to_pylist(), table.column("candidate_ids").to_numpy(),
                                table.column("be_scores").to_numpy()):
        if qid in keep:
            yield (direction, qid), (np.asarray(ids, dtype=np.int64), np.asarray(scores, dtype=np.float32))


# ------------------------------------------------------------------------------------- reading
def read_query_vectors(task, emb_dir: str, wanted: Mapping[str, frozenset]):
    """(direction, modality, shard name, sha256, groups) -> ((direction, group), (query_id, vector)) for the
    wanted ids."""
    direction, modality, name, sha256, groups = task
    path = files.join(emb_dir, embeddings.shard_relpath(modality, name))
    data = files.read_bytes(path)
    embeddings.verify_shard_bytes(data, {"sha256": sha256}, path)
    ids, vecs = embeddings.read_embedding_shard(data)
    keep = wanted[direction]
    for i, qid in enumerate(ids.tolist()):
        if qid in keep:
            yield (direction, group_of(qid, 0, groups)), (qid, vecs[i])


class StagedReader:
    """Staged captions (caption_id, text) and images (image_id, (features, boxes)), one shard per call."""

    def __init__(self, staged_dir: str, token_fingerprint: Optional[str] = None):
        self.staged_dir = staged_dir
        self.captions = CaptionTexts(token_fingerprint)
        self._ds = None

    def _dataset(self) -> StagedDataset:
        if self._ds is None:
            self._ds = StagedDataset(self.staged_dir, files=files.BEAM_FILES)
        return self._ds

    def id_column(self, rel: str, column: str) -> np.ndarray:
        """One id column of one staged shard (no text, no features)."""
        return self._dataset().read_shard_columns(rel, (column,)).column(column).to_numpy().astype(np.int64)

    def texts_for_pairs(self, element):
        """(caption shard group, [(shard, caption_id, (pair, requesters))]) -> (image_id, (pair, requesters,
        text)): each shard's text (or its token ids) is read for the requested captions only."""
        _group, wanted = element
        for rel, in_shard in _by_shard(wanted):
            text_of = dict(zip(*self.captions(self._dataset(), rel, wanted={int(cid) for cid, _ in in_shard})))
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
    for pair in rerank.query_pairs(direction, qid, ids, k):
        yield pair, (direction, qid)


def by_caption(element):
    pair, requesters = element
    return pair[0], (pair, rerank.merge_requesters(requesters))


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
    beam_kit.Progress.advance(len(requesters))  # CE modes count (query, pair) requests: the launcher's total
    for direction, qid in requesters:
        yield (direction, qid), (image_id if direction == T2I else caption_id, score)


# ---------------------------------------------------------------------------------------- ranking
def rank_emb(element, k: int):
    key, (ids, scores) = element
    _RANKED.inc()
    beam_kit.Progress.advance(1)  # EMB counts queries
    return key, rerank.rank_query(ids, scores, None, k, "emb", keep=len(ids))


def rank_with_ce(element, k: int, mode: str, lam: float):
    """Every candidate of the query (its whole BE top-n), in final order, with the CE scores of its top k."""
    (direction, qid), grouped = element
    cands = list(grouped["cands"])
    if len(cands) != 1:
        raise RerankError(f"{direction} query {qid}: {len(cands)} candidate lists")
    ids, be = cands[0]
    ce = rerank.ce_scores_of(ids, k, dict(grouped["ce"]), f"{direction} query {qid}")
    _RANKED.inc()
    return (direction, qid), rerank.rank_query(ids, be, ce, k, mode, lam=lam, keep=len(ids))


def shard_key(element, shards: Mapping[str, int]):
    (direction, qid), result = element
    return (direction, qid % shards[direction]), (qid, result)


def write_shard(output: str, name: str, direction: str, query_ids, results, fingerprint: str) -> dict:
    """Write one rankings shard, then its progress record (what a resumed run trusts); the shard's info."""
    table = rerank.rankings_table(direction, query_ids, results)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    sha = files.write_atomic(files.join(output, rerank.RANKINGS_SUBDIR, name), buf.getvalue())
    info = {"kind": "shard", "direction": direction, "name": name, "queries": len(query_ids),
            "rows": table.num_rows, "sha256": sha}
    progress_ledger(output, fingerprint).record(info)
    return info


def write_rankings_shard(element, output: str, shards: Mapping[str, int], fingerprint: str) -> dict:
    (direction, index), rows = element
    rows = sorted(rows, key=lambda r: r[0])
    name = files.shard_name(direction, index, shards[direction], ".parquet")
    _SHARDS_WRITTEN.inc()
    return write_shard(output, name, direction, [q for q, _ in rows], [r for _, r in rows], fingerprint)


# ----------------------------------------------------------------------------------------- graph
def build_search_graph(p: beam.Pipeline, res: Resolved, todo: Mapping[str, frozenset]) -> None:
    """The search job: the queries of the search groups ``todo`` ({direction: group numbers}), each group one
    pass over its direction's pool, written as one candidates file per group. The waves read these files,
    so the pool is searched once per group, not once per wave (at 1M, ten waves each searching again took most
    of the CO job's wall time)."""
    plan = res.plan
    wanted = {d: frozenset(res.query_ids[d].tolist()) for d in todo}
    query_tasks = [(d, m, name, sha, res.search_groups[d]) for d, m, name, sha in res.query_shards if d in todo]
    written = (p | "query shards" >> beam.Create(query_tasks)
               | "read queries" >> beam.FlatMap(read_query_vectors, plan.embeddings, wanted)
               | "groups to search" >> beam.Filter(lambda kv: kv[0][1] in todo[kv[0][0]])
               | "group queries" >> beam.GroupByKey()
               | "search" >> beam.ParDo(SearchBatch({d: res.searchers[d] for d in todo}, res.candidates,
                                                    plan.search_batch_size, plan.threads))
               | "write candidates" >> beam.Map(write_candidates, plan.output, res.search_groups, res.fingerprint))
    beam_kit.WriteRunReport.apply((written,), plan.output)


def build_graph(p: beam.Pipeline, res: Resolved, wave: Mapping[str, frozenset],
                candidates: Mapping[str, dict]) -> None:
    """The Beam graph ranking the queries ``wave`` ({direction: query ids}) of a resolved plan from the search
    job's ``candidates`` ({file name: its record})."""
    plan = res.plan
    tasks = [(c["direction"], name, c["sha256"]) for name, c in sorted(candidates.items())
             if wave.get(c["direction"])]
    cands = (p | "candidates files" >> beam.Create(tasks)
             | "read candidates" >> beam.FlatMap(read_candidates, plan.output, dict(wave)))
    report_parts = []
    if not res.ce_k:
        ranked = cands | "rank" >> beam.Map(rank_emb, plan.k)
    else:
        requested = sum(shard_pairs(res, d, q) for d, q in wave.items())
        # ~8 length-sorted batches per group of image shards: little padding, one group's regions in memory
        image_group = shards_per_group(len(res.image_shards), requested, plan.batch_size * CE_BATCHES_PER_GROUP)
        staged = StagedReader(plan.staged, res.token_fingerprint)
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
        handler = VLModelHandler(plan.cross_encoder, TASK_SCORE_PAIRS, device=plan.device,
                                 max_batch_size=plan.batch_size, num_threads=plan.threads,
                                 model_copies=plan.model_copies, quantize=plan.precision,
                                 collate_workers=plan.collate_workers,
                                 token_fingerprint=res.token_fingerprint)
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
    beam_kit.WriteRunReport.apply((written, counts), plan.output)  # last step: DaskRunner computes only its graph



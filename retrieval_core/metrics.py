"""Exact top-k search and recall@K in both retrieval directions (NOTES.md section 2).

Convention (OSCAR, UNITER, MMT, CLIP_benchmark): text->image: every caption is a query, a hit when its
image is in the top-k; image->text: every image is a query, a hit when ANY of its captions is in the top-k.
mR is the mean of the six recalls. Recalls are percentages.

Nothing here mutates its inputs: gold mappings may be read-only (MappingProxyType, frozensets).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence, Union

import numpy as np
import pandas as pd
import pyarrow as pa

from retrieval_core import schema

DEFAULT_KS = (1, 5, 10)

RankedIds = Union[np.ndarray, Sequence[Sequence[int]]]
DIRECTIONS = (schema.DIRECTION_T2I, schema.DIRECTION_I2T)

log = logging.getLogger(__name__)


class RankingsError(ValueError):
    """A rankings table that cannot be scored against its gold (a missing or extra query, a repeated rank)."""


# ---------------------------------------------------------------------------------------- exact top-k
#: Below this many queries a search is a scan bound by memory bandwidth (GEMV-like: every item row is read
#: for a handful of dot products), so the items are scanned in cache-sized chunks whose top-k is selected
#: while their scores are still in cache. From this size on it is compute-bound: GEMM over query blocks x
#: large item chunks. (faiss Flat switches to BLAS at 20 queries too, but below that it scans one query per
#: thread, which leaves a core idle for a single query: the latency suite's EMB-Flat row.)
SMALL_BATCH = 20
#: Scores per chunk of a small-batch scan: 512 KiB of float32, resident in L2 while top-k is taken.
SCAN_CHUNK_SCORES = 1 << 17
#: Item rows per chunk of a large-batch GEMM (enough columns for BLAS to reach its peak).
GEMM_CHUNK_ROWS = 8192


def exact_topk(queries: np.ndarray, items: np.ndarray, item_ids: np.ndarray, k: int,
               batch_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top-k of every query over ``items``: the one exact search of the project
    (pipelines.rerank's exact searcher, training's dev evaluation, the latency suite's exact rows).

    Returns ``(scores, ids)``, both (Q, k'), best first, where k' = min(k, N). Equal scores are ordered by
    the smaller item_id, so the result does not depend on the order of ``items``. The kernel depends on the
    query batch (:data:`SMALL_BATCH`): one query is a BLAS GEMV (numpy's, multi-threaded), more are torch.mm
    (zero-copy views of the float32 arrays, torch's thread setting), with the top-k taken chunk by chunk, so the
    scores of all N items never exist at once.
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    items = np.ascontiguousarray(items, dtype=np.float32)
    item_ids = np.asarray(item_ids, dtype=np.int64)
    if queries.ndim != 2 or items.ndim != 2:
        raise ValueError(f"queries and items must be 2-D, got {queries.shape} and {items.shape}")
    if queries.shape[1] != items.shape[1]:
        raise ValueError(f"dimension mismatch: queries d={queries.shape[1]}, items d={items.shape[1]}")
    if item_ids.shape != (items.shape[0],):
        raise ValueError(f"item_ids shape {item_ids.shape} does not match {items.shape[0]} items")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n_q, n = queries.shape[0], items.shape[0]
    k = min(k, n)
    if n_q == 1 and 0 < n <= SCAN_CHUNK_SCORES:  # one query, one chunk: numpy alone (torch's per-call costs
        s, i = _topk_one(queries[0], items, item_ids, k)  # would be most of it at this size)
        return s[None], i[None]
    out_s = np.empty((n_q, k), dtype=np.float32)
    out_i = np.empty((n_q, k), dtype=np.int64)
    if k == 0 or n_q == 0:
        return out_s, out_i
    items_t = _tensor(items)
    for start in range(0, n_q, batch_size):  # tensors from numpy never require grad: no autograd context
        q = queries[start:start + batch_size]
        s, i = _topk_block(q, items, items_t, item_ids, k)
        out_s[start:start + len(q)], out_i[start:start + len(q)] = s, i
    return out_s, out_i


def _tensor(a: np.ndarray):
    """A zero-copy torch view; read-only arrays (Arrow buffers) are fine: nothing writes to them."""
    import torch

    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _topk_one(q: np.ndarray, items: np.ndarray, item_ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of one query over a few items: GEMV, the k+1 best by argpartition, ordered by (score desc, id
    asc). If the (k+1)-th equals the k-th, argpartition may have dropped a tied item with a smaller id: the
    tied scores are then ordered over all items."""
    s = items @ q
    n = len(s)
    cand = np.argpartition(s, n - k - 1)[n - k - 1:] if k < n else np.arange(n)
    cand = cand[np.lexsort((item_ids[cand], -s[cand]))]
    if k < n and s[cand[k]] == s[cand[k - 1]]:
        cand = np.flatnonzero(s >= s[cand[k - 1]])
        cand = cand[np.lexsort((item_ids[cand], -s[cand]))]
    best = cand[:k]
    return s[best], item_ids[best]


def _topk_block(q: np.ndarray, items: np.ndarray, items_t, item_ids: np.ndarray, k: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of one query block: per chunk torch.topk candidates, then the best k of the candidates by
    (score desc, id asc). A chunk whose k-th score is tied with a score it left out (its (k+1)-th) is noted;
    a row whose final k-th score equals such a chunk's k-th is recomputed over all items (exact ties: rare
    with real embeddings, common with quantised ones)."""
    import torch

    b, n = len(q), len(items)
    rows = max(k, SCAN_CHUNK_SCORES // b) if b < SMALL_BATCH else max(k, GEMM_CHUNK_ROWS)
    q_t = _tensor(q)
    cand_s, cand_p, tie_kth = [], [], []
    for a in range(0, n, rows):
        if b == 1:  # GEMV: numpy's BLAS threads it and streams the rows (torch.mm with one row runs on one
            s = torch.from_numpy(items[a:a + rows] @ q[0])[None]  # thread, ~1.7x slower at 1M items)
        else:
            s = torch.mm(q_t, items_t[a:a + rows].T)  # (b, r)
        kk = min(k, s.shape[1])
        # one more than needed: the (k+1)-th equal to the k-th means a tied item was left out
        top = torch.topk(s, min(kk + 1, s.shape[1]), dim=1)
        vals = top.values.numpy()
        cand_s.append(vals[:, :kk])
        cand_p.append(top.indices.numpy()[:, :kk] + a)
        if vals.shape[1] > kk:
            tie_kth.append(np.where(vals[:, kk] == vals[:, kk - 1], vals[:, kk - 1], np.nan))
    if len(cand_s) == 1 and (not tie_kth or np.isnan(tie_kth[0]).all()) \
            and (k == 1 or (cand_s[0][:, 1:] < cand_s[0][:, :-1]).all()):
        return cand_s[0], item_ids[cand_p[0]]  # one chunk, no equal scores: torch.topk's order is the answer
    cs, cp = np.concatenate(cand_s, axis=1), np.concatenate(cand_p, axis=1)
    order = np.lexsort((item_ids[cp], -cs), axis=1)[:, :k]  # last key primary: score desc, then id asc
    pos = np.take_along_axis(cp, order, axis=1)
    scores = np.take_along_axis(cs, order, axis=1)
    if tie_kth:
        redo = np.flatnonzero((np.stack(tie_kth, axis=1) == scores[:, -1:]).any(axis=1))
        for r in redo:  # some item tied with the k-th best was left out by a chunk: select over all items
            row = items @ q[r]
            idx = np.flatnonzero(row >= np.partition(row, n - k)[n - k])  # the k-th of this same pass
            best = idx[np.lexsort((item_ids[idx], -row[idx]))[:k]]
            pos[r], scores[r] = best, row[best]
    return scores, item_ids[pos]


def _l2_topk(queries: np.ndarray, items: np.ndarray, item_ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact L2 top-k as (negated squared distances, ids): higher is better, as for inner products."""
    import faiss  # only here: the training and roofline code imports this module on machines without faiss

    dist, pos = faiss.knn(np.ascontiguousarray(queries, np.float32), np.ascontiguousarray(items, np.float32),
                          min(k, len(item_ids)), faiss.METRIC_L2)
    return -dist, item_ids[pos]


def exact_topk_shards(batches: Sequence[np.ndarray], shards, k: int,
                      metric: str = "ip") -> list[tuple[np.ndarray, np.ndarray]]:
    """Exact top-k of every query batch over items that come as ``shards``, an iterable of ``(item_ids,
    items)`` consumed once, one shard at a time: only one shard (and each query's best k so far) is in memory.
    [(scores, ids)] per batch, higher scores first (``metric`` "l2": negated squared distances); for "ip" the
    same items, order and ties (smaller id first) as :func:`exact_topk` over all items (a score can differ in
    the last bits: BLAS sums in a shape-dependent order)."""
    search = exact_topk if metric == "ip" else _l2_topk
    best: list = [None] * len(batches)
    for item_ids, items in shards:
        if len(item_ids) == 0:
            continue
        for b, q in enumerate(batches):
            part = search(q, items, item_ids, k)
            best[b] = part if best[b] is None else merge_topk([best[b], part], k)
    empty = lambda q: (np.empty((np.asarray(q).shape[0], 0), dtype=np.float32),  # noqa: E731
                       np.empty((np.asarray(q).shape[0], 0), dtype=np.int64))
    return [found if found is not None else empty(q) for found, q in zip(best, batches)]


def merge_topk(parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of several (scores, ids) top lists of the same queries over disjoint items: score
    descending, ties by smaller id (exact_topk's order)."""
    scores = np.concatenate([p[0] for p in parts], axis=1)
    ids = np.concatenate([p[1] for p in parts], axis=1)
    order = np.lexsort((ids, -scores), axis=1)[:, :k]  # last key is primary
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


# --------------------------------------------------------------------------------------------- recall
def recall_at_k(ranked_ids: RankedIds, gold: Sequence[Collection[int]],
                ks: Sequence[int] = DEFAULT_KS) -> dict[int, float]:
    """Percentage of queries with at least one gold id among their first k ranked ids, for each k.

    ``ranked_ids`` is (Q, K) or a list of Q best-first id lists (lists may differ in length; a list shorter
    than k simply has fewer chances). ``gold[i]`` is the non-empty collection of correct ids of query i.
    """
    n_q = len(ranked_ids)
    if n_q == 0:
        raise ValueError("recall_at_k needs at least one query, got 0")
    if len(gold) != n_q:
        raise ValueError(f"{n_q} ranked queries but {len(gold)} gold entries")
    ks = _check_ks(ks)
    first_hit = first_hit_ranks(ranked_ids, gold)
    return {k: float(100.0 * np.mean(first_hit < k)) for k in ks}


def first_hit_ranks(ranked_ids: RankedIds, gold: Sequence[Collection[int]]) -> np.ndarray:
    """0-based position of the first gold id in each query's ranking; a large sentinel when absent."""
    miss = np.iinfo(np.int64).max
    out = np.full(len(ranked_ids), miss, dtype=np.int64)
    for i, (row, g) in enumerate(zip(ranked_ids, gold)):
        if len(g) == 0:
            raise ValueError(f"query #{i} has no gold ids")
        g = g if isinstance(g, (set, frozenset)) else frozenset(int(x) for x in g)
        for pos, item in enumerate(np.asarray(row).tolist()):
            if item in g:
                out[i] = pos
                break
    return out


def direction_first_hits(direction: str, ranked_ids: RankedIds, query_ids: Sequence[int],
                         caption_to_image: Mapping[int, int], image_to_captions: Mapping[int, Collection[int]]
                         ) -> np.ndarray:
    """:func:`first_hit_ranks` of one direction's queries ("t2i": caption queries, gold = its image; "i2t": image
    queries, gold = any of its captions). A query without gold (unknown id, or an image with no captions) raises
    ValueError naming it; so does a duplicate query id."""
    if direction not in ("t2i", "i2t"):
        raise ValueError(f"direction must be 't2i' or 'i2t', got {direction!r}")
    gold = []
    for q in _query_list(query_ids, ranked_ids, direction):
        if direction == "t2i":
            if q not in caption_to_image:
                raise ValueError(f"t2i query (caption) {q} has no gold image")
            gold.append((int(caption_to_image[q]),))
        else:
            caps = image_to_captions.get(q)
            if not caps:
                raise ValueError(f"i2t query (image) {q} has no gold captions")
            gold.append(caps)
    if not gold:
        raise ValueError(f"{direction}: no queries")
    return first_hit_ranks(ranked_ids, gold)


def direction_recall(direction: str, ranked_ids: RankedIds, query_ids: Sequence[int],
                     caption_to_image: Mapping[int, int], image_to_captions: Mapping[int, Collection[int]],
                     ks: Sequence[int] = DEFAULT_KS) -> dict:
    """R@k of one direction (:func:`direction_first_hits`). Keys ``<direction>_R@<k>`` and
    ``<direction>_queries``."""
    ks = _check_ks(ks)
    first = direction_first_hits(direction, ranked_ids, query_ids, caption_to_image, image_to_captions)
    result: dict = {f"{direction}_R@{k}": float(100.0 * np.mean(first < k)) for k in ks}
    result[f"{direction}_queries"] = len(first)
    return result


def bidirectional_recall(t2i_ranked_ids: RankedIds, t2i_query_ids: Sequence[int],
                         i2t_ranked_ids: RankedIds, i2t_query_ids: Sequence[int],
                         caption_to_image: Mapping[int, int],
                         image_to_captions: Mapping[int, Collection[int]],
                         ks: Sequence[int] = DEFAULT_KS) -> dict:
    """R@k for text->image and image->text plus mR (mean of all of them) and the query counts.

    Keys: ``t2i_R@<k>``, ``i2t_R@<k>`` for each k, ``mR``, ``t2i_queries``, ``i2t_queries``.
    A query without gold (unknown id, or an image with no captions) raises ValueError naming it;
    duplicate query ids raise too (they would be counted twice).
    """
    ks = _check_ks(ks)
    t2i = direction_recall("t2i", t2i_ranked_ids, t2i_query_ids, caption_to_image, image_to_captions, ks)
    i2t = direction_recall("i2t", i2t_ranked_ids, i2t_query_ids, caption_to_image, image_to_captions, ks)
    result: dict = {f"t2i_R@{k}": t2i[f"t2i_R@{k}"] for k in ks}
    result.update({f"i2t_R@{k}": i2t[f"i2t_R@{k}"] for k in ks})
    result["mR"] = float(np.mean([result[f"{d}_R@{k}"] for d in ("t2i", "i2t") for k in ks]))
    result["t2i_queries"] = t2i["t2i_queries"]
    result["i2t_queries"] = i2t["i2t_queries"]
    return result


def _query_list(query_ids: Sequence[int], ranked: RankedIds, direction: str) -> list[int]:
    ids = [int(q) for q in np.asarray(query_ids).tolist()]
    if len(ids) != len(ranked):
        raise ValueError(f"{direction}: {len(ids)} query ids but {len(ranked)} ranked lists")
    if len(set(ids)) != len(ids):
        seen, dup = set(), None
        for q in ids:
            if q in seen:
                dup = q
                break
            seen.add(q)
        raise ValueError(f"{direction}: query id {dup} appears more than once")
    return ids


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks}")
    return ks


# ------------------------------------------------------------------------------------- rankings tables
def ranked_lists(df: pd.DataFrame, direction: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """(query ids, best-first item id arrays) of one direction, ordered by query id."""
    sub = df[df["direction"] == direction]
    q = sub["query_id"].to_numpy(np.int64)
    r = sub["rank"].to_numpy(np.int64)
    items = sub["item_id"].to_numpy(np.int64)
    order = np.lexsort((r, q))
    q, r, items = q[order], r[order], items[order]
    if len(q) and np.any((q[1:] == q[:-1]) & (r[1:] == r[:-1])):
        bad = int(q[1:][(q[1:] == q[:-1]) & (r[1:] == r[:-1])][0])
        raise RankingsError(f"{direction} query {bad} has the same rank twice")
    queries, starts = np.unique(q, return_index=True)
    return queries, np.split(items, starts[1:]) if len(q) else []


def check_queries(direction: str, ranked: np.ndarray, gold_keys: Collection[int]) -> None:
    ranked_set = set(ranked.tolist())
    gold_set = set(int(g) for g in gold_keys)
    extra = sorted(ranked_set - gold_set)
    missing = sorted(gold_set - ranked_set)
    what = "caption" if direction == schema.DIRECTION_T2I else "image"
    if extra:
        raise RankingsError(f"{direction}: ranked {what} query {extra[0]} is not in the gold "
                              f"({len(extra)} such queries; first: {extra[:5]})")
    if missing:
        raise RankingsError(f"{direction}: gold {what} query {missing[0]} is missing from the rankings "
                              f"({len(missing)} missing; first: {missing[:5]})")


@dataclass(frozen=True)
class DirectionHits:
    """One direction of a ranking, query by query: the query ids (ascending), the 0-based rank of each query's
    first gold item (:func:`first_hit_ranks`; a large sentinel when absent, so a hit at K is ``first_hit < K``)
    and the length of its shortest ranked list. What recall and its confidence intervals are computed from."""
    direction: str
    query_ids: np.ndarray
    first_hit: np.ndarray
    depth: int

    def recall(self, k: int) -> float:
        return float(100.0 * np.mean(self.first_hit < k))


def rankings_hits(rankings: Union[pd.DataFrame, pa.Table], caption_to_image: Mapping[int, int],
                  image_to_captions: Mapping[int, Collection[int]],
                  directions: Sequence[str] = DIRECTIONS) -> dict[str, DirectionHits]:
    """:class:`DirectionHits` of each given direction of a rankings table (schema.RANKING_SCHEMA columns).

    Every gold query of an evaluated direction must be ranked and vice versa (RankingsError otherwise). Gold
    mappings are only read."""
    df = rankings.to_pandas() if isinstance(rankings, pa.Table) else rankings
    missing_cols = [c for c in ("direction", "query_id", "rank", "item_id") if c not in df.columns]
    if missing_cols:
        raise RankingsError(f"rankings lack column(s) {missing_cols}")
    unknown = set(df["direction"].unique()) - set(DIRECTIONS)
    if unknown:
        raise RankingsError(f"rankings have unknown direction(s) {sorted(unknown)}")
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise RankingsError(f"directions must be a non-empty subset of {DIRECTIONS}, got {directions}")
    extra = set(df["direction"].unique()) - set(directions)
    if extra:
        raise RankingsError(f"rankings hold direction(s) {sorted(extra)} that are not evaluated")
    out = {}
    for d in DIRECTIONS:
        if d not in directions:
            continue
        queries, lists = ranked_lists(df, d)
        check_queries(d, queries, (caption_to_image if d == schema.DIRECTION_T2I else image_to_captions).keys())
        first = direction_first_hits(d, lists, queries, caption_to_image, image_to_captions)
        out[d] = DirectionHits(d, queries, first, int(min(len(x) for x in lists)))
    return out


def recall_summary(hits: Mapping[str, DirectionHits], collection_size: int,
                   ks: Sequence[int] = DEFAULT_KS) -> dict:
    """``<d>_R@<k>`` and ``<d>_queries`` for both directions (NaN and 0 for a direction not in ``hits``), ``mR``
    (mean of the evaluated recalls), ``collection_size`` and ``ranked_depth`` (shortest ranked list)."""
    ks = _check_ks(ks)
    result: dict = {}
    for d in DIRECTIONS:
        h = hits.get(d)
        result.update({f"{d}_R@{kk}": h.recall(kk) if h else float("nan") for kk in ks})
        result[f"{d}_queries"] = len(h.query_ids) if h else 0
    result["mR"] = float(np.mean([result[f"{d}_R@{kk}"] for d in hits for kk in ks]))
    result["collection_size"] = int(collection_size)
    result["ranked_depth"] = int(min(h.depth for h in hits.values()))
    if result["ranked_depth"] < max(ks):
        log.warning("some ranked lists hold only %d items (< %d): R@%d counts them as misses beyond",
                    result["ranked_depth"], max(ks), max(ks))
    return result


def evaluate_rankings(rankings: Union[pd.DataFrame, pa.Table], caption_to_image: Mapping[int, int],
                      image_to_captions: Mapping[int, Collection[int]], ks: Sequence[int] = DEFAULT_KS,
                      directions: Sequence[str] = DIRECTIONS) -> dict:
    """Recall of the given directions of a rankings table: :func:`recall_summary` of :func:`rankings_hits`, the
    collection size being the gold images."""
    return recall_summary(rankings_hits(rankings, caption_to_image, image_to_captions, directions),
                          len(image_to_captions), ks)

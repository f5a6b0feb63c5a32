"""Candidate pairs, score fusion and the final ranking of one query's candidates (paper section 3, App. A.2).

The bi-encoder (BE) retrieves n candidates, best first; the cross-encoder (CE) scores the top k of them.
Within the top k the fused score decides the order; candidates below k keep their BE order underneath.
This module is the one implementation of every step between retrieval and a rankings table; the rerank
pipeline's DoFns and benchmarks.evaluate call it, nothing else builds pairs or ranks:

  :func:`query_pairs`      the (caption_id, image_id) pairs of one query's BE top-k (either direction)
  :func:`merge_requesters` a pair's requesting queries, deduplicated: a pair asked for by a t2i and an i2t
                           query is scored once
  :func:`ce_scores_of`     one query's CE scores of its top-k, looked up from scored pairs (a gap is an error)
  :func:`fuse` / :func:`rank_query`  fusion and the final order of one query
  :func:`rankings_table`   rank_query results -> a table in ``schema.RANKING_SCHEMA``
  :func:`derive_rankings`  a stored rankings table re-ranked for another mode, k or lam (score once,
                           evaluate many)

Modes:
  ``emb``       BE only (no rerank; CE scores are ignored and may be None)
  ``ce``        CE scores replace BE scores in the top k (the paper's best setting; the CLIs' "co")
  ``add``       lam * e + (1 - lam) * sigmoid(c)
  ``norm_add``  lam * minmax(e) + (1 - lam) * minmax(c), min-max over the top k (constant -> 0)

``final_score`` of the output rows: the fused score for the reranked top k; for the i-th row of the BE
tail (i = 1, 2, ...) it is ``min(fused top-k) - i``: strictly decreasing and below every reranked row, so
sorting by final_score descending reproduces the ranks. It is an ordering key, not a calibrated score;
``rank`` (1-based) is authoritative; ``be_rank`` is the row's position in the BE order. BE scores must be
"higher is better" (negate L2 distances).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa

from retrieval_core.data import schema

MODES = ("emb", "ce", "add", "norm_add")
#: A ranking stores at least this many rows per query, whatever its rerank depth k: recall@10 reads from every run.
MIN_STORED_DEPTH = 10


def stored_depth(k: int) -> int:
    """The rows per query a ranking of rerank depth ``k`` stores: its BE top max(k, MIN_STORED_DEPTH)."""
    return max(int(k), MIN_STORED_DEPTH)
#: The modes a run is made and evaluated with (pipelines.rerank / benchmarks.evaluate --mode): "co" reranks
#: the BE top-k with the CE, "ce" is exhaustive CE over the whole pool; both rank by the CE score.
RUN_MODES = ("emb", "co", "ce", "add", "norm_add")
RUN_TO_RANK_MODE = {"emb": "emb", "co": "ce", "ce": "ce", "add": "add", "norm_add": "norm_add"}
FUSION_MODES = ("add", "norm_add")
#: A rankings run directory (written by pipelines.rerank, read by benchmarks.evaluate): the shards are
#: ``<run>/rankings/*.parquet``; ``<run>/rankings_manifest.json`` lists the ones that belong to the run.
RANKINGS_SUBDIR = "rankings"
RANKINGS_MANIFEST = "rankings_manifest.json"


# ------------------------------------------------------------------------------------------ CE pairs
def query_pairs(direction: str, query_id: int, candidate_ids: Sequence[int], k: int) -> list[tuple[int, int]]:
    """The (caption_id, image_id) pairs the CE scores for one query: its first k candidates (BE order).

    t2i: the query is a caption and the candidates are images; i2t the other way round."""
    if direction not in (schema.DIRECTION_T2I, schema.DIRECTION_I2T):
        raise ValueError(f"direction must be {schema.DIRECTION_T2I!r} or {schema.DIRECTION_I2T!r}, "
                         f"got {direction!r}")
    top = [int(c) for c in np.asarray(candidate_ids)[:k].tolist()]
    q = int(query_id)
    return [(q, c) for c in top] if direction == schema.DIRECTION_T2I else [(c, q) for c in top]


def merge_requesters(requesters: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The distinct (direction, query_id) that asked for one pair, sorted: the pair is scored once and its
    score goes back to each of them."""
    return tuple(sorted({(str(d), int(q)) for d, q in requesters}))


def pair_requests(queries: Iterable[tuple[tuple[str, int], Sequence[int]]], k: int
                  ) -> dict[tuple[int, int], tuple[tuple[str, int], ...]]:
    """In-process form of the pipeline's pair dedup: {(caption_id, image_id): requesters} over
    ((direction, query_id), candidate_ids) items."""
    asked: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for (direction, qid), cands in queries:
        for pair in query_pairs(direction, qid, cands, k):
            asked.setdefault(pair, []).append((direction, qid))
    return {pair: merge_requesters(reqs) for pair, reqs in asked.items()}


def ce_scores_of(candidate_ids: Sequence[int], k: int, scores: Mapping[int, float], query: str = "query"
                 ) -> np.ndarray:
    """CE scores (float64) of the first min(k, n) candidates, from {candidate id: score}; a candidate
    without a score is an error naming ``query`` (never a silent gap in a ranking)."""
    top = [int(c) for c in np.asarray(candidate_ids)[:k].tolist()]
    missing = [c for c in top if c not in scores]
    if missing:
        raise ValueError(f"{query}: no CE score for candidate(s) {missing[:5]}")
    return np.array([scores[c] for c in top], dtype=np.float64)


# ------------------------------------------------------------------------------------ fusion, ranking
def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Split by sign so large |x| neither overflows exp nor loses precision.
    out = np.empty_like(x, dtype=np.float64)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def _minmax(x: np.ndarray) -> np.ndarray:
    lo, hi = float(np.min(x)), float(np.max(x))
    if hi - lo <= 0.0:
        return np.zeros_like(x, dtype=np.float64)
    return (x - lo) / (hi - lo)


def fuse(be_scores: np.ndarray, ce_scores: Optional[np.ndarray], mode: str, lam: float = 0.5) -> np.ndarray:
    """Fused scores (float64, higher is better) of the top-k candidates."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    e = np.asarray(be_scores, dtype=np.float64)
    if mode == "emb":
        return e.copy()
    if ce_scores is None:
        raise ValueError(f"mode {mode!r} needs CE scores")
    c = np.asarray(ce_scores, dtype=np.float64)
    if c.shape != e.shape:
        raise ValueError(f"{c.shape} CE scores for {e.shape} BE scores")
    if not (np.all(np.isfinite(e)) and np.all(np.isfinite(c))):
        raise ValueError("BE and CE scores must be finite")
    if mode == "ce":
        return c.copy()
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    if mode == "add":
        return lam * e + (1.0 - lam) * _sigmoid(c)
    return lam * _minmax(e) + (1.0 - lam) * _minmax(c)


def rank_query(candidate_ids: np.ndarray, be_scores: np.ndarray, ce_scores: Optional[np.ndarray], k: int,
               mode: str, lam: float = 0.5, keep: Optional[int] = None) -> dict[str, np.ndarray]:
    """Final ranking of one query's candidates.

    ``candidate_ids`` / ``be_scores`` (n,) arrive in BE order, best first; ``ce_scores`` (k',) scores the
    first k' = min(k, n) of them. The top k' are reordered by the fused score (ties: better BE rank first);
    the rest keep their BE order below. Returns the first ``keep`` (default stored_depth(k)) rows as arrays
    ``item_id, rank, be_rank, be_score, ce_score (NaN outside the top k), final_score``, best first.
    """
    ids = np.asarray(candidate_ids, dtype=np.int64)
    be = np.asarray(be_scores, dtype=np.float64)
    if ids.ndim != 1 or be.shape != ids.shape:
        raise ValueError(f"candidate_ids {ids.shape} and be_scores {be.shape} must be equal-length 1-D arrays")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("duplicate candidate ids")
    n = len(ids)
    kk = min(k, n)
    if n > 1 and np.any(np.diff(be) > 1e-6 * (1.0 + np.abs(be[:-1]))):
        raise ValueError("candidates must arrive in BE order (best first)")
    ce_full = np.full(n, np.nan)
    if mode == "emb":
        fused = be[:kk].copy()
        if ce_scores is not None:
            ce_full[:kk] = np.asarray(ce_scores, dtype=np.float64)[:kk]
    else:
        if ce_scores is None:
            raise ValueError(f"mode {mode!r} needs CE scores")
        ce = np.asarray(ce_scores, dtype=np.float64)
        if ce.shape != (kk,):
            raise ValueError(f"expected {kk} CE scores (top min(k, n)), got {ce.shape}")
        fused = fuse(be[:kk], ce, mode, lam)
        ce_full[:kk] = ce
    # Stable sort on -fused: equal fused scores keep BE order.
    order = np.concatenate([np.argsort(-fused, kind="stable"), np.arange(kk, n)])
    final = np.empty(n, dtype=np.float64)
    final[:kk] = fused
    if n > kk:
        # Tail below the reranked block: strictly decreasing, under every reranked score.
        final[kk:] = np.min(fused) - np.arange(1, n - kk + 1, dtype=np.float64)
    keep = stored_depth(k) if keep is None else int(keep)
    top = order[:keep]
    return {
        "item_id": ids[top],
        "rank": np.arange(1, len(top) + 1, dtype=np.int32),
        "be_rank": (top + 1).astype(np.int32),
        "be_score": be[top].astype(np.float32),
        "ce_score": ce_full[top].astype(np.float32),
        "final_score": final[top].astype(np.float32),
    }


def rankings_table(direction: str, query_ids: Sequence[int], per_query_results: Sequence[dict]) -> pa.Table:
    """One Arrow table (``schema.RANKING_SCHEMA``) from :func:`rank_query` results; NaN CE -> null."""
    if direction not in (schema.DIRECTION_T2I, schema.DIRECTION_I2T):
        raise ValueError(f"direction must be {schema.DIRECTION_T2I!r} or {schema.DIRECTION_I2T!r}, got {direction!r}")
    query_ids = np.asarray(query_ids, dtype=np.int64)
    if len(query_ids) != len(per_query_results):
        raise ValueError(f"{len(query_ids)} query ids for {len(per_query_results)} results")
    lengths = np.array([len(r["item_id"]) for r in per_query_results], dtype=np.int64)

    def cat(key, dtype):
        parts = [np.asarray(r[key], dtype=dtype) for r in per_query_results]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    ce = cat("ce_score", np.float32)
    total = int(lengths.sum())
    columns = {
        "direction": pa.array([direction] * total, type=pa.string()),
        "query_id": pa.array(np.repeat(query_ids, lengths), type=pa.int64()),
        "rank": pa.array(cat("rank", np.int32), type=pa.int32()),
        "item_id": pa.array(cat("item_id", np.int64), type=pa.int64()),
        "be_rank": pa.array(cat("be_rank", np.int32), type=pa.int32()),
        "be_score": pa.array(cat("be_score", np.float32), type=pa.float32()),
        "ce_score": pa.array(ce, type=pa.float32(), mask=np.isnan(ce)),
        "final_score": pa.array(cat("final_score", np.float32), type=pa.float32()),
    }
    return pa.Table.from_pydict(columns, schema=schema.RANKING_SCHEMA)


def derive_rankings(table: pa.Table, k: int, mode: str, lam: float = 0.5) -> pa.Table:
    """Re-rank stored rankings (``schema.RANKING_SCHEMA`` rows of one or both directions) as a run with
    (k, mode, lam) would have: per query, the stored rows in BE order (``be_rank``) are the BE candidates,
    the stored ``ce_score`` of the first min(k, n) of them the CE scores, and :func:`rank_query` decides.

    Gives exactly the rankings of a run with that k and mode when the stored run retrieved at least
    stored_depth(k) candidates and CE-scored at least the top k (same BE, same CE scores): a pipelines.rerank run
    stores its BE top stored_depth(k), with the CE scores of its top k. A CE mode needs a CE score for each of
    the top min(k, n) rows: a gap is an error naming the query."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    missing = [c for c in schema.RANKING_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"rankings lack column(s) {missing}")
    direction = table.column("direction").to_numpy(zero_copy_only=False)
    parts = []
    for d in (schema.DIRECTION_T2I, schema.DIRECTION_I2T):
        mask = direction == d
        if not mask.any():
            continue
        sub = table.filter(pa.array(mask))
        qid = sub.column("query_id").to_numpy()
        be_rank = sub.column("be_rank").to_numpy()
        order = np.lexsort((be_rank, qid))
        qid, be_rank = qid[order], be_rank[order]
        ids = sub.column("item_id").to_numpy()[order]
        be = sub.column("be_score").to_numpy(zero_copy_only=False)[order].astype(np.float64)
        ce = sub.column("ce_score").to_numpy(zero_copy_only=False)[order].astype(np.float64)  # null -> NaN
        queries, starts = np.unique(qid, return_index=True)
        ends = np.append(starts[1:], len(qid))
        results = []
        for q, a, b in zip(queries.tolist(), starts.tolist(), ends.tolist()):
            if not np.array_equal(be_rank[a:b], np.arange(1, b - a + 1)):
                raise ValueError(f"{d} query {q}: be_rank is not 1..{b - a}; not a complete stored BE list")
            kk = min(k, b - a)
            top_ce = None
            if mode != "emb":
                top_ce = ce[a:a + kk]
                if np.isnan(top_ce).any():
                    gap = int(np.flatnonzero(np.isnan(top_ce))[0]) + 1
                    raise ValueError(f"{d} query {q}: no stored CE score at BE rank {gap}, so mode {mode!r} "
                                     f"at k={k} cannot be derived (the run CE-scored fewer candidates)")
            results.append(rank_query(ids[a:b], be[a:b], top_ce, k, mode, lam=lam))
        parts.append(rankings_table(d, queries, results))
    if not parts:
        return schema.RANKING_SCHEMA.empty_table()
    return pa.concat_tables(parts)

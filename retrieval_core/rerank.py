"""Score fusion and the final ranking of one query's candidates (paper section 3 and Appendix A.2).

The bi-encoder (BE) retrieves n candidates, best first; the cross-encoder (CE) scores the top k of them.
Within the top k the fused score decides the order; candidates below k keep their BE order underneath.

Modes:
  ``emb``       BE only (no rerank; CE scores are ignored and may be None)
  ``ce``        CE scores replace BE scores in the top k (the paper's best setting)
  ``add``       lam * e + (1 - lam) * sigmoid(c)
  ``norm_add``  lam * minmax(e) + (1 - lam) * minmax(c), min-max over the top k (constant -> 0)

``final_score`` of the output rows: the fused score for the reranked top k; for the i-th row of the BE
tail (i = 1, 2, ...) it is ``min(fused top-k) - i``: strictly decreasing and below every reranked row, so
sorting by final_score descending reproduces the ranks. It is an ordering key, not a calibrated score;
``rank`` (1-based) is authoritative. BE scores must be "higher is better" (negate L2 distances).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pyarrow as pa

from retrieval_core import schema

MODES = ("emb", "ce", "add", "norm_add")
#: A rankings run directory (written by pipelines.rerank, read by benchmarks.evaluate): the shards are
#: ``<run>/rankings/*.parquet``; ``<run>/rankings_manifest.json`` lists the ones that belong to the run.
RANKINGS_SUBDIR = "rankings"
RANKINGS_MANIFEST = "rankings_manifest.json"


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
    the rest keep their BE order below. Returns the first ``keep`` (default max(k, 10)) rows as arrays
    ``item_id, rank, be_score, ce_score (NaN outside the top k), final_score``, best first.
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
    keep = max(k, 10) if keep is None else int(keep)
    top = order[:keep]
    return {
        "item_id": ids[top],
        "rank": np.arange(1, len(top) + 1, dtype=np.int32),
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
        "be_score": pa.array(cat("be_score", np.float32), type=pa.float32()),
        "ce_score": pa.array(ce, type=pa.float32(), mask=np.isnan(ce)),
        "final_score": pa.array(cat("final_score", np.float32), type=pa.float32()),
    }
    return pa.Table.from_pydict(columns, schema=schema.RANKING_SCHEMA)

"""Exact inner-product top-k: the one exact search of the project (the rerank job's exact searcher, the
sharded index's exact fallback, training's dev evaluation and negative mining, the latency suite's exact rows).
Ties go to the smaller id, so every exact search ranks alike."""
from __future__ import annotations

import logging
import warnings
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)


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
            s = torch.from_numpy(items[a:a + rows] @ q[0])[None]  # thread, slower: docs/log/PERFORMANCE-2026-11.md)
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

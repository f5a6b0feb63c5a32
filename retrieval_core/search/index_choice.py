"""Choosing a FAISS index and its search parameters under a memory and a query-time budget (autofaiss'
approach, hand-written: autofaiss 2.18 pins numpy<2 and pandas<3, so installing it would downgrade this
environment's numpy 2.4 -- pip install --dry-run autofaiss).

Plain functions over numpy arrays (no Beam); ``pipelines.build_index --index-factory auto`` calls them.

1. Candidates (:func:`candidate_factories`): Flat, IVF-Flat, IVF-SQ8, IVF-PQ and HNSW32, nlist from N; each
   with its memory estimated from N and d (:func:`estimated_bytes`). One over the memory budget is dropped.
2. Each remaining candidate is built on a tuning collection (a deterministic sample of the items, the whole
   collection when it is small), its search parameter (nprobe / efSearch) swept upward until recall@10
   against exact search on held-out queries reaches the target (:func:`tune_search`), and its single-query
   p50 measured (:func:`query_ms`). On a sample, query time is scaled to N (linearly for Flat and IVF,
   whose scans grow with N; by log N for HNSW) and marked as such.
3. The cheapest candidate (lowest query time, then least memory) meeting recall, memory and query time is
   chosen; none -> :class:`NoIndexFits` naming each candidate's reason on one line.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from retrieval_core.search.exact import exact_topk
from retrieval_core.search.index import (
    MIN_POINTS_PER_CENTROID,
    ShardedIndex,
    build_shard,
    needs_training,
    train_index,
    training_sample,
)

#: The search-parameter sweeps: the smallest value reaching the recall target wins.
NPROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
EF_SEARCHES = (16, 32, 64, 128, 256, 512, 1024)
HNSW_M = 32
K = 10
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


class NoIndexFits(ValueError):
    """No candidate meets the recall target within the memory and query-time budgets."""


def parse_bytes(text: str) -> int:
    """'4GB' -> 4e9, '512MiB' -> 512 * 2**20, '1000' -> 1000 bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"a memory size must be a positive number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class IndexBudget:
    max_memory_bytes: Optional[int] = None  # None: no memory limit
    max_query_ms: Optional[float] = None  # single-query p50 (None: no limit)
    recall_target: float = 0.99  # recall@10 against exact search on held-out queries

    def __post_init__(self):
        if self.max_memory_bytes is not None and self.max_memory_bytes <= 0:
            raise ValueError(f"max_memory_bytes must be > 0, got {self.max_memory_bytes}")
        if self.max_query_ms is not None and not self.max_query_ms > 0:
            raise ValueError(f"max_query_ms must be > 0, got {self.max_query_ms}")
        if not 0 < self.recall_target <= 1:
            raise ValueError(f"recall_target must be in (0, 1], got {self.recall_target}")

    def as_dict(self) -> dict:
        return {"max_memory_bytes": self.max_memory_bytes, "max_query_ms": self.max_query_ms,
                "recall_target": self.recall_target}


def ivf_nlist(n: int) -> int:
    """IVF lists for N vectors: ~4 sqrt(N), at most 1024, >= 39 training points per list."""
    return int(max(1, min(1024, 4 * math.sqrt(n), n // MIN_POINTS_PER_CENTROID)))


def candidate_factories(n: int, d: int) -> list[str]:
    nlist = ivf_nlist(n)
    out = ["Flat", f"IVF{nlist},Flat", f"IVF{nlist},SQ8"]
    m = max(1, d // 4)  # PQ: d/4 one-byte codes per vector (16x smaller than float32)
    if d % m == 0:
        out.append(f"IVF{nlist},PQ{m}x8")
    return out + [f"HNSW{HNSW_M}"]


def estimated_bytes(factory: str, n: int, d: int) -> int:
    """Memory of ``factory`` holding n d-dim vectors with int64 ids (faiss' layouts, to within a few %)."""
    ivf = re.match(r"IVF(\d+),(.+)", factory)
    if factory == "Flat":
        return n * (4 * d + 8)  # IDMap2: vectors + ids
    if factory.startswith("HNSW"):
        m = int(factory[4:] or 32)
        return n * (4 * d + 8 + 2 * m * 4 + 8)  # vectors, ids, ~2M level-0 links of int32, level offsets
    if ivf:
        nlist, code = int(ivf.group(1)), ivf.group(2)
        per = {"Flat": 4 * d, "SQ8": d}.get(code)
        if per is None and (pq := re.fullmatch(r"PQ(\d+)x8", code)):
            per = int(pq.group(1))
        if per is None:
            raise ValueError(f"no memory estimate for {factory!r}")
        return n * (per + 8) + nlist * d * 4
    raise ValueError(f"no memory estimate for {factory!r}")


def search_param(factory: str) -> Optional[tuple[str, Sequence[int]]]:
    """(faiss parameter name, sweep) of a factory; None for Flat (nothing to tune)."""
    if factory.startswith("HNSW"):
        return "efSearch", EF_SEARCHES
    if factory.startswith("IVF"):
        nlist = int(re.match(r"IVF(\d+)", factory).group(1))
        return "nprobe", tuple(v for v in NPROBES if v < nlist) + (nlist,)
    return None


def recall_at_10(found: np.ndarray, exact: np.ndarray) -> float:
    """Share of the exact top 10 found in the top 10 (faiss.contrib.evaluation.knn_intersection_measure)."""
    from faiss.contrib.evaluation import knn_intersection_measure

    return float(knn_intersection_measure(found[:, :K], exact[:, :K]))


def tune_search(index: ShardedIndex, factory: str, queries: np.ndarray, exact_ids: np.ndarray,
                recall_target: float, start: Optional[int] = None) -> tuple[dict, float, list]:
    """Sweep nprobe / efSearch upward (from ``start``) until recall@10 reaches the target; set the chosen
    value on ``index``. Returns ({name: value} or {} for Flat, its recall, the sweep [(value, recall)])."""
    sp = search_param(factory)
    if sp is None:
        return {}, recall_at_10(index.search(queries, K)[1], exact_ids), []
    name, values = sp
    sweep = []
    for v in values:
        if start is not None and v < start:
            continue
        index.set_params(**{name: v})
        sweep.append((v, recall_at_10(index.search(queries, K)[1], exact_ids)))
        if sweep[-1][1] >= recall_target:
            break
    index.set_params(**{name: sweep[-1][0]})
    return {name: sweep[-1][0]}, sweep[-1][1], sweep


def query_ms(index: ShardedIndex, queries: np.ndarray, reps: int = 50, warmup: int = 3) -> float:
    """p50 milliseconds of a single-query search (one query per call, as an interactive user sends)."""
    n = min(len(queries), reps + warmup)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        index.search(queries[i:i + 1], K)
        if i >= min(warmup, n - 1):
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1000


@dataclass
class Candidate:
    factory: str
    estimated_bytes: int
    params: dict = field(default_factory=dict)
    recall: Optional[float] = None
    query_ms: Optional[float] = None
    build_s: Optional[float] = None
    sweep: list = field(default_factory=list)
    rejected: Optional[str] = None  # why it does not fit (None: it fits)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def choose_index(ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray, n_total: int, budget: IndexBudget,
                 metric: str = "ip", seed: int = 0, log: Callable[[str], None] = lambda m: None
                 ) -> tuple[Candidate, list[Candidate]]:
    """Choose among :func:`candidate_factories` (see the module docstring). ``ids``/``vectors``: the tuning
    collection (all N items, or a sample of them); ``n_total``: N, for memory and query-time scaling.
    Returns (the chosen candidate, every candidate with its measurements or reason)."""
    n_s, d = vectors.shape
    if n_s == 0 or len(queries) == 0:
        raise ValueError(f"choosing an index needs items and queries, got {n_s} and {len(queries)}")
    scale = n_total / n_s
    exact = exact_topk(queries, vectors, ids, K)[1] if metric == "ip" else None
    cands = []
    for fac in candidate_factories(n_total, d):
        c = Candidate(fac, estimated_bytes(fac, n_total, d))
        cands.append(c)
        if budget.max_memory_bytes is not None and c.estimated_bytes > budget.max_memory_bytes:
            c.rejected = f"needs ~{human_bytes(c.estimated_bytes)} > {human_bytes(budget.max_memory_bytes)}"
            continue
        sample_fac = fac if not fac.startswith("IVF") else re.sub(r"IVF\d+", f"IVF{ivf_nlist(n_s)}", fac)
        t0 = time.perf_counter()
        sample = training_sample(ids, vectors, min(n_s, 100_000), seed=seed) \
            if needs_training(sample_fac, d, metric) else None
        index = ShardedIndex([build_shard(train_index(sample_fac, d, metric, sample, seed=seed), ids,
                                          vectors)])
        c.build_s = time.perf_counter() - t0
        if exact is None:
            exact = ShardedIndex([build_shard(train_index("Flat", d, metric, None), ids, vectors)]
                                    ).search(queries, K)[1]
        c.params, c.recall, c.sweep = tune_search(index, sample_fac, queries, exact, budget.recall_target)
        ms = query_ms(index, queries)
        growth = scale if not fac.startswith("HNSW") else math.log(max(n_total, 2)) / math.log(max(n_s, 2))
        c.query_ms = ms * max(1.0, growth)
        if c.recall < budget.recall_target:
            c.rejected = f"recall@10 {c.recall:.3f} < {budget.recall_target} at {_fmt(c.params)}"
        elif budget.max_query_ms is not None and c.query_ms > budget.max_query_ms:
            c.rejected = f"{c.query_ms:.2f} ms > {budget.max_query_ms} ms per query at {_fmt(c.params)}"
        log(f"auto index: {fac}: recall@10 {c.recall:.3f} at {_fmt(c.params)}, {c.query_ms:.2f} ms/query"
            f"{' (scaled to N)' if scale > 1 else ''}, ~{human_bytes(c.estimated_bytes)}"
            f"{': ' + c.rejected if c.rejected else ''}")
        del index
    fits = [c for c in cands if c.rejected is None]
    if not fits:
        raise NoIndexFits("no index meets the budget (recall@10 >= {}, {}, {}): {}".format(
            budget.recall_target,
            f"<= {human_bytes(budget.max_memory_bytes)}" if budget.max_memory_bytes else "any memory",
            f"<= {budget.max_query_ms} ms/query" if budget.max_query_ms else "any query time",
            "; ".join(f"{c.factory}: {c.rejected}" for c in cands)))
    best = min(fits, key=lambda c: (round(c.query_ms, 3), c.estimated_bytes))
    return best, cands


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "no search parameter"

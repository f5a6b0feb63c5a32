"""Queries per faiss call against the time of a rerank search pass: one index shard of the project's Flat
factory (retrieval_core.search.index, inner product) searched for the rerank job's n = 100 candidates with
``--queries-per-call`` queries at a time, beside numpy's GEMM over the same shapes (the machine's rate).

    python -m benchmarks.meters.search_batch [--shard-size 50000] [--threads 2] [--output search_batch.csv]

Why it exists: at 1M the rerank job searched in calls of 256 queries, and faiss ran those at a fraction of the
rate it reaches from ~512 queries per call (docs/log/PERFORMANCE-2026-11.md, "Search"); the CSV is the evidence for
pipelines.rerank's --search-batch-size default.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import click
import numpy as np

from benchmarks.report import environment, provenance, write_csv
from retrieval_core.cli import CheckedPlan, option, plan_command, plan_from_cli, threads_option
from retrieval_core.search.index import build_shard, set_threads, train_index

COLUMNS = ("shard_size", "dim", "candidates", "queries_per_call", "search_ms", "us_per_query", "search_gflops",
           "gemm_gflops", "device", "cpu_model", "threads", "torch", "faiss", "commit", "date", "notes")


@dataclass(frozen=True)
class SearchBatchPlan(CheckedPlan):
    """The measurement's options, each a typed field."""
    shard_size: int = option(50_000, type=click.IntRange(min=1000), help="vectors in the index shard")
    dim: int = option(384, type=click.IntRange(min=8), help="embedding width (MiniLM's 384)")
    candidates: int = option(100, type=click.IntRange(min=1), help="n, the top list a rerank query keeps")
    queries_per_call: tuple[int, ...] = option((128, 256, 512, 1024, 4096), sep=",", type=click.IntRange(min=1),
                                               help="queries per faiss search call, comma-separated")
    repeats: int = option(3, type=click.IntRange(min=1), help="timings per size (the best is kept)")
    threads: Optional[int] = threads_option()
    output: Optional[str] = option(None, help="CSV to write (default: print only)")


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(plan: SearchBatchPlan) -> list[dict]:
    """One row per queries-per-call size: the best of ``repeats`` searches of that many queries."""
    if plan.threads:
        set_threads(plan.threads)
    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731  (cosine embeddings)
    xb = unit(rng.standard_normal((plan.shard_size, plan.dim), dtype=np.float32))
    xq = unit(rng.standard_normal((max(plan.queries_per_call), plan.dim), dtype=np.float32))
    shard = build_shard(train_index("Flat", plan.dim, "ip", None), np.arange(plan.shard_size, dtype=np.int64), xb)
    env = environment(threads=plan.threads)
    rows = []
    for nq in plan.queries_per_call:
        flop = 2.0 * nq * plan.shard_size * plan.dim
        gemm = _best(lambda: xq[:nq] @ xb.T, plan.repeats)
        search = _best(lambda: shard.search(xq[:nq], plan.candidates), plan.repeats)
        rows.append({"shard_size": plan.shard_size, "dim": plan.dim, "candidates": plan.candidates,
                     "queries_per_call": nq, "search_ms": round(1e3 * search, 3),
                     "us_per_query": round(1e6 * search / nq, 1), "search_gflops": round(flop / search / 1e9, 1),
                     "gemm_gflops": round(flop / gemm / 1e9, 1),
                     **{c: env[c] for c in ("device", "cpu_model", "threads", "torch", "faiss")}, **provenance(),
                     "notes": f"best of {plan.repeats}; random unit vectors; numpy GEMM of the same shapes"})
    return rows


@plan_command(SearchBatchPlan)
def main(**values) -> None:
    """Time faiss' search of one index shard by queries per call."""
    try:
        plan = plan_from_cli(SearchBatchPlan, values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not plan.queries_per_call:
        raise click.UsageError("--queries-per-call: give at least one size")
    rows = measure(plan)
    for r in rows:
        click.echo(f"{r['queries_per_call']:>5} queries per call: {r['search_ms']:8.1f} ms, {r['us_per_query']:7.1f} "
                   f"us per query, {r['search_gflops']:6.1f} GFLOP/s (GEMM {r['gemm_gflops']:.0f})")
    if plan.output:
        click.echo(f"wrote {write_csv(plan.output, rows, COLUMNS)}")


if __name__ == "__main__":
    main()

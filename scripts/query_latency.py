"""Per-query latency of the Python query entry point (retrieval_core.search.query.QueryEngine): what
docs/QUERY.md's latency table is generated from (docs/results/query_latency.csv).

    python scripts/query_latency.py --staged runs/demo/staged --embeddings EMB --index INDEX \
        --output docs/results/query_latency.csv --threads 2 --queries 200

Opens the engine (timed: models, index, staged lookups loaded), then asks ``--queries`` queries one call each,
after ``--warmup`` untimed ones: text queries (the staged captions of ``--split``, in id order, one per image) over
the image index, and image queries (those images by id) over the caption pool; each with the BE only (emb) and
with the CE reranking the top ``--k`` (co). A row per (direction, mode): the median, 90th percentile and mean of
the calls' wall time, query encoding, search, CE and ranking included; the machine's 1-minute load average
before and after (a shared machine slows every number), and $OMP_WAIT_POLICY: on a machine busier than its cores,
OpenMP's default spin-waiting made each 2-thread call ~20x slower (390 ms instead of 14-18 ms for a BE-only query
at a load average of 8); PASSIVE, or one thread, avoids it.
"""
from __future__ import annotations

import csv
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import click
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report.schema import environment  # noqa: E402
from retrieval_core.cli import (  # noqa: E402
    CONTEXT_SETTINGS,
    CheckedPlan,
    count_option,
    k_option,
    option,
    plan_from_cli,
    plan_options,
    threads_option,
)
from retrieval_core.data.store import StagedDataset  # noqa: E402
from retrieval_core.search.query import I2T, T2I, Query, QueryEngine  # noqa: E402

COLUMNS = ("date", "commit", "cpu_model", "device", "threads", "torch", "faiss", "pool_images", "pool_captions",
           "search", "direction", "mode", "k", "queries", "load_s", "p50_ms", "p90_ms", "mean_ms", "omp_wait_policy",
           "loadavg_1m_before", "loadavg_1m_after")


@dataclass(frozen=True)
class LatencyPlan(CheckedPlan):
    staged: str = option(help="staged folder")
    embeddings: str = option(help="embeddings of the pool (every image and caption to search)")
    output: str = option(help="CSV to write")
    index: Optional[str] = option(None, help="image FAISS index (default: exact search)")
    split: str = option("test", help="the split whose captions and images are the queries")
    queries: int = count_option(200, help="timed queries per (direction, mode)")
    warmup: int = count_option(10, help="untimed queries first")
    k: int = k_option(20, help="hits per query (the CE's depth)")
    threads: Optional[int] = threads_option(2)


def _time(fn, items) -> np.ndarray:
    out = []
    for item in items:
        t = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - t)
    return np.array(out) * 1000


def measure(plan: LatencyPlan) -> list[dict]:
    t0 = time.perf_counter()
    engine = QueryEngine(staged=plan.staged, embeddings=plan.embeddings, index=plan.index, device="cpu",
                         threads=plan.threads).load(warm=True)
    load_s = time.perf_counter() - t0
    ds = StagedDataset(plan.staged)
    caps = ds.captions(split=plan.split).drop_duplicates("image_item_id")
    n = plan.queries + plan.warmup
    texts = [Query(str(c), t) for c, t in zip(caps["caption_id"][:n], caps["text"][:n])]
    images = [Query(str(i), image=str(i)) for i in caps["image_item_id"][:n]]
    env = environment("cpu", threads=plan.threads)
    pools = {d: s["pool"] for d, s in engine.inputs.searchers.items()}
    rows = []
    for direction, queries, search in ((T2I, texts, engine.search_text), (I2T, images, engine.search_images)):
        for mode in ("emb", "co"):
            before = os.getloadavg()[0]
            _time(lambda q: search([q], k=plan.k, rerank=mode), queries[:plan.warmup])
            ms = _time(lambda q: search([q], k=plan.k, rerank=mode), queries[plan.warmup:])
            rows.append({**{c: env.get(c, "") for c in COLUMNS}, "pool_images": pools[T2I],
                         "pool_captions": pools[I2T], "search": engine.inputs.searchers[direction]["name"],
                         "direction": direction, "mode": mode, "k": plan.k, "queries": len(ms),
                         "load_s": round(load_s, 2), "p50_ms": round(float(np.median(ms)), 1),
                         "p90_ms": round(float(np.percentile(ms, 90)), 1), "mean_ms": round(float(ms.mean()), 1),
                         "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                         "loadavg_1m_before": round(before, 1), "loadavg_1m_after": round(os.getloadavg()[0], 1)})
            print({k: rows[-1][k] for k in ("direction", "mode", "p50_ms", "p90_ms", "mean_ms")}, flush=True)
    return rows


@click.command(context_settings=CONTEXT_SETTINGS)
@plan_options(LatencyPlan)
def main(**values):
    """Per-query latency of the query entry point; one CSV row per (direction, mode)."""
    plan = plan_from_cli(LatencyPlan, values)
    rows = measure(plan)
    with open(plan.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {plan.output}")


if __name__ == "__main__":
    main()

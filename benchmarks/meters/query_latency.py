"""Per-query latency of the Python query entry point (retrieval_core.search.query.QueryEngine), and the query job
against the rerank job on one batch of queries: what docs/QUERY.md's latency tables are generated from
(docs/results/query_latency*.csv, query_job*.csv).

    python -m benchmarks.meters.query_latency --staged runs/demo/staged --embeddings EMB --index INDEX \
        --output docs/results/query_latency.csv --threads 2 --queries 200 \
        --job-queries 5000 --job-output docs/results/query_job.csv

Opens the engine (timed: models, index, staged lookups loaded), then asks ``--queries`` queries one call each,
after ``--warmup`` untimed ones: text queries (the staged captions of ``--split``, in id order, one per image) over
the image index, and image queries (those images by id) over the caption pool; each with the BE only (emb) and
with the CE reranking the top ``--k`` (co). A row per (direction, mode): the median, 90th percentile and mean of
the calls' wall time, query encoding, search, CE and ranking included; the machine's 1-minute load average
before and after (a shared machine slows every number), and $OMP_WAIT_POLICY: on a machine busier than its cores,
OpenMP's default spin-waiting made each 2-thread call many times slower (docs/log/ENGINEERING-2026-11.md); PASSIVE,
or one thread, avoids it.

``--job-queries N[,N...]``: the same pool asked N text queries (the split's captions, one per image, seeded) twice, as a
user would: ``python -m pipelines.query`` with them in a JSONL file, and ``python -m pipelines.rerank`` with the
same captions as its ``--queries``, both ``--mode co --k K`` over the same index, each a child process timed from
start to exit (loading included). A row per job: its wall seconds, the CE pairs it scored (N x K), pairs per
second, the ratio of the query job's rate to the rerank job's, and the child's peak RSS (its own: started
through benchmarks.suites.launch's wait4 wrapper). Several counts give a pair of rows each: the jobs' memory
against the number of queries.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import click
import numpy as np

from benchmarks.report.schema import environment
from benchmarks.suites import launch
from retrieval_core.cli import (
    CONTEXT_SETTINGS,
    CheckedPlan,
    cli_errors,
    count_option,
    k_option,
    option,
    plan_from_cli,
    plan_options,
    threads_option,
)
from retrieval_core.data.store import StagedDataset
from retrieval_core.search.query import I2T, T2I, Query, QueryEngine

COLUMNS = ("date", "commit", "cpu_model", "device", "threads", "torch", "faiss", "pool_images", "pool_captions",
           "search", "direction", "mode", "k", "queries", "load_s", "reopen_s", "p50_ms", "p90_ms", "mean_ms",
           "omp_wait_policy", "loadavg_1m_before", "loadavg_1m_after")
JOB_COLUMNS = ("date", "commit", "cpu_model", "device", "threads", "torch", "faiss", "pool_images", "search", "job",
               "direction", "mode", "k", "queries", "ce_pairs", "wall_s", "pairs_per_s", "ratio_to_rerank",
               "peak_rss_mb", "omp_wait_policy", "loadavg_1m_before", "loadavg_1m_after", "command")


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
    job_queries: tuple[int, ...] = option((), sep=",", type=click.IntRange(min=1), metavar="N[,N...]",
                                          show_default=False,
                                          help="also time pipelines.query against pipelines.rerank on this many text "
                                               "queries (a pair of runs per count: memory against the number of "
                                               "queries)")
    job_output: Optional[str] = option(None, help="CSV for the job rows (with --job-queries)")
    seed: int = option(0, help="seed of the job queries' sample")
    work: Optional[str] = option(None, help="scratch folder of the job runs, kept (default: a temporary one)")


def _time(fn, items) -> np.ndarray:
    out = []
    for item in items:
        t = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - t)
    return np.array(out) * 1000


def measure(plan: LatencyPlan, env: dict) -> list[dict]:
    def open_engine() -> tuple[QueryEngine, float]:
        t = time.perf_counter()
        opened = QueryEngine(staged=plan.staged, embeddings=plan.embeddings, index=plan.index, device="cpu",
                             threads=plan.threads).load(warm=True)
        return opened, time.perf_counter() - t

    # the first open may build derived files (a large pool's region file); a user's next open finds them
    engine, load_s = open_engine()
    del engine
    engine, reopen_s = open_engine()
    ds = StagedDataset(plan.staged)
    caps = ds.captions(split=plan.split).drop_duplicates("image_item_id")
    n = plan.queries + plan.warmup
    texts = [Query(str(c), t) for c, t in zip(caps["caption_id"][:n], caps["text"][:n])]
    images = [Query(str(i), image=str(i)) for i in caps["image_item_id"][:n]]
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
                         "load_s": round(load_s, 2), "reopen_s": round(reopen_s, 2),
                         "p50_ms": round(float(np.median(ms)), 1),
                         "p90_ms": round(float(np.percentile(ms, 90)), 1), "mean_ms": round(float(ms.mean()), 1),
                         "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                         "loadavg_1m_before": round(before, 1), "loadavg_1m_after": round(os.getloadavg()[0], 1)})
            print({k: rows[-1][k] for k in ("direction", "mode", "p50_ms", "p90_ms", "mean_ms")}, flush=True)
    return rows


def _child(argv: list[str], log: str) -> tuple[float, float]:
    """Run ``python -m <argv>`` to its end: (wall seconds, peak RSS in MiB of that child). Started through
    benchmarks.suites.launch's wait4 wrapper: a child forked from this process would report at least this
    process's own peak (Linux carries the high-water mark through fork and exec), the engine loaded above."""
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="query-job-rss-") as tmp, open(log, "w") as out:
        rss_file = os.path.join(tmp, "maxrss")
        lines, wait = launch.start([sys.executable, "-m", *argv], rss_file, preload=False)
        try:
            for line in lines:
                out.write(line)
            returncode = wait(stop=False)
        finally:
            wait(stop=True)
        with open(rss_file) as f:
            peak_kib = int(f.read() or 0)
    wall = time.perf_counter() - t
    if returncode != 0:
        raise click.ClickException(f"{argv[0]} exited {returncode}: see {log}")
    return wall, peak_kib / 1024


def measure_jobs(plan: LatencyPlan, work: str, env: dict) -> list[dict]:
    """For each count of ``job_queries``: pipelines.rerank, then pipelines.query, on the same captions (mode co,
    depth k), in a subfolder ``q<count>`` of ``work``."""
    rows = []
    for count in plan.job_queries:
        folder = os.path.join(work, f"q{count}")
        os.makedirs(folder, exist_ok=True)
        rows += _measure_job_pair(plan, count, folder, env)
    return rows


def _measure_job_pair(plan: LatencyPlan, count: int, work: str, env: dict) -> list[dict]:
    import pandas as pd

    caps = StagedDataset(plan.staged).captions(split=plan.split).drop_duplicates("image_item_id")
    n = min(count, len(caps))
    caps = caps.sample(n=n, random_state=plan.seed).sort_values("caption_id")
    queries_parquet, queries_jsonl = os.path.join(work, "queries.parquet"), os.path.join(work, "queries.jsonl")
    pd.DataFrame({"direction": "t2i", "query_id": caps["caption_id"].astype("int64")}).to_parquet(queries_parquet)
    with open(queries_jsonl, "w") as f:
        for cid, text in zip(caps["caption_id"], caps["text"]):
            f.write(json.dumps({"id": str(cid), "text": text}) + "\n")
    common = ["--staged", plan.staged, "--embeddings", plan.embeddings, "--mode", "co", "--k", str(plan.k),
              "--threads", str(plan.threads)] + (["--index", plan.index] if plan.index else [])
    with open(os.path.join(plan.embeddings, "embeddings_manifest.json")) as f:
        model = json.load(f)["model"]["path"]  # the query job's default; rerank is told (the JOIN's CE)
    jobs = {"pipelines.rerank": ["pipelines.rerank", *common, "--ce-model", model, "--queries", queries_parquet,
                                 "--directions", "t2i",
                                 "--split", plan.split, "--output", os.path.join(work, "rerank")],
            "pipelines.query": ["pipelines.query", *common, "--queries", queries_jsonl, "--page-queries", "0",
                                "--output", os.path.join(work, "query")]}
    rows = []
    for job, argv in jobs.items():
        before = os.getloadavg()[0]
        wall, rss = _child(argv, os.path.join(work, f"{job}.log"))
        pairs = n * plan.k
        rows.append({**{c: env.get(c, "") for c in JOB_COLUMNS}, "pool_images": "", "search": "",
                     "job": job, "direction": T2I, "mode": "co", "k": plan.k, "queries": n, "ce_pairs": pairs,
                     "wall_s": round(wall, 1), "pairs_per_s": round(pairs / wall, 1), "peak_rss_mb": round(rss, 1),
                     "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                     "loadavg_1m_before": round(before, 1), "loadavg_1m_after": round(os.getloadavg()[0], 1),
                     "command": "python -m " + " ".join(argv)})
        print({k: rows[-1][k] for k in ("job", "wall_s", "pairs_per_s", "peak_rss_mb")}, flush=True)
    for r in rows:
        r["ratio_to_rerank"] = round(r["pairs_per_s"] / rows[0]["pairs_per_s"], 3)
    return rows


def _write(path: str, columns: tuple, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


@click.command(context_settings=CONTEXT_SETTINGS)
@plan_options(LatencyPlan)
def main(**values):
    """Per-query latency of the query entry point (one CSV row per direction and mode), and optionally the query
    job's CE pairs per second against the rerank job's on one batch of queries."""
    with cli_errors():  # a bad option value: one line, exit 1
        plan = plan_from_cli(LatencyPlan, values)
    if plan.job_queries and not plan.job_output:
        raise click.UsageError("--job-queries needs --job-output")
    # the environment (commit, date) once, at the start: an edit in the tree during a long run must not split its
    # rows across commits or mark the later ones dirty
    env = environment("cpu", threads=plan.threads)
    rows = measure(plan, env)
    _write(plan.output, COLUMNS, rows)
    if plan.job_queries:
        if plan.work:
            os.makedirs(plan.work, exist_ok=True)
            job_rows = measure_jobs(plan, plan.work, env)
        else:
            with tempfile.TemporaryDirectory(prefix="query-jobs-") as work:
                job_rows = measure_jobs(plan, work, env)
        for r in job_rows:
            r["pool_images"], r["search"] = rows[0]["pool_images"], rows[0]["search"]
        _write(plan.job_output, JOB_COLUMNS, job_rows)


if __name__ == "__main__":
    main()

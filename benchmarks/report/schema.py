"""The benchmark CSVs' schema: their columns and what each means (written beside every CSV as
``<name>.schema.json``, so a CSV read without this code still says what its columns mean), the environment every
row records (docs/CONVENTIONS.md#what-every-result-records: split, model, k, collection size, queries, hardware
and threads, library versions, the commit and date it ran, measured or extrapolated), and CSV reading/writing."""
from __future__ import annotations

import csv
import io
import math
import os
import platform
import time
from typing import Callable, Iterable, Mapping, Optional, Sequence

#: ``model`` of the rows that measure the paper's code path (benchmarks.suites.latency)
PAPER_CODE_MODEL = "paper-code"

#: The recalls whose bootstrap intervals every recall row carries (retrieval_core.evaluation.stats).
METRICS = ("R@1", "R@5", "R@10", "mR")
#: Per recall row: each recall's interval, then the reranked rows' paired difference to EMB with its interval.
INTERVAL_COLUMNS = tuple(f"{m}_{e}" for m in METRICS for e in ("lo", "hi")) + ("against",) + tuple(
    f"delta_{m}{e}" for m in METRICS for e in ("", "_lo", "_hi")) + ("bootstrap",)

#: Rows ranked by one model in two serving precisions (or any two runs of the same queries): how far the two runs'
#: stored scores of the same (query, item) pairs lie apart (retrieval_core.evaluation.runs.score_differences).
SCORE_DIFF_COLUMNS = tuple(f"{s}_score_{stat}_diff" for s in ("be", "ce") for stat in ("max_abs", "mean_abs")) + (
    "be_pairs_compared", "ce_pairs_compared")

#: Column order of every suite CSV. Optional timings stay empty where a suite does not measure them.
CSV_COLUMNS = (
    "suite", "collection", "model", "mode", "k", "lam", "fusion", "direction",
    "R@1", "R@5", "R@10", "mR", *INTERVAL_COLUMNS, *SCORE_DIFF_COLUMNS, "queries", "collection_size",
    "wall_s", "encode_s", "index_s", "search_s", "rerank_s", "ce_pairs", "per_query_ms", "peak_rss_mb",
    "launcher_peak_rss_mb", "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "ann_recall@10",
    "speedup_vs_paper_code", "search_p50_ms", "bound_ms", "index_bytes", "rate_per_s", "roofline_fraction",
    "useful_token_fraction",
    "split", "lang", "recipe", "model_seed", "device", "cpu_model", "threads", "torch", "faiss", "transformers",
    "commit", "date", "batch_size", "quantize", "measured", "rankings", "notes",
)

#: Column order of <suite>_seeds.csv: one row per suite row key, over the runs of several model seeds.
SEED_KEY = ("suite", "collection", "model", "mode", "k", "lam", "direction")
#: The environment columns a seed row carries over from its seeds' rows (several values: joined with ", ").
SEED_ENVIRONMENT = ("queries", "collection_size", "split", "lang", "recipe", "device", "cpu_model", "threads",
                    "torch", "faiss", "transformers", "commit", "date", "quantize")
SEED_COLUMNS = SEED_KEY + ("seeds", "fusion") + tuple(f"{m}_{stat}" for m in METRICS for stat in (
    "mean", "mean_lo", "mean_hi", "mean_t_lo", "mean_t_hi", "std", "min", "max")) + ("against",) + tuple(
    f"delta_{m}_{stat}" for m in METRICS for stat in ("mean", "mean_lo", "mean_hi", "mean_t_lo", "mean_t_hi", "min",
                                                       "max")) + ("bootstrap", "seed_interval", "gap_against") + tuple(
    f"gap_{m}_{stat}" for m in METRICS for stat in ("mean", "welch_lo", "welch_hi")) + SEED_ENVIRONMENT
#: The seed summary's model comparison, the paper's central claim: the first model's rows carry their seed mean
#: minus the second's (the same row key otherwise) with its Welch t interval (each recipe trained on its own seeds).
GAP_MODELS = ("JOIN", "SEP")


#: The columns of environment() that say where, when and by which code a row was measured (its batch size aside).
ENVIRONMENT_COLUMNS = ("device", "cpu_model", "threads", "torch", "faiss", "transformers", "commit", "date")
#: Column order of <suite>_jobs.csv: what every pipeline job of a suite run cost, and where the run was.
JOB_COLUMNS = ("job", "step", "wall_s", "earlier_runs_s", "peak_rss_mb", "reused", "finished", "job_threads", "output",
               "command", "quantize") + ENVIRONMENT_COLUMNS

#: What every column of the suite CSVs and the jobs CSVs holds (written as <name>.schema.json by write_csv).
COLUMN_DOCS = {
    "suite": "benchmark suite that wrote the row (benchmarks.run --suite)",
    "collection": "evaluated collection or pool label (e.g. synthetic_coco5k_1k, or per_query_<n> latency rows)",
    "model": "model family: JOIN, SEP, a baseline, or paper-code (the paper's code path, latency rows)",
    "mode": "ranking: EMB (bi-encoder only), CO (CE reranks the BE top k), CE (exhaustive CE), ADD / NORM_ADD "
            "(score fusion); latency rows name the index too",
    "k": "rerank depth: how many BE candidates the CE scored ('all' for exhaustive CE; empty for EMB)",
    "lam": "weight of the BE score in ADD / NORM_ADD fusion (empty for other modes)",
    "fusion": "AUTO rows: the fusion chosen on the dev split (co, add_<lam> or norm_add_<lam>); in <suite>_seeds.csv "
              "each seed's choice (seed:fusion)",
    "direction": "t2i (caption query, images ranked), i2t (image query, captions ranked), or both (a skipped row)",
    "R@1": "recall at 1, percent of queries with a gold item at rank 1",
    "R@5": "recall at 5, percent",
    "R@10": "recall at 10, percent",
    "mR": "mean of R@1/5/10 over the evaluated directions, percent",
    **{f"{m}_{e}": f"{'lower' if e == 'lo' else 'upper'} end of the 95 % bootstrap interval of {m} (percentile "
                   f"interval, queries resampled; see bootstrap), percent" for m in METRICS for e in ("lo", "hi")},
    "against": "the ranking the delta_* columns are a paired difference to: EMB of the same model and pool (empty: "
               "no difference, e.g. an EMB row)",
    **{f"delta_{m}": f"{m} of this row minus {m} of the 'against' ranking, percent points" for m in METRICS},
    **{f"delta_{m}_{e}": f"{'lower' if e == 'lo' else 'upper'} end of the paired 95 % bootstrap interval of "
                         f"delta_{m} (the same resampled queries for both rankings): entirely > 0 = lifts, "
                         f"entirely < 0 = lowers, else no significant difference" for m in METRICS
       for e in ("lo", "hi")},
    "bootstrap": "how the intervals were computed: level, bootstrap resamples of the queries, seed "
                 "(retrieval_core.evaluation.stats; docs/STATISTICS.md)",
    **{f"{s}_score_{stat}_diff": f"{stat.replace('_abs', '')} absolute difference between this row's run and the "
                                 f"'against' run of the {name} they both stored for the same (query, item) pairs "
                                 f"of this direction (e.g. bf16 against float32 serving)"
       for s, name in (("be", "BE score (cosine of the embeddings)"), ("ce", "CE score")) for stat in
       ("max_abs", "mean_abs")},
    "be_pairs_compared": "(query, item) pairs of this direction in both runs' BE top lists: what be_score_*_diff "
                         "is over",
    "ce_pairs_compared": "(query, item) pairs of this direction that both runs CE-scored: what ce_score_*_diff is "
                         "over",
    "queries": "number of queries evaluated in this direction",
    "collection_size": "candidate pool size in images (the t2i pool)",
    "wall_s": "seconds of the jobs behind the row (encode + index + rerank + evaluation), as measured",
    "encode_s": "seconds of the encode job(s)",
    "index_s": "seconds of the build_index job(s)",
    "search_s": "seconds of ANN search (latency rows)",
    "rerank_s": "seconds of the rerank job(s) (retrieval + CE scoring + ranking)",
    "ce_pairs": "(query, item) pairs the CE scored for the row's run (an extrapolated CE row: per query)",
    "per_query_ms": "milliseconds per query of the row's one rerank job: its wall / the queries it ranked (both "
                    "directions together; batched and amortised, start-up included: not one query's latency); an "
                    "extrapolated exhaustive CE row: its direction's pool / the CE's measured pairs per second",
    "peak_rss_mb": "peak resident memory of the row's jobs (the largest job's ru_maxrss, benchmarks.suites.jobs), MiB",
    "launcher_peak_rss_mb": "high-water resident memory of the benchmarks.run process itself once this row was "
                            "evaluated (planning, running the jobs as subprocesses, reading rankings and gold; "
                            "rows are evaluated in plan order), MiB",
    "latency_p50_ms": "median per-query latency, milliseconds",
    "latency_p95_ms": "95th percentile per-query latency, milliseconds",
    "latency_p99_ms": "99th percentile per-query latency, milliseconds",
    "ann_recall@10": "share of the exact top 10 that the ANN index returns (fraction, latency rows)",
    "speedup_vs_paper_code": "paper-code time divided by this row's time (same setting)",
    "search_p50_ms": "median time of the index search alone on pre-encoded queries, milliseconds (latency rows)",
    "bound_ms": "memory-bandwidth bound of one exact scan: collection bytes / read bandwidth measured in the "
                "same run, milliseconds (latency rows)",
    "index_bytes": "serialized size of the row's index, bytes",
    "rate_per_s": "measured throughput in the row's unit per second (latency roofline/pipeline rows: see notes)",
    "roofline_fraction": "rate_per_s / the roofline rate from the measured GEMM rate and the model's FLOPs per "
                         "unit (or, for pipeline rows, / the raw model's rate)",
    "useful_token_fraction": "token positions that carry a token / all the encoder computed (padding included) in "
                             "the row's batches: 1.0 = no padding (latency roofline, training and pipeline rows)",
    "split": "split of the queries (e.g. test)",
    "lang": "language of the caption side (ISO 639-1, e.g. en, de); empty where the collection has one language",
    "recipe": "training recipe of the cached models behind the row (retrieval_core.training.recipes: bench or demo; "
              "empty when the model folders were given)",
    "model_seed": "training seed of those cached models (empty when the model folders were given)",
    "device": "cpu or cuda (with the GPU name)",
    "cpu_model": "CPU name from /proc/cpuinfo",
    "threads": "torch + faiss threads the jobs were given",
    "torch": "torch version",
    "faiss": "faiss version",
    "transformers": "transformers version",
    "commit": "git commit of the code that ran (HEAD of its checkout; '+dirty' when tracked files differed from it, "
              "'unknown' outside a git checkout)",
    "date": "UTC date the row was measured (YYYY-MM-DD)",
    "batch_size": "model batch size of the jobs",
    "quantize": "serving precision of the encode and CE jobs (none = float32, int8, bf16)",
    "measured": "true: measured in this run; false: extrapolated or skipped (see notes)",
    "rankings": "rerank run dir(s) the recall was read from, with the derived k / mode / lam",
    "notes": "what else a reader needs: derivations, reused jobs, query samples, skip reasons",
    # <suite>_seeds.csv
    "seeds": "the model seeds the statistics are over (benchmarks.run --model-seed 0,1,2)",
    **{f"{m}_{stat}": f"{m} over the seeds: {desc}" for m in METRICS
       for stat, desc in (("mean", "mean"), ("std", "sample standard deviation"), ("min", "smallest"),
                          ("max", "largest"))},
    **{f"{m}_mean_{e}": f"{'lower' if e == 'lo' else 'upper'} end of the 95 % bootstrap interval of {m}_mean: "
                        f"queries resampled jointly across the seeds (the same resample applied to every seed's "
                        f"ranking of the same queries)" for m in METRICS for e in ("lo", "hi")},
    **{f"delta_{m}_mean": f"mean over the seeds of (this row's {m} minus the 'against' ranking's), percent points"
       for m in METRICS},
    **{f"delta_{m}_mean_{e}": f"{'lower' if e == 'lo' else 'upper'} end of the paired 95 % bootstrap interval of "
                              f"delta_{m}_mean (queries resampled jointly across seeds and both rankings): "
                              f"entirely > 0 = the seed mean lifts, entirely < 0 = lowers" for m in METRICS
       for e in ("lo", "hi")},
    **{f"{m}_mean_t_{e}": f"{'lower' if e == 'lo' else 'upper'} end of the 95 % Student t interval of {m}_mean "
                          f"from the seeds' values (the spread over training runs; see seed_interval)"
       for m in METRICS for e in ("lo", "hi")},
    **{f"delta_{m}_mean_t_{e}": f"{'lower' if e == 'lo' else 'upper'} end of the 95 % Student t interval of "
                                f"delta_{m}_mean from the seeds' own differences: entirely > 0 = the recipe lifts "
                                f"across training runs" for m in METRICS for e in ("lo", "hi")},
    **{f"delta_{m}_{stat}": f"the {word} of the seeds' own differences delta_{m}, percent points"
       for m in METRICS for stat, word in (("min", "smallest"), ("max", "largest"))},
    "seed_interval": "how the *_t_lo / *_t_hi columns were computed (level, seeds, degrees of freedom)",
    "gap_against": "the model the gap_* columns compare this row's model with (GAP_MODELS: JOIN against SEP, "
                   "the same row key otherwise); empty: no such pair",
    **{f"gap_{m}_mean": f"{m}_mean minus the gap_against model's, percent points" for m in METRICS},
    **{f"gap_{m}_welch_{e}": f"{'lower' if e == 'lo' else 'upper'} end of the 95 % Welch t interval of gap_{m}_mean "
                             f"from both models' seed values (each recipe trained on its own seeds: not paired)"
       for m in METRICS for e in ("lo", "hi")},
    # fusion_rule.csv (benchmarks.probes.fusion_rule)
    "rule": "how the default ranking was chosen on dev: EMB (none), previous (best worse-direction R@1 gain, pure CO "
            "without a noise check), today (choose_fusion: CO only when its dev lead is beyond noise)",
    "interval": "how delta_R@1_lo / delta_R@1_hi were computed: a paired query bootstrap (one model) or a Student t "
                "interval over the model seeds (a seed-mean row)",
    "co_lead": "when CO ranked first on dev: CO minus the best candidate that keeps the BE score, dev R@1 per "
               "direction with its paired 95 % bootstrap interval",
    # search_batch.csv (benchmarks.meters.search_batch)
    "shard_size": "vectors in the one index shard searched",
    "dim": "embedding width",
    "candidates": "n, the top list each query keeps (the rerank job's stored depth)",
    "queries_per_call": "queries in one faiss search call (pipelines.rerank --search-batch-size)",
    "search_ms": "wall time of one search call over the shard, best of the repeats, ms",
    "us_per_query": "search_ms per query, microseconds",
    "search_gflops": "the call's inner-product FLOPs (2 x queries x shard_size x dim) per second, GFLOP/s",
    "gemm_gflops": "the same FLOPs as one numpy float32 GEMM per second: the machine's rate at this shape",
    # <suite>_jobs.csv
    "job": "job name (unique within the suite)",
    "step": "module the job ran (python -m <step>)",
    "reused": "true: a finished output was reused (its cost as measured when it ran)",
    "finished": "when the job finished (UTC; a reused job: when it ran)",
    "job_threads": "the --threads the job's command gave it (empty: none, torch's default from the environment)",
    "earlier_runs_s": "seconds interrupted earlier runs of the job spent on work it kept (encode: from each run's "
                      "start to its last spilled batch); wall_s covers only the last run. Empty: none",
    "output": "the job's output folder",
    "command": "the full command line, Beam flags included",
}


def schema_path(csv_path: str) -> str:
    """``x.csv`` -> ``x.schema.json``: the column documentation beside a CSV."""
    return (csv_path[:-4] if csv_path.endswith(".csv") else csv_path) + ".schema.json"


def column_schema(columns: Sequence[str]) -> dict:
    """{"columns": [{"name", "description"}]} for ``columns``; a column without a description is an error."""
    undocumented = [c for c in columns if c not in COLUMN_DOCS]
    if undocumented:
        raise KeyError(f"CSV column(s) {undocumented} have no description; add them to report.COLUMN_DOCS")
    return {"columns": [{"name": c, "description": COLUMN_DOCS[c]} for c in columns]}


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> str:
    """The flags that decide bf16 speed: avx512_bf16, amx_bf16 (absent ones say "no ...")."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "; ".join(f if f in flags else f"no {f}" for f in ("avx512_bf16", "amx_bf16"))


def gemm_gflops(device: str = "cpu") -> float:
    """A float32 1024^3 matmul rate on this device now: how much of the machine the run had (other jobs share
    it); a quiet 2-core machine of this class does several times the rate of a busy one."""
    import torch

    a = torch.randn(1024, 1024, device=device)
    a @ a
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 10 * 2 * 1024 ** 3 / (time.perf_counter() - t) / 1e9


def source_commit() -> str:
    """The git commit of the checkout this code runs from, ``+dirty`` when tracked files differ from it (a number
    must name the code that produced it); outside a git checkout (an installed wheel, a copied working tree: the
    GPU machine's), ``$RR_COMMIT`` where the launcher set it, else ``unknown``."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))  # git finds the checkout from any folder inside it
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("RR_COMMIT") or "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def provenance() -> dict:
    """The ``commit`` and ``date`` columns: which code measured a row, and when (UTC)."""
    return {"commit": source_commit(), "date": time.strftime("%Y-%m-%d", time.gmtime())}


def environment(device: str = "cpu", batch_size: Optional[int] = None, threads: Optional[int] = None) -> dict:
    """Columns describing where, when and with what code a row was measured (``threads``: what the jobs were
    given; default this process's torch thread count, which the jobs inherit)."""
    import faiss
    import torch
    import transformers

    dev = device
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return {
        "device": dev,
        "cpu_model": cpu_model(),
        "threads": threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "faiss": faiss.__version__,
        "transformers": transformers.__version__,
        **provenance(),
        "batch_size": "" if batch_size is None else batch_size,
    }


def set_threads(n: Optional[int]) -> int:
    """Fix the thread count of torch and faiss (faiss bundles its own OpenMP). Returns the count in use."""
    import faiss
    import torch

    if n:
        torch.set_num_threads(int(n))
        faiss.omp_set_num_threads(int(n))
    return torch.get_num_threads()


def normalise_row(row: Mapping) -> dict:
    """A row with exactly CSV_COLUMNS (missing ones empty); unknown keys are an error, not silently dropped."""
    unknown = set(row) - set(CSV_COLUMNS)
    if unknown:
        raise KeyError(f"unknown benchmark column(s) {sorted(unknown)}; add them to CSV_COLUMNS")
    out = {}
    for c in CSV_COLUMNS:
        v = row.get(c, "")
        if v is None or (isinstance(v, float) and math.isnan(v)):
            v = ""
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, float):
            v = round(v, 6)
        out[c] = v
    return out


def write_csv(path: str, rows: Iterable[Mapping], columns: Sequence[str] = CSV_COLUMNS,
              write_atomic: Optional[Callable[[str, bytes], object]] = None) -> str:
    """Writes the rows atomically (default pipelines.files.write_atomic: a crashed run never leaves a half CSV)
    and its column documentation beside it (:func:`schema_path`); returns the CSV's path. ``write_atomic``:
    another writer of (path, bytes), for callers that run without Beam (benchmarks.meters.roofline)."""
    import json

    if write_atomic is None:  # Beam's FileSystems only when used: benchmarks.meters.roofline runs where Beam is absent
        from pipelines.files import write_atomic

    doc = column_schema(columns)  # before writing anything: an undocumented column is refused
    write_atomic(schema_path(path), (json.dumps({"csv": path.rsplit("/", 1)[-1], **doc}, indent=1) + "\n")
                 .encode("utf-8"))
    rows = [normalise_row(r) for r in rows] if columns is CSV_COLUMNS else list(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns))
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue().encode("utf-8"))
    return path


def write_jobs_csv(path: str, rows: Sequence[Mapping]) -> str:
    bad = [sorted(set(r) ^ set(JOB_COLUMNS)) for r in rows if set(r) != set(JOB_COLUMNS)]
    if bad:
        raise KeyError(f"job rows must have exactly {JOB_COLUMNS}; differing columns: {bad[0]}")
    rows = [{c: ("true" if v else "false") if isinstance(v, bool) else v for c, v in r.items()} for r in rows]
    return write_csv(path, rows, JOB_COLUMNS)


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))

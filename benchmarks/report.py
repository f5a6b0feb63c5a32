"""Benchmark reporting: the CSV row schema, environment capture, the terminal summary table and PNG plots.

Every row records what a result needs to be read (docs/CONVENTIONS.md#what-every-result-records): split, model,
k, collection size, number of queries, hardware and threads, library versions, the commit and date it ran, and
whether the number was measured or extrapolated.
:func:`write_csv` writes ``<name>.schema.json`` beside each CSV: every column with its description
(``COLUMN_DOCS``), so a CSV read without this code still says what its columns mean.

Plots: ``k_ablation.png`` (:func:`plot_recall_vs_k`), ``latency.png`` (:func:`plot_latency`) and
``recall_vs_size.png`` (:func:`plot_recall_vs_size_from`: R@1 of EMB and CO against the collection size over
every suite CSV of an output folder: 1k/5k from standard, 20k from distractor_20k, 100k from scale_100k).
"""
from __future__ import annotations

import csv
import io
import math
import os
import platform
import re
import time
from typing import Callable, Iterable, Mapping, Optional, Sequence

import click

from retrieval_core.evaluation.stats import Bootstrap, Interval, difference_intervals, recall_intervals, verdict

#: ``model`` of the rows that measure the paper's code path (benchmarks.latency)
PAPER_CODE_MODEL = "paper-code"

#: The recalls whose bootstrap intervals every recall row carries (retrieval_core.evaluation.stats).
METRICS = ("R@1", "R@5", "R@10", "mR")
#: Per recall row: each recall's interval, then the reranked rows' paired difference to EMB with its interval.
INTERVAL_COLUMNS = tuple(f"{m}_{e}" for m in METRICS for e in ("lo", "hi")) + ("against",) + tuple(
    f"delta_{m}{e}" for m in METRICS for e in ("", "_lo", "_hi")) + ("bootstrap",)

#: Column order of every suite CSV. Optional timings stay empty where a suite does not measure them.
CSV_COLUMNS = (
    "suite", "collection", "model", "mode", "k", "lam", "fusion", "direction",
    "R@1", "R@5", "R@10", "mR", *INTERVAL_COLUMNS, "queries", "collection_size",
    "wall_s", "encode_s", "index_s", "search_s", "rerank_s", "ce_pairs", "peak_rss_mb", "launcher_peak_rss_mb",
    "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "ann_recall@10", "speedup_vs_paper_code",
    "search_p50_ms", "bound_ms", "index_bytes", "rate_per_s", "roofline_fraction", "useful_token_fraction",
    "split", "lang", "recipe", "model_seed", "device", "cpu_model", "threads", "torch", "faiss", "transformers",
    "commit", "date", "batch_size", "quantize", "measured", "rankings", "notes",
)

#: Column order of <suite>_seeds.csv: one row per suite row key, over the runs of several model seeds.
SEED_KEY = ("suite", "collection", "model", "mode", "k", "lam", "direction")
SEED_COLUMNS = SEED_KEY + ("seeds", "fusion") + tuple(f"{m}_{stat}" for m in METRICS for stat in (
    "mean", "mean_lo", "mean_hi", "std", "min", "max")) + ("against",) + tuple(
    f"delta_{m}_mean{e}" for m in METRICS for e in ("", "_lo", "_hi")) + ("bootstrap", "queries", "recipe")


#: Column order of <suite>_jobs.csv: what every pipeline job of a suite run cost.
JOB_COLUMNS = ("job", "step", "wall_s", "peak_rss_mb", "reused", "output", "command")

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
    "queries": "number of queries evaluated in this direction",
    "collection_size": "candidate pool size in images (the t2i pool)",
    "wall_s": "seconds of the jobs behind the row (encode + index + rerank + evaluation), as measured",
    "encode_s": "seconds of the encode job(s)",
    "index_s": "seconds of the build_index job(s)",
    "search_s": "seconds of ANN search (latency rows)",
    "rerank_s": "seconds of the rerank job(s) (retrieval + CE scoring + ranking)",
    "ce_pairs": "(query, item) pairs the CE scored for the row's run",
    "peak_rss_mb": "peak resident memory of the row's jobs (the largest job's ru_maxrss, benchmarks.jobs), MiB",
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
    "recipe": "training recipe of the cached models behind the row (pipelines.demo_assets: bench or demo; empty "
              "when the model folders were given)",
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
    # <suite>_jobs.csv
    "job": "job name (unique within the suite)",
    "step": "module the job ran (python -m <step>)",
    "reused": "true: a finished output was reused (its cost as measured when it ran)",
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


def source_commit() -> str:
    """The git commit of the checkout this code runs from, ``+dirty`` when tracked files differ from it (a number
    must name the code that produced it); ``unknown`` outside a git checkout (e.g. an installed wheel)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


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
        "commit": source_commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
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
    """Writes the rows atomically (default pipelines.common.write_atomic: a crashed run never leaves a half CSV)
    and its column documentation beside it (:func:`schema_path`); returns the CSV's path. ``write_atomic``:
    another writer of (path, bytes), for callers that run without Beam (benchmarks.roofline)."""
    import json

    if write_atomic is None:  # Beam's FileSystems only when used: benchmarks.roofline runs where Beam is absent
        from pipelines.common import write_atomic

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


def _fmt(v, digits: int = 1) -> str:
    if v == "" or v is None:
        return "-"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if x != x:
        return "-"
    return f"{x:.{digits}f}"


def _fmt_seconds(v) -> str:
    if v == "" or v is None:
        return "-"
    s = float(v)
    if s < 1:
        return f"{s * 1000:.1f}ms"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f}h"
    if s < 2 * 365 * 86400:
        return f"{s / 86400:.1f}d"
    return f"{s / (365 * 86400):.1f}a"


def summary_table(rows: Sequence[Mapping], title: str = "") -> str:
    """A fixed-width text table: the recall rows, and the latency/timing rows with their own columns."""
    rows = [normalise_row(r) for r in rows]
    lines = [f"== {title} ==" if title else ""]
    skipped = [r for r in rows if str(r["notes"]).startswith("skipped")]
    recall = [r for r in rows if r["R@1"] != ""]
    timing = [r for r in rows if r["R@1"] == "" and r not in skipped]
    if recall:
        head = f"{'collection':<28} {'model':<14} {'mode':<16} {'k':>4} {'lam':>4} {'dir':<4} " \
               f"{'R@1':>6} {'R@1 95% CI':>14} {'R@5':>6} {'R@10':>6} {'mR':>6} {'queries':>8} {'size':>8} " \
               f"{'wall':>9}  R@1 minus EMB [95% CI]"
        lines += [head, "-" * len(head)]
        for r in recall:
            ci = f"[{_fmt(r['R@1_lo'])}, {_fmt(r['R@1_hi'])}]" if r["R@1_lo"] != "" else "-"
            lines.append(f"{str(r['collection'])[:28]:<28} {str(r['model'])[:14]:<14} {str(r['mode'])[:16]:<16} "
                         f"{str(r['k']):>4} {str(r['lam']):>4} {str(r['direction']):<4} {_fmt(r['R@1']):>6} "
                         f"{ci:>14} {_fmt(r['R@5']):>6} {_fmt(r['R@10']):>6} {_fmt(r['mR']):>6} "
                         f"{str(r['queries']):>8} {str(r['collection_size']):>8} {_fmt_seconds(r['wall_s']):>9}  "
                         f"{_signed(r, 'R@1')}")
    if timing:
        head = f"{'collection':<22} {'model':<12} {'mode':<20} {'k':>4} {'size':>9} {'p50':>9} {'p95':>9} " \
               f"{'p99':>9} {'wall':>9} {'ann_R@10':>8} {'speedup':>8} {'measured':>8}"
        lines += ["", head, "-" * len(head)]
        for r in timing:
            p = [_fmt_seconds(float(r[c]) / 1000) if r[c] != "" else "-"
                 for c in ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")]
            lines.append(f"{str(r['collection'])[:22]:<22} {str(r['model'])[:12]:<12} {str(r['mode'])[:20]:<20} "
                         f"{str(r['k']):>4} {str(r['collection_size']):>9} {p[0]:>9} {p[1]:>9} {p[2]:>9} "
                         f"{_fmt_seconds(r['wall_s']):>9} {_fmt(r['ann_recall@10'], 3):>8} "
                         f"{_fmt(r['speedup_vs_paper_code'], 1):>8} {str(r['measured']):>8}")
    for r in skipped:
        lines.append(f"  note: {r['collection']} {r['model']} {r['mode']}: {r['notes']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- plots
def seed_summary(rows_by_seed: Mapping[int, Sequence[Mapping]],
                 hits_by_seed: Optional[Mapping[int, Sequence]] = None, boot: Bootstrap = Bootstrap()) -> list[dict]:
    """<suite>_seeds.csv rows: per suite row key (SEED_KEY), R@1/5/10 and mR over the model seeds (mean, sample
    std, min, max). A key missing from one seed's run is an error: the seeds must have run the same plan. AUTO
    rows are keyed without their lam (each seed's dev run may choose another fusion; ``fusion`` lists them).

    ``hits_by_seed``: per seed, for each of its rows, the per-query hits behind it (``benchmarks.rows.RowHits``:
    ``hits``, ``baseline``; None for a row without): the interval of each seed mean, and of the seed mean of the
    difference to the row's baseline, with the queries resampled jointly across the seeds (they rank the same
    queries; anything else is an error)."""
    import statistics

    by_key: dict[tuple, dict[int, tuple[Mapping, object]]] = {}
    for seed, rows in rows_by_seed.items():
        hits = list(hits_by_seed[seed]) if hits_by_seed else [None] * len(rows)
        if len(hits) != len(rows):
            raise ValueError(f"seed {seed}: {len(rows)} rows but {len(hits)} hits")
        for r, h in zip(rows, hits):
            r = normalise_row(r)
            if r["R@1"] != "":
                # an AUTO row is one configuration whatever fusion each seed's dev run chose: keyed without its lam
                key = {**r, "lam": ""} if r["mode"] == "AUTO" else r
                by_key.setdefault(tuple(str(key[c]) for c in SEED_KEY), {})[seed] = (r, h)
    seeds = sorted(rows_by_seed)
    out = []
    cache: dict[tuple, tuple] = {}  # both direction rows of a group share their hits: resample them once
    for key, per_seed in by_key.items():
        if sorted(per_seed) != seeds:
            raise ValueError(f"row {dict(zip(SEED_KEY, key))} is missing for seed(s) "
                             f"{sorted(set(seeds) - set(per_seed))}")
        row = dict(zip(SEED_KEY, key))
        rows = {s: per_seed[s][0] for s in seeds}
        row["seeds"] = ",".join(map(str, seeds))
        row["fusion"] = " ".join(f"{s}:{rows[s]['fusion']}" for s in seeds if rows[s]["fusion"] != "")
        for m in METRICS:
            vals = [float(rows[s][m]) for s in seeds]
            row.update({f"{m}_mean": round(statistics.fmean(vals), 3),
                        f"{m}_std": round(statistics.stdev(vals), 3) if len(vals) > 1 else 0.0,
                        f"{m}_min": min(vals), f"{m}_max": max(vals)})
        hits = [per_seed[s][1] for s in seeds]
        if all(h is not None for h in hits):
            ids = tuple(id(h) for h in hits)
            if ids not in cache:
                cache[ids] = (recall_intervals([h.hits for h in hits], boot),
                              difference_intervals([h.hits for h in hits], [h.baseline for h in hits], boot)
                              if all(h.baseline is not None for h in hits) else None)
            means, delta = cache[ids]
            d = row["direction"]
            row.update({f"{m}_mean_{e}": v for m, iv in _by_metric(means, d).items()
                        for e, v in (("lo", round(iv.lo, 3)), ("hi", round(iv.hi, 3)))})
            if delta is not None:
                row["against"] = rows[seeds[0]]["against"]
                row.update({f"delta_{m}_mean{e}": round(v, 3) for m, iv in _by_metric(delta, d).items()
                            for e, v in (("", iv.estimate), ("_lo", iv.lo), ("_hi", iv.hi))})
            row["bootstrap"] = boot.label + ", resampled jointly across the seeds"
        row["queries"] = rows[seeds[0]]["queries"]
        row["recipe"] = rows[seeds[0]]["recipe"]
        out.append(row)
    return out


def _by_metric(intervals: Mapping[str, Interval], direction: str) -> dict[str, Interval]:
    """A direction row's intervals by CSV metric name: R@k of that direction, and mR."""
    return {m: intervals["mR" if m == "mR" else f"{direction}_{m}"] for m in METRICS}


def _signed(r: Mapping, m: str, stat: str = "") -> str:
    """``+3.1 [+1.2, +5.0] lifts`` from a row's delta columns (``delta_<m><stat>``), "-" without them."""
    cols = [f"delta_{m}{stat}{e}" for e in ("", "_lo", "_hi")]
    if not r or any(str(r.get(c, "")) in ("", "nan") for c in cols):
        return "-"
    est, lo, hi = (float(r[c]) for c in cols)
    return f"{est:+.1f} [{lo:+.1f}, {hi:+.1f}] {verdict(lo, hi)}"


def seed_summary_table(rows: Sequence[Mapping], title: str = "") -> str:
    """R@1 per direction and mR as mean ± std over the seeds [95 % interval of the mean], one line per (collection,
    model, mode, k, lam); reranked rows then say the seed-mean difference of R@1 to EMB with its interval."""
    lines = [f"== {title} ==" if title else ""]
    head = f"{'collection':<30} {'model':<6} {'mode':<12} {'k':>3} {'lam':>4} {'t2i R@1':>26} {'i2t R@1':>26} " \
           f"{'mR':>26}"
    lines += [head, "-" * len(head)]
    groups: dict[tuple, dict[str, Mapping]] = {}
    for r in rows:
        groups.setdefault((r["collection"], r["model"], r["mode"], r["k"], r["lam"]), {})[r["direction"]] = r

    def pm(r, m):
        if not r:
            return "-"
        ci = f" [{float(r[m + '_mean_lo']):.1f}, {float(r[m + '_mean_hi']):.1f}]" \
            if str(r.get(m + "_mean_lo", "")) not in ("", "nan") else ""
        return f"{float(r[m + '_mean']):.1f} ± {float(r[m + '_std']):.1f}{ci}"

    for (coll, model, mode, k, lam), d in groups.items():
        t, i = d.get("t2i"), d.get("i2t")
        chosen = (t or i).get("fusion", "")
        lines.append(f"{str(coll)[:30]:<30} {str(model)[:6]:<6} {str(mode)[:12]:<12} {str(k):>3} {str(lam):>4} "
                     f"{pm(t, 'R@1'):>26} {pm(i, 'R@1'):>26} {pm(t or i, 'mR'):>26}"
                     + (f"  (chosen per seed: {chosen})" if chosen else ""))
        if _signed(t or i, "mR", "_mean") != "-":
            lines.append(f"{'':<30}   seed-mean R@1 minus {(t or i).get('against')}: t2i {_signed(t, 'R@1', '_mean')}"
                         f"; i2t {_signed(i, 'R@1', '_mean')}")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_latency(rows: Sequence[Mapping], path: str, title: str = "Per-query latency") -> Optional[str]:
    """Log-log p50 latency vs collection size, one line per (model, mode, k); extrapolated points hollow."""
    rows = [normalise_row(r) for r in rows if r.get("latency_p50_ms", "") not in ("", None)]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    series: dict[str, list] = {}
    for r in rows:
        mode = re.sub(r"^EMB-IVF\d+,", "EMB-IVF,", str(r["mode"]))  # nlist grows with N: one line per index type
        label = f"{r['model']} {mode}" + (f" k={r['k']}" if r["k"] not in ("", None) else "")
        series.setdefault(label, []).append((int(r["collection_size"]), float(r["latency_p50_ms"]),
                                             str(r["measured"]) == "true"))
    colours = plt.get_cmap("tab20").colors  # the default 10-colour cycle repeats with 11+ series
    for i, (label, pts) in enumerate(sorted(series.items())):
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        # dashed = the paper-code baseline, so each of our methods sits visibly next to its baseline
        style = "--" if label.startswith(PAPER_CODE_MODEL) else "-"
        line, = ax.plot(xs, ys, style, color=colours[i % len(colours)], label=label)
        for x, y, measured in pts:
            ax.plot([x], [y], "o", color=line.get_color(), markerfacecolor=line.get_color() if measured else "none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("collection size (items)")
    ax.set_ylabel("p50 latency per query (ms)")
    ax.set_title(title + " (hollow = extrapolated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_roofline(rows: Sequence[Mapping], path: str, title: str = "Fraction of the GEMM roofline") -> Optional[str]:
    """One horizontal bar per roofline and training row (latency suite): roofline_fraction, labelled with the
    rate and the useful / computed tokens of its batches; rows not measured are hatched."""
    rows = [normalise_row(r) for r in rows if r.get("collection") in ("roofline", "training")
            and r.get("roofline_fraction", "") not in ("", None)]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
    ys = range(len(rows))[::-1]
    for y, r in zip(ys, rows):
        frac = float(r["roofline_fraction"])
        colour = "tab:orange" if r["collection"] == "training" else "tab:blue"
        ax.barh(y, frac, color=colour, hatch="" if str(r["measured"]) == "true" else "//", alpha=0.85)
        useful = r["useful_token_fraction"]
        ax.text(frac + 0.01, y, f"{float(r['rate_per_s']):,.1f}/s" + (f", useful {float(useful):.2f}" if useful != ""
                                                                      else ""), va="center", fontsize=7)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{r['mode']}" for r in rows], fontsize=7)
    ax.set_xlim(0, max(1.0, max(float(r["roofline_fraction"]) for r in rows) * 1.25))
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("measured rate / roofline (blue: inference, orange: training steps; hatched = not measured)")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _size_label(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else \
        f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def _by_direction(plt, rows: Sequence[Mapping], title: str):
    """A figure with one panel per direction present (shared y axis); returns (fig, {direction: axis})."""
    directions = [d for d in ("t2i", "i2t") if any(r["direction"] == d for r in rows)]
    fig, axes = plt.subplots(1, len(directions), figsize=(5.2 * len(directions) + 2.6, 4.4), sharey=True,
                             squeeze=False)
    fig.suptitle(title)
    names = {"t2i": "text -> image (t2i)", "i2t": "image -> text (i2t)"}
    out = {}
    for d, ax in zip(directions, axes[0]):
        ax.set_title(names[d], fontsize=10)
        ax.grid(True, alpha=0.3)
        out[d] = ax
    axes[0][0].set_ylabel("recall (%)")
    return fig, out


def _log_x(axes: dict, ticks, labels, xlabel: str) -> None:
    """A log x axis ticked exactly at the measured values (no minor ticks), on every panel."""
    for ax in axes.values():
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels)
        ax.minorticks_off()
        ax.set_xlabel(xlabel)


def _finish(fig, axes: Mapping, path: str) -> str:
    """One legend for the figure, right of the panels (never on the data), then save."""
    handles, labels = {}, []
    for ax in axes.values():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend([handles[lab] for lab in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_recall_vs_k(rows: Sequence[Mapping], path: str, title: str = "Recall@K vs rerank depth k") -> Optional[str]:
    """R@1/5/10 against the rerank depth k: one panel per direction, one colour per (collection,) model and
    mode, one line style per metric; the x ticks are the k values measured (10, 20, 50)."""
    rows = [normalise_row(r) for r in rows if r.get("R@1", "") not in ("", None) and r.get("k", "") not in ("", None)
            and str(r.get("k")).isdigit()]
    if not rows:
        return None
    plt = _pyplot()
    collections = sorted({str(r["collection"]) for r in rows})
    one = len(collections) == 1
    fig, axes = _by_direction(plt, rows, title + (f": {collections[0]}" if one else ""))
    series: dict[tuple, list] = {}
    for r in rows:
        key = (str(r["model"]) + ("+" + str(r["mode"]) if r["mode"] != "EMB" else " EMB")
               if one else f"{r['collection']} {r['model']}+{r['mode']}")
        for metric in ("R@1", "R@5", "R@10"):
            series.setdefault((r["direction"], key, metric), []).append((int(r["k"]), float(r[metric])))
    keys = sorted({k for _, k, _ in series})
    colours = plt.get_cmap("tab10").colors
    styles = {"R@1": "o-", "R@5": "s--", "R@10": "^:"}
    ks = sorted({p[0] for pts in series.values() for p in pts})
    order = {m: i for i, m in enumerate(styles)}  # legend: R@1, R@5, R@10 (not string order)
    for (d, key, metric), pts in sorted(series.items(), key=lambda kv: (kv[0][0], kv[0][1], order[kv[0][2]])):
        pts.sort()
        axes[d].plot([p[0] for p in pts], [p[1] for p in pts], styles[metric],
                     color=colours[keys.index(key) % len(colours)], label=f"{key} {metric}")
    _log_x(axes, ks, [str(k) for k in ks], "rerank depth k")
    return _finish(fig, axes, path)


#: Suites whose EMB / CO rows span collection sizes: 1k and 5k (standard), 20k (distractor_20k), 100k (scale_100k)
SIZE_SUITES = ("standard", "distractor_20k", "scale_100k")


def plot_recall_vs_size(rows: Sequence[Mapping], path: str, title: str = "R@1 vs collection size") -> Optional[str]:
    """R@1 of EMB and CO against the candidate pool size (log x, ticks at the measured sizes), one panel per
    direction, one line per model and mode (and k where CO rows of several k exist). Rows of one size (e.g. the
    coco 1k folds and f30k 1k) are averaged; the point says how many rows it averages when more than one."""
    rows = [normalise_row(r) for r in rows if r.get("R@1", "") not in ("", None) and r.get("mode") in ("EMB", "CO")
            and r.get("collection_size", "") not in ("", None)]
    if not rows:
        return None
    several_k = len({str(r["k"]) for r in rows if r["mode"] == "CO"}) > 1
    plt = _pyplot()
    fig, axes = _by_direction(plt, rows, title)
    points: dict[tuple, dict[int, list]] = {}
    for r in rows:
        label = f"{r['model']} {r['mode']}" + (f" k={r['k']}" if several_k and r["mode"] == "CO" else "")
        points.setdefault((r["direction"], label), {}).setdefault(int(r["collection_size"]), []).append(float(r["R@1"]))
    labels = sorted({lab for _, lab in points})
    colours = plt.get_cmap("tab10").colors
    sizes = sorted({n for per in points.values() for n in per})
    for (d, label), per in sorted(points.items()):
        xs = sorted(per)
        ys = [sum(per[x]) / len(per[x]) for x in xs]
        style = "--" if " EMB" in label else "-"
        axes[d].plot(xs, ys, "o" + style, color=colours[labels.index(label) % len(colours)], label=label)
        for x, y in zip(xs, ys):
            if len(per[x]) > 1:
                axes[d].annotate(f"mean of {len(per[x])}", (x, y), textcoords="offset points", xytext=(4, 4),
                                 fontsize=6)
    _log_x(axes, sizes, [_size_label(n) for n in sizes], "collection size (images in the pool)")
    return _finish(fig, axes, path)


def plot_recall_vs_size_from(output_dir: str, suites: Sequence[str] = SIZE_SUITES,
                             name: str = "recall_vs_size.png") -> Optional[str]:
    """The recall-vs-size plot from the suite CSVs in ``output_dir`` that exist (``<suite>.csv``); None when
    none of them holds an EMB or CO recall row. benchmarks.run calls it after a recall suite."""
    rows = []
    for suite in suites:
        csv_path = os.path.join(output_dir, f"{suite}.csv")
        if os.path.exists(csv_path):
            rows += [r for r in read_csv(csv_path) if r.get("measured") == "true"]
    return plot_recall_vs_size(rows, os.path.join(output_dir, name)) if rows else None


# -------------------------------------------------------------------------------------- memory table
#: The memory suite's columns: the pipeline steps (one process per job), then the launcher itself.
MEMORY_STEPS = ("pipelines.stage", "benchmarks.queries", "pipelines.encode", "pipelines.build_index",
                "pipelines.rerank")


def _images_of(job_name: str) -> Optional[int]:
    """Collection size of a memory-suite job, from its staged folder's name (``synthetic_memory-n<N>``)."""
    m = re.search(r"-n(\d+)(?:\b|/)", job_name)
    return int(m.group(1)) if m else None


def memory_table(job_rows: Sequence[Mapping], rows: Sequence[Mapping],
                 remeasured: Sequence[Sequence[Mapping]] = ()) -> str:
    """Markdown table of peak RSS (MiB) per step and collection size, from the memory suite's CSVs
    (``memory_jobs.csv``: one row per job; ``memory.csv``: the recall rows, for the launcher's high-water mark
    and the environment), with the growth between the two largest sizes. A step with several jobs at one size
    (image and caption indexes) shows the larger. ``remeasured``: jobs CSVs of later runs of some of the same
    jobs (after a fix); their cells replace the suite's and are marked ``*``."""
    def cells(jobs: Sequence[Mapping]) -> dict:
        out: dict[tuple[int, str], float] = {}
        for r in jobs:
            n = _images_of(str(r["job"]))
            if r["step"] in MEMORY_STEPS and n is not None and str(r["peak_rss_mb"]) not in ("", "0", "0.0"):
                out[(n, r["step"])] = max(out.get((n, r["step"]), 0.0), float(r["peak_rss_mb"]))
        return out

    table = cells(job_rows)
    marked = set()
    for later in remeasured:
        again = cells(later)
        table.update(again)
        marked |= set(again)
    for r in rows:
        if str(r.get("launcher_peak_rss_mb", "")) not in ("",) and str(r.get("collection_size", "")).isdigit():
            key = (int(r["collection_size"]), "launcher")
            table[key] = max(table.get(key, 0.0), float(r["launcher_peak_rss_mb"]))
    cols = [*MEMORY_STEPS, "launcher"]
    runner = next((c.split("--runner=", 1)[1].split()[0].rsplit(".", 1)[-1] for c in (r["command"] for r in job_rows)
                   if "--runner=" in c), "DirectRunner")
    first = rows[0] if rows else {}
    reused = sum(1 for r in job_rows if str(r.get("reused")) == "true")
    lines = [f"Peak RSS (MiB) per process, {runner}, CPU {first.get('cpu_model', '?')}, threads "
             f"{first.get('threads', '?')}, batch {first.get('batch_size', '?')}: each job's ru_maxrss from wait4 "
             f"(the largest single process of its tree, not a sum), the larger of a step's jobs at one size; "
             f"launcher = benchmarks.run's own high-water mark after evaluating that size's rows"
             + (f"; {reused} job(s) reused, their RSS as measured when they ran" if reused else "")
             + ("; * = re-measured in a later run of the same job" if marked else ""),
             "",
             "| images | " + " | ".join(c.split(".")[-1] for c in cols) + " |",
             "|---:" * (len(cols) + 1) + "|"]
    sizes = sorted({n for n, _ in table})

    def fmt(n: int, c: str) -> str:
        return f"{table[(n, c)]:,.0f}" + ("*" if (n, c) in marked else "") if (n, c) in table else "-"

    for n in sizes:
        lines.append(f"| {n:,} | " + " | ".join(fmt(n, c) for c in cols) + " |")
    if len(sizes) >= 2:
        a, b = sizes[-2], sizes[-1]
        growth = [f"{(table[(b, c)] / table[(a, c)] - 1) * 100:+.0f} %" if (a, c) in table and (b, c) in table
                  else "-" for c in cols]
        lines.append(f"| growth {_size_label(a)} -> {_size_label(b)} | " + " | ".join(growth) + " |")
    return "\n".join(lines)


def memory_table_from(output_dir: str, *remeasured_dirs: str, suite: str = "memory") -> str:
    """:func:`memory_table` of the CSVs a memory suite run wrote to ``output_dir``; the ``<suite>_jobs.csv`` of
    each of ``remeasured_dirs`` (later runs of some of its jobs) replaces their cells."""
    return memory_table(read_csv(os.path.join(output_dir, f"{suite}_jobs.csv")),
                        read_csv(os.path.join(output_dir, f"{suite}.csv")),
                        [read_csv(os.path.join(d, f"{suite}_jobs.csv")) for d in remeasured_dirs])


def recall_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of a suite CSV's recall rows, as the paper's tables read: one line per (collection, model,
    mode, k), R@1 with its 95 % interval, R@5, R@10 per direction, mR [interval], and a reranked row's R@1 minus
    EMB per direction with the verdict of its paired interval. Written for the docs, generated, not copied."""
    rows = [normalise_row(r) for r in rows if str(r.get("R@1", "")) not in ("", "nan")]
    lines = ["| collection | model | mode | t2i R@1 | t2i R@5 | t2i R@10 | i2t R@1 | i2t R@5 | i2t R@10 | mR | "
             "R@1 minus EMB: t2i | R@1 minus EMB: i2t |", "|" + "---|" * 12]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["collection"], r["model"], r["mode"], r["k"], r["fusion"]), {})[r["direction"]] = r

    def ci(r: Optional[Mapping], m: str) -> str:
        if r is None:
            return "-"
        lo, hi = r.get(f"{m}_lo", ""), r.get(f"{m}_hi", "")
        return _fmt(r[m]) + (f" [{_fmt(lo)}, {_fmt(hi)}]" if str(lo) not in ("", "nan") else "")

    for (collection, model, mode, k, fusion), by_dir in groups.items():
        t, i = by_dir.get("t2i"), by_dir.get("i2t")
        label = f"{mode} k={k}" if str(k) not in ("", "nan") and mode != "EMB" else str(mode)
        label += f" ({fusion})" if str(fusion) not in ("", "nan") else ""
        cells = [str(collection), str(model), label, ci(t, "R@1"), *(_fmt(t[m]) if t else "-" for m in ("R@5", "R@10")),
                 ci(i, "R@1"), *(_fmt(i[m]) if i else "-" for m in ("R@5", "R@10")), ci(t or i, "mR"),
                 _signed(t, "R@1"), _signed(i, "R@1")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.group()
def main():
    """Tables from benchmark CSVs already written."""


@main.command("memory-table")
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("remeasured_dirs", nargs=-1, type=click.Path(exists=True, file_okay=False))
def memory_table_cmd(output_dir, remeasured_dirs):
    """Print the memory suite's peak-RSS table (Markdown) from OUTPUT_DIR/memory.csv and memory_jobs.csv;
    the memory_jobs.csv in each REMEASURED_DIR (later runs of some of the same jobs) replaces their cells."""
    click.echo(memory_table_from(output_dir, *remeasured_dirs))


@main.command("recall-table")
@click.argument("csv_path", type=click.Path(exists=True, dir_okay=False))
def recall_table_cmd(csv_path):
    """Print the recall rows of a suite CSV (benchmarks.run's <suite>.csv) as a Markdown table with intervals."""
    click.echo(recall_table(read_csv(csv_path)))


if __name__ == "__main__":
    main()

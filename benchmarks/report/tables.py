"""Terminal and Markdown tables from benchmark rows: the suite summary, the seed summary (mean, std and the
interval of the seed mean), the memory suite's peak-RSS table and the recall table with intervals."""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Sequence

from benchmarks.report.schema import GAP_MODELS, METRICS, SEED_ENVIRONMENT, SEED_KEY, normalise_row, read_csv
from retrieval_core.evaluation.stats import (
    Bootstrap,
    Interval,
    difference_intervals,
    recall_intervals,
    seed_mean_interval,
    verdict,
    welch_interval,
)


def size_label(n: int) -> str:
    """1000 -> 1k, 2000000 -> 2M (a collection size on an axis or in a column)."""
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else \
        f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


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


def seed_summary(rows_by_seed: Mapping[int, Sequence[Mapping]],
                 hits_by_seed: Optional[Mapping[int, Sequence]] = None, boot: Bootstrap = Bootstrap()) -> list[dict]:
    """<suite>_seeds.csv rows: per suite row key (SEED_KEY), R@1/5/10 and mR over the model seeds (mean, sample
    std, min, max, and the Student t interval of the mean from the seeds' values), and for a reranked row the
    same of its difference to its baseline (``against``). A key missing from one seed's run is an error: the seeds
    must have run the same plan. AUTO rows are keyed without their lam (each seed's dev run may choose another
    fusion; ``fusion`` lists them).

    ``hits_by_seed``: per seed, for each of its rows, the per-query hits behind it (``benchmarks.suites.rows.RowHits``:
    ``hits``, ``baseline``; None for a row without): then also the bootstrap interval of each seed mean, and of
    the seed mean of the difference, with the queries resampled jointly across the seeds (they rank the same
    queries; anything else is an error). The two intervals answer two questions: the bootstrap one how sure these
    trained models are on these queries, the t one how sure the recipe is over training runs."""
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
    t_label = f"{100 * boot.level:g} % Student t interval of the mean over {len(seeds)} seeds " \
              f"({len(seeds) - 1} degrees of freedom)" if len(seeds) > 1 else ""
    out = []
    cache: dict[tuple, tuple] = {}  # both direction rows of a group share their hits: resample them once
    values: dict[tuple, dict[str, list[float]]] = {}  # each row's seed values: its statistics and the model gap
    row_of: dict[tuple, dict] = {}
    for key, per_seed in by_key.items():
        if sorted(per_seed) != seeds:
            raise ValueError(f"row {dict(zip(SEED_KEY, key))} is missing for seed(s) "
                             f"{sorted(set(seeds) - set(per_seed))}")
        row = dict(zip(SEED_KEY, key))
        rows = {s: per_seed[s][0] for s in seeds}
        row["seeds"] = ",".join(map(str, seeds))
        row["fusion"] = " ".join(f"{s}:{rows[s]['fusion']}" for s in seeds if rows[s]["fusion"] != "")
        values[key] = {m: [float(rows[s][m]) for s in seeds] for m in METRICS}
        for m, vals in values[key].items():
            row.update({f"{m}_mean": round(statistics.fmean(vals), 3),
                        f"{m}_std": round(statistics.stdev(vals), 3) if len(vals) > 1 else 0.0,
                        f"{m}_min": min(vals), f"{m}_max": max(vals), **_t_columns(f"{m}_mean", vals, boot)})
        deltas = {m: [rows[s][f"delta_{m}"] for s in seeds] for m in METRICS}
        if all(v != "" for m in METRICS for v in deltas[m]):
            row["against"] = rows[seeds[0]]["against"]
            for m in METRICS:
                vals = [float(v) for v in deltas[m]]
                row.update({f"delta_{m}_mean": round(statistics.fmean(vals), 3), f"delta_{m}_min": min(vals),
                            f"delta_{m}_max": max(vals), **_t_columns(f"delta_{m}_mean", vals, boot)})
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
        row["seed_interval"] = t_label
        for c in SEED_ENVIRONMENT:
            row[c] = ", ".join(dict.fromkeys(str(rows[s][c]) for s in seeds if str(rows[s][c]) != ""))
        out.append(row)
        row_of[key] = row
    a, b = GAP_MODELS
    model_at = SEED_KEY.index("model")
    for key, row in row_of.items():
        partner = values.get((*key[:model_at], b, *key[model_at + 1:])) if row["model"] == a else None
        if partner is not None and len(seeds) > 1:
            row["gap_against"] = b
            for m in METRICS:
                iv = welch_interval(values[key][m], partner[m], boot.level)
                row.update({f"gap_{m}_mean": round(iv.estimate, 3), f"gap_{m}_welch_lo": round(iv.lo, 3),
                            f"gap_{m}_welch_hi": round(iv.hi, 3)})
    return out


def seed_summary_from(run_dir: str, suite: str) -> tuple[list[dict], list[dict]]:
    """:func:`seed_summary` of the per-seed CSVs a several-seed run wrote (``<run_dir>/seed<N>/<suite>.csv``),
    e.g. to add columns a newer summary has to a finished run, or after one model's rows were rerun. The per-query
    hits are not in the CSVs: a row keeps the query-bootstrap columns of an existing ``<run_dir>/<suite>_seeds.csv``
    when that file has the same row of the same seeds with the same means (its differences to EMB included); a row
    without such a match has them blank. Returns the summary and the rows left blank (the caller says which)."""
    rows_by_seed = {}
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name, f"{suite}.csv")
        if re.fullmatch(r"seed\d+", name) and os.path.isfile(path):
            rows_by_seed[int(name[4:])] = read_csv(path)
    if len(rows_by_seed) < 2:
        raise ValueError(f"{run_dir}: a seed summary needs the {suite}.csv of >= 2 seed<N>/ folders, found "
                         f"{sorted(rows_by_seed) or 'none'}")
    summary = seed_summary(rows_by_seed)
    old_path = os.path.join(run_dir, f"{suite}_seeds.csv")
    old = {tuple(str(r[c]) for c in SEED_KEY): r for r in read_csv(old_path)} if os.path.isfile(old_path) else {}
    carried = [f"{m}_mean_{e}" for m in METRICS for e in ("lo", "hi")] + \
        [f"delta_{m}_mean_{e}" for m in METRICS for e in ("lo", "hi")] + ["bootstrap"]
    means = [f"{m}_mean" for m in METRICS] + [f"delta_{m}_mean" for m in METRICS]

    def same(prev: Mapping, row: Mapping) -> bool:
        return prev.get("seeds") == row["seeds"] and all(
            (str(prev.get(c, "")) == "") == (str(row.get(c, "")) == "") and
            (str(row.get(c, "")) == "" or abs(float(prev[c]) - float(row[c])) <= 1e-3) for c in means)

    blank = []
    for row in summary:
        prev = old.get(tuple(str(row[c]) for c in SEED_KEY))
        if prev is not None and same(prev, row):
            row.update({c: prev[c] for c in carried if c in prev and str(prev[c]) != ""})
        elif old:
            blank.append(row)
    return summary, blank


def _t_columns(prefix: str, values: Sequence[float], boot: Bootstrap) -> dict:
    """``<prefix>_t_lo`` / ``_t_hi``: the seed-mean t interval (none from a single seed)."""
    if len(values) < 2:
        return {}
    iv = seed_mean_interval(values, boot.level)
    return {f"{prefix}_t_lo": round(iv.lo, 3), f"{prefix}_t_hi": round(iv.hi, 3)}


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
        lines.append(f"| growth {size_label(a)} -> {size_label(b)} | " + " | ".join(growth) + " |")
    return "\n".join(lines)


def memory_table_from(output_dir: str, *remeasured_dirs: str, suite: str = "memory") -> str:
    """:func:`memory_table` of the CSVs a memory suite run wrote to ``output_dir``; the ``<suite>_jobs.csv`` of
    each of ``remeasured_dirs`` (later runs of some of its jobs) replaces their cells."""
    return memory_table(read_csv(os.path.join(output_dir, f"{suite}_jobs.csv")),
                        read_csv(os.path.join(output_dir, f"{suite}.csv")),
                        [read_csv(os.path.join(d, f"{suite}_jobs.csv")) for d in remeasured_dirs])


def _with_interval(r: Optional[Mapping], m: str) -> str:
    """``55.9 [55.2, 56.4]``: a row's metric with its interval where the row has one; "-" without the row."""
    if r is None:
        return "-"
    lo, hi = r.get(f"{m}_lo", ""), r.get(f"{m}_hi", "")
    return _fmt(r[m]) + (f" [{_fmt(lo)}, {_fmt(hi)}]" if str(lo) not in ("", "nan") else "")


def recall_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of a suite CSV's recall rows, as the paper's tables read: one line per (collection, model,
    mode, k), R@1 with its 95 % interval, R@5, R@10 per direction, mR [interval], and a reranked row's R@1 minus
    EMB per direction with the verdict of its paired interval. Written for the docs, generated, not copied."""
    rows = [normalise_row(r) for r in rows if str(r.get("R@1", "")) not in ("", "nan")]
    lines = ["| collection | model | mode | t2i R@1 | t2i R@5 | t2i R@10 | i2t R@1 | i2t R@5 | i2t R@10 | mR | "
             "R@1 minus EMB: t2i | R@1 minus EMB: i2t |", "|" + "---|" * 12]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:  # a fused row's weight (lam) tells it from the same fusion at another weight
        key = (r["collection"], r["model"], r["mode"], r["k"], r["fusion"], r.get("lam", ""))
        groups.setdefault(key, {})[r["direction"]] = r

    ci = _with_interval
    for (collection, model, mode, k, fusion, lam), by_dir in groups.items():
        t, i = by_dir.get("t2i"), by_dir.get("i2t")
        label = f"{mode} k={k}" if str(k) not in ("", "nan") and mode != "EMB" else str(mode)
        if str(fusion) not in ("", "nan"):
            label += f" ({fusion})"  # the fusion AUTO chose names its weight
        elif str(lam) not in ("", "nan"):
            label += f" lam={lam}"
        cells = [str(collection), str(model), label, ci(t, "R@1"), *(_fmt(t[m]) if t else "-" for m in ("R@5", "R@10")),
                 ci(i, "R@1"), *(_fmt(i[m]) if i else "-" for m in ("R@5", "R@10")), ci(t or i, "mR"),
                 _signed(t, "R@1"), _signed(i, "R@1")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of a <suite>_seeds.csv: per (collection, model, mode, k), R@1 per direction and mR as the
    seed mean ± std with the t interval of the mean, and a reranked row's seed-mean R@1 minus its baseline per
    direction with its t interval, the verdict of that interval and the range of the seeds' own differences."""
    lines = ["| collection | model | mode | t2i R@1 | i2t R@1 | mR | R@1 minus EMB: t2i | R@1 minus EMB: i2t |",
             "|" + "---|" * 8]
    groups: dict[tuple, dict[str, Mapping]] = {}
    for r in rows:
        groups.setdefault((r["collection"], r["model"], r["mode"], r["k"], r["lam"]), {})[r["direction"]] = r

    def mean(r: Optional[Mapping], m: str) -> str:
        if r is None:
            return "-"
        ci = f" [{_fmt(r[m + '_mean_t_lo'])}, {_fmt(r[m + '_mean_t_hi'])}]" \
            if str(r.get(m + "_mean_t_lo", "")) not in ("", "nan") else ""
        return f"{_fmt(r[m + '_mean'])} ± {_fmt(r[m + '_std'])}{ci}"

    def delta(r: Optional[Mapping]) -> str:
        if r is None or str(r.get("delta_R@1_mean_t_lo", "")) in ("", "nan"):
            return "-"
        est, lo, hi = (float(r[f"delta_R@1_mean{e}"]) for e in ("", "_t_lo", "_t_hi"))
        return f"{est:+.1f} [{lo:+.1f}, {hi:+.1f}] {verdict(lo, hi)}; seeds {float(r['delta_R@1_min']):+.1f} to " \
               f"{float(r['delta_R@1_max']):+.1f}"

    for (collection, model, mode, k, lam), by_dir in groups.items():
        t, i = by_dir.get("t2i"), by_dir.get("i2t")
        label = f"{mode} k={k}" if str(k) not in ("", "nan") and mode != "EMB" else str(mode)
        label += f" lam={lam}" if str(lam) not in ("", "nan") else ""
        fusion = str((t or i).get("fusion", ""))
        label += f" (per seed: {fusion})" if fusion not in ("", "nan") else ""
        lines.append("| " + " | ".join([str(collection), str(model), label, mean(t, "R@1"), mean(i, "R@1"),
                                        mean(t or i, "mR"), delta(t), delta(i)]) + " |")
    return "\n".join(lines)


def model_gap_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of a <suite>_seeds.csv's model comparison (its gap_* columns, GAP_MODELS): per (collection,
    mode, k), both models' seed-mean R@1 per direction and the first's minus the second's with its Welch t interval
    (each recipe trained on its own seeds, so the seeds are not paired) and what that interval says."""
    a, b = GAP_MODELS
    lines = [f"| collection | mode | t2i R@1: {a} | {b} | {a} minus {b} | i2t R@1: {a} | {b} | {a} minus {b} |",
             "|" + "---|" * 8]
    by_key = {(r["collection"], r["mode"], r["k"], r["direction"], r["model"]): r for r in rows}
    groups = dict.fromkeys((r["collection"], r["mode"], r["k"]) for r in rows
                           if r["model"] == a and str(r.get("gap_against", "")) == b)

    def cells(key: tuple, direction: str) -> list[str]:
        ra, rb = by_key.get((*key, direction, a)), by_key.get((*key, direction, b))
        if ra is None or rb is None or str(ra.get("gap_R@1_welch_lo", "")) in ("", "nan"):
            return ["-"] * 3
        est, lo, hi = (float(ra[f"gap_R@1_{c}"]) for c in ("mean", "welch_lo", "welch_hi"))
        said = f"{a} above" if lo > 0 else f"{a} below" if hi < 0 else verdict(lo, hi)
        return [_fmt(ra["R@1_mean"]), _fmt(rb["R@1_mean"]), f"{end(est)} [{end(lo)}, {end(hi)}] {said}"]

    def end(v: float) -> str:  # an end next to zero keeps its side: -0.007 is -0.01, not -0.0
        return f"{v:+.2f}" if 0 < abs(v) < 0.05 else f"{v:+.1f}"

    for collection, mode, k in groups:
        label = f"{mode} k={k}" if str(k) not in ("", "nan") and mode != "EMB" else str(mode)
        lines.append("| " + " | ".join([str(collection), label, *cells((collection, mode, k), "t2i"),
                                        *cells((collection, mode, k), "i2t")]) + " |")
    return "\n".join(lines)


def probe_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.probes.family_probe's CSV: per model and head (CE, BE, and the features' oracle),
    the share of binding and attribute siblings told apart (pairwise: gold above the sibling, chance 50 %) and of
    captions whose own image wins its family (top-1), each with its bootstrap interval."""
    cols = (("pairwise", "binding"), ("pairwise", "attribute"), ("top1", "binding"), ("top1", "all"))
    lines = ["| model (BE / CE) | head | " + " | ".join(f"{'top-1' if t == 'top1' else t} {c}" for t, c in cols)
             + " |", "|" + "---|" * (2 + len(cols))]
    cells: dict[tuple, dict[tuple, Mapping]] = {}
    for r in rows:
        cells.setdefault((r["be_model"], r["ce_model"], r["head"]), {})[(r["table"], r["change"])] = r
    for (be, ce, head), by in cells.items():
        model = be if be == ce else f"{be} / {ce}"

        def acc(key: tuple) -> str:
            r = by.get(key)
            if r is None:
                return "-"
            return f"{_fmt(r['accuracy'])} [{_fmt(r['accuracy_lo'])}, {_fmt(r['accuracy_hi'])}] (n={r['total']})"
        lines.append(f"| {model} | {head} | " + " | ".join(acc(k) for k in cols) + " |")
    return "\n".join(lines)


def fusion_rule_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.probes.fusion_rule's CSV: per (test row, family, rule), each seed's chosen
    default, its seed-mean R@1 minus EMB per direction with the t interval over seeds, and the seeds whose own paired
    interval lies below 0 (a measured loss) in either direction."""
    lines = ["| test row | model | rule | choice per seed | t2i R@1 minus EMB | i2t R@1 minus EMB | seeds with a "
             "measured loss |", "|" + "---|" * 7]
    means: dict[tuple, dict[str, Mapping]] = {}
    losses: dict[tuple, set] = {}
    for r in rows:
        key = (r["collection"], r["model"], r["rule"])
        if r["rule"] == "EMB":
            continue
        if "," in str(r["model_seed"]):
            means.setdefault(key, {})[r["direction"]] = r
        elif float(r["delta_R@1_hi"]) < 0:
            losses.setdefault(key, set()).add(r["model_seed"])
    for key, by in means.items():
        cells = ["{:+.1f} [{:+.1f}, {:+.1f}]".format(*(float(by[d][f"delta_R@1{e}"]) for e in ("", "_lo", "_hi")))
                 for d in ("t2i", "i2t")]
        seeds = str(by["t2i"]["model_seed"]).split(",")
        choice = ", ".join(f"{s}: {c}" for s, c in zip(seeds, str(by["t2i"]["fusion"]).split(";")))
        lost = ", ".join(str(s) for s in sorted(losses.get(key, ()), key=str)) or "none"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {choice} | {cells[0]} | {cells[1]} | {lost} |")
    return "\n".join(lines)


def comparison_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of paired comparisons between two rankings of the same queries (benchmarks.evaluate
    --against: e.g. one model's EMB against another model's): per (collection, model, ranking, against), R@1 per
    direction and mR with their intervals, and this ranking minus the other with the verdict of each paired
    interval."""
    rows = [normalise_row(r) for r in rows if str(r.get("R@1", "")) not in ("", "nan")]
    lines = ["| collection | model | ranking | against | t2i R@1 | i2t R@1 | mR | t2i R@1 minus it | "
             "i2t R@1 minus it | mR minus it |", "|" + "---|" * 10]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["collection"], r["model"], r["mode"], r["against"]), {})[r["direction"]] = r
    ci = _with_interval
    for (collection, model, mode, against), by_dir in groups.items():
        t, i = by_dir.get("t2i"), by_dir.get("i2t")
        cells = [str(collection), str(model), str(mode), str(against), ci(t, "R@1"), ci(i, "R@1"), ci(t or i, "mR"),
                 _signed(t, "R@1"), _signed(i, "R@1"), _signed(t or i, "mR")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def joint_screen_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.probes.joint_screen's CSV: per screened model pair and direction, the dev R@1
    of its BE and of its CE reranking the BE's top k, CO minus EMB and CO minus the screen's first pair (paired
    bootstrap intervals), the CE's pairwise binding accuracy, and from its training logs each objective's mean
    trunk gradient norm while the CE trained and the pair's training seconds (steps, minings, dev evaluations)."""
    lines = ["| screen | pair | seed | direction | EMB R@1 | CO R@1 | CO minus EMB | CO minus the first pair | "
             "CE binding % | BE trunk grad | CE trunk grad | training s |", "|" + "---|" * 12]

    def diff(r: Mapping, key: str) -> str:
        return f"{float(r[key]):+.1f} [{float(r[key + '_lo']):+.1f}, {float(r[key + '_hi']):+.1f}]"
    for r in rows:
        lines.append(f"| {r['label']} | {r['pair']} | {r['train_seed']} | {r['direction']} | {_fmt(r['emb_R@1'])} | "
                     f"{_fmt(r['co_R@1'])} | {diff(r, 'co_minus_emb')} | {diff(r, 'co_minus_first')} | "
                     f"{_fmt(r.get('binding_pairwise', ''))} | {_fmt(r.get('be_grad_trunk', ''), 2)} | "
                     f"{_fmt(r.get('ce_grad_trunk', ''), 2)} | {_fmt(r.get('train_seconds', ''))} |")
    return "\n".join(lines)

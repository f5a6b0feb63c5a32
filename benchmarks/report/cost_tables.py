"""The cost tables of the reports (Markdown): what a job, a model call or a search took, and what a reduced
precision changed; :mod:`.tables` holds the recall, seed, probe and memory tables."""
from __future__ import annotations

from typing import Mapping, Sequence

from benchmarks.report.schema import normalise_row
from benchmarks.report.tables import _fmt, _signed, size_label


def precision_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of rankings served in a reduced precision, each paired with the float32 run's same ranking
    of the same queries (benchmarks.demo --quantize): the row's R@1 [interval], its R@1 and mR minus float32's with
    the verdict of the paired interval, and how far the stored CE and BE scores of the same pairs moved."""
    rows = [normalise_row(r) for r in rows if str(r.get("R@1", "")) not in ("", "nan")]
    lines = ["| ranking | precision | direction | R@1 | against | R@1 minus it | mR minus it | CE score max / mean "
             "abs diff (pairs) | BE score max / mean abs diff (pairs) |", "|" + "---|" * 9]

    def diff(r: Mapping, s: str) -> str:
        mx, mean, n = r[f"{s}_score_max_abs_diff"], r[f"{s}_score_mean_abs_diff"], r[f"{s}_pairs_compared"]
        return "-" if str(mx) in ("", "nan") else f"{_fmt(mx, 4)} / {_fmt(mean, 4)} ({n})"

    for r in rows:
        ci = f"{_fmt(r['R@1'])} [{_fmt(r['R@1_lo'])}, {_fmt(r['R@1_hi'])}]"
        cells = [f"{r['mode']} k={r['k']}" if r["mode"] != "EMB" else "EMB", str(r["quantize"]), str(r["direction"]),
                 ci, str(r["against"]), _signed(r, "R@1"), _signed(r, "mR"), diff(r, "ce"), diff(r, "be")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def feeding_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.meters.feeding's rows: per task, precision and batch size, the rate of each way
    measured (job path, library loop, model alone; items per second) and each way's fraction of the model alone."""
    ways = ("job path", "library loop", "model alone")
    groups: dict[tuple, dict[str, Mapping]] = {}
    for r in rows:
        task, _, way = str(r["mode"]).partition(": ")
        groups.setdefault((task, r["quantize"], r["batch_size"]), {})[next(w for w in ways if way.startswith(w))] = r
    present = [w for w in ways if any(w in g for g in groups.values())]
    lines = ["| task | precision | batch | " + " | ".join(f"{w} /s" for w in present) + " | " + " | ".join(
        f"{w} / model alone" for w in present if w != "model alone") + " |", "|" + "---|" * (3 + 2 * len(present) - 1)]
    for (task, precision, batch), by_way in groups.items():
        cells = [task, str(precision), str(batch)]
        cells += [_fmt(by_way[w]["rate_per_s"]) if w in by_way else "-" for w in present]
        cells += [_fmt(by_way[w]["roofline_fraction"], 2) if w in by_way else "-" for w in present
                  if w != "model alone"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def search_batch_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.meters.search_batch's rows: per queries-per-call size, the search call's time, its
    time per query, its FLOP rate and numpy's GEMM rate at the same shapes."""
    lines = ["| queries per call | ms per call | us per query | faiss search GFLOP/s | numpy GEMM GFLOP/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['queries_per_call']} | {_fmt(r['search_ms'])} | {_fmt(r['us_per_query'])} | "
                     f"{_fmt(r['search_gflops'])} | {_fmt(r['gemm_gflops'])} |")
    return "\n".join(lines)


def query_latency_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks/meters/query_latency.py's rows: per direction and ranking, the query entry point's
    milliseconds per query (median, 90th percentile, mean)."""
    names = {"t2i": "text -> images", "i2t": "image -> captions"}
    modes = {"emb": "BE only (emb)", "co": "BE + CE (co)"}
    lines = ["| queries | searched by | ranking | k | ms per query, median | 90th percentile | mean |",
             "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {names.get(r['direction'], r['direction'])} | {r['search']} | "
                     f"{modes.get(r['mode'], r['mode'])} | {r['k']} | {_fmt(r['p50_ms'])} | {_fmt(r['p90_ms'])} | "
                     f"{_fmt(r['mean_ms'])} |")
    return "\n".join(lines)


def query_job_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks/meters/query_latency.py's job rows: the query job against the rerank job on
    one batch of text queries, CE pairs per second and the ratio to the rerank job's."""
    lines = ["| job | queries | k | CE pairs | wall s | CE pairs/s | ratio to rerank | peak RSS MiB |",
             "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| `{r['job']}` | {r['queries']} | {r['k']} | {r['ce_pairs']} | {_fmt(r['wall_s'])} | "
                     f"{_fmt(r['pairs_per_s'])} | {_fmt(r['ratio_to_rerank'])} | {_fmt(r['peak_rss_mb'])} |")
    return "\n".join(lines)


def train_source_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.meters.train_source's training rows: per recipe, precision and source, the
    median over its repetitions of the step rate (the streamed source's ratio to the table's), step time, peak
    RssAnon and VmHWM, start-up and mining seconds."""
    import statistics

    def med(group, col):
        vals = [float(r[col]) for r in group if str(r.get(col, "")) not in ("", "nan")]
        return statistics.median(vals) if vals else ""

    groups: dict = {}
    for r in rows:
        if r.get("measurement") == "train":
            groups.setdefault((r["recipe"], r["cpu_bf16"], r["source"]), []).append(r)
    lines = ["| recipe | precision | source | reps | steps/s | median step s | peak RssAnon MB | VmHWM MB | "
             "start-up s | mining s |", "|" + "---|" * 10]
    for (recipe, bf16, source), group in groups.items():
        rate = med(group, "steps_per_s")
        memory_rate = med(groups.get((recipe, bf16, "memory"), []), "steps_per_s")
        ratio = f" ({rate / memory_rate:.2f}x)" if source != "memory" and rate != "" and memory_rate else ""
        mining = med(group, "mining_s")
        lines.append(f"| {recipe} | {'bf16 autocast' if bf16 == 'True' else 'fp32'} | {source} | {len(group)} | "
                     f"{_fmt(rate, 3)}{ratio} | {_fmt(med(group, 'median_step_s'), 3)} | "
                     f"{_fmt(med(group, 'peak_rss_anon_mb'))} | {_fmt(med(group, 'vm_hwm_mb'))} | "
                     f"{_fmt(med(group, 'startup_s'))} | {_fmt(mining) if mining else 'none'} |")
    return "\n".join(lines)


def train_scale_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.meters.train_scale's rows: one training run at a collection's full size, its
    peak anonymous memory and the times of its phases."""
    lines = ["| train images | captions | region file GB | batch | regions | steps | start-up s | BE step s | "
             "CE step s | mining s | dev eval s | dev mR | peak RssAnon MB (start-up) | peak RssAnon MB (run) | "
             "VmHWM MB |", "|" + "---|" * 15]
    for r in rows:
        lines.append(f"| {r['train_images']} | {r['train_captions']} | {_fmt(r['region_file_gb'])} | "
                     f"{r['batch_size']} | {r['max_regions']} | {r['steps']} | {_fmt(r['startup_s'])} | "
                     f"{_fmt(r['median_be_step_s'])} | {_fmt(r['median_ce_step_s'])} | {_fmt(r['mining_s'])} | "
                     f"{_fmt(r['eval_s'])} | {_fmt(r['dev_mR'], 2)} | {_fmt(r['peak_rss_anon_mb_startup'])} | "
                     f"{_fmt(r['peak_rss_anon_mb'])} | {_fmt(r['vm_hwm_mb'])} |")
    return "\n".join(lines)


def jobs_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of a <suite>_jobs.csv: per job, what it ran, its wall seconds, peak RSS, the threads its
    command gave it and when it finished (a reused job: when it ran, at its own thread count); a job resumed
    after an interruption shows its wall and its earlier runs' seconds."""
    lines = ["| job | step | threads | wall s | peak RSS MiB | finished (UTC) |", "|" + "---|" * 6]
    for r in rows:
        wall = _fmt(r['wall_s'])
        if r.get("earlier_runs_s") not in (None, ""):  # a resumed job: the seconds its interrupted runs spent too
            wall += f" + {_fmt(r['earlier_runs_s'])} earlier"
        lines.append(f"| {r['job']} | {r['step']} | {r.get('job_threads') or '-'} | {wall} | "
                     f"{_fmt(r['peak_rss_mb'])} | {r.get('finished') or '-'} |")
    return "\n".join(lines)


def per_query_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of a scale suite's cost per query (the paper's Table 3 from a measured run): per model,
    ranking and direction, the milliseconds per query of its rerank job (``per_query_ms``: batched, amortised),
    the exhaustive CE's extrapolated from the CE pairs per second the CO job measured."""
    lines = ["| model | ranking | direction | queries | ms per query | CE pairs per query | how |",
             "|" + "---|" * 7]
    for r in rows:
        if str(r.get("per_query_ms", "")) in ("", "nan"):
            continue
        mode = str(r["mode"])
        ranking = "CE over the whole pool" if str(r.get("k")) == "all" else mode if mode == "EMB" else \
            f"{mode} k={r['k']}"
        pairs = r.get("ce_pairs") if mode == "CE" else "-" if mode == "EMB" else r["k"]  # CO: its depth
        lines.append(f"| {r['model']} | {ranking} | {r['direction']} | {r.get('queries') or '-'} | "
                     f"{_fmt(r['per_query_ms'], 2)} | {pairs} | "
                     f"{'measured' if str(r['measured']).lower() == 'true' else 'extrapolated'} |")
    return "\n".join(lines)


def latency_table(rows: Sequence[Mapping]) -> str:
    """Markdown tables of the latency suite's per-query rows (the paper's Table 3): the median milliseconds of one
    text query per method and collection size, extrapolated ones in italics; then the query entry point's rows
    (``QueryEngine.search_text``) with their 95th and 99th percentiles."""
    per_query = [r for r in rows if str(r.get("collection", "")).startswith("per_query")]
    sizes = sorted({int(float(r["collection_size"])) for r in per_query})
    cells: dict[tuple, dict[int, str]] = {}
    for r in per_query:
        if str(r.get("latency_p50_ms", "")) in ("", "nan"):
            continue  # a method not run at this size (HNSW beyond --hnsw-max-n)
        ms = _fmt(r["latency_p50_ms"], 2 if float(r["latency_p50_ms"]) < 1 else 1)  # the bandwidth bound at 1k
        method = (str(r["model"]), str(r["mode"]), "" if str(r["mode"]).startswith("EMB") else str(r["k"]))
        cells.setdefault(method, {})[int(float(r["collection_size"]))] = \
            ms if str(r["measured"]).lower() == "true" else f"*{ms}*"
    lines = ["| model | method | k | " + " | ".join(f"{size_label(n)} items" for n in sizes) + " |",
             "|" + "---|" * (3 + len(sizes))]
    for (model, mode, k), by_size in cells.items():
        lines.append(f"| {model} | {mode} | {k or '-'} | " + " | ".join(by_size.get(n, "-") for n in sizes) + " |")
    entry = [r for r in rows if str(r.get("collection", "")) == "entry_point"]
    if entry:
        lines += ["", "| entry point | indexed images | k | ms median | 95th percentile | 99th percentile |",
                  "|" + "---|" * 6]
        lines += [f"| {r['mode'].replace('entry point ', '')} | {int(float(r['collection_size']))} | {r['k']} | "
                  f"{_fmt(r['latency_p50_ms'])} | {_fmt(r['latency_p95_ms'])} | {_fmt(r['latency_p99_ms'])} |"
                  for r in entry]
    return "\n".join(lines)


def gpu_run_table(rows: Sequence[Mapping]) -> str:
    """A Markdown table of benchmarks.meters.gpu_pipelines' rows.csv: per part, its steps' wall seconds and every rate
    (items per second) with its fraction (of the model alone, or of one collating thread), recall rows left to
    the recall tables."""
    lines = ["| part | size | row | precision | batch | wall s | per second | fraction |", "|" + "---|" * 8]
    for r in rows:
        if r.get("direction") in ("t2i", "i2t"):
            continue
        size = r["recipe"] if r["recipe"] in ("demo", "base") else "-"
        name = r["mode"] if r.get("collection") in ("steps", "") else f"{r['collection']}: {r['mode']}"
        rate = r.get("rate_per_s")
        digits = 2 if rate not in (None, "") and float(rate) < 10 else 1  # training steps per second
        lines.append(f"| {_gpu_part(r)} | {size} | {name} | {r.get('quantize') or '-'} | {r.get('batch_size') or '-'} "
                     f"| {_fmt(r.get('wall_s'))} | {_fmt(rate, digits)} | {_fmt(r.get('roofline_fraction'), 2)} |")
    return "\n".join(lines)


def _gpu_part(row: Mapping) -> str:
    """The part a gpu_pipelines row came from: its recipe, or for the feeding part's rows (whose recipe is the
    model size) the part their collection belongs to."""
    if row["recipe"] not in ("demo", "base"):
        return row["recipe"]
    return "feeding"

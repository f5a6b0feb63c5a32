"""Benchmark reporting: the CSV row schema, environment capture, the terminal summary table and PNG plots.

Every row records what NOTES.md section 2 asks for: split, model, k, collection size, number of queries,
hardware and threads, plus library versions and whether the number was measured or extrapolated.
"""
from __future__ import annotations

import csv
import io
import math
import platform
import re
from typing import Iterable, Mapping, Optional, Sequence

#: ``model`` of the rows that measure the paper's code path (benchmarks.latency)
PAPER_CODE_MODEL = "paper-code"

#: Column order of every suite CSV. Optional timings stay empty where a suite does not measure them.
CSV_COLUMNS = (
    "suite", "collection", "model", "mode", "k", "lam", "direction",
    "R@1", "R@5", "R@10", "mR", "queries", "collection_size",
    "wall_s", "encode_s", "index_s", "search_s", "rerank_s", "ce_pairs", "peak_rss_mb",
    "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "ann_recall@10", "speedup_vs_paper_code",
    "split", "device", "cpu_model", "threads", "torch", "faiss", "transformers", "batch_size",
    "measured", "rankings", "notes",
)


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


def environment(device: str = "cpu", batch_size: Optional[int] = None, threads: Optional[int] = None) -> dict:
    """Columns describing where and with what a row was measured (``threads``: what the jobs were given;
    default this process's torch thread count, which the jobs inherit)."""
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


def write_csv(path: str, rows: Iterable[Mapping], columns: Sequence[str] = CSV_COLUMNS) -> str:
    """Writes the rows atomically (pipelines.common.write_atomic: a crashed run never leaves a half CSV) and
    returns the path."""
    from pipelines.common import write_atomic

    rows = [normalise_row(r) for r in rows] if columns is CSV_COLUMNS else list(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns))
    w.writeheader()
    w.writerows(rows)
    write_atomic(path, buf.getvalue().encode("utf-8"))
    return path


#: Columns of <suite>_jobs.csv: what every pipeline job of a suite run cost.
JOB_COLUMNS = ("job", "step", "wall_s", "peak_rss_mb", "reused", "output", "command")


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
               f"{'R@1':>6} {'R@5':>6} {'R@10':>6} {'mR':>6} {'queries':>8} {'size':>8} {'wall':>9}"
        lines += [head, "-" * len(head)]
        for r in recall:
            lines.append(f"{str(r['collection'])[:28]:<28} {str(r['model'])[:14]:<14} {str(r['mode'])[:16]:<16} "
                         f"{str(r['k']):>4} {str(r['lam']):>4} {str(r['direction']):<4} {_fmt(r['R@1']):>6} "
                         f"{_fmt(r['R@5']):>6} {_fmt(r['R@10']):>6} {_fmt(r['mR']):>6} {str(r['queries']):>8} "
                         f"{str(r['collection_size']):>8} {_fmt_seconds(r['wall_s']):>9}")
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


def plot_recall_vs_k(rows: Sequence[Mapping], path: str, title: str = "Recall@K vs k") -> Optional[str]:
    """R@1/5/10 against the rerank depth k, one line per (collection, model, direction, metric)."""
    rows = [normalise_row(r) for r in rows if r.get("R@1", "") not in ("", None) and r.get("k", "") not in ("", None)]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    series: dict[str, list] = {}
    for r in rows:
        for metric in ("R@1", "R@5", "R@10"):
            label = f"{r['collection']} {r['model']}+{r['mode']} {r['direction']} {metric}"
            series.setdefault(label, []).append((int(r["k"]), float(r[metric])))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax.set_xlabel("rerank depth k")
    ax.set_ylabel("recall (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

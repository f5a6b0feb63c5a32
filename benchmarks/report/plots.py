"""PNG plots of benchmark rows: ``k_ablation.png`` (:func:`plot_recall_vs_k`), ``latency.png``
(:func:`plot_latency`), ``roofline.png`` and ``recall_vs_size.png`` (:func:`plot_recall_vs_size_from`: R@1 of EMB
and CO against the collection size over every suite CSV of an output folder: 1k/5k from standard, 20k from
distractor_20k, 100k from scale_100k)."""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Sequence

from benchmarks.report.schema import PAPER_CODE_MODEL, normalise_row, read_csv
from benchmarks.report.tables import size_label


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
    _log_x(axes, sizes, [size_label(n) for n in sizes], "collection size (images in the pool)")
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

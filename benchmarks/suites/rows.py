"""A planned suite row's CSV rows (one per direction) from its finished rerank run(s): recall re-derived from the
stored scores (evaluation.runs) with its bootstrap intervals and, for a reranked row, its paired difference to
the EMB ranking of the same family and pool (evaluation.stats), the jobs' wall times and peak RSS, and notes
saying how it was measured."""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

import numpy as np

from benchmarks.suites.planner import DIRECTIONS, Row
from retrieval_core.evaluation.runs import LoadedRun, choose_fusion, read_run_manifest
from retrieval_core.evaluation.stats import (
    Bootstrap,
    Hits,
    difference_intervals,
    fold_hits,
    interval_columns,
    recall_intervals,
)

#: What a row's difference is paired with (the ``against`` column).
BASELINE = "EMB"


class RowHits(NamedTuple):
    """The per-query hits behind a row group (per fold), and those of its paired EMB baseline (None: no
    difference); the seed summary (benchmarks.report.seed_summary) resamples them across seeds."""
    hits: Hits
    baseline: Optional[Hits]


def ce_pairs_scored(run_dir: str) -> int:
    """The CE pairs a finished rerank run scored (its manifest's count)."""
    return int(read_run_manifest(run_dir)[1].get("ce_pairs_scored", 0))


def evaluate_row(row: Row, results: dict, env: dict, boot: Bootstrap = Bootstrap(),
                 memo: Optional[dict] = None) -> tuple[list[dict], Optional[RowHits]]:
    """CSV rows (one per direction) of a planned Row, from its finished rerank run(s), and the hits behind them
    (None for a skipped row). ``memo``: EMB hits by run, shared by the rows of one plan (a run's EMB ranking is
    derived once for its EMB row and every difference to it)."""
    common = {"suite": row.suite, "collection": row.collection, "model": row.model, "mode": row.mode,
              "k": "" if row.k is None else row.k, "lam": "" if row.lam is None else row.lam,
              "collection_size": row.pool_images, "split": row.split or "", "lang": row.lang or "",
              **env}
    if row.skip:
        return [{**common, "direction": "both", "measured": False, "notes": row.skip}], None
    if row.extrapolated:
        return extrapolated_rows(row, results, common), None
    memo = {} if memo is None else memo
    t0 = time.perf_counter()
    eval_mode, eval_lam, chosen = row.eval_mode, row.eval_lam, ""
    if eval_mode == "auto":  # what pipelines.rerank --mode auto --tune-on would run, from the stored scores
        choice = choose_fusion(row.tune_on, row.tune_staged, row.eval_k, lang=row.lang)
        eval_mode, eval_lam = choice["mode"], choice["lam"]
        dev, got = choice["dev"]["emb"], choice["dev"][choice["label"]]
        chosen = f"chosen on {choice['dev_split']}: {choice['label']} (dev R@1 " + \
            ", ".join(f"{d} {dev[f'{d}_R@1']:.2f} -> {got[f'{d}_R@1']:.2f}" for d in DIRECTIONS if f"{d}_R@1" in got) \
            + " from emb)"
        common["lam"] = eval_lam if eval_lam is not None else ""
        common["fusion"] = choice["label"]
    metrics, hits, base = [], [], []
    for i, run in enumerate(row.runs):
        loaded = LoadedRun.read(run, row.staged, row.eval_collection, row.split, lang=row.lang)
        metrics.append(loaded.evaluate(row.eval_k, eval_mode, eval_lam))
        hits.append(loaded.hits(row.eval_k, eval_mode, eval_lam))
        if eval_mode == "emb" and row.eval_k is None and eval_lam is None:
            memo[_memo_key(row, run)] = hits[-1]
        if row.emb_runs:
            base.append(_emb_hits(row, row.emb_runs[i], loaded if row.emb_runs[i] == run else None, memo))
    row_hits = RowHits(fold_hits(hits), fold_hits(base) if base else None)
    intervals = recall_intervals(row_hits.hits, boot)
    delta = difference_intervals(row_hits.hits, row_hits.baseline, boot) if base else None
    eval_s = (time.perf_counter() - t0) / len(row.runs)
    timing: dict[str, float] = {}
    for col, name in row.timing:
        # the stamps keep wall_s to the millisecond: summing those keeps a reused row equal to its first run
        timing[col] = timing.get(col, 0.0) + round(results[name].wall_s, 3)
    if row.per_fold:
        timing = {c: v / len(row.runs) if c != "encode_s" else v for c, v in timing.items()}
    peak = max((results[name].peak_rss_mb for _, name in row.timing), default=0.0)
    per_query, resumed_note = "", []
    reranks = [name for col, name in row.timing if col == "rerank_s"]
    if len(reranks) == 1 and not row.per_fold:  # one job ranked every query of the row (an AUTO row has two)
        ranked = sum(m.get(f"{d}_queries", 0) for m in metrics for d in DIRECTIONS)
        # a rerank job resumed from finished shards timed only the rest: its wall over every query would flatter it
        reused_shards = shards_reused(results[reranks[0]].job.output)
        if reused_shards:
            resumed_note = [f"per_query_ms left out: {reused_shards} of the rerank job's ranking shards reused "
                            f"from an interrupted run (its wall timed only the rest)"]
        elif ranked:
            per_query = round(results[reranks[0]].wall_s * 1000.0 / ranked, 3)
    pairs = ""
    if row.mode != "EMB":
        pairs = int(round(np.mean([ce_pairs_scored(r) for r in row.runs])))
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    per_dir = {d: {f"R@{k}": mean([m[f"{d}_R@{k}"] for m in metrics]) for k in (1, 5, 10)}
               for d in DIRECTIONS}
    m_r = mean([v for d in per_dir.values() for v in d.values()])
    derived = f"k={metrics[0].get('k')} mode={metrics[0].get('mode')}" + \
        (f" lam={metrics[0].get('lam')}" if eval_mode in ("add", "norm_add") else "")
    reused = sorted({name for _, name in row.timing if results[name].reused})
    notes = list(row.notes) + ([chosen] if chosen else []) + \
        ([f"{len(reused)} job(s) reused from an earlier run (their cost as measured then)"] if reused else []) + \
        resumed_note + [_interval_note(row)]
    out = []
    for d in DIRECTIONS:
        stats = interval_columns(intervals, d)
        if delta is not None:
            stats.update(against=BASELINE, **interval_columns(delta, d, prefix="delta_"))
        out.append({**common, "direction": d, **per_dir[d], "mR": m_r, **stats, "bootstrap": boot.label,
                    "queries": int(round(mean([m[f"{d}_queries"] for m in metrics]))),
                    **{c: round(v, 3) for c, v in timing.items()},
                    "wall_s": round(sum(timing.values()) + eval_s, 3), "ce_pairs": pairs,
                    "per_query_ms": per_query, "peak_rss_mb": round(peak, 1), "measured": True,
                    "rankings": ";".join(row.runs) + f" ({derived})", "notes": "; ".join(notes)})
    return out, row_hits


def shards_reused(run_folder: str) -> int:
    """The ranking shards a rerank run kept from an interrupted run: its wall timed only the rest."""
    return int(read_run_manifest(run_folder)[1].get("shards_reused", 0))


def extrapolated_rows(row: Row, results: dict, common: dict) -> list[dict]:
    """An exhaustive CE row that was not run (one per direction): its pool (images for t2i, captions for i2t)
    times the CE's seconds per pair, measured as the CO job's wall minus the search-only job's over the CE pairs
    the CO job scored. No recall; measured=false."""
    co, search = (results[name] for name in row.extrapolated)
    pairs, reused = int(read_run_manifest(row.runs[0])[1].get("ce_pairs_scored", 0)), shards_reused(row.runs[0])
    ce_s = co.wall_s - search.wall_s
    # a CO job resumed from finished shards timed only the rest: its rate would mix two runs' work
    if pairs <= 0 or ce_s <= 0 or reused:
        why = f"not extrapolated: the CO job scored {pairs} CE pairs in {ce_s:.1f} s more than the search job" + \
            (f", {reused} of its ranking shards reused from an interrupted run" if reused else "")
        return [{**common, "direction": "both", "measured": False, "notes": "; ".join(row.notes + (why,))}]
    rate = pairs / ce_s
    pools = {"t2i": row.pool_images, "i2t": row.pool_captions}
    return [{**common, "direction": d, "ce_pairs": pools[d], "rate_per_s": round(rate, 1),
             "per_query_ms": round(pools[d] * 1000.0 / rate, 1), "measured": False,
             "notes": "; ".join(row.notes + (f"{pairs:,} CE pairs in {ce_s:.1f} s", "ce_pairs: per query"))}
            for d in DIRECTIONS]


def _memo_key(row: Row, run: str) -> tuple:
    return run, row.staged, row.eval_collection, row.split, row.lang


def _emb_hits(row: Row, run: str, loaded: Optional[LoadedRun], memo: dict) -> Hits:
    """The EMB hits of ``run`` (a row's paired baseline): from the memo, else derived (and kept)."""
    key = _memo_key(row, run)
    if key not in memo:
        loaded = loaded or LoadedRun.read(run, row.staged, row.eval_collection, row.split, lang=row.lang)
        memo[key] = loaded.hits(None, "emb", None)
    return memo[key]


def _interval_note(row: Row) -> str:
    """How the row's intervals were computed (the CSV's bootstrap column says with how many resamples)."""
    how = "each fold's queries resampled on their own, the statistic the mean over the folds" if row.per_fold \
        else "queries resampled, each direction on its own"
    if row.emb_runs:
        how += f"; delta_* = this row minus {BASELINE} of the same model and pool, paired over the same queries"
    return f"intervals: {how}"

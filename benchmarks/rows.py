"""A planned suite row's CSV rows (one per direction) from its finished rerank run(s): recall re-derived from the
stored scores (retrieval_core.runs), the jobs' wall times and peak RSS, and notes saying how it was measured."""
from __future__ import annotations

import time

import numpy as np

from benchmarks.suites import DIRECTIONS, Row
from retrieval_core.runs import choose_fusion, evaluate_run, read_run_manifest


def ce_pairs_scored(run_dir: str) -> int:
    """The CE pairs a finished rerank run scored (its manifest's count)."""
    return int(read_run_manifest(run_dir)[1].get("ce_pairs_scored", 0))


def evaluate_row(row: Row, results: dict, env: dict) -> list[dict]:
    """CSV rows (one per direction) of a planned Row, from its finished rerank run(s)."""
    common = {"suite": row.suite, "collection": row.collection, "model": row.model, "mode": row.mode, "k": row.k,
              "lam": row.lam, "collection_size": row.pool_images, "split": row.split or "", **env}
    if row.skip:
        return [{**common, "direction": "both", "measured": False, "notes": row.skip}]
    t0 = time.perf_counter()
    eval_mode, eval_lam, chosen = row.eval_mode, row.eval_lam, ""
    if eval_mode == "auto":  # what pipelines.rerank --mode auto --tune-on would run, from the stored scores
        choice = choose_fusion(row.tune_on, row.tune_staged, row.eval_k)
        eval_mode, eval_lam = choice["mode"], choice["lam"]
        dev_mr = choice["dev_mR"]
        chosen = f"chosen on {choice['dev_split']}: {choice['label']} (dev mR {dev_mr[choice['label']]:.2f}, " \
                 f"co {dev_mr['co']:.2f})"
        common["lam"] = eval_lam if eval_lam is not None else ""
        common["fusion"] = choice["label"]
    metrics = [evaluate_run(run, row.staged, k=row.eval_k, mode=eval_mode, lam=eval_lam,
                            collection=row.eval_collection, split=row.split) for run in row.runs]
    eval_s = (time.perf_counter() - t0) / len(row.runs)
    timing: dict[str, float] = {}
    for col, name in row.timing:
        # the stamps keep wall_s to the millisecond: summing those keeps a reused row equal to its first run
        timing[col] = timing.get(col, 0.0) + round(results[name].wall_s, 3)
    if row.per_fold:
        timing = {c: v / len(row.runs) if c != "encode_s" else v for c, v in timing.items()}
    peak = max((results[name].peak_rss_mb for _, name in row.timing), default=0.0)
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
        ([f"{len(reused)} job(s) reused from an earlier run (their cost as measured then)"] if reused else [])
    out = []
    for d in DIRECTIONS:
        out.append({**common, "direction": d, **per_dir[d], "mR": m_r,
                    "queries": int(round(mean([m[f"{d}_queries"] for m in metrics]))),
                    **{c: round(v, 3) for c, v in timing.items()},
                    "wall_s": round(sum(timing.values()) + eval_s, 3), "ce_pairs": pairs,
                    "peak_rss_mb": round(peak, 1), "measured": True,
                    "rankings": ";".join(row.runs) + f" ({derived})", "notes": "; ".join(notes)})
    return out

"""Recall@K of a pipelines.rerank run against the staged gold labels: CSV rows + a CLIP_benchmark-style JSON.

    python -m benchmarks.evaluate --rankings RUN --staged STAGED --output RESULTS --model join-minilm
    python -m benchmarks.evaluate --rankings RUN ... --mode add --lam 0.7 --k 10   # re-derived, not re-scored
    python -m benchmarks.evaluate --rankings RUN ... --mode co --against-mode emb  # CO minus EMB, paired

``--rankings`` takes a pipelines.rerank run (its run dir or its rankings/ dir): the shards listed in its
rankings_manifest.json are read, checksum-verified. The run, --staged and --output may be URLs (gs://): they
are read and written through Beam FileSystems (pipelines.files). Score once, evaluate many: the run stores,
per query, its BE top-n with be_rank, be_score and (CE modes) the CE scores of its BE top-k, so ``--k`` (any
k' <= the run's k), ``--mode`` (emb, co, add, norm_add; ce for an exhaustive run) and ``--lam`` re-rank the
stored rows (``retrieval_core.search.rerank.derive_rankings``) exactly as a run with those settings would have; each
defaults to the run's own (rankings_manifest.json). CE modes on an EMB run, k' > k, and runs written before be_rank
existed are refused in one line.

Every gold query of the run's collection/split must be ranked and every ranked query must be in the gold: a
missing query is an error, never a silent miss. A run restricted with ``--queries`` is evaluated on its
ranked queries (the gold is restricted to them). Ranked items outside the gold set (distractors) are fine.
A run of one direction reports that direction only (mR = mean of its recalls).

Outputs in ``--output``:
  metrics.csv   one row per (collection, split, model, mode label, k, direction, tags); rerunning the same
                configuration replaces its rows, other rows are kept. Recalls in percent.
  <collection>_<model>_<label>_k<k>.json   a CLIP_benchmark result file ("dataset", "model", "pretrained",
                "task": "zeroshot_retrieval", "metrics": {"image_retrieval_recall@1": ...}, "language"), which
                ``clip_benchmark build`` accepts, plus our own keys (split, mode, k, lam, ...); like
                CLIP_benchmark, recalls there are fractions in [0, 1], rounded to 4 decimals.
                image_retrieval = text->image, text_retrieval = image->text.

Confidence intervals (retrieval_core.evaluation.stats, docs/STATISTICS.md): every recall and mR gets its 95 % bootstrap
percentile interval (``--bootstrap`` resamples of the queries, ``--seed``): CSV columns ``R@<k>_lo``,
``R@<k>_hi``, ``mR_lo``, ``mR_hi``; the JSON's ``intervals`` (percent). ``--against-mode MODE`` (and/or
``--against RUN``, a run ranking the same queries) adds the paired difference of this ranking minus that one:
CSV ``against``, ``delta_R@<k>`` with ``_lo`` / ``_hi``, ``delta_mR`` likewise; the JSON's ``difference``, with
the verdict of each interval ("lifts", "lowers", "no significant difference"). ``--against RUN`` also compares the
two runs' stored scores of the same (query, item) pairs (max and mean absolute difference of the BE and the CE
scores: CSV ``be_score_max_abs_diff`` ..., the JSON's ``score_differences``): one model served in two precisions
(``--quantize``) ranks the same queries, and this says how far its scores moved besides its recall.
"""
from __future__ import annotations

import io
import logging
import re
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import click
import pandas as pd

from benchmarks.report.schema import ENVIRONMENT_COLUMNS, environment
from pipelines.files import BEAM_FILES, exists, join, makedirs, read_bytes, write_atomic, write_json_atomic
from retrieval_core.cli import CheckedPlan, cli_errors, k_option, lam_option, option, plan_command, plan_from_cli
from retrieval_core.errors import UsageFault
from retrieval_core.evaluation.metrics import DEFAULT_KS, DIRECTIONS
from retrieval_core.evaluation.runs import COMPARED_SCORES, LoadedRun, RunError, mode_label, score_differences
from retrieval_core.evaluation.stats import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    MIN_RESAMPLES,
    Bootstrap,
    Interval,
    difference_intervals,
    interval_columns,
)
from retrieval_core.search.rerank import RUN_MODES

log = logging.getLogger(__name__)

METRICS_CSV = "metrics.csv"
KEY_COLUMNS = ("collection", "split", "lang", "model", "mode", "k", "direction")


def csv_rows(result: dict, *, collection: str, split: str, model: str, mode: str, k: int,
             tags: Mapping[str, str], ks: Sequence[int] = DEFAULT_KS) -> list[dict]:
    """One row per evaluated direction (a direction with 0 queries was not evaluated); with the result's
    ``intervals`` and ``delta`` (:func:`evaluate_ranking`), their columns."""
    rows = []
    for direction in DIRECTIONS:
        if not result.get(f"{direction}_queries"):
            continue
        row = {"collection": collection, "split": split, "lang": result.get("lang") or "", "model": model,
               "mode": mode, "k": int(k), "direction": direction}
        row.update({f"R@{kk}": round(result[f"{direction}_R@{kk}"], 4) for kk in ks})
        row.update({"mR": round(result["mR"], 4), "queries": result[f"{direction}_queries"],
                    "collection_size": result["collection_size"]})
        if "intervals" in result:
            row.update(interval_columns(result["intervals"], direction, ks=ks))
        if "delta" in result:
            row["against"] = result["against"]["label"]
            row.update(interval_columns(result["delta"], direction, prefix="delta_", ks=ks))
        if "bootstrap" in result:
            row["bootstrap"] = result["bootstrap"].label
        if direction in result.get("score_diff", {}):
            row.update(score_diff_columns(result["score_diff"][direction]))
        row.update(tags)
        rows.append(row)
    return rows


def score_diff_columns(diff: Mapping[str, float]) -> dict:
    """One direction of ``score_differences`` as the CSV's columns (report.SCORE_DIFF_COLUMNS)."""
    out = {}
    for score in COMPARED_SCORES:
        short = score.split("_")[0]  # be_score -> be
        out.update({f"{score}_{stat}_diff": diff[f"{score}_{stat}"] for stat in ("max_abs", "mean_abs")})
        out[f"{short}_pairs_compared"] = diff[f"{score}_pairs"]
    return out


def evaluate_ranking(rankings: str, staged: str, *, k: Optional[int] = None, mode: Optional[str] = None,
                     lam: Optional[float] = None, collection: Optional[str] = None, split: Optional[str] = None,
                     bootstrap: Bootstrap = Bootstrap(), against: Optional[str] = None,
                     against_mode: Optional[str] = None, against_k: Optional[int] = None,
                     against_lam: Optional[float] = None, files=BEAM_FILES, lang: Optional[str] = None) -> dict:
    """A run's recalls for (k, mode, lam) with their ``intervals`` and ``bootstrap``; given ``against`` (another
    run ranking the same queries) and/or ``against_mode``, also ``delta``: the paired intervals of this ranking
    minus that one (its k defaults to ``k`` where given, its mode and lam to its run's own), and ``against``
    (what it was: run, mode, k, lam, label); given another run, also ``score_diff``: how far the two runs' stored
    BE and CE scores of the same pairs lie apart (``runs.score_differences``; e.g. bf16 against float32 serving of
    one model). ``lang``: evaluated on that language's captions only."""
    run = LoadedRun.read(rankings, staged, collection, split, files, lang)
    result = run.evaluate(k, mode, lam, bootstrap)
    result["bootstrap"] = bootstrap
    if against is None and against_mode is None:
        return result
    other = run if against is None else LoadedRun.read(against, staged, result["collection"], result["split"], files,
                                                       lang)
    b_mode = (against_mode or other.manifest["mode"]).lower()
    if against_k is None and b_mode != "ce":  # the depth asked for this ranking (exhaustive CE has none)
        against_k = k
    b_k, b_mode, b_lam = other.resolve(against_k, b_mode, against_lam)
    label = mode_label(b_mode, b_lam) + ("" if other is run else f" of {other.run_dir}")
    result["against"] = {"run": other.run_dir, "mode": b_mode, "k": b_k, "lam": b_lam, "label": label}
    result["delta"] = difference_intervals(run.hits(result["k"], result["mode"], result["lam"]),
                                           other.hits(b_k, b_mode, b_lam), bootstrap)
    if other is not run:
        result["score_diff"] = score_differences(run.table, other.table, run.directions)
    return result


def merge_csv(existing: Optional[pd.DataFrame], new_rows: list[dict], tag_keys: Sequence[str]) -> pd.DataFrame:
    """Existing rows with the same configuration (key columns + tags) are replaced by the new ones."""
    new = pd.DataFrame(new_rows)
    if existing is None or existing.empty:
        return new
    key = list(KEY_COLUMNS) + [t for t in tag_keys if t in existing.columns]
    for col in key:
        if col not in existing.columns:
            existing[col] = pd.NA
    # a missing value (a CSV's empty cell reads back as NaN) keys as the empty string
    as_key = lambda df: df[key].map(lambda v: "" if pd.isna(v) else str(v)).agg("\x1f".join, axis=1)  # noqa: E731
    kept = existing[~as_key(existing).isin(set(as_key(new)))]
    return pd.concat([kept, new], ignore_index=True)


#: The keys of a CLIP_benchmark result file (clip_benchmark.cli writes them, its ``build`` step reads them: it
#: flattens ``metrics`` into the row and names the model ``model + " " + pretrained``).
CLIP_BENCHMARK_KEYS = ("dataset", "model", "pretrained", "task", "metrics", "language")
#: Decimals of the JSON's numbers: CLIP_benchmark's published results carry 4 (acc1 0.9074); more is float noise.
CLIP_BENCHMARK_DECIMALS = 4


def clip_benchmark_json(result: dict, *, collection: str, model: str, pretrained: str, ks: Sequence[int],
                        extra: dict, language: str = "en") -> dict:
    """A CLIP_benchmark ``zeroshot_retrieval`` result (recall as a fraction, rounded) plus ``extra`` keys of ours."""
    clash = sorted(set(extra) & set(CLIP_BENCHMARK_KEYS))
    if clash:
        raise ValueError(f"extra keys {clash} would overwrite CLIP_benchmark's own")
    r = lambda x: round(float(x) / 100.0, CLIP_BENCHMARK_DECIMALS)  # noqa: E731 -- percent -> fraction
    metrics = {}
    for kk in ks:
        if result.get("t2i_queries"):
            metrics[f"image_retrieval_recall@{kk}"] = r(result[f"t2i_R@{kk}"])
        if result.get("i2t_queries"):
            metrics[f"text_retrieval_recall@{kk}"] = r(result[f"i2t_R@{kk}"])
    metrics["mean_recall"] = r(result["mR"])
    return {"dataset": collection, "model": model, "pretrained": pretrained, "task": "zeroshot_retrieval",
            "metrics": metrics, "language": language, **extra}


def interval_json(result: dict) -> dict:
    """Our JSON keys for the intervals (percent, like ``mR``): ``bootstrap`` (how), ``intervals`` ({"t2i_R@1":
    [lo, hi], ..., "mR": [lo, hi]}) and, with a difference, ``difference`` ({"against": ..., "t2i_R@1":
    {"estimate", "lo", "hi", "verdict"}, ...})."""
    d = CLIP_BENCHMARK_DECIMALS
    out = {"bootstrap": result["bootstrap"].as_dict(),
           "intervals": {key: [round(iv.lo, d), round(iv.hi, d)] for key, iv in result["intervals"].items()}}
    if "delta" in result:
        diff: dict = {"against": {key: v for key, v in result["against"].items() if key != "label"}}
        for key, iv in result["delta"].items():
            diff[key] = {"estimate": round(iv.estimate, d), "lo": round(iv.lo, d), "hi": round(iv.hi, d),
                         "verdict": iv.verdict}
        out["difference"] = diff
    if "score_diff" in result:
        out["score_differences"] = {d: {key: None if v != v else v for key, v in diff.items()}  # NaN: no pair
                                    for d, diff in result["score_diff"].items()}
    return out


def summary_line(result: dict) -> str:
    """Recalls and mR with their intervals, then each difference with its verdict (the CLI's output)."""
    done = [d for d in DIRECTIONS if result[f"{d}_queries"]]
    iv: Mapping[str, Interval] = result.get("intervals", {})
    show = lambda key: f"{key}={iv[key].format()}" if key in iv else f"{key}={result[key]:.2f}"  # noqa: E731
    line = " ".join(show(f"{d}_R@{kk}") for d in done for kk in DEFAULT_KS) + " " + show("mR")
    if "delta" in result:
        line += f"\nminus {result['against']['label']} (paired): " + "; ".join(
            f"{key} {result['delta'][key].format(signed=True)} -> {result['delta'][key].verdict}"
            for key in [f"{d}_R@{kk}" for d in done for kk in DEFAULT_KS] + ["mR"])
    for d, diff in result.get("score_diff", {}).items():
        line += f"\n{d} scores against it, same (query, item) pairs: " + "; ".join(
            f"{score} max |diff| {diff[f'{score}_max_abs']:.3g}, mean {diff[f'{score}_mean_abs']:.3g} "
            f"({diff[f'{score}_pairs']} pairs)" for score in COMPARED_SCORES)
    return line


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", str(name)) or "_"


def parse_tags(tags: Sequence[str]) -> dict[str, str]:
    out = {}
    for t in tags:
        if "=" not in t:
            raise UsageFault(f"--tag must be key=value, got {t!r}")
        key, value = t.split("=", 1)
        if key in KEY_COLUMNS or not key:
            raise UsageFault(f"--tag key {key!r} is empty or clashes with a metrics column")
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------------ CLI
@dataclass(frozen=True)
class EvaluatePlan(CheckedPlan):
    """One evaluation, every option a typed field (checked when built); what the demo launches (``to_argv``)."""
    rankings: str = option(help="A pipelines.rerank run: its directory or its rankings/ dir.")
    staged: str = option(help="Staged dataset directory (gold labels).")
    output: str = option(help="Directory for metrics.csv and the JSON.")
    collection: Optional[str] = option(None, help="Staged collection of the queries (default: the run's, else the "
                                                  "only one).")
    split: Optional[str] = option(None, help="Split of the queries (default: the run's).")
    model: str = option("model", help="Model name recorded with the result.")
    mode: Optional[str] = option(None, type=click.Choice(RUN_MODES, case_sensitive=False),
                                 help="Rank the stored scores with this mode (default: the run's own).")
    k: Optional[int] = k_option(None, help="Rerank depth, at most the run's k (default: the run's own).")
    lam: Optional[float] = lam_option(None,
                                      help="add / norm_add weight of the BE score (default: the run's, else 0.5).")
    label: Optional[str] = option(None, help="The mode column of metrics.csv and the JSON name (default: the mode, "
                                             "e.g. co or add_0.5).")
    collection_size: Optional[int] = option(None, type=int,
                                            help="Candidate pool size to record (default: the run's t2i pool).")
    tag: tuple[str, ...] = option((), multiple=True, help="Extra key=value column (repeatable).")
    pretrained: Optional[str] = option(None, help="The JSON's CLIP_benchmark 'pretrained' key (default: <label>_k<k>, "
                                                  "the retrieval configuration; CLIP_benchmark's build names a row "
                                                  "'<model> <pretrained>').")
    lang: Optional[str] = option(None, help="Evaluate on the captions of this language only (the lang column: t2i "
                                            "queries and i2t gold); also the JSON's CLIP_benchmark 'language' key "
                                            "[all captions; the key says en].")
    against: Optional[str] = option(None, help="A pipelines.rerank run of the same queries: also the paired "
                                               "difference to its ranking [the --rankings run, with --against-mode].")
    against_mode: Optional[str] = option(None, type=click.Choice(RUN_MODES, case_sensitive=False),
                                         help="Also the paired difference to this mode's ranking (e.g. emb) "
                                              "[--against's own].")
    against_k: Optional[int] = option(None, type=click.IntRange(min=1),
                                      help="Rerank depth of the --against ranking [--k, else its run's own].")
    against_lam: Optional[float] = lam_option(None, help="add / norm_add weight of the --against ranking [its "
                                                         "run's, else 0.5].")
    against_label: Optional[str] = option(None, help="The against column's name for the --against ranking (e.g. "
                                                     "'model B, EMB') [its mode and run folder].")
    bootstrap: int = option(DEFAULT_RESAMPLES, type=click.IntRange(min=MIN_RESAMPLES),
                            help="Bootstrap resamples of the queries behind each 95 % interval.")
    seed: int = option(DEFAULT_SEED, type=click.IntRange(min=0), help="Seed of the bootstrap resampling.")


@plan_command(EvaluatePlan)
def main(**values):
    """Recall@1/5/10 and mR of a rankings run with 95 % bootstrap intervals, for its own or a re-derived mode, k
    and lam; with --against-mode / --against, the paired difference to another ranking of the same queries."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.time()
    with cli_errors(RunError):  # a missing staged / rankings dir, bad rankings or unpaired queries: one line, exit 1
        p = plan_from_cli(EvaluatePlan, values)
        tag_map = parse_tags(p.tag)  # a malformed --tag: a usage error, exit 2
        result = evaluate_ranking(p.rankings, p.staged, k=p.k, mode=p.mode, lam=p.lam, collection=p.collection,
                                  split=p.split, bootstrap=Bootstrap(p.bootstrap, p.seed), against=p.against,
                                  against_mode=p.against_mode, against_k=p.against_k, against_lam=p.against_lam,
                                  lang=p.lang)
    if p.collection_size is not None:
        result["collection_size"] = int(p.collection_size)
    collection, split, k, output, model, lang = (result["collection"], result["split"], result["k"], p.output,
                                                 p.model, p.lang)
    label = p.label or mode_label(result["mode"], result["lam"])

    makedirs(output)
    csv_path = join(output, METRICS_CSV)
    existing = pd.read_csv(io.BytesIO(read_bytes(csv_path))) if exists(csv_path) else None
    if p.against_label and "against" in result:
        result["against"]["label"] = p.against_label
    # where, when and by which code: a published comparison names them (benchmarks.report docs --publish)
    env = {c: v for c, v in environment().items() if c in ENVIRONMENT_COLUMNS}
    rows = [{**r, **env} for r in csv_rows(result, collection=collection, split=split, model=model, mode=label,
                                           k=k, tags=tag_map)]
    merged = merge_csv(existing, rows, list(tag_map))
    buf = io.StringIO()
    merged.to_csv(buf, index=False)
    write_atomic(csv_path, buf.getvalue().encode("utf-8"))
    suffix = f"_{_safe(lang)}" if lang else ""
    json_path = join(output, f"{_safe(collection)}_{_safe(model)}_{_safe(label)}_k{k}{suffix}.json")
    extra = {"split": split, "mode": result["mode"], "label": label, "k": k, "lam": result["lam"],
             "mR": round(result["mR"], CLIP_BENCHMARK_DECIMALS),
             "queries": {"t2i": result["t2i_queries"], "i2t": result["i2t_queries"]},
             "collection_size": result["collection_size"], "tags": tag_map, **interval_json(result)}
    write_json_atomic(json_path, clip_benchmark_json(result, collection=collection, model=model,
                                                     pretrained=p.pretrained or f"{label}_k{k}", ks=DEFAULT_KS,
                                                     extra=extra, language=lang or "en"))
    click.echo(f"{collection}/{split} {model} {label} k={k} ({result['bootstrap'].label}): {summary_line(result)}")
    click.echo(f"(t2i {result['t2i_queries']} / i2t {result['i2t_queries']} queries, {result['collection_size']} "
               f"images) in {time.time() - t0:.1f} s")
    click.echo(f"wrote {csv_path} and {json_path}")


if __name__ == "__main__":
    main()

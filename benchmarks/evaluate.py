"""Recall@K of a pipelines.rerank run against the staged gold labels: CSV rows + a CLIP_benchmark-style JSON.

    python -m benchmarks.evaluate --rankings RUN --staged STAGED --output RESULTS --model join-minilm
    python -m benchmarks.evaluate --rankings RUN ... --mode add --lam 0.7 --k 10   # re-derived, not re-scored

``--rankings`` takes a pipelines.rerank run (its run dir or its rankings/ dir): the shards listed in its
rankings_manifest.json are read, checksum-verified. The run, --staged and --output may be URLs (gs://): they
are read and written through Beam FileSystems (pipelines.common). Score once, evaluate many: the run stores,
per query, its BE top-n with be_rank, be_score and (CE modes) the CE scores of its BE top-k, so ``--k`` (any
k' <= the run's k), ``--mode`` (emb, co, add, norm_add; ce for an exhaustive run) and ``--lam`` re-rank the
stored rows (``retrieval_core.rerank.derive_rankings``) exactly as a run with those settings would have; each
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
"""
from __future__ import annotations

import io
import logging
import re
import time
from typing import Mapping, Optional, Sequence

import click
import pandas as pd

from pipelines.common import BEAM_FILES, exists, join, makedirs, read_bytes, write_atomic, write_json_atomic
from retrieval_core.cli import CONTEXT_SETTINGS, cli_errors
from retrieval_core.metrics import DEFAULT_KS, DIRECTIONS
from retrieval_core.rerank import RUN_MODES
from retrieval_core.runs import RunError, evaluate_run, mode_label

log = logging.getLogger(__name__)

METRICS_CSV = "metrics.csv"
KEY_COLUMNS = ("collection", "split", "model", "mode", "k", "direction")


def csv_rows(result: dict, *, collection: str, split: str, model: str, mode: str, k: int,
             tags: Mapping[str, str], ks: Sequence[int] = DEFAULT_KS) -> list[dict]:
    """One row per evaluated direction (a direction with 0 queries was not evaluated)."""
    rows = []
    for direction in DIRECTIONS:
        if not result.get(f"{direction}_queries"):
            continue
        row = {"collection": collection, "split": split, "model": model, "mode": mode, "k": int(k),
               "direction": direction}
        row.update({f"R@{kk}": round(result[f"{direction}_R@{kk}"], 4) for kk in ks})
        row.update({"mR": round(result["mR"], 4), "queries": result[f"{direction}_queries"],
                    "collection_size": result["collection_size"]})
        row.update(tags)
        rows.append(row)
    return rows


def merge_csv(existing: Optional[pd.DataFrame], new_rows: list[dict], tag_keys: Sequence[str]) -> pd.DataFrame:
    """Existing rows with the same configuration (key columns + tags) are replaced by the new ones."""
    new = pd.DataFrame(new_rows)
    if existing is None or existing.empty:
        return new
    key = list(KEY_COLUMNS) + [t for t in tag_keys if t in existing.columns]
    for col in key:
        if col not in existing.columns:
            existing[col] = pd.NA
    as_key = lambda df: df[key].astype(str).agg("\x1f".join, axis=1)  # noqa: E731
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


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", str(name)) or "_"


def parse_tags(tags: Sequence[str]) -> dict[str, str]:
    out = {}
    for t in tags:
        if "=" not in t:
            raise click.BadParameter(f"--tag must be key=value, got {t!r}")
        key, value = t.split("=", 1)
        if key in KEY_COLUMNS or not key:
            raise click.BadParameter(f"--tag key {key!r} is empty or clashes with a metrics column")
        out[key] = value
    return out


# ------------------------------------------------------------------------------------------------ CLI
@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--rankings", required=True, help="A pipelines.rerank run: its directory or its rankings/ dir.")
@click.option("--staged", required=True, help="Staged dataset directory (gold labels).")
@click.option("--output", required=True, help="Directory for metrics.csv and the JSON.")
@click.option("--collection", default=None, help="Staged collection of the queries (default: the run's, else the "
                                                 "only one).")
@click.option("--split", default=None, help="Split of the queries (default: the run's).")
@click.option("--model", default="model", show_default=True, help="Model name recorded with the result.")
@click.option("--mode", type=click.Choice(RUN_MODES, case_sensitive=False), default=None,
              help="Rank the stored scores with this mode (default: the run's own).")
@click.option("--k", "k", type=click.IntRange(min=1), default=None,
              help="Rerank depth, at most the run's k (default: the run's own).")
@click.option("--lam", type=float, default=None,
              help="add / norm_add weight of the BE score (default: the run's, else 0.5).")
@click.option("--label", default=None,
              help="The mode column of metrics.csv and the JSON name (default: the mode, e.g. co or add_0.5).")
@click.option("--collection-size", type=int, default=None,
              help="Candidate pool size to record (default: the run's t2i pool).")
@click.option("--tag", "tags", multiple=True, help="Extra key=value column (repeatable).")
@click.option("--pretrained", default=None,
              help="The JSON's CLIP_benchmark 'pretrained' key (default: <label>_k<k>, the retrieval configuration; "
                   "CLIP_benchmark's build names a row '<model> <pretrained>').")
@click.option("--language", default="en", show_default=True, help="The JSON's CLIP_benchmark 'language' key.")
def main(rankings, staged, output, collection, split, model, mode, k, lam, label, collection_size, tags, pretrained,
         language):
    """Recall@1/5/10 and mR of a rankings run, for its own or a re-derived mode, k and lam."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.time()
    tag_map = parse_tags(tags)
    with cli_errors(RunError):  # a missing staged / rankings dir or bad rankings: one line, exit 1
        result = evaluate_run(rankings, staged, k=k, mode=mode, lam=lam, collection=collection, split=split,
                              files=BEAM_FILES)
    if collection_size is not None:
        result["collection_size"] = int(collection_size)
    collection, split, k = result["collection"], result["split"], result["k"]
    label = label or mode_label(result["mode"], result["lam"])

    makedirs(output)
    csv_path = join(output, METRICS_CSV)
    existing = pd.read_csv(io.BytesIO(read_bytes(csv_path))) if exists(csv_path) else None
    merged = merge_csv(existing, csv_rows(result, collection=collection, split=split, model=model, mode=label,
                                          k=k, tags=tag_map), list(tag_map))
    buf = io.StringIO()
    merged.to_csv(buf, index=False)
    write_atomic(csv_path, buf.getvalue().encode("utf-8"))
    json_path = join(output, f"{_safe(collection)}_{_safe(model)}_{_safe(label)}_k{k}.json")
    extra = {"split": split, "mode": result["mode"], "label": label, "k": k, "lam": result["lam"],
             "mR": round(result["mR"], CLIP_BENCHMARK_DECIMALS),
             "queries": {"t2i": result["t2i_queries"], "i2t": result["i2t_queries"]},
             "collection_size": result["collection_size"], "tags": tag_map}
    write_json_atomic(json_path, clip_benchmark_json(result, collection=collection, model=model,
                                                     pretrained=pretrained or f"{label}_k{k}", ks=DEFAULT_KS,
                                                     extra=extra, language=language))
    click.echo(f"{collection}/{split} {model} {label} k={k}: "
               + " ".join(f"{key}={result[key]:.2f}" for key in result
                          if "_R@" in key and result[f"{key.split('_')[0]}_queries"])
               + f" mR={result['mR']:.2f} (t2i {result['t2i_queries']} / i2t {result['i2t_queries']} queries, "
               f"{result['collection_size']} images) in {time.time() - t0:.1f} s")
    click.echo(f"wrote {csv_path} and {json_path}")


if __name__ == "__main__":
    main()

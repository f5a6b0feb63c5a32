"""Recall@K of a rankings run against the staged gold labels: CSV rows + a CLIP_benchmark-style JSON.

    python -m benchmarks.evaluate --rankings RUN/rankings --staged STAGED --output RESULTS \\
        --collection coco --split test --model join-minilm --mode ce --k 20 --tag hardware=cpu

``--rankings`` takes a pipelines.rerank run (its run dir or its rankings/ dir: the shards listed in its
rankings_manifest.json are read, checksum-verified) or any directory / Parquet file of rankings (every
.parquet under it). Both directions are required (schema.RANKING_SCHEMA rows with direction t2i and i2t).
Every gold query must be ranked and every ranked query must be in the gold: a missing query is an error,
never a silent miss. Ranked items outside the gold set (distractors) are fine.

Outputs in ``--output``:
  metrics.csv   one row per (collection, split, model, mode, k, direction, tags); rerunning the same
                configuration replaces its rows, other rows are kept. Recalls in percent.
  <collection>_<model>_<mode>_k<k>.json   CLIP_benchmark layout ("dataset", "model", "task":
                "zeroshot_retrieval", "metrics": {"image_retrieval_recall@1": ...}); like CLIP_benchmark,
                recalls there are fractions in [0, 1]. image_retrieval = text->image, text_retrieval =
                image->text.
"""
from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from typing import Collection, Mapping, Optional, Sequence, Union

import click
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval_core import schema
from retrieval_core.metrics import DEFAULT_KS, bidirectional_recall
from retrieval_core.rerank import RANKINGS_MANIFEST, RANKINGS_SUBDIR

log = logging.getLogger(__name__)

METRICS_CSV = "metrics.csv"
KEY_COLUMNS = ("collection", "split", "model", "mode", "k", "direction")


class EvaluationError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------ core
def ranked_lists(df: pd.DataFrame, direction: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """(query ids, best-first item id arrays) of one direction, ordered by query id."""
    sub = df[df["direction"] == direction]
    q = sub["query_id"].to_numpy(np.int64)
    r = sub["rank"].to_numpy(np.int64)
    items = sub["item_id"].to_numpy(np.int64)
    order = np.lexsort((r, q))
    q, r, items = q[order], r[order], items[order]
    if len(q) and np.any((q[1:] == q[:-1]) & (r[1:] == r[:-1])):
        bad = int(q[1:][(q[1:] == q[:-1]) & (r[1:] == r[:-1])][0])
        raise EvaluationError(f"{direction} query {bad} has the same rank twice")
    queries, starts = np.unique(q, return_index=True)
    return queries, np.split(items, starts[1:]) if len(q) else []


def _check_queries(direction: str, ranked: np.ndarray, gold_keys: Collection[int]) -> None:
    ranked_set = set(ranked.tolist())
    gold_set = set(int(g) for g in gold_keys)
    extra = sorted(ranked_set - gold_set)
    missing = sorted(gold_set - ranked_set)
    what = "caption" if direction == schema.DIRECTION_T2I else "image"
    if extra:
        raise EvaluationError(f"{direction}: ranked {what} query {extra[0]} is not in the gold "
                              f"({len(extra)} such queries; first: {extra[:5]})")
    if missing:
        raise EvaluationError(f"{direction}: gold {what} query {missing[0]} is missing from the rankings "
                              f"({len(missing)} missing; first: {missing[:5]})")


def evaluate_rankings(rankings: Union[pd.DataFrame, pa.Table], caption_to_image: Mapping[int, int],
                      image_to_captions: Mapping[int, Collection[int]], ks: Sequence[int] = DEFAULT_KS) -> dict:
    """Recall of both directions of a rankings table (schema.RANKING_SCHEMA columns).

    Returns bidirectional_recall's dict (t2i_R@k, i2t_R@k, mR, t2i_queries, i2t_queries) plus
    ``collection_size`` (gold images) and ``ranked_depth`` (shortest ranked list). Gold mappings are only
    read.
    """
    df = rankings.to_pandas() if isinstance(rankings, pa.Table) else rankings
    missing_cols = [c for c in ("direction", "query_id", "rank", "item_id") if c not in df.columns]
    if missing_cols:
        raise EvaluationError(f"rankings lack column(s) {missing_cols}")
    unknown = set(df["direction"].unique()) - {schema.DIRECTION_T2I, schema.DIRECTION_I2T}
    if unknown:
        raise EvaluationError(f"rankings have unknown direction(s) {sorted(unknown)}")
    t2i_q, t2i_lists = ranked_lists(df, schema.DIRECTION_T2I)
    i2t_q, i2t_lists = ranked_lists(df, schema.DIRECTION_I2T)
    _check_queries(schema.DIRECTION_T2I, t2i_q, caption_to_image.keys())
    _check_queries(schema.DIRECTION_I2T, i2t_q, image_to_captions.keys())
    result = bidirectional_recall(t2i_lists, t2i_q, i2t_lists, i2t_q, caption_to_image, image_to_captions, ks)
    result["collection_size"] = len(image_to_captions)
    result["ranked_depth"] = int(min(len(x) for x in (*t2i_lists, *i2t_lists)))
    if result["ranked_depth"] < max(ks):
        log.warning("some ranked lists hold only %d items (< %d): R@%d counts them as misses beyond",
                    result["ranked_depth"], max(ks), max(ks))
    return result


def infer_k(df: pd.DataFrame) -> int:
    """The rerank depth of a run: the most CE-scored rows of any query (0 = BE only)."""
    if "ce_score" not in df.columns or df["ce_score"].notna().sum() == 0:
        return 0
    scored = df[df["ce_score"].notna()]
    return int(scored.groupby(["direction", "query_id"]).size().max())


# ---------------------------------------------------------------------------------------------- files
def _rankings_manifest(src: str) -> Optional[str]:
    """The rankings manifest of a pipelines.rerank run given as its run dir or its rankings/ dir, else None."""
    src = os.path.normpath(src)
    for run_dir in (src, os.path.dirname(src) if os.path.basename(src) == RANKINGS_SUBDIR else None):
        if run_dir is not None and os.path.isfile(os.path.join(run_dir, RANKINGS_MANIFEST)):
            return os.path.join(run_dir, RANKINGS_MANIFEST)
    return None


def listed_shards(manifest_path: str) -> list[str]:
    """Paths of the shards a rankings manifest lists, each checked against its recorded sha256."""
    from pipelines.common import sha256_file  # Beam's FileSystems: imported only when a run is read

    with open(manifest_path, "rb") as f:
        manifest = json.loads(f.read().decode("utf-8"))
    rank_dir = os.path.join(os.path.dirname(manifest_path), RANKINGS_SUBDIR)
    files = []
    for shard in manifest.get("shards", []):
        path = os.path.join(rank_dir, shard["name"])
        if not os.path.isfile(path):
            raise EvaluationError(f"{path} is listed in {manifest_path} but missing; rerun pipelines.rerank")
        digest = sha256_file(path)
        if shard.get("sha256") and digest != shard["sha256"]:
            raise EvaluationError(f"{path} changed since {manifest_path} was written (sha256 {digest[:12]}... != "
                                  f"{shard['sha256'][:12]}...); rerun pipelines.rerank")
        files.append(path)
    return files


def read_rankings(sources: Sequence[str]) -> pa.Table:
    """The ranking Parquet files of the given directories / files. A pipelines.rerank run (its run dir or its
    rankings/ dir) contributes the shards its rankings_manifest.json lists: a rerun with another shard count
    may leave an earlier run's shards next to them, which would rank the same queries twice. Other directories
    contribute every .parquet file under them."""
    files: list[str] = []
    for src in sources:
        manifest = _rankings_manifest(src) if os.path.isdir(src) else None
        if manifest is not None:
            files += listed_shards(manifest)
        elif os.path.isdir(src):
            for root, _, names in sorted(os.walk(src)):
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".parquet")]
        elif os.path.isfile(src):
            files.append(src)
        else:
            raise EvaluationError(f"rankings path not found: {src}")
    if not files:
        raise EvaluationError(f"no .parquet rankings under {list(sources)}")
    tables = []
    for f in files:
        t = pq.read_table(f)
        missing = [c for c in schema.RANKING_COLUMNS if c not in t.column_names]
        if missing:
            raise EvaluationError(f"{f}: not a rankings file (missing {missing})")
        tables.append(t.select(list(schema.RANKING_COLUMNS)).cast(schema.RANKING_SCHEMA))
    return pa.concat_tables(tables)


def csv_rows(result: dict, *, collection: str, split: str, model: str, mode: str, k: int,
             tags: Mapping[str, str], ks: Sequence[int] = DEFAULT_KS) -> list[dict]:
    rows = []
    for direction in (schema.DIRECTION_T2I, schema.DIRECTION_I2T):
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


def clip_benchmark_json(result: dict, *, collection: str, model: str, ks: Sequence[int], extra: dict) -> dict:
    metrics = {}
    for kk in ks:
        metrics[f"image_retrieval_recall@{kk}"] = result[f"t2i_R@{kk}"] / 100.0
        metrics[f"text_retrieval_recall@{kk}"] = result[f"i2t_R@{kk}"] / 100.0
    metrics["mean_recall"] = result["mR"] / 100.0
    return {"dataset": collection, "model": model, "task": "zeroshot_retrieval", "metrics": metrics, **extra}


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
@click.command(context_settings=dict(help_option_names=["-h", "--help"]))
@click.option("--rankings", "rankings", multiple=True, required=True,
              help="Rankings directory or Parquet file (repeatable).")
@click.option("--staged", required=True, help="Staged dataset directory (gold labels).")
@click.option("--output", required=True, help="Directory for metrics.csv and the JSON.")
@click.option("--collection", default=None, help="Staged collection of the queries (default: the only one).")
@click.option("--split", default="test", show_default=True)
@click.option("--model", default="model", show_default=True, help="Model name recorded with the result.")
@click.option("--mode", default="ce", show_default=True, help="Fusion mode of the run (emb, ce, add, norm_add...).")
@click.option("--k", "k", type=int, default=None, help="Rerank depth of the run (default: inferred).")
@click.option("--collection-size", type=int, default=None,
              help="Candidate pool size to record (default: gold images; set it for distractor pools).")
@click.option("--tag", "tags", multiple=True, help="Extra key=value column (repeatable).")
def main(rankings, staged, output, collection, split, model, mode, k, collection_size, tags):
    """Recall@1/5/10 in both directions and mR of a rankings run."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pipelines.common import cli_errors, makedirs, open_file, write_atomic, write_json_atomic
    from retrieval_core.store import StagedDataset

    t0 = time.time()
    tag_map = parse_tags(tags)
    with cli_errors(EvaluationError):  # a missing staged / rankings dir or bad rankings: one line, exit 1
        dataset = StagedDataset(staged, opener=open_file)
        if collection is None:
            if len(dataset.collections) != 1:
                raise click.UsageError(f"--collection is required: {staged} holds {dataset.collections}")
            collection = dataset.collections[0]
        caption_to_image, image_to_captions = dataset.gold(collection, split)
        if not caption_to_image:
            raise click.ClickException(f"no {split!r} captions for collection {collection!r} in {staged}")
        df = read_rankings(rankings).to_pandas()
        result = evaluate_rankings(df, caption_to_image, image_to_captions)
    if collection_size is not None:
        result["collection_size"] = int(collection_size)
    k = infer_k(df) if k is None else k

    makedirs(output)
    csv_path = os.path.join(output, METRICS_CSV)
    existing = pd.read_csv(csv_path) if os.path.exists(csv_path) else None
    merged = merge_csv(existing, csv_rows(result, collection=collection, split=split, model=model, mode=mode,
                                          k=k, tags=tag_map), list(tag_map))
    buf = io.StringIO()
    merged.to_csv(buf, index=False)
    write_atomic(csv_path, buf.getvalue().encode("utf-8"))
    json_path = os.path.join(output, f"{_safe(collection)}_{_safe(model)}_{_safe(mode)}_k{k}.json")
    extra = {"split": split, "mode": mode, "k": k, "mR": result["mR"],
             "queries": {"t2i": result["t2i_queries"], "i2t": result["i2t_queries"]},
             "collection_size": result["collection_size"], "tags": tag_map}
    write_json_atomic(json_path, clip_benchmark_json(result, collection=collection, model=model,
                                                     ks=DEFAULT_KS, extra=extra))
    click.echo(f"{collection}/{split} {model} mode={mode} k={k}: "
               + " ".join(f"{key}={result[key]:.2f}" for key in result if "_R@" in key)
               + f" mR={result['mR']:.2f} (t2i {result['t2i_queries']} / i2t {result['i2t_queries']} queries, "
               f"{result['collection_size']} images) in {time.time() - t0:.1f} s")
    click.echo(f"wrote {csv_path} and {json_path}")


if __name__ == "__main__":
    main()

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
from typing import Collection, Mapping, Optional, Sequence, Union

import click
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retrieval_core import schema
from retrieval_core.metrics import DEFAULT_KS, direction_recall
from retrieval_core.paths import join_path, split_path
from retrieval_core.rerank import (FUSION_MODES, RANKINGS_MANIFEST, RANKINGS_SUBDIR, RUN_MODES, RUN_TO_RANK_MODE,
                                   derive_rankings)

log = logging.getLogger(__name__)

METRICS_CSV = "metrics.csv"
KEY_COLUMNS = ("collection", "split", "model", "mode", "k", "direction")
DIRECTIONS = (schema.DIRECTION_T2I, schema.DIRECTION_I2T)
DEFAULT_LAM = 0.5  # pipelines.rerank's default --lam: a fusion derived from a CO run uses it


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
                      image_to_captions: Mapping[int, Collection[int]], ks: Sequence[int] = DEFAULT_KS,
                      directions: Sequence[str] = DIRECTIONS) -> dict:
    """Recall of the given directions of a rankings table (schema.RANKING_SCHEMA columns).

    Returns ``<d>_R@<k>`` and ``<d>_queries`` for both directions (NaN and 0 for a direction not evaluated),
    ``mR`` (mean of the evaluated recalls), ``collection_size`` (gold images) and ``ranked_depth`` (shortest
    ranked list). Every gold query of an evaluated direction must be ranked and vice versa. Gold mappings are
    only read.
    """
    df = rankings.to_pandas() if isinstance(rankings, pa.Table) else rankings
    missing_cols = [c for c in ("direction", "query_id", "rank", "item_id") if c not in df.columns]
    if missing_cols:
        raise EvaluationError(f"rankings lack column(s) {missing_cols}")
    unknown = set(df["direction"].unique()) - set(DIRECTIONS)
    if unknown:
        raise EvaluationError(f"rankings have unknown direction(s) {sorted(unknown)}")
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise EvaluationError(f"directions must be a non-empty subset of {DIRECTIONS}, got {directions}")
    extra = set(df["direction"].unique()) - set(directions)
    if extra:
        raise EvaluationError(f"rankings hold direction(s) {sorted(extra)} that are not evaluated")
    result: dict = {}
    depth = []
    for d in DIRECTIONS:
        if d not in directions:
            result.update({f"{d}_R@{kk}": float("nan") for kk in ks})
            result[f"{d}_queries"] = 0
            continue
        queries, lists = ranked_lists(df, d)
        _check_queries(d, queries, (caption_to_image if d == schema.DIRECTION_T2I else image_to_captions).keys())
        result.update(direction_recall(d, lists, queries, caption_to_image, image_to_captions, ks))
        depth += [len(x) for x in lists]
    result["mR"] = float(np.mean([result[f"{d}_R@{kk}"] for d in directions for kk in ks]))
    result["collection_size"] = len(image_to_captions)
    result["ranked_depth"] = int(min(depth))
    if result["ranked_depth"] < max(ks):
        log.warning("some ranked lists hold only %d items (< %d): R@%d counts them as misses beyond",
                    result["ranked_depth"], max(ks), max(ks))
    return result


# ------------------------------------------------------------------------------------------------ runs
def run_manifest_path(src: str) -> str:
    """rankings_manifest.json of a pipelines.rerank run given as its run dir or its rankings/ dir."""
    from pipelines.common import BEAM_FILES  # Beam's FileSystems: imported only when a run is read

    if not (BEAM_FILES.isdir(src) or BEAM_FILES.exists(src)):
        raise EvaluationError(f"rankings path not found: {src}")
    parent, name = split_path(src)
    for run_dir in (src, parent if name == RANKINGS_SUBDIR else None):
        if run_dir is not None and BEAM_FILES.exists(join_path(run_dir, RANKINGS_MANIFEST)):
            return join_path(run_dir, RANKINGS_MANIFEST)
    raise EvaluationError(f"{src}: no {RANKINGS_MANIFEST}: not a finished pipelines.rerank run (rerun it)")


def run_dir_of(manifest_path: str) -> str:
    """The run directory of a rankings manifest path (local or URL)."""
    return split_path(manifest_path)[0]


def read_run_manifest(src: str) -> tuple[str, dict]:
    """(path, manifest) of a run; refuses a manifest of another rankings schema version."""
    from pipelines.common import read_json

    path = run_manifest_path(src)
    manifest = read_json(path)
    version = str(manifest.get("schema_version"))
    if version != schema.RANKINGS_SCHEMA_VERSION:
        raise EvaluationError(f"{path}: rankings schema {version}, this evaluate reads "
                              f"{schema.RANKINGS_SCHEMA_VERSION} (stored BE lists with be_rank): rerun "
                              f"pipelines.rerank")
    return path, manifest


def listed_shards(manifest_path: str, manifest: dict) -> list[tuple[str, bytes]]:
    """(path, bytes) of the shards a rankings manifest lists, each checked against its recorded sha256 (read
    once: a URL shard is not fetched twice)."""
    from pipelines.common import exists, read_bytes, sha256_bytes

    rank_dir = join_path(run_dir_of(manifest_path), RANKINGS_SUBDIR)
    found = []
    for shard in manifest.get("shards", []):
        path = join_path(rank_dir, shard["name"])
        if not exists(path):
            raise EvaluationError(f"{path} is listed in {manifest_path} but missing; rerun pipelines.rerank")
        data = read_bytes(path)
        digest = sha256_bytes(data)
        if digest != shard["sha256"]:
            raise EvaluationError(f"{path} changed since {manifest_path} was written (sha256 {digest[:12]}... != "
                                  f"{shard['sha256'][:12]}...); rerun pipelines.rerank")
        found.append((path, data))
    return found


def read_run_rankings(manifest_path: str, manifest: dict) -> pa.Table:
    """Every ranking row of a run (its listed, verified shards)."""
    tables = []
    for f, data in listed_shards(manifest_path, manifest):
        t = pq.read_table(pa.BufferReader(data))
        if "be_rank" not in t.column_names:
            raise EvaluationError(f"{f}: rankings without be_rank (an older pipelines.rerank): rerun pipelines.rerank")
        missing = [c for c in schema.RANKING_COLUMNS if c not in t.column_names]
        if missing:
            raise EvaluationError(f"{f}: not a rankings file (missing {missing})")
        tables.append(t.select(list(schema.RANKING_COLUMNS)).cast(schema.RANKING_SCHEMA))
    if not tables:
        raise EvaluationError(f"{manifest_path} lists no ranking shards; rerun pipelines.rerank")
    return pa.concat_tables(tables)


def resolve_derivation(manifest: dict, k: Optional[int] = None, mode: Optional[str] = None,
                       lam: Optional[float] = None, where: str = "the run") -> tuple[int, str, Optional[float]]:
    """(k, mode, lam) to evaluate a run with: each defaults to the run's own; refuses what the stored scores
    cannot give (CE modes on an EMB run, exhaustive CE on a top-k run, k deeper than the run's)."""
    run_mode, run_k, run_lam = manifest["mode"], int(manifest["k"]), manifest.get("lam")
    mode = (mode or run_mode).lower()
    if mode not in RUN_MODES:
        raise EvaluationError(f"mode must be one of {RUN_MODES}, got {mode!r}")
    k = run_k if k is None else k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise EvaluationError(f"k must be an integer >= 1, got {k!r}")
    if mode == "ce":
        if run_mode != "ce":
            raise EvaluationError(f"mode ce (exhaustive CE over the whole pool) needs a --mode ce run; {where} "
                                  f"({run_mode}) CE-scored its BE top-{run_k} only: use --mode co")
        if k != run_k:
            raise EvaluationError(f"--k does not apply to mode ce: {where} CE-ranked its whole pool")
    elif mode != "emb" and run_mode == "emb":
        raise EvaluationError(f"mode {mode} needs CE scores and {where} is an EMB run (none stored): rerun "
                              f"pipelines.rerank with --mode co and a CE model")
    # an exhaustive run CE-scored its whole pool: CO / fusion at any depth within it can be derived
    limit = min(int(v) for v in manifest["ce_depth"].values()) if run_mode == "ce" else run_k
    if mode != "ce" and k > limit:
        raise EvaluationError(f"k={k} is deeper than {where} (k={limit}): only k <= {limit} can be derived "
                              f"from its stored scores; rerun pipelines.rerank with --k {k}")
    if mode in FUSION_MODES:
        lam = float(lam if lam is not None else run_lam if run_lam is not None else DEFAULT_LAM)
        if not 0.0 <= lam <= 1.0:
            raise EvaluationError(f"lam must be in [0, 1], got {lam}")
    elif lam is not None:
        raise EvaluationError(f"--lam applies to add / norm_add only, not to mode {mode}")
    return int(k), mode, lam


def run_collection(manifest: dict, dataset, collection: Optional[str] = None) -> str:
    """The staged collection whose gold a run is scored against: the given one, else the run's, else the
    staged folder's only one."""
    collection = collection or manifest.get("collection")
    if collection is None:
        if len(dataset.collections) != 1:
            raise EvaluationError(f"--collection is required: {dataset.root} holds {dataset.collections}")
        collection = dataset.collections[0]
    if collection not in dataset.collections:
        raise EvaluationError(f"collection {collection!r} is not staged in {dataset.root} "
                              f"(have {dataset.collections})")
    return collection


def derived_table(table: pa.Table, manifest_path: str, manifest: dict, k: int, mode: str,
                  lam: Optional[float]) -> pa.Table:
    """A run's rankings re-ranked for (k, mode, lam) from its stored scores when they are not the run's own
    (``resolve_derivation`` has checked they can be derived)."""
    if (k, mode, lam) == (int(manifest["k"]), manifest["mode"], manifest.get("lam")):
        return table
    rank_k = max(int(v) for v in manifest["ce_depth"].values()) if mode == "ce" else k
    try:
        return derive_rankings(table, rank_k, RUN_TO_RANK_MODE[mode], lam if lam is not None else DEFAULT_LAM)
    except ValueError as exc:
        raise EvaluationError(f"{manifest_path}: {exc}") from None


def ranked_as(manifest_path: str, manifest: dict, k: int, mode: str, lam: Optional[float]) -> pa.Table:
    """A run's verified rankings, re-ranked for (k, mode, lam): what inspect reads."""
    return derived_table(read_run_rankings(manifest_path, manifest), manifest_path, manifest, k, mode, lam)


def evaluate_run(run_dir: str, staged: str, *, k: Optional[int] = None, mode: Optional[str] = None,
                 lam: Optional[float] = None, collection: Optional[str] = None, split: Optional[str] = None) -> dict:
    """Recall of a pipelines.rerank run, re-derived for (k, mode, lam) (default: the run's own).

    Returns the metrics (``t2i_R@1``, ``t2i_R@5``, ``t2i_R@10``, ``t2i_queries``, the same for ``i2t``, ``mR``;
    a direction the run did not rank has NaN recalls and 0 queries) plus ``k``, ``mode``, ``lam`` as applied,
    ``collection``, ``split``, ``collection_size`` (the t2i candidate pool, else the gold images) and
    ``ranked_depth``."""
    run = LoadedRun.read(run_dir, staged, collection, split)
    return run.evaluate(k, mode, lam)


class LoadedRun:
    """A verified rerank run with the gold of its queries, read once: ``evaluate`` re-derives any (k, mode,
    lam) from its stored scores (evaluate_run for one setting, choose_fusion for a grid of them)."""

    def __init__(self, manifest_path: str, manifest: dict, table: pa.Table, collection: str, split: Optional[str],
                 caption_to_image: dict, image_to_captions: dict, directions: tuple[str, ...]):
        self.manifest_path, self.manifest, self.table = manifest_path, manifest, table
        self.collection, self.split, self.directions = collection, split, directions
        self.caption_to_image, self.image_to_captions = caption_to_image, image_to_captions

    @classmethod
    def read(cls, run_dir: str, staged: str, collection: Optional[str] = None,
             split: Optional[str] = None) -> "LoadedRun":
        from pipelines.common import open_file
        from retrieval_core.store import StagedDataset

        dataset = StagedDataset(staged, opener=open_file)
        manifest_path, manifest = read_run_manifest(run_dir)
        collection = run_collection(manifest, dataset, collection)
        split = split if split is not None else manifest.get("split")
        recorded = (manifest.get("staged_sha256") or {}).get(f"captions/{collection}")
        if recorded and recorded != dataset.content_sha256("captions", collection):
            raise EvaluationError(f"{manifest_path} ranked the captions/{collection} shards of another staging "
                                  f"(sha256 {recorded[:12]}...) than --staged {staged} holds "
                                  f"({dataset.content_sha256('captions', collection)[:12]}...): its gold would not "
                                  f"be the run's; pass the staged folder the run used ({manifest.get('staged')})")
        table = read_run_rankings(manifest_path, manifest)
        directions = tuple(d for d in DIRECTIONS if d in manifest.get("directions", DIRECTIONS))
        restrict = {}
        if manifest.get("queries_file"):  # a restricted run: the gold of its ranked queries only (read as such)
            ranked = {d: set(pc.unique(table.filter(pc.equal(table.column("direction"), d)).column("query_id"))
                             .to_pylist()) for d in directions}
            restrict = {"captions": ranked.get(schema.DIRECTION_T2I, set()),
                        "images": ranked.get(schema.DIRECTION_I2T, set())}
        caption_to_image, image_to_captions = dataset.gold(collection, split, **restrict)
        if not caption_to_image and not restrict:
            raise EvaluationError(f"no {split!r} captions for collection {collection!r} in {staged}")
        return cls(manifest_path, manifest, table, collection, split, caption_to_image, image_to_captions,
                   directions)

    def evaluate(self, k: Optional[int] = None, mode: Optional[str] = None, lam: Optional[float] = None) -> dict:
        where = run_dir_of(self.manifest_path)
        k, mode, lam = resolve_derivation(self.manifest, k, mode, lam, where=where)
        table = derived_table(self.table, self.manifest_path, self.manifest, k, mode, lam)
        result = evaluate_rankings(table, self.caption_to_image, self.image_to_captions, directions=self.directions)
        pool = self.manifest.get("pool_size", {}).get(schema.DIRECTION_T2I)
        if pool is not None:
            result["collection_size"] = int(pool)
        result.update(k=k, mode=mode, lam=lam, collection=self.collection, split=self.split)
        return result


#: ``--mode auto``'s candidates besides CO: both fusions at these BE weights (the paper's Table 6 grid).
AUTO_LAMS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def choose_fusion(dev_run: str, staged: str, k: int, lams: Sequence[float] = AUTO_LAMS,
                  collection: Optional[str] = None) -> dict:
    """The fusion with the best mR on a dev run (a CE-scored pipelines.rerank run on a held-out split): CO,
    ADD_lam and NORM_ADD_lam for every lam, each derived at depth ``k`` from the run's stored scores.

    CO, the paper's setting, wins ties: a fusion is chosen only where it measures better. Returns
    ``{"mode", "lam", "label", "dev_mR": {label: mR}, "dev_run", "dev_split", "k"}``."""
    run = LoadedRun.read(dev_run, staged, collection)
    candidates = [("co", None)] + [(m, float(lam)) for m in FUSION_MODES for lam in lams]
    scores = {mode_label(m, lam): run.evaluate(k, m, lam)["mR"] for m, lam in candidates}
    best = candidates[0]
    for m, lam in candidates[1:]:
        if scores[mode_label(m, lam)] > scores[mode_label(*best)] + 1e-9:
            best = (m, lam)
    return {"mode": best[0], "lam": best[1], "label": mode_label(*best),
            "dev_mR": {label: round(v, 4) for label, v in scores.items()},
            "dev_run": run_dir_of(run.manifest_path), "dev_split": run.split, "k": int(k)}


def mode_label(mode: str, lam: Optional[float]) -> str:
    """The default ``mode`` column of metrics.csv: the mode, with lam for the fusions (add_0.5)."""
    return f"{mode}_{lam:g}" if lam is not None else mode


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
@click.command(context_settings=dict(help_option_names=["-h", "--help"]))
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
    from pipelines.common import cli_errors, exists, join, makedirs, read_bytes, write_atomic, write_json_atomic

    t0 = time.time()
    tag_map = parse_tags(tags)
    with cli_errors(EvaluationError):  # a missing staged / rankings dir or bad rankings: one line, exit 1
        result = evaluate_run(rankings, staged, k=k, mode=mode, lam=lam, collection=collection, split=split)
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

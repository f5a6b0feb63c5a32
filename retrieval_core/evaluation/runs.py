"""The rerank-run contract, read side: a ``pipelines.rerank`` run (its rankings_manifest.json and the checksummed
shards it lists), the gold of its queries, and any (k, mode, lam) re-derived from its stored scores.

Score once, evaluate many: a run stores, per query, its BE top-n with ``be_rank``, ``be_score`` and (CE modes) the
CE scores of its BE top-k, so any k' <= k, mode and lam can be ranked from it exactly as a run with those
settings would have been (``retrieval_core.search.rerank.derive_rankings``). Everything is read through the
``files`` given (a ``FileAccess``; the pipelines and benchmarks pass Beam's, so runs may live at URLs).
"""
from __future__ import annotations

import hashlib
import json
from typing import Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retrieval_core.data import schema
from retrieval_core.data.paths import LOCAL_FILES, FileAccess, join_path, read_file, split_path
from retrieval_core.data.store import StagedDataset
from retrieval_core.evaluation.metrics import DirectionHits, rankings_hits, recall_summary
from retrieval_core.evaluation.stats import Bootstrap, difference_intervals, recall_intervals
from retrieval_core.search.rerank import (
    FUSION_MODES,
    RANKINGS_MANIFEST,
    RANKINGS_SUBDIR,
    RUN_MODES,
    RUN_TO_RANK_MODE,
    derive_rankings,
)

DIRECTIONS = (schema.DIRECTION_T2I, schema.DIRECTION_I2T)
DEFAULT_LAM = 0.5  # pipelines.rerank's default --lam: a fusion derived from a CO run uses it
#: The fusion candidates besides CO (``choose_fusion``): both fusions at these BE weights (the paper's Table 6 grid).
AUTO_LAMS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class RunError(ValueError):
    """A rerank run that is missing, unfinished, changed, or cannot give what is asked of it."""


def run_manifest_path(src: str, files: Optional[FileAccess] = None) -> str:
    """rankings_manifest.json of a run given as its run dir or its rankings/ dir."""
    files = files or LOCAL_FILES
    if not (files.isdir(src) or files.exists(src)):
        raise RunError(f"rankings path not found: {src}")
    parent, name = split_path(src)
    for run_dir in (src, parent if name == RANKINGS_SUBDIR else None):
        if run_dir is not None and files.exists(join_path(run_dir, RANKINGS_MANIFEST)):
            return join_path(run_dir, RANKINGS_MANIFEST)
    raise RunError(f"{src}: no {RANKINGS_MANIFEST}: not a finished pipelines.rerank run (rerun it)")


def run_dir_of(manifest_path: str) -> str:
    return split_path(manifest_path)[0]


def read_run_manifest(src: str, files: Optional[FileAccess] = None) -> tuple[str, dict]:
    """(path, manifest) of a run; refuses a manifest of another rankings schema version."""
    path = run_manifest_path(src, files)
    try:
        manifest = json.loads(read_file(path, files).decode("utf-8"))
    except ValueError as exc:
        raise RunError(f"{path}: not a rankings manifest ({exc})") from None
    version = str(manifest.get("schema_version"))
    if version != schema.RANKINGS_SCHEMA_VERSION:
        raise RunError(f"{path}: rankings schema {version}, this code reads {schema.RANKINGS_SCHEMA_VERSION} "
                       f"(stored BE lists with be_rank): rerun pipelines.rerank")
    return path, manifest


def read_run_rankings(manifest_path: str, manifest: dict, files: Optional[FileAccess] = None) -> pa.Table:
    """Every ranking row of a run: the shards its manifest lists, each checked against its recorded sha256."""
    files = files or LOCAL_FILES
    rank_dir = join_path(run_dir_of(manifest_path), RANKINGS_SUBDIR)
    tables = []
    for shard in manifest.get("shards", []):
        path = join_path(rank_dir, shard["name"])
        if not files.exists(path):
            raise RunError(f"{path} is listed in {manifest_path} but missing; rerun pipelines.rerank")
        data = read_file(path, files)
        digest = hashlib.sha256(data).hexdigest()
        if digest != shard["sha256"]:
            raise RunError(f"{path} changed since {manifest_path} was written (sha256 {digest[:12]}... != "
                           f"{shard['sha256'][:12]}...); rerun pipelines.rerank")
        t = pq.read_table(pa.BufferReader(data))
        missing = [c for c in schema.RANKING_COLUMNS if c not in t.column_names]
        if missing:
            raise RunError(f"{path}: not a rankings file of this schema (missing {missing}); rerun pipelines.rerank")
        tables.append(t.select(list(schema.RANKING_COLUMNS)).cast(schema.RANKING_SCHEMA))
    if not tables:
        raise RunError(f"{manifest_path} lists no ranking shards; rerun pipelines.rerank")
    return pa.concat_tables(tables)


def resolve_derivation(manifest: dict, k: Optional[int] = None, mode: Optional[str] = None,
                       lam: Optional[float] = None, where: str = "the run") -> tuple[int, str, Optional[float]]:
    """(k, mode, lam) to rank a run with: each defaults to the run's own; refuses what the stored scores
    cannot give (CE modes on an EMB run, exhaustive CE on a top-k run, k deeper than the run's)."""
    run_mode, run_k, run_lam = manifest["mode"], int(manifest["k"]), manifest.get("lam")
    mode = (mode or run_mode).lower()
    if mode not in RUN_MODES:
        raise RunError(f"mode must be one of {RUN_MODES}, got {mode!r}")
    k = run_k if k is None else k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise RunError(f"k must be an integer >= 1, got {k!r}")
    if mode == "ce":
        if run_mode != "ce":
            raise RunError(f"mode ce (exhaustive CE over the whole pool) needs a --mode ce run; {where} "
                           f"({run_mode}) CE-scored its BE top-{run_k} only: use --mode co")
        if k != run_k:
            raise RunError(f"--k does not apply to mode ce: {where} CE-ranked its whole pool")
    elif mode != "emb" and not any(int(v) for v in manifest.get("ce_depth", {}).values()):
        raise RunError(f"mode {mode} needs CE scores and {where} is an EMB run (none stored): rerun "
                       f"pipelines.rerank with --mode co (or --score-ce) and a CE model")
    # an exhaustive run CE-scored its whole pool: CO / fusion at any depth within it can be derived
    limit = min(int(v) for v in manifest["ce_depth"].values()) if run_mode == "ce" else run_k
    if mode != "ce" and k > limit:
        raise RunError(f"k={k} is deeper than {where} (k={limit}): only k <= {limit} can be derived "
                       f"from its stored scores; rerun pipelines.rerank with --k {k}")
    if mode in FUSION_MODES:
        lam = float(lam if lam is not None else run_lam if run_lam is not None else DEFAULT_LAM)
        if not 0.0 <= lam <= 1.0:
            raise RunError(f"lam must be in [0, 1], got {lam}")
    elif lam is not None:
        raise RunError(f"--lam applies to add / norm_add only, not to mode {mode}")
    return int(k), mode, lam


def run_collection(manifest: dict, dataset: StagedDataset, collection: Optional[str] = None) -> str:
    """The staged collection whose gold a run is scored against: the given one, else the run's, else the
    staged folder's only one."""
    collection = collection or manifest.get("collection")
    if collection is None:
        if len(dataset.collections) != 1:
            raise RunError(f"--collection is required: {dataset.root} holds {dataset.collections}")
        collection = dataset.collections[0]
    if collection not in dataset.collections:
        raise RunError(f"collection {collection!r} is not staged in {dataset.root} (have {dataset.collections})")
    return collection


def mode_label(mode: str, lam: Optional[float]) -> str:
    """A ranking's name: the mode, with lam for the fusions (add_0.5)."""
    return f"{mode}_{lam:g}" if lam is not None else mode


class LoadedRun:
    """A verified rerank run with the gold of its queries, read once: :meth:`evaluate` and :meth:`ranked`
    re-derive any (k, mode, lam) from its stored scores."""

    def __init__(self, manifest_path: str, manifest: dict, table: pa.Table, dataset: StagedDataset,
                 collection: str, split: Optional[str], caption_to_image: dict, image_to_captions: dict,
                 directions: tuple[str, ...], lang: Optional[str] = None):
        self.manifest_path, self.manifest, self.table, self.dataset = manifest_path, manifest, table, dataset
        self.collection, self.split, self.directions, self.lang = collection, split, directions, lang
        self.caption_to_image, self.image_to_captions = caption_to_image, image_to_captions
        self._hits: dict[tuple, dict[str, DirectionHits]] = {}

    @classmethod
    def read(cls, run_dir: str, staged: str, collection: Optional[str] = None, split: Optional[str] = None,
             files: Optional[FileAccess] = None, lang: Optional[str] = None) -> "LoadedRun":
        """The run and its gold; ``lang``: evaluated on the captions of that language only (its t2i queries, and
        the gold captions of its i2t queries; rank it against that language's captions for a fair i2t pool)."""
        dataset = StagedDataset(staged, files=files)
        manifest_path, manifest = read_run_manifest(run_dir, files)
        collection = run_collection(manifest, dataset, collection)
        split = split if split is not None else manifest.get("split")
        recorded = (manifest.get("staged_sha256") or {}).get(f"captions/{collection}")
        here = dataset.content_sha256("captions", collection)
        if recorded and recorded != here:
            raise RunError(f"{manifest_path} ranked the captions/{collection} shards of another staging (sha256 "
                           f"{recorded[:12]}...) than {staged} holds ({here[:12]}...): its gold would not be the "
                           f"run's; pass the staged folder the run used ({manifest.get('staged')})")
        table = read_run_rankings(manifest_path, manifest, files)
        directions = tuple(d for d in DIRECTIONS if d in manifest.get("directions", DIRECTIONS))
        restrict = {}
        if manifest.get("queries_file"):  # a restricted run: the gold of its ranked queries only
            ranked = {d: set(pc.unique(table.filter(pc.equal(table.column("direction"), d)).column("query_id"))
                             .to_pylist()) for d in directions}
            restrict = {"captions": ranked.get(schema.DIRECTION_T2I, set()),
                        "images": ranked.get(schema.DIRECTION_I2T, set())}
        caption_to_image, image_to_captions = dataset.gold(collection, split, lang=lang, **restrict)
        if not caption_to_image and not restrict:
            raise RunError(f"no {split!r} captions for collection {collection!r} in {staged}"
                           + (f" in language {lang!r}" if lang else ""))
        if lang is not None:  # the t2i queries of other languages are not this evaluation's
            keep = pc.or_(pc.not_equal(table.column("direction"), schema.DIRECTION_T2I),
                          pc.is_in(table.column("query_id"), pa.array(list(caption_to_image), pa.int64())))
            table = table.filter(keep)
        return cls(manifest_path, manifest, table, dataset, collection, split, caption_to_image, image_to_captions,
                   directions, lang)

    @property
    def run_dir(self) -> str:
        return run_dir_of(self.manifest_path)

    def resolve(self, k: Optional[int] = None, mode: Optional[str] = None,
                lam: Optional[float] = None) -> tuple[int, str, Optional[float]]:
        return resolve_derivation(self.manifest, k, mode, lam, where=self.run_dir)

    def ranked(self, k: Optional[int] = None, mode: Optional[str] = None, lam: Optional[float] = None) -> pa.Table:
        """The run's rankings re-ranked for (k, mode, lam) from its stored scores (its own when they match)."""
        k, mode, lam = self.resolve(k, mode, lam)
        if (k, mode, lam) == (int(self.manifest["k"]), self.manifest["mode"], self.manifest.get("lam")):
            return self.table
        rank_k = max(int(v) for v in self.manifest["ce_depth"].values()) if mode == "ce" else k
        try:
            return derive_rankings(self.table, rank_k, RUN_TO_RANK_MODE[mode],
                                   lam if lam is not None else DEFAULT_LAM)
        except ValueError as exc:
            raise RunError(f"{self.manifest_path}: {exc}") from None

    def hits(self, k: Optional[int] = None, mode: Optional[str] = None,
             lam: Optional[float] = None) -> dict[str, DirectionHits]:
        """Per direction, the ranked queries and the rank of each one's first gold item, for the run ranked for
        (k, mode, lam): what its recalls and their intervals (``evaluation.stats``) are computed from. Kept per
        (k, mode, lam), so that a run's EMB hits are derived once whatever compares with them."""
        key = self.resolve(k, mode, lam)
        if key not in self._hits:
            self._hits[key] = rankings_hits(self.ranked(*key), self.caption_to_image, self.image_to_captions,
                                            directions=self.directions)
        return self._hits[key]

    def evaluate(self, k: Optional[int] = None, mode: Optional[str] = None, lam: Optional[float] = None,
                 bootstrap: Optional[Bootstrap] = None) -> dict:
        """Recall of the run ranked for (k, mode, lam): ``metrics.recall_summary``'s keys plus ``k``, ``mode``,
        ``lam`` as applied, ``collection``, ``split``; ``collection_size`` is the t2i candidate pool (else the gold
        images). With ``bootstrap``: ``intervals``, ``stats.recall_intervals`` of its recalls and mR."""
        k, mode, lam = self.resolve(k, mode, lam)
        hits = self.hits(k, mode, lam)
        pool = self.manifest.get("pool_size", {}).get(schema.DIRECTION_T2I)
        result = recall_summary(hits, int(pool) if pool is not None else len(self.image_to_captions))
        result.update(k=k, mode=mode, lam=lam, collection=self.collection, split=self.split, lang=self.lang)
        if bootstrap is not None:
            result["intervals"] = recall_intervals(hits, bootstrap)
        return result


def evaluate_run(run_dir: str, staged: str, *, k: Optional[int] = None, mode: Optional[str] = None,
                 lam: Optional[float] = None, collection: Optional[str] = None, split: Optional[str] = None,
                 files: Optional[FileAccess] = None, bootstrap: Optional[Bootstrap] = None,
                 lang: Optional[str] = None) -> dict:
    """Recall of a run, re-derived for (k, mode, lam) (default: the run's own): see :meth:`LoadedRun.evaluate`."""
    return LoadedRun.read(run_dir, staged, collection, split, files, lang).evaluate(k, mode, lam, bootstrap)


#: How choose_fusion ranks the candidates (recorded with every choice).
CHOICE_CRITERION = ("the largest R@1 gain over EMB in the worse direction on the dev run; ties: the higher mR, then "
                    "the first of emb, co, add_lam, norm_add_lam; pure co only when its R@1 lead over the best "
                    "candidate that keeps the BE score is beyond noise on the dev queries (its paired 95 % interval "
                    "above 0 in one direction, its estimate not below 0 in the other)")
#: The paired bootstrap of that noise check (the settings of the intervals the suites report).
LEAD_BOOTSTRAP = Bootstrap()


def lead_beyond_noise(a: Mapping[str, DirectionHits], b: Mapping[str, DirectionHits],
                      boot: Bootstrap = LEAD_BOOTSTRAP) -> tuple[bool, dict[str, list[float]]]:
    """Whether ranking A's R@1 lead over B on the same queries is beyond noise: the paired interval of A - B above 0
    in at least one direction and its estimate not below 0 in any. Returns (that, ``{"<d>_R@1": [estimate, lo,
    hi]}``)."""
    lead = difference_intervals(a, b, boot, ks=(1,))
    out = {f"{d}_R@1": [round(v, 4) for v in (i.estimate, i.lo, i.hi)]
           for d in DIRECTIONS if f"{d}_R@1" in lead for i in (lead[f"{d}_R@1"],)}
    beyond = any(lo > 0 for _, lo, _ in out.values()) and all(est >= 0 for est, _, _ in out.values())
    return beyond, out


def choose_fusion(dev_run: str, staged: str, k: int, lams: Sequence[float] = AUTO_LAMS,
                  collection: Optional[str] = None, files: Optional[FileAccess] = None,
                  lang: Optional[str] = None) -> dict:
    """The ranking users get by default, chosen on a dev run (a CE-scored run on a held-out split): among EMB,
    CO and ADD_lam / NORM_ADD_lam for every lam, each derived at depth ``k`` from the run's stored scores, the one
    whose worse direction gains most R@1 over EMB (CHOICE_CRITERION). EMB is a candidate, so a gain in one
    direction is never bought with a measured loss in the other. Pure CO drops the BE score, the part that keeps a
    ranking near EMB where the CE transfers worse than the BE (queries unlike the dev split's), so CO is taken only
    when its dev lead over the best candidate that keeps the BE score is beyond noise, not a query or two. Returns
    ``{"mode", "lam", "label", "dev": {label: {t2i_R@1, i2t_R@1, mR}}, "dev_mR": {label: mR}, "criterion",
    "dev_run", "dev_split", "k", "co_lead"}``; ``co_lead`` (None unless CO ranked first): CO minus that candidate
    per direction, ``{"<d>_R@1": [estimate, lo, hi]}``."""
    run = LoadedRun.read(dev_run, staged, collection, files=files, lang=lang)
    candidates = [("emb", None), ("co", None)] + [(m, float(lam)) for m in FUSION_MODES for lam in lams]
    results = {mode_label(m, lam): run.evaluate(k, m, lam) for m, lam in candidates}
    base = results["emb"]

    def rank(label: str) -> tuple[float, float]:
        lifts = [results[label][f"{d}_R@1"] - base[f"{d}_R@1"] for d in run.directions]
        return round(min(lifts), 9), round(results[label]["mR"], 9)

    labels = {mode_label(m, lam): (m, lam) for m, lam in candidates}
    best = max(labels, key=rank)  # max keeps the first of equals
    co_lead = None
    if best == "co":
        kept = max((label for label in labels if label != "co"), key=rank)
        beyond, co_lead = lead_beyond_noise(run.hits(k, "co"), run.hits(k, *labels[kept]))
        best = best if beyond else kept
    mode, lam = labels[best]
    dev = {label: {key: round(r[key], 4) for key in (*(f"{d}_R@1" for d in run.directions), "mR")}
           for label, r in results.items()}
    return {"mode": mode, "lam": lam, "label": best, "dev": dev,
            "dev_mR": {label: d["mR"] for label, d in dev.items()}, "criterion": CHOICE_CRITERION,
            "dev_run": run.run_dir, "dev_split": run.split, "k": int(k), "co_lead": co_lead}


def check_same_models(run_dir: str, run: dict, emb_dir: str, cross_encoder: str, precision: str,
                      files: Optional[FileAccess] = None, flag: str = "--tune-on") -> None:
    """Refuse a run (``run``: its manifest) made with another bi-encoder than the one that encoded ``emb_dir``,
    another cross-encoder than ``cross_encoder`` or CE scores of another precision: a fusion chosen on it would be
    chosen on other scores. ``flag``: how the caller names the run (an option, or a parameter)."""
    from retrieval_core.model.checkpoints import CheckpointError, inspect_model_folder
    from retrieval_core.search import embeddings

    emb_model = embeddings.load_embeddings_manifest(emb_dir, files)["model"]
    if run.get("be_model", {}).get("sha256") != emb_model.get("sha256"):
        raise RunError(f"{flag} {run_dir} was retrieved by another bi-encoder ({run.get('be_model', {}).get('path')}) "
                       f"than the embeddings {emb_dir} ({emb_model.get('path')})")
    try:
        same_ce = bool(run.get("ce_model")) and inspect_model_folder(run["ce_model"], files=files).fingerprint == \
            inspect_model_folder(cross_encoder, files=files).require(("ce",)).fingerprint
    except CheckpointError as exc:
        raise RunError(f"CE model: {exc}") from None
    if not same_ce:
        raise RunError(f"{flag} {run_dir} was reranked by another cross-encoder ({run.get('ce_model')}) than "
                       f"{cross_encoder}")
    if run.get("quantize", "none") != precision:
        raise RunError(f"{flag} {run_dir} scored with --quantize {run.get('quantize', 'none')}, this ranking with "
                       f"{precision}: the fusion would be chosen on other CE scores")


def recorded_choice(run_dir: str, emb_dir: str, cross_encoder: str, precision: str, k: int,
                    files: Optional[FileAccess] = None, flag: str = "--tune-on") -> dict:
    """The fusion a finished ``--mode auto`` rerank run chose on its dev split (its manifest's ``fusion_choice``:
    mode, lam, label, every candidate's dev recall), to rank other queries the same way (``pipelines.query --mode
    auto``, ``QueryEngine.search_text(rerank="auto")``): refused when the run is no auto run, was made with other
    models or precision (:func:`check_same_models`) or at another depth k (the choice is made at the run's k)."""
    cli = flag.startswith("--")  # the words of the caller: the query job's options, or the engine's parameters
    k_is, yourself = ("--k ", "--mode and --lam") if cli else ("k=", "rerank and lam")
    try:
        _, run = read_run_manifest(run_dir, files)
    except RunError as exc:
        raise RunError(f"{flag}: {exc}") from None
    choice = run.get("fusion_choice")
    if not choice or choice.get("mode") is None:
        raise RunError(f"{flag} {run_dir} is a --mode {run.get('mode')} run that chose nothing: name a finished "
                       f"--mode auto rerank run (its fusion_choice), or pass {yourself}")
    check_same_models(run_dir, run, emb_dir, cross_encoder, precision, files, flag)
    if int(run.get("k", -1)) != int(k):
        raise RunError(f"{flag} {run_dir} chose {choice.get('label')} at k = {run.get('k')}, not at {k_is}{k}: pass "
                       f"{k_is}{run.get('k')}, or {yourself} yourself")
    return dict(choice)


#: The stored scores :func:`score_differences` compares (schema.RANKING_COLUMNS).
COMPARED_SCORES = ("be_score", "ce_score")


def score_differences(a: pa.Table, b: pa.Table, directions: Sequence[str] = DIRECTIONS) -> dict[str, dict]:
    """How far two runs' stored scores of the same (query, item) pairs lie apart, per direction: e.g. one model
    served in bf16 against float32, where the rankings alone cannot say whether a changed order is a tie broken
    otherwise or a real shift. Per direction and score (COMPARED_SCORES): ``{"<score>_max_abs", "<score>_mean_abs",
    "<score>_pairs"}`` over the pairs both runs scored (a BE top-k that differs leaves its other items out; a CE
    score counts where both have one). RunError when no pair is shared (not two runs of the same queries)."""
    pair = ["query_id", "item_id"]
    out: dict[str, dict] = {}
    for d in directions:
        sides = [t.filter(pc.equal(t.column("direction"), d)).select(pair + list(COMPARED_SCORES))
                 for t in (a, b)]
        if not all(s.num_rows for s in sides):
            continue
        joined = sides[0].join(sides[1], pair, left_suffix="_a", right_suffix="_b")
        if joined.num_rows == 0:
            raise RunError(f"{d}: the two runs share no (query, item) pair: not rankings of the same queries")
        row: dict = {}
        for score in COMPARED_SCORES:
            x, y = (joined.column(f"{score}_{s}").to_numpy(zero_copy_only=False).astype(np.float64)
                    for s in ("a", "b"))  # a null (no CE score) reads as NaN
            both = ~(np.isnan(x) | np.isnan(y))
            diff = np.abs(x[both] - y[both])
            row[f"{score}_pairs"] = int(both.sum())
            row[f"{score}_max_abs"] = float(diff.max()) if diff.size else float("nan")
            row[f"{score}_mean_abs"] = float(diff.mean()) if diff.size else float("nan")
        out[d] = row
    return out

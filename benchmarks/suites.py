"""The recall benchmark suites (paper Tables 1, 5, 8, 11 and the 100k setting), as plain functions.

Each suite takes a :class:`SuiteContext` (models, output folder, cache, options) and :class:`Task` s (which
collection's queries and gold, which collections fill the candidate pools, where the data comes from) and
returns CSV rows (``benchmarks.report.CSV_COLUMNS``). ``benchmarks.run`` resolves tasks from manifests and
staged directories; tests build them in memory from ``retrieval_core.synthetic``.

Every row's rankings are written to ``<output>/rankings/<suite>/<row>.parquet`` (several files, ';'-joined,
for fold means) and named in the row's ``rankings`` column, so each number can be recomputed.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import pandas as pd

from benchmarks.engine import (DEFAULT_CE_PAIR_BUDGET, DIRECTIONS, EvalCache, EvalResult, ModelRef, Pool, SkipRow,
                               direction_metrics, evaluate_collection)
from benchmarks.report import environment
from retrieval_core.schema import DIRECTION_I2T, DIRECTION_T2I, ImageTable

# Method = (model family, method label). Model families: SEP (BE model + separate CE model), JOIN (one model).
EMB, CO, CE = "EMB", "CO", "CE"
MODE_LABELS = {"emb": EMB, "ce": CO, "add": "CO-ADD", "norm_add": "CO-NORM_ADD"}
STANDARD_K = 20  # the paper's default rerank depth
COCO_1K_FOLDS = 5
COCO_1K_SIZE = 1000


# ---------------------------------------------------------------------------------------------- data
class DataSource:
    """Where a task's images and captions come from."""

    def load(self, collection: str, split: Optional[str]) -> tuple[ImageTable, pd.DataFrame]:
        raise NotImplementedError


class StagedSource(DataSource):
    def __init__(self, staged_dir: str):
        from retrieval_core.store import StagedDataset

        self.ds = StagedDataset(staged_dir)

    def load(self, collection, split):
        # Keep the stored precision in memory (collate_images casts each batch to float32): a float16
        # collection of 100k images is ~6 GB as stored and would be ~12 GB, twice over while loading, as float32.
        dtype = np.float16 if self.ds.feature_dtype == "float16" else np.float32
        return (self.ds.load_images(collection=collection, split=split, dtype=dtype),
                self.ds.captions(collection, split))


class InMemorySource(DataSource):
    """collection -> (ImageTable, captions DataFrame); ``split`` filters on the captions' split column."""

    def __init__(self, data: dict):
        self.data = data

    def load(self, collection, split):
        images, caps = self.data[collection]
        if split is not None and "split" in caps:
            caps = caps[caps["split"] == split].reset_index(drop=True)
            keep = np.isin(images.item_ids, caps["image_item_id"].to_numpy(np.int64))
            images = images.take(np.flatnonzero(keep))
        return images, caps


def synthetic_collection(spec) -> tuple[ImageTable, pd.DataFrame]:
    """Generate + validate one synthetic collection in memory with the stager's own per-record functions
    (no Beam): what ``pipelines.stage`` would write for it."""
    from retrieval_core import staging, synthetic
    from retrieval_core.schema import DEFAULT_MAX_REGIONS, Reject

    rows = []
    for raw in synthetic.generate_images(spec):
        r = staging.stage_image(raw, collection=spec.collection, feature_dim=spec.feature_dim,
                                max_regions=DEFAULT_MAX_REGIONS, source="synthetic")
        if isinstance(r, Reject):
            raise ValueError(f"synthetic image rejected: {r.reason}")
        rows.append(r)
    caps = []
    for raw in synthetic.generate_captions(spec):
        r = staging.stage_caption(raw, collection=spec.collection, source="synthetic")
        if isinstance(r, Reject):
            raise ValueError(f"synthetic caption rejected: {r.reason}")
        caps.append({k: r[k] for k in ("caption_id", "image_item_id", "collection", "source_id", "text", "lang",
                                       "split")})
    table = ImageTable.from_lists([r["item_id"] for r in rows], [r["features"] for r in rows],
                                  [r["boxes"] for r in rows])
    return table, pd.DataFrame(caps).sort_values("caption_id").reset_index(drop=True)


def concat_images(tables: Sequence[ImageTable]) -> ImageTable:
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for t in tables:
        offsets.append(t.offsets[1:] + base)
        base += int(t.offsets[-1])
    return ImageTable(np.concatenate([t.item_ids for t in tables]).astype(np.int64), np.concatenate(offsets),
                      np.concatenate([t.features for t in tables]), np.concatenate([t.boxes for t in tables]), {})


def gold_of(captions: pd.DataFrame) -> tuple[dict, dict]:
    """(caption_id -> image_id, image_id -> frozenset(caption_ids)), fresh dicts."""
    cap = captions["caption_id"].to_numpy(np.int64).tolist()
    img = captions["image_item_id"].to_numpy(np.int64).tolist()
    groups: dict[int, list] = {}
    for c, i in zip(cap, img):
        groups.setdefault(i, []).append(c)
    return dict(zip(cap, img)), {i: frozenset(cs) for i, cs in groups.items()}


@dataclass
class Task:
    """One standard task: queries + gold from ``collection`` (``split``), candidates from it plus
    ``distractors`` (other collections, all splits named in ``distractor_split``)."""
    label: str
    source: DataSource
    collection: str
    split: Optional[str] = "test"
    distractors: tuple = ()
    distractor_split: Optional[str] = None
    folds: int = 0  # > 0: also report the mean over this many folds of fold_size images (COCO 1k)
    fold_size: int = COCO_1K_SIZE


# ------------------------------------------------------------------------------------------- models
@dataclass
class ModelSet:
    """Model folders of the compared systems; loaded on first use. SEP = be_dir (BE objective only) +
    ce_dir (CE objective only); JOIN = join_dir (both objectives, shared weights)."""
    join_dir: Optional[str] = None
    be_dir: Optional[str] = None
    ce_dir: Optional[str] = None
    baseline: Optional[ModelRef] = None
    device: str = "cpu"
    _loaded: dict = field(default_factory=dict)

    def ref(self, which: str) -> ModelRef:
        path = {"join": self.join_dir, "be": self.be_dir, "ce": self.ce_dir}[which]
        if path is None:
            raise ValueError(f"no {which!r} model given")
        if path not in self._loaded:
            from retrieval_core.model import VLRetrievalModel

            self._loaded[path] = ModelRef(VLRetrievalModel.load(path, device=self.device), os.path.abspath(path),
                                          which)
        return self._loaded[path]

    def pair(self, family: str) -> tuple[ModelRef, ModelRef]:
        """(BE model, CE model) of a family."""
        if family == "SEP":
            return self.ref("be"), self.ref("ce")
        if family == "JOIN":
            j = self.ref("join")
            return j, j
        raise ValueError(f"unknown model family {family!r}")

    def have(self, family: str) -> bool:
        return bool(self.be_dir and self.ce_dir) if family == "SEP" else bool(self.join_dir)


@dataclass
class SuiteContext:
    output: str
    models: ModelSet
    cache: EvalCache = field(default_factory=EvalCache)
    batch_size: int = 128
    device: str = "cpu"
    ce_pair_budget: int = DEFAULT_CE_PAIR_BUDGET
    max_queries: Optional[int] = None  # per direction; None = the full protocol
    quick: bool = False
    progress: bool = True
    seed: int = 0
    index_factory: str = "Flat"
    _env: Optional[dict] = None

    def env(self) -> dict:
        if self._env is None:
            self._env = environment(self.device, self.batch_size)
        return self._env

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def families(self) -> list[str]:
        fams = [f for f in ("SEP", "JOIN") if self.models.have(f)]
        if not fams:
            raise ValueError("no models: give --model (JOIN) and/or --be-model with --ce-model (SEP)")
        return fams


# ------------------------------------------------------------------------------------------- rows
def _slug(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", "__".join(str(p) for p in parts if p not in (None, "")))


def save_rankings(ctx: SuiteContext, suite: str, slug: str, table) -> str:
    """Writes one rankings table as Parquet; returns its path relative to the output folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rel = os.path.join("rankings", suite, slug + ".parquet")
    path = os.path.join(ctx.output, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table, preserve_index=False)
    pq.write_table(table, path + ".tmp")
    os.replace(path + ".tmp", path)
    return rel


def make_rows(ctx: SuiteContext, suite: str, collection: str, model: str, mode: str, k, lam,
              results: Sequence[EvalResult], directions: Sequence[str], collection_size: int, split: Optional[str],
              rankings: Sequence[str], notes: Iterable[str] = ()) -> list[dict]:
    """One row per direction; with several results (folds) every number is the mean over them. mR is the
    mean of the six recalls of both directions (of one direction's three when only one was run)."""
    notes = list(notes) + [n for r in results[:1] for n in r.notes]
    per_dir = {d: [direction_metrics(r.metrics, d) for r in results] for d in directions}
    mean = lambda xs: float(np.mean(xs))
    m_r = mean([mean([m[f"R@{kk}"] for m in per_dir[d] for kk in (1, 5, 10)]) for d in directions])
    timing = {c: mean([r.timings[c] for r in results]) for c in ("wall_s", "encode_s", "index_s", "search_s",
                                                                   "rerank_s")}
    pairs = mean([r.timings["ce_pairs"] for r in results])
    rows = []
    for d in directions:
        rows.append({
            "suite": suite, "collection": collection, "model": model, "mode": mode, "k": k, "lam": lam,
            "direction": d, **{f"R@{kk}": mean([m[f"R@{kk}"] for m in per_dir[d]]) for kk in (1, 5, 10)},
            "mR": m_r, "queries": int(round(mean([m["queries"] for m in per_dir[d]]))),
            "collection_size": collection_size, **timing, "ce_pairs": int(round(pairs)) if pairs else "",
            "split": split or "", **ctx.env(), "measured": True, "rankings": ";".join(rankings),
            "notes": "; ".join(notes),
        })
    return rows


def skipped_row(ctx: SuiteContext, suite: str, collection: str, model: str, mode: str, k, reason: str,
                collection_size: int, split: Optional[str]) -> dict:
    return {"suite": suite, "collection": collection, "model": model, "mode": mode, "k": k, "direction": "both",
            "collection_size": collection_size, "split": split or "", **ctx.env(), "measured": False,
            "notes": str(reason)}


# ------------------------------------------------------------------------------------------ running
def subsample_queries(pool: Pool, gold: tuple, max_queries: Optional[int], seed: int
                      ) -> tuple[Optional[np.ndarray], Optional[np.ndarray], list[str]]:
    """Seeded per-direction query subsets when ``max_queries`` caps them (same subset for every row of a
    task, so rows stay comparable); None = all queries."""
    if not max_queries:
        return None, None, []
    cap2img, img2caps = gold
    caps = np.array([c for c in pool.captions["caption_id"].to_numpy(np.int64).tolist() if c in cap2img])
    imgs = np.array([i for i in pool.images.item_ids.tolist() if i in img2caps])
    rng = np.random.default_rng(seed)
    notes = []
    if len(caps) > max_queries:
        caps = np.sort(rng.choice(caps, max_queries, replace=False))
        notes.append(f"t2i queries: seeded sample of {max_queries} (--max-queries)")
    if len(imgs) > max_queries:
        imgs = np.sort(rng.choice(imgs, max_queries, replace=False))
        notes.append(f"i2t queries: seeded sample of {max_queries} (--max-queries)")
    return caps.astype(np.int64), imgs.astype(np.int64), notes


def run_setting(ctx: SuiteContext, suite: str, label: str, family: str, method: str, *,
                pools: Sequence[tuple[Pool, tuple]], k=STANDARD_K, mode: str = "ce", lam: float = 0.0,
                directions: Sequence[str] = DIRECTIONS, split: Optional[str] = "test",
                queries: Optional[Sequence[tuple]] = None, notes: Iterable[str] = ()) -> list[dict]:
    """Evaluate one (family, method, k, λ) on one pool (or the mean over several folds) -> CSV rows."""
    be, ce = ctx.models.pair(family)
    exhaustive = method == CE
    emb = method == EMB
    mode_label = CE if exhaustive else MODE_LABELS["emb" if emb else mode]
    k_col = "all" if exhaustive else ("" if emb else k)
    lam_col = lam if mode in ("add", "norm_add") and not emb else ""
    size = len(pools[0][0].images)
    notes = list(notes)
    if not emb and not exhaustive and k > size:
        notes.append(f"k={k} exceeds the {size}-image pool: the whole pool is reranked")
    results, paths = [], []
    ctx.log(f"{suite}: {label} {family}+{mode_label} k={k_col} lam={lam_col} ({len(pools)} pool(s) of {size} images)")
    for f, (pool, gold) in enumerate(pools):
        t2i_q, i2t_q = queries[f] if queries else (None, None)
        try:
            res = evaluate_collection(be, None if emb else ce, pool, gold, mode="emb" if emb else mode, k=k,
                                      lam=lam, directions=directions, index_factory=ctx.index_factory,
                                      batch_size=ctx.batch_size, cache=ctx.cache, t2i_queries=t2i_q,
                                      i2t_queries=i2t_q, exhaustive=exhaustive, ce_pair_budget=ctx.ce_pair_budget,
                                      device=ctx.device, progress=ctx.progress)
        except SkipRow as why:
            ctx.log(f"  {why}")
            return [skipped_row(ctx, suite, label, family, mode_label, k_col, str(why), size, split)]
        results.append(res)
        slug = _slug(label, family, mode_label, f"k{k_col}", f"lam{lam_col}" if lam_col != "" else "",
                     f"fold{f}" if len(pools) > 1 else "")
        paths.append(save_rankings(ctx, suite, slug, res.rankings))
    rows = make_rows(ctx, suite, label, family, mode_label, k_col, lam_col, results, directions, size, split,
                     paths, notes)
    for r in rows:
        ctx.log(f"  {r['direction']}: R@1 {r['R@1']:.1f} R@5 {r['R@5']:.1f} R@10 {r['R@10']:.1f} "
                f"mR {r['mR']:.1f} ({r['queries']} queries, {r['wall_s']:.1f}s)")
    return rows


def _load_task_pool(task: Task) -> tuple[Pool, tuple, int]:
    """(pool, task gold, number of distractor images) of a task."""
    images, caps = task.source.load(task.collection, task.split)
    if len(images) == 0 or len(caps) == 0:
        raise ValueError(f"{task.label}: collection {task.collection!r} split {task.split!r} is empty")
    gold = gold_of(caps)
    if not task.distractors:
        return Pool(images, caps), gold, 0
    imgs, capss = [images], [caps]
    for d in task.distractors:
        di, dc = task.source.load(d, task.distractor_split)
        imgs.append(di)
        capss.append(dc)
    n_dis = sum(len(t) for t in imgs[1:])
    return Pool(concat_images(imgs), pd.concat(capss, ignore_index=True)), gold, n_dis


def _folds(pool: Pool, n_folds: int, fold_size: int) -> list[tuple[Pool, tuple]]:
    """The COCO 1k protocol: consecutive blocks of fold_size images (here in item_id order) with their
    captions, each evaluated on its own."""
    order = np.argsort(pool.images.item_ids, kind="stable")
    out = []
    for f in range(n_folds):
        pos = order[f * fold_size:(f + 1) * fold_size]
        if len(pos) < fold_size:
            break
        imgs = pool.images.take(pos)
        caps = pool.captions[pool.captions["image_item_id"].isin(imgs.item_ids.tolist())].reset_index(drop=True)
        out.append((Pool(imgs, caps), gold_of(caps)))
    return out


# -------------------------------------------------------------------------------------------- suites
def standard(ctx: SuiteContext, tasks: Sequence[Task], k: int = STANDARD_K) -> list[dict]:
    """Table 1: EMB (SEP's BE, JOIN), SEP+CO, JOIN+CO and exhaustive CE (when under the pair budget), both
    directions, on each task's full test set and, for tasks with folds, the mean over its 1k folds."""
    rows = []
    for task in tasks:
        pool, gold, _ = _load_task_pool(task)
        variants = [(task.label, [(pool, gold)], [])]
        if task.folds:
            folds = _folds(pool, task.folds, task.fold_size)
            if folds:
                variants.append((f"{task.label}/1k" if task.fold_size == COCO_1K_SIZE else
                                 f"{task.label}/{task.fold_size}", folds,
                                 [f"mean over {len(folds)} folds of {task.fold_size} images (the standard COCO 1k "
                                  f"protocol; folds = consecutive blocks in item_id order); times are per fold"]))
        for label, pools, notes in variants:
            # folds share the query cap, so the mean over folds costs what the full-set row costs
            cap = -(-ctx.max_queries // len(pools)) if ctx.max_queries else None
            qs = [subsample_queries(p, g, cap, ctx.seed + f) for f, (p, g) in enumerate(pools)]
            queries = [(a, b) for a, b, _ in qs]
            notes = notes + qs[0][2]
            for family in ctx.families():
                for method in (EMB, CO, CE):
                    rows += run_setting(ctx, "standard", label, family, method, pools=pools, k=k, split=task.split,
                                        queries=queries, notes=notes)
    return rows


def distractor(ctx: SuiteContext, tasks: Sequence[Task], k: int = STANDARD_K) -> list[dict]:
    """Table 5: each task's queries and gold unchanged, pools enlarged with the other collections' images
    AND captions."""
    rows = []
    for task in tasks:
        pool, gold, n_dis = _load_task_pool(task)
        t2i, i2t, qnotes = subsample_queries(pool, gold, ctx.max_queries, ctx.seed)
        notes = [f"queries+gold of {task.collection}; pool adds {n_dis} images and their captions from "
                 f"{', '.join(task.distractors)} as distractors"] + qnotes
        for family in ctx.families():
            for method in (EMB, CO):
                rows += run_setting(ctx, "distractor_20k", task.label, family, method, pools=[(pool, gold)], k=k,
                                    split=task.split, queries=[(t2i, i2t)], notes=notes)
    return rows


def scale(ctx: SuiteContext, task: Task, num_queries: int = 5000, k: int = STANDARD_K) -> list[dict]:
    """The 100k setting: every image of the collection indexed; t2i queries = one caption each of a seeded
    subset of ``num_queries`` images (LightningDOT's "full" setting is t2i too). CO measured end to end."""
    pool, gold, _ = _load_task_pool(task)
    rng = np.random.default_rng(ctx.seed)
    with_caps = np.array(sorted(gold[1]), dtype=np.int64)
    chosen = rng.choice(with_caps, min(num_queries, len(with_caps)), replace=False)
    t2i = np.array(sorted(min(gold[1][int(i)]) for i in chosen), dtype=np.int64)  # smallest caption id each
    # t2i only: the caption pool needs just the query captions (no i2t index over every caption).
    qcaps = pool.captions[pool.captions["caption_id"].isin(t2i.tolist())].reset_index(drop=True)
    qpool = Pool(pool.images, qcaps)
    notes = [f"t2i only: {len(t2i)} queries (one caption each of a seeded {len(t2i)}-image subset) against "
             f"all {len(pool.images)} images; measured end to end, encoding included"]
    rows = []
    for family in ctx.families():
        for method in (EMB, CO):
            rows += run_setting(ctx, "scale_100k", task.label, family, method, pools=[(qpool, gold)], k=k,
                                directions=(DIRECTION_T2I,), split=task.split, queries=[(t2i, None)], notes=notes)
    return rows


def k_ablation(ctx: SuiteContext, tasks: Sequence[Task], ks: Sequence[int] = (10, 20, 50)) -> list[dict]:
    """Table 8: SEP+CO and JOIN+CO reranking the top-k for k in ``ks`` (CE scores cached across k)."""
    rows = []
    for task in tasks:
        pool, gold, _ = _load_task_pool(task)
        t2i, i2t, notes = subsample_queries(pool, gold, ctx.max_queries, ctx.seed)
        for family in ctx.families():
            for k in sorted(ks, reverse=True):  # largest k first: smaller k reuse its CE scores
                rows += run_setting(ctx, "k_ablation", task.label, family, CO, pools=[(pool, gold)], k=k,
                                    split=task.split, queries=[(t2i, i2t)], notes=notes)
    return rows


def combination(ctx: SuiteContext, tasks: Sequence[Task], lams: Sequence[float] = (0.1, 0.5, 0.9),
                k: int = STANDARD_K) -> list[dict]:
    """Table 11: pure CE rerank vs ADD_λ and NORM_ADD_λ fusion of BE and CE scores."""
    rows = []
    for task in tasks:
        pool, gold, _ = _load_task_pool(task)
        t2i, i2t, notes = subsample_queries(pool, gold, ctx.max_queries, ctx.seed)
        for family in ctx.families():
            settings = [("ce", 0.0)] + [(m, lam) for m in ("add", "norm_add") for lam in lams]
            for mode, lam in settings:
                rows += run_setting(ctx, "combination", task.label, family, CO, pools=[(pool, gold)], k=k,
                                    mode=mode, lam=lam, split=task.split, queries=[(t2i, i2t)], notes=notes)
    return rows


def baseline(ctx: SuiteContext, tasks: Sequence[Task], baseline_ref: ModelRef, baseline_notes: str = ""
             ) -> list[dict]:
    """The training-free mapped baseline as an EMB row, beside the trained EMB rows for reference."""
    rows = []
    for task in tasks:
        pool, gold, _ = _load_task_pool(task)
        t2i, i2t, notes = subsample_queries(pool, gold, ctx.max_queries, ctx.seed)
        ctx.log(f"baseline: {task.label} {baseline_ref.label} EMB")
        res = evaluate_collection(baseline_ref, None, pool, gold, mode="emb", directions=DIRECTIONS,
                                  index_factory=ctx.index_factory, batch_size=ctx.batch_size, cache=ctx.cache,
                                  t2i_queries=t2i, i2t_queries=i2t, device=ctx.device, progress=ctx.progress)
        path = save_rankings(ctx, "baseline", _slug(task.label, baseline_ref.label, EMB), res.rankings)
        rows += make_rows(ctx, "baseline", task.label, baseline_ref.label, EMB, "", "", [res], DIRECTIONS,
                          len(pool.images), task.split, [path], notes + ([baseline_notes] if baseline_notes else []))
        for family in ctx.families():
            rows += run_setting(ctx, "baseline", task.label, family, EMB, pools=[(pool, gold)], split=task.split,
                                queries=[(t2i, i2t)], notes=notes)
    return rows

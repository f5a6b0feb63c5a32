"""Which queries a benchmark run ranks, and which items its pools hold: ``python -m benchmarks.queries``.

    python -m benchmarks.queries --staged S --collection C --output DIR [--max-queries 500] [--seed 0]
    python -m benchmarks.queries ... --fold 2 --folds 5 --fold-size 1000     # the COCO 1k protocol
    python -m benchmarks.queries ... --scale 5000                          # the 100k setting

Writes into DIR:
  queries.parquet       columns direction ("t2i"/"i2t"), query_id (int64): ``pipelines.rerank --queries``
  image_ids.parquet     column item_id: ``pipelines.build_index --modality image --ids`` (folds only)
  caption_ids.parquet   column item_id: ``pipelines.build_index --modality text --ids`` (folds only)
  selection.json        what was selected and how (written last: the job's manifest)

Selections (all seeded, ids sorted; only ids are read, shard by shard, never features or texts):
  sample  every caption (t2i) and image (i2t) of the collection's split, or a seeded sample of at most
          --max-queries per direction (the same sample the in-process suites drew: captions first, then
          images, from one numpy Generator(seed) over the sorted ids);
  fold    images [f * size, (f + 1) * size) in item_id order and their captions; queries sampled within the
          fold (at most --max-queries per direction, seed + f);
  scale   a seeded subset of N images: i2t queries = those images, t2i queries = the smallest caption id
          of each (one caption per image).
"""
from __future__ import annotations

import io
import os
from dataclasses import asdict, dataclass
from typing import Optional

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.files import BEAM_FILES, write_atomic, write_json_atomic
from retrieval_core.cli import CONTEXT_SETTINGS, CheckedPlan, cli_errors, option, plan_from_cli, plan_options
from retrieval_core.data import schema
from retrieval_core.data.schema import DIRECTION_I2T, DIRECTION_T2I
from retrieval_core.data.store import StagedDataset
from retrieval_core.errors import UsageFault

QUERIES_FILE = "queries.parquet"
IMAGE_IDS_FILE = "image_ids.parquet"
CAPTION_IDS_FILE = "caption_ids.parquet"
SELECTION_FILE = "selection.json"
ITEM_ID = "item_id"


def staged_ids(staged: str, collection: str, split: Optional[str], lang: Optional[str] = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image ids, caption ids, the caption's image ids) of one collection and split (captions of ``lang`` only
    when given), sorted by id; read one shard at a time, id columns only."""
    ds = StagedDataset(staged, files=BEAM_FILES)
    imgs = [ds.read_shard_columns(s, [ITEM_ID], split).column(ITEM_ID).to_numpy()
            for s in ds.shard_names("images", collection)]
    caps = [ds.read_shard_columns(s, ["caption_id", "image_item_id", "lang"], split)
            for s in ds.shard_names("captions", collection)]
    if lang is not None:
        caps = [c.filter(pc.equal(c.column("lang"), lang)) for c in caps]
    img = np.sort(np.concatenate(imgs).astype(np.int64)) if imgs else np.zeros(0, np.int64)
    cap = np.concatenate([c.column("caption_id").to_numpy() for c in caps]).astype(np.int64) if caps else \
        np.zeros(0, np.int64)
    cap_img = np.concatenate([c.column("image_item_id").to_numpy() for c in caps]).astype(np.int64) if caps else \
        np.zeros(0, np.int64)
    order = np.argsort(cap, kind="stable")
    return img, cap[order], cap_img[order]


def sample(captions: np.ndarray, images: np.ndarray, max_queries: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_queries`` of each (0 = all), drawn from one Generator: captions first, then images."""
    rng = np.random.default_rng(seed)
    if max_queries and len(captions) > max_queries:
        captions = np.sort(rng.choice(captions, max_queries, replace=False))
    if max_queries and len(images) > max_queries:
        images = np.sort(rng.choice(images, max_queries, replace=False))
    return captions, images


def select(staged: str, collection: str, split: Optional[str], *, max_queries: int = 0, seed: int = 0,
           fold: Optional[int] = None, folds: int = 0, fold_size: int = 0, scale: int = 0,
           lang: Optional[str] = None) -> dict:
    """The selection as arrays: {"t2i", "i2t", "image_ids"?, "caption_ids"?} plus "pool_images" and notes.
    ``lang``: captions of that language only, as queries and as the i2t pool (``caption_ids``)."""
    img, cap, cap_img = staged_ids(staged, collection, split, lang)
    if len(img) == 0 or len(cap) == 0:
        raise ValueError(f"collection {collection!r} split {split!r} of {staged} has no images or no captions"
                         + (f" in language {lang!r}" if lang else ""))
    out: dict = {"notes": []}
    if fold is not None:
        if not 0 <= fold < folds or fold_size < 1:
            raise UsageFault(f"--fold {fold} must be in [0, --folds {folds}) with --fold-size >= 1")
        if (fold + 1) * fold_size > len(img):
            raise ValueError(f"fold {fold} needs images up to {(fold + 1) * fold_size}; {collection} has {len(img)}")
        pool = img[fold * fold_size:(fold + 1) * fold_size]
        in_fold = np.isin(cap_img, pool)
        out["image_ids"], out["caption_ids"] = pool, cap[in_fold]
        out["t2i"], out["i2t"] = sample(cap[in_fold], pool, max_queries, seed + fold)
        out["pool_images"] = len(pool)
        out["notes"].append(f"fold {fold} of {folds}: images {fold * fold_size}..{(fold + 1) * fold_size - 1} "
                            f"in item_id order and their {int(in_fold.sum())} captions")
    elif scale:
        # cap is sorted, so an image's first position in cap_img holds its smallest caption id (vectorised: a
        # dict over every caption grew this job's peak RSS by ~27 MiB from 100k to 200k captions)
        has_caps, first = np.unique(cap_img, return_index=True)
        rng = np.random.default_rng(seed)
        chosen = rng.choice(has_caps, min(scale, len(has_caps)), replace=False)
        out["t2i"] = np.sort(cap[first[np.searchsorted(has_caps, chosen)]])
        out["i2t"] = np.sort(chosen.astype(np.int64))
        out["pool_images"] = len(img)
        out["notes"].append(f"{len(chosen)} queries per direction: a seeded {len(chosen)}-image subset (i2t) and "
                            f"one caption of each (t2i), against all {len(img)} images / {len(cap)} captions")
    else:
        out["t2i"], out["i2t"] = sample(cap, img, max_queries, seed)
        out["pool_images"] = len(img)
    if lang is not None:
        out.setdefault("image_ids", img)
        out.setdefault("caption_ids", cap)
        out["notes"].append(f"captions in {lang!r} only: {len(out['caption_ids'])} as t2i queries and i2t pool")
    pools = ((DIRECTION_T2I, len(out.get("caption_ids", cap))), (DIRECTION_I2T, len(out.get("image_ids", img))))
    for d, pool_n in pools:
        if not scale and len(out[d]) < pool_n:
            out["notes"].append(f"{d} queries: seeded sample of {len(out[d])} of {pool_n} (--max-queries)")
    return out


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_selection(output: str, sel: dict, params: dict) -> dict:
    q = pa.table({"direction": pa.array([DIRECTION_T2I] * len(sel["t2i"]) + [DIRECTION_I2T] * len(sel["i2t"]),
                                        pa.string()),
                  "query_id": pa.array(np.concatenate([sel["t2i"], sel["i2t"]]), pa.int64())})
    write_atomic(os.path.join(output, QUERIES_FILE), _parquet_bytes(q))
    files = {"queries": QUERIES_FILE}
    for key, name in (("image_ids", IMAGE_IDS_FILE), ("caption_ids", CAPTION_IDS_FILE)):
        if key in sel:
            ids = pa.table({ITEM_ID: pa.array(sel[key], pa.int64())})
            write_atomic(os.path.join(output, name), _parquet_bytes(ids))
            files[key] = name
    info = {"params": params, "files": files,
            "queries": {DIRECTION_T2I: len(sel["t2i"]), DIRECTION_I2T: len(sel["i2t"])},
            "pool_images": int(sel["pool_images"]),
            "pool_captions": int(len(sel["caption_ids"])) if "caption_ids" in sel else None,
            "notes": sel["notes"], "schema_version": schema.SCHEMA_VERSION}
    write_json_atomic(os.path.join(output, SELECTION_FILE), info)
    return info


@dataclass(frozen=True)
class QueriesPlan(CheckedPlan):
    """One selection: the queries (and fold pools) of a collection's split, written to ``output``."""
    staged: str = option(help="staged directory (pipelines.stage output)")
    collection: str = option(help="collection whose queries (and fold pools) are selected")
    output: str = option(help="folder for queries.parquet (+ id files) and selection.json")
    split: str = option("test")
    max_queries: int = option(0, type=click.IntRange(min=0),
                              help="seeded sample of at most this many queries per direction; 0 = all")
    seed: int = option(0)
    fold: Optional[int] = option(None, type=click.IntRange(min=0), help="select fold F (with --folds, --fold-size)")
    folds: int = option(0, type=click.IntRange(min=0))
    fold_size: int = option(0, type=click.IntRange(min=0))
    scale: int = option(0, type=click.IntRange(min=0), help="N queries per direction: N seeded images and one "
                                                            "caption of each")
    lang: Optional[str] = option(None, help="captions of this language only (lang column), as t2i queries and as "
                                            "the caption pool an index --ids file gets")

    def __post_init__(self):
        super().__post_init__()
        if self.fold is not None and self.scale:
            raise ValueError("--fold and --scale exclude each other")


@click.command(context_settings=CONTEXT_SETTINGS)
@plan_options(QueriesPlan)
def main(**values):
    """Write the queries file (and fold id files) a benchmark's rerank and build_index jobs read."""
    with cli_errors():
        plan = plan_from_cli(QueriesPlan, values)
        sel = select(plan.staged, plan.collection, plan.split, max_queries=plan.max_queries, seed=plan.seed,
                     fold=plan.fold, folds=plan.folds, fold_size=plan.fold_size, scale=plan.scale, lang=plan.lang)
        info = write_selection(plan.output, sel, asdict(plan))
    click.echo(f"selected {info['queries']} queries (pool {info['pool_images']} images) -> {plan.output}")


if __name__ == "__main__":
    main()

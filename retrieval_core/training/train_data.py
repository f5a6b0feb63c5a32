"""What the trainer reads: the captions and images of a split (:class:`TrainData`, :func:`load_split`), each
image's nearest images by region features (:func:`feature_neighbours`) and the bi-encoder's own near misses
(:func:`mine_be_negatives`), the CE negatives of ``losses.sample_ce_groups``; and where a split's regions come from
(:func:`choose_train_source`): streamed from the staged folder's region file (``data.region_file``), or one
in-memory table."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from retrieval_core.data.region_file import RegionFile, StreamedImages, mean_region_feature
from retrieval_core.data.schema import ImageReader
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.search import exact
from retrieval_core.training.losses import MinedNegatives

#: Where a run's regions come from (--train-source): ``auto`` applies choose_train_source's rule.
TRAIN_SOURCES = ("auto", "streamed", "memory")
#: auto keeps the regions in memory only when their float32 table would take at most this share of the memory
#: available: the model, its activations and AdamW's state need the rest, and a table near the limit swaps or is
#: killed rather than merely slow.
IN_MEMORY_SHARE = 0.25
#: The streamed source's step rate over the in-memory table's on the demo data (same batches; interleaved
#: repetitions; docs/results/train_source.csv, docs/log/TRAINING-2026-11.md "Training memory"): the lowest of the
#: measured settings (demo fp32 1.03, bench fp32 1.08, demo bf16 1.11), the one most in the table's favour.
STREAMED_RELATIVE_RATE = 1.03
#: auto picks the in-memory table only when it was measured this much faster (beyond the repetitions' spread).
MEMORY_FASTER_BY = 1.02


def choose_train_source(requested: str, table_bytes: int, available: Optional[int]) -> tuple[str, str]:
    """(source, why) of a run: "streamed" (regions read by position from the staged folder's region file) or
    "memory" (one float32 table of the splits' regions, ``table_bytes``). The rule, in one place: streamed unless
    the table fits (at most IN_MEMORY_SHARE of ``available``) AND the in-memory table was measured faster
    (1 / STREAMED_RELATIVE_RATE >= MEMORY_FASTER_BY). Why: memory that training does not need is memory a larger
    collection or batch can use, and only a measured gain would pay for holding it."""
    if requested not in TRAIN_SOURCES:
        raise ValueError(f"train source must be one of {'|'.join(TRAIN_SOURCES)}, got {requested!r}")
    gb = f"{table_bytes / 1e9:.2f} GB"
    if requested != "auto":
        return requested, f"asked for; the in-memory table would take {gb}"
    fits = available is not None and table_bytes <= IN_MEMORY_SHARE * available
    faster = 1.0 / STREAMED_RELATIVE_RATE >= MEMORY_FASTER_BY
    room = f"{gb} of {available / 1e9:.1f} GB available" if available is not None else f"{gb}, memory unknown"
    if fits and faster:
        return "memory", f"the table fits ({room}) and was measured {1 / STREAMED_RELATIVE_RATE:.2f}x faster"
    return "streamed", (f"the in-memory table ({room}) " + ("would not be faster: streamed measured "
                                                             f"{STREAMED_RELATIVE_RATE:.2f}x its step rate"
                                                             if fits else f"is over {IN_MEMORY_SHARE:.0%} of it"))


class TrainData:
    """Captions (schema.CAPTION_COLUMNS; caption_id, image_item_id, text used) + their images: an ImageTable, or
    StreamedImages read from the region file by position (the same positions, regions and counts)."""

    def __init__(self, captions: pd.DataFrame, images: ImageReader):
        if len(captions) == 0:
            raise ValueError("no captions to train/evaluate on")
        pos = images.position_of()
        img_ids = captions["image_item_id"].to_numpy(np.int64)
        missing = sorted({int(i) for i in img_ids if int(i) not in pos})
        if missing:
            raise ValueError(f"{len(missing)} caption image(s) are not in the image table, e.g. {missing[:5]}")
        self.texts: list[str] = captions["text"].astype(str).tolist()
        self.caption_ids = captions["caption_id"].to_numpy(np.int64)
        self.image_pos = np.array([pos[int(i)] for i in img_ids], dtype=np.int64)
        self.images = images

    def __len__(self) -> int:
        return len(self.texts)

    def gold(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        cap2img = {int(c): int(self.images.item_ids[p]) for c, p in zip(self.caption_ids, self.image_pos)}
        img2caps: dict[int, list[int]] = {}
        for c, i in cap2img.items():
            img2caps.setdefault(i, []).append(c)
        return cap2img, img2caps


def pooled_features(images: ImageReader, positions: Sequence[int], max_regions: Optional[int] = None) -> np.ndarray:
    """(n, F) float32: the mean of the first ``max_regions`` (None: all staged) region features of each image at
    ``positions``; streamed images read their stored means (small: n x F), never their regions, for None."""
    positions = np.asarray(positions, dtype=np.int64)
    if isinstance(images, StreamedImages):
        if max_regions is None:
            return images.pooled(positions)
        if max_regions > images.max_regions and np.any(images.num_boxes()[positions] > images.max_regions):
            raise ValueError(f"pooling {max_regions} regions of images whose region file keeps {images.max_regions}")
    return np.stack([mean_region_feature(images.regions(int(p))[0][:max_regions]) for p in positions])


def feature_neighbours(images: ImageReader, k: int, max_regions: Optional[int] = None,
                       positions: Optional[np.ndarray] = None) -> np.ndarray:
    """(n, k) positions (into ``positions``, default all images) of each image's k nearest other images by
    cosine of the centred mean of its first ``max_regions`` region features - no model needed. Exact faiss
    inner-product search, O(n^2 F): seconds for tens of thousands of images; memory: the n x F pooled vectors
    (twice: faiss keeps its own copy), never the regions of streamed images."""
    import faiss

    positions = np.arange(len(images)) if positions is None else np.asarray(positions, dtype=np.int64)
    if len(positions) < 2:
        raise ValueError("neighbours need at least 2 images")
    k = min(k, len(positions) - 1)
    pooled = pooled_features(images, positions, max_regions)
    pooled -= pooled.mean(0)  # region features are post-ReLU: without centring every pair looks alike
    pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    index = faiss.IndexFlatIP(pooled.shape[1])
    index.add(pooled)
    _, nn = index.search(pooled, k + 1)
    out = np.empty((len(positions), k), dtype=np.int64)
    for i, row in enumerate(nn):
        row = row[(row != i) & (row >= 0)]  # drop self (ties with exact duplicates may put it anywhere)
        out[i] = row[:k] if len(row) >= k else np.resize(row, k)
    return out


def mine_be_negatives(model: VLRetrievalModel, data: TrainData, caption_pos: np.ndarray, k: int, pool_size: int,
                      seed: int, batch_size: int = 128, device: str = "cpu") -> tuple[MinedNegatives, dict]:
    """The BE's top-k wrong images of each caption in ``caption_pos`` (among every training image with a
    caption) and its top-k wrong captions of each of their gold images (among a pool: ``caption_pos`` plus a
    seeded sample of the other captions, ``pool_size`` in all). Returns the negatives and a log record (the
    BE's R@1 on these captions, seconds)."""
    t0 = time.perf_counter()
    caption_pos = np.unique(np.asarray(caption_pos, dtype=np.int64))
    img_pos = np.unique(data.image_pos)
    rest = np.setdiff1d(np.arange(len(data)), caption_pos)
    fill = max(0, min(pool_size - len(caption_pos), len(rest)))
    pool = np.union1d(caption_pos, np.random.default_rng([seed, 13]).choice(rest, fill, replace=False))
    was_training = model.training
    model.eval()
    img_emb = model.encode_image(data.images.take(img_pos), batch_size, device)
    txt_emb = model.encode_text([data.texts[i] for i in pool], batch_size, device)
    model.train(was_training)
    depth_i, depth_c = min(k + 1, len(img_pos)), min(k + 5 * 2, len(pool))  # room for the gold item(s) dropped
    _, t2i = exact.exact_topk(txt_emb[np.searchsorted(pool, caption_pos)], img_emb, img_pos, depth_i)
    gold = data.image_pos[caption_pos]
    caption_images = np.full((len(caption_pos), k), -1, dtype=np.int64)
    for row, (top, g) in enumerate(zip(t2i, gold)):
        wrong = top[top != g][:k]
        caption_images[row, :len(wrong)] = wrong
    gold_images = np.unique(gold)
    _, i2t = exact.exact_topk(img_emb[np.searchsorted(img_pos, gold_images)], txt_emb, pool, depth_c)
    image_captions = np.full((len(gold_images), k), -1, dtype=np.int64)
    for row, (top, g) in enumerate(zip(i2t, gold_images)):
        wrong = top[data.image_pos[top] != g][:k]
        image_captions[row, :len(wrong)] = wrong
    # a short row (tiny sets) repeats its entries so that every draw is a real negative
    for rows in (caption_images, image_captions):
        for row in rows:
            n = int((row >= 0).sum())
            if 0 < n < k:
                row[n:] = np.resize(row[:n], k - n)
    record = {"mined_captions": int(len(caption_pos)), "caption_pool": int(len(pool)),
              "be_t2i_R@1": round(float(np.mean(t2i[:, 0] == gold)) * 100.0, 2),
              "seconds": round(time.perf_counter() - t0, 3)}
    return MinedNegatives(caption_pos, caption_images, gold_images, image_captions), record


def load_split(staged, split: str, max_captions: Optional[int] = None, seed: int = 0,
               languages: tuple[str, ...] = (), regions: Optional[RegionFile] = None) -> TrainData:
    """The captions of ``split`` (only those of ``languages`` when given) and their images: read from
    ``regions`` (the staged folder's region file) by position when given, else loaded into one table."""
    captions = staged.captions(split=split)
    if languages:
        captions = captions[captions["lang"].isin(languages)].reset_index(drop=True)
    if len(captions) == 0:
        raise ValueError(f"the staged data has no captions in split {split!r}"
                         + (f" in language(s) {', '.join(languages)}" if languages else ""))
    if max_captions is not None and len(captions) > max_captions:
        keep = np.sort(np.random.default_rng([seed, 7]).choice(len(captions), max_captions, replace=False))
        captions = captions.iloc[keep].reset_index(drop=True)
    image_ids = np.unique(captions["image_item_id"].to_numpy(np.int64))
    return TrainData(captions, staged.load_images(item_ids=image_ids) if regions is None else
                     regions.images(image_ids))

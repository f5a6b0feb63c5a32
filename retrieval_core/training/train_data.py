"""What the trainer reads: the captions and images of a split (:class:`TrainData`, :func:`load_split`), each
image's nearest images by region features (:func:`feature_neighbours`) and the bi-encoder's own near misses
(:func:`mine_be_negatives`), the CE negatives of ``losses.sample_ce_groups``."""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import pandas as pd

from retrieval_core.data.schema import ImageTable
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.search import exact
from retrieval_core.training.losses import MinedNegatives


class TrainData:
    """Captions (schema.CAPTION_COLUMNS; caption_id, image_item_id, text used) + the ImageTable of their images."""

    def __init__(self, captions: pd.DataFrame, images: ImageTable):
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


def feature_neighbours(images: ImageTable, k: int, max_regions: Optional[int] = None,
                       positions: Optional[np.ndarray] = None) -> np.ndarray:
    """(n, k) positions (into ``positions``, default all images) of each image's k nearest other images by
    cosine of the centred mean of its first ``max_regions`` region features - no model needed. Exact faiss
    inner-product search, O(n^2 F): seconds for tens of thousands of images."""
    import faiss

    positions = np.arange(len(images)) if positions is None else np.asarray(positions, dtype=np.int64)
    if len(positions) < 2:
        raise ValueError("neighbours need at least 2 images")
    k = min(k, len(positions) - 1)
    pooled = np.stack([images.regions(int(p))[0][:max_regions].mean(0) for p in positions]).astype(np.float32)
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
               languages: tuple[str, ...] = ()) -> TrainData:
    """The captions of ``split`` (only those of ``languages`` when given) and their images."""
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
    return TrainData(captions, staged.load_images(item_ids=image_ids))

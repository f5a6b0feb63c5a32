"""Validate and normalise raw records into staged rows, resolve duplicates and summarise a source (plain library,
no Beam).

One record in, one outcome out: :func:`stage_image` / :func:`stage_caption` return either a staged row
(a dict keyed by ``schema.IMAGE_COLUMNS`` / ``schema.CAPTION_COLUMNS`` plus a few private ``_``-prefixed
bookkeeping keys) or a :class:`schema.Reject` that says why. Nothing is dropped silently.

Every reject reason starts with a fixed category followed by ``": "`` and the specifics, so the summary
can count reasons by category (:func:`reason_category`). The staged rows are written as shards by
``data.shards`` (through the per-task ``data.spill`` in the staging pipeline).
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Iterable, Optional

import numpy as np

from . import schema
from .schema import RawCaption, RawImage, Reject

# Boxes may poke slightly outside the image (detectors round to the pixel grid): tolerate this fraction of
# the image size, then clip to [0, 1].
BOX_TOLERANCE = 0.02

POLICY_CONFIDENCE = "confidence"  # kept the max_regions most confident regions, in confidence order
POLICY_STORED_ORDER = "stored_order"  # no confidences: kept the first max_regions in file order

# Reason categories (the text before ": " in Reject.reason).
R_NUM_BOXES = "num_boxes mismatch"
R_ROW_MISMATCH = "features/boxes row mismatch"
R_FEATURE_DIM = "wrong feature dim"
R_NOT_FINITE = "non-finite values"
R_NO_REGIONS = "zero regions"
R_NO_SIZE = "pixel boxes without image size"
R_BAD_BOX = "box outside image"
R_BAD_SHAPE = "bad array shape"
R_BAD_CONF = "bad confidences"
R_DUPLICATE = "duplicate image id"
R_DUPLICATE_CAPTION = "duplicate caption id"
R_ID_COLLISION = "item_id hash collision"
R_NOT_UTF8 = "caption not UTF-8"
R_EMPTY_CAPTION = "empty caption"
R_SPLIT_CONFLICT = "captions in several splits"
#: Decided by the caption/image join in the pipeline.
R_UNKNOWN_IMAGE = "caption's image not staged"
REASON_UNKNOWN_IMAGE = R_UNKNOWN_IMAGE + ": image {image_source_id!r} of collection {collection!r} is " \
                                         "unknown or was rejected"

# Private row keys (not columns): where the row came from and which region-cap policy applied.
K_SOURCE = "_source"
K_LOCATOR = "_locator"
K_CAP_POLICY = "_cap_policy"  # None when the image had <= max_regions regions
K_REGIONS_IN = "_regions_in"  # region count before the cap


def reason_category(reason: str) -> str:
    """The fixed part of a reject reason, for the summary's histogram: our own reasons' category (the text
    before ": "); for reader reasons the text before the first parenthesis (which holds the specifics)."""
    head = reason.split(": ", 1)[0]
    if len(head) <= 40 and head != reason:
        return head
    return reason.split(" (", 1)[0].strip()[:80]


def _reject(source: str, locator: str, kind: str, category: str, detail: str) -> Reject:
    return Reject(source=source, locator=locator, reason=f"{category}: {detail}", kind=kind)


# ------------------------------------------------------------------------------------------ images
def _normalise_boxes(raw: RawImage, boxes: np.ndarray) -> tuple[Optional[np.ndarray], str, str]:
    """(normalised (n,6) boxes, "", "") or (None, reason category, detail)."""
    n = boxes.shape[0]
    if raw.box_format == "xyxy":
        if boxes.shape[1] != 4:
            return None, R_BAD_SHAPE, f"xyxy boxes must have 4 columns, got {boxes.shape[1]}"
        w, h = int(raw.image_w or 0), int(raw.image_h or 0)
        if w <= 0 or h <= 0:
            return None, R_NO_SIZE, f"image size {w}x{h} is unknown, cannot normalise pixel boxes"
        xyxy = boxes.astype(np.float64) / np.array([w, h, w, h], dtype=np.float64)
    elif raw.box_format in ("normalized6", "normalized7"):
        if boxes.shape[1] not in (6, 7):
            return None, R_BAD_SHAPE, f"normalised boxes must have 6 (or UNITER's 7) columns, got {boxes.shape[1]}"
        xyxy = boxes[:, :4].astype(np.float64)  # a 7th column (UNITER's area w*h) is dropped
    else:
        return None, R_BAD_SHAPE, f"unknown box_format {raw.box_format!r}"
    x1, y1, x2, y2 = xyxy.T
    lo, hi = -BOX_TOLERANCE, 1.0 + BOX_TOLERANCE
    outside = (xyxy < lo) | (xyxy > hi)
    inverted = (x2 < x1) | (y2 < y1)
    bad = outside.any(axis=1) | inverted
    if bad.any():
        i = int(np.argmax(bad))
        return None, R_BAD_BOX, (f"{int(bad.sum())} of {n} boxes are outside the image or have x2<x1/y2<y1 "
                                 f"(first: region {i}, box {boxes[i].tolist()})")
    if raw.box_format == "xyxy":
        xyxy = np.clip(xyxy, 0.0, 1.0)
        out = np.empty((n, schema.BOX_DIM), dtype=np.float32)
        out[:, :4] = xyxy
        out[:, 4] = xyxy[:, 2] - xyxy[:, 0]
        out[:, 5] = xyxy[:, 3] - xyxy[:, 1]
        return out, "", ""
    return np.ascontiguousarray(boxes[:, :schema.BOX_DIM], dtype=np.float32), "", ""  # taken as is


def stage_image(raw: RawImage, *, collection: str, feature_dim: int, max_regions: int,
                source: str) -> dict | Reject:
    """Validate + normalise one image; the staged row or a Reject (kind "image") with the reason.

    The row holds every ``schema.IMAGE_COLUMNS`` key (``feature_shard``/``feature_row`` are None until an
    HDF5 shard assigns them) plus ``_source``, ``_locator``, ``_cap_policy`` and ``_regions_in``.
    """
    loc = raw.locator

    def rej(category: str, detail: str) -> Reject:
        return _reject(source, loc, schema.KIND_IMAGE, category, f"{detail} (image {raw.source_id!r})")

    feats = np.asarray(raw.features)
    boxes = np.asarray(raw.boxes)
    if feats.ndim != 2 or boxes.ndim != 2:
        return rej(R_BAD_SHAPE, f"features must be 2-D and boxes 2-D, got shapes {feats.shape} and {boxes.shape}")
    n = feats.shape[0]
    if raw.num_boxes is not None and (int(raw.num_boxes) != n or int(raw.num_boxes) != boxes.shape[0]):
        return rej(R_NUM_BOXES, f"num_boxes says {raw.num_boxes} but features have {n} rows and boxes "
                                f"{boxes.shape[0]}")
    if boxes.shape[0] != n:
        return rej(R_ROW_MISMATCH, f"features have {n} rows but boxes have {boxes.shape[0]}")
    if feats.shape[1] != feature_dim:
        return rej(R_FEATURE_DIM, f"features are {feats.shape[1]}-d but the manifest says feature_dim {feature_dim}")
    if n == 0:
        return rej(R_NO_REGIONS, "the image has no regions")
    if not np.isfinite(feats).all():
        return rej(R_NOT_FINITE, f"{int((~np.isfinite(feats)).sum())} NaN/Inf values in features")
    if not np.isfinite(boxes).all():
        return rej(R_NOT_FINITE, f"{int((~np.isfinite(boxes)).sum())} NaN/Inf values in boxes")
    conf = None
    if raw.confidences is not None:
        conf = np.asarray(raw.confidences, dtype=np.float64).reshape(-1)
        if conf.shape[0] != n:
            return rej(R_BAD_CONF, f"{conf.shape[0]} confidences for {n} regions")
        if not np.isfinite(conf).all():
            return rej(R_NOT_FINITE, "NaN/Inf values in confidences")
    norm_boxes, category, detail = _normalise_boxes(raw, boxes)
    if norm_boxes is None:
        return rej(category, detail)

    # Regions are stored most-confident first whenever confidences exist, capped or not: every later stage
    # (a model's own --max-regions, the reranker's region cap) truncates from the end and must drop the
    # least confident regions, not whichever the detector happened to write last.
    policy = None
    if conf is not None:
        keep = np.argsort(-conf, kind="stable")[:max_regions]  # stable: ties keep file order (deterministic)
        policy = POLICY_CONFIDENCE if n > max_regions else None
    elif n > max_regions:
        keep = np.arange(max_regions)
        policy = POLICY_STORED_ORDER
    else:
        keep = None
    if keep is not None:
        feats, norm_boxes = feats[keep], norm_boxes[keep]

    return {
        "item_id": schema.make_item_id(collection, schema.KIND_IMAGE, raw.source_id),
        "collection": collection,
        "source_id": str(raw.source_id),
        "split": raw.split,
        "image_w": int(raw.image_w or 0),
        "image_h": int(raw.image_h or 0),
        "num_boxes": int(feats.shape[0]),
        "boxes": np.ascontiguousarray(norm_boxes, dtype=np.float32),
        "features": np.ascontiguousarray(feats, dtype=np.float32),
        "feature_shard": None,
        "feature_row": None,
        K_SOURCE: source,
        K_LOCATOR: loc,
        K_CAP_POLICY: policy,
        K_REGIONS_IN: int(n),
    }


def with_caption_split(raw: RawImage, splits: Optional[frozenset], source: str) -> Optional[RawImage | Reject]:
    """An image of a collection staged with ``uncaptioned_images: skip``, given the splits of the captions that
    name it (``readers.caption_image_splits``): None when no caption names it (not staged; the stager counts
    it as skipped), the image in its captions' split, or a Reject when its captions are in several splits."""
    if not splits:
        return None
    if len(splits) > 1:
        names = ", ".join(sorted(str(s) for s in splits))
        return _reject(source, raw.locator, schema.KIND_IMAGE, R_SPLIT_CONFLICT,
                       f"the captions of image {raw.source_id!r} are in splits {names}; an image is in one split")
    (split,) = splits
    return dataclasses.replace(raw, split=split)


def split_counts(rows: Iterable[dict]) -> dict[str, int]:
    """{split: rows} of staged rows (a row without a split counts under "(none)")."""
    return dict(Counter(r["split"] if r["split"] is not None else NO_SPLIT for r in rows))


NO_SPLIT = "(none)"


# ---------------------------------------------------------------------------------------- captions
def stage_caption(raw: RawCaption, *, collection: str, image_item_id: Optional[int] = None,
                  source: str = "") -> dict | Reject:
    """Validate one caption; the staged row (``schema.CAPTION_COLUMNS`` + ``_source``/``_locator``) or a
    Reject (kind "caption"). ``image_item_id`` defaults to the id of ``raw.image_source_id`` in
    ``collection``; whether that image was actually staged is decided by the pipeline's join."""
    loc = raw.locator
    text = raw.text
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            return _reject(source, loc, schema.KIND_CAPTION, R_NOT_UTF8,
                           f"{exc.reason} at byte {exc.start} (image {raw.image_source_id!r})")
    text = str(text).strip()
    if not text:
        return _reject(source, loc, schema.KIND_CAPTION, R_EMPTY_CAPTION,
                       f"empty or whitespace-only text (image {raw.image_source_id!r})")
    if image_item_id is None:
        image_item_id = schema.make_item_id(collection, schema.KIND_IMAGE, raw.image_source_id)
    source_id = schema.caption_source_id(raw.image_source_id, raw.caption_key)
    return {
        "caption_id": schema.make_item_id(collection, schema.KIND_CAPTION, source_id),
        "image_item_id": int(image_item_id),
        "collection": collection,
        "source_id": source_id,
        "text": text,
        "lang": raw.lang,
        "split": raw.split,
        K_SOURCE: source,
        K_LOCATOR: loc,
    }


def unknown_image_reject(row: dict, image_source_id: str) -> Reject:
    """The reject for a caption whose image was not staged (decided by the pipeline's join)."""
    return Reject(source=row.get(K_SOURCE, ""), locator=row.get(K_LOCATOR, ""), kind=schema.KIND_CAPTION,
                  reason=REASON_UNKNOWN_IMAGE.format(image_source_id=image_source_id,
                                                     collection=row["collection"]))


# -------------------------------------------------------------------------------------- duplicates
def _natural_key(text: str) -> tuple:
    """'f.tsv:10' sorts after 'f.tsv:9' (numbers compare as numbers)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def locator_key(row: dict) -> tuple:
    return _natural_key(str(row.get(K_SOURCE, ""))), _natural_key(str(row.get(K_LOCATOR, "")))


def resolve_duplicates(rows: Iterable[dict], id_key: str = "item_id") -> tuple[list[dict], list[Reject]]:
    """Keep one row per id, deterministically the one with the smallest (source, locator); the others
    become rejects that name the kept row's locator. Rows whose id is shared by a *different*
    (collection, source_id) are hash collisions: rejected too, with that reason."""
    by_id: dict[int, list[dict]] = {}
    for r in rows:
        by_id.setdefault(int(r[id_key]), []).append(r)
    kept, rejects = [], []
    is_caption = id_key == "caption_id"
    kind = schema.KIND_CAPTION if is_caption else schema.KIND_IMAGE
    for item_id, group in by_id.items():
        if len(group) == 1:
            kept.append(group[0])
            continue
        group.sort(key=locator_key)
        first = group[0]
        kept.append(first)
        where = first.get(K_LOCATOR) or first.get(K_SOURCE, "")  # readers' locators include the file
        for r in group[1:]:
            if (r["collection"], r["source_id"]) == (first["collection"], first["source_id"]):
                cat = R_DUPLICATE_CAPTION if is_caption else R_DUPLICATE
                detail = f"{r['source_id']!r} in collection {r['collection']!r}; first seen at {where}"
            else:
                cat = R_ID_COLLISION
                detail = (f"{r['collection']}/{r['source_id']} hashes to item_id {item_id} like "
                          f"{first['collection']}/{first['source_id']} (first seen at {where})")
            rejects.append(Reject(source=r.get(K_SOURCE, ""), locator=r.get(K_LOCATOR, ""),
                                  reason=f"{cat}: {detail}", kind=kind))
    return kept, rejects


def find_id_collisions(owners: Iterable[tuple[int, tuple[str, str, str]]]) -> list[dict]:
    """(item_id, (collection, kind, source_id)) pairs -> the item_ids claimed by more than one owner,
    via ``schema.IdRegistry`` (covers images vs captions and across collections)."""
    registry = schema.IdRegistry()
    seen: dict[int, tuple[str, str, str]] = {}
    for item_id, owner in owners:
        if seen.setdefault(int(item_id), owner) != owner:
            registry.collisions.append((int(item_id), seen[int(item_id)], owner))
    return [{"item_id": i, "first": list(a), "second": list(b)} for i, a, b in registry.collisions]


# ----------------------------------------------------------------------------------------- summary


def cap_summary(max_regions: int, by_policy: dict[str, int]) -> dict:
    """The region-cap part of a source's summary: how many images were cut to max_regions, and how."""
    by_policy = {k: int(v) for k, v in sorted(by_policy.items()) if v}
    if not by_policy:
        policy = "none needed"
    elif len(by_policy) == 1:
        policy = next(iter(by_policy))
    else:
        policy = "mixed"
    return {"max_regions": int(max_regions), "capped_images": int(sum(by_policy.values())), "policy": policy,
            "by_policy": by_policy}


def source_summary(*, fmt: str, path: str, records_in: int, staged: int, rejects: Iterable[str] | Counter,
                   shards: list[dict], expected, rejects_file: str,
                   region_cap: Optional[dict] = None, feature_shards: Optional[list[dict]] = None,
                   skipped: int = 0, staged_by_split: Optional[dict] = None,
                   expected_key: str = "expected") -> dict:
    """Summary of one source (a collection's images or captions). ``rejects`` is the list of reasons (or
    a Counter of categories already). ``expected``: None, a count, or {split: count} (checked against
    ``staged_by_split``); a mismatch is a warning naming the manifest key to set (``expected_key``).
    ``skipped``: images no caption named (``uncaptioned_images: skip``): read, neither staged nor rejected."""
    hist = rejects if isinstance(rejects, Counter) else Counter(reason_category(r) for r in rejects)
    rejected = int(sum(hist.values()))
    by_split = {str(k): int(v) for k, v in sorted((staged_by_split or {}).items())}
    out = {
        "format": fmt, "path": path,
        "records_in": int(records_in), "staged": int(staged), "rejected": rejected,
        "reject_reasons": dict(sorted(hist.items())),
        "rejects_file": rejects_file,
        "shards": sorted(shards, key=lambda s: s["name"]),
        "expected": expected,
        "staged_by_split": by_split,
    }
    if skipped:
        out["skipped"] = int(skipped)
    warnings = []
    if records_in != staged + rejected + skipped:
        warnings.append(f"records_in {records_in} != staged {staged} + rejected {rejected}"
                        + (f" + skipped {skipped}" if skipped else ""))
    if isinstance(expected, dict):
        for split, n in sorted(expected.items()):
            got = by_split.get(split, 0)
            if int(n) != got:
                warnings.append(f"expected {n} in split {split!r} but staged {got} (the manifest's check: set "
                                f"{expected_key}.{split}={got}, or {expected_key}=null to drop the checks)")
    elif expected is not None and int(expected) != staged:
        warnings.append(f"expected {expected} records but staged {staged} (the manifest's check: set "
                        f"{expected_key}={staged}, or null to drop it)")
    out["warnings"] = warnings
    if region_cap is not None:
        out["region_cap"] = region_cap
    if feature_shards is not None:
        out["feature_shards"] = sorted(feature_shards, key=lambda s: s["name"])
    return out


def in_equals_line(label: str, src: dict) -> str:
    """'demo images: 5000 in = 5000 staged + 0 rejected' (+ 'N skipped (no caption names them)' when any)"""
    line = f"{label}: {src['records_in']} in = {src['staged']} staged + {src['rejected']} rejected"
    if src.get("skipped"):
        line += f" + {src['skipped']} skipped (no caption names them)"
    by_split = src.get("staged_by_split") or {}
    if len(by_split) > 1:
        line += " [" + ", ".join(f"{k}: {v}" for k, v in by_split.items()) + "]"
    return line

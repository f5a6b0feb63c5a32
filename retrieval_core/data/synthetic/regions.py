"""Detector-like region features of the synthetic scenes.

Region features imitate a detector box head: ``relu(offset + class_code + colour_code + size_code + noise)``
with codebooks drawn from ``world_seed`` only, so "red" is the same direction in every collection. Because the
codes add up, the mean of an image's region features is nearly unchanged by a binding swap or a relation swap:
a pooled (bi-encoder) embedding confuses siblings, while cross-attention over text + regions (+ boxes) can tell
them apart. Everything that is not the intended difference (clutter, image size, detections per object) is drawn
per family, so siblings really are near-duplicates; only the noise, box jitter, confidences and the stored
region order are drawn per image.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from retrieval_core.data.schema import RawImage
from retrieval_core.data.synthetic.scenes import GRID, NUM_BACKGROUND, describe_scene, family_draws
from retrieval_core.data.synthetic.spec import SyntheticSpec, seeded_rng
from retrieval_core.data.synthetic.vocabulary import COLOURS, DOMAINS, SIZES

# Feature model (see module doc). Offsets/scales keep ~50% of post-ReLU values at zero, like a real box head.
_OFFSET, _CLASS_SCALE, _COLOUR_SCALE, _SIZE_SCALE, _BG_SCALE = 0.0, 1.0, 0.6, 0.4, 1.0
_NOISE, _BG_NOISE = 0.25, 0.35
_NOISE_BANK_ROWS = 2048


@dataclass(frozen=True)
class _World:
    """All codebooks stacked in one float32 table, so a region feature is a sum of 5 table rows:
    object = class + colour + size + noise_a + noise_b; clutter = background + zero + zero + noise_a + noise_b."""
    table: np.ndarray
    class_row: dict  # class name -> row
    colour_row: dict
    size_row: dict
    background_start: int
    zero_row: int
    obj_noise_start: int  # _NOISE_BANK_ROWS rows of object noise (std _NOISE / sqrt 2)
    bg_noise_start: int  # _NOISE_BANK_ROWS rows of clutter noise (std _BG_NOISE / sqrt 2)


@functools.lru_cache(maxsize=4)
def _world(world_seed: int, feature_dim: int) -> _World:
    """Codebooks shared by every collection with the same world_seed (one 'detector feature space').
    Noise is the sum of two random bank rows: cheaper than drawing fresh normals, millions of combinations."""
    rng = seeded_rng("world", world_seed, feature_dim)
    classes = sorted({n.name for nouns in DOMAINS.values() for n in nouns})
    blocks = [(len(classes), _CLASS_SCALE), (len(COLOURS), _COLOUR_SCALE), (len(SIZES), _SIZE_SCALE),
              (NUM_BACKGROUND, _BG_SCALE), (1, 0.0), (_NOISE_BANK_ROWS, _NOISE / np.sqrt(2.0)),
              (_NOISE_BANK_ROWS, _BG_NOISE / np.sqrt(2.0))]
    starts = np.cumsum([0] + [n for n, _ in blocks]).tolist()
    table = np.empty((starts[-1], feature_dim), dtype=np.float32)
    for (n, scale), start in zip(blocks, starts):
        table[start:start + n] = rng.standard_normal((n, feature_dim), dtype=np.float32) * np.float32(scale)
    return _World(table, {c: starts[0] + i for i, c in enumerate(classes)},
                  {c: starts[1] + i for i, c in enumerate(COLOURS)}, {z: starts[2] + i for i, z in enumerate(SIZES)},
                  starts[3], starts[4], starts[5], starts[6])


def generate_image(spec: SyntheticSpec, index: int) -> RawImage:
    scene = describe_scene(spec, index)
    fam = family_draws(spec, scene["family"])
    world = _world(spec.world_seed, spec.feature_dim)
    rng = seeded_rng("image", spec.seed, spec.collection, index)
    w, h = scene["image_w"], scene["image_h"]
    cw, ch = w / GRID, h / GRID

    rows, obj_boxes = [], []  # per object detection: (class row, colour row, size row)
    for g, grp in enumerate(scene["groups"]):
        n = grp["count"]
        scale = (0.85 if grp["size"] == "large" else 0.45) / np.sqrt(n)
        r, c = grp["cell"]
        code = (world.class_row[grp["class"]], world.colour_row[grp["colour"]], world.size_row[grp["size"]])
        for k in range(n):
            ox, oy = fam["instance_offsets"][g][k]
            cx, cy = (c + 0.5 + ox * (n > 1)) * cw, (r + 0.5 + oy * (n > 1)) * ch
            bw, bh = scale * cw, scale * ch
            for _ in range(fam["dets"][g][k]):  # 1-3 overlapping detections of one object
                obj_boxes.append((cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2))
                rows.append(code)
    n_obj = scene["num_object_detections"]
    n_bg = scene["num_clutter"]
    n = n_obj + n_bg

    # Object detections rank above clutter; keep the most confident if max_regions is tiny.
    obj_conf = rng.uniform(0.55, 0.99, len(obj_boxes)).astype(np.float32)
    keep = np.sort(np.argsort(-obj_conf, kind="stable")[:n_obj])
    idx = np.empty((n, 5), dtype=np.int64)  # table rows summed into each region feature
    idx[:n_obj, :3] = np.asarray(rows, dtype=np.int64).reshape(-1, 3)[keep]
    idx[n_obj:, 0] = world.background_start + np.asarray(fam["clutter_codes"][:n_bg], dtype=np.int64)
    idx[n_obj:, 1:3] = world.zero_row
    noise = rng.integers(0, _NOISE_BANK_ROWS, size=(n, 2))
    idx[:n_obj, 3:] = world.obj_noise_start + noise[:n_obj]
    idx[n_obj:, 3:] = world.bg_noise_start + noise[n_obj:]

    boxes = np.empty((n, 4), dtype=np.float32)
    boxes[:n_obj] = np.asarray(obj_boxes, dtype=np.float32).reshape(-1, 4)[keep]
    cb = np.asarray(fam["clutter_boxes"][:n_bg], dtype=np.float32).reshape(-1, 4)
    bx, by = cb[:, 0] * w * 0.8, cb[:, 1] * h * 0.8
    boxes[n_obj:] = np.stack([bx, by, bx + (0.05 + cb[:, 2] * 0.4) * w, by + (0.05 + cb[:, 3] * 0.4) * h], 1)
    boxes += rng.normal(0.0, 0.02 * min(w, h), size=boxes.shape).astype(np.float32)  # per-image jitter
    np.clip(boxes[:, 0::2], 0, w - 1, out=boxes[:, 0::2])
    np.clip(boxes[:, 1::2], 0, h - 1, out=boxes[:, 1::2])
    boxes[:, 2] = np.maximum(boxes[:, 2], boxes[:, 0] + 1)
    boxes[:, 3] = np.maximum(boxes[:, 3], boxes[:, 1] + 1)
    conf = np.concatenate([obj_conf[keep], rng.uniform(0.2, 0.5, n_bg).astype(np.float32)])

    order = rng.permutation(n)  # stored order is NOT confidence order
    idx = idx[order]
    feats = world.table[idx[:, 0]]
    for j in range(1, 5):
        feats += world.table[idx[:, j]]
    if _OFFSET:
        feats += np.float32(_OFFSET)
    np.maximum(feats, 0.0, out=feats)  # ReLU, like a real box head
    return RawImage(
        source_id=scene["source_id"], features=feats, boxes=boxes[order], image_w=w, image_h=h,
        box_format="xyxy", confidences=conf[order], num_boxes=n, split=scene["split"],
        locator=f"synthetic:{spec.collection}:{index}",
    )


def decode_regions(spec: SyntheticSpec, features: np.ndarray) -> list[tuple[str, str]]:
    """The (class, colour) each region feature correlates with most in the world codebook (centred features).

    An oracle for what the features make recoverable, not an input to any model: which colour sits on which
    object is in every single region, although the image's mean cannot show a binding swap
    (benchmarks.probes.family_probe's ``oracle`` head)."""
    world = _world(spec.world_seed, spec.feature_dim)
    f = np.asarray(features, dtype=np.float32)
    f = f - f.mean(axis=1, keepdims=True)
    classes, colours = list(world.class_row), list(world.colour_row)
    c = np.argmax(f @ world.table[[world.class_row[k] for k in classes]].T, axis=1)
    k = np.argmax(f @ world.table[[world.colour_row[k] for k in colours]].T, axis=1)
    return [(classes[i], colours[j]) for i, j in zip(c, k)]


def generate_images(spec: SyntheticSpec, start: int = 0, stop: Optional[int] = None) -> Iterator[RawImage]:
    stop = spec.num_images if stop is None else min(stop, spec.num_images)
    for i in range(max(start, 0), stop):
        yield generate_image(spec, i)

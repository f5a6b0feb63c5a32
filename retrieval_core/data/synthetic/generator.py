"""Deterministic, seeded, streaming synthetic image-text benchmark with detector-like region features.

Why it is hard in the way the paper needs
-----------------------------------------
Images come in *families* of ``family_size`` consecutive indices (same split). Member 0 is a base scene; member
``j`` differs from it in exactly ONE way, ``sibling_changes[j - 1]``:

* ``attribute`` - one focus object's colour is replaced by a colour found nowhere else in the scene ("a red cube"
  vs "a green cube"): a query-specific detail among the scene's other objects. Cross-attention checks the
  caption's colour words against the regions; a pooled embedding holds it as a small share of one vector;
* ``binding``   - the colours of the two focus objects are swapped ("a red cube and a blue ball" vs
  "a blue cube and a red ball");
* ``count``     - one focus object group has another number of instances ("two cubes" vs "three cubes");
* ``relation``  - the two focus groups trade places ("cube left of ball" vs "ball left of cube").

Binding and relation swaps are second-order (which colour or place goes with which object): pooled features
cannot show them at all, and telling them apart needs cross-modal reasoning that a cross-encoder must first
learn. The default family (base, attribute, binding, attribute) mixes the detail a reranker is for with a
binding swap that remains hard for both heads (docs/DATA.md).

Region features imitate a detector box head: ``relu(offset + class_code + colour_code + size_code + noise)``
with codebooks drawn from ``world_seed`` only, so "red" is the same direction in every collection. Because the
codes add up, the mean of an image's region features is nearly unchanged by a binding swap or a relation swap:
a pooled (bi-encoder) embedding confuses siblings, while cross-attention over text + regions (+ boxes) can tell
them apart. Everything that is not the intended difference (clutter, image size, detections per object) is drawn
per family, so siblings really are near-duplicates; only the noise, box jitter, confidences and the stored
region order are drawn per image.

Determinism: image ``i`` depends only on (spec fields, i) - a family stream seeded by a hash of
(seed, collection, family) and an image stream seeded by a hash of (seed, collection, i) - so any index range can
be generated on any worker in any order with identical results. Captions use their own stream.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, fields
from typing import Iterator, Optional

import numpy as np
import pandas as pd

from retrieval_core.data import staging
from retrieval_core.data.schema import DEFAULT_MAX_REGIONS, ImageTable, RawCaption, RawImage, Reject
from retrieval_core.data.synthetic import languages as synthetic_languages

# ------------------------------------------------------------------------------------- vocabulary
# Colours are shared by every domain (one world). name -> caption variants (first = canonical).
COLOURS: dict[str, tuple[str, ...]] = {
    "red": ("red",), "blue": ("blue",), "green": ("green",), "yellow": ("yellow",), "black": ("black",),
    "white": ("white",), "orange": ("orange",), "purple": ("purple", "violet"), "pink": ("pink",),
    "brown": ("brown",), "grey": ("grey", "gray"),
}
SIZES: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "large": ("large", "big", "huge")}


@dataclass(frozen=True)
class _Noun:
    name: str  # codebook key
    forms: tuple[tuple[str, str], ...]  # (singular, plural) wordings, first = canonical
    wears: bool = False  # people: the colour is their clothing ("a man in red")


def _nouns(*specs) -> tuple[_Noun, ...]:
    out = []
    for spec in specs:
        wears = spec.startswith("@")
        words = [w.split("/") for w in spec.lstrip("@").split("|")]
        out.append(_Noun(words[0][0], tuple((s, p) for s, p in words), wears))
    return tuple(out)


DOMAINS: dict[str, tuple[_Noun, ...]] = {
    # everyday objects, MS-COCO like
    "coco": _nouns("cup/cups|mug/mugs", "bottle/bottles", "chair/chairs", "bowl/bowls", "book/books",
                   "clock/clocks", "vase/vases", "laptop/laptops|computer/computers", "umbrella/umbrellas",
                   "suitcase/suitcases|bag/bags", "teddy bear/teddy bears", "ball/balls", "bench/benches",
                   "bicycle/bicycles|bike/bikes", "car/cars", "cat/cats|kitten/kittens", "dog/dogs|puppy/puppies",
                   "kite/kites", "cube/cubes|block/blocks", "plate/plates", "lamp/lamps", "pillow/pillows"),
    # people and outdoor scenes, Flickr30k like
    "f30k": _nouns("@man/men|guy/guys", "@woman/women|lady/ladies", "@boy/boys", "@girl/girls",
                   "@child/children|kid/kids", "@player/players", "dog/dogs", "bicycle/bicycles|bike/bikes",
                   "car/cars", "ball/balls", "tent/tents", "boat/boats", "horse/horses", "guitar/guitars",
                   "umbrella/umbrellas", "kite/kites", "bench/benches", "flag/flags"),
    # web images, Conceptual Captions like
    "cc": _nouns("sofa/sofas|couch/couches", "lamp/lamps", "poster/posters", "sneaker/sneakers|shoe/shoes",
                 "cake/cakes", "building/buildings", "dress/dresses", "mug/mugs", "car/cars", "flower/flowers",
                 "balloon/balloons", "chair/chairs", "tree/trees", "bird/birds", "vase/vases", "@model/models",
                 "@actor/actors", "pumpkin/pumpkins"),
}
SETTINGS = {
    "coco": ("", "", " on a table", " in a kitchen", " on the floor", " in a living room", " on a shelf"),
    "f30k": ("", "", " outside", " in a park", " on the street", " near the water", " on the grass"),
    "cc": (" on a sunny day", " in a modern interior", " against a white background", " at the festival",
           " in the city", " during the holidays"),
}
# Directional relations a caption states; "next to" only appears in describe_scene's relation list.
RELATION_WORDS = {
    "left of": ("to the left of", "left of", "on the left side of"),
    "right of": ("to the right of", "right of", "on the right side of"),
    "above": ("above", "over", "higher up than"),
    "below": ("below", "under", "beneath"),
}
INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
COUNT_WORDS = {1: ("a", "one", "a single"), 2: ("two", "a pair of", "2"), 3: ("three", "3")}
PERTURBATIONS = ("attribute", "binding", "count", "relation")
#: Caption languages: English (this module's writer) and those of ``synthetic_languages``.
CAPTION_LANGUAGES = ("en",) + synthetic_languages.LANGUAGES
DEFAULT_SIBLING_CHANGES = ("attribute", "binding", "attribute", "relation", "count", "count")
# A second binding or relation swap would recreate the base scene; count has 4 distinct variants (2 groups x 2
# other values); attribute alternates between the two focus groups, each time with a fresh unused colour.
_MAX_CHANGES = {"attribute": 6, "binding": 1, "count": 4, "relation": 1}
IMAGE_SIZES = ((640, 480), (500, 375), (480, 640), (375, 500), (640, 427), (500, 333), (800, 600))
GRID = 3  # objects are anchored on a GRID x GRID layout
NUM_BACKGROUND = 64

# Feature model (see module doc). Offsets/scales keep ~50% of post-ReLU values at zero, like a real box head.
_OFFSET, _CLASS_SCALE, _COLOUR_SCALE, _SIZE_SCALE, _BG_SCALE = 0.0, 1.0, 0.6, 0.4, 1.0
_NOISE, _BG_NOISE = 0.25, 0.35
_NOISE_BANK_ROWS = 2048


# ------------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class SyntheticSpec:
    collection: str
    num_images: int
    seed: int = 0
    domain: str = "coco"
    feature_dim: int = 2048
    captions_per_image: Optional[int] = None  # None -> 5 (1 for the cc domain); always an int after init
    min_regions: int = 10
    max_regions: int = 50
    splits: tuple = (("test", 1.0),)
    family_size: int = 4
    # what member j of a family changes from the base (member 0): sibling_changes[j - 1]
    sibling_changes: tuple = DEFAULT_SIBLING_CHANGES
    world_seed: int = 1234
    # every image gets captions_per_image captions in each language (in this order); English keys stay "0".."n-1",
    # the others' carry the language ("0.de"), so caption ids differ per language
    languages: tuple = ("en",)

    def __post_init__(self):
        if self.captions_per_image is None:
            object.__setattr__(self, "captions_per_image", 1 if self.domain == "cc" else 5)
        if isinstance(self.splits, dict):
            object.__setattr__(self, "splits", tuple(self.splits.items()))
        # Sorted by name: the assignment must not depend on mapping order (a Beam task freezes options sorted).
        object.__setattr__(self, "splits", tuple(sorted((str(n), float(f)) for n, f in self.splits)))
        if isinstance(self.sibling_changes, str):
            object.__setattr__(self, "sibling_changes", (self.sibling_changes,))
        object.__setattr__(self, "sibling_changes", tuple(str(c) for c in self.sibling_changes))
        if isinstance(self.languages, str):
            object.__setattr__(self, "languages", (self.languages,))
        object.__setattr__(self, "languages", tuple(str(x) for x in self.languages))
        problems = []
        if not self.collection:
            problems.append("collection must be a non-empty string")
        for name in ("num_images", "feature_dim", "captions_per_image", "min_regions", "max_regions", "family_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if self.domain not in DOMAINS:
            problems.append(f"unknown domain {self.domain!r} (expected one of: {', '.join(DOMAINS)})")
        if not problems and self.min_regions > self.max_regions:
            problems.append(f"min_regions ({self.min_regions}) > max_regions ({self.max_regions})")
        unknown = sorted(set(self.sibling_changes) - set(PERTURBATIONS))
        if unknown:
            problems.append(f"unknown sibling change(s) {unknown} (expected: {', '.join(PERTURBATIONS)})")
        elif not problems:
            used = self.sibling_changes[:self.family_size - 1]
            if len(used) < self.family_size - 1:
                problems.append(f"family_size {self.family_size} needs {self.family_size - 1} sibling_changes, "
                                f"got {len(self.sibling_changes)}")
            for kind, most in _MAX_CHANGES.items():
                if used.count(kind) > most:
                    problems.append(f"at most {most} {kind!r} sibling(s) per family (distinct scenes), "
                                    f"got {used.count(kind)}")
        unknown = [x for x in self.languages if x not in CAPTION_LANGUAGES]
        if unknown or not self.languages or len(set(self.languages)) != len(self.languages):
            problems.append(f"languages must be distinct caption languages of {', '.join(CAPTION_LANGUAGES)}, "
                            f"got {list(self.languages)}")
        fracs = [f for _, f in self.splits]
        if not self.splits or any(f <= 0 for f in fracs) or abs(sum(fracs) - 1.0) > 1e-6:
            problems.append(f"splits must be positive fractions summing to 1, got {dict(self.splits)}")
        if len({n for n, _ in self.splits}) != len(self.splits):
            problems.append(f"split names repeat: {[n for n, _ in self.splits]}")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_options(cls, collection: str, options: dict, feature_dim: int) -> "SyntheticSpec":
        """Build from a manifest's ``images:`` block options (``format``/``path`` already removed).
        ``splits`` may be a mapping ``{train: 0.7, ...}`` or a list of ``[name, fraction]`` pairs."""
        allowed = {f.name for f in fields(cls)} - {"collection", "feature_dim"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(f"unknown synthetic option(s): {', '.join(unknown)} "
                             f"(expected: {', '.join(sorted(allowed))})")
        if "num_images" not in options:
            raise ValueError("synthetic images need num_images")
        kwargs = dict(options)
        splits = kwargs.get("splits")
        if splits is not None:
            if isinstance(splits, dict):
                kwargs["splits"] = tuple(splits.items())
            elif isinstance(splits, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2
                                                           for p in splits):
                kwargs["splits"] = tuple(tuple(p) for p in splits)
            else:
                raise ValueError(f"splits must be a mapping name -> fraction, got {splits!r}")
        return cls(collection=collection, feature_dim=feature_dim, **kwargs)

    @property
    def num_families(self) -> int:
        return -(-self.num_images // self.family_size)

    @property
    def num_captions(self) -> int:
        return self.num_images * self.captions_per_image * len(self.languages)


# ------------------------------------------------------------------------------------ seeding
def _seed(*parts) -> int:
    key = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "big")


def _rng(*parts) -> np.random.Generator:
    # SFC64: cheap to seed and fast; the stream is fully determined by the hashed parts.
    return np.random.Generator(np.random.SFC64(_seed(*parts)))


# ----------------------------------------------------------------------------------- codebooks
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
    Noise is the sum of two random bank rows: ~2x faster than fresh normals, millions of combinations."""
    rng = _rng("world", world_seed, feature_dim)
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


# ---------------------------------------------------------------------------------- scene graph
def image_source_id(spec: SyntheticSpec, index: int) -> str:
    return f"{index:07d}"


def _check_index(spec: SyntheticSpec, index: int) -> int:
    index = int(index)
    if not 0 <= index < spec.num_images:
        raise IndexError(f"{spec.collection}: image index {index} outside [0, {spec.num_images})")
    return index


def split_of(spec: SyntheticSpec, index: int) -> str:
    """Split of image ``index``: assigned per family (siblings share a split), contiguous runs of families
    in split-name order; each split gets round(fraction x families) families."""
    family = _check_index(spec, index) // spec.family_size
    cum = 0.0
    for name, frac in spec.splits[:-1]:
        cum += frac
        if family < round(cum * spec.num_families):
            return name
    return spec.splits[-1][0]


def _relation(cell_a, cell_b) -> str:
    (ra, ca), (rb, cb) = cell_a, cell_b
    if ca != cb:
        return "left of" if ca < cb else "right of"
    return "above" if ra < rb else "below"


@functools.lru_cache(maxsize=4096)
def _family(spec: SyntheticSpec, family: int) -> dict:
    """The base scene of a family plus everything its members share (drawn once per family)."""
    rng = _rng("family", spec.seed, spec.collection, spec.domain, family)
    nouns = DOMAINS[spec.domain]
    n_groups = int(rng.choice([2, 3, 4], p=[0.5, 0.35, 0.15]))
    classes = rng.choice(len(nouns), n_groups, replace=False)
    colours = rng.choice(list(COLOURS), n_groups, replace=False)  # distinct: a binding swap always changes
    cells = rng.choice(GRID * GRID, n_groups, replace=False)
    groups = [{
        "class": nouns[int(c)].name, "colour": str(col), "size": str(rng.choice(list(SIZES))),
        "count": int(rng.choice([1, 2, 3], p=[0.6, 0.3, 0.1])), "cell": (int(cell) // GRID, int(cell) % GRID),
    } for c, col, cell in zip(classes, colours, cells)]
    # The focus pair shares its count and detections per instance, so swapping their colours leaves the
    # multiset of (class+colour+size) codes' sum unchanged: a pooled embedding cannot see a binding swap.
    groups[1]["count"] = groups[0]["count"]
    w, h = IMAGE_SIZES[int(rng.integers(len(IMAGE_SIZES)))]
    # Count siblings: group a or b, each to the other count values (distinct scenes).
    count_variants = [(g, v) for g in (0, 1) for v in (1, 2, 3) if v != groups[g]["count"]]
    count_variants = [count_variants[i] for i in rng.permutation(len(count_variants))]
    # Attribute siblings: a colour that no group of the scene has, so the caption's colour word names something
    # absent from every other member (checking it needs no binding).
    free_colours = [c for c in COLOURS if c not in {g["colour"] for g in groups}]
    free_colours = [free_colours[i] for i in rng.permutation(len(free_colours))]
    member_changes = [None]
    for kind in spec.sibling_changes[:spec.family_size - 1]:
        if kind == "count":
            detail = count_variants.pop(0)
        elif kind == "attribute":  # focus groups 0, 1, 0, ... in turn
            detail = (sum(c[0] == "attribute" for c in member_changes[1:]) % 2, free_colours.pop(0))
        else:
            detail = None
        member_changes.append((kind, detail))
    target_regions = int(rng.integers(spec.min_regions, spec.max_regions + 1))
    dets = rng.integers(1, 4, size=(4, 3))
    dets[1] = dets[0]
    return {
        "groups": groups, "image_w": w, "image_h": h, "changes": member_changes,
        # detections per (group, instance) slot, so an added instance has its own count
        "dets": dets.tolist(),
        "target_regions": target_regions,
        "clutter_codes": rng.integers(NUM_BACKGROUND, size=spec.max_regions).tolist(),
        "clutter_boxes": rng.random((spec.max_regions, 4)).tolist(),
        "instance_offsets": rng.uniform(-0.25, 0.25, size=(4, 3, 2)).tolist(),
    }


def describe_scene(spec: SyntheticSpec, index: int) -> dict:
    """The scene graph of image ``index``: groups (class, colour, size, count, cell), the focus pair (groups 0
    and 1) with its relation, every pairwise relation, the family/member and the single change from the base."""
    index = _check_index(spec, index)
    family, member = divmod(index, spec.family_size)
    fam = _family(spec, family)
    groups = [dict(g) for g in fam["groups"]]
    change, detail = fam["changes"][member] if member else (None, None)
    if change == "binding":
        groups[0]["colour"], groups[1]["colour"] = groups[1]["colour"], groups[0]["colour"]
    elif change == "count":
        g, value = detail
        groups[g]["count"] = value
    elif change == "relation":
        groups[0]["cell"], groups[1]["cell"] = groups[1]["cell"], groups[0]["cell"]
    elif change == "attribute":
        g, colour = detail
        groups[g]["colour"] = colour
    relations = []
    for i in range(len(groups)):
        for j in range(len(groups)):
            if i != j:
                relations.append((i, _relation(groups[i]["cell"], groups[j]["cell"]), j))
                (ri, ci), (rj, cj) = groups[i]["cell"], groups[j]["cell"]
                if max(abs(ri - rj), abs(ci - cj)) == 1:
                    relations.append((i, "next to", j))
    n_obj_dets = min(sum(fam["dets"][g][k] for g, grp in enumerate(groups) for k in range(grp["count"])),
                     spec.max_regions)
    base_dets = sum(fam["dets"][g][k] for g, grp in enumerate(fam["groups"]) for k in range(grp["count"]))
    # Clutter count is fixed per family (so clutter cancels between siblings), then fitted into [min, max].
    n_clutter = int(np.clip(fam["target_regions"] - base_dets, spec.min_regions - n_obj_dets,
                            spec.max_regions - n_obj_dets))
    return {
        "index": index, "source_id": image_source_id(spec, index), "split": split_of(spec, index),
        "family": family, "member": member, "change": change,
        "changed_group": detail[0] if change in ("count", "attribute") else None,
        "image_w": fam["image_w"], "image_h": fam["image_h"], "groups": groups, "focus": (0, 1),
        "relation": _relation(groups[0]["cell"], groups[1]["cell"]), "relations": relations,
        "num_object_detections": n_obj_dets, "num_clutter": max(n_clutter, 0),
    }


# ---------------------------------------------------------------------------------------- images
def generate_image(spec: SyntheticSpec, index: int) -> RawImage:
    scene = describe_scene(spec, index)
    fam = _family(spec, scene["family"])
    world = _world(spec.world_seed, spec.feature_dim)
    rng = _rng("image", spec.seed, spec.collection, index)
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
    (benchmarks.family_probe's ``oracle`` head)."""
    world = _world(spec.world_seed, spec.feature_dim)
    f = np.asarray(features, dtype=np.float32)
    f = f - f.mean(axis=1, keepdims=True)
    classes, colours = list(world.class_row), list(world.colour_row)
    c = np.argmax(f @ world.table[[world.class_row[k] for k in classes]].T, axis=1)
    k = np.argmax(f @ world.table[[world.colour_row[k] for k in colours]].T, axis=1)
    return [(classes[i], colours[j]) for i, j in zip(c, k)]


def focus_pairs(scene: dict) -> set[tuple[str, str]]:
    """The (class, colour) of the two focus groups: what every caption of the scene names."""
    return {(scene["groups"][g]["class"], scene["groups"][g]["colour"]) for g in scene["focus"]}


def generate_images(spec: SyntheticSpec, start: int = 0, stop: Optional[int] = None) -> Iterator[RawImage]:
    stop = spec.num_images if stop is None else min(stop, spec.num_images)
    for i in range(max(start, 0), stop):
        yield generate_image(spec, i)


# -------------------------------------------------------------------------------------- captions
def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _phrase(rng, noun: _Noun, grp: dict, with_size: bool) -> str:
    """'two large red cubes', 'a man in blue', 'an orange mug'."""
    n = grp["count"]
    sing, plur = noun.forms[int(rng.integers(len(noun.forms)))]
    word = sing if n == 1 else plur
    colour = COLOURS[grp["colour"]][int(rng.integers(len(COLOURS[grp["colour"]])))]
    with_size = with_size and not noun.wears
    size = SIZES[grp["size"]][int(rng.integers(len(SIZES[grp["size"]])))] + " " if with_size else ""
    if noun.wears:
        core, head = f"{size}{word} in {colour}", size or word
    else:
        core, head = f"{size}{colour} {word}", size or colour
    count = COUNT_WORDS[n][int(rng.integers(len(COUNT_WORDS[n])))]
    if count in ("a",):
        count = _article(head)
    return f"{count} {core}"


def _be(grp) -> str:
    return "is" if grp["count"] == 1 else "are"


def _the(rng, noun: _Noun, grp: dict) -> str:
    sing, plur = noun.forms[0]
    colour = grp["colour"]
    word = sing if grp["count"] == 1 else plur
    return f"the {word} in {colour}" if noun.wears else f"the {colour} {word}"


_TEMPLATES = {
    "coco": (
        "{A} {beA} {rel} {B}{set}.", "There {beA} {A} {rel} {B}{set}.", "{B} {beB} {inv} {A}{set}.",
        "A photo of {A} {rel} {B}{set}.", "{A} and {B}{set}, with {tA} {rel} {tB}.",
        "An image showing {B} and {A}; {tA} {beA} {rel} {tB}.", "{A} placed {rel} {B}{extra}.",
        "Close-up of {A} sitting {rel} {B}{extra}.",
    ),
    "f30k": (
        "{A} {beA} {rel} {B}{set}.", "{A} {beA} standing {rel} {B}{set}.", "{B} {beB} {inv} {A}{set}.",
        "{A} and {B}{set}; {tA} {beA} {rel} {tB}.", "There {beA} {A} {rel} {B}{extra}.",
        "{B}{set}, with {A} {rel} {tB}.", "Outdoors, {A} {rel} {B}{extra}.",
    ),
    "cc": (
        "stock photo : {A} {rel} {B}{set}{extra} .", "{A} {rel} {B}{set} -- a view of {tA} and {tB} .",
        "illustration of {B} {inv} {A}{set}{extra} .", "the {adj} scene with {A} {rel} {B}{set} .",
    ),
}
_CC_ADJ = ("beautiful", "vintage", "colorful", "minimalist", "cozy", "festive")


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _english_texts(spec: SyntheticSpec, scene: dict, index: int) -> list[str]:
    rng = _rng("captions", spec.seed, spec.collection, index)
    nouns = {n.name: n for n in DOMAINS[spec.domain]}
    ga, gb = scene["groups"][0], scene["groups"][1]
    na, nb = nouns[ga["class"]], nouns[gb["class"]]
    others = scene["groups"][2:]
    templates = _TEMPLATES[spec.domain]
    picks = rng.permutation(len(templates))
    out = []
    for k in range(spec.captions_per_image):
        tpl = templates[int(picks[k % len(picks)])]
        rel = scene["relation"]
        extra = ""
        if others and rng.random() < 0.6:
            o = others[int(rng.integers(len(others)))]
            extra = f", next to {_phrase(rng, nouns[o['class']], o, False)}" if rng.random() < 0.5 else \
                f" and {_phrase(rng, nouns[o['class']], o, False)} nearby"
        text = tpl.format(
            A=_phrase(rng, na, ga, rng.random() < 0.35), B=_phrase(rng, nb, gb, rng.random() < 0.35),
            tA=_the(rng, na, ga), tB=_the(rng, nb, gb), beA=_be(ga), beB=_be(gb),
            rel=RELATION_WORDS[rel][int(rng.integers(3))], inv=RELATION_WORDS[INVERSE[rel]][int(rng.integers(3))],
            set=SETTINGS[spec.domain][int(rng.integers(len(SETTINGS[spec.domain])))], extra=extra,
            adj=_CC_ADJ[int(rng.integers(len(_CC_ADJ)))],
        )
        out.append(text if spec.domain == "cc" else _cap(text))
    return out


def _translated_texts(spec: SyntheticSpec, scene: dict, index: int, lang: str) -> list[str]:
    """Captions in ``lang`` from a random stream of their own, so adding a language changes no other language's."""
    rng = _rng("captions", spec.seed, spec.collection, index, lang)
    wears = {n.name: n.wears for n in DOMAINS[spec.domain]}
    groups = [synthetic_languages.Group(g["class"], g["colour"], g["size"], g["count"], wears[g["class"]])
              for g in scene["groups"]]
    return synthetic_languages.write_captions(lang, spec.domain, groups, scene["relation"],
                                              INVERSE[scene["relation"]], spec.captions_per_image, rng)


def caption_key(k: int, lang: str) -> str:
    """Key of caption ``k`` of an image in ``lang``: "3" in English (as before there were languages), "3.de"."""
    return str(k) if lang == "en" else f"{k}.{lang}"


def generate_captions_for(spec: SyntheticSpec, index: int) -> list[RawCaption]:
    """Captions of image ``index``, ``captions_per_image`` per language of ``spec.languages`` (in that order):
    paraphrases that name both focus groups with count, colour (sometimes size) and their relation, so every
    caption tells the image apart from its siblings."""
    scene = describe_scene(spec, index)
    out = []
    for lang in spec.languages:
        texts = _english_texts(spec, scene, index) if lang == "en" else _translated_texts(spec, scene, index, lang)
        for k, text in enumerate(texts):
            key = caption_key(k, lang)
            out.append(RawCaption(image_source_id=scene["source_id"], text=text, caption_key=key, lang=lang,
                                  split=scene["split"], locator=f"synthetic:{spec.collection}:{index}#{key}"))
    return out


def generate_captions(spec: SyntheticSpec, start: int = 0, stop: Optional[int] = None) -> Iterator[RawCaption]:
    """Captions of images ``start:stop`` (image order, then language, then caption key)."""
    stop = spec.num_images if stop is None else min(stop, spec.num_images)
    for i in range(max(start, 0), stop):
        yield from generate_captions_for(spec, i)


def synthetic_collection(spec: SyntheticSpec) -> tuple[ImageTable, pd.DataFrame]:
    """(ImageTable, captions DataFrame) of one synthetic collection in memory, validated with the stager's
    per-record functions (no Beam): real images and captions for in-process benchmarks."""
    rows = []
    for raw in generate_images(spec):
        r = staging.stage_image(raw, collection=spec.collection, feature_dim=spec.feature_dim,
                                max_regions=DEFAULT_MAX_REGIONS, source="synthetic")
        if isinstance(r, Reject):
            raise ValueError(f"synthetic image rejected: {r.reason}")
        rows.append(r)
    caps = []
    for raw in generate_captions(spec):
        r = staging.stage_caption(raw, collection=spec.collection, source="synthetic")
        if isinstance(r, Reject):
            raise ValueError(f"synthetic caption rejected: {r.reason}")
        caps.append({"caption_id": r["caption_id"], "image_item_id": r["image_item_id"], "text": r["text"]})
    table = ImageTable.from_lists([r["item_id"] for r in rows], [r["features"] for r in rows],
                                  [r["boxes"] for r in rows])
    return table, pd.DataFrame(caps).sort_values("caption_id").reset_index(drop=True)

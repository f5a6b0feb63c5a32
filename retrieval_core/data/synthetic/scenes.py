"""The scene graphs: which family and split an image belongs to, what its family's base scene holds and the
one change each member makes (``describe_scene``)."""
from __future__ import annotations

import functools

import numpy as np

from retrieval_core.data.synthetic.spec import SyntheticSpec, seeded_rng
from retrieval_core.data.synthetic.vocabulary import COLOURS, DOMAINS, SIZES

IMAGE_SIZES = ((640, 480), (500, 375), (480, 640), (375, 500), (640, 427), (500, 333), (800, 600))
GRID = 3  # objects are anchored on a GRID x GRID layout
NUM_BACKGROUND = 64


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
def family_draws(spec: SyntheticSpec, family: int) -> dict:
    """The base scene of a family plus everything its members share (drawn once per family)."""
    rng = seeded_rng("family", spec.seed, spec.collection, spec.domain, family)
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
    fam = family_draws(spec, family)
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


def focus_pairs(scene: dict) -> set[tuple[str, str]]:
    """The (class, colour) of the two focus groups: what every caption of the scene names."""
    return {(scene["groups"][g]["class"], scene["groups"][g]["colour"]) for g in scene["focus"]}

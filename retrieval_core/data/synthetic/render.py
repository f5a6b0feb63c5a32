"""Pixels of the synthetic scenes: each scene ``describe_scene`` gives, drawn as a picture, so the raw-image path
(pipelines.stage's image_files -> backbone -> grid regions) is trained and evaluated on the same benchmark as the
region features.

Each object class of a domain is its own drawn shape (an outline x a fill pattern), in its colour, as many times
as its count, large or small, in its cell of the 3 x 3 layout; a binding swap exchanges two shapes' colours and a
relation swap their places, so every sibling contrast is visible. Clutter is drawn in neutral greys (no colour
word names it). ``python -m retrieval_core.data.synthetic.render`` writes a rendered-scene collection: PNGs, a
Karpathy JSON of the scenes' captions (their splits) and a manifest that stages them through image_files.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import click

from retrieval_core.cli import CheckedPlan, cli_errors, option, plan_command, plan_from_cli
from retrieval_core.data.synthetic.captions import generate_captions
from retrieval_core.data.synthetic.scenes import GRID, describe_scene, family_draws
from retrieval_core.data.synthetic.spec import SyntheticSpec, seeded_rng
from retrieval_core.data.synthetic.vocabulary import COLOURS, DOMAINS

RGB = {"red": (215, 35, 35), "blue": (35, 75, 215), "green": (35, 155, 55), "yellow": (240, 215, 30),
       "black": (15, 15, 15), "white": (252, 252, 252), "orange": (245, 130, 20), "purple": (130, 45, 170),
       "pink": (245, 140, 190), "brown": (120, 70, 30), "grey": (128, 128, 128)}
assert set(RGB) == set(COLOURS)
#: Backgrounds (one per family): muted tones that none of the object colours is close to.
BACKGROUNDS = ((196, 208, 186), (206, 196, 176), (184, 200, 212), (210, 200, 210))
OUTLINES = ("disk", "square", "triangle", "diamond", "star", "hexagon", "cross", "tall_bar")
FILLS = ("solid", "ring", "striped")  # a ring: the outline drawn thick, the background inside
RENDER_SCALE = 0.5  # a 640 x 480 scene is drawn at 320 x 240 (the backbone reads it at RENDERED_INPUT)
#: The backbone's input for rendered scenes: 288 pixels give a 9 x 9 final map, so the 3 x 3 grid's cells are the
#: scenes' 3 x 3 layout cells exactly (at 224 they overlap); measured on the dev split: docs/log/PIXELS-2026-11-27.md.
RENDERED_INPUT = 288
RENDER_VERSION = 1  # bump when the drawing changes: cached rendered collections are redrawn


def shape_of(domain: str, cls: str) -> tuple[str, str]:
    """(outline, fill) of a class: distinct for every class of the domain (22 at most; 8 x 3 shapes)."""
    names = [n.name for n in DOMAINS[domain]]
    i = names.index(cls)
    return OUTLINES[i % len(OUTLINES)], FILLS[i // len(OUTLINES)]


def _polygon(outline: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    def ring(n, radius, phase=-math.pi / 2):
        return [(cx + radius[k % len(radius)] * math.cos(phase + 2 * math.pi * k / n),
                 cy + radius[k % len(radius)] * math.sin(phase + 2 * math.pi * k / n)) for k in range(n)]
    def rect(hw, hh):
        return [(cx - hw, cy - hh), (cx + hw, cy - hh), (cx + hw, cy + hh), (cx - hw, cy + hh)]
    if outline == "square":
        return rect(r * .8, r * .8)
    if outline == "triangle":
        return ring(3, [r])
    if outline == "diamond":
        return [(cx, cy - r), (cx + r * .7, cy), (cx, cy + r), (cx - r * .7, cy)]
    if outline == "star":
        return ring(10, [r, r * .45])
    if outline == "hexagon":
        return ring(6, [r], 0.0)
    if outline == "cross":
        a, b = r * .35, r  # the 12 corners of a plus sign, clockwise from the top bar's left corner
        steps = ((-a, -b), (a, -b), (a, -a), (b, -a), (b, a), (a, a), (a, b), (-a, b), (-a, a), (-b, a), (-b, -a),
                 (-a, -a))
        return [(cx + dx, cy + dy) for dx, dy in steps]
    if outline == "tall_bar":
        return rect(r * .35, r)
    raise ValueError(f"unknown outline {outline!r}")


def _draw_object(draw, outline: str, fill: str, cx: float, cy: float, r: float, colour, background) -> None:
    edge = (40, 40, 40) if colour != RGB["black"] else (200, 200, 200)
    if outline == "disk":
        box = [cx - r, cy - r, cx + r, cy + r]
        draw.ellipse(box, fill=colour, outline=edge, width=max(1, int(r / 12)))
        inner = [cx - r * .5, cy - r * .5, cx + r * .5, cy + r * .5]
        if fill == "ring":
            draw.ellipse(inner, fill=background, outline=edge)
    else:
        pts = _polygon(outline, cx, cy, r)
        draw.polygon(pts, fill=colour, outline=edge, width=max(1, int(r / 12)))
        if fill == "ring":
            draw.polygon(_polygon(outline, cx, cy, r * .5), fill=background, outline=edge)
    if fill == "striped":  # three bars of the background across the shape
        for k in (-1, 0, 1):
            y = cy + k * r * .4
            draw.line([(cx - r, y), (cx + r, y)], fill=background, width=max(1, int(r / 8)))


def render_scene(spec: SyntheticSpec, index: int, scale: float = RENDER_SCALE):
    """The picture (a PIL RGB image, the scene's size x ``scale``) of image ``index``."""
    from PIL import Image, ImageDraw

    scene = describe_scene(spec, index)
    fam = family_draws(spec, scene["family"])
    w, h = max(1, round(scene["image_w"] * scale)), max(1, round(scene["image_h"] * scale))
    background = BACKGROUNDS[scene["family"] % len(BACKGROUNDS)]
    im = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(im)
    rng = seeded_rng("render", spec.seed, spec.collection, scene["family"])  # clutter: shared by the family
    for x1, y1, bw, bh in fam["clutter_boxes"][:scene["num_clutter"]]:
        tone = int(rng.integers(150, 200))
        bx, by = x1 * w * .85, y1 * h * .85
        draw.rectangle([bx, by, bx + (.03 + bw * .1) * w, by + (.03 + bh * .1) * h], fill=(tone, tone, tone))
    cw, ch = w / GRID, h / GRID
    for g, grp in enumerate(scene["groups"]):
        n = grp["count"]
        outline, fill = shape_of(spec.domain, grp["class"])
        radius = (0.85 if grp["size"] == "large" else 0.45) / math.sqrt(n) * min(cw, ch) / 2
        r, c = grp["cell"]
        for k in range(n):
            ox, oy = fam["instance_offsets"][g][k]
            cx, cy = (c + 0.5 + ox * (n > 1)) * cw, (r + 0.5 + oy * (n > 1)) * ch
            _draw_object(draw, outline, fill, cx, cy, radius, RGB[grp["colour"]], background)
    return im


@dataclass(frozen=True)
class RenderPlan(CheckedPlan):
    """One rendered-scene collection: which synthetic collection, how many of its images, where."""
    output: str = option(help="folder to write: images/*.png, captions.json (Karpathy), manifest.yaml")
    manifest: str = option("demo", help="the synthetic manifest whose collection is rendered")
    collection: Optional[str] = option(None, help="its collection [the manifest's only or query collection]")
    limit: Optional[int] = option(None, type=click.IntRange(min=1),
                                  help="render only the first N images (whole families) [all]")
    grids: str = option("1,3", help="grid sizes of the staged regions (image_files grids), coarse first")
    layers: str = option("stage3,stage4,stage5,stage6,stage7",
                         help="the backbone maps whose cells make a region's features (image_files layers: "
                              "stage1..stage7, head), comma-separated")
    cell_norm: str = option("unit", type=click.Choice(["none", "unit"]),
                            help="each map's cell vector as it is, or centred over its channels and scaled to unit "
                                 "length (image_files cell_norm)")
    input_size: int = option(RENDERED_INPUT, type=click.IntRange(96, 640),
                             help="the square the backbone reads each picture at (image_files input_size, a multiple "
                                  "of 32)")
    scale: float = option(RENDER_SCALE, type=click.FloatRange(0.05, 4.0), help="picture size / scene size")


def _spec(plan: RenderPlan) -> SyntheticSpec:
    from retrieval_core.data.manifest import load_manifest

    manifest = load_manifest(plan.manifest)
    names = [n for n, c in manifest.collections.items() if c.images is not None and c.images.format == "synthetic"]
    name = plan.collection or (names[0] if len(names) == 1 else (manifest.benchmark or {}).get("query_collection"))
    if name not in names:
        raise ValueError(f"{plan.manifest}: no synthetic collection {name!r} (have {names})")
    return manifest.synthetic_spec(name)


def write_collection(plan: RenderPlan) -> dict:
    """Render the images, write captions.json (every English caption, with its scene's split) and a manifest
    staging both (image_files + karpathy_json); returns {"manifest", "images", "captions"}."""
    from retrieval_core.data.pixels.backbone import GridSpec, parse_grids, parse_layers

    spec = _spec(plan)
    # the staging settings, checked before anything is drawn
    spec_px = GridSpec(parse_grids(plan.grids), layers=parse_layers(plan.layers), cell_norm=plan.cell_norm,
                       input_size=plan.input_size)
    stop = spec.num_images if plan.limit is None else min(plan.limit, spec.num_images)
    stop -= stop % spec.family_size if stop >= spec.family_size else 0  # whole families: siblings stay together
    img_dir = os.path.join(plan.output, "images")
    os.makedirs(img_dir, exist_ok=True)
    by_image: dict[str, dict] = {}
    for index in range(stop):
        scene = describe_scene(spec, index)
        name = f"{scene['source_id']}.png"
        path = os.path.join(img_dir, name)
        tmp = f"{path}.tmp.png"
        render_scene(spec, index, plan.scale).save(tmp, "PNG", optimize=False, compress_level=3)
        os.replace(tmp, path)
        by_image[scene["source_id"]] = {"filename": name, "split": scene["split"], "imgid": index, "sentences": []}
    n_caps = 0
    for cap in generate_captions(spec, 0, stop):
        if cap.lang != "en":
            continue
        by_image[cap.image_source_id]["sentences"].append({"raw": cap.text, "sentid": n_caps})
        n_caps += 1
    captions = os.path.join(plan.output, "captions.json")
    with open(captions, "w") as f:
        json.dump({"images": list(by_image.values()), "dataset": f"rendered {spec.collection}"}, f)
    grids = [int(g) for g in str(plan.grids).split(",") if g.strip()]
    manifest = os.path.join(plan.output, "manifest.yaml")
    with open(manifest, "w") as f:
        f.write(f"""name: rendered_{spec.collection}
description: The {spec.collection} scenes of {plan.manifest} drawn as pictures ({stop} images), staged from pixels.
feature_dim: {spec_px.feature_dim}
max_regions: {spec_px.num_regions}
collections:
  {spec.collection}:
    role: query
    images:
      format: image_files
      path: {os.path.abspath(img_dir)}
      grids: {grids}
      layers: {list(spec_px.layers)}
      cell_norm: {spec_px.cell_norm}
      input_size: {spec_px.input_size}
    captions:
      format: karpathy_json
      path: {os.path.abspath(captions)}
      image_id: filename_stem
    uncaptioned_images: skip
    expected_images: {stop}
    expected_captions: {n_caps}
benchmark:
  query_collection: {spec.collection}
  distractor_collections: []
  split: test
""")
    return {"manifest": manifest, "images": stop, "captions": n_caps}


@plan_command(RenderPlan)
def main(**values):
    """Draw a synthetic collection's scenes as PNGs with their captions and a manifest that stages them from
    pixels (pipelines.stage --manifest OUTPUT/manifest.yaml)."""
    with cli_errors():
        plan = plan_from_cli(RenderPlan, values)
        out = write_collection(plan)
    click.echo(f"rendered {out['images']} images, {out['captions']} captions; manifest: {out['manifest']}")


if __name__ == "__main__":
    main()

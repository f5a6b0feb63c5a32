"""The stage job's plan: the typed options, the manifest's read tasks and the settings the DoFns need."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional

import click

from pipelines import files
from retrieval_core.cli import CheckedPlan, device_option, option, threads_option
from retrieval_core.data import schema
from retrieval_core.data.manifest_spec import Manifest
from retrieval_core.data.readers import IMAGE_FILES, plan_read_tasks
from retrieval_core.data.shards import num_shards_for

IMAGES_DIR, FEATURES_DIR, CAPTIONS_DIR, REJECTS_DIR = "images", "features", "captions", "rejects"
FEATURE_FORMATS = ("parquet", "hdf5")
FEATURE_DTYPES = ("float32", "float16")
SPILL_COMPRESSIONS = ("none", "lzf")


class StageError(ValueError):
    """Bad input, reported before anything is written."""


@dataclass(frozen=True)
class StagePlan(CheckedPlan):
    """Everything one staging run needs, checked when built (by its options' types, as typed on the command
    line). None = the manifest's value."""
    output: str = option(help="staged directory to write (local path or gs://)")
    manifest: str = option("demo", help="manifest name (data_manifests/<name>.yaml) or path to a YAML file")
    overrides: tuple[str, ...] = option((), name="--set", multiple=True, metavar="KEY=VALUE",
                                        help="manifest override, e.g. --set "
                                             "collections.coco.images.path=/data/coco.tsv (repeatable)")
    feature_format: Optional[str] = option(None, type=click.Choice(FEATURE_FORMATS),
                                           help="where features go: inline in Parquet, or HDF5 shards beside Parquet "
                                                "meta [manifest's]")
    feature_dtype: Optional[str] = option(None, type=click.Choice(FEATURE_DTYPES),
                                          help="on-disk feature dtype [manifest's]")
    max_regions: Optional[int] = option(None, type=click.IntRange(min=1),
                                        help="region cap per image [manifest's, 50]")
    images_per_shard: int = option(500, type=click.IntRange(min=1))
    spill_compression: str = option("none", type=click.Choice(SPILL_COMPRESSIONS),
                                    help="compress the region features of the temporary spill (lzf: a lower "
                                         "disk peak for a longer stage; the staged shards are the same bytes)")
    max_reject_fraction: float = option(0.01, type=click.FloatRange(0, 1),
                                        help="exit non-zero (after writing summary + rejects) if more of any source "
                                             "is rejected")
    chunk_size: Optional[int] = option(None, type=click.IntRange(min=1),
                                       help="records per read task for index-addressable sources (synthetic) [500; "
                                            "100 with --direct_running_mode=multi_processing]")
    allow_empty: bool = option(False, help="accept a source (images or captions) that yields no records")
    device: str = device_option()  # the image backbone of image_files sources
    threads: Optional[int] = threads_option()

    def __post_init__(self):
        if not self.output:
            raise StageError(f"output must be a path, got {self.output!r}")
        if not self.manifest:
            raise StageError("manifest must be a name or a path")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        for o in self.overrides:
            if "=" not in o:
                raise StageError(f"manifest override {o!r} is not KEY=VALUE")
        try:
            super().__post_init__()  # every option's type; --device auto resolved on the launching host
        except ValueError as exc:
            raise StageError(str(exc)) from None



@dataclass(frozen=True)
class Settings:
    """Everything the DoFns need (picklable, no manifest object)."""
    output: str
    feature_dim: int
    max_regions: int
    feature_format: str
    feature_dtype: str
    images_per_shard: int
    expected_images: dict = field(default_factory=dict)  # collection -> count known up front (synthetic only)
    spill_dir: str = ""  # where read tasks spill features (run_stage sets <output>/_spill/<run id>)
    #: collection -> its caption source (format, path, options) for ``uncaptioned_images: skip``: only the images
    #: those captions name are staged, each in its captions' split
    caption_filters: dict = field(default_factory=dict)
    device: str = "cpu"  # where the image backbone runs (image_files sources)
    spill_compression: Optional[str] = None  # h5py compression of the spill's features (None: uncompressed)
    threads: Optional[int] = None  # torch threads of a worker decoding image files

    def num_shards(self, collection: str, counts: dict) -> int:
        count = self.expected_images.get(collection) or counts.get(collection, 0)
        return num_shards_for(count, self.images_per_shard)


def shard_rel(kind_dir: str, collection: str, index: int, total: int, suffix: str) -> str:
    return f"{kind_dir}/{files.shard_name(collection, index, total, suffix)}"


def planned_images(manifest) -> dict[str, int]:
    """Image counts known before reading: num_images of a synthetic collection. A file source's
    expected_images is a check, not a fact (a subset, an override, skipped uncaptioned images): its shards
    are sized by the images that passed validation (a 40-image file checked against 123,287 got 247 shards)."""
    return {name: int(c.images.options["num_images"]) for name, c in manifest.collections.items()
            if c.images.format == "synthetic" and c.images.options.get("num_images")}


def default_chunk_size(beam_args) -> int:
    """Records per read task: 100 under the multi-processing DirectRunner (which dropped outputs of 500-record
    tasks, module doc), else 500."""
    words = [w for a in beam_args for w in a.split("=", 1)]
    multi = any(a == "--direct_running_mode" and b == "multi_processing" for a, b in zip(words, words[1:]))
    return 100 if multi else 500


def plan_tasks(manifest: Manifest, chunk_size: int = 500) -> list:
    tasks = []
    for name, spec in manifest.collections.items():
        for kind, src in (("image", spec.images), ("caption", spec.captions)):
            if src is None:
                continue
            tasks += plan_read_tasks(name, kind, src.format, src.path, dict(src.options or {}),
                                     manifest.feature_dim, chunk_size=chunk_size, files=files.BEAM_FILES)
    return tasks


def _settings(plan: StagePlan, manifest) -> Settings:
    return Settings(
        output=plan.output,
        feature_dim=int(manifest.feature_dim),
        max_regions=int(plan.max_regions or getattr(manifest, "max_regions", None) or schema.DEFAULT_MAX_REGIONS),
        feature_format=plan.feature_format or getattr(manifest, "feature_format", None) or "parquet",
        feature_dtype=plan.feature_dtype or getattr(manifest, "feature_dtype", None) or "float32",
        images_per_shard=int(plan.images_per_shard),
        expected_images=planned_images(manifest),
        caption_filters={name: _caption_source(c) for name, c in manifest.collections.items()
                         if c.uncaptioned_images == "skip"},
        spill_dir=files.join(plan.output, files.SPILL_DIR, uuid.uuid4().hex[:12]),
        device=plan.device,
        threads=plan.threads,
        spill_compression=None if plan.spill_compression == "none" else plan.spill_compression,
    )


def image_backbone(manifest) -> Optional[dict]:
    """The backbone description (its fingerprint) of the manifest's image_files sources, None without any. One
    staged folder holds one kind of features: image files beside extracted features, or two grid layouts, are
    refused (a model reads one)."""
    sources = {name: c.images for name, c in manifest.collections.items() if c.images is not None}
    pixel = {n: s for n, s in sources.items() if s.format == IMAGE_FILES}
    if not pixel:
        return None
    from retrieval_core.data.pixels.backbone import (
        DEFAULT_CELL_NORM,
        DEFAULT_LAYERS,
        DEFAULT_PRECISION,
        INPUT_SIZE,
        GridSpec,
        fingerprint,
        parse_grids,
        parse_layers,
    )

    others = sorted(set(sources) - set(pixel))
    if others:
        raise StageError(f"collections {others} stage extracted region features beside image files in "
                         f"{sorted(pixel)}: a staged folder holds one kind of image features; stage them apart")
    specs = {n: GridSpec(parse_grids(s.options.get("grids", 7)), str(s.options.get("precision", DEFAULT_PRECISION)),
                         parse_layers(s.options.get("layers", list(DEFAULT_LAYERS))),
                         str(s.options.get("cell_norm", DEFAULT_CELL_NORM)), s.options.get("input_size", INPUT_SIZE))
             for n, s in pixel.items()}
    if len(set(specs.values())) > 1:
        layouts = {n: (g.grids, g.precision, g.layers, g.cell_norm, g.input_size) for n, g in specs.items()}
        raise StageError(f"image_files collections use different grids, precisions, layers, cell norms or input "
                         f"sizes {layouts}: one staged folder, one layout")
    spec = next(iter(specs.values()))
    if int(manifest.feature_dim) != spec.feature_dim:
        raise StageError(f"image_files sources with layers {list(spec.layers)} give {spec.feature_dim}-d features "
                         f"(EfficientNet-Lite0); the manifest says feature_dim: {manifest.feature_dim} "
                         f"(set feature_dim: {spec.feature_dim})")
    return fingerprint(spec)


def _frozen(value):
    """A YAML option value made hashable (lists -> tuples), for the cached caption-split lookup."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _caption_source(coll) -> tuple:
    """(format, path, options) of a collection's captions, hashable: the key of ``_caption_splits``."""
    src = coll.captions
    return (src.format, _frozen(src.path), tuple(sorted((k, _frozen(v)) for k, v in src.options.items())))



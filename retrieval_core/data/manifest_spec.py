"""What a valid data manifest is: its keys, formats and choices, the types a loaded manifest is made of
(``Manifest``, ``CollectionSpec``, ``SourceSpec``), ``ManifestError``, and ``validate_manifest``, which builds a
``Manifest`` from the parsed (overridden, expanded) YAML or fails naming the key path. Loading a manifest file
is ``data.manifest``'s.

Format options are checked against the reader functions' keyword-only parameters
(``retrieval_core.data.readers``), so the readers stay the one place that defines them.
"""
from __future__ import annotations

import glob
import inspect
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from . import readers
from .paths import is_url
from .schema import DEFAULT_MAX_REGIONS
from .synthetic.spec import SyntheticSpec

IMAGE_FORMATS = ("synthetic", "butd_tsv", "bua_npz", "uniter_npz", "oscar_pt", "plain_npz", "image_files")
CAPTION_FORMATS = ("synthetic", "karpathy_json", "caption_lines", "flickr30k_entities", "cc_tsv", "multi30k")
ROLES = ("query", "distractor")
FEATURE_FORMATS = ("parquet", "hdf5")
FEATURE_DTYPES = ("float32", "float16")
#: Options (besides ``path``) that name files: expanded, resolved against RR_DATA_ROOT, checked by missing_paths.
PATH_OPTIONS = ("ids_path", "id_mapping", "image_list", "image_dir")
#: Options the manifest requires although the reader has a fallback (explicit beats guessed file names).
EXTRA_REQUIRED = {"caption_lines": ("ids_path",)}

TOP_LEVEL_KEYS = ("name", "description", "feature_dim", "max_regions", "feature_format", "feature_dtype",
                  "collections", "benchmark")
COLLECTION_KEYS = ("images", "captions", "expected_images", "expected_captions", "role", "uncaptioned_images")
#: ``uncaptioned_images``: keep = stage every image the image source holds; skip = stage only the images the
#: collection's captions name, each in its captions' split (a trainval TSV + a Karpathy JSON -> train/val/test).
UNCAPTIONED = ("keep", "skip")
#: Generator options a synthetic ``captions:`` block may set (the others describe the images: under ``images:``).
SYNTHETIC_CAPTION_OPTIONS = ("captions_per_image", "languages")
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_GLOB_CHARS = re.compile(r"[*?\[]")


class ManifestError(ValueError):
    pass


@dataclass
class SourceSpec:
    """An ``images:`` or ``captions:`` block. ``options`` = every key but format and path. For synthetic
    captions, ``options`` also holds the collection's synthetic image options (the generator needs both)."""
    format: str
    path: Optional[str | list[str]]
    options: dict = field(default_factory=dict)


@dataclass
class CollectionSpec:
    name: str
    images: SourceSpec
    captions: SourceSpec
    expected_images: Optional[int | dict[str, int]] = None  # a count, or {split: count}
    expected_captions: Optional[int | dict[str, int]] = None
    role: str = "query"
    uncaptioned_images: str = "keep"

    def expected_total(self, kind: str) -> Optional[int]:
        """expected_images / expected_captions as one number (a per-split mapping summed), None if unknown."""
        value = self.expected_images if kind == "images" else self.expected_captions
        return sum(value.values()) if isinstance(value, dict) else value


@dataclass
class Manifest:
    name: str
    path: str
    description: str
    feature_dim: int
    collections: dict[str, CollectionSpec]
    max_regions: int = DEFAULT_MAX_REGIONS
    feature_format: str = "parquet"
    feature_dtype: str = "float32"
    benchmark: dict = field(default_factory=dict)

    def collection(self, name: str) -> CollectionSpec:
        if name not in self.collections:
            raise ManifestError(f"{os.path.basename(self.path)}: collections: no collection {name!r} "
                                f"(has: {', '.join(self.collections)})")
        return self.collections[name]

    def synthetic_spec(self, name: str):
        """The ``SyntheticSpec`` of a synthetic collection."""

        coll = self.collection(name)
        if coll.images.format != "synthetic":
            raise ManifestError(f"{os.path.basename(self.path)}: collections.{name}.images.format: "
                                f"{coll.images.format!r} is not synthetic")
        return SyntheticSpec.from_options(name, coll.images.options, self.feature_dim)

    def input_paths(self) -> list[tuple[str, str]]:
        """(key path, file path or glob) of every input this manifest names."""
        out = []
        for cname, coll in self.collections.items():
            for kind, src in (("images", coll.images), ("captions", coll.captions)):
                for key, value in [("path", src.path)] + [(k, src.options.get(k)) for k in PATH_OPTIONS]:
                    for p in ([value] if isinstance(value, str) else value or []):
                        out.append((f"collections.{cname}.{kind}.{key}", p))
        return out

    def missing_paths(self, files=None) -> list[str]:
        """Input paths (globs expanded) that do not exist; empty when every input is there.

        Local paths are checked with os.path / glob. URL paths (gs://...) are checked through ``files`` (a
        ``readers.FileAccess``; the stage pipeline passes Beam FileSystems); without one they are skipped,
        not reported: this library cannot reach them, and the readers report a missing file when they open it.
        """
        return [p for _, p in self.input_paths() if not _path_exists(p, files)]

    def check_paths(self, files=None) -> None:
        """Raise a ManifestError naming every missing input with its key path (URLs as in missing_paths)."""
        missing = [(k, p) for k, p in self.input_paths() if not _path_exists(p, files)]
        if missing:
            lines = "\n".join(f"  {k}: {p}" for k, p in missing)
            raise ManifestError(f"{os.path.basename(self.path)}: {len(missing)} input path(s) do not exist "
                                f"(override with RR_<COLLECTION>_<IMAGES|CAPTIONS>_PATH, RR_DATA_ROOT or "
                                f"<collection>.<images|captions>.path=...):\n{lines}")

    def to_dict(self) -> dict:
        return asdict(self)


def _path_exists(path: str, files) -> bool:
    """Whether an input (file, directory or glob) exists; a URL without ``files`` counts as present
    (unchecked: no Beam here)."""
    if not is_url(path):
        return bool(glob.glob(path)) if _GLOB_CHARS.search(path) else os.path.exists(path)
    if files is None:
        return True
    return bool(files.match(path)) if _GLOB_CHARS.search(path) else files.exists(path) or files.isdir(path)


def _positive_int(value, key: str, fail, optional: bool = False) -> Optional[int]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(key, f"must be a positive integer, got {value!r}")
    return value


def _expected(value, key: str, fail) -> Optional[int | dict[str, int]]:
    """An expected count: null, a positive integer, or a mapping {split: positive integer}."""
    if isinstance(value, dict):
        if not value:
            fail(key, "an empty mapping (give {split: count, ...}, a count, or null)")
        for split, n in value.items():
            if not isinstance(split, str) or not split:
                fail(key, f"split names must be non-empty strings, got {split!r}")
            _positive_int(n, f"{key}.{split}", fail, optional=False)
        return dict(value)
    return _positive_int(value, key, fail, optional=True)


def _choice(value, choices, key: str, fail, what: str = "value") -> str:
    if value not in choices:
        fail(key, f"unknown {what} {value!r} (expected one of: {', '.join(choices)})")
    return value


def _reader_params(kind: str, fmt: str) -> tuple[set, set]:
    """(allowed, required) keyword options of a format's reader."""
    reader = (readers.IMAGE_READERS if kind == "images" else readers.CAPTION_READERS)[fmt]
    params = inspect.signature(reader).parameters
    allowed = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    required = {n for n in allowed if params[n].default is inspect.Parameter.empty}
    return allowed, required | set(EXTRA_REQUIRED.get(fmt, ()))


def _source(block, kind: str, key: str, fail) -> SourceSpec:
    if not isinstance(block, dict):
        fail(key, f"must be a mapping with at least 'format', got {block!r}")
    formats = IMAGE_FORMATS if kind == "images" else CAPTION_FORMATS
    if "format" not in block:
        fail(f"{key}.format", f"missing (expected one of: {', '.join(formats)})")
    fmt = _choice(block["format"], formats, f"{key}.format", fail, "format")
    path = block.get("path")
    options = {k: v for k, v in block.items() if k not in ("format", "path")}
    if fmt == "synthetic":
        if path is not None:
            fail(f"{key}.path", "synthetic sources are generated: remove the path")
        return SourceSpec(fmt, None, options)
    if path is None or path == "" or path == []:
        fail(f"{key}.path", f"required for format {fmt!r}")
    if not (isinstance(path, str) or (isinstance(path, list) and all(isinstance(p, str) and p for p in path))):
        fail(f"{key}.path", f"must be a string (file, directory or glob) or a list of them, got {path!r}")
    allowed, required = _reader_params(kind, fmt)
    unknown = sorted(set(options) - allowed)
    if unknown:
        fail(f"{key}.{unknown[0]}", f"unknown option(s) {', '.join(unknown)} for format {fmt!r} "
                                    f"(expected: {', '.join(sorted(allowed)) or 'none'})")
    for name in sorted(required):
        if options.get(name) in (None, ""):
            fail(f"{key}.{name}", f"required for format {fmt!r}")
    for name in PATH_OPTIONS:
        if name in options and not isinstance(options[name], str):
            fail(f"{key}.{name}", f"must be a path string, got {options[name]!r}")
    return SourceSpec(fmt, path, options)


def _collection(cname, block, feature_dim: int, fail, follow: frozenset = frozenset()) -> CollectionSpec:
    """``follow``: the expected_* keys set to the generator's counts instead of checked (size overrides)."""
    key = f"collections.{cname}"
    if not isinstance(cname, str) or not _NAME.match(cname):
        fail(key, "collection names use letters, digits, '_' and '-' only (they appear in ids and env vars)")
    if not isinstance(block, dict):
        fail(key, f"must be a mapping with images: and captions:, got {block!r}")
    unknown = sorted(set(block) - set(COLLECTION_KEYS))
    if unknown:
        fail(f"{key}.{unknown[0]}", f"unknown key(s) {', '.join(map(str, unknown))} "
                                    f"(expected: {', '.join(COLLECTION_KEYS)})")
    for part in ("images", "captions"):
        if part not in block:
            fail(f"{key}.{part}", "missing")
    images = _source(block["images"], "images", f"{key}.images", fail)
    captions = _source(block["captions"], "captions", f"{key}.captions", fail)
    exp_i = _expected(block.get("expected_images"), f"{key}.expected_images", fail)
    exp_c = _expected(block.get("expected_captions"), f"{key}.expected_captions", fail)
    role = _choice(block.get("role", "query"), ROLES, f"{key}.role", fail, "role")
    uncaptioned = _choice(block.get("uncaptioned_images", "keep"), UNCAPTIONED, f"{key}.uncaptioned_images", fail)
    if uncaptioned == "skip":
        if "synthetic" in (images.format, captions.format):
            fail(f"{key}.uncaptioned_images", "skip selects file images by their captions; synthetic "
                                              "collections are generated with their captions (remove it)")
        if images.options.get("split") is not None:
            fail(f"{key}.images.split", "with uncaptioned_images: skip each image takes its captions' split "
                                        "(set the split on captions:, remove it here)")

    if captions.format == "synthetic" and images.format != "synthetic":
        fail(f"{key}.captions.format", "synthetic captions need synthetic images (they describe the generated scenes)")
    if images.format == "synthetic":

        for name, value in (("expected_images", exp_i), ("expected_captions", exp_c)):
            if isinstance(value, dict):
                fail(f"{key}.{name}", "per-split counts are checks of file sources; give a synthetic "
                                      "collection's total (or null)")

        opts = dict(images.options)
        if captions.format == "synthetic":
            extra = sorted(set(captions.options) - set(SYNTHETIC_CAPTION_OPTIONS))
            if extra:
                fail(f"{key}.captions.{extra[0]}", f"synthetic captions take only "
                                                   f"{' and '.join(SYNTHETIC_CAPTION_OPTIONS)} "
                                                   "(other generator options go under images:)")
            for name in SYNTHETIC_CAPTION_OPTIONS:
                if name in captions.options:
                    if name in opts and opts[name] != captions.options[name]:
                        fail(f"{key}.captions.{name}", f"differs from images.{name}")
                    opts[name] = captions.options[name]
        try:
            spec = SyntheticSpec.from_options(cname, opts, feature_dim)
        except (TypeError, ValueError) as e:
            fail(f"{key}.images", str(e))
        images = SourceSpec("synthetic", None, opts)
        if captions.format == "synthetic":
            captions = SourceSpec("synthetic", None, dict(opts))  # the generator needs the image options too
            if exp_c is not None and "expected_captions" in follow:
                exp_c = spec.num_captions
            if exp_c is not None and exp_c != spec.num_captions:
                langs = f" x {len(spec.languages)} languages" if len(spec.languages) > 1 else ""
                fail(f"{key}.expected_captions", f"{exp_c} but the generator makes {spec.num_images} x "
                                                 f"{spec.captions_per_image}{langs} = {spec.num_captions} (set "
                                                 f"{cname}.expected_captions={spec.num_captions} or remove it)")
        if exp_i is not None and "expected_images" in follow:
            exp_i = spec.num_images
        if exp_i is not None and exp_i != spec.num_images:
            fail(f"{key}.expected_images", f"{exp_i} but images.num_images is {spec.num_images} (set "
                                           f"{cname}.expected_images={spec.num_images} or remove it)")
    return CollectionSpec(cname, images, captions, exp_i, exp_c, role, uncaptioned)


def _benchmark(block, collections: dict, fail) -> dict:
    if block is None:
        return {}
    if not isinstance(block, dict):
        fail("benchmark", f"must be a mapping, got {block!r}")
    out = dict(block)
    names = ", ".join(collections)
    q = block.get("query_collection")
    if q is not None and q not in collections:
        fail("benchmark.query_collection", f"no collection {q!r} (has: {names})")
    d = block.get("distractor_collections", [])
    if d is None:
        d = []
    if not isinstance(d, list) or not all(isinstance(x, str) for x in d):
        fail("benchmark.distractor_collections", f"must be a list of collection names, got {d!r}")
    for x in d:
        if x not in collections:
            fail("benchmark.distractor_collections", f"no collection {x!r} (has: {names})")
        if x == q:
            fail("benchmark.distractor_collections", f"{x!r} is also the query_collection")
    if len(set(d)) != len(d):
        fail("benchmark.distractor_collections", f"repeats a name: {d}")
    out["distractor_collections"] = list(d)
    if "split" in block and not isinstance(block["split"], str):
        fail("benchmark.split", f"must be a split name, got {block['split']!r}")
    return out


def validate_manifest(raw: dict, path: str, fail, follow: Optional[Mapping[str, set[str]]] = None) -> Manifest:
    """The ``Manifest`` that ``raw`` (parsed from ``path``) describes; ``fail(key, message)`` raises on the first
    problem. ``follow``: per collection, the ``expected_*`` keys that follow a size override (see load_manifest)."""
    unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
    if unknown:
        fail(str(unknown[0]), f"unknown top-level key(s) {', '.join(map(str, unknown))} "
                              f"(expected: {', '.join(TOP_LEVEL_KEYS)})")
    if "feature_dim" not in raw:
        fail("feature_dim", "missing (the region feature width, e.g. 2048 for bottom-up-attention)")
    feature_dim = _positive_int(raw["feature_dim"], "feature_dim", fail)
    max_regions = _positive_int(raw.get("max_regions", DEFAULT_MAX_REGIONS), "max_regions", fail)
    feature_format = _choice(raw.get("feature_format", "parquet"), FEATURE_FORMATS, "feature_format", fail)
    feature_dtype = _choice(raw.get("feature_dtype", "float32"), FEATURE_DTYPES, "feature_dtype", fail)
    name = raw.get("name", Path(path).stem)
    if not isinstance(name, str) or not name:
        fail("name", f"must be a non-empty string, got {name!r}")
    description = raw.get("description") or ""
    if not isinstance(description, str):
        fail("description", f"must be a string, got {description!r}")
    colls = raw.get("collections")
    if not isinstance(colls, dict) or not colls:
        fail("collections", "missing or empty (a mapping: name -> {images:, captions:})")
    follow = follow or {}
    collections = {c: _collection(c, b, feature_dim, fail, frozenset(follow.get(c, ()))) for c, b in colls.items()}
    benchmark = _benchmark(raw.get("benchmark"), collections, fail)
    return Manifest(name=name, path=str(path), description=description, feature_dim=feature_dim,
                    collections=collections, max_regions=max_regions, feature_format=feature_format,
                    feature_dtype=feature_dtype, benchmark=benchmark)

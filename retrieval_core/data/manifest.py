"""Load and validate data manifests (``data_manifests/*.yaml``): which collections to stage, from which files.

Every error is a :class:`ManifestError` whose message names the file and the key path, e.g.
``demo.yaml: collections.coco.images.format: unknown format 'tsv' (expected one of: ...)``.

Loading order: YAML -> env path overrides (``RR_<COLLECTION>_<IMAGES|CAPTIONS>_PATH``) -> CLI overrides
(``coco.images.path=/x``, ``feature_dim=1024``) -> ``${VAR}`` / ``${VAR:-default}`` expansion -> validation ->
relative paths resolved against ``RR_DATA_ROOT`` (else the current directory; it may be a URL such as
``gs://bucket/data``); URL paths (``gs://...``) are kept as written. Input files are not opened here (the
stager reports unreadable ones); :meth:`Manifest.missing_paths` lists the ones that do not exist (URLs only
when given a file access that reaches them: no Beam here).

Size overrides: when a CLI override changes a synthetic collection's generator options (``demo.images.
num_images=200``) and does not set its ``expected_images`` / ``expected_captions``, those checks follow the
generator's new counts (they guard the YAML's own numbers); ``expected_*`` set by an override are checked.
A file source's ``expected_*`` (a count or ``{split: count}``) cannot follow an override: the stager checks
them against what it staged and reports a mismatch as a warning naming the key to set, not as an error.

``uncaptioned_images: skip`` (a collection key) stages only the images its captions name, each in their split.

Format options are checked against the reader functions' keyword-only parameters
(``retrieval_core.data.readers``), so the readers stay the one place that defines them.
"""
from __future__ import annotations

import glob
import inspect
import os
import posixpath
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from . import readers
from .paths import is_url
from .schema import DEFAULT_MAX_REGIONS
from .synthetic.spec import SyntheticSpec

IMAGE_FORMATS = ("synthetic", "butd_tsv", "bua_npz", "uniter_npz", "oscar_pt", "plain_npz")
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
MANIFEST_DIR = Path(__file__).resolve().parents[2] / "data_manifests"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
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


# ------------------------------------------------------------------------------------ locating
def list_shipped_manifests() -> list[str]:
    return sorted(p.stem for p in MANIFEST_DIR.glob("*.yaml"))


def resolve_manifest_path(path_or_name: str) -> str:
    """A shipped manifest name ("demo") -> its file; anything that looks like a path is used as is."""
    text = os.fspath(path_or_name)
    looks_like_path = os.sep in text or "/" in text or text.endswith((".yaml", ".yml"))
    if looks_like_path or os.path.isfile(text):
        if not os.path.isfile(text):
            raise ManifestError(f"{text}: manifest file not found")
        return text
    candidate = MANIFEST_DIR / f"{text}.yaml"
    if candidate.is_file():
        return str(candidate)
    raise ManifestError(f"{text}: no such manifest (shipped: {', '.join(list_shipped_manifests())}; "
                        f"or give a path to a .yaml file)")


# ------------------------------------------------------------------------------------ loading
def load_manifest(path_or_name: str, overrides: Sequence[str] = (), env: Optional[Mapping[str, str]] = None
                  ) -> Manifest:
    path = resolve_manifest_path(path_or_name)
    env = os.environ if env is None else env
    fname = os.path.basename(path)

    def fail(key: str, msg: str):
        raise ManifestError(f"{fname}: {key}: {msg}" if key else f"{fname}: {msg}")

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as e:
        fail("", f"not valid YAML: {e}")
    if not isinstance(raw, dict):
        fail("", "expected a mapping at the top level")
    collections = raw.get("collections")
    if isinstance(collections, dict):
        _apply_env_paths(collections, env)
    touched = [_apply_override(raw, item, fail) for item in overrides]
    raw = _expand(raw, env, "", fail)
    manifest = _validate(raw, path, fail, _expected_that_follow(touched))
    root = env.get("RR_DATA_ROOT") or os.getcwd()
    for coll in manifest.collections.values():
        for src in (coll.images, coll.captions):
            src.path = _resolve(src.path, root)
            for k in PATH_OPTIONS:
                if k in src.options:
                    src.options[k] = _resolve(src.options[k], root)
    return manifest


def env_path_var(collection: str, kind: str) -> str:
    """Name of the env var that overrides a collection's images/captions path."""
    return f"RR_{re.sub(r'[^A-Za-z0-9]', '_', collection).upper()}_{kind.upper()}_PATH"


def _apply_env_paths(collections: dict, env: Mapping[str, str]) -> None:
    for cname, coll in collections.items():
        for kind in ("images", "captions"):
            value = env.get(env_path_var(str(cname), kind))
            if value and isinstance(coll, dict) and isinstance(coll.get(kind), dict):
                coll[kind]["path"] = value


def _expected_that_follow(touched: Sequence[list[str]]) -> dict[str, set[str]]:
    """{collection: the expected_* keys that follow its generator}: those of collections whose images/captions
    an override changed, less the expected_* an override set itself (or a whole-collection override)."""
    sized, explicit = set(), set()
    for parts in touched:
        if parts[0] != "collections" or len(parts) < 2:
            continue
        if len(parts) == 2:  # the whole collection block: its expected_* are the user's
            explicit |= {(parts[1], "expected_images"), (parts[1], "expected_captions")}
        elif parts[2] in ("images", "captions"):
            sized.add(parts[1])
        elif parts[2] in ("expected_images", "expected_captions"):
            explicit.add((parts[1], parts[2]))
    return {c: {k for k in ("expected_images", "expected_captions") if (c, k) not in explicit} for c in sized}


def _apply_override(raw: dict, item: str, fail) -> list[str]:
    """Applies ``key.path=value`` to ``raw``; returns the key path from the top level (collections.<c>...)."""
    if "=" not in item:
        fail("", f"override {item!r} is not of the form key.path=value")
    key, value = item.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        fail("", f"override {item!r} has an empty key segment")
    collections = raw.get("collections") if isinstance(raw.get("collections"), dict) else {}
    if parts[0] not in TOP_LEVEL_KEYS:
        if parts[0] not in collections:
            fail("", f"override {item!r}: {parts[0]!r} is neither a top-level key ({', '.join(TOP_LEVEL_KEYS)}) "
                     f"nor a collection ({', '.join(map(str, collections)) or 'none'})")
        parts = ["collections"] + parts
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        fail(".".join(parts), f"override value {value!r} is not valid YAML: {e}")
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            fail(".".join(parts[:i + 1]), f"override {item!r} goes through a non-mapping value")
        node = nxt
    node[parts[-1]] = parsed
    return parts


def _expand(value: Any, env: Mapping[str, str], key: str, fail) -> Any:
    if isinstance(value, dict):
        return {k: _expand(v, env, f"{key}.{k}" if key else str(k), fail) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, env, f"{key}[{i}]", fail) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        got = env.get(name)
        if got:  # like the shell's ${VAR:-default}: an empty value counts as unset
            return got
        if default is not None:
            return default
        fail(key, f"environment variable {name} is not set (and ${{{name}}} has no :-default)")

    return _VAR.sub(sub, value)


def _resolve(path, root: str):
    if path is None:
        return None
    if isinstance(path, list):
        return [_resolve(p, root) for p in path]
    if is_url(path):  # gs://b/x.tsv is absolute: normpath + join with the root would make it <root>/gs:/b/x.tsv
        return path
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return path
    if is_url(root):  # RR_DATA_ROOT=gs://bucket/data: join with "/" (normpath would turn gs:// into gs:/)
        return f"{root.rstrip('/')}/{posixpath.normpath(path)}"
    return os.path.normpath(os.path.join(root, path))


# --------------------------------------------------------------------------------- validation
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


def _validate(raw: dict, path: str, fail, follow: Optional[Mapping[str, set[str]]] = None) -> Manifest:
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

"""Load and validate data manifests (``data_manifests/*.yaml``): which collections to stage, from which files.

Every error is a :class:`ManifestError` whose message names the file and the key path, e.g.
``demo.yaml: collections.coco.images.format: unknown format 'tsv' (expected one of: ...)``.

Loading order: YAML -> env path overrides (``RR_<COLLECTION>_<IMAGES|CAPTIONS>_PATH``) -> CLI overrides
(``coco.images.path=/x``, ``feature_dim=1024``) -> ``${VAR}`` / ``${VAR:-default}`` expansion -> validation ->
relative paths resolved against ``RR_DATA_ROOT`` (else the current directory; it may be a URL such as
``gs://bucket/data``); URL paths (``gs://...``) are kept as written -> confinement (below). Input files are
not opened here (the stager reports unreadable ones); :meth:`Manifest.missing_paths` lists the ones that do not
exist (URLs only when given a file access that reaches them: no Beam here).

Size overrides: when a CLI override changes a synthetic collection's generator options (``demo.images.
num_images=200``) and does not set its ``expected_images`` / ``expected_captions``, those checks follow the
generator's new counts (they guard the YAML's own numbers); ``expected_*`` set by an override are checked.
A file source's ``expected_*`` (a count or ``{split: count}``) cannot follow an override: the stager checks
them against what it staged and reports a mismatch as a warning naming the key to set, not as an error.

``uncaptioned_images: skip`` (a collection key) stages only the images its captions name, each in their split.

Confinement: a path written in the manifest must resolve (``..`` and symlinks followed) inside one of its
roots: the data root (``RR_DATA_ROOT``, else the current directory: where relative paths resolve), the folder
holding the manifest file, and, for a path that starts with ``${VAR}`` set in the environment, that variable's
folder. Anything else is a ManifestError naming the key, the path, where it leads and the roots. Paths the
user gives outside the file (``--set`` overrides, ``RR_<COLLECTION>_<KIND>_PATH``) are taken as written: they
are the user's own command line. A URL path escapes only by a ``..`` segment (object stores have no symlinks).

What a valid manifest holds, and its validation, are ``data.manifest_spec``'s.
"""
from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from .manifest_spec import PATH_OPTIONS, TOP_LEVEL_KEYS, Manifest, ManifestError, validate_manifest
from .paths import escapes_roots, is_url

MANIFEST_DIR = Path(__file__).resolve().parents[2] / "data_manifests"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


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
    declared = _declared_roots(collections, env) if isinstance(collections, dict) else {}
    given = _apply_env_paths(collections, env) if isinstance(collections, dict) else set()
    touched = [_apply_override(raw, item, fail) for item in overrides]
    raw = _expand(raw, env, "", fail)
    manifest = validate_manifest(raw, path, fail, _expected_that_follow(touched))
    root = env.get("RR_DATA_ROOT") or os.getcwd()
    roots = {root: "RR_DATA_ROOT" if env.get("RR_DATA_ROOT") else "the current directory"}
    own = os.path.dirname(os.path.abspath(path))
    roots[own] = f"{roots[own]}, the manifest's folder" if own in roots else "the manifest's folder"
    for cname, coll in manifest.collections.items():
        for kind, src in (("images", coll.images), ("captions", coll.captions)):
            written = {"path": src.path, **{k: src.options.get(k) for k in PATH_OPTIONS}}
            src.path = _resolve(src.path, root)
            for k in PATH_OPTIONS:
                if k in src.options:
                    src.options[k] = _resolve(src.options[k], root)
            for key in ("path",) + PATH_OPTIONS:
                where = ["collections", cname, kind, key]
                if (cname, kind, key) in given or any(where[:len(t)] == t for t in touched):
                    continue  # the user's own environment or command line, not the file's text
                value = src.path if key == "path" else src.options.get(key)
                texts = [written[key]] if isinstance(value, str) else written[key] or []
                for i, (p, text) in enumerate(zip([value] if isinstance(value, str) else value or [], texts)):
                    index = None if isinstance(value, str) else i
                    extra = declared.get((cname, kind, key, index))
                    _confine(p, text, {**roots, **({extra[1]: f"${extra[0]}"} if extra else {})},
                             f"collections.{cname}.{kind}.{key}" + ("" if index is None else f"[{i}]"),
                             (cname, kind, key), fail)
    return manifest


def _declared_roots(collections: dict, env: Mapping[str, str]) -> dict[tuple, tuple[str, str]]:
    """{(collection, kind, key, list index or None): (VAR, its value)} for each path written in the file that
    starts with ``${VAR}`` set in the environment: the user declared that folder a root of the path."""
    out = {}
    for cname, coll in collections.items():
        for kind in ("images", "captions"):
            block = coll.get(kind) if isinstance(coll, dict) else None
            for key in ("path",) + PATH_OPTIONS if isinstance(block, dict) else ():
                value = block.get(key)
                for i, text in enumerate([value] if isinstance(value, str) else value or []):
                    m = _VAR.match(text) if isinstance(text, str) else None
                    if m and env.get(m.group(1)):
                        out[(cname, kind, key, None if isinstance(value, str) else i)] = (m.group(1),
                                                                                          env[m.group(1)])
    return out


def _confine(path: str, text: str, roots: Mapping[str, str], key: str, where: tuple[str, str, str], fail) -> None:
    """A ManifestError (via ``fail``) when ``path`` (resolved from ``text``, as the file gives it after
    ``${VAR}`` expansion) resolves outside every root (see the module docstring)."""
    leads = escapes_roots(path, list(roots))
    if leads is None:
        return
    cname, kind, name = where
    named = "; ".join(f"{r} ({why})" for r, why in roots.items())
    fail(key, f"{text!r} resolves to {leads}, outside the manifest's roots ({named}): keep the data under a root, "
              f"set RR_DATA_ROOT to its folder, or give the path on the command line (--set "
              f"{cname}.{kind}.{name}=...{' or ' + env_path_var(cname, kind) if name == 'path' else ''})")


def env_path_var(collection: str, kind: str) -> str:
    """Name of the env var that overrides a collection's images/captions path."""
    return f"RR_{re.sub(r'[^A-Za-z0-9]', '_', collection).upper()}_{kind.upper()}_PATH"


def _apply_env_paths(collections: dict, env: Mapping[str, str]) -> set[tuple[str, str, str]]:
    """Sets each RR_<COLLECTION>_<KIND>_PATH given; returns the (collection, kind, "path") it set."""
    given = set()
    for cname, coll in collections.items():
        for kind in ("images", "captions"):
            value = env.get(env_path_var(str(cname), kind))
            if value and isinstance(coll, dict) and isinstance(coll.get(kind), dict):
                coll[kind]["path"] = value
                given.add((str(cname), kind, "path"))
    return given


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

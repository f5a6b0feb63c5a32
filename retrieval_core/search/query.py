"""Your own queries against a built index, from Python (no Beam): load the models, the index and the staged store
once, then ask.

    engine = QueryEngine(staged="runs/staged_demo", embeddings="runs/emb", index="runs/index")
    hits = engine.search_text(["a red car next to a tree"], k=10, rerank="co")      # a pandas DataFrame
    hits = engine.search_images([staged_image_id, "photos/dog.jpg"], k=10, rerank="norm_add", lam=0.2)
    hits = engine.search_text(["two dogs"], k=10, rerank="auto", tune_on="runs/rankings-auto")  # as that run chose

A text query (t2i) is encoded by the bi-encoder (BE) that encoded ``embeddings``; the image pool (``index``, an
image FAISS index built from ``embeddings``, else exact search over their image vectors) gives its top k; the
cross-encoder (CE) scores the query with each candidate's staged regions, and ``retrieval_core.search.rerank``
(the one fusion and ranking of the project) orders them. An image query (i2t) is a staged image (its item id, or
its source id) or a picture file, turned into regions by the image backbone the staged folder was built with
(``data.pixels.backbone.backbone_for``: refused when it would make other features); the pool is the captions
(``text_index``, else exact search), reranked with the candidates' staged text.

Every call returns one row per hit (:data:`HIT_COLUMNS`): direction, query_id, query, rank, item_id, source_id
(the hit's id in its collection), text (a caption hit's text), be_rank, be_score, ce_score (NaN for ``emb``) and
final_score, best first per query, in the order the queries came. ``pipelines.query`` runs the same calls, batch
by batch, so the job and this entry point give the same scores. Queries that cannot be answered are not dropped:
``hits.attrs["rejected"]`` lists them with their reason (empty, duplicate, unknown id, unreadable picture) and
``hits.attrs["truncated"]`` the ids of texts longer than the model reads (cut, and answered): queries in =
answered + rejected.

Inputs are checked before anything loads (:func:`check_inputs`): the model must be the one that encoded the
embeddings, an index must have been built from them, the embeddings from the staged folder, and the staged
features must be those the models were trained on; each mismatch is one QueryError naming both sides.
"""
from __future__ import annotations

import collections
import csv
import io
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd

from retrieval_core.cli import apply_device_and_threads, resolve_device
from retrieval_core.data import schema
from retrieval_core.data.paths import FileAccess, file_exists, is_url, read_file
from retrieval_core.data.pixels.backbone import FeatureSourceError, backbone_for
from retrieval_core.data.region_file import RegionFile, ensure_region_file
from retrieval_core.data.store import StagedDataset
from retrieval_core.memory import HeapTrimmer, without_onednn
from retrieval_core.model.checkpoints import CheckpointError, ModelFolder, inspect_model_folder, load_model_folder
from retrieval_core.precision import check_quantize, resolve_quantize
from retrieval_core.search import embeddings, rerank
from retrieval_core.search.index import IndexIntegrityError, check_search_params, set_threads
from retrieval_core.search.index_folder import (
    INDEX_MANIFEST,
    check_index_source,
    load_index_manifest,
    load_sharded_index,
)

T2I, I2T = schema.DIRECTION_T2I, schema.DIRECTION_I2T
#: The ranking modes a query takes (rerank's run modes but the exhaustive ``ce``): emb (BE only), co (the CE's
#: order in the top k), add / norm_add (BE and CE fused in the top k, weight ``lam`` on the BE score).
MODES = ("emb", "co", "add", "norm_add")
#: Or the mode a finished ``--mode auto`` rerank run chose on its dev split (``tune_on``: that run's folder).
AUTO = "auto"
#: One row per hit, in this order (the job's Parquet and JSONL rows too).
HIT_COLUMNS = ("direction", "query_id", "query", "rank", "item_id", "source_id", "text", "be_rank", "be_score",
               "ce_score", "final_score")
#: Why a query is not answered (the text before the first ':' of a reject's reason).
R_EMPTY = "empty query"
R_DUPLICATE = "duplicate"
R_UNKNOWN_ID = "unknown id"
R_UNREADABLE = "unreadable picture"
R_BAD_LINE = "unreadable line"
REASONS = (R_EMPTY, R_DUPLICATE, R_UNKNOWN_ID, R_UNREADABLE, R_BAD_LINE)
#: Query files: JSON lines and CSV by their suffix, anything else one query per line.
JSONL_SUFFIXES, CSV_SUFFIXES = (".jsonl", ".json", ".ndjson"), (".csv",)
#: Bytes of staged regions an engine keeps between calls, whole shards, least recently used dropped first: the demo's
#: 5,000 images (245 MB at 12 regions of 1024 float32) stay in memory; a larger pool reads a shard per miss (a budget
#: of a few shards thrashed at the demo's size).
CACHED_IMAGE_BYTES = 1 << 30
#: Queries between two heap trims (memory.HeapTrimmer): batches of other caption lengths and candidate counts
#: leave free holes in glibc's heap; untrimmed, the query job's peak grew from 1.4 to 2.4 GB between 500 and 5,000
#: queries over 5,000 images (docs/log/ENGINEERING-2026-11.md, "QUERY: memory and the number of queries").
TRIM_EVERY_QUERIES = 32


class QueryError(ValueError):
    """Inputs that cannot answer queries (models, index, embeddings and staged folder that do not belong together)."""


@dataclass(frozen=True)
class Query:
    """One query: ``text`` (t2i; ``lang`` optional), or ``image`` (i2t): a staged image's item id or source id, or
    a picture file (``picture`` True)."""
    id: str
    text: Optional[str] = None
    lang: Optional[str] = None
    image: Optional[str] = None
    picture: bool = False

    @property
    def direction(self) -> str:
        return T2I if self.image is None else I2T

    @property
    def shown(self) -> str:
        return self.text if self.image is None else self.image


@dataclass(frozen=True)
class Rejected:
    """A query that is not answered, with its reason (one of :data:`REASONS`, then details)."""
    id: str
    query: str
    reason: str

    def to_dict(self) -> dict:
        return {"query_id": self.id, "query": self.query, "reason": self.reason}


# ------------------------------------------------------------------------------------------ queries in
def _suffix(path: str) -> str:
    return os.path.splitext(str(path))[1].lower()


def read_text_queries(path: str, files: Optional[FileAccess] = None) -> tuple[list[Query], list[Rejected]]:
    """Text queries of a file: JSON lines or CSV (``id``, ``text``, optional ``lang``; ``id`` defaults to the line
    or row number) by suffix, else one query per line (its id: the line number, from 1). Returns the queries to
    answer and those rejected (:func:`check_queries`); a line that is no JSON object is rejected too."""
    try:
        data = read_file(path, files)
    except FileNotFoundError:
        raise QueryError(f"query file {path} not found") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise QueryError(f"query file {path} is not UTF-8 text ({exc})") from None
    queries: list[Query] = []
    bad: list[Rejected] = []
    if _suffix(path) in JSONL_SUFFIXES:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                queries.append(Query(str(n), ""))
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                bad.append(Rejected(str(n), line[:200], f"{R_BAD_LINE}: line {n} is not JSON ({exc})"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("text", ""), str):
                bad.append(Rejected(str(n), line[:200], f"{R_BAD_LINE}: line {n} is not an object with a text"))
                continue
            queries.append(Query(str(obj.get("id", n)), obj.get("text") or "", obj.get("lang")))
    elif _suffix(path) in CSV_SUFFIXES:
        rows = csv.DictReader(io.StringIO(text))
        if "text" not in (rows.fieldnames or []):
            raise QueryError(f"query file {path}: a CSV needs a header with a text column (id and lang optional), "
                             f"got {rows.fieldnames}")
        for n, row in enumerate(rows, 1):
            queries.append(Query(str(row.get("id") or n), row.get("text") or "", row.get("lang") or None))
    else:
        queries = [Query(str(n), line) for n, line in enumerate(text.splitlines(), 1)]
    kept, rejected = check_queries(queries)
    return kept, bad + rejected


def read_image_queries(ids_file: Optional[str] = None, pictures: Optional[str] = None,
                       files: Optional[FileAccess] = None) -> tuple[list[Query], list[Rejected]]:
    """Image queries: ``ids_file`` lists staged images, one item id or source id per line (the query id: as
    written); ``pictures`` is a folder, glob or list file of picture files (``readers.images``; the query id: the
    file's stem). Returns the queries to answer and those rejected (:func:`check_queries`)."""
    from retrieval_core.data.readers.images import image_file_entries

    queries: list[Query] = []
    bad: list[Rejected] = []
    if ids_file is not None:
        try:
            lines = read_file(ids_file, files).decode("utf-8-sig").splitlines()
        except FileNotFoundError:
            raise QueryError(f"image id file {ids_file} not found") from None
        queries += [Query(line.strip(), image=line.strip()) for line in lines]
    if pictures is not None:
        try:
            entries = image_file_entries(pictures, files)
        except FileNotFoundError as exc:
            raise QueryError(str(exc)) from None
        for path, refused in entries:
            stem = os.path.splitext(os.path.basename(path))[0]
            if refused:
                bad.append(Rejected(stem, path, f"{R_UNREADABLE}: {refused}"))
            else:
                queries.append(Query(stem, image=path, picture=True))
    kept, rejected = check_queries(queries)
    return kept, bad + rejected


def check_queries(queries: Iterable[Query]) -> tuple[list[Query], list[Rejected]]:
    """(answered, rejected): an empty query, a second query with an id seen before, or the same text (and lang) or
    image asked again is rejected with its reason; the rest keep their order."""
    kept, rejected = [], []
    ids: set = set()
    seen: dict = {}
    for q in queries:
        what = q.shown if q.shown is not None else ""
        if not what.strip():
            kind = "text" if q.image is None else "id"
            rejected.append(Rejected(q.id, what, f"{R_EMPTY}: query {q.id} has no {kind}"))
            continue
        if q.id in ids:
            rejected.append(Rejected(q.id, what, f"{R_DUPLICATE}: id {q.id!r} is used by an earlier query"))
            continue
        key = (q.direction, " ".join(what.split()), q.lang)
        if key in seen:
            rejected.append(Rejected(q.id, what, f"{R_DUPLICATE}: the same query as {seen[key]!r}"))
            continue
        ids.add(q.id)
        seen[key] = q.id
        kept.append(q)
    return kept, rejected


def as_queries(items: Sequence, direction: str) -> list[Query]:
    """What ``search_text`` / ``search_images`` take, as Query objects: Query objects pass; strings are texts
    (t2i) or, for images, a staged id or a picture file (a path that exists); ints are staged ids; a (features,
    boxes) pair is an image's regions. Ids: the position in ``items`` (from 0) unless a Query names its own."""
    out = []
    for n, item in enumerate(items):
        if isinstance(item, Query):
            out.append(item)
        elif direction == T2I:
            if not isinstance(item, str):
                raise QueryError(f"text query {n} is a {type(item).__name__}, not a str")
            out.append(Query(str(n), item))
        elif isinstance(item, (int, np.integer)):
            out.append(Query(str(n), image=str(int(item))))
        elif isinstance(item, (str, os.PathLike)):
            path = os.fspath(item)
            out.append(Query(str(n), image=path, picture=os.path.isfile(path)))
        elif isinstance(item, tuple) and len(item) == 2:
            regions = (np.asarray(item[0]), np.asarray(item[1]))
            out.append(_RegionsQuery(str(n), image=f"<regions {n}>", regions=regions))
        else:
            raise QueryError(f"image query {n} is a {type(item).__name__}: give a staged id, a picture path or "
                             f"(features, boxes)")
    return out


@dataclass(frozen=True)
class _RegionsQuery(Query):
    """An image query given as its regions (features (n, F), boxes (n, 6))."""
    regions: tuple = field(default=(), compare=False)


# --------------------------------------------------------------------------------------- the inputs
@dataclass(frozen=True)
class EngineSpec:
    """What an engine loads: the staged folder, the embeddings (and the BE model that encoded them: ``model``, by
    default the path their manifest records), the image index for t2i and caption index for i2t (default: exact
    search over the embeddings), the CE (``ce_model``; default the BE folder when it has a CE head: JOIN), where
    and how they run. Plain values: it pickles to a Beam worker, which opens one engine per process."""
    staged: str
    embeddings: str
    index: Optional[str] = None
    text_index: Optional[str] = None
    model: Optional[str] = None
    ce_model: Optional[str] = None
    device: str = "auto"
    threads: Optional[int] = None
    quantize: str = "auto"
    batch_size: int = 64
    nprobe: Optional[int] = None
    ef_search: Optional[int] = None


@dataclass(frozen=True)
class Inputs:
    """The checked inputs of an engine (:func:`check_inputs`), as plain values: what a job records and
    fingerprints, and what the engine loads."""
    spec: EngineSpec
    device: str
    be: ModelFolder
    be_precision: str  # the precision the embeddings were encoded in (the queries are encoded alike)
    ce: Optional[ModelFolder]
    ce_precision: str
    searchers: Mapping[str, dict]  # direction -> {kind, path, fingerprint, params, pool, described}
    fingerprints: Mapping[str, str]  # what the answers depend on, by input
    image_backbone: Optional[dict]  # the staged folder's backbone description (None: extracted features)

    def fingerprint(self) -> dict:
        """What answers depend on (models, index, embeddings, staged content, precisions), for a job's plan."""
        return {"be": self.be.fingerprint, "be_precision": self.be_precision,
                "ce": self.ce.fingerprint if self.ce else None, "ce_precision": self.ce_precision,
                "search": {d: {k: s[k] for k in ("kind", "fingerprint", "params")} for d, s in self.searchers.items()},
                **self.fingerprints}


def _sha(path: str, files: Optional[FileAccess]) -> str:
    import hashlib

    return hashlib.sha256(read_file(path, files)).hexdigest() if file_exists(path, files) else "missing"


def _model(path: str, need: tuple[str, ...], what: str, files: Optional[FileAccess]) -> ModelFolder:
    try:
        return inspect_model_folder(path, files=files).require(need)
    except CheckpointError as exc:
        raise QueryError(f"{what}: {exc}") from None


def _searcher(spec: EngineSpec, direction: str, emb_manifest: dict, files: Optional[FileAccess]) -> dict:
    pool_modality = schema.MODALITY_IMAGE if direction == T2I else schema.MODALITY_TEXT
    index_dir, flag = (spec.index, "index") if direction == T2I else (spec.text_index, "text_index")
    if not index_dir:
        entry = embeddings.modality_entry(emb_manifest, pool_modality)
        return {"kind": "exact", "name": "exact", "path": spec.embeddings, "params": (), "pool": int(entry["count"]),
                "fingerprint": embeddings.manifest_sha256(spec.embeddings, files),
                "described": f"exact search over {pool_modality} embeddings in {spec.embeddings}"}
    try:
        manifest = load_index_manifest(index_dir, files)
        check_index_source(flag, index_dir, manifest, spec.embeddings, emb_manifest, pool_modality, files,
                           emb_flag="embeddings")
    except (IndexIntegrityError, embeddings.EmbeddingsError) as exc:
        raise QueryError(str(exc)) from None
    params = {n: v for n, v in (("nprobe", spec.nprobe), ("efSearch", spec.ef_search)) if v is not None} or \
        {n: int(v) for n, v in (manifest.get("search_params") or {}).items()}
    try:
        check_search_params(manifest["factory"], int(manifest["d"]), manifest["metric"], **params)
    except ValueError as exc:
        raise QueryError(f"{index_dir} ({manifest['factory']}): {exc}") from None
    return {"kind": "index", "name": f"FAISS {manifest['factory']}", "path": index_dir,
            "params": tuple(sorted(params.items())),
            "pool": int(manifest["ntotal"]),
            "fingerprint": _sha(os.path.join(index_dir, INDEX_MANIFEST) if "://" not in index_dir
                                else index_dir.rstrip("/") + "/" + INDEX_MANIFEST, files),
            "described": f"FAISS index {index_dir} ({manifest['factory']}, {manifest['metric']})"}


def check_inputs(spec: EngineSpec, directions: Sequence[str] = (T2I, I2T), needs_ce: bool = True,
                 files: Optional[FileAccess] = None) -> Inputs:
    """Check that the inputs of ``spec`` belong together, reading manifests and small JSON files only (no weights,
    no index): the embeddings were encoded from the staged folder by the BE model (``spec.model``, default the one
    their manifest names: its fingerprint must be the recorded one), each index was built from the embeddings, the
    staged features are those the models were trained on, and with ``needs_ce`` a CE exists. Each mismatch is one
    QueryError naming both sides. ``directions``: those whose pool must be searchable."""
    device = resolve_device(spec.device)
    ds = StagedDataset(spec.staged, files=files)
    try:
        emb_manifest = embeddings.load_embeddings_manifest(spec.embeddings, files)
        embeddings.check_encoded_from(spec.embeddings, emb_manifest, ds, flag="embeddings", staged_flag="staged folder")
    except embeddings.EmbeddingsError as exc:
        raise QueryError(str(exc)) from None
    recorded = emb_manifest["model"]
    be = _model(spec.model or recorded["path"], ("be",), "BE model", files)
    if be.fingerprint != recorded.get("sha256"):
        raise QueryError(f"BE model {be.path} (sha256 {be.fingerprint[:12]}...) is not the model that encoded the "
                         f"embeddings in {spec.embeddings} ({recorded.get('path')}, sha256 "
                         f"{str(recorded.get('sha256'))[:12]}...): query with the model that encoded them, or "
                         f"encode and index with this one")
    ce = None
    if needs_ce:
        if spec.ce_model:
            ce = _model(spec.ce_model, ("ce",), "CE model", files)
        elif "ce" in be.heads:
            ce = be
        else:
            raise QueryError(f"{be.path} has no cross-encoder head: pass a CE model (ce_model), or rank with emb")
    for folder, what in ((be, "BE model"), (ce, "CE model")):
        if folder is not None:
            try:
                folder.require_features(ds)
            except FeatureSourceError as exc:
                raise QueryError(f"{what}: {exc}") from None
    ce_precision = resolve_quantize(spec.quantize, device) if ce else "none"
    try:
        check_quantize(ce_precision, device)
    except ValueError as exc:
        raise QueryError(str(exc)) from None
    searchers = {d: _searcher(spec, d, emb_manifest, files) for d in directions}
    fingerprints = {"embeddings": embeddings.manifest_sha256(spec.embeddings, files),
                    "staged": json.dumps({f"{kind}/{c}": ds.content_sha256(kind, c) for c in ds.collections
                                          for kind in ("images", "captions")}, sort_keys=True)}
    return Inputs(spec, device, be, str(emb_manifest.get("quantize", "none")), ce, ce_precision, searchers,
                  fingerprints, ds.summary.get("image_backbone") or None)


# --------------------------------------------------------------------------------------- the engine
class _ImagePool:
    """Staged images' regions by id: the shard holding each id (one id column per shard, read once), and the
    regions of the shards read last, up to CACHED_IMAGE_BYTES (in the staged dtype, cut to the regions the CE
    reads). A local pool larger than that budget reads each candidate with one ``pread`` from the staged folder's
    region file (retrieval_core.data.region_file, built on first use, as training builds it) instead: with shards
    of 500 images, the CE's 20 candidates of a query at 100k images were 20 whole-shard reads."""

    def __init__(self, ds: StagedDataset, collections_: Sequence[str], max_regions: int):
        self.ds, self.max_regions = ds, max_regions
        ids, where, self.shards = [], [], []
        meta = []
        for c in collections_:
            for rel in ds.shard_names("images", c):
                table = ds.read_shard_columns(rel, ("item_id", "source_id"))
                meta.append(table)
                ids.append(table.column("item_id").to_numpy().astype(np.int64))
                where.append(np.full(len(ids[-1]), len(self.shards), dtype=np.int32))
                self.shards.append(rel)
        self.shard_of = dict(zip(np.concatenate(ids).tolist(), np.concatenate(where).tolist())) if ids else {}
        self.source_of = {int(i): str(s) for t in meta for i, s in zip(t.column("item_id").to_pylist(),
                                                                     t.column("source_id").to_pylist())}
        self._cache: collections.OrderedDict = collections.OrderedDict()  # shard -> ({id: regions}, bytes)
        pool_bytes = len(self.shard_of) * max_regions * ds.feature_dim * np.dtype(ds.feature_dtype).itemsize
        self.file: Optional[RegionFile] = None
        if pool_bytes > CACHED_IMAGE_BYTES and not is_url(ds.root):
            self.file = ensure_region_file(ds, max_regions, log=lambda m: print(m, file=sys.stderr, flush=True))
        self.by_source: dict[str, list[int]] = {}  # source id -> the item ids bearing it (one per collection)
        for item_id, source in self.source_of.items():
            self.by_source.setdefault(source, []).append(item_id)

    def _shard(self, n: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        if n in self._cache:
            self._cache.move_to_end(n)
            return self._cache[n][0]
        table = self.ds.read_image_shard(self.shards[n], dtype=np.dtype(self.ds.feature_dtype))
        regions, size = {}, 0
        for i, item_id in enumerate(table.item_ids.tolist()):
            feats, boxes = table.regions(i)
            regions[item_id] = (feats[:self.max_regions].copy(), boxes[:self.max_regions].copy())
            size += regions[item_id][0].nbytes + regions[item_id][1].nbytes
        self._cache[n] = (regions, size)
        while len(self._cache) > 1 and sum(b for _, b in self._cache.values()) > CACHED_IMAGE_BYTES:
            self._cache.popitem(last=False)
        return regions

    def warm(self) -> None:
        """Read shards into the cache in order while they fit CACHED_IMAGE_BYTES (``QueryEngine.load``); a region
        file is read per query."""
        for n in range(0 if self.file is not None else len(self.shards)):
            self._shard(n)
            if sum(b for _, b in self._cache.values()) * (n + 2) / (n + 1) > CACHED_IMAGE_BYTES:
                break

    def regions(self, item_ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        missing = [i for i in item_ids if int(i) not in self.shard_of]
        if missing:
            raise QueryError(f"image(s) {missing[:5]} are in the index but not staged in {self.ds.root}")
        if self.file is not None:
            return self.file.images([int(i) for i in item_ids]).read(range(len(item_ids)))
        return [self._shard(self.shard_of[int(i)])[int(i)] for i in item_ids]


class QueryEngine:
    """Models, searchers and staged store loaded once (each on first use), queried many times. Build it from an
    :class:`EngineSpec` or its fields as keywords; ``files``: how paths are read (default local; the pipelines pass
    Beam's FileSystems). Device and threads as everywhere (``retrieval_core.cli``): ``device="auto"`` is CUDA where
    torch sees one, else the CPU; ``threads`` sets torch's and faiss' threads."""

    def __init__(self, spec: Optional[EngineSpec] = None, *, files: Optional[FileAccess] = None,
                 directions: Sequence[str] = (T2I, I2T), needs_ce: bool = True, **fields):
        self.spec = spec if spec is not None else EngineSpec(**fields)
        self.files = files
        self.inputs = check_inputs(self.spec, directions, needs_ce, files)
        self.device = self.inputs.device
        apply_device_and_threads(self.device, self.spec.threads)
        if self.spec.threads:
            set_threads(self.spec.threads)
        self.ds = StagedDataset(self.spec.staged, files=files)
        self._be = self._ce = None
        self._searchers: dict = {}
        self._images: Optional[_ImagePool] = None
        self._captions: Optional[pd.DataFrame] = None
        self._backbone = None
        self._pool_collections = self._encoded_collections()
        self._choices: dict = {}  # (tune_on, k) -> the recorded fusion choice
        self._trimmer = HeapTrimmer(TRIM_EVERY_QUERIES)

    # -------------------------------------------------------------------------------------- loading
    def _encoded_collections(self) -> list[str]:
        """The staged collections the embeddings were encoded from (the pools): every one when unrecorded."""
        manifest = embeddings.load_embeddings_manifest(self.spec.embeddings, self.files)
        encoded = (manifest.get("inputs") or {}).get("collections")
        return [c for c in self.ds.collections if c in encoded] if encoded else list(self.ds.collections)

    @property
    def be_model(self):
        if self._be is None:
            inp = self.inputs
            self._be = load_model_folder(inp.be.path, need=("be",), device=self.device, quantize=inp.be_precision,
                                         files=self.files)
        return self._be

    @property
    def ce_model(self):
        inp = self.inputs
        if inp.ce is None:
            raise QueryError("this engine has no cross-encoder: rank with emb, or open it with a CE model")
        if self._ce is None:
            if inp.ce.fingerprint == inp.be.fingerprint and inp.ce_precision == inp.be_precision:
                self._ce = self.be_model  # JOIN: one model serves both heads
            else:
                self._ce = load_model_folder(inp.ce.path, need=("ce",), device=self.device,
                                             quantize=inp.ce_precision, files=self.files)
        return self._ce

    def _searcher(self, direction: str):
        if direction not in self.inputs.searchers:
            raise QueryError(f"this engine was opened for {list(self.inputs.searchers)}, not {direction}")
        if direction not in self._searchers:
            s = self.inputs.searchers[direction]
            if s["kind"] == "index":
                index = load_sharded_index(s["path"], embeddings_dir=self.spec.embeddings, files=self.files)
                index.set_params(**dict(s["params"]))
                self._searchers[direction] = lambda q, k, index=index: index.search_scores(q, k)
            else:
                from retrieval_core.search.exact import exact_topk

                modality = schema.MODALITY_IMAGE if direction == T2I else schema.MODALITY_TEXT
                ids, vecs = embeddings.read_embeddings(self.spec.embeddings, modality, files=self.files)
                self._searchers[direction] = lambda q, k, ids=ids, vecs=vecs: exact_topk(q, vecs, ids, k)
        return self._searchers[direction]

    @property
    def images(self) -> _ImagePool:
        if self._images is None:
            max_regions = self.inputs.ce.max_regions if self.inputs.ce else self.inputs.be.max_regions
            self._images = _ImagePool(self.ds, self._pool_collections, max_regions)
        return self._images

    @property
    def captions(self) -> pd.DataFrame:
        """caption_id -> source_id, text of the pool's captions."""
        if self._captions is None:
            parts = [self.ds.captions(collection=c)[["caption_id", "source_id", "text"]]
                     for c in self._pool_collections]
            self._captions = pd.concat(parts).set_index("caption_id")
        return self._captions

    def load(self, directions: Sequence[str] = (T2I, I2T), warm: bool = False) -> "QueryEngine":
        """Load now what the ``directions`` use (models, searchers, staged lookups) instead of at the first query;
        with ``warm``, also the staged regions the CE reads for text queries (up to CACHED_IMAGE_BYTES, else each
        image shard is read at the first query that needs it): a first query then costs what every later one does
        (what a latency measurement wants; a job of few queries does not)."""
        self.be_model
        if self.inputs.ce is not None:
            self.ce_model
        for d in directions:
            self._searcher(d)
            if d == T2I:
                pool = self.images
                if warm and self.inputs.ce is not None:
                    pool.warm()
            else:
                self.captions
        return self

    # ------------------------------------------------------------------------------------- querying
    def search_text(self, texts: Sequence, k: int = 10, rerank: str = "co", lam: float = 0.5,
                    tune_on: Optional[str] = None) -> pd.DataFrame:
        """Hits (:data:`HIT_COLUMNS`) of text queries (str, ids "0", "1"... by position; or :class:`Query`) over the
        image pool: the BE's top ``k``, ranked by ``rerank`` (MODES) with weight ``lam`` on the BE score; or
        ``rerank="auto"``: as the finished ``--mode auto`` rerank run ``tune_on`` chose on its dev split."""
        queries, rejected = check_queries(as_queries(texts, T2I))
        return self._answer(T2I, queries, rejected, k, rerank, lam, tune_on)

    def search_images(self, images: Sequence, k: int = 10, rerank: str = "co", lam: float = 0.5,
                      tune_on: Optional[str] = None) -> pd.DataFrame:
        """Hits of image queries over the caption pool: each a staged image (its item id as int or str, or its
        source id), a picture file (path), a (features, boxes) pair, or a :class:`Query`; ids by position unless a
        Query names its own."""
        queries, rejected = check_queries(as_queries(images, I2T))
        return self._answer(I2T, queries, rejected, k, rerank, lam, tune_on)

    def search(self, queries: Sequence[Query], k: int = 10, rerank: str = "co", lam: float = 0.5,
               tune_on: Optional[str] = None) -> pd.DataFrame:
        """Hits of checked queries of one direction (what pipelines.query calls per batch)."""
        directions = {q.direction for q in queries}
        if len(directions) > 1:
            raise QueryError("a batch of queries holds one direction")
        direction = directions.pop() if directions else T2I
        return self._answer(direction, list(queries), [], k, rerank, lam, tune_on)

    def auto_choice(self, tune_on: str, k: int) -> dict:
        """The fusion (mode, lam, label, dev recalls) the finished ``--mode auto`` rerank run ``tune_on`` chose, read
        once per (run, k) and checked against this engine's models, CE precision and ``k``
        (``retrieval_core.evaluation.runs.recorded_choice``, which pipelines.query --mode auto reads too)."""
        from retrieval_core.evaluation.runs import RunError, recorded_choice

        if (tune_on, int(k)) not in self._choices:
            if self.inputs.ce is None:
                raise QueryError("rerank='auto' checks the CE the tune_on run reranked with: open the engine with "
                                 "its CE (needs_ce=True)")
            try:
                self._choices[tune_on, int(k)] = recorded_choice(tune_on, self.spec.embeddings, self.inputs.ce.path,
                                                                 self.inputs.ce_precision, int(k), self.files,
                                                                 flag="tune_on")
            except RunError as exc:
                raise QueryError(str(exc)) from None
        return dict(self._choices[tune_on, int(k)])

    def _answer(self, direction: str, queries: list[Query], rejected: list[Rejected], k: int, mode: str,
                lam: float, tune_on: Optional[str] = None) -> pd.DataFrame:
        if mode != AUTO and mode not in MODES:
            raise QueryError(f"rerank must be one of {MODES + (AUTO,)}, got {mode!r}")
        if (mode == AUTO) != (tune_on is not None):
            raise QueryError(f"rerank='auto' takes tune_on (a finished --mode auto rerank run) and tune_on applies "
                             f"to rerank='auto' only; got rerank={mode!r}, tune_on={tune_on!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise QueryError(f"k must be an integer >= 1, got {k!r}")
        if not 0.0 <= float(lam) <= 1.0:
            raise QueryError(f"lam must be in [0, 1], got {lam!r}")
        choice = None
        if mode == AUTO:
            choice = self.auto_choice(tune_on, k)
            mode, lam = choice["mode"], choice["lam"] if choice["lam"] is not None else lam
        with without_onednn(self._float32_cpu):  # the models' calls: a long-lived engine's memory stays flat
            truncated: list[str] = []
            if direction == T2I:
                vectors = self._encode_texts(queries, truncated)
            else:
                queries, regions, more = self._image_regions(queries)
                rejected = rejected + more
                vectors = self.be_model.encode_image(regions, batch_size=self.spec.batch_size, device=self.device) \
                    if regions else np.zeros((0, 1), np.float32)
            results = []
            if queries:
                scores, ids = self._searcher(direction)(np.ascontiguousarray(vectors, dtype=np.float32), int(k))
                cands = [(i[i >= 0], s[i >= 0]) for s, i in zip(scores, ids)]  # -1: a pool smaller than k
                ce = self._ce_scores(direction, queries, regions if direction == I2T else None, cands) \
                    if mode != "emb" else [None] * len(queries)
                rank_mode = rerank.RUN_TO_RANK_MODE[mode]
                results = [rerank.rank_query(i, s, c, int(k), rank_mode, lam=float(lam), keep=int(k))
                           for (i, s), c in zip(cands, ce)]
        hits = self._frame(direction, queries, results)
        hits.attrs.update(rejected=[r.to_dict() for r in rejected], truncated=truncated, answered=len(queries),
                          mode=mode, k=int(k), lam=float(lam) if mode in rerank.FUSION_MODES else None,
                          fusion_choice=choice)
        self._trimmer.tick(len(queries))
        return hits

    @property
    def _float32_cpu(self) -> bool:
        """Both models run float32 on the CPU (memory.without_onednn applies; bf16 needs oneDNN)."""
        inp = self.inputs
        return str(self.device) == "cpu" and inp.be_precision == "none" and inp.ce_precision == "none"

    def _encode_texts(self, queries: list[Query], truncated: list[str]) -> np.ndarray:
        model = self.be_model
        texts = [q.text for q in queries]
        if not texts:
            return np.zeros((0, 1), np.float32)
        collator = model.text_collator() if hasattr(model, "text_collator") else None
        if collator is not None:  # over the model's length: cut (as every caption is), counted
            lengths = collator.tokenizer(texts, truncation=False, return_attention_mask=False,
                                         return_token_type_ids=False, verbose=False)["input_ids"]
            truncated += [q.id for q, ids in zip(queries, lengths) if len(ids) > collator.max_len]
        return model.encode_text(texts, batch_size=self.spec.batch_size, device=self.device)

    def _image_regions(self, queries: list[Query]) -> tuple[list[Query], list, list[Rejected]]:
        """(answerable queries, their regions, rejected): staged ids looked up, pictures through the backbone."""
        kept, regions, rejected = [], [], []
        staged = {q.id: q for q in queries if not q.picture and not isinstance(q, _RegionsQuery)}
        found = self._staged_image_ids([q.image for q in staged.values()])
        pictures = self._picture_regions([q for q in queries if q.picture])
        for q in queries:
            if isinstance(q, _RegionsQuery):
                got = q.regions
            elif q.picture:
                got = pictures[q.id]
            else:
                got = found.get(q.image)
                if got is None:
                    rejected.append(Rejected(q.id, q.image, f"{R_UNKNOWN_ID}: {q.image!r} is no staged image item id "
                                                            f"or source id of the pool {self._pool_collections}"))
                    continue
            if isinstance(got, str):
                rejected.append(Rejected(q.id, q.image, got))
                continue
            kept.append(q)
            regions.append(got)
        return kept, regions, rejected

    def _staged_image_ids(self, wanted: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{as written: regions} of the staged images named by item id or (unambiguous) source id."""
        pool = self.images
        by_source = pool.by_source
        out = {}
        for w in wanted:
            item = int(w) if w.lstrip("-").isdigit() and int(w) in pool.shard_of else None
            if item is None and len(by_source.get(w, ())) == 1:
                item = by_source[w][0]
            if item is not None:
                out[w] = pool.regions([item])[0]
        return out

    def _picture_regions(self, queries: list[Query]) -> dict[str, Union[tuple, str]]:
        """{query id: regions, or the reason it is rejected} of picture files, through the staged backbone."""
        if not queries:
            return {}
        from retrieval_core.data.pixels import decode

        if self._backbone is None:
            desc = self.inputs.image_backbone
            if not desc:
                raise QueryError(f"{self.spec.staged} holds region features extracted elsewhere (no image backbone): "
                                 f"pictures cannot be turned into the same features; query its staged images by id")
            try:
                self._backbone = backbone_for(desc, self.device)
            except FeatureSourceError as exc:
                raise QueryError(str(exc)) from None
        backbone = self._backbone
        out: dict = {}
        decoded = []
        for q in queries:
            try:
                data = read_file(q.image, self.files)
            except (FileNotFoundError, OSError, ValueError) as exc:
                out[q.id] = f"{R_UNREADABLE}: {exc}"
                continue
            d, reason = decode.decode_or_reason(data, backbone.input_size)
            if d is None:
                out[q.id] = f"{R_UNREADABLE}: {reason}"
            else:
                decoded.append((q.id, d))
        for start in range(0, len(decoded), 8):
            chunk = decoded[start:start + 8]
            feats = backbone.regions(np.stack([d.pixels for _, d in chunk]))
            for (qid, _), f in zip(chunk, feats):
                out[qid] = (f, backbone.boxes.copy())
        return out

    def _ce_scores(self, direction: str, queries: list[Query], regions: Optional[list],
                   cands: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """The CE scores of each query's candidates, one model call over every pair of the batch."""
        texts, images, sizes = [], [], []
        if direction == T2I:
            for q, (ids, _) in zip(queries, cands):
                texts += [q.text] * len(ids)
                images += self.images.regions(ids.tolist())
                sizes.append(len(ids))
        else:
            caps = self.captions
            for q, r, (ids, _) in zip(queries, regions, cands):
                texts += caps.loc[ids.tolist(), "text"].tolist()
                images += [r] * len(ids)
                sizes.append(len(ids))
        scores = self.ce_model.score(texts, images, batch_size=self.spec.batch_size, device=self.device) \
            if texts else np.zeros(0, np.float32)
        return np.split(scores.astype(np.float32), np.cumsum(sizes)[:-1])

    def _frame(self, direction: str, queries: list[Query], results: list[dict]) -> pd.DataFrame:
        n = [len(r["item_id"]) for r in results]
        cat = lambda key, dtype: np.concatenate([r[key] for r in results]).astype(dtype) if results \
            else np.zeros(0, dtype)  # noqa: E731
        items = cat("item_id", np.int64)
        if direction == T2I:
            source = [self.images.source_of.get(int(i), "") for i in items]
            text = [None] * len(items)
        else:
            caps = self.captions.loc[items.tolist()] if len(items) else self.captions.iloc[:0]
            source, text = caps["source_id"].astype(str).tolist(), caps["text"].tolist()
        return pd.DataFrame({
            "direction": [direction] * len(items),
            "query_id": np.repeat([q.id for q in queries], n).astype(object) if queries else [],
            "query": np.repeat([q.shown for q in queries], n).astype(object) if queries else [],
            "rank": cat("rank", np.int32), "item_id": items, "source_id": source, "text": text,
            "be_rank": cat("be_rank", np.int32), "be_score": cat("be_score", np.float32),
            "ce_score": cat("ce_score", np.float32), "final_score": cat("final_score", np.float32),
        }, columns=list(HIT_COLUMNS))

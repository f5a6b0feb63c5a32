"""The rerank job's plan: every parameter as a typed value (each one a command-line option), and ``resolve``,
which checks the plan against its inputs (staged folder, embeddings, indexes, models, --queries) and fixes what
the graph needs, before anything runs."""
from __future__ import annotations

import functools
import hashlib
import io
import logging
import math
from dataclasses import dataclass
from typing import Mapping, Optional

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines import files
from pipelines.ledger import Ledger, fingerprint
from retrieval_core.cli import (
    CheckedPlan,
    batch_size_option,
    collate_workers_option,
    count_option,
    device_option,
    ef_search_option,
    k_option,
    lam_option,
    nprobe_option,
    option,
    quantize_option,
    threads_option,
)
from retrieval_core.data import schema
from retrieval_core.data.pixels.backbone import FeatureSourceError
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.checkpoints import CheckpointError, ModelFolder, inspect_model_folder
from retrieval_core.precision import QUANTIZE_AUTO, check_quantize, resolve_quantize
from retrieval_core.search import embeddings, rerank
from retrieval_core.search.index import IndexIntegrityError, check_search_params
from retrieval_core.search.index_folder import INDEX_MANIFEST, check_index_source, load_index_manifest

log = logging.getLogger(__name__)

T2I, I2T = schema.DIRECTION_T2I, schema.DIRECTION_I2T
DIRECTIONS = (T2I, I2T)
#: "auto": the fusion (co, add_lam, norm_add_lam) with the best mR on a dev run (--tune-on), then run as that mode
AUTO = "auto"
CLI_MODES = rerank.RUN_MODES + (AUTO,)
PROGRESS_DIR = "_progress"  # <output>/_progress/<shard>.json: one record per finished ranking shard
TUNE_DIR = "_tune"  # <output>/_tune: --mode auto's own dev run (--tune-embeddings)
CANDIDATES_DIR = "_candidates"  # <output>/_candidates/<direction>-<group>.parquet (+ .json): the search's output


class RerankError(ValueError):
    pass


@dataclass(frozen=True)
class RerankPlan(CheckedPlan):
    """Every parameter of one rerank run, checked when built (a one-line RerankError naming the value).
    ``run(plan)`` executes it; the CLI only builds it."""
    staged: str = option(help="staged directory (queries, captions, regions)")
    embeddings: str = option(help="embeddings directory (pipelines.encode output)")
    output: str = option(help="run directory: rankings/ and rankings_manifest.json")
    mode: str = option(AUTO, type=click.Choice(CLI_MODES, case_sensitive=False),
                       help="auto: the ranking chosen on a dev split (--tune-embeddings or --tune-on) among co, "
                            "add / norm_add at every lam and emb; emb: BE only; co: CE rerank of the BE top-k (the "
                            "paper's); add / norm_add: BE+CE score fusion in the top-k (--lam); ce: exhaustive CE")
    k: int = k_option(20, help=f"rerank depth; every query stores its BE top max(k, {rerank.MIN_STORED_DEPTH})")
    lam: float = lam_option(0.5)
    directions: tuple[str, ...] = option(DIRECTIONS, sep=",", help="t2i, i2t or both")
    index: Optional[str] = option(None, help="image FAISS index for t2i, built from --embeddings (default: exact "
                                             "search)")
    text_index: Optional[str] = option(None, help="caption FAISS index for i2t, built from --embeddings (default: "
                                                  "exact search)")
    ce_model: Optional[str] = option(None, help="CE model folder (SEP+CO): ours, MMT-Retrieval or OSCAR; default "
                                                "--be-model (JOIN+CO)")
    be_model: Optional[str] = option(None, help="BE model folder (not needed: embeddings exist; used as CE for JOIN "
                                                "models)")
    collection: Optional[str] = option(None, help="queries of this collection only")
    split: Optional[str] = option("test", help="queries of this split")
    queries: Optional[str] = option(None, help="Parquet file (direction, query_id): rank only these queries of the "
                                               "collection/split")
    batch_size: int = batch_size_option(64, "CE pairs per batch")
    search_batch_size: int = count_option(1_024, help="queries per search call (faiss' Flat search is far slower per "
                                                      "query in small calls: docs/log/PERFORMANCE-2026-11.md, "
                                                      "\"Search\")")
    queries_per_pass: int = count_option(8_192, help="queries searched per pass over the pool, before any CE work: "
                                                     "each pass reads every index (or embedding) shard once, so "
                                                     "fewer passes read less; a worker holds one pass's queries and "
                                                     "top lists")
    device: str = device_option()
    threads: Optional[int] = threads_option()
    collate_workers: Optional[int] = collate_workers_option()
    model_copies: Optional[int] = count_option(None, help="CE model copies per machine (Dataflow GPU: 1)")
    max_exhaustive_pairs: int = count_option(200_000, help="--mode ce: the most (query, pool item) pairs it may score")
    queries_per_shard: int = count_option(1_000, help="queries per ranking shard (the unit a rerun of a killed job "
                                                      "keeps)")
    shards_per_wave: int = count_option(10, help="ranking shards per Beam job: a killed run loses at most its current "
                                                 "wave (on Dataflow, where each job starts workers, raise it)")
    pairs_per_wave: int = count_option(20_000, help="CE pairs per Beam job (but at least one shard): what a local "
                                                    "runner holds in memory")
    nprobe: Optional[int] = nprobe_option()
    ef_search: Optional[int] = ef_search_option()
    tune_on: Optional[str] = option(None, help="--mode auto: a CE-scored rerank run of the same models on a "
                                               "held-out split, to choose on")
    tune_embeddings: Optional[str] = option(None, help="--mode auto: the dev split's embeddings (pipelines.encode "
                                                       "--split dev): this job ranks a seeded sample of their queries "
                                                       "with co first and chooses on that run (<output>/_tune)")
    tune_index: Optional[str] = option(None, help="--mode auto: a FAISS image index of --tune-embeddings (default: "
                                                  "exact search)")
    tune_split: str = option("dev", help="--mode auto with --tune-embeddings: the split of its queries")
    tune_queries: int = count_option(500, help="--mode auto with --tune-embeddings: queries sampled per direction")
    score_ce: bool = option(False, help="--mode emb: still CE-score the BE top-k and store the scores (what --mode "
                                        "auto does when it chooses emb), so every mode can be derived from the run")
    quantize: str = quantize_option()  # of the CE; recorded in the rankings manifest

    def __post_init__(self):
        for name in ("staged", "embeddings", "output"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RerankError(f"{name} must be a non-empty path, got {getattr(self, name)!r}")
        try:
            super().__post_init__()  # every option's type; --device auto resolved on the launching host
            check_quantize(self.precision, self.device)
        except ValueError as exc:
            raise RerankError(str(exc)) from None
        mode = self.mode
        if isinstance(self.directions, str) or not self.directions \
                or any(d not in DIRECTIONS for d in self.directions):
            raise RerankError(f"directions must be a non-empty tuple of {DIRECTIONS}, got {self.directions!r}")
        object.__setattr__(self, "directions", tuple(dict.fromkeys(self.directions)))
        if mode == AUTO and bool(self.tune_on) == bool(self.tune_embeddings):
            raise RerankError("--mode auto (the default) chooses the ranking on a dev split: pass --tune-embeddings "
                              "DEV_EMBEDDINGS (the dev split encoded by pipelines.encode --split dev) or --tune-on "
                              "DEV_RUN (a --mode co run on a held-out split), not both; or another --mode (co: the "
                              "paper's)" if not (self.tune_on and self.tune_embeddings) else
                              "--tune-on and --tune-embeddings exclude each other")
        if mode != AUTO and (self.tune_on or self.tune_embeddings or self.tune_index):
            raise RerankError(f"--tune-on / --tune-embeddings / --tune-index apply to --mode auto only, not to "
                              f"--mode {mode}")
        if self.tune_index and not self.tune_embeddings:
            raise RerankError("--tune-index indexes --tune-embeddings: pass both")
        if self.score_ce and mode != "emb":
            raise RerankError(f"--score-ce applies to --mode emb (--mode {mode} scores the top-k anyway)")
        if (mode != "emb" or self.score_ce) and not (self.ce_model or self.be_model):
            raise RerankError(f"mode {mode!r} needs --ce-model (or --be-model for a JOIN model)")
        if self.quantize not in ("none", QUANTIZE_AUTO) and mode == "emb" and not self.score_ce:
            raise RerankError(f"--quantize {self.quantize} quantises the CE: --mode emb scores nothing with it")
        if (self.nprobe is not None or self.ef_search is not None) and not self.uses_index:
            raise RerankError("--nprobe / --ef-search tune a FAISS index: pass --index (t2i) or --text-index "
                              "(i2t); the default exact search has no parameters")

    @functools.cached_property
    def precision(self) -> str:
        """The serving precision: --quantize with auto resolved (precision.resolve_quantize); float32 where no CE
        is scored."""
        return resolve_quantize(self.quantize, "cpu" if self.cross_encoder is None else self.device)

    @property
    def cross_encoder(self) -> Optional[str]:
        """The CE model folder (None for EMB): --ce-model, else the JOIN model given as --be-model."""
        return None if self.mode == "emb" and not self.score_ce else (self.ce_model or self.be_model)

    @property
    def rank_mode(self) -> str:
        return rerank.RUN_TO_RANK_MODE[self.mode]

    @property
    def applied_lam(self) -> Optional[float]:
        return float(self.lam) if self.mode in rerank.FUSION_MODES else None

    @property
    def uses_index(self) -> bool:
        return bool((T2I in self.directions and self.index) or (I2T in self.directions and self.text_index))

    def index_of(self, direction: str) -> Optional[str]:
        return self.index if direction == T2I else self.text_index


@dataclass(frozen=True)
class SearcherSpec:
    """How a worker finds one direction's candidates: a FAISS index dir or exact search over embeddings."""
    kind: str  # "index" | "exact"
    path: str
    modality: str
    fingerprint: str  # sha256 of the index / embeddings manifest: a changed input is another searcher
    params: tuple[tuple[str, int], ...] = ()  # faiss search parameters (nprobe, efSearch) set on every shard


@dataclass(frozen=True)
class Resolved:
    """A plan resolved against its inputs, as plain typed values that pickle to the workers."""
    plan: RerankPlan
    query_ids: Mapping[str, np.ndarray]  # every query of the run per direction (sorted int64)
    pools: Mapping[str, int]  # candidate pool size per direction
    candidates: Mapping[str, int]  # BE candidates retrieved and stored per query (n)
    ce_k: int  # BE top-k the CE scores (the whole pool for --mode ce; 0 for emb)
    searchers: Mapping[str, SearcherSpec]
    described: Mapping[str, str]
    query_shards: tuple[tuple[str, str, str, str], ...]  # (direction, modality, embedding shard, sha256)
    out_shards: Mapping[str, int]  # ranking shards per direction
    search_groups: Mapping[str, int]  # search passes per direction (queries hashed into groups; a file each)
    caption_shards: tuple[str, ...]
    image_shards: tuple[str, ...]
    ce_max_regions: int  # regions per image the CE reads (more would be cut by its collator anyway)
    ce_fingerprint: Optional[str]  # ModelFolder.fingerprint of the CE (None for EMB)
    ce_score_key: Optional[str]  # the CE score the ce_score column holds (model.CE_SCORES)
    be_model: Mapping[str, str]  # the embeddings manifest's model entry
    queries_file: Optional[Mapping]  # {path, sha256, counts} of --queries
    fingerprint: str  # what a finished shard must have been computed under to be reused
    staged_sha256: Mapping[str, str] = None  # staged_fingerprints(): recorded for the run's readers
    token_fingerprint: Optional[str] = None  # the captions' token-id store the CE reads (None: texts)


def shard_pairs(res: Resolved, direction: str, ids) -> int:
    """CE pairs the queries ``ids`` of one direction request."""
    return len(ids) * min(res.ce_k, res.pools[direction])


def ce_model_folder(model_dir: str) -> ModelFolder:
    """The CE model folder (any kind checkpoints knows: ours, MMT-Retrieval, OSCAR; a CE-only folder too),
    refused without a CE head."""
    try:
        return inspect_model_folder(model_dir, files=files.BEAM_FILES).require(("ce",))
    except CheckpointError as exc:
        raise RerankError(f"CE model: {exc}") from None


def _file_fingerprint(path: str) -> str:
    return files.sha256_file(path) if files.exists(path) else "missing"


def _searcher_spec(plan: RerankPlan, direction: str, emb_manifest: dict) -> tuple[SearcherSpec, int, str]:
    """(spec, pool size, description) of one direction's candidate search."""
    pool_modality = schema.MODALITY_IMAGE if direction == T2I else schema.MODALITY_TEXT
    index_dir = plan.index_of(direction)
    if index_dir:
        manifest = load_index_manifest(index_dir, files.BEAM_FILES)
        if manifest.get("modality", pool_modality) != pool_modality:
            raise RerankError(f"{direction} needs a {pool_modality} index; {index_dir} indexes "
                              f"{manifest.get('modality')}")
        _check_index_source("--index" if direction == T2I else "--text-index", index_dir, manifest,
                            plan.embeddings, emb_manifest, pool_modality)
        params = {name: v for name, v in (("nprobe", plan.nprobe), ("efSearch", plan.ef_search)) if v is not None}
        if not params:  # the parameters build_index --index-factory auto tuned and recorded, if any
            params = {name: int(v) for name, v in (manifest.get("search_params") or {}).items()}
        try:  # refuse a parameter the index lacks now, not in a worker after the job started
            check_search_params(manifest["factory"], int(manifest["d"]), manifest["metric"], **params)
        except ValueError as exc:
            raise RerankError(f"{index_dir} ({manifest['factory']}): {exc}") from None
        spec = SearcherSpec("index", index_dir, pool_modality,
                            _file_fingerprint(files.join(index_dir, INDEX_MANIFEST)), tuple(sorted(params.items())))
        metric = manifest["metric"]
        scored = "; be_score = -squared L2 distance" if metric == "l2" else ""
        return spec, int(manifest["ntotal"]), f"FAISS index {index_dir} ({manifest['factory']}, {metric}{scored})"
    entry = embeddings.modality_entry(emb_manifest, pool_modality)
    spec = SearcherSpec("exact", plan.embeddings, pool_modality,
                        _file_fingerprint(embeddings.manifest_path(plan.embeddings)))
    return spec, int(entry["count"]), f"exact search over {pool_modality} embeddings in {plan.embeddings}"


def _check_index_source(flag: str, index_dir: str, index_manifest: dict, emb_dir: str, emb_manifest: dict,
                        modality: str) -> None:
    """An index built from other embeddings than --embeddings is refused (index_folder.check_index_source)."""
    try:
        check_index_source(flag, index_dir, index_manifest, emb_dir, emb_manifest, modality, files.BEAM_FILES)
    except IndexIntegrityError as exc:
        raise RerankError(str(exc)) from None


def split_query_ids(ds, direction: str, collection: Optional[str], split: Optional[str]) -> np.ndarray:
    """Sorted ids of the split's queries (captions for t2i, images for i2t), read one id column per shard:
    the launcher never holds the captions' text."""
    kind, column = ("captions", "caption_id") if direction == T2I else ("images", "item_id")
    parts = [ds.read_shard_columns(rel, (column,), split).column(column).to_numpy()
             for rel in ds.shard_names(kind, collection)]
    return np.sort(np.concatenate(parts).astype(np.int64)) if parts else np.zeros(0, dtype=np.int64)


def _read_queries_file(plan: RerankPlan, split_ids: Mapping[str, np.ndarray]
                       ) -> tuple[dict[str, np.ndarray], Optional[dict]]:
    """The queries of the run per direction: every query of the collection/split, or those --queries lists
    (a Parquet file with columns direction, query_id), which must all be queries of that collection/split.
    Also returns the manifest's record of the file (path, sha256, per-direction counts)."""
    if plan.queries is None:
        return dict(split_ids), None
    path = plan.queries
    if not files.exists(path):
        raise RerankError(f"--queries {path}: file not found")
    data = files.read_bytes(path)
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        raise RerankError(f"--queries {path}: not a Parquet file ({exc})") from None
    missing = [c for c in ("direction", "query_id") if c not in table.column_names]
    if missing:
        raise RerankError(f"--queries {path}: missing column(s) {missing} (needs direction, query_id)")
    if not pa.types.is_integer(table.schema.field("query_id").type) or table.column("query_id").null_count \
            or table.column("direction").null_count:
        raise RerankError(f"--queries {path}: query_id must be non-null integers (int64) and direction non-null, "
                          f"got {table.schema.field('query_id').type}")
    directions = np.asarray(table.column("direction").to_pylist(), dtype=object)
    ids = table.column("query_id").to_numpy().astype(np.int64)
    unknown = sorted(set(directions.tolist()) - set(DIRECTIONS))
    if unknown:
        raise RerankError(f"--queries {path}: unknown direction(s) {unknown} (expected {T2I!r} / {I2T!r})")
    extra = sorted(set(directions.tolist()) - set(plan.directions))
    if extra:
        raise RerankError(f"--queries {path} lists {extra} queries but --directions is {','.join(plan.directions)}")
    out, what = {}, {T2I: "captions", I2T: "images"}
    for d in plan.directions:
        wanted = ids[directions == d]
        if len(wanted) == 0:
            raise RerankError(f"--queries {path} lists no {d} queries; leave {d} out of --directions")
        uniq = np.unique(wanted)
        if len(uniq) != len(wanted):
            raise RerankError(f"--queries {path}: duplicate {d} query id(s)")
        strangers = np.setdiff1d(uniq, split_ids[d])
        if len(strangers):
            raise RerankError(f"--queries {path}: {len(strangers)} {d} query id(s) are not {what[d]} of "
                              f"collection={plan.collection}, split={plan.split} in {plan.staged} "
                              f"(e.g. {strangers[:5].tolist()})")
        out[d] = uniq
    return out, {"path": path, "sha256": files.sha256_bytes(data), "counts": {d: len(q) for d, q in out.items()}}


def staged_fingerprints(ds) -> dict[str, str]:
    """{"<images|captions>/<collection>": content sha256} of a staged folder: what a rankings manifest records
    and benchmarks.evaluate compares with the --staged it is given."""
    return {f"{kind}/{c}": ds.content_sha256(kind, c) for c in ds.collections for kind in ("images", "captions")}


def _pool_collections(ds, emb_manifest: dict) -> list[str]:
    """The staged collections whose items can be candidates: those the embeddings were encoded from (the
    pools), not only --collection's (which picks the queries): in a distractor run the CE scores the other
    collections' images and captions too. Embeddings that record no inputs: every staged collection."""
    encoded = (emb_manifest.get("inputs") or {}).get("collections")
    return [c for c in ds.collections if c in encoded] if encoded else list(ds.collections)


def _check_embeddings_match_staged(plan: RerankPlan, ds, emb_manifest: dict) -> None:
    """Refuse embeddings encoded from other staged shards than --staged (embeddings.check_encoded_from)."""
    try:
        checked = embeddings.check_encoded_from(plan.embeddings, emb_manifest, ds)
    except embeddings.EmbeddingsError as exc:
        raise RerankError(str(exc)) from None
    if not checked:
        log.warning("%s records no staged fingerprint (encoded before fingerprints): not checked against %s",
                    plan.embeddings, plan.staged)


def _searchers(plan: RerankPlan, query_ids: Mapping[str, np.ndarray], emb_manifest: dict) -> tuple:
    """Per direction: its searcher, pool size and description, after checking that every query has an
    embedding; and the query embedding shards, (direction, modality, name, sha256)."""
    searchers, pools, described, query_shards = {}, {}, {}, []
    for d in plan.directions:
        if len(query_ids[d]) == 0:
            raise RerankError(f"{d}: no queries in {plan.staged} (collection={plan.collection}, split={plan.split})")
        q_modality = schema.MODALITY_TEXT if d == T2I else schema.MODALITY_IMAGE
        have = embeddings.read_modality_ids(plan.embeddings, q_modality, files.BEAM_FILES)
        missing = np.setdiff1d(query_ids[d], have)
        if len(missing):
            raise RerankError(f"{d}: {len(missing)} query id(s) have no {q_modality} embedding in "
                              f"{plan.embeddings} (e.g. {missing[:5].tolist()}); encode that split first")
        searchers[d], pools[d], described[d] = _searcher_spec(plan, d, emb_manifest)
        query_shards += [(d, q_modality, s["name"], s["sha256"])
                         for s in embeddings.modality_entry(emb_manifest, q_modality)["shards"]]
    return searchers, pools, described, query_shards


def _depths(plan: RerankPlan, query_ids: Mapping[str, np.ndarray], pools: Mapping[str, int]) -> tuple[dict, int]:
    """({direction: candidates kept per query}, the CE depth): --mode ce scores every pool item (refused
    above --max-exhaustive-pairs), the other modes keep rerank.stored_depth(k) and score the top k."""
    if plan.mode == "ce":  # exhaustive: every pool item is a candidate and CE-scored
        total_pairs = sum(len(query_ids[d]) * pools[d] for d in plan.directions)
        if total_pairs > plan.max_exhaustive_pairs:
            raise RerankError(f"--mode ce would cross-encode {total_pairs:,} pairs (queries x pool), above "
                              f"--max-exhaustive-pairs {plan.max_exhaustive_pairs:,}; use --mode co")
        return {d: pools[d] for d in plan.directions}, max(pools.values())
    keep = rerank.stored_depth(plan.k)
    return {d: keep for d in plan.directions}, plan.k if plan.cross_encoder else 0


def resolve(plan: RerankPlan) -> Resolved:
    """Check the plan against its inputs (staged dir, embeddings, indexes, models, --queries) and fix
    everything the graph needs; every inconsistency is a one-line RerankError / ValueError here, before
    anything runs."""
    ds = StagedDataset(plan.staged, files=files.BEAM_FILES)
    if plan.collection is not None and plan.collection not in ds.collections:
        raise RerankError(f"collection {plan.collection!r} is not staged in {plan.staged} (have {ds.collections})")
    split_ids = {d: split_query_ids(ds, d, plan.collection, plan.split) for d in plan.directions}
    query_ids, queries_file = _read_queries_file(plan, split_ids)

    emb_manifest_path = embeddings.manifest_path(plan.embeddings)
    emb_manifest = embeddings.load_embeddings_manifest(plan.embeddings, files.BEAM_FILES)
    _check_embeddings_match_staged(plan, ds, emb_manifest)
    searchers, pools, described, query_shards = _searchers(plan, query_ids, emb_manifest)
    candidates, ce_k = _depths(plan, query_ids, pools)
    ce = ce_model_folder(plan.cross_encoder) if plan.cross_encoder else None
    if ce is not None:
        try:
            ce.require_features(ds)
        except FeatureSourceError as exc:
            raise RerankError(f"CE model: {exc}") from None
    pool_collections = _pool_collections(ds, emb_manifest)
    out_shards = {d: max(1, math.ceil(len(q) / plan.queries_per_shard)) for d, q in query_ids.items()}
    search_groups = {d: max(1, math.ceil(len(q) / plan.queries_per_pass)) for d, q in query_ids.items()}
    fingerprint_of = {
        "rankings_schema": schema.RANKINGS_SCHEMA_VERSION, "mode": plan.mode, "k": plan.k,
        "lam": plan.applied_lam, "directions": list(plan.directions),
        "queries": {d: hashlib.sha256(q.tobytes()).hexdigest() for d, q in query_ids.items()},
        "candidates": candidates, "ce_k": ce_k, "embeddings": _file_fingerprint(emb_manifest_path),
        "search": {d: {"kind": s.kind, "fingerprint": s.fingerprint, "params": s.params} for d, s in searchers.items()},
        "ce_model": ce.fingerprint if ce else None, "ce_max_regions": ce.max_regions if ce else 0,
        "ce_score": ce.ce_score if ce else None,
        "staged": _file_fingerprint(files.join(plan.staged, "summary.json")),
        "batch_size": plan.batch_size, "search_batch_size": plan.search_batch_size,
        "queries_per_pass": plan.queries_per_pass, "device": plan.device,
        "queries_per_shard": plan.queries_per_shard, "shards_per_wave": plan.shards_per_wave,
        "pairs_per_wave": plan.pairs_per_wave,
        **({"quantize": plan.precision} if plan.precision != "none" else {}),  # fp32 runs keep their fingerprint
    }
    return Resolved(
        plan=plan, query_ids=query_ids, pools=pools, candidates=candidates, ce_k=ce_k, searchers=searchers,
        described=described, query_shards=tuple(query_shards), out_shards=out_shards, search_groups=search_groups,
        caption_shards=tuple(s for c in pool_collections for s in ds.shard_names("captions", c)) if ce else (),
        image_shards=tuple(s for c in pool_collections for s in ds.shard_names("images", c)) if ce else (),
        ce_max_regions=ce.max_regions if ce else 0, ce_fingerprint=ce.fingerprint if ce else None,
        ce_score_key=ce.ce_score if ce else None, be_model=emb_manifest["model"], queries_file=queries_file,
        fingerprint=fingerprint(fingerprint_of), staged_sha256=staged_fingerprints(ds))


def progress_ledger(output: str, plan_fingerprint: str) -> Ledger:
    """The ranking shards' ledger: <output>/rankings/<shard>, its record <output>/_progress/<shard>.json."""
    return Ledger(files.join(output, rerank.RANKINGS_SUBDIR), plan_fingerprint,
                  records=files.join(output, PROGRESS_DIR))


def candidates_ledger(output: str, plan_fingerprint: str) -> Ledger:
    """The search groups' ledger: <output>/_candidates/<file> and its record <file>.json beside it."""
    folder = files.join(output, CANDIDATES_DIR)
    return Ledger(folder, plan_fingerprint, records=folder)

"""The query job's plan: every parameter as a typed value (each one a command-line option), and ``resolve``, which
reads and checks the queries and the inputs (staged folder, embeddings, index, models: through
``retrieval_core.search.query.check_inputs``, the Python entry point's own checks) and fixes the shards and
batches, before anything runs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import click

from pipelines import files
from pipelines.ledger import Ledger, fingerprint
from retrieval_core.cli import (
    CheckedPlan,
    batch_size_option,
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
from retrieval_core.errors import UsageFault
from retrieval_core.evaluation.runs import RunError, recorded_choice
from retrieval_core.pages import PAGE_QUERIES
from retrieval_core.search.query import (
    AUTO,
    I2T,
    MODES,
    T2I,
    EngineSpec,
    Inputs,
    Query,
    QueryError,
    Rejected,
    check_inputs,
    read_image_queries,
    read_text_queries,
)

HITS_DIR = "hits"  # <output>/hits/hits-0000i-of-0000N.parquet: the ranked hits, one shard per --queries-per-shard
PROGRESS_DIR = "_progress"  # <output>/_progress/<shard>.json: a finished shard's record (the ledger)
HITS_JSONL = "hits.jsonl"  # every hit, in query order (written from the shards at the end)
REJECTS_JSONL = "rejects.jsonl"  # every query not answered, with its reason
HITS_HTML = "hits.html"  # the first --page-queries queries' hits, drawn (retrieval_core.pages)
QUERY_MANIFEST = "query_manifest.json"


class QueryJobError(ValueError):
    pass


@dataclass(frozen=True)
class QueryPlan(CheckedPlan):
    """Every parameter of one query run, checked when built (a one-line error naming the value). ``run(plan)``
    executes it; the CLI only builds it."""
    staged: str = option(help="staged directory the index's items come from (their regions and captions)")
    embeddings: str = option(help="embeddings directory (pipelines.encode output) the index was built from")
    output: str = option(help="run directory: hits/*.parquet, hits.jsonl, hits.html, rejects.jsonl, "
                              "query_manifest.json")
    queries: Optional[str] = option(None, help="text queries (t2i): a text file (one per line; id = line number), "
                                               "JSON lines or CSV (id, text, optional lang)")
    image_ids: Optional[str] = option(None, help="image queries (i2t): a text file of staged images, one item id "
                                                 "or source id per line")
    images: Optional[str] = option(None, help="image queries (i2t): picture files (a folder, glob or list file), "
                                              "through the image backbone the staged folder was built with")
    index: Optional[str] = option(None, help="image FAISS index for text queries, built from --embeddings "
                                             "(default: exact search)")
    text_index: Optional[str] = option(None, help="caption FAISS index for image queries, built from --embeddings "
                                                  "(default: exact search)")
    model: Optional[str] = option(None, help="BE model folder (default: the one that encoded --embeddings, as its "
                                             "manifest records; another is refused)")
    ce_model: Optional[str] = option(None, help="CE model folder (default: the BE folder, a JOIN model)")
    mode: str = option("co", type=click.Choice(MODES + (AUTO,), case_sensitive=False),
                       help="emb: BE only; co: CE rerank of the BE top-k (the paper's); add / norm_add: BE+CE score "
                            "fusion (--lam); auto: the ranking a finished --mode auto rerank run chose (--tune-on)")
    k: int = k_option(10, help="hits per query: the BE's top k, reranked by the CE")
    lam: float = lam_option(0.5)
    tune_on: Optional[str] = option(None, help="--mode auto: a finished --mode auto pipelines.rerank run of the same "
                                               "models and k, whose choice (its manifest's fusion_choice) is used")
    batch_size: int = batch_size_option(64, "CE pairs (and BE queries) per model call")
    queries_per_batch: int = count_option(32, help="queries per call of the entry point (retrieval_core.search."
                                                   "query): one Beam element")
    queries_per_shard: int = count_option(1_000, help="queries per output shard (the unit a rerun of a killed job "
                                                      "keeps)")
    page_queries: int = option(PAGE_QUERIES, type=click.IntRange(min=0),
                               help="queries drawn in hits.html (the first ones, in query order: each hit's "
                                    "thumbnail, scene description or caption); 0: no page")
    device: str = device_option()
    threads: Optional[int] = threads_option()
    quantize: str = quantize_option()  # of the CE; the queries are encoded as the embeddings were
    nprobe: Optional[int] = nprobe_option()
    ef_search: Optional[int] = ef_search_option()

    def __post_init__(self):
        for name in ("staged", "embeddings", "output"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise QueryJobError(f"{name} must be a non-empty path, got {getattr(self, name)!r}")
        try:
            super().__post_init__()
        except ValueError as exc:
            raise QueryJobError(str(exc)) from None
        given = [f"--{n.replace('_', '-')}" for n in ("queries", "image_ids", "images") if getattr(self, n)]
        if len(given) != 1:
            raise UsageFault(f"pass one of --queries (text), --image-ids or --images (pictures), got "
                             f"{' and '.join(given) or 'none'}")
        if (self.mode == AUTO) != bool(self.tune_on):
            raise UsageFault("--mode auto takes --tune-on RUN (a finished --mode auto rerank run) and --tune-on "
                             "applies to --mode auto only")

    @property
    def direction(self) -> str:
        return T2I if self.queries else I2T

    def engine_spec(self) -> EngineSpec:
        return EngineSpec(self.staged, self.embeddings, self.index, self.text_index, self.model, self.ce_model,
                          self.device, self.threads, self.quantize, self.batch_size, self.nprobe, self.ef_search)


@dataclass(frozen=True)
class Batch:
    """One call of the entry point: the shard it belongs to, its place in the shard, its queries."""
    shard: str
    number: int
    queries: tuple[Query, ...]


@dataclass(frozen=True)
class Resolved:
    """A plan resolved against its inputs, as plain values that pickle to the workers."""
    plan: QueryPlan
    mode: str  # the ranking mode run (--mode auto: the recorded choice)
    lam: float
    fusion_choice: Optional[dict]
    inputs: Inputs
    queries_file: dict  # {path, sha256}
    queries_in: int  # every query of the file (answered or rejected)
    rejected: tuple[Rejected, ...]  # refused before the job (empty, duplicate, unreadable lines)
    shards: dict  # shard name -> tuple of its batches
    fingerprint: str


def _queries_path(plan: QueryPlan) -> str:
    return plan.queries or plan.image_ids or plan.images


def read_queries(plan: QueryPlan) -> tuple[list[Query], list[Rejected]]:
    if plan.queries:
        return read_text_queries(plan.queries, files.BEAM_FILES)
    return read_image_queries(plan.image_ids, plan.images, files.BEAM_FILES)


def resolve(plan: QueryPlan) -> Resolved:
    """Check the plan against its inputs and fix the shards and batches; every inconsistency is a one-line
    error here, before anything runs."""
    mode, lam, choice = plan.mode, plan.lam, None
    needs_ce = mode != "emb"
    spec = plan.engine_spec()
    inputs = check_inputs(spec, (plan.direction,), needs_ce, files.BEAM_FILES)
    if mode == AUTO:
        try:
            choice = recorded_choice(plan.tune_on, plan.embeddings, inputs.ce.path, inputs.ce_precision, plan.k,
                                     files.BEAM_FILES)
        except RunError as exc:
            raise QueryJobError(str(exc)) from None
        mode, lam = choice["mode"], choice["lam"] if choice["lam"] is not None else plan.lam
        if mode == "emb":
            inputs = check_inputs(spec, (plan.direction,), False, files.BEAM_FILES)
    queries, rejected = read_queries(plan)
    n = len(queries)
    shards_n = max(1, math.ceil(n / plan.queries_per_shard)) if n else 0
    shards = {}
    for s in range(shards_n):
        name = files.shard_name(HITS_DIR, s, shards_n, ".parquet")
        part = queries[s * plan.queries_per_shard:(s + 1) * plan.queries_per_shard]
        shards[name] = tuple(Batch(name, b, tuple(part[i:i + plan.queries_per_batch]))
                             for b, i in enumerate(range(0, len(part), plan.queries_per_batch)))
    path = _queries_path(plan)
    listing = [(q.id, q.shown, q.lang, q.picture) for q in queries]
    queries_file = {"path": path, "sha256": fingerprint(listing)}
    fp = fingerprint({
        "queries": queries_file["sha256"], "mode": mode, "k": plan.k,
        "lam": lam if mode in ("add", "norm_add") else None, "inputs": inputs.fingerprint(),
        "batch_size": plan.batch_size, "queries_per_batch": plan.queries_per_batch,
        "queries_per_shard": plan.queries_per_shard, "device": inputs.device,
    })
    return Resolved(plan, mode, float(lam), choice, inputs, queries_file, n + len(rejected), tuple(rejected),
                    shards, fp)


def progress_ledger(output: str, plan_fingerprint: str) -> Ledger:
    """The hit shards' ledger: <output>/hits/<shard>, its record <output>/_progress/<shard>.json."""
    return Ledger(files.join(output, HITS_DIR), plan_fingerprint, records=files.join(output, PROGRESS_DIR))


__all__ = ["AUTO", "HITS_DIR", "HITS_HTML", "HITS_JSONL", "PROGRESS_DIR", "QUERY_MANIFEST", "REJECTS_JSONL", "Batch",
           "QueryError", "QueryJobError", "QueryPlan", "Resolved", "progress_ledger", "read_queries", "resolve"]

"""Build a sharded FAISS index from an embeddings directory: one index shard per embedding shard.

    python -m pipelines.build_index --embeddings EMB --output INDEX --modality image \\
        --index-factory "IVF256,Flat" --train-sample 20000 [--ids FOLD.parquet] [--runner ... Beam options]

Graph::

    Create(embedding shard entries still to build) -> Reshuffle
      -> BuildShard: read one embedding shard (checksum-verified), keep the --ids items, add them with their
         global item_ids to a copy of the trained index, write shards/<name>.faiss -> its manifest entry
      -> one run report (common.WriteRunReport) -> the launcher writes index_manifest.json

The launcher trains once (deterministic, shard-order independent sample, gathered shard by shard) and writes
``trained.faiss``; workers read it by path and checksum (no side input: DaskRunner evaluates side inputs in a
second graph submission), and the id list the same way. Runs on DirectRunner, DaskRunner and Dataflow, with
byte-identical shards (a shard's content depends only on its embedding shard, the trained index and the id
list).

``--ids``: a Parquet file with an int64 ``item_id`` column; the index holds only those vectors (a fold or a
sub-pool). Every id must have an embedding of the modality, else the run stops before it starts. The manifest
records the file's path, sha256 and count.

Memory: the launcher holds the ids (8 bytes each), the training sample and one embedding shard at a time; a
worker holds one embedding shard, its index shard, the trained index and the id list. Nothing holds the
collection's vectors (a Flat index shard is as large as its embedding shard).

A rerun with the same configuration keeps every shard whose file still matches the previous manifest (and
whose source shard, trained index and id list are unchanged), and rebuilds the rest.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional

import apache_beam as beam
import click
from apache_beam.metrics import Metrics
import numpy as np

from pipelines import common
from retrieval_core import embeddings as emb
from retrieval_core import index as ix
from retrieval_core import index_choice as ic

log = logging.getLogger("pipelines.build_index")
CREATED_BY = "pipelines.build_index"
#: --index-factory value that chooses the factory and its search parameters under budgets (index_choice).
AUTO = "auto"


#: Beam counters (namespace "build_index"): vectors_added, shards_built.
METRICS_NAMESPACE = "build_index"


class IndexBuildError(ValueError):
    """Bad input or an inconsistent result; reported as one line by the CLI."""


@dataclass(frozen=True)
class IndexPlan:
    """Everything one build_index run needs, validated when built."""
    embeddings: str
    output: str
    modality: str = "image"
    factory: str = "Flat"
    metric: str = "ip"
    train_sample: int = 50_000
    seed: int = 0
    threads: Optional[int] = None
    ids: Optional[str] = None  # id-list Parquet: index only these items
    # factory "auto" only: budgets of the choice, the tuning collection and the held-out queries
    max_index_memory: Optional[int] = None  # bytes
    max_query_ms: Optional[float] = None
    recall_target: Optional[float] = None  # None: index_choice.IndexBudget's default (0.99)
    auto_sample: int = 100_000
    auto_queries: int = 200

    @property
    def budget(self) -> ic.IndexBudget:
        extra = {} if self.recall_target is None else {"recall_target": self.recall_target}
        return ic.IndexBudget(self.max_index_memory, self.max_query_ms, **extra)

    def __post_init__(self):
        for name in ("embeddings", "output"):
            if not getattr(self, name):
                raise IndexBuildError(f"{name} must be a path, got {getattr(self, name)!r}")
        common.check_choice("modality", self.modality, emb.MODALITIES)
        common.check_choice("metric", self.metric, sorted(ix.METRICS))
        if not self.factory or not self.factory.strip():
            raise IndexBuildError("index factory must be a faiss factory string such as Flat or IVF256,Flat")
        common.check_positive("train_sample", self.train_sample)
        if self.factory == AUTO:
            self.budget  # validates the budgets
            common.check_positive("auto_sample", self.auto_sample)
            common.check_positive("auto_queries", self.auto_queries)
        elif any(v is not None for v in (self.max_index_memory, self.max_query_ms, self.recall_target)):
            raise IndexBuildError("--max-index-memory, --max-query-ms and --recall-target choose an index: "
                                  f"they need --index-factory {AUTO}, got {self.factory!r}")
        common.check_positive("threads", self.threads, allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise IndexBuildError(f"seed must be an integer, got {self.seed!r}")


# ------------------------------------------------------------------------------------------- worker
@dataclass(frozen=True)
class _Blob:
    """A file the workers read by path and verify by checksum (the trained index, the id list)."""
    path: str
    sha256: str

    def read(self) -> bytes:
        data = common.read_bytes(self.path)
        if common.sha256_bytes(data) != self.sha256:
            raise IndexBuildError(f"{self.path} changed while the index was being built")
        return data


class BuildShard(beam.DoFn):
    """Embedding shard entry -> written index shard -> its manifest entry."""

    def __init__(self, plan: IndexPlan, dim: int, trained: _Blob, ids: Optional[_Blob]):
        self.plan, self.dim, self.trained, self.ids = plan, dim, trained, ids

    def setup(self):
        ix.set_threads(self.plan.threads)  # faiss bundles its own OpenMP pool
        self._trained = self.trained.read()
        # The id list: 8 bytes per listed item, read once per worker process (never pickled into the graph).
        self._ids = ix.read_id_list(self.ids.read(), self.ids.path) if self.ids else None

    def process(self, entry: dict):
        t0 = time.time()
        src = common.join(self.plan.embeddings, emb.shard_relpath(self.plan.modality, entry["name"]))
        data = common.read_bytes(src)
        emb.verify_shard_bytes(data, entry, src)
        ids, vectors = emb.read_embedding_shard(data)
        emb.check_shard_contents(ids, vectors, entry, self.dim, src)
        if self._ids is not None:
            keep = np.isin(ids, self._ids)
            ids, vectors = ids[keep], vectors[keep]
        shard = ix.build_shard(self._trained, ids, vectors)
        name = ix.shard_file_name(entry["name"])
        sha = common.write_atomic(common.join(self.plan.output, ix.SHARDS_SUBDIR, name), ix.index_bytes(shard))
        log.info("built %s: %d vectors in %.1f s", name, shard.ntotal, time.time() - t0)
        Metrics.counter(METRICS_NAMESPACE, "vectors_added").inc(int(shard.ntotal))
        Metrics.counter(METRICS_NAMESPACE, "shards_built").inc()
        common.Progress.advance(int(entry["rows"]))  # the embedding vectors this shard read
        yield {"name": name, "rows": int(shard.ntotal), "sha256": sha,
               "source": entry["name"], "source_sha256": entry["sha256"]}


def build_graph(p: beam.Pipeline, todo: list[dict], shard_fn: BuildShard, output: str) -> None:
    infos = (p | "Shards" >> beam.Create(todo)
             | "Spread" >> beam.Reshuffle()
             | "Build" >> beam.ParDo(shard_fn))
    common.WriteRunReport.apply([infos], output)  # the last step: DaskRunner computes only its graph


# ------------------------------------------------------------------------------------------ launcher
def _previous_manifest(output: str) -> Optional[dict]:
    path = common.join(output, ix.INDEX_MANIFEST)
    if not common.exists(path):
        return None
    try:
        return common.read_json(path)
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable previous manifest %s (%s)", path, exc)
        return None


def _shard_ids(emb_dir: str, modality: str, entry: dict) -> np.ndarray:
    return emb.read_embedding_ids(common.read_bytes(common.join(emb_dir, emb.shard_relpath(modality, entry["name"]))))


def check_ids_present(ids: np.ndarray, emb_dir: str, modality: str, shards: list[dict], where: str) -> None:
    """Every listed id must have an embedding; read one id column per shard (never the vectors)."""
    found = np.zeros(len(ids), dtype=bool)
    for s in shards:
        found |= np.isin(ids, _shard_ids(emb_dir, modality, s))
    if not found.all():
        missing = ids[~found]
        raise IndexBuildError(f"{where}: {len(missing)} of {len(ids)} id(s) have no {modality} embedding in "
                              f"{emb_dir} (e.g. {missing[:5].tolist()})")


def _training_vectors(plan: IndexPlan, shards: list[dict], dim: int, ids: Optional[np.ndarray],
                      n: Optional[int] = None, seed: Optional[int] = None) -> np.ndarray:
    """The deterministic training sample of ``n`` (default --train-sample) vectors (of the listed ids, if
    any), gathered shard by shard: the launcher holds the sample and one shard at a time, never the whole
    collection."""
    if ids is None:
        ids = np.concatenate([_shard_ids(plan.embeddings, plan.modality, s) for s in shards])
    chosen = ix.select_training_ids(ids, plan.train_sample if n is None else n, plan.seed if seed is None else seed)
    return _gather(plan.embeddings, plan.modality, shards, chosen, dim)


def _gather(emb_dir: str, modality: str, shards: list[dict], chosen: np.ndarray, dim: int) -> np.ndarray:
    """The vectors of the ``chosen`` ids, in that order, read shard by shard (checksum-verified)."""
    found: dict[int, np.ndarray] = {}
    for s in shards:
        path = common.join(emb_dir, emb.shard_relpath(modality, s["name"]))
        data = common.read_bytes(path)
        emb.verify_shard_bytes(data, s, path)
        shard_ids, vectors = emb.read_embedding_shard(data)
        for row in np.flatnonzero(np.isin(shard_ids, chosen)):
            found[int(shard_ids[row])] = vectors[row]
    missing = set(chosen.tolist()) - set(found)
    if missing:
        raise IndexBuildError(f"training ids vanished while reading shards: {sorted(missing)[:5]}")
    if not len(chosen):
        return np.zeros((0, dim), np.float32)
    return np.stack([found[int(i)] for i in chosen]).astype(np.float32)


def run(plan: IndexPlan, beam_args=()) -> Optional[dict]:
    """Train, build the shards still missing, write index_manifest.json; returns a summary (None on dry run)."""
    t0 = time.time()
    options = common.task_pipeline_options(beam_args)
    dry = common.is_dry_run(options)
    ix.set_threads(plan.threads)
    manifest_path = common.join(plan.embeddings, emb.EMBEDDINGS_MANIFEST)
    if not common.exists(manifest_path):
        raise emb.EmbeddingsError(f"no {emb.EMBEDDINGS_MANIFEST} in {plan.embeddings}: not an embeddings "
                                  f"directory (run pipelines.encode first)")
    manifest_bytes = common.read_bytes(manifest_path)
    emb_manifest = emb.validate_embeddings_manifest(json.loads(manifest_bytes.decode("utf-8")))
    entry = emb.modality_entry(emb_manifest, plan.modality)
    shards, dim = entry["shards"], int(emb_manifest["dim"])
    if not shards:
        raise IndexBuildError(f"no {plan.modality} embedding shards in {plan.embeddings}")
    emb_sha = hashlib.sha256(manifest_bytes).hexdigest()

    ids, ids_entry, ids_blob = None, None, None
    if plan.ids:
        if not common.exists(plan.ids):
            raise IndexBuildError(f"--ids {plan.ids}: no such file")
        ids_bytes = common.read_bytes(plan.ids)
        ids = ix.read_id_list(ids_bytes, f"--ids {plan.ids}")
        if not len(ids):
            raise IndexBuildError(f"--ids {plan.ids}: lists no ids")
        check_ids_present(ids, plan.embeddings, plan.modality, shards, f"--ids {plan.ids}")
        ids_entry = {"path": plan.ids, "sha256": common.sha256_bytes(ids_bytes), "count": int(len(ids))}
        ids_blob = _Blob(plan.ids, ids_entry["sha256"])
    expected = int(len(ids)) if ids is not None else int(entry["count"])

    factory, auto = plan.factory, None
    if plan.factory == AUTO:
        factory, auto = _choose(plan, emb_manifest, shards, dim, ids, expected)
    config = {"factory": factory, "d": dim, "metric": plan.metric, "modality": plan.modality}
    train_cfg = {"train_sample": plan.train_sample, "seed": plan.seed, "embeddings_manifest_sha256": emb_sha,
                 "ids_sha256": ids_entry["sha256"] if ids_entry else None}
    prev = _previous_manifest(plan.output)
    same_config = prev is not None and all(prev.get(k) == v for k, v in config.items()) and \
        (prev.get("ids") or {}).get("sha256") == train_cfg["ids_sha256"]
    trained_path = common.join(plan.output, ix.TRAINED_INDEX)
    prev_trained = (prev or {}).get("trained", {})
    if same_config and {k: prev_trained.get(k) for k in train_cfg} == train_cfg \
            and common.shard_is_valid(trained_path, prev_trained.get("sha256")):
        trained = common.read_bytes(trained_path)  # reuse: retraining could move centroids
        log.info("reusing trained index %s", trained_path)
    else:
        sample = None
        if ix.needs_training(factory, dim, plan.metric):
            sample = _training_vectors(plan, shards, dim, ids)
            log.info("training %s on %d vectors", factory, len(sample))
        trained = ix.train_index(factory, dim, plan.metric, sample, seed=plan.seed)
    trained_sha = hashlib.sha256(trained).hexdigest()

    # Keep shards that still match the previous manifest, built from the same source, trained index and ids.
    kept, todo = [], []
    prev_shards = {s["source"]: s for s in (prev or {}).get("shards", [])} if same_config and \
        prev_trained.get("sha256") == trained_sha else {}
    for s in shards:
        old = prev_shards.get(s["name"])
        if old and old.get("source_sha256") == s["sha256"] and common.shard_is_valid(
                common.join(plan.output, ix.SHARDS_SUBDIR, old["name"]), old["sha256"]):
            kept.append(old)
        else:
            todo.append(s)
    log.info("%d shard(s) kept from the previous run, %d to build", len(kept), len(todo))

    built = []
    if todo:
        p = beam.Pipeline(options=options)
        build_graph(p, todo, BuildShard(plan, dim, _Blob(trained_path, trained_sha), ids_blob), plan.output)
        if common.translated_only(p, "build_index"):
            return None
        common.makedirs(plan.output)
        if not common.shard_is_valid(trained_path, trained_sha):
            common.write_atomic(trained_path, trained)
        common.clear_run_dir(plan.output)  # a killed run's report must not enter this manifest
        with common.Progress.running(sum(int(s["rows"]) for s in todo), "vectors", "build_index", options):
            result = common.run_pipeline(p)
        print(common.counter_line(METRICS_NAMESPACE, common.counter_values(result, METRICS_NAMESPACE),
                                  common.runner_name(options)))
        built = common.read_run_report(plan.output)
        common.clear_run_dir(plan.output)
    elif dry:
        print(common.dry_run_message("build_index", options))
        return None

    manifest = ix.make_index_manifest(
        factory, dim, plan.metric, plan.modality, kept + built,
        embeddings={"dir": plan.embeddings, "manifest_sha256": emb_sha, "count": int(entry["count"])},
        trained={"name": ix.TRAINED_INDEX, "sha256": trained_sha, **train_cfg},
        created_by=CREATED_BY, ids=ids_entry)
    if manifest["ntotal"] != expected or len(manifest["shards"]) != len(shards):
        raise IndexBuildError(f"index holds {manifest['ntotal']} vectors in {len(manifest['shards'])} shards; "
                              f"expected {expected} in {len(shards)} (the runner lost shards?)")
    if auto is not None:  # measured on the index as built: the recorded numbers are the full index's
        manifest["search_params"], manifest["auto"] = _measure_built(plan, manifest, shards, ids, auto)
    common.write_json_atomic(common.join(plan.output, ix.INDEX_MANIFEST), manifest)
    return {"factory": factory, "metric": plan.metric, "search_params": manifest.get("search_params"), "d": dim, "ntotal": manifest["ntotal"],
            "shards": len(shards), "built": len(built), "kept": len(kept), "ids": ids_entry,
            "runner": common.runner_name(options), "seconds": round(time.time() - t0, 2)}


def _held_out_queries(plan: IndexPlan, emb_manifest: dict, shards: list[dict], dim: int,
                      ids: Optional[np.ndarray]) -> tuple[np.ndarray, str]:
    """Queries for measuring recall: a seeded sample of the OTHER modality's embeddings (captions for an
    image index: the queries it will serve, never in it); items of the index when that modality is absent."""
    other = "text" if plan.modality == emb.MODALITIES[0] else emb.MODALITIES[0]
    if other in emb_manifest["modalities"] and emb_manifest["modalities"][other]["shards"]:
        o_shards = emb_manifest["modalities"][other]["shards"]
        o_ids = np.concatenate([_shard_ids(plan.embeddings, other, s) for s in o_shards])
        chosen = ix.select_training_ids(o_ids, plan.auto_queries, plan.seed + 2)
        return _gather(plan.embeddings, other, o_shards, chosen, dim), f"{len(chosen)} {other} embeddings"
    q = _training_vectors(plan, shards, dim, ids, n=plan.auto_queries, seed=plan.seed + 2)
    return q, f"{len(q)} {plan.modality} embeddings of the index itself (no {other} embeddings)"


def _choose(plan: IndexPlan, emb_manifest: dict, shards: list[dict], dim: int, ids: Optional[np.ndarray],
            n_total: int) -> tuple[str, dict]:
    """--index-factory auto: the factory index_choice picks on a tuning collection of --auto-sample items."""
    t0 = time.time()
    tune_ids = ids if ids is not None else np.concatenate([_shard_ids(plan.embeddings, plan.modality, s)
                                                           for s in shards])
    tune_ids = ix.select_training_ids(tune_ids, plan.auto_sample, plan.seed + 1)
    vectors = _gather(plan.embeddings, plan.modality, shards, tune_ids, dim)
    queries, source = _held_out_queries(plan, emb_manifest, shards, dim, ids)
    log.info("auto index: choosing among %s on %d of %d items, %s as queries",
             ic.candidate_factories(n_total, dim), len(tune_ids), n_total, source)
    try:
        best, cands = ic.choose_index(tune_ids, vectors, queries, n_total, plan.budget, plan.metric, plan.seed,
                                      log=log.info)
    except ic.NoIndexFits as exc:
        raise IndexBuildError(str(exc)) from None
    log.info("auto index: chose %s in %.1f s", best.factory, time.time() - t0)
    return best.factory, {"budget": plan.budget.as_dict(), "tuning_items": int(len(tune_ids)),
                          "queries": source, "queries_array": queries,
                          "candidates": [c.as_dict() for c in cands], "choice_s": round(time.time() - t0, 2)}


def _exact_ids(plan: IndexPlan, shards: list[dict], ids: Optional[np.ndarray], queries: np.ndarray) -> np.ndarray:
    """Exact top-10 ids of ``queries`` over the indexed items, one embedding shard at a time."""
    import faiss

    from retrieval_core import metrics

    parts_s, parts_i = [], []
    for s in shards:
        path = common.join(plan.embeddings, emb.shard_relpath(plan.modality, s["name"]))
        data = common.read_bytes(path)
        emb.verify_shard_bytes(data, s, path)
        sid, vec = emb.read_embedding_shard(data)
        if ids is not None:
            keep = np.isin(sid, ids)
            sid, vec = sid[keep], vec[keep]
        if not len(sid):
            continue
        if plan.metric == "ip":
            sc, found = metrics.exact_topk(queries, vec, sid, ic.K)
        else:
            dist, pos = faiss.knn(np.ascontiguousarray(queries, np.float32), np.ascontiguousarray(vec, np.float32),
                                  min(ic.K, len(sid)), faiss.METRIC_L2)
            sc, found = -dist, sid[pos]
        parts_s.append(sc)
        parts_i.append(found)
    all_s, all_i = np.concatenate(parts_s, axis=1), np.concatenate(parts_i, axis=1)
    order = np.lexsort((all_i, -all_s), axis=1)[:, :ic.K]
    return np.take_along_axis(all_i, order, axis=1)


def _measure_built(plan: IndexPlan, manifest: dict, shards: list[dict], ids: Optional[np.ndarray],
                   auto: dict) -> tuple[dict, dict]:
    """Tune the search parameter on the built index against exact search, measure its query time and memory;
    a built index outside the budget is an error (the choice on a sample can be wrong at full size)."""
    queries = auto.pop("queries_array")
    index = ix.ShardedIndex([ix.index_from_bytes(common.read_bytes(common.join(plan.output, ix.SHARDS_SUBDIR,
                                                                                s["name"])))
                             for s in manifest["shards"]])
    memory = int(sum(len(ix.index_bytes(x)) for x in index.shards))
    params, recall, sweep = ic.tune_search(index, manifest["factory"], queries,
                                           _exact_ids(plan, shards, ids, queries), plan.budget.recall_target)
    ms = ic.query_ms(index, queries)
    budget = plan.budget
    misses = [m for m, bad in ((f"recall@10 {recall:.3f} < {budget.recall_target}", recall < budget.recall_target),
                               (f"{ms:.2f} ms/query > {budget.max_query_ms} ms", budget.max_query_ms is not None
                                and ms > budget.max_query_ms),
                               (f"{ic.human_bytes(memory)} > {ic.human_bytes(budget.max_memory_bytes or 0)}",
                                budget.max_memory_bytes is not None and memory > budget.max_memory_bytes)) if bad]
    if misses:
        raise IndexBuildError(f"the chosen {manifest['factory']} as built misses the budget: {'; '.join(misses)} "
                              f"(chosen on {auto['tuning_items']} sampled items); raise --auto-sample or the budget")
    log.info("auto index %s: recall@10 %.3f at %s, %.2f ms/query, %s", manifest["factory"], recall, params,
             ms, ic.human_bytes(memory))
    return params, {**auto, "measured": {"recall@10": recall, "query_ms": ms, "memory_bytes": memory,
                                         "sweep": sweep, "how": "single-query p50 over the held-out queries; "
                                         f"recall@10 = knn_intersection_measure vs exact {plan.metric} search"}}


def build_index(emb_dir: str, output: str, modality: str, factory: str, metric: str, train_sample: int,
                seed: int, threads: Optional[int], beam_args=()) -> Optional[dict]:
    """Positional form kept for existing callers (tests/test_rerank_pipeline.py); builds an IndexPlan."""
    return run(IndexPlan(emb_dir, output, modality, factory, metric, train_sample, seed, threads), beam_args)


@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--embeddings", "emb_dir", required=True, help="Embeddings directory (embeddings_manifest.json).")
@click.option("--output", required=True, help="Index directory.")
@click.option("--modality", type=click.Choice(emb.MODALITIES), default="image", show_default=True)
@click.option("--index-factory", "factory", default="Flat", show_default=True,
              help='faiss factory string: "Flat", "IVF256,Flat", "HNSW32", "IVF256,PQ16x8"..., or "auto": the '
                   'cheapest of Flat / IVF-Flat / IVF-SQ8 / IVF-PQ / HNSW32 (and its nprobe / efSearch) reaching '
                   '--recall-target within the budgets, measured and written into the index manifest.')
@click.option("--metric", type=click.Choice(sorted(ix.METRICS)), default="ip", show_default=True)
@click.option("--train-sample", type=click.IntRange(min=1), default=50_000, show_default=True,
              help="Training vectors for factories that need training (>= 39 per IVF list).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help=f"faiss OpenMP threads per process (default ${ix.THREADS_ENV} or all).")
@click.option("--ids", "ids_path", default=None,
              help="Parquet file with an int64 item_id column: index only these items (a fold, a sub-pool).")
@click.option("--max-index-memory", default=None, metavar="SIZE",
              help="auto: memory budget of the index, e.g. 4GB or 512MiB.")
@click.option("--max-query-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="auto: single-query search budget, milliseconds (p50 on held-out queries).")
@click.option("--recall-target", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="auto: recall@10 against exact search to reach [0.99].")
@click.option("--auto-sample", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="auto: items the candidates are built and tuned on (the whole collection when smaller).")
@click.option("--auto-queries", type=click.IntRange(min=1), default=200, show_default=True,
              help="auto: held-out queries (the other modality's embeddings) recall and query time use.")
@click.pass_context
def main(ctx, emb_dir, output, modality, factory, metric, train_sample, seed, threads, ids_path, max_index_memory,
         max_query_ms, recall_target, auto_sample, auto_queries):
    """Build a sharded FAISS index (one shard per embedding shard). Unknown --flags go to Beam.

    Counters namespace: build_index (vectors_added, shards_built)."""
    common.configure_logging(fmt="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common.check_beam_flags(ctx.args)
    with common.cli_errors():
        plan = IndexPlan(emb_dir, output, modality, factory, metric, train_sample, seed, threads, ids_path,
                         ic.parse_bytes(max_index_memory) if max_index_memory is not None else None, max_query_ms,
                         recall_target, auto_sample, auto_queries)
        summary = run(plan, tuple(ctx.args))
    if summary is None:
        return
    subset = f" of the {summary['ids']['count']} ids in {summary['ids']['path']}" if summary["ids"] else ""
    click.echo(f"index {summary['factory']} ({summary['metric']}, d={summary['d']}): {summary['ntotal']} vectors"
               f"{subset} in {summary['shards']} shards ({summary['built']} built, {summary['kept']} kept) "
               f"in {summary['seconds']:.1f} s -> {output}"
               + (f"; search params {summary['search_params']}" if summary.get("search_params") else ""))


common.add_progress_help(main)

if __name__ == "__main__":
    common.main_as_module("pipelines.build_index")  # workers import pipelines.build_index, not __main__

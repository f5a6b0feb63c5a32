"""``python -m pipelines.build_index``: a sharded FAISS index from an embeddings directory, one index shard per
embedding shard. The launcher trains once (a deterministic, shard-order independent sample), the graph builds
the shards, the launcher writes index_manifest.json; a rerun keeps every shard still valid. ``--index-factory
auto`` chooses the index under budgets (retrieval_core.search.index_choice). docs/ARCHITECTURE.md has the details.

    python -m pipelines.build_index --embeddings EMB --output INDEX --modality image --index-factory "IVF256,Flat"
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Optional

import apache_beam as beam
import click
import numpy as np

from pipelines import beam_kit, files
from pipelines.build_index.graph import METRICS_NAMESPACE, BuildShard, _Blob, build_graph
from pipelines.build_index.plan import AUTO, IndexBuildError, IndexPlan
from pipelines.ledger import Ledger
from retrieval_core.cli import cli_errors, plan_from_cli, plan_options
from retrieval_core.data import schema
from retrieval_core.data.outputs import holds_output
from retrieval_core.memory import require_headroom
from retrieval_core.search import embeddings, exact, index_choice
from retrieval_core.search.index import (
    ShardedIndex,
    index_bytes,
    index_from_bytes,
    needs_training,
    read_id_list,
    select_training_ids,
    set_threads,
    train_index,
)
from retrieval_core.search.index_folder import INDEX_MANIFEST, SHARDS_SUBDIR, TRAINED_INDEX, make_index_manifest

log = logging.getLogger(__name__)
CREATED_BY = "pipelines.build_index"


def _previous_manifest(output: str) -> Optional[dict]:
    path = files.join(output, INDEX_MANIFEST)
    if not files.exists(path):
        return None
    try:
        return files.read_json(path)
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable previous manifest %s (%s)", path, exc)
        return None


def _shard_ids(emb_dir: str, modality: str, entry: dict) -> np.ndarray:
    path = files.join(emb_dir, embeddings.shard_relpath(modality, entry["name"]))
    return embeddings.read_embedding_ids(files.read_bytes(path))


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
    chosen = select_training_ids(ids, plan.train_sample if n is None else n, plan.seed if seed is None else seed)
    return _gather(plan.embeddings, plan.modality, shards, chosen, dim)


def _gather(emb_dir: str, modality: str, shards: list[dict], chosen: np.ndarray, dim: int) -> np.ndarray:
    """The vectors of the ``chosen`` ids, in that order, read shard by shard (checksum-verified)."""
    found: dict[int, np.ndarray] = {}
    for s in shards:
        path = files.join(emb_dir, embeddings.shard_relpath(modality, s["name"]))
        data = files.read_bytes(path)
        embeddings.verify_shard_bytes(data, s, path)
        shard_ids, vectors = embeddings.read_embedding_shard(data)
        for row in np.flatnonzero(np.isin(shard_ids, chosen)):
            found[int(shard_ids[row])] = vectors[row]
    missing = set(chosen.tolist()) - set(found)
    if missing:
        raise IndexBuildError(f"training ids vanished while reading shards: {sorted(missing)[:5]}")
    if not len(chosen):
        return np.zeros((0, dim), np.float32)
    return np.stack([found[int(i)] for i in chosen]).astype(np.float32)


@holds_output("build_index")
def run(plan: IndexPlan, beam_args=()) -> Optional[dict]:
    """Train, build the shards still missing, write index_manifest.json; returns a summary (None on dry run)."""
    t0 = time.time()
    options = beam_kit.task_pipeline_options(beam_args)
    dry = beam_kit.is_dry_run(options)
    set_threads(plan.threads)
    require_headroom("build_index", plan.threads, ("--threads", "--train-sample"))
    manifest_path = files.join(plan.embeddings, embeddings.EMBEDDINGS_MANIFEST)
    if not files.exists(manifest_path):
        raise embeddings.EmbeddingsError(f"no {embeddings.EMBEDDINGS_MANIFEST} in {plan.embeddings}: not an embeddings "
                                         f"directory (run pipelines.encode first)")
    manifest_bytes = files.read_bytes(manifest_path)
    emb_manifest = embeddings.validate_embeddings_manifest(json.loads(manifest_bytes.decode("utf-8")))
    entry = embeddings.modality_entry(emb_manifest, plan.modality)
    shards, dim = entry["shards"], int(emb_manifest["dim"])
    if not shards:
        raise IndexBuildError(f"no {plan.modality} embedding shards in {plan.embeddings}")
    emb_sha = hashlib.sha256(manifest_bytes).hexdigest()

    ids, ids_entry, ids_blob = None, None, None
    if plan.ids:
        if not files.exists(plan.ids):
            raise IndexBuildError(f"--ids {plan.ids}: no such file")
        ids_bytes = files.read_bytes(plan.ids)
        ids = read_id_list(ids_bytes, f"--ids {plan.ids}")
        if not len(ids):
            raise IndexBuildError(f"--ids {plan.ids}: lists no ids")
        check_ids_present(ids, plan.embeddings, plan.modality, shards, f"--ids {plan.ids}")
        ids_entry = {"path": plan.ids, "sha256": files.sha256_bytes(ids_bytes), "count": int(len(ids))}
        ids_blob = _Blob(plan.ids, ids_entry["sha256"])
    expected = int(len(ids)) if ids is not None else int(entry["count"])

    factory, auto = plan.factory, None
    if plan.factory == AUTO:
        factory, auto = _choose(plan, emb_manifest, shards, dim, ids, expected)
    config = {"factory": factory, "d": dim, "metric": plan.metric, "modality": plan.modality}
    train_cfg = {"train_sample": plan.train_sample, "seed": plan.seed, "embeddings_manifest_sha256": emb_sha,
                 "ids_sha256": ids_entry["sha256"] if ids_entry else None}
    prev = _previous_manifest(plan.output) or {}
    recorded = {**{k: prev.get(k) for k in config}, "ids_sha256": (prev.get("ids") or {}).get("sha256")} \
        if prev else None
    now = {**config, "ids_sha256": train_cfg["ids_sha256"]}
    trained_path = files.join(plan.output, TRAINED_INDEX)
    prev_trained = prev.get("trained", {})
    if Ledger.from_listing(plan.output, {TRAINED_INDEX: prev_trained}, now, recorded).finished(
            TRAINED_INDEX, **train_cfg) is not None:
        trained = files.read_bytes(trained_path)  # reuse: retraining could move centroids
        log.info("reusing trained index %s", trained_path)
    else:
        sample = None
        if needs_training(factory, dim, plan.metric):
            sample = _training_vectors(plan, shards, dim, ids)
            log.info("training %s on %d vectors", factory, len(sample))
        trained = train_index(factory, dim, plan.metric, sample, seed=plan.seed)
    trained_sha = hashlib.sha256(trained).hexdigest()

    # Keep shards that still match the previous manifest, built from the same source, trained index and ids.
    built_under = {**recorded, "trained": prev_trained.get("sha256")} if recorded else None
    ledger = Ledger.from_listing(files.join(plan.output, SHARDS_SUBDIR),
                                 {s.get("source"): s for s in prev.get("shards") or []},
                                 {**now, "trained": trained_sha}, built_under)
    kept, todo = [], []
    for s in shards:
        rec = ledger.finished(s["name"], source_sha256=s["sha256"])
        if rec is not None:
            kept.append(rec.info())
        else:
            todo.append(s)
    log.info("%d shard(s) kept from the previous run, %d to build", len(kept), len(todo))

    built = []
    if todo:
        p = beam.Pipeline(options=options)
        build_graph(p, todo, BuildShard(plan, dim, _Blob(trained_path, trained_sha), ids_blob), plan.output)
        if beam_kit.translated_only(p, "build_index"):
            return None
        files.makedirs(plan.output)
        if not files.shard_is_valid(trained_path, trained_sha):
            files.write_atomic(trained_path, trained)
        beam_kit.clear_run_dir(plan.output)  # a killed run's report must not enter this manifest
        with beam_kit.Progress.running(sum(int(s["rows"]) for s in todo), "vectors", "build_index", options):
            result = beam_kit.run_pipeline(p)
        print(beam_kit.counter_line(METRICS_NAMESPACE, beam_kit.counter_values(result, METRICS_NAMESPACE),
                                  beam_kit.runner_name(options)))
        built = beam_kit.read_run_report(plan.output)
        beam_kit.clear_run_dir(plan.output)
    elif dry:
        print(beam_kit.dry_run_message("build_index", options))
        return None

    manifest = make_index_manifest(
        factory, dim, plan.metric, plan.modality, kept + built,
        embeddings={"dir": plan.embeddings, "manifest_sha256": emb_sha, "count": int(entry["count"])},
        trained={"name": TRAINED_INDEX, "sha256": trained_sha, **train_cfg},
        created_by=CREATED_BY, ids=ids_entry)
    if manifest["ntotal"] != expected or len(manifest["shards"]) != len(shards):
        raise IndexBuildError(f"index holds {manifest['ntotal']} vectors in {len(manifest['shards'])} shards; "
                              f"expected {expected} in {len(shards)} (the runner lost shards?)")
    if auto is not None:  # measured on the index as built: the recorded numbers are the full index's
        manifest["search_params"], manifest["auto"] = _measure_built(plan, manifest, shards, ids, auto)
    files.write_json_atomic(files.join(plan.output, INDEX_MANIFEST), manifest)
    return {"factory": factory, "metric": plan.metric, "search_params": manifest.get("search_params"), "d": dim,
            "ntotal": manifest["ntotal"], "shards": len(shards), "built": len(built), "kept": len(kept),
            "ids": ids_entry, "runner": beam_kit.runner_name(options), "seconds": round(time.time() - t0, 2)}


def _held_out_queries(plan: IndexPlan, emb_manifest: dict, shards: list[dict], dim: int,
                      ids: Optional[np.ndarray]) -> tuple[np.ndarray, str]:
    """Queries for measuring recall: a seeded sample of the OTHER modality's embeddings (captions for an
    image index: the queries it will serve, never in it); items of the index when that modality is absent."""
    other = schema.MODALITY_TEXT if plan.modality == schema.MODALITY_IMAGE else schema.MODALITY_IMAGE
    if other in emb_manifest["modalities"] and emb_manifest["modalities"][other]["shards"]:
        o_shards = emb_manifest["modalities"][other]["shards"]
        o_ids = np.concatenate([_shard_ids(plan.embeddings, other, s) for s in o_shards])
        chosen = select_training_ids(o_ids, plan.auto_queries, plan.seed + 2)
        return _gather(plan.embeddings, other, o_shards, chosen, dim), f"{len(chosen)} {other} embeddings"
    q = _training_vectors(plan, shards, dim, ids, n=plan.auto_queries, seed=plan.seed + 2)
    return q, f"{len(q)} {plan.modality} embeddings of the index itself (no {other} embeddings)"


def _choose(plan: IndexPlan, emb_manifest: dict, shards: list[dict], dim: int, ids: Optional[np.ndarray],
            n_total: int) -> tuple[str, dict]:
    """--index-factory auto: the factory index_choice picks on a tuning collection of --auto-sample items."""
    t0 = time.time()
    tune_ids = ids if ids is not None else np.concatenate([_shard_ids(plan.embeddings, plan.modality, s)
                                                           for s in shards])
    tune_ids = select_training_ids(tune_ids, plan.auto_sample, plan.seed + 1)
    vectors = _gather(plan.embeddings, plan.modality, shards, tune_ids, dim)
    queries, source = _held_out_queries(plan, emb_manifest, shards, dim, ids)
    log.info("auto index: choosing among %s on %d of %d items, %s as queries",
             index_choice.candidate_factories(n_total, dim), len(tune_ids), n_total, source)
    try:
        best, cands = index_choice.choose_index(tune_ids, vectors, queries, n_total, plan.budget, plan.metric,
                                                plan.seed, log=log.info)
    except index_choice.NoIndexFits as exc:
        raise IndexBuildError(str(exc)) from None
    log.info("auto index: chose %s in %.1f s", best.factory, time.time() - t0)
    return best.factory, {"budget": plan.budget.as_dict(), "tuning_items": int(len(tune_ids)),
                          "queries": source, "queries_array": queries,
                          "candidates": [c.as_dict() for c in cands], "choice_s": round(time.time() - t0, 2)}


def _exact_ids(plan: IndexPlan, shards: list[dict], ids: Optional[np.ndarray], queries: np.ndarray) -> np.ndarray:
    """Exact top-10 ids of ``queries`` over the indexed items, one embedding shard at a time."""
    def listed():
        for sid, vec in embeddings.iter_embedding_shards(plan.embeddings, plan.modality, files=files.BEAM_FILES):
            keep = np.isin(sid, ids) if ids is not None else slice(None)
            yield sid[keep], vec[keep]
    [(_, found)] = exact.exact_topk_shards([queries], listed(), index_choice.K, plan.metric)
    return found


def _measure_built(plan: IndexPlan, manifest: dict, shards: list[dict], ids: Optional[np.ndarray],
                   auto: dict) -> tuple[dict, dict]:
    """Tune the search parameter on the built index against exact search, measure its query time and memory;
    a built index outside the budget is an error (the choice on a sample can be wrong at full size)."""
    queries = auto.pop("queries_array")
    index = ShardedIndex([index_from_bytes(files.read_bytes(files.join(plan.output, SHARDS_SUBDIR,
                                                                             s["name"])))
                          for s in manifest["shards"]])
    memory = int(sum(len(index_bytes(x)) for x in index.shards))
    params, recall, sweep = index_choice.tune_search(index, manifest["factory"], queries,
                                                     _exact_ids(plan, shards, ids, queries), plan.budget.recall_target)
    ms = index_choice.query_ms(index, queries)
    budget = plan.budget
    misses = [m for m, bad in ((f"recall@10 {recall:.3f} < {budget.recall_target}", recall < budget.recall_target),
                               (f"{ms:.2f} ms/query > {budget.max_query_ms} ms", budget.max_query_ms is not None
                                and ms > budget.max_query_ms),
                               (f"{index_choice.human_bytes(memory)} > "
                                f"{index_choice.human_bytes(budget.max_memory_bytes or 0)}",
                                budget.max_memory_bytes is not None and memory > budget.max_memory_bytes)) if bad]
    if misses:
        raise IndexBuildError(f"the chosen {manifest['factory']} as built misses the budget: {'; '.join(misses)} "
                              f"(chosen on {auto['tuning_items']} sampled items); raise --auto-sample or the budget")
    log.info("auto index %s: recall@10 %.3f at %s, %.2f ms/query, %s", manifest["factory"], recall, params,
             ms, index_choice.human_bytes(memory))
    return params, {**auto, "measured": {"recall@10": recall, "query_ms": ms, "memory_bytes": memory,
                                         "sweep": sweep, "how": "single-query p50 over the held-out queries; "
                                         f"recall@10 = knn_intersection_measure vs exact {plan.metric} search"}}


@click.command(context_settings=beam_kit.BEAM_CLI_CONTEXT)
@plan_options(IndexPlan)
@click.pass_context
def main(ctx, **values):
    """Build a sharded FAISS index (one shard per embedding shard). Unknown --flags go to Beam.

    Counters namespace: build_index (vectors_added, shards_built)."""
    beam_kit.configure_logging(fmt="%(asctime)s %(levelname)s %(name)s: %(message)s")
    beam_kit.check_beam_flags(ctx.args)
    with cli_errors(memory_options=("--train-sample",)):
        plan = plan_from_cli(IndexPlan, values)
        summary = run(plan, tuple(ctx.args))
    if summary is None:
        return
    subset = f" of the {summary['ids']['count']} ids in {summary['ids']['path']}" if summary["ids"] else ""
    click.echo(f"index {summary['factory']} ({summary['metric']}, d={summary['d']}): {summary['ntotal']} vectors"
               f"{subset} in {summary['shards']} shards ({summary['built']} built, {summary['kept']} kept) "
               f"in {summary['seconds']:.1f} s -> {plan.output}"
               + (f"; search params {summary['search_params']}" if summary.get("search_params") else ""))


beam_kit.add_progress_help(main)

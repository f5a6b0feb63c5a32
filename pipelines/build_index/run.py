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
from dataclasses import dataclass, replace
from typing import Optional

import apache_beam as beam
import click
import numpy as np

from pipelines import beam_kit, files
from pipelines.build_index.graph import METRICS_NAMESPACE, BuildShard, _Blob, build_graph
from pipelines.build_index.plan import AUTO, IndexBuildError, IndexPlan
from pipelines.ledger import Ledger, write_or_keep
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


@dataclass(frozen=True)
class Inputs:
    """What resolve checked and the build needs: the embeddings (manifest, its sha256, this modality's shards),
    the --ids list (None: every embedding) and the factory (--index-factory auto chosen)."""
    emb_manifest: dict
    emb_sha: str
    shards: list
    dim: int
    count: int
    ids: Optional[np.ndarray]
    ids_entry: Optional[dict]
    ids_blob: Optional[_Blob]
    factory: str
    auto: Optional[dict]

    @property
    def expected(self) -> int:
        return int(len(self.ids)) if self.ids is not None else self.count

    def config(self, plan: IndexPlan) -> dict:
        """What an index's shards and trained index depend on besides the trained index (its fingerprint)."""
        return {"factory": self.factory, "d": self.dim, "metric": plan.metric, "modality": plan.modality,
                "ids_sha256": self.ids_sha256}

    def train_cfg(self, plan: IndexPlan) -> dict:
        return {"train_sample": plan.train_sample, "seed": plan.seed, "embeddings_manifest_sha256": self.emb_sha,
                "ids_sha256": self.ids_sha256}

    @property
    def ids_sha256(self) -> Optional[str]:
        return self.ids_entry["sha256"] if self.ids_entry else None


@holds_output("build_index")
def run(plan: IndexPlan, beam_args=()) -> Optional[dict]:
    """Train, build the shards still missing, write index_manifest.json; returns a summary (None on dry run)."""
    t0 = time.time()
    options = beam_kit.task_pipeline_options(beam_args)
    set_threads(plan.threads)
    require_headroom("build_index", plan.threads, ("--threads", "--train-sample"))
    inp = resolve(plan)
    prev = _previous_manifest(plan.output) or {}
    trained, trained_sha = _trained_index(plan, inp, prev)
    kept, todo = _kept_shards(plan, inp, prev, trained_sha)
    built = _build(plan, inp, options, todo, trained, trained_sha)
    if built is None:
        return None
    manifest = _write_manifest(plan, inp, kept + built, trained_sha)
    return {"factory": inp.factory, "metric": plan.metric, "search_params": manifest.get("search_params"),
            "d": inp.dim, "ntotal": manifest["ntotal"], "shards": len(inp.shards), "built": len(built),
            "kept": len(kept), "ids": inp.ids_entry, "runner": beam_kit.runner_name(options),
            "seconds": round(time.time() - t0, 2)}


def resolve(plan: IndexPlan) -> Inputs:
    """Check the embeddings and the --ids list, and choose the factory (--index-factory auto)."""
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
    ids, ids_entry, ids_blob = _read_ids(plan, shards)
    inp = Inputs(emb_manifest, hashlib.sha256(manifest_bytes).hexdigest(), shards, dim, int(entry["count"]), ids,
                 ids_entry, ids_blob, plan.factory, None)
    if plan.factory != AUTO:
        return inp
    factory, auto = _choose(plan, emb_manifest, shards, dim, ids, inp.expected)
    return replace(inp, factory=factory, auto=auto)


def _read_ids(plan: IndexPlan, shards: list[dict]) -> tuple[Optional[np.ndarray], Optional[dict], Optional[_Blob]]:
    """--ids: the listed ids (each checked to have an embedding), their manifest entry and the workers' blob."""
    if not plan.ids:
        return None, None, None
    if not files.exists(plan.ids):
        raise IndexBuildError(f"--ids {plan.ids}: no such file")
    ids_bytes = files.read_bytes(plan.ids)
    ids = read_id_list(ids_bytes, f"--ids {plan.ids}")
    if not len(ids):
        raise IndexBuildError(f"--ids {plan.ids}: lists no ids")
    check_ids_present(ids, plan.embeddings, plan.modality, shards, f"--ids {plan.ids}")
    ids_entry = {"path": plan.ids, "sha256": files.sha256_bytes(ids_bytes), "count": int(len(ids))}
    return ids, ids_entry, _Blob(plan.ids, ids_entry["sha256"])


def _built_under(prev: dict) -> Optional[dict]:
    """The config an earlier run's index was built under (Inputs.config), None when there is none."""
    if not prev:
        return None
    return {**{k: prev.get(k) for k in ("factory", "d", "metric", "modality")},
            "ids_sha256": (prev.get("ids") or {}).get("sha256")}


def _trained_index(plan: IndexPlan, inp: Inputs, prev: dict) -> tuple[bytes, str]:
    """The trained index and its sha256: the earlier run's when the ledger says it is finished (same config and
    training inputs, file intact: retraining could move centroids), else trained now."""
    trained_path = files.join(plan.output, TRAINED_INDEX)
    ledger = Ledger.from_listing(plan.output, {TRAINED_INDEX: prev.get("trained", {})}, inp.config(plan),
                                 _built_under(prev))
    if ledger.finished(TRAINED_INDEX, **inp.train_cfg(plan)) is not None:
        trained = files.read_bytes(trained_path)
        log.info("reusing trained index %s", trained_path)
    else:
        sample = None
        if needs_training(inp.factory, inp.dim, plan.metric):
            sample = _training_vectors(plan, inp.shards, inp.dim, inp.ids)
            log.info("training %s on %d vectors", inp.factory, len(sample))
        trained = train_index(inp.factory, inp.dim, plan.metric, sample, seed=plan.seed)
    return trained, hashlib.sha256(trained).hexdigest()


def _kept_shards(plan: IndexPlan, inp: Inputs, prev: dict, trained_sha: str) -> tuple[list[dict], list[dict]]:
    """(kept, to build): the ledger keeps the earlier manifest's shards built under the same config and trained
    index from the same source shard, whose files still match."""
    built_under = _built_under(prev)
    ledger = Ledger.from_listing(files.join(plan.output, SHARDS_SUBDIR),
                                 {s.get("source"): s for s in prev.get("shards") or []},
                                 {**inp.config(plan), "trained": trained_sha},
                                 {**built_under, "trained": prev.get("trained", {}).get("sha256")} if built_under
                                 else None)
    kept, todo = [], []
    for s in inp.shards:
        rec = ledger.finished(s["name"], source_sha256=s["sha256"])
        if rec is not None:
            kept.append(rec.info())
        else:
            todo.append(s)
    log.info("%d shard(s) kept from the previous run, %d to build", len(kept), len(todo))
    return kept, todo


def _build(plan: IndexPlan, inp: Inputs, options, todo: list[dict], trained: bytes,
           trained_sha: str) -> Optional[list[dict]]:
    """The Beam job over the shards to build: their manifest entries ([] when none is; None for a dry run)."""
    if not todo:
        if beam_kit.is_dry_run(options):
            print(beam_kit.dry_run_message("build_index", options))
            return None
        return []
    trained_path = files.join(plan.output, TRAINED_INDEX)
    p = beam.Pipeline(options=options)
    build_graph(p, todo, BuildShard(plan, inp.dim, _Blob(trained_path, trained_sha), inp.ids_blob), plan.output)
    if beam_kit.translated_only(p, "build_index"):
        return None
    files.makedirs(plan.output)
    write_or_keep(trained_path, trained)  # the trained index, unless the file already holds it
    beam_kit.clear_run_dir(plan.output)  # a killed run's report must not enter this manifest
    with beam_kit.Progress.running(sum(int(s["rows"]) for s in todo), "vectors", "build_index", options):
        result = beam_kit.run_pipeline(p)
    print(beam_kit.counter_line(METRICS_NAMESPACE, beam_kit.counter_values(result, METRICS_NAMESPACE),
                                beam_kit.runner_name(options)))
    built = beam_kit.read_run_report(plan.output)
    beam_kit.clear_run_dir(plan.output)
    return built


def _write_manifest(plan: IndexPlan, inp: Inputs, entries: list[dict], trained_sha: str) -> dict:
    """index_manifest.json of the index whose shard ``entries`` these are (checked to hold every expected vector;
    --index-factory auto: with the search parameters measured on it)."""
    manifest = make_index_manifest(
        inp.factory, inp.dim, plan.metric, plan.modality, entries,
        embeddings={"dir": plan.embeddings, "manifest_sha256": inp.emb_sha, "count": inp.count},
        trained={"name": TRAINED_INDEX, "sha256": trained_sha, **inp.train_cfg(plan)},
        created_by=CREATED_BY, ids=inp.ids_entry)
    expected, shards, ids, auto = inp.expected, inp.shards, inp.ids, inp.auto
    if manifest["ntotal"] != expected or len(manifest["shards"]) != len(shards):
        raise IndexBuildError(f"index holds {manifest['ntotal']} vectors in {len(manifest['shards'])} shards; "
                              f"expected {expected} in {len(shards)} (the runner lost shards?)")
    if auto is not None:  # measured on the index as built: the recorded numbers are the full index's
        manifest["search_params"], manifest["auto"] = _measure_built(plan, manifest, shards, ids, auto)
    files.write_json_atomic(files.join(plan.output, INDEX_MANIFEST), manifest)
    return manifest


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
    with cli_errors(memory_options=("--train-sample",), job="build_index"):
        beam_kit.check_beam_flags(ctx.args)
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

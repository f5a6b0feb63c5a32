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

log = logging.getLogger("pipelines.build_index")
CREATED_BY = "pipelines.build_index"


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

    def __post_init__(self):
        for name in ("embeddings", "output"):
            if not getattr(self, name):
                raise IndexBuildError(f"{name} must be a path, got {getattr(self, name)!r}")
        common.check_choice("modality", self.modality, emb.MODALITIES)
        common.check_choice("metric", self.metric, sorted(ix.METRICS))
        if not self.factory or not self.factory.strip():
            raise IndexBuildError("index factory must be a faiss factory string such as Flat or IVF256,Flat")
        common.check_positive("train_sample", self.train_sample)
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


def _training_vectors(plan: IndexPlan, shards: list[dict], dim: int, ids: Optional[np.ndarray]) -> np.ndarray:
    """The deterministic training sample (of the listed ids, if any), gathered shard by shard: the launcher
    holds the sample and one shard at a time, never the whole collection."""
    if ids is None:
        ids = np.concatenate([_shard_ids(plan.embeddings, plan.modality, s) for s in shards])
    chosen = ix.select_training_ids(ids, plan.train_sample, plan.seed)
    found: dict[int, np.ndarray] = {}
    for s in shards:
        path = common.join(plan.embeddings, emb.shard_relpath(plan.modality, s["name"]))
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

    config = {"factory": plan.factory, "d": dim, "metric": plan.metric, "modality": plan.modality}
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
        if ix.needs_training(plan.factory, dim, plan.metric):
            sample = _training_vectors(plan, shards, dim, ids)
            log.info("training %s on %d vectors", plan.factory, len(sample))
        trained = ix.train_index(plan.factory, dim, plan.metric, sample, seed=plan.seed)
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
        plan.factory, dim, plan.metric, plan.modality, kept + built,
        embeddings={"dir": plan.embeddings, "manifest_sha256": emb_sha, "count": int(entry["count"])},
        trained={"name": ix.TRAINED_INDEX, "sha256": trained_sha, **train_cfg},
        created_by=CREATED_BY, ids=ids_entry)
    if manifest["ntotal"] != expected or len(manifest["shards"]) != len(shards):
        raise IndexBuildError(f"index holds {manifest['ntotal']} vectors in {len(manifest['shards'])} shards; "
                              f"expected {expected} in {len(shards)} (the runner lost shards?)")
    common.write_json_atomic(common.join(plan.output, ix.INDEX_MANIFEST), manifest)
    return {"factory": plan.factory, "metric": plan.metric, "d": dim, "ntotal": manifest["ntotal"],
            "shards": len(shards), "built": len(built), "kept": len(kept), "ids": ids_entry,
            "runner": common.runner_name(options), "seconds": round(time.time() - t0, 2)}


def build_index(emb_dir: str, output: str, modality: str, factory: str, metric: str, train_sample: int,
                seed: int, threads: Optional[int], beam_args=()) -> Optional[dict]:
    """Positional form kept for existing callers (tests/test_rerank_pipeline.py); builds an IndexPlan."""
    return run(IndexPlan(emb_dir, output, modality, factory, metric, train_sample, seed, threads), beam_args)


@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--embeddings", "emb_dir", required=True, help="Embeddings directory (embeddings_manifest.json).")
@click.option("--output", required=True, help="Index directory.")
@click.option("--modality", type=click.Choice(emb.MODALITIES), default="image", show_default=True)
@click.option("--index-factory", "factory", default="Flat", show_default=True,
              help='faiss factory string: "Flat", "IVF256,Flat", "HNSW32", "IVF256,PQ16x8"...')
@click.option("--metric", type=click.Choice(sorted(ix.METRICS)), default="ip", show_default=True)
@click.option("--train-sample", type=click.IntRange(min=1), default=50_000, show_default=True,
              help="Training vectors for factories that need training (>= 39 per IVF list).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help=f"faiss OpenMP threads per process (default ${ix.THREADS_ENV} or all).")
@click.option("--ids", "ids_path", default=None,
              help="Parquet file with an int64 item_id column: index only these items (a fold, a sub-pool).")
@click.pass_context
def main(ctx, emb_dir, output, modality, factory, metric, train_sample, seed, threads, ids_path):
    """Build a sharded FAISS index (one shard per embedding shard). Unknown --flags go to Beam.

    Counters namespace: build_index (vectors_added, shards_built)."""
    common.configure_logging(fmt="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common.check_beam_flags(ctx.args)
    with common.cli_errors():
        plan = IndexPlan(emb_dir, output, modality, factory, metric, train_sample, seed, threads, ids_path)
        summary = run(plan, tuple(ctx.args))
    if summary is None:
        return
    subset = f" of the {summary['ids']['count']} ids in {summary['ids']['path']}" if summary["ids"] else ""
    click.echo(f"index {summary['factory']} ({summary['metric']}, d={summary['d']}): {summary['ntotal']} vectors"
               f"{subset} in {summary['shards']} shards ({summary['built']} built, {summary['kept']} kept) "
               f"in {summary['seconds']:.1f} s -> {output}")


common.add_progress_help(main)

if __name__ == "__main__":
    main()

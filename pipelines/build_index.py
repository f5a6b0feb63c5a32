"""Build a sharded FAISS index from an embeddings directory: one index shard per embedding shard.

    python -m pipelines.build_index --embeddings EMB --output INDEX --modality image \\
        --index-factory "IVF256,Flat" --train-sample 20000 [--runner ... Beam options]

The launcher trains once (deterministic, shard-order independent sample) and passes the trained bytes to
the workers as a side input; each worker reads its embedding shard (checksum-verified), adds the vectors
with their global item_ids and writes ``shards/<name>.faiss`` atomically. The launcher then writes
``index_manifest.json``. A rerun with the same configuration keeps every shard whose file still matches the
previous manifest (and whose source shard and trained index are unchanged), and rebuilds the rest.
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

from pipelines import common
from retrieval_core import embeddings as emb
from retrieval_core import index as ix

log = logging.getLogger("pipelines.build_index")


class BuildShard(beam.DoFn):
    """Embedding shard entry -> written index shard -> its manifest entry."""

    def __init__(self, emb_dir: str, modality: str, output: str, dim: int, threads: Optional[int]):
        self.emb_dir, self.modality, self.output, self.dim, self.threads = emb_dir, modality, output, dim, threads

    def setup(self):
        ix.set_threads(self.threads)  # faiss bundles its own OpenMP pool

    def process(self, entry: dict, trained: bytes):
        t0 = time.time()
        src = common.join(self.emb_dir, emb.shard_relpath(self.modality, entry["name"]))
        data = common.read_bytes(src)
        emb.verify_shard_bytes(data, entry, src)
        ids, vectors = emb.read_embedding_shard(data)
        emb.check_shard_contents(ids, vectors, entry, self.dim, src)
        shard = ix.build_shard(trained, ids, vectors)
        name = ix.shard_file_name(entry["name"])
        sha = common.write_atomic(common.join(self.output, ix.SHARDS_SUBDIR, name), ix.index_bytes(shard))
        log.info("built %s: %d vectors in %.1f s", name, shard.ntotal, time.time() - t0)
        yield {"name": name, "rows": int(shard.ntotal), "sha256": sha,
               "source": entry["name"], "source_sha256": entry["sha256"]}


def _previous_manifest(output: str) -> Optional[dict]:
    path = common.join(output, ix.INDEX_MANIFEST)
    if not common.exists(path):
        return None
    try:
        return common.read_json(path)
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable previous manifest %s (%s)", path, exc)
        return None


def _training_vectors(emb_dir: str, modality: str, shards: list[dict], n: int, seed: int, dim: int) -> np.ndarray:
    """The deterministic training sample, gathered shard by shard (never the whole collection in memory)."""
    all_ids = np.concatenate([emb.read_embedding_ids(common.read_bytes(
        common.join(emb_dir, emb.shard_relpath(modality, s["name"])))) for s in shards])
    chosen = ix.select_training_ids(all_ids, n, seed)
    wanted = set(chosen.tolist())
    found: dict[int, np.ndarray] = {}
    from tqdm import tqdm
    for s in tqdm(shards, desc="training sample", unit="shard"):
        data = common.read_bytes(common.join(emb_dir, emb.shard_relpath(modality, s["name"])))
        emb.verify_shard_bytes(data, s, s["name"])
        ids, vectors = emb.read_embedding_shard(data)
        for row in np.flatnonzero(np.isin(ids, chosen)):
            found[int(ids[row])] = vectors[row]
    missing = wanted - set(found)
    if missing:
        raise RuntimeError(f"training ids vanished while reading shards: {sorted(missing)[:5]}")
    return np.stack([found[int(i)] for i in chosen]).astype(np.float32) if len(chosen) else np.zeros((0, dim), np.float32)


def build_index(emb_dir: str, output: str, modality: str, factory: str, metric: str, train_sample: int,
                seed: int, threads: Optional[int], beam_args: list[str]) -> dict:
    t0 = time.time()
    ix.set_threads(threads)
    manifest_path = common.join(emb_dir, emb.EMBEDDINGS_MANIFEST)
    if not common.exists(manifest_path):
        raise emb.EmbeddingsError(f"no {emb.EMBEDDINGS_MANIFEST} in {emb_dir}: not an embeddings directory "
                                  f"(run pipelines.encode first)")
    manifest_bytes = common.read_bytes(manifest_path)
    emb_manifest = emb.validate_embeddings_manifest(json.loads(manifest_bytes.decode("utf-8")))
    entry = emb.modality_entry(emb_manifest, modality)
    shards, dim = entry["shards"], int(emb_manifest["dim"])
    if not shards:
        raise click.ClickException(f"no {modality} embedding shards in {emb_dir}")
    emb_sha = hashlib.sha256(manifest_bytes).hexdigest()
    config = {"factory": factory, "d": dim, "metric": metric, "modality": modality}
    train_cfg = {"train_sample": int(train_sample), "seed": int(seed), "embeddings_manifest_sha256": emb_sha}

    prev = _previous_manifest(output)
    same_config = prev is not None and all(prev.get(k) == v for k, v in config.items())
    trained_path = common.join(output, ix.TRAINED_INDEX)
    prev_trained = (prev or {}).get("trained", {})
    if same_config and {k: prev_trained.get(k) for k in train_cfg} == train_cfg \
            and common.shard_is_valid(trained_path, prev_trained.get("sha256")):
        trained = common.read_bytes(trained_path)  # reuse: retraining could move centroids
        log.info("reusing trained index %s", trained_path)
    else:
        sample = None
        if ix.needs_training(factory, dim, metric):
            sample = _training_vectors(emb_dir, modality, shards, train_sample, seed, dim)
            log.info("training %s on %d vectors", factory, len(sample))
        trained = ix.train_index(factory, dim, metric, sample, seed=seed)
    trained_sha = hashlib.sha256(trained).hexdigest()
    if not common.shard_is_valid(trained_path, trained_sha):
        common.write_atomic(trained_path, trained)

    # Keep shards that still match the previous manifest, built from the same source and trained index.
    kept, todo = [], []
    prev_shards = {s["source"]: s for s in (prev or {}).get("shards", [])} if same_config and \
        prev_trained.get("sha256") == trained_sha else {}
    for s in shards:
        old = prev_shards.get(s["name"])
        if old and old.get("source_sha256") == s["sha256"] and common.shard_is_valid(
                common.join(output, ix.SHARDS_SUBDIR, old["name"]), old["sha256"]):
            kept.append(old)
        else:
            todo.append(s)
    log.info("%d shard(s) kept from the previous run, %d to build", len(kept), len(todo))

    built = []
    if todo:
        _clear_infos(output)  # leftovers of a killed run must not enter this manifest
        with beam.Pipeline(options=common.pipeline_options(beam_args)) as p:
            trained_pc = p | "Trained" >> beam.Create([trained])
            infos = (p
                     | "Shards" >> beam.Create(todo)
                     | "Spread" >> beam.Reshuffle()
                     | "Build" >> beam.ParDo(BuildShard(emb_dir, modality, output, dim, threads),
                                             beam.pvalue.AsSingleton(trained_pc)))
            # Shard infos come back through small files: runner-agnostic, no driver-side collect.
            (infos | "ToJson" >> beam.Map(lambda d: json.dumps(d, sort_keys=True))
                   | "WriteInfos" >> beam.io.WriteToText(common.join(output, "_work", "shard_infos"),
                                                          file_name_suffix=".jsonl"))
        built = _read_infos(output)

    manifest = ix.make_index_manifest(
        factory, dim, metric, modality, kept + built,
        embeddings={"dir": emb_dir, "manifest_sha256": emb_sha, "count": int(entry["count"])},
        trained={"name": ix.TRAINED_INDEX, "sha256": trained_sha, **train_cfg},
        created_by="pipelines.build_index")
    if manifest["ntotal"] != int(entry["count"]) or len(manifest["shards"]) != len(shards):
        raise RuntimeError(f"index holds {manifest['ntotal']} vectors in {len(manifest['shards'])} shards; "
                           f"embeddings have {entry['count']} in {len(shards)}")
    common.write_json_atomic(common.join(output, ix.INDEX_MANIFEST), manifest)
    summary = {"factory": factory, "metric": metric, "d": dim, "ntotal": manifest["ntotal"],
               "shards": len(shards), "built": len(built), "kept": len(kept),
               "seconds": round(time.time() - t0, 2)}
    return summary


def _info_paths(output: str) -> list[str]:
    from apache_beam.io.filesystems import FileSystems
    pattern = common.join(output, "_work", "shard_infos*")
    return [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]


def _clear_infos(output: str) -> None:
    from apache_beam.io.filesystems import FileSystems
    paths = _info_paths(output)
    if paths:
        FileSystems.delete(paths)


def _read_infos(output: str) -> list[dict]:
    paths = _info_paths(output)
    infos = []
    for path in paths:
        infos += [json.loads(line) for line in common.read_bytes(path).decode("utf-8").splitlines() if line]
    _clear_infos(output)
    return infos


@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--embeddings", "emb_dir", required=True, help="Embeddings directory (embeddings_manifest.json).")
@click.option("--output", required=True, help="Index directory.")
@click.option("--modality", type=click.Choice(emb.MODALITIES), default="image", show_default=True)
@click.option("--index-factory", "factory", default="Flat", show_default=True,
              help='faiss factory string: "Flat", "IVF256,Flat", "HNSW32", "IVF256,PQ16x8"...')
@click.option("--metric", type=click.Choice(sorted(ix.METRICS)), default="ip", show_default=True)
@click.option("--train-sample", type=int, default=50_000, show_default=True,
              help="Training vectors for factories that need training (>= 39 per IVF list).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help=f"faiss OpenMP threads (default ${ix.THREADS_ENV} or all).")
@click.pass_context
def main(ctx, emb_dir, output, modality, factory, metric, train_sample, seed, threads):
    """Build a sharded FAISS index (one shard per embedding shard). Unknown --flags go to Beam."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with common.cli_errors():
        summary = build_index(emb_dir, output, modality, factory, metric, train_sample, seed, threads,
                              list(ctx.args))
    click.echo(f"index {summary['factory']} ({summary['metric']}, d={summary['d']}): {summary['ntotal']} vectors "
               f"in {summary['shards']} shards ({summary['built']} built, {summary['kept']} kept) "
               f"in {summary['seconds']:.1f} s -> {output}")


if __name__ == "__main__":
    main()

"""Bulk-encode a staged collection with the bi-encoder: ``python -m pipelines.encode``.

Graph (one branch per modality)::

    Create(staged shard list) -> FlatMap(read shard -> ((collection, id), example))
      -> RunInference(KeyedModelHandler(VLModelHandler)).with_exception_handling()
           ok:   -> key (modality, collection, id % N) -> GroupByKey -> write one Parquet shard atomically
           dead: -> one dead-letter row per element of a failed batch, with the reason
      -> one run report (shard entries + dead letters) that the launcher turns into
         embeddings_manifest.json and dead_letter.jsonl

Output: ``<output>/embeddings/<modality>/<collection>-0000i-of-0000N.parquet`` (rows sorted by item_id),
``<output>/embeddings_manifest.json`` and ``<output>/dead_letter.jsonl``. The shard of an item is
``item_id % N`` (ids are hashes, so shards come out even and never depend on input order), N =
ceil(count / --images-per-shard or --texts-per-shard).

Rerun: a shard whose file matches the manifest's sha256 and holds every item planned for it is skipped
(its items are not even encoded); an incomplete shard (some items dead-lettered) is redone. A changed
model, embedding dim or staged summary invalidates everything.

Runners: DirectRunner (default) and Dataflow. Not DaskRunner: Beam 2.77's DaskRunner drops output emitted
in finish_bundle (which RunInference's BatchElements relies on) and does not separate tagged outputs
(the dead-letter queue); ``pipelines.rerank`` is written for it, this job is not.

Examples::

    python -m pipelines.encode                       # the embedded demo collection and model
    python -m pipelines.encode --staged runs/staged/coco --model runs/models/join/best \\
        --output runs/emb/coco --split test --batch-size 128
    python -m pipelines.encode ... --runner DataflowRunner --device GPU --model-copies 1 --project ... \\
        --region ... --temp_location gs://... --sdk_container_image ...
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import apache_beam as beam
import click
import numpy as np
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference

from pipelines import common
from pipelines.handlers import TASK_EMBED_IMAGE, TASK_EMBED_TEXT, VLModelHandler
from retrieval_core import embeddings as emb
from retrieval_core import schema

log = logging.getLogger(__name__)

MODALITY_IMAGE = schema.KIND_IMAGE  # "image"
MODALITY_TEXT = "text"
MODALITY_TASK = {MODALITY_IMAGE: TASK_EMBED_IMAGE, MODALITY_TEXT: TASK_EMBED_TEXT}
DEAD_LETTER_FILE = "dead_letter.jsonl"
RUN_REPORT_DIR = "_run"  # per-run scratch: the pipeline's report to the launcher
CREATED_BY = "pipelines.encode"
MODEL_FILES = ("model.safetensors", "config.json", "rr_model.json", "tokenizer.json", "vocab.txt",
               "tokenizer_config.json")


class EncodeError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------ fingerprints
def model_fingerprint(model_dir: str) -> str:
    """sha256 over the weights, configs and tokenizer files of a model folder (what decides its outputs)."""
    h = hashlib.sha256()
    found = False
    for name in MODEL_FILES:
        path = common.join(model_dir, name)
        if common.exists(path):
            h.update(f"{name}:{common.sha256_file(path)}\n".encode())
            found = found or name == "model.safetensors"
    if not found:
        raise EncodeError(f"{model_dir} has no model.safetensors: not a VLRetrievalModel folder")
    return h.hexdigest()


def model_embedding_dim(model_dir: str) -> int:
    return int(common.read_json(common.join(model_dir, "config.json"))["hidden_size"])


# ----------------------------------------------------------------------------------------- planning
@dataclass
class ShardPlan:
    """The output shards of one (modality, collection): N shards, item i goes to shard item_id % N."""
    modality: str
    collection: str
    num_shards: int
    expected_rows: list[int]  # per shard
    redo: set[int] = field(default_factory=set)  # shard indices this run (re)writes

    def name(self, index: int) -> str:
        return common.shard_name(self.collection, index, self.num_shards, ".parquet")

    def shard_of(self, item_id: int) -> int:
        return int(item_id) % self.num_shards


def plan_shards(modality: str, collection: str, ids: np.ndarray, per_shard: int) -> Optional[ShardPlan]:
    if len(ids) == 0:
        return None
    if per_shard < 1:
        raise click.BadParameter(f"items per shard must be >= 1, got {per_shard}")
    n = max(1, math.ceil(len(ids) / per_shard))
    counts = np.bincount(np.asarray(ids, dtype=np.int64) % n, minlength=n)
    return ShardPlan(modality, collection, n, [int(c) for c in counts], set(range(n)))


def reusable_entries(output: str, manifest: Optional[dict], plans: list[ShardPlan], model_sha: str, dim: int,
                     inputs: dict) -> dict[str, list[dict]]:
    """Marks shards that an earlier run finished (same model, dim, inputs; checksum matches; every planned
    row present) as not to redo, and returns the manifest entries to keep, per modality."""
    keep: dict[str, list[dict]] = {}
    if manifest is None:
        return keep
    same_run = (manifest.get("model", {}).get("sha256") == model_sha and int(manifest.get("dim", -1)) == dim
                and manifest.get("inputs") == inputs)
    if not same_run:
        log.info("existing manifest is from another model/inputs: re-encoding everything")
        return keep
    planned_modalities = {p.modality for p in plans}
    for modality, entry in manifest["modalities"].items():
        by_name = {s["name"]: s for s in entry["shards"]}
        if modality not in planned_modalities:  # e.g. --modality image now, text from an earlier run
            keep[modality] = [s for s in entry["shards"]
                              if common.shard_is_valid(common.join(output, emb.shard_relpath(modality, s["name"])),
                                                       s["sha256"])]
            continue
        for plan in (p for p in plans if p.modality == modality):
            for i in sorted(plan.redo):
                s = by_name.get(plan.name(i))
                path = common.join(output, emb.shard_relpath(modality, plan.name(i)))
                if s and int(s["rows"]) == plan.expected_rows[i] and common.shard_is_valid(path, s["sha256"]):
                    plan.redo.discard(i)
                    keep.setdefault(modality, []).append(s)
    return keep


# ---------------------------------------------------------------------------------------- reading
class StagedShardReader:
    """Reads one staged shard into keyed examples, keeping only items whose output shard is redone.

    Uses StagedDataset's public per-shard readers so that the Parquet and HDF5 feature layouts both work."""

    def __init__(self, staged_dir: str, split: Optional[str], plans: dict[tuple[str, str], ShardPlan]):
        self.staged_dir = staged_dir
        self.split = split
        self.plans = plans
        self._ds = None

    def _dataset(self):
        if self._ds is None:
            from retrieval_core.store import StagedDataset
            self._ds = StagedDataset(self.staged_dir, opener=common.open_file)
        return self._ds

    def _wanted(self, modality: str, collection: str, item_id: int) -> bool:
        plan = self.plans.get((modality, collection))
        return plan is not None and plan.shard_of(item_id) in plan.redo

    def images(self, task: tuple[str, str]) -> Iterable[tuple[tuple[str, int], tuple[np.ndarray, np.ndarray]]]:
        collection, rel = task
        table = self._dataset().read_image_shard(rel, None, self.split)
        if table is None:
            return
        for i, item_id in enumerate(table.item_ids.tolist()):
            if self._wanted(MODALITY_IMAGE, collection, item_id):
                feats, boxes = table.regions(i)
                yield (collection, item_id), (feats.copy(), boxes.copy())

    def captions(self, task: tuple[str, str]) -> Iterable[tuple[tuple[str, int], str]]:
        collection, rel = task
        table = self._dataset().read_shard_columns(rel, ("caption_id", "text"), self.split)
        for cid, text in zip(table.column("caption_id").to_pylist(), table.column("text").to_pylist()):
            if self._wanted(MODALITY_TEXT, collection, cid):
                yield (collection, int(cid)), text


def staged_shards(ds, kind: str, collections: list[str]) -> list[tuple[str, str]]:
    """(collection, shard path relative to the staged dir) of every staged shard of ``kind``."""
    return [(c, name) for c in collections for name in ds.shard_names(kind, c)]


# ---------------------------------------------------------------------------------------- writing
def write_shard(group, output: str, plans: dict[tuple[str, str], ShardPlan]) -> dict:
    (modality, collection, index), rows = group
    rows = sorted(rows, key=lambda r: r[0])
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    vectors = np.stack([r[1] for r in rows]).astype(np.float32)
    data = emb.embedding_shard_bytes(ids, vectors)
    name = plans[(modality, collection)].name(index)
    common.write_atomic(common.join(output, emb.shard_relpath(modality, name)), data)
    return {"kind": "shard", "modality": modality, **emb.shard_info(name, data, len(ids))}


def dead_letter_rows(failed, modality: str) -> Iterable[dict]:
    """One row per element of a failed batch: ((key, example) list, (exc_type, repr, traceback))."""
    batch, (exc_type, exc_repr, tb) = failed
    reason = f"{getattr(exc_type, '__name__', exc_type)}: {exc_repr}"
    for key, _example in batch:
        collection, item_id = key
        yield {"kind": "dead", "modality": modality, "collection": collection, "item_id": int(item_id),
               "reason": reason, "traceback": "".join(tb[-3:]) if tb else ""}


def write_run_report(items: list[dict], path: str) -> int:
    common.write_json_atomic(path, sorted(items, key=lambda r: json.dumps(r, sort_keys=True)))
    return len(items)


# ----------------------------------------------------------------------------------------- graph
def build_pipeline(p: beam.Pipeline, *, staged: str, model: str, output: str, split: Optional[str],
                   plans: dict[tuple[str, str], ShardPlan], shard_tasks: dict[str, list[tuple[str, str]]],
                   batch_size: int, device: str, model_copies: Optional[int], num_threads: Optional[int],
                   report_path: str) -> None:
    reader = StagedShardReader(staged, split, plans)
    report_parts = []
    for modality, tasks in shard_tasks.items():
        read = reader.images if modality == MODALITY_IMAGE else reader.captions
        handler = VLModelHandler(model, MODALITY_TASK[modality], device=device, max_batch_size=batch_size,
                                 min_batch_size=batch_size, model_copies=model_copies, num_threads=num_threads)
        examples = (p | f"{modality}: staged shards" >> beam.Create(tasks)
                    | f"{modality}: read" >> beam.FlatMap(read)
                    | f"{modality}: spread" >> beam.Reshuffle())
        ok, dead = (examples | f"{modality}: encode"
                    >> RunInference(KeyedModelHandler(handler)).with_exception_handling())
        shards = (ok
                  | f"{modality}: key by shard" >> beam.Map(
                      lambda kv, m=modality: ((m, kv[0][0], plans[(m, kv[0][0])].shard_of(kv[0][1])),
                                              (kv[0][1], kv[1].inference)))
                  | f"{modality}: group shards" >> beam.GroupByKey()
                  | f"{modality}: write shards" >> beam.Map(write_shard, output, plans))
        dead_rows = dead.failed_inferences | f"{modality}: dead letters" >> beam.FlatMap(dead_letter_rows, modality)
        report_parts += [shards, dead_rows]
    if not report_parts:
        report_parts.append(p | "nothing to encode" >> beam.Create([]))
    _ = (report_parts | "all results" >> beam.Flatten()
         | "collect" >> beam.combiners.ToList()
         | "write run report" >> beam.Map(write_run_report, report_path))


# -------------------------------------------------------------------------------------- metrics
def inference_metrics(result, namespace: str) -> dict:
    """Sum RunInference's counters/distributions of one handler namespace (DirectRunner, Dataflow)."""
    from apache_beam.metrics.metric import MetricsFilter

    try:
        res = result.metrics().query(MetricsFilter().with_namespace(namespace))
    except (NotImplementedError, AttributeError) as exc:
        log.warning("runner reports no metrics (%s)", exc)
        return {}
    out: dict = {}
    for c in res.get("counters", []):
        value = c.committed if c.committed is not None else c.attempted
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + (value or 0)
    for d in res.get("distributions", []):
        v = d.committed if d.committed is not None else d.attempted
        if v is None:
            continue
        s, n = out.get(d.key.metric.name, (0, 0))
        out[d.key.metric.name] = (s + v.sum, n + v.count)
    return out


def throughput_line(modality: str, metrics: dict, device: str) -> str:
    import torch

    n = metrics.get("num_inferences", 0)
    lat_sum, batches = metrics.get("inference_batch_latency_micro_secs", (0, 0))
    bs_sum, bs_n = metrics.get("inference_request_batch_size", (0, 0))
    rate = n / (lat_sum / 1e6) if lat_sum else float("nan")
    mean_bs = bs_sum / bs_n if bs_n else float("nan")
    return (f"{modality}: {n} encoded in {batches} batches, mean batch {mean_bs:.1f}, "
            f"{rate:.1f} items/s of model time, device {device}, torch threads {torch.get_num_threads()}")


# ------------------------------------------------------------------------------------- launcher
def run_encode(staged: str, model: str, output: str, modality: str = "both", batch_size: int = 64,
               device: str = "CPU", collection: Optional[str] = None, split: Optional[str] = None,
               images_per_shard: int = 10_000, texts_per_shard: int = 50_000, model_copies: Optional[int] = None,
               num_threads: Optional[int] = None, beam_args: tuple[str, ...] = ()) -> dict:
    """Encode, write shards + manifest + dead letters; returns a report dict (counts, shards, metrics)."""
    from retrieval_core.store import StagedDataset

    t0 = time.time()
    if any("DaskRunner" in a for a in beam_args):
        raise EncodeError("pipelines.encode does not run on DaskRunner (see the module docstring); "
                          "use DirectRunner (optionally --direct_running_mode multi_processing) or Dataflow")
    modalities = [MODALITY_IMAGE, MODALITY_TEXT] if modality == "both" else [modality]
    ds = StagedDataset(staged, opener=common.open_file)
    collections = [collection] if collection else list(ds.collections)
    if collection and collection not in ds.collections:
        raise EncodeError(f"collection {collection!r} is not staged in {staged} (have {ds.collections})")
    model_sha = model_fingerprint(model)
    dim = model_embedding_dim(model)
    inputs = {"staged_summary_sha256": common.sha256_bytes(json.dumps(ds.summary, sort_keys=True).encode()),
              "collections": collections, "split": split}

    plans: dict[tuple[str, str], ShardPlan] = {}
    for m in modalities:
        for c in collections:
            if m == MODALITY_IMAGE:
                ids = ds.images_meta(c, split)["item_id"].to_numpy(np.int64)
                plan = plan_shards(m, c, ids, images_per_shard)
            else:
                ids = ds.captions(c, split)["caption_id"].to_numpy(np.int64)
                plan = plan_shards(m, c, ids, texts_per_shard)
            if plan is not None:
                plans[(m, c)] = plan
    if not plans:
        raise EncodeError(f"nothing to encode: no {'/'.join(modalities)} items in {staged} "
                          f"(collection={collection}, split={split})")

    manifest_file = common.join(output, emb.EMBEDDINGS_MANIFEST)
    old = common.read_json(manifest_file) if common.exists(manifest_file) else None
    keep = reusable_entries(output, old, list(plans.values()), model_sha, dim, inputs)
    planned_in = {m: sum(sum(p.expected_rows[i] for i in p.redo) for p in plans.values() if p.modality == m)
                  for m in modalities}
    skipped = {m: sum(int(s["rows"]) for s in keep.get(m, [])) for m in modalities}
    for m in modalities:
        n_valid = len(keep.get(m, []))
        if n_valid:
            print(f"{m}: {n_valid} shard(s) with {skipped[m]} items already valid, skipped")

    kinds = {MODALITY_IMAGE: "images", MODALITY_TEXT: "captions"}
    shard_tasks = {m: [t for t in staged_shards(ds, kinds[m], collections) if plans.get((m, t[0])) and
                       plans[(m, t[0])].redo] for m in modalities}
    shard_tasks = {m: t for m, t in shard_tasks.items() if t}
    report_path = common.join(output, RUN_REPORT_DIR, "report.json")
    common.makedirs(output)

    result = None
    if shard_tasks:
        options = common.pipeline_options(beam_args)
        p = beam.Pipeline(options=options)
        build_pipeline(p, staged=staged, model=model, output=output, split=split, plans=plans,
                       shard_tasks=shard_tasks, batch_size=batch_size, device=device, model_copies=model_copies,
                       num_threads=num_threads, report_path=report_path)
        result = p.run()
        result.wait_until_finish()
        report = common.read_json(report_path)
    else:
        report = []

    written = [r for r in report if r["kind"] == "shard"]
    dead = [r for r in report if r["kind"] == "dead"]
    by_modality: dict[str, list[dict]] = {m: list(keep.get(m, [])) for m in set(keep) | set(modalities)}
    for r in written:
        by_modality[r["modality"]].append({k: r[k] for k in ("name", "rows", "sha256")})
    dim_check = {m: s for m, s in by_modality.items() if s}
    manifest = emb.make_embeddings_manifest(model, model_sha, dim, dim_check, CREATED_BY)
    manifest["inputs"] = inputs
    common.write_json_atomic(manifest_file, manifest)
    common.write_jsonl_atomic(common.join(output, DEAD_LETTER_FILE), dead)

    summary = {"output": output, "modalities": {}, "wall_s": None, "device": device}
    for m in modalities:
        encoded = sum(r["rows"] for r in written if r["modality"] == m)
        n_dead = sum(1 for r in dead if r["modality"] == m)
        line = (f"{m}: {planned_in[m]} inputs = {encoded} encoded + {n_dead} dead-lettered"
                + (f" (+ {skipped[m]} reused from valid shards)" if skipped[m] else ""))
        print(line)
        if planned_in[m] != encoded + n_dead:
            raise EncodeError(f"{m}: counts do not reconcile: {line}")
        metrics = inference_metrics(result, VLModelHandler(model, MODALITY_TASK[m]).get_metrics_namespace()) \
            if result is not None and m in shard_tasks else {}
        if metrics:
            print(throughput_line(m, metrics, device))
        summary["modalities"][m] = {"inputs": planned_in[m], "encoded": encoded, "dead_lettered": n_dead,
                                    "reused": skipped[m], "metrics": {k: v for k, v in metrics.items()}}
    if common.exists(report_path):
        from apache_beam.io.filesystems import FileSystems
        FileSystems.delete([common.join(output, RUN_REPORT_DIR)])
    summary["wall_s"] = time.time() - t0
    print(f"embeddings: {output} (manifest {emb.EMBEDDINGS_MANIFEST}); wall time {summary['wall_s']:.1f} s")
    if dead:
        print(f"{len(dead)} item(s) dead-lettered, reasons in {common.join(output, DEAD_LETTER_FILE)}; "
              f"a rerun retries their shards")
    return summary


# ------------------------------------------------------------------------------------------- CLI
def demo_assets(beam_args: tuple[str, ...] = ()) -> tuple[str, str]:
    """(staged_dir, model_dir) of the embedded default collection and model, built on first use."""
    from pipelines.demo_assets import ensure_demo_assets
    return ensure_demo_assets(beam_args)


@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--staged", help="staged directory (pipelines.stage output); default: the embedded demo")
@click.option("--model", "model_dir", help="VLRetrievalModel folder; default: the embedded demo model")
@click.option("--output", help="embeddings directory; default <demo>/embeddings for the demo")
@click.option("--modality", type=click.Choice(["image", "text", "both"]), default="both", show_default=True)
@click.option("--batch-size", type=int, default=64, show_default=True, help="RunInference batch size")
@click.option("--device", type=click.Choice(["CPU", "GPU"], case_sensitive=False), default="CPU", show_default=True)
@click.option("--collection", help="encode only this staged collection")
@click.option("--split", help="encode only this split (e.g. test)")
@click.option("--images-per-shard", type=int, default=10_000, show_default=True)
@click.option("--texts-per-shard", type=int, default=50_000, show_default=True)
@click.option("--model-copies", type=int, help="model copies per worker machine (Dataflow GPU: 1)")
@click.option("--num-threads", type=int, help="torch intra-op threads per model")
@click.pass_context
def main(ctx, staged, model_dir, output, modality, batch_size, device, collection, split, images_per_shard,
         texts_per_shard, model_copies, num_threads):
    """Encode staged images and captions with the bi-encoder into checksummed embedding shards.
    Unknown --flags go to Beam (--runner, --direct_num_workers, Dataflow options...)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    beam_args = tuple(ctx.args)
    if (staged is None) != (model_dir is None):
        raise click.UsageError("pass both --staged and --model, or neither (the embedded demo)")
    if staged is None:
        from pipelines import demo_assets as demo
        staged, model_dir = demo_assets(beam_args)
        output = output or os.path.join(demo.demo_dir(), "embeddings")
    if output is None:
        raise click.UsageError("--output is required with --staged/--model")
    with common.cli_errors(EncodeError):
        summary = run_encode(staged, model_dir, output, modality, batch_size, device.upper(), collection, split,
                             images_per_shard, texts_per_shard, model_copies, num_threads, beam_args)
    if any(v["dead_lettered"] for v in summary["modalities"].values()):
        ctx.exit(1)


if __name__ == "__main__":
    main()

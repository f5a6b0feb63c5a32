"""Bulk-encode a staged collection with the bi-encoder: ``python -m pipelines.encode``.

Graph (one branch per modality)::

    Create(staged shards holding items of output shards still to encode) -> Reshuffle
      -> read batches: one staged shard -> its items per output shard, sorted by (length, id), cut into
         --batch-size batches (the same batches on every runner, whatever the bundles)
      -> RunInference(KeyedModelHandler(VLModelHandler(dead_letter=True)).with_no_batching())
      -> encoded: each finished batch written to a spill piece (<output>/_spill/<modality>/) -> (key (modality,
                  collection, item_id % N), piece name) -> GroupByKey -> read the shard's pieces, write one
                  Parquet shard atomically, then its completion record
         failed:  one dead-letter row per element of a failed batch, with the reason
      -> one run report (common.WriteRunReport: shard entries + dead letters) that the launcher turns into
         embeddings_manifest.json and dead_letter.jsonl

Output: ``<output>/embeddings/<modality>/<collection>-0000i-of-0000N.parquet`` (rows sorted by item_id),
``<output>/embeddings_manifest.json``, ``<output>/dead_letter.jsonl`` and ``<output>/_completed/<modality>/
<shard>.json``. The shard of an item is ``item_id % N`` (ids are hashes, so shards come out even and never
depend on input order), N = ceil(count / --images-per-shard or --texts-per-shard).

Resume: each shard gets a completion record as soon as it is written (its rows, sha256 and the key it was
encoded under: model sha256, dim, modality, collection, split, N and the sha256 of the staged shards it was
read from). A rerun -- after a finished run or a killed one, whose manifest was never written -- keeps every
shard whose record matches the current key and whose file matches the record, and encodes only the others.
Re-staging byte-identical shards keeps the key (it is built from the staged shards' checksums, not from
summary.json, which holds timings). A shard with dead-lettered items gets no record and is redone.

Runners: DirectRunner, DaskRunner (byte-identical shards: batches are fixed by the data, and there are no
tagged outputs or finish_bundle outputs, which DaskRunner drops) and Dataflow.

Memory: no process holds a collection's features, captions or embeddings. The launcher reads only the staged
id columns; a worker holds one staged shard, one batch's vectors and, when it writes, one output shard.
Vectors never travel through the GroupByKey that gathers a shard (Beam's local runners keep a GroupByKey's
whole input in memory: that was every embedding of the collection, ~1.6 KB each at d=384): each batch is
written to a spill piece as soon as RunInference has returned all of it, and the shuffle carries the
piece's name. The spill folder is removed when the run ends (and at the start, after a killed run).

Examples::

    python -m pipelines.encode                       # the embedded demo collection and model
    python -m pipelines.encode --staged runs/staged/coco --model runs/models/join/best \\
        --output runs/emb/coco --split test --batch-size 128
    python -m pipelines.encode ... --runner DataflowRunner --device cuda --model-copies 1 --project ... \\
        --region ... --temp_location gs://... --sdk_container_image ...
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import apache_beam as beam
import click
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference

from pipelines import common
from pipelines.handlers import (COMPUTED_TOKENS, TASK_EMBED_IMAGE, TASK_EMBED_TEXT, USEFUL_TOKENS, FailedBatch,
                               VLModelHandler, element_length)
from retrieval_core import embeddings as emb
from retrieval_core import schema

log = logging.getLogger(__name__)

MODALITY_IMAGE = schema.KIND_IMAGE  # "image"
MODALITY_TEXT = "text"
MODALITY_TASK = {MODALITY_IMAGE: TASK_EMBED_IMAGE, MODALITY_TEXT: TASK_EMBED_TEXT}
STAGED_KIND = {MODALITY_IMAGE: "images", MODALITY_TEXT: "captions"}  # summary.json / StagedDataset kind
STAGED_ID = {MODALITY_IMAGE: schema.ITEM_ID, MODALITY_TEXT: "caption_id"}
MODALITY_CHOICES = (MODALITY_IMAGE, MODALITY_TEXT, "both")
DEAD_LETTER_FILE = "dead_letter.jsonl"
COMPLETED_DIR = "_completed"  # per-shard completion records: what a rerun keeps
CREATED_BY = "pipelines.encode"


#: Beam counters (namespace "encode"): images_encoded, captions_encoded, images_dead_lettered, ...
METRICS_NAMESPACE = "encode"
_ENCODED = {m: Metrics.counter(METRICS_NAMESPACE, f"{STAGED_KIND[m]}_encoded") for m in STAGED_KIND}
_DEAD = {m: Metrics.counter(METRICS_NAMESPACE, f"{STAGED_KIND[m]}_dead_lettered") for m in STAGED_KIND}


class EncodeError(RuntimeError):
    pass


@dataclass(frozen=True)
class EncodePlan:
    """Everything one encode run needs, validated when built."""
    staged: str
    model: str
    output: str
    modality: str = "both"  # image | text | both
    batch_size: int = 64
    device: str = "cpu"  # cpu | cuda
    collection: Optional[str] = None
    split: Optional[str] = None
    images_per_shard: int = 10_000
    texts_per_shard: int = 50_000
    model_copies: Optional[int] = None
    threads: Optional[int] = None  # torch intra-op threads per model
    quantize: str = "none"  # schema.QUANTIZE_CHOICES: int8 Linear layers (CPU) or bf16 weights (model.quantize_model)

    def __post_init__(self):
        for name in ("staged", "model", "output"):
            if not getattr(self, name):
                raise EncodeError(f"{name} must be a path, got {getattr(self, name)!r}")
        common.check_choice("modality", self.modality, MODALITY_CHOICES)
        object.__setattr__(self, "device", str(self.device).lower())
        common.check_choice("device", self.device, common.DEVICES)
        for name in ("batch_size", "images_per_shard", "texts_per_shard"):
            common.check_positive(name, getattr(self, name))
        for name in ("model_copies", "threads"):
            common.check_positive(name, getattr(self, name), allow_none=True)
        try:
            schema.check_quantize(self.quantize, self.device)
        except ValueError as exc:
            raise EncodeError(str(exc)) from None

    @property
    def modalities(self) -> tuple[str, ...]:
        return (MODALITY_IMAGE, MODALITY_TEXT) if self.modality == "both" else (self.modality,)

    def per_shard(self, modality: str) -> int:
        return self.images_per_shard if modality == MODALITY_IMAGE else self.texts_per_shard


# ------------------------------------------------------------------------------------ fingerprints
def _model_folder(model_dir: str):
    """The folder's kind and files (retrieval_core.checkpoints), refused unless it has a BE head; a gs://
    folder is read from its local copy (checkpoints.local_model_folder)."""
    from retrieval_core.checkpoints import CheckpointError, inspect_model_folder
    try:
        return inspect_model_folder(model_dir, files=common.BEAM_FILES).require(("be",))
    except CheckpointError as exc:
        raise EncodeError(str(exc)) from None


def model_fingerprint(model_dir: str) -> str:
    """sha256 over the files that decide a model folder's outputs (weights, configs, tokenizer; for the
    training-free baseline also its text encoder's), of any kind ``checkpoints.inspect_model_folder`` knows.
    Files are named relative to the folder, so a URL folder's fingerprint is its local copy's."""
    h = hashlib.sha256()
    folder = _model_folder(model_dir)
    local = folder.local_dir
    for path in folder.files:
        name = os.path.relpath(path, local) if path.startswith(os.path.join(local, "")) else path
        h.update(f"{name}:{common.sha256_file(path)}\n".encode())
    return h.hexdigest()


def model_embedding_dim(model_dir: str) -> int:
    return _model_folder(model_dir).embedding_dim


def staged_inputs_sha256(ds, modality: str, collection: str) -> str:
    """The staged content a modality of a collection is read from (StagedDataset.content_sha256): the key
    encode's shards are recorded under, and what rerank checks embeddings against."""
    return ds.content_sha256(STAGED_KIND[modality], collection)


# ----------------------------------------------------------------------------------------- planning
@dataclass
class ShardPlan:
    """The output shards of one (modality, collection): N shards, item i goes to shard item_id % N."""
    modality: str
    collection: str
    num_shards: int
    expected_rows: list[int]  # per shard
    key: dict  # what the shards are encoded under: a completion record must match it to be kept
    redo: set[int] = field(default_factory=set)  # shard indices this run (re)writes

    def name(self, index: int) -> str:
        return common.shard_name(self.collection, index, self.num_shards, ".parquet")

    def shard_of(self, item_id: int) -> int:
        return int(item_id) % self.num_shards


def plan_shards(modality: str, collection: str, ids: np.ndarray, per_shard: int, key: dict) -> Optional[ShardPlan]:
    if len(ids) == 0:
        return None
    n = max(1, math.ceil(len(ids) / per_shard))
    counts = np.bincount(np.asarray(ids, dtype=np.int64) % n, minlength=n)
    return ShardPlan(modality, collection, n, [int(c) for c in counts], dict(key, num_shards=n),
                     {i for i in range(n) if counts[i]})


def staged_ids(ds, modality: str, collection: str, split: Optional[str]) -> np.ndarray:
    """Ids of one modality of a collection, read one id column per staged shard (no features, no text)."""
    col = STAGED_ID[modality]
    parts = [ds.read_shard_columns(rel, (col,), split).column(col).to_numpy().astype(np.int64)
             for rel in ds.shard_names(STAGED_KIND[modality], collection)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def record_path(output: str, modality: str, name: str) -> str:
    return common.join(output, COMPLETED_DIR, modality, f"{name}.json")


def _read_record(output: str, modality: str, name: str) -> Optional[dict]:
    path = record_path(output, modality, name)
    if not common.exists(path):
        return None
    try:
        return common.read_json(path)
    except (OSError, ValueError):
        return None  # a damaged record: the shard is redone


def keep_finished(output: str, plans: list[ShardPlan]) -> dict[str, list[dict]]:
    """Drops from ``redo`` every shard an earlier run finished (completion record with this plan's key and
    row count, file matching its checksum); returns their manifest entries per modality."""
    keep: dict[str, list[dict]] = {}
    for plan in plans:
        for i in sorted(plan.redo):
            rec = _read_record(output, plan.modality, plan.name(i))
            path = common.join(output, emb.shard_relpath(plan.modality, plan.name(i)))
            if rec and rec.get("key") == plan.key and int(rec.get("rows", -1)) == plan.expected_rows[i] \
                    and common.shard_is_valid(path, rec.get("sha256")):
                plan.redo.discard(i)
                keep.setdefault(plan.modality, []).append({k: rec[k] for k in ("name", "rows", "sha256")})
    return keep


def keep_other_modalities(output: str, old: Optional[dict], planned: tuple[str, ...], model_sha: str, dim: int,
                          current_key) -> dict[str, list[dict]]:
    """Shards of modalities this run does not encode (e.g. --modality image now, text from an earlier run):
    kept in the manifest when each still has a completion record matching the current model and staged
    inputs, and its file matches; the whole modality is dropped otherwise (never a partial one)."""
    keep: dict[str, list[dict]] = {}
    if not old or old.get("model", {}).get("sha256") != model_sha or int(old.get("dim", -1)) != dim:
        return keep
    for modality, entry in old.get("modalities", {}).items():
        if modality in planned:
            continue
        ok = []
        for s in entry.get("shards", []):
            rec = _read_record(output, modality, s["name"])
            path = common.join(output, emb.shard_relpath(modality, s["name"]))
            if not rec or not isinstance(rec.get("key"), dict) or rec.get("sha256") != s["sha256"] \
                    or rec["key"] != current_key(modality, rec["key"]) or not common.shard_is_valid(path, s["sha256"]):
                ok = None
                break
            ok.append({k: s[k] for k in ("name", "rows", "sha256")})
        if ok:
            keep[modality] = ok
    return keep


# ---------------------------------------------------------------------------------------- reading
class StagedShardReader:
    """One staged shard -> fixed batches of keyed examples for the output shards still to encode.

    A batch holds items of one output shard only, sorted by (padded length, id) and cut every
    ``batch_size``: little padding, and the same batches on every runner (float results depend on the
    batch), so a shard's bytes never depend on bundles or on which other shards are redone."""

    def __init__(self, staged_dir: str, split: Optional[str], plans: dict[tuple[str, str], ShardPlan],
                 batch_size: int):
        self.staged_dir = staged_dir
        self.split = split
        self.plans = plans
        self.batch_size = batch_size
        self._ds = None

    def _dataset(self):
        if self._ds is None:
            from retrieval_core.store import StagedDataset
            self._ds = StagedDataset(self.staged_dir, opener=common.open_file)
        return self._ds

    def _examples(self, modality: str, collection: str, rel: str):
        if modality == MODALITY_IMAGE:
            table = self._dataset().read_image_shard(rel, None, self.split)
            if table is None:
                return
            for i, item_id in enumerate(table.item_ids.tolist()):
                feats, boxes = table.regions(i)
                yield int(item_id), (feats.copy(), boxes.copy())
        else:
            table = self._dataset().read_shard_columns(rel, ("caption_id", "text"), self.split)
            for cid, text in zip(table.column("caption_id").to_pylist(), table.column("text").to_pylist()):
                yield int(cid), text

    def batches(self, task: tuple[str, str, str]) -> Iterable[list]:
        """Keyed examples in batches; the key (collection, item_id, batch tag, batch size) lets
        :class:`SpillBatches` tell when RunInference has returned the whole batch."""
        modality, collection, rel = task
        plan = self.plans[(modality, collection)]
        by_shard: dict[int, list] = {}
        for item_id, example in self._examples(modality, collection, rel):
            if plan.shard_of(item_id) in plan.redo:
                by_shard.setdefault(plan.shard_of(item_id), []).append((item_id, example))
        length = MODALITY_TASK[modality]
        for index in sorted(by_shard):
            items = sorted(by_shard[index], key=lambda kv: (element_length(length, kv[1]), kv[0]))
            for start in range(0, len(items), self.batch_size):
                batch = items[start:start + self.batch_size]
                tag = f"{rel}#{index}#{start}"  # unique in the run: staged shard, output shard, position
                yield [((collection, item_id, tag, len(batch)), example) for item_id, example in batch]


# ---------------------------------------------------------------------------------------- writing
def spill_piece_path(output: str, modality: str, collection: str, tag: str) -> str:
    """Where one encoded batch waits for its shard writer (a retried bundle rewrites the same name)."""
    digest = hashlib.sha1(f"{collection}\0{tag}".encode("utf-8")).hexdigest()[:20]
    return common.join(output, common.SPILL_DIR, modality, f"{digest}.parquet")


class SpillBatches(beam.DoFn):
    """RunInference's (key, PredictionResult) elements -> one ((modality, collection, shard), (piece, rows))
    per encoded batch, once the whole batch has come back: its vectors go to a spill piece (an embedding
    shard file), so the GroupByKey that gathers a shard carries names, never vectors. Failed elements are
    counted towards their batch and left to :func:`dead_letter_rows`.

    RunInference returns a batch's results from the one call that computed them, so a batch never spans
    bundles; a runner that split one would leave a batch unfinished at the end of the bundle, which fails
    the job here rather than losing items."""

    def __init__(self, output: str, modality: str, plans: dict[tuple[str, str], ShardPlan]):
        self.output, self.modality, self.plans = output, modality, plans

    def start_bundle(self):
        self._open: dict[str, list] = {}

    def process(self, result):
        (collection, item_id, tag, size), prediction = result
        common.Progress.advance(1)  # every item passes here once, encoded or failed
        batch = self._open.setdefault(tag, [])
        batch.append((int(item_id), prediction.inference))
        if len(batch) < size:
            return
        del self._open[tag]
        done = sorted(((i, v) for i, v in batch if not isinstance(v, FailedBatch)), key=lambda r: r[0])
        if not done:
            return
        _ENCODED[self.modality].inc(len(done))
        ids = np.array([i for i, _ in done], dtype=np.int64)
        shard = self.plans[(self.modality, collection)].shard_of(ids[0])  # a batch holds one output shard
        path = spill_piece_path(self.output, self.modality, collection, tag)
        common.write_atomic(path, emb.embedding_shard_bytes(ids, np.stack([v for _, v in done])))
        yield (self.modality, collection, shard), (path, len(ids))

    def finish_bundle(self):
        if self._open:
            tag, got = next(iter(self._open.items()))
            raise EncodeError(f"{len(self._open)} encoded batch(es) incomplete at the end of a bundle (e.g. {tag}: "
                              f"{len(got)} of its items): the runner split RunInference's output of one batch")


def dead_letter_rows(result, modality: str):
    (collection, item_id, _tag, _size), prediction = result
    failed = prediction.inference
    if isinstance(failed, FailedBatch):
        _DEAD[modality].inc()
        yield {"kind": "dead", "modality": modality, "collection": collection, "item_id": int(item_id),
               "reason": failed.reason, "traceback": failed.traceback}


def write_shard(group, output: str, plans: dict[tuple[str, str], ShardPlan]) -> dict:
    """Write one output shard from its spill pieces (rows sorted by id), then (if it holds every planned
    item) its completion record; the shard's buffers (~4 copies of its vectors) go back to the OS before the
    next shard, so a worker's peak does not grow with the number of shards it writes."""
    info = _write_shard(group, output, plans)
    common.release_memory()
    return info


def _write_shard(group, output: str, plans: dict[tuple[str, str], ShardPlan]) -> dict:
    (modality, collection, index), pieces = group
    parts = []
    for path, rows in sorted(pieces):
        ids, vectors = emb.read_embedding_shard(common.read_bytes(path))
        if len(ids) != rows:
            raise EncodeError(f"spill piece {path} holds {len(ids)} rows, {rows} were written")
        parts.append((ids, vectors))
    ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], np.concatenate([p[1] for p in parts])[order]
    data = emb.embedding_shard_bytes(ids, vectors)
    plan = plans[(modality, collection)]
    name = plan.name(index)
    common.write_atomic(common.join(output, emb.shard_relpath(modality, name)), data)
    info = emb.shard_info(name, data, len(ids))
    if len(ids) == plan.expected_rows[index]:  # after the shard: a kill in between only costs a redo
        common.write_json_atomic(record_path(output, modality, name), {**info, "key": plan.key})
    return {"kind": "shard", "modality": modality, **info}


# ----------------------------------------------------------------------------------------- graph
def build_graph(p: beam.Pipeline, plan: EncodePlan, shard_plans: dict[tuple[str, str], ShardPlan],
                tasks: dict[str, list[tuple[str, str, str]]]) -> None:
    reader = StagedShardReader(plan.staged, plan.split, shard_plans, plan.batch_size)
    report_parts = []
    for modality, todo in tasks.items():
        handler = VLModelHandler(plan.model, MODALITY_TASK[modality], device=common.beam_device(plan.device),
                                 max_batch_size=plan.batch_size, model_copies=plan.model_copies,
                                 num_threads=plan.threads, dead_letter=True, quantize=plan.quantize)
        results = (p | f"{modality}: staged shards" >> beam.Create(todo)
                   | f"{modality}: spread" >> beam.Reshuffle()  # shard names only: features never shuffle
                   | f"{modality}: read batches" >> beam.FlatMap(reader.batches)
                   | f"{modality}: encode" >> RunInference(KeyedModelHandler(handler).with_no_batching()))
        shards = (results
                  | f"{modality}: spill batches" >> beam.ParDo(SpillBatches(plan.output, modality, shard_plans))
                  | f"{modality}: group shards" >> beam.GroupByKey()
                  | f"{modality}: write shards" >> beam.Map(write_shard, plan.output, shard_plans))
        dead = results | f"{modality}: dead letters" >> beam.FlatMap(dead_letter_rows, modality)
        report_parts += [shards, dead]
    common.WriteRunReport.apply(report_parts, plan.output)  # the last step: DaskRunner computes only its graph


# -------------------------------------------------------------------------------------- metrics
def inference_metrics(result, namespace: str) -> dict:
    """Sum RunInference's counters/distributions of one handler namespace (DirectRunner, Dataflow)."""
    from apache_beam.metrics.metric import MetricsFilter

    try:
        res = result.metrics().query(MetricsFilter().with_namespace(namespace))
    except (NotImplementedError, AttributeError) as exc:
        log.info("runner reports no metrics (%s)", exc)
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
    computed = metrics.get(COMPUTED_TOKENS, 0)
    useful = f", useful tokens {metrics.get(USEFUL_TOKENS, 0) / computed:.3f} of computed" if computed else ""
    return (f"{modality}: {n} encoded in {batches} batches, mean batch {mean_bs:.1f}{useful}, "
            f"{rate:.1f} items/s of model time, device {device}, torch threads {torch.get_num_threads()}")


# ------------------------------------------------------------------------------------- launcher
def run(plan: EncodePlan, beam_args=()) -> Optional[dict]:
    """Encode, write shards + completion records + manifest + dead letters; returns a report dict (counts,
    shards, metrics), or None on a dry run."""
    from retrieval_core.store import StagedDataset

    t0 = time.time()
    options = common.task_pipeline_options(beam_args)
    ds = StagedDataset(plan.staged, opener=common.open_file)
    collections = [plan.collection] if plan.collection else list(ds.collections)
    if plan.collection and plan.collection not in ds.collections:
        raise EncodeError(f"collection {plan.collection!r} is not staged in {plan.staged} (have {ds.collections})")
    model_sha = model_fingerprint(plan.model)
    dim = model_embedding_dim(plan.model)

    def key_of(modality: str, collection: str, split: Optional[str]) -> dict:
        return {"model_sha256": model_sha, "dim": dim, "modality": modality, "collection": collection,
                "split": split, "staged_sha256": staged_inputs_sha256(ds, modality, collection),
                # int8 vectors differ from fp32 ones: never kept across a change (fp32 keys stay as they were)
                **({"quantize": plan.quantize} if plan.quantize != "none" else {})}

    plans: dict[tuple[str, str], ShardPlan] = {}
    for m in plan.modalities:
        for c in collections:
            shard_plan = plan_shards(m, c, staged_ids(ds, m, c, plan.split), plan.per_shard(m),
                                     key_of(m, c, plan.split))
            if shard_plan is not None:
                plans[(m, c)] = shard_plan
    if not plans:
        raise EncodeError(f"nothing to encode: no {'/'.join(plan.modalities)} items in {plan.staged} "
                          f"(collection={plan.collection}, split={plan.split})")

    manifest_file = common.join(plan.output, emb.EMBEDDINGS_MANIFEST)
    old = common.read_json(manifest_file) if common.exists(manifest_file) else None
    keep = keep_finished(plan.output, list(plans.values()))

    def recorded_key_now(modality: str, recorded: dict) -> Optional[dict]:
        """The key a record of an earlier run would have today (None: its collection is no longer staged)."""
        if recorded.get("collection") not in ds.collections:
            return None
        return dict(key_of(modality, recorded["collection"], recorded.get("split")),
                    num_shards=recorded.get("num_shards"))

    keep.update(keep_other_modalities(plan.output, old, plan.modalities, model_sha, dim, recorded_key_now))
    planned_in = {m: sum(sum(p.expected_rows[i] for i in p.redo) for p in plans.values() if p.modality == m)
                  for m in plan.modalities}
    skipped = {m: sum(int(s["rows"]) for s in keep.get(m, [])) for m in plan.modalities}
    for m in plan.modalities:
        if keep.get(m):
            print(f"{m}: {len(keep[m])} shard(s) with {skipped[m]} items already valid, skipped")

    tasks = {m: [(m, c, rel) for c in collections if plans.get((m, c)) and plans[(m, c)].redo
                 for rel in ds.shard_names(STAGED_KIND[m], c)] for m in plan.modalities}
    tasks = {m: t for m, t in tasks.items() if t}

    result, report = None, []
    if tasks:
        p = beam.Pipeline(options=options)
        build_graph(p, plan, plans, tasks)
        if common.translated_only(p, "encode"):
            return None
        common.makedirs(plan.output)
        common.clear_run_dir(plan.output)
        common.remove_spill(plan.output)  # pieces of a killed earlier run
        try:
            with common.Progress.running(sum(planned_in[m] for m in tasks), "items", "encode", options):
                result = common.run_pipeline(p)
        finally:
            common.remove_spill(plan.output)
        print(common.counter_line(METRICS_NAMESPACE, common.counter_values(result, METRICS_NAMESPACE),
                                  common.runner_name(options)))
        report = common.read_run_report(plan.output)
        common.clear_run_dir(plan.output)
    elif common.is_dry_run(options):
        print(common.dry_run_message("encode", options))
        return None

    written = [r for r in report if r["kind"] == "shard"]
    dead = sorted((r for r in report if r["kind"] == "dead"), key=lambda r: (r["modality"], r["item_id"]))
    by_modality: dict[str, list[dict]] = {m: list(keep.get(m, [])) for m in set(keep) | set(plan.modalities)}
    for r in written:
        by_modality[r["modality"]].append({k: r[k] for k in ("name", "rows", "sha256")})
    manifest = emb.make_embeddings_manifest(plan.model, model_sha, dim, {m: s for m, s in by_modality.items() if s},
                                            CREATED_BY)
    manifest["quantize"] = plan.quantize  # the serving precision the vectors come from (schema.QUANTIZE_CHOICES)
    manifest["inputs"] = {"collections": collections, "split": plan.split,
                          "staged_sha256": {f"{m}/{c}": p.key["staged_sha256"] for (m, c), p in sorted(plans.items())}}
    common.makedirs(plan.output)
    common.write_json_atomic(manifest_file, manifest)
    common.write_jsonl_atomic(common.join(plan.output, DEAD_LETTER_FILE), dead)

    summary = {"output": plan.output, "modalities": {}, "wall_s": None, "device": plan.device,
               "runner": common.runner_name(options)}
    for m in plan.modalities:
        encoded = sum(r["rows"] for r in written if r["modality"] == m)
        n_dead = sum(1 for r in dead if r["modality"] == m)
        line = (f"{m}: {planned_in[m]} inputs = {encoded} encoded + {n_dead} dead-lettered"
                + (f" (+ {skipped[m]} reused from valid shards)" if skipped[m] else ""))
        print(line)
        if planned_in[m] != encoded + n_dead:
            raise EncodeError(f"{m}: counts do not reconcile: {line}")
        metrics = inference_metrics(result, VLModelHandler(plan.model, MODALITY_TASK[m]).get_metrics_namespace()) \
            if result is not None and m in tasks else {}
        if metrics:
            print(throughput_line(m, metrics, plan.device))
        summary["modalities"][m] = {"inputs": planned_in[m], "encoded": encoded, "dead_lettered": n_dead,
                                    "reused": skipped[m], "metrics": metrics}
    summary["wall_s"] = time.time() - t0
    print(f"embeddings: {plan.output} (manifest {emb.EMBEDDINGS_MANIFEST}); wall time {summary['wall_s']:.1f} s")
    if dead:
        print(f"{len(dead)} item(s) dead-lettered, reasons in {common.join(plan.output, DEAD_LETTER_FILE)}; "
              f"a rerun retries their shards")
    return summary


def run_encode(staged: str, model: str, output: str, beam_args=(), **options) -> Optional[dict]:
    """Keyword form kept for existing callers (tests/test_rerank_pipeline.py): ``run(EncodePlan(...))``."""
    return run(EncodePlan(staged, model, output, **options), beam_args)


# ------------------------------------------------------------------------------------------- CLI
def demo_assets(beam_args: tuple[str, ...] = ()) -> tuple[str, str]:
    """(staged_dir, model_dir) of the embedded default collection and model, built on first use."""
    from pipelines.demo_assets import ensure_demo_assets
    return ensure_demo_assets(beam_args)


@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--staged", help="staged directory (pipelines.stage output); default: the embedded demo")
@click.option("--model", "model_dir", help="Model folder with a BE head: ours (rr_model.json), MMT-Retrieval "
                                          "(modules.json), OSCAR, or a training-free baseline; default: the "
                                          "embedded demo model")
@click.option("--output", help="embeddings directory; default <demo>/embeddings for the demo")
@click.option("--modality", type=click.Choice(MODALITY_CHOICES), default="both", show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="items per model call")
@click.option("--device", type=common.DEVICE_CHOICE, default="cpu", show_default=True)
@click.option("--collection", help="encode only this staged collection")
@click.option("--split", help="encode only this split (e.g. test)")
@click.option("--images-per-shard", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--texts-per-shard", type=click.IntRange(min=1), default=50_000, show_default=True)
@click.option("--model-copies", type=click.IntRange(min=1), help="model copies per worker machine (Dataflow GPU: 1)")
@click.option("--threads", type=click.IntRange(min=1), help="torch intra-op threads per model")
@click.option("--quantize", type=click.Choice(schema.QUANTIZE_CHOICES), default="none", show_default=True,
              help="int8: dynamic int8 quantisation of the BE's Linear layers (CPU only); bf16: matrix products "
                   "in bfloat16 (CUDA, or a CPU with native bf16: avx512_bf16/AMX, where it is ~2x faster). Vectors "
                   "differ slightly from float32; recorded in the embeddings manifest.")
@click.pass_context
def main(ctx, staged, model_dir, output, modality, batch_size, device, collection, split, images_per_shard,
         texts_per_shard, model_copies, threads, quantize):
    """Encode staged images and captions with the bi-encoder into checksummed embedding shards.
    Unknown --flags go to Beam (--runner, --direct_num_workers, Dataflow options...).

    Counters namespace: encode (images_encoded, captions_encoded, *_dead_lettered)."""
    common.configure_logging()
    beam_args = tuple(ctx.args)
    if (staged is None) != (model_dir is None):
        raise click.UsageError("pass both --staged and --model, or neither (the embedded demo)")
    common.check_beam_flags(beam_args)  # an unknown flag is an error before the demo assets are built
    if staged is None:
        from pipelines import demo_assets as demo
        staged, model_dir = demo_assets(beam_args)
        output = output or os.path.join(demo.demo_dir(), "embeddings")
    if output is None:
        raise click.UsageError("--output is required with --staged/--model")
    with common.cli_errors(EncodeError):
        plan = EncodePlan(staged, model_dir, output, modality, batch_size, device, collection, split,
                          images_per_shard, texts_per_shard, model_copies, threads, quantize)
        summary = run(plan, beam_args)
    if summary is not None and any(v["dead_lettered"] for v in summary["modalities"].values()):
        ctx.exit(1)


common.add_progress_help(main)

if __name__ == "__main__":
    common.main_as_module("pipelines.encode")  # workers import pipelines.encode, not __main__

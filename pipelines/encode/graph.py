"""The encode job's Beam graph: staged shards -> fixed length-sorted batches -> RunInference -> spill pieces ->
one Parquet shard per output shard, with its completion record; dead letters for failed batches."""
from __future__ import annotations

from typing import Iterable, Optional

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference

from pipelines import beam_kit, files
from pipelines.encode.plan import EncodeError, EncodePlan, ShardPlan, SpillResume, completion_ledger, piece_name
from pipelines.handlers import (
    TASK_EMBED_IMAGE,
    TASK_EMBED_TEXT,
    CaptionTexts,
    FailedBatch,
    VLModelHandler,
    element_length,
)
from retrieval_core.data import schema
from retrieval_core.data.store import StagedDataset
from retrieval_core.search import embeddings

MODALITY_TASK = {schema.MODALITY_IMAGE: TASK_EMBED_IMAGE, schema.MODALITY_TEXT: TASK_EMBED_TEXT}
#: Beam counters (namespace "encode"): images_encoded, captions_encoded, images_dead_lettered, ...
METRICS_NAMESPACE = "encode"
_ENCODED = {m: Metrics.counter(METRICS_NAMESPACE, f"{kind}_encoded") for m, kind in schema.STAGED_KIND.items()}
_DEAD = {m: Metrics.counter(METRICS_NAMESPACE, f"{kind}_dead_lettered") for m, kind in schema.STAGED_KIND.items()}
_RESUMED = {m: Metrics.counter(METRICS_NAMESPACE, f"{kind}_resumed") for m, kind in schema.STAGED_KIND.items()}
ENCODE, RESUMED = "encode", "resumed"  # the reader's batches to encode; those an interrupted run spilled


def only(kind: str):
    """The reader's elements of one kind, untagged."""
    def pick(element):
        if element[0] == kind:
            yield element[1]
    return pick


class StagedShardReader:
    """One staged shard -> fixed batches of keyed examples for the output shards still to encode.

    A batch holds items of one output shard only, sorted by (padded length, id) and cut every
    ``batch_size``: little padding, and the same batches on every runner (float results depend on the
    batch), so a shard's bytes never depend on bundles or on which other shards are redone."""

    def __init__(self, staged_dir: str, split: Optional[str], plans: dict[tuple[str, str], ShardPlan],
                 batch_size: int, token_fingerprint: Optional[str] = None, output: str = "",
                 resume: Optional[SpillResume] = None):
        self.staged_dir = staged_dir
        self.output = output
        self.resume = resume or SpillResume()  # batches an interrupted run spilled: not encoded again
        self.captions = CaptionTexts(token_fingerprint)
        self.split = split
        self.plans = plans
        self.batch_size = batch_size
        self._ds = None

    def _dataset(self) -> StagedDataset:
        if self._ds is None:
            self._ds = StagedDataset(self.staged_dir, files=files.BEAM_FILES)
        return self._ds

    def _examples(self, modality: str, collection: str, rel: str):
        if modality == schema.MODALITY_IMAGE:
            table = self._dataset().read_image_shard(rel, None, self.split)
            if table is None:
                return
            for i, item_id in enumerate(table.item_ids.tolist()):
                feats, boxes = table.regions(i)
                yield int(item_id), (feats.copy(), boxes.copy())
        else:
            yield from zip(*self.captions(self._dataset(), rel, self.split))

    def batches(self, task: tuple[str, str, str]) -> Iterable[list]:
        """Keyed examples in batches; the key (collection, item_id, batch tag, batch size) lets
        :class:`SpillBatches` tell when RunInference has returned the whole batch. Each goes out as
        (ENCODE, batch), or as (RESUMED, (shard, (piece, rows))), what SpillBatches would have given, when an
        interrupted run spilled it (a tag in the element, not a tagged output: DaskRunner drops those)."""
        modality, collection, rel = task
        plan = self.plans[(modality, collection)]
        by_shard: dict[int, list] = {}
        for item_id, example in self._examples(modality, collection, rel):
            shard = plan.shard_of(rel, item_id)
            if shard in plan.redo:
                by_shard.setdefault(shard, []).append((item_id, example))
        length = MODALITY_TASK[modality]
        for index in sorted(by_shard):
            items = sorted(by_shard[index], key=lambda kv: (element_length(length, kv[1]), kv[0]))
            for start in range(0, len(items), self.batch_size):
                batch = items[start:start + self.batch_size]
                tag = f"{rel}#{index}#{start}"  # unique in the run: staged shard, output shard, position
                if piece_name(collection, tag, len(batch)) in self.resume.pieces.get(modality, ()):
                    _RESUMED[modality].inc(len(batch))
                    path = spill_piece_path(self.output, modality, collection, tag, len(batch))
                    yield RESUMED, ((modality, collection, index), (path, len(batch)))
                    continue
                yield ENCODE, [((collection, item_id, tag, len(batch)), example) for item_id, example in batch]


# ------------------------------------------------------------------------------------- writing
def batch_shard(tag: str) -> int:
    """The output shard of a batch, from its tag (staged shard # output shard # position)."""
    return int(tag.rsplit("#", 2)[1])


def spill_piece_path(output: str, modality: str, collection: str, tag: str, rows: int) -> str:
    """Where one encoded batch waits for its shard writer (a retried bundle rewrites the same name). The pieces
    outlive a killed run: a rerun under the same key (plan.keep_spilled) skips their batches."""
    return files.join(output, files.SPILL_DIR, modality, piece_name(collection, tag, rows))


class SpillBatches(beam.DoFn):
    """RunInference's (key, PredictionResult) elements -> one ((modality, collection, shard), (piece, rows))
    per encoded batch, once the whole batch has come back: its vectors go to a spill piece (an embedding
    shard file), so the GroupByKey that gathers a shard carries names, never vectors. Failed elements are
    counted towards their batch and left to :func:`dead_letter_rows`.

    RunInference returns a batch's results from the one call that computed them, so a batch never spans
    bundles; a runner that split one would leave a batch unfinished at the end of the bundle, which fails
    the job here rather than losing items."""

    def __init__(self, output: str, modality: str):
        self.output, self.modality = output, modality

    def start_bundle(self):
        self._open: dict[str, list] = {}

    def process(self, result):
        (collection, item_id, tag, size), prediction = result
        beam_kit.Progress.advance(1)  # every item passes here once, encoded or failed
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
        shard = batch_shard(tag)
        path = spill_piece_path(self.output, self.modality, collection, tag, len(ids))
        files.write_atomic(path, embeddings.embedding_shard_bytes(ids, np.stack([v for _, v in done])))
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
    beam_kit.release_memory()
    return info


def _write_shard(group, output: str, plans: dict[tuple[str, str], ShardPlan]) -> dict:
    (modality, collection, index), pieces = group
    parts = []
    for path, rows in sorted(pieces):
        ids, vectors = embeddings.read_embedding_shard(files.read_bytes(path))
        if len(ids) != rows:
            raise EncodeError(f"spill piece {path} holds {len(ids)} rows, {rows} were written")
        parts.append((ids, vectors))
    ids = np.concatenate([p[0] for p in parts])
    order = np.argsort(ids, kind="stable")
    ids, vectors = ids[order], np.concatenate([p[1] for p in parts])[order]
    data = embeddings.embedding_shard_bytes(ids, vectors)
    plan = plans[(modality, collection)]
    name = plan.name(index)
    files.write_atomic(files.join(output, embeddings.shard_relpath(modality, name)), data)
    info = embeddings.shard_info(name, data, len(ids))
    if len(ids) == plan.expected_rows[index]:  # after the shard: a kill in between only costs a redo
        completion_ledger(output, modality, plan.key).record(info)
    return {"kind": "shard", "modality": modality, **info}


# ----------------------------------------------------------------------------------------- graph
def build_graph(p: beam.Pipeline, plan: EncodePlan, shard_plans: dict[tuple[str, str], ShardPlan],
                tasks: dict[str, list[tuple[str, str, str]]], token_fingerprint: Optional[str] = None,
                resume: Optional[SpillResume] = None) -> None:
    """``token_fingerprint``: the captions' token ids are read from that store (prepare_token_ids), not tokenised
    per batch. ``resume``: the spill pieces of an interrupted run (plan.keep_spilled), not encoded again."""
    reader = StagedShardReader(plan.staged, plan.split, shard_plans, plan.batch_size, token_fingerprint,
                               plan.output, resume)
    report_parts = []
    for modality, todo in tasks.items():
        handler = VLModelHandler(plan.model, MODALITY_TASK[modality], device=plan.device,
                                 max_batch_size=plan.batch_size, model_copies=plan.model_copies,
                                 num_threads=plan.threads, dead_letter=True, quantize=plan.precision,
                                 collate_workers=plan.collate_workers,
                                 token_fingerprint=token_fingerprint if modality == schema.MODALITY_TEXT else None)
        read = (p | f"{modality}: staged shards" >> beam.Create(todo)
                | f"{modality}: spread" >> beam.Reshuffle()  # shard names only: features never shuffle
                | f"{modality}: read batches" >> beam.FlatMap(reader.batches))
        results = (read | f"{modality}: to encode" >> beam.FlatMap(only(ENCODE))
                   | f"{modality}: encode" >> RunInference(KeyedModelHandler(handler).with_no_batching()))
        spilled = results | f"{modality}: spill batches" >> beam.ParDo(SpillBatches(plan.output, modality))
        resumed = read | f"{modality}: spilled before" >> beam.FlatMap(only(RESUMED))
        shards = ((spilled, resumed) | f"{modality}: with resumed pieces" >> beam.Flatten()
                  | f"{modality}: group shards" >> beam.GroupByKey()
                  | f"{modality}: write shards" >> beam.Map(write_shard, plan.output, shard_plans))
        dead = results | f"{modality}: dead letters" >> beam.FlatMap(dead_letter_rows, modality)
        report_parts += [shards, dead]
    beam_kit.WriteRunReport.apply(report_parts, plan.output)  # the last step: DaskRunner computes only its graph



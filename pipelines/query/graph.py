"""The query job's Beam graph: batches of queries -> ``retrieval_core.search.query.QueryEngine.search`` (the
Python entry point, one engine per worker process) -> hit shards written with their ledger records.

    Create(batches of the unfinished shards) -> Reshuffle
      -> Answer: the engine's hits and rejects of one batch (BE encoding, search, CE reranking, fusion)
      -> key by shard -> GroupByKey -> hits/<shard>.parquet (batches in order) + _progress/<shard>.json
      -> WriteRunReport

Batches are cut by the launcher from the queries in file order, so every runner scores the same batches and
writes the same bytes. No RunInference here: the unit of work is the entry point's call, so the job and Python
give the same scores by construction (``pipelines.handlers.VLModelHandler`` stays the one ModelHandler)."""
from __future__ import annotations

import io
from typing import Mapping

import apache_beam as beam
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics

from pipelines import beam_kit, files
from pipelines.query.plan import HITS_DIR, Batch, Resolved, progress_ledger
from retrieval_core.search.query import HIT_COLUMNS, EngineSpec, QueryEngine

#: Beam counters (namespace "query"): queries_answered, queries_rejected, hits_written.
METRICS_NAMESPACE = "query"
_ANSWERED = Metrics.counter(METRICS_NAMESPACE, "queries_answered")
_REJECTED = Metrics.counter(METRICS_NAMESPACE, "queries_rejected")
_HITS = Metrics.counter(METRICS_NAMESPACE, "hits_written")

#: The hit shards' Arrow schema (retrieval_core.search.query.HIT_COLUMNS).
HITS_SCHEMA = pa.schema([
    ("direction", pa.string()), ("query_id", pa.string()), ("query", pa.string()), ("rank", pa.int32()),
    ("item_id", pa.int64()), ("source_id", pa.string()), ("text", pa.string()), ("be_rank", pa.int32()),
    ("be_score", pa.float32()), ("ce_score", pa.float32()), ("final_score", pa.float32()),
])
assert tuple(HITS_SCHEMA.names) == HIT_COLUMNS

_ENGINES: dict = {}  # per worker process: (spec, direction, needs_ce, plan fingerprint) -> QueryEngine


def get_engine(spec: EngineSpec, direction: str, needs_ce: bool, fingerprint: str) -> QueryEngine:
    """The engine of ``spec``, opened (checked and loaded) once per process and plan fingerprint (which holds the
    inputs' fingerprints: an index rebuilt at the same path is another engine)."""
    key = (spec, direction, needs_ce, fingerprint)
    if key not in _ENGINES:
        _ENGINES[key] = QueryEngine(spec, files=files.BEAM_FILES, directions=(direction,),
                                    needs_ce=needs_ce).load((direction,))
    return _ENGINES[key]


class Answer(beam.DoFn):
    """Batch -> (shard, (batch number, hits DataFrame, rejects, truncated ids, answered)): one call of the entry
    point."""

    def __init__(self, spec: EngineSpec, direction: str, mode: str, k: int, lam: float, fingerprint: str):
        self.spec, self.direction, self.mode, self.k, self.lam = spec, direction, mode, k, lam
        self.fingerprint = fingerprint

    def setup(self):
        self._engine = get_engine(self.spec, self.direction, self.mode != "emb", self.fingerprint)

    def process(self, batch: Batch):
        hits = self._engine.search(list(batch.queries), self.k, self.mode, self.lam)
        rejected, answered = list(hits.attrs["rejected"]), int(hits.attrs["answered"])
        _ANSWERED.inc(answered)
        _REJECTED.inc(len(rejected))
        beam_kit.Progress.advance(len(batch.queries))
        yield batch.shard, (batch.number, pd.DataFrame(hits), rejected, list(hits.attrs["truncated"]), answered)


def hits_table(frames) -> pa.Table:
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({c: [] for c in HIT_COLUMNS})
    return pa.Table.from_pandas(frame[list(HIT_COLUMNS)], schema=HITS_SCHEMA, preserve_index=False)


def write_hits_shard(element, output: str, expected: Mapping[str, int], fingerprint: str) -> dict:
    """One shard's batches -> hits/<shard>.parquet, then its record (answered, rejected, truncated): the shard's
    info for the run report."""
    name, parts = element
    parts = sorted(parts, key=lambda p: p[0])
    if [p[0] for p in parts] != list(range(expected[name])):
        raise ValueError(f"{name}: batches {[p[0] for p in parts]} arrived, {expected[name]} expected")
    table = hits_table([p[1] for p in parts])
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    sha = files.write_atomic(files.join(output, HITS_DIR, name), buf.getvalue())
    rejected = [r for p in parts for r in p[2]]
    truncated = [t for p in parts for t in p[3]]
    info = {"kind": "shard", "name": name, "rows": table.num_rows, "sha256": sha, "answered": sum(p[4] for p in parts),
            "rejected": rejected, "truncated": truncated}
    _HITS.inc(table.num_rows)
    progress_ledger(output, fingerprint).record(info)
    return info


def build_graph(p: beam.Pipeline, res: Resolved, todo: list[str]) -> None:
    """The graph answering the batches of the shards ``todo``."""
    plan = res.plan
    batches = [b for name in todo for b in res.shards[name]]
    written = (p | "batches" >> beam.Create(batches)
               | "spread" >> beam.Reshuffle()
               | "answer" >> beam.ParDo(Answer(plan.engine_spec(), plan.direction, res.mode, plan.k, res.lam,
                                                 res.fingerprint))
               | "group shards" >> beam.GroupByKey()
               | "write hits" >> beam.Map(write_hits_shard, plan.output, {n: len(res.shards[n]) for n in todo},
                                          res.fingerprint))
    beam_kit.WriteRunReport.apply((written,), plan.output)

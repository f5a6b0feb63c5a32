"""The build_index job's Beam graph: one index shard per embedding shard, built from the trained index by the
workers (which read it, and the id list, by path and checksum)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipelines import beam_kit, files
from pipelines.build_index.plan import IndexBuildError, IndexPlan
from retrieval_core.search import embeddings
from retrieval_core.search.index import build_shard, index_bytes, read_id_list, set_threads
from retrieval_core.search.index_folder import SHARDS_SUBDIR, shard_file_name

log = logging.getLogger(__name__)

#: Beam counters (namespace "build_index"): vectors_added, shards_built.
METRICS_NAMESPACE = "build_index"


@dataclass(frozen=True)
class _Blob:
    """A file the workers read by path and verify by checksum (the trained index, the id list)."""
    path: str
    sha256: str

    def read(self) -> bytes:
        data = files.read_bytes(self.path)
        if files.sha256_bytes(data) != self.sha256:
            raise IndexBuildError(f"{self.path} changed while the index was being built")
        return data


class BuildShard(beam.DoFn):
    """Embedding shard entry -> written index shard -> its manifest entry."""

    def __init__(self, plan: IndexPlan, dim: int, trained: _Blob, ids: Optional[_Blob]):
        self.plan, self.dim, self.trained, self.ids = plan, dim, trained, ids

    def setup(self):
        set_threads(self.plan.threads)  # faiss bundles its own OpenMP pool
        self._trained = self.trained.read()
        # The id list: 8 bytes per listed item, read once per worker process (never pickled into the graph).
        self._ids = read_id_list(self.ids.read(), self.ids.path) if self.ids else None

    def process(self, entry: dict):
        t0 = time.time()
        src = files.join(self.plan.embeddings, embeddings.shard_relpath(self.plan.modality, entry["name"]))
        data = files.read_bytes(src)
        embeddings.verify_shard_bytes(data, entry, src)
        ids, vectors = embeddings.read_embedding_shard(data)
        embeddings.check_shard_contents(ids, vectors, entry, self.dim, src)
        if self._ids is not None:
            keep = np.isin(ids, self._ids)
            ids, vectors = ids[keep], vectors[keep]
        shard = build_shard(self._trained, ids, vectors)
        name = shard_file_name(entry["name"])
        sha = files.write_atomic(files.join(self.plan.output, SHARDS_SUBDIR, name), index_bytes(shard))
        log.info("built %s: %d vectors in %.1f s", name, shard.ntotal, time.time() - t0)
        Metrics.counter(METRICS_NAMESPACE, "vectors_added").inc(int(shard.ntotal))
        Metrics.counter(METRICS_NAMESPACE, "shards_built").inc()
        beam_kit.Progress.advance(int(entry["rows"]))  # the embedding vectors this shard read
        yield {"name": name, "rows": int(shard.ntotal), "sha256": sha,
               "source": entry["name"], "source_sha256": entry["sha256"]}


def build_graph(p: beam.Pipeline, todo: list[dict], shard_fn: BuildShard, output: str) -> None:
    infos = (p | "Shards" >> beam.Create(todo)
             | "Spread" >> beam.Reshuffle()
             | "Build" >> beam.ParDo(shard_fn))
    beam_kit.WriteRunReport.apply([infos], output)  # the last step: DaskRunner computes only its graph

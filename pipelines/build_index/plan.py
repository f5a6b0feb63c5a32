"""The build_index job's plan: the typed options (each one a command-line option)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import click

from retrieval_core.cli import CheckedPlan, option, threads_option
from retrieval_core.data import schema
from retrieval_core.search import index_choice
from retrieval_core.search.index import METRICS, THREADS_ENV

#: --index-factory value that chooses the factory and its search parameters under budgets (index_choice).
AUTO = "auto"


class IndexBuildError(ValueError):
    """Bad input or an inconsistent result; reported as one line by the CLI."""


class ByteSize(click.ParamType):
    """A memory size such as 4GB, 512MiB or 1000 (bytes) -> int bytes."""
    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return index_choice.parse_bytes(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


BYTE_SIZE = ByteSize()


@dataclass(frozen=True)
class IndexPlan(CheckedPlan):
    """Everything one build_index run needs, checked when built."""
    embeddings: str = option(help="embeddings directory (embeddings_manifest.json)")
    output: str = option(help="index directory")
    modality: str = option(schema.MODALITY_IMAGE, type=click.Choice(schema.MODALITIES))
    factory: str = option("Flat", name="--index-factory",
                          help='faiss factory string: "Flat", "IVF256,Flat", "HNSW32", "IVF256,PQ16x8"..., or "auto": '
                               "the cheapest of Flat / IVF-Flat / IVF-SQ8 / IVF-PQ / HNSW32 (and its nprobe / "
                               "efSearch) reaching --recall-target within the budgets, measured and written into "
                               "the index manifest.")
    metric: str = option("ip", type=click.Choice(sorted(METRICS)))
    train_sample: int = option(50_000, type=click.IntRange(min=1),
                               help="training vectors for factories that need training (>= 39 per IVF list)")
    seed: int = option(0, type=click.INT)
    threads: Optional[int] = threads_option(help=f"faiss OpenMP threads per process (default ${THREADS_ENV} or all)")
    ids: Optional[str] = option(None, help="Parquet file with an int64 item_id column: index only these items "
                                           "(a fold, a sub-pool)")
    # factory "auto" only: budgets of the choice, the tuning collection and the held-out queries
    max_index_memory: Optional[int] = option(None, type=BYTE_SIZE, metavar="SIZE",
                                             help="auto: memory budget of the index, e.g. 4GB or 512MiB")
    max_query_ms: Optional[float] = option(None, type=click.FloatRange(min=0, min_open=True),
                                           help="auto: single-query search budget, milliseconds (p50 on held-out "
                                                "queries)")
    recall_target: Optional[float] = option(None, type=click.FloatRange(min=0, max=1, min_open=True),
                                            help="auto: recall@10 against exact search to reach [0.99]")
    auto_sample: int = option(100_000, type=click.IntRange(min=1),
                              help="auto: items the candidates are built and tuned on (the whole collection when "
                                   "smaller)")
    auto_queries: int = option(200, type=click.IntRange(min=1),
                               help="auto: held-out queries (the other modality's embeddings) recall and query time "
                                    "use")
    @property
    def budget(self) -> index_choice.IndexBudget:
        extra = {} if self.recall_target is None else {"recall_target": self.recall_target}
        return index_choice.IndexBudget(self.max_index_memory, self.max_query_ms, **extra)

    def __post_init__(self):
        for name in ("embeddings", "output"):
            if not getattr(self, name):
                raise IndexBuildError(f"{name} must be a path, got {getattr(self, name)!r}")
        if not self.factory or not self.factory.strip():
            raise IndexBuildError("index factory must be a faiss factory string such as Flat or IVF256,Flat")
        if self.factory != AUTO and any(v is not None for v in (self.max_index_memory, self.max_query_ms,
                                                                self.recall_target)):
            raise IndexBuildError("--max-index-memory, --max-query-ms and --recall-target choose an index: "
                                  f"they need --index-factory {AUTO}, got {self.factory!r}")
        if isinstance(self.seed, bool):
            raise IndexBuildError(f"seed must be an integer, got {self.seed!r}")
        try:
            super().__post_init__()  # every option's type
            if self.factory == AUTO:
                self.budget  # validates the budgets
        except ValueError as exc:
            raise IndexBuildError(str(exc)) from None

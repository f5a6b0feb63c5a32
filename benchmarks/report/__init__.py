"""Benchmark reporting, one part per module: :mod:`.schema` (the CSV columns and their docs, the environment a row
records, reading and writing the CSVs), :mod:`.tables` (recall, seed, probe and memory
tables), :mod:`.cost_tables` (what jobs, model calls and searches took) and :mod:`.plots` (PNG
plots); ``python -m benchmarks.report`` prints tables from CSVs already written. The names the suites use are
re-exported here (``report.write_csv``)."""
from benchmarks.report.plots import (
    SIZE_SUITES,
    plot_latency,
    plot_recall_vs_k,
    plot_recall_vs_size,
    plot_recall_vs_size_from,
    plot_roofline,
)
from benchmarks.report.schema import (
    COLUMN_DOCS,
    CSV_COLUMNS,
    ENVIRONMENT_COLUMNS,
    INTERVAL_COLUMNS,
    JOB_COLUMNS,
    METRICS,
    PAPER_CODE_MODEL,
    SEED_COLUMNS,
    SEED_KEY,
    column_schema,
    cpu_flags,
    cpu_model,
    environment,
    gemm_gflops,
    normalise_row,
    provenance,
    read_csv,
    schema_path,
    set_threads,
    source_commit,
    write_csv,
    write_jobs_csv,
)
from benchmarks.report.tables import (
    MEMORY_STEPS,
    memory_table,
    memory_table_from,
    recall_table,
    seed_summary,
    seed_summary_table,
    summary_table,
)

__all__ = [
    "COLUMN_DOCS", "CSV_COLUMNS", "ENVIRONMENT_COLUMNS", "INTERVAL_COLUMNS", "JOB_COLUMNS", "MEMORY_STEPS", "METRICS",
    "PAPER_CODE_MODEL", "SEED_COLUMNS", "SEED_KEY", "SIZE_SUITES", "column_schema", "cpu_flags", "cpu_model",
    "environment", "gemm_gflops", "memory_table", "memory_table_from", "normalise_row", "plot_latency",
    "plot_recall_vs_k", "plot_recall_vs_size", "plot_recall_vs_size_from", "plot_roofline", "read_csv", "recall_table",
    "schema_path", "seed_summary", "seed_summary_table", "set_threads", "source_commit", "provenance", "summary_table",
    "write_csv", "write_jobs_csv",
]

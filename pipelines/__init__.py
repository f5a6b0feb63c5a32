"""Thin Beam pipelines over retrieval_core: stage, encode, build_index, rerank (and the demo).

Importing the package imports apache_beam once, quietly. Without the GCP extras (apache-beam[gcp]) Beam's
import logs "apitools not found, and bigquery client libraries are not available..." through
``logging.warning``: harmless here (no pipeline uses BigQuery), yet printed by every CLI. That call also ran
``logging.basicConfig()`` as a side effect, so the CLIs' own ``basicConfig(level=..., format=...)`` did
nothing. The guard below drops only that message, and only while apache_beam is first imported.

Under a memory cap (RLIMIT_DATA) the libraries Beam loads are first told not to commit memory they do not
use (retrieval_core.memory): this must happen before Beam imports pyarrow.
"""
import logging

from retrieval_core.memory import bound_reservations

#: The start of the one message the guard drops (apache_beam/io/gcp/internal/clients/bigquery/__init__.py).
APITOOLS_WARNING = "apitools not found, and bigquery client libraries are not available"


class _DropApitoolsWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(APITOOLS_WARNING)


def _import_beam_quietly() -> None:
    root = logging.getLogger()
    drop, placeholder = _DropApitoolsWarning(), logging.NullHandler()
    root.addFilter(drop)
    if not root.handlers:
        root.addHandler(placeholder)  # logging.warning() calls basicConfig() when the root has no handler
    try:
        import apache_beam  # noqa: F401  (the import that logs it, when the GCP extras are absent)
    finally:
        root.removeFilter(drop)
        root.removeHandler(placeholder)


bound_reservations()
_import_beam_quietly()

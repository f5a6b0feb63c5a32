"""Training: objectives, losses, negatives, initialisation and the dev evaluation.

Under a memory cap (RLIMIT_DATA) pyarrow's mimalloc is first told not to commit memory it does not use
(retrieval_core.memory): ``python -m retrieval_core.training.train`` loads pyarrow (staged shards are
Parquet) without pipelines/__init__, which does this for the Beam jobs, and this must run before that import.
"""
from retrieval_core.memory import bound_reservations

bound_reservations()

"""DaskRunner in tests: a real dask.distributed LocalCluster (2 worker processes, 1 thread each), as the
issue's user ran it, and a byte-for-byte comparison of two pipeline outputs."""
from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator

import pytest

DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"


@contextlib.contextmanager
def local_cluster() -> Iterator[object]:
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        yield cluster


def dask_args(cluster) -> tuple[str, ...]:
    return (f"--runner={DASK_RUNNER}", f"--dask_client_address={cluster.scheduler_address}")


def relative_files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def assert_same_bytes(a: str, b: str, names: Iterable[str]) -> None:
    for name in names:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), f"{name} differs between {a} and {b}"

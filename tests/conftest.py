"""Shared test helpers: where the real data lives (never copied into the repo).

The shared folder is ``$RR_SHARED_DIR`` when set, else ``<repo>/../shared``; the real data is its
``realdata/`` folder (``$RR_SHARED_DIR`` may also point at the realdata folder itself). Tests that need it
use the ``realdata`` fixture or ``require_realdata(...)``, which skip with a clear reason when it is absent.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_dir() -> Optional[Path]:
    """The shared folder, or None when there is none."""
    env = os.environ.get("RR_SHARED_DIR")
    candidate = Path(env) if env else REPO_ROOT.parent / "shared"
    return candidate if candidate.is_dir() else None


def realdata_dir() -> Optional[Path]:
    """The real-data folder, or None when it is absent."""
    shared = shared_dir()
    if shared is None:
        return None
    if (shared / "realdata").is_dir():
        return shared / "realdata"
    return shared if (shared / "PROVENANCE.md").is_file() else None


def require_realdata(*parts: str) -> Path:
    """``<realdata>/<parts...>``, or skip the calling test with the reason it cannot run."""
    root = realdata_dir()
    if root is None:
        pytest.skip("real data not found: set RR_SHARED_DIR or provide <repo>/../shared/realdata")
    path = root.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data file absent: {path}")
    return path


@pytest.fixture
def realdata() -> Path:
    """The real-data folder; skips the test when it is absent."""
    return require_realdata()


def pytest_terminal_summary(terminalreporter) -> None:
    """The fault suite's table (tests/test_faults.py): fault, job, outcome, rerun identical; with counts."""
    import sys

    faults = sys.modules.get("tests.test_faults")
    rows = getattr(faults, "TABLE", None)
    if not rows:
        return
    head = ("fault", "job", "outcome", "rerun identical")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    tr = terminalreporter
    tr.section("fault suite")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        tr.write_line("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    identical = sum(r[3] == "yes" for r in rows)
    reruns = sum(r[3] != "n/a" for r in rows)
    tr.write_line(f"{len(rows)} cases over {len({r[1] for r in rows})} jobs; reruns byte-identical: "
                  f"{identical} of {reruns}")


# ------------------------------------------------------------------------------------------- test time
# The fast subset for the edit-test loop is ``pytest -m "not slow"`` (README, "Tests"); scripts/test.sh runs
# everything on parallel workers. Slow = runs a Beam pipeline or a benchmark suite end to end, starts
# interpreters (python -m, forkserver, Dask workers) or trains: a module name marks the whole module, a
# module::test name one test (its parametrizations included).
SLOW = (
    "test_benchmarks", "test_benchmark_staging", "test_binding_probe", "test_build_index_pipeline", "test_dataflow",
    "test_e5", "test_encode_pipeline", "test_faults", "test_family_probe", "test_feeding", "test_gpu_pipelines",
    "test_learning_curves", "test_model_folders", "test_pages", "test_pixels", "test_progress",
    "test_query_multilingual", "test_query_pipeline",
    "test_rerank_errors",
    "test_rerank_pipeline", "test_roofline", "test_stage_pipeline", "test_url_artifacts", "test_walkthrough",
    "test_cli_errors::test_encode_missing_staged_dir",
    "test_training_cache::test_a_cached_model_is_reused_only_for_the_same_training_command",
    "test_store::test_retrieval_core_never_imports_beam",
    "test_train::test_joint_ce_head_learns_to_rank_positives_first",
    "test_train::test_cli_help",
    "test_train::test_cli_bad_input_is_one_line_not_a_traceback",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: outside the fast subset (pytest -m 'not slow'); see tests/conftest.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.stem
        if module in SLOW or f"{module}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)


def build_once(tmp_path_factory, name: str, build) -> Path:
    """``build(folder)`` run once per test run, even with parallel workers (pytest-xdist): the first worker to
    ask builds under a file lock in the run's temporary root, which every worker shares; the others wait and
    reuse the folder. The folder is read-only by convention: a test that writes copies it first."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # <run basetemp>/popen-gwN: the parent is this run's, shared by its workers
    folder, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            build(str(folder))
            done.write_text("built\n")
    return folder


@pytest.fixture(scope="session")
def tiny_encoded(tmp_path_factory) -> tuple[str, str, str]:
    """(staged, model, embeddings): tests/test_encode_pipeline's tiny staged collection (24 images), a tiny
    model and that model's embeddings of it (pipelines.encode), built once per run for every module that reads
    them (test_encode_pipeline, test_rerank_pipeline)."""

    def build(folder: str) -> None:
        from pipelines.encode import plan as encode_plan
        from pipelines.encode import run as encode_run
        from tests.test_encode_pipeline import write_tiny_model, write_tiny_staged

        staged = write_tiny_staged(os.path.join(folder, "staged"), num_images=24)  # test_rerank_pipeline.NUM_IMAGES
        model = write_tiny_model(os.path.join(folder, "model"), folder)
        encode_run.run(encode_plan.EncodePlan(staged, model, os.path.join(folder, "emb"), batch_size=8))

    folder = build_once(tmp_path_factory, "tiny_encoded", build)
    return str(folder / "staged"), str(folder / "model"), str(folder / "emb")

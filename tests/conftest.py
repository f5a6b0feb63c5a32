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

"""Every pipeline / evaluation CLI turns a missing input directory into a one-line error and a non-zero exit,
never a Python traceback. One case runs as a user runs it, ``python -m <module>`` in a subprocess (the exit
status and stderr of the process); the others call the same click command in-process (CliRunner): the same
code from argv to the error line, without paying a cold interpreter start per case."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from tests.conftest import REPO_ROOT
from tests.test_encode_pipeline import write_tiny_staged


def run_cli(module: str, *args: str) -> SimpleNamespace:
    """``python -m module args`` in-process: its click command (what the module's __main__ runs) under
    CliRunner; returncode, stdout and stderr as a subprocess would give them. An exception that escapes the
    command (a user would see its traceback) is re-raised here, so the test fails on it."""
    entry = importlib.import_module(module)
    if hasattr(entry, "__path__"):  # a package: python -m runs its __main__ (guarded, so importing it runs nothing)
        entry = importlib.import_module(f"{module}.__main__")
    res = CliRunner().invoke(entry.main, list(args), prog_name=f"python -m {module}")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=res.stderr)


def run_cli_process(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=str(REPO_ROOT), env=env,
                          capture_output=True, text=True, timeout=300)


def assert_clean_failure(res, *expected: str) -> None:
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, res.stderr  # one line says what is wrong
    for text in expected:
        assert text in errors[0], errors[0]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return write_tiny_staged(str(tmp_path_factory.mktemp("cli") / "staged"), num_images=8)


def test_encode_missing_staged_dir(tmp_path):
    """As a user runs it: the process exits non-zero with one error line and no traceback."""
    missing = str(tmp_path / "no_staged")
    res = run_cli_process("pipelines.encode", "--staged", missing, "--model", str(tmp_path / "model"),
                  "--output", str(tmp_path / "emb"))
    assert_clean_failure(res, missing, "not a staged directory")


def test_build_index_missing_embeddings_dir(tmp_path):
    missing = str(tmp_path / "no_emb")
    res = run_cli("pipelines.build_index", "--embeddings", missing, "--output", str(tmp_path / "index"))
    assert_clean_failure(res, missing, "embeddings_manifest.json")


def test_rerank_missing_staged_dir(tmp_path):
    missing = str(tmp_path / "no_staged")
    res = run_cli("pipelines.rerank", "--staged", missing, "--embeddings", str(tmp_path / "emb"),
                  "--output", str(tmp_path / "run"), "--mode", "emb")
    assert_clean_failure(res, missing, "not a staged directory")


def test_rerank_missing_embeddings_dir(tmp_path, staged):
    missing = str(tmp_path / "no_emb")
    res = run_cli("pipelines.rerank", "--staged", staged, "--embeddings", missing, "--output", str(tmp_path / "run"),
                  "--mode", "emb")
    assert_clean_failure(res, missing, "embeddings_manifest.json")


def test_evaluate_missing_staged_dir(tmp_path):
    missing = str(tmp_path / "no_staged")
    res = run_cli("benchmarks.evaluate", "--rankings", str(tmp_path / "rankings"), "--staged", missing,
                  "--output", str(tmp_path / "results"))
    assert_clean_failure(res, missing, "not a staged directory")


def test_evaluate_missing_rankings_dir(tmp_path, staged):
    missing = str(tmp_path / "no_rankings")
    res = run_cli("benchmarks.evaluate", "--rankings", missing, "--staged", staged, "--output",
                  str(tmp_path / "results"))
    assert_clean_failure(res, missing, "rankings path not found")


@pytest.mark.parametrize("module,args,flag", [
    ("pipelines.rerank", ["--staged", "S", "--embeddings", "E", "--output", "{out}", "--top-k", "3"], "--top-k"),
    ("pipelines.build_index", ["--embeddings", "E", "--output", "{out}", "--index_factory", "HNSW32"],
     "--index_factory"),
])
def test_the_issues_mistyped_flags_are_refused_before_anything_runs(module, args, flag, tmp_path):
    """Mistyped flags: `--top-k 3` used to run with k = 20 and `--index_factory HNSW32` built a Flat index, both
    exit 0 (Beam only logged "Discarding unparseable args"). Now: one line, exit 2, nothing written."""
    out = str(tmp_path / "out")
    res = run_cli(module, *[a.format(out=out) for a in args])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("Error: ")] == \
        [line for line in res.stderr.splitlines() if f"unknown option(s) {flag}" in line]
    assert not os.path.exists(out)


def test_real_beam_and_dask_flags_are_not_unknown():
    from pipelines.beam_kit import unknown_beam_flags

    assert unknown_beam_flags(["--runner=DirectRunner", "--direct_num_workers=2", "--dask_client_address=h:1",
                               "--direct_running_mode", "multi_processing", "--project=p", "--dry_run=True"]) == []
    assert unknown_beam_flags(["--direct_num_worker=2", "--dask-client-address=h:1"]) == \
        ["--direct_num_worker=2", "--dask-client-address=h:1"]

"""docs/CLI.md lists every CLI's options as the code declares them: generated from the click commands the plans
build (benchmarks.report.cli_reference), and stale the moment an option changes without it."""
from __future__ import annotations

from pathlib import Path

import click

from benchmarks.report import cli_reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_is_current():
    assert cli_reference.check(str(ROOT)) == [], "python -m benchmarks.report docs rewrites docs/CLI.md"


def test_the_reference_lists_every_command_and_option():
    text = (ROOT / cli_reference.REFERENCE).read_text(encoding="utf-8")
    for path, cmd in cli_reference.all_commands():
        assert f"## `{cli_reference.invocation(path)}`" in text, path
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name != "help":
                assert f"`{p.opts[0]}`" in text, (path, p.opts)


def test_a_changed_option_makes_the_reference_stale(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / cli_reference.REFERENCE).write_text(cli_reference.reference(), encoding="utf-8")
    assert cli_reference.check(str(tmp_path)) == []
    path, cmd = next((p, c) for p, c in cli_reference.all_commands() if p == "pipelines.rerank.run")
    k = next(p for p in cmd.params if p.name == "k")
    monkeypatch.setattr(k, "default", 99)
    assert cli_reference.check(str(tmp_path)) != []


def test_a_command_is_named_as_a_user_types_it():
    assert cli_reference.invocation("pipelines.stage.run") == "python -m pipelines.stage"
    assert cli_reference.invocation("benchmarks.run") == "python -m benchmarks.run"
    assert cli_reference.invocation("benchmarks.report.__main__ docs") == "python -m benchmarks.report docs"
    assert cli_reference.invocation("perf_ab versions") == "python scripts/perf_ab.py versions"

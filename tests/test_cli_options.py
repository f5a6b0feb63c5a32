"""One launch contract on every floor: every command-line entry point of pipelines/, benchmarks/,
retrieval_core/ and scripts/ is a click command whose options are the fields of its plan (declared once, with
``retrieval_core.cli.option``), and --device, --threads and --batch-size have one declaration each (in
retrieval_core/cli.py) that every plan reuses. In-process: the commands are inspected, none is run."""
from __future__ import annotations

import os
import re

import click
import pytest

from benchmarks.report import cli_reference
from retrieval_core.cli import DeviceType, plan_flags, plan_of

CLI_MODULE = os.path.join("retrieval_core", "cli.py")
_sources = cli_reference.sources  # the walk that also writes the reference of every option (docs/CLI.md)
COMMANDS = cli_reference.all_commands()


def test_the_walk_finds_every_floors_clis():
    names = {path for path, _ in COMMANDS}
    assert {"pipelines.stage.run", "pipelines.encode.run", "pipelines.rerank.run", "pipelines.query.run",
            "benchmarks.run", "benchmarks.demo", "benchmarks.evaluate", "benchmarks.meters.roofline measure",
            "benchmarks.report.__main__ memory-table",
            "retrieval_core.training.train", "retrieval_core.model.e5", "perf_ab versions"} <= names, sorted(names)
    assert len(COMMANDS) >= 25


@pytest.mark.parametrize("path, cmd", COMMANDS, ids=[p for p, _ in COMMANDS])
def test_every_option_is_a_field_of_the_commands_plan(path, cmd):
    params = [p for p in cmd.params if p.name != "help"]
    if isinstance(cmd, click.Group) and not params:
        return  # a group of commands, each checked on its own
    plan = plan_of(cmd)
    assert plan is not None, f"{path}: options written by hand, not built from a plan (retrieval_core.cli)"
    flags = plan_flags(plan)
    for p in params:
        assert p.name in flags, f"{path}: {p.opts} is not a field of {plan.__name__}"
        fl = flags[p.name]
        if isinstance(p, click.Option):
            assert (fl.off or fl.flag(p.name)) in p.opts, (path, p.opts)
    opts = [o for p in params for o in p.opts]
    assert len(opts) == len(set(opts)), f"{path}: a flag declared twice: {opts}"


def test_device_threads_and_batch_size_have_one_declaration_each():
    """Every --device, --threads and --batch-size of every CLI is the shared one; its spelling and checks are
    written once, in retrieval_core/cli.py."""
    for path, cmd in COMMANDS:
        for p in cmd.params:
            if "--device" in p.opts:
                assert isinstance(p.type, DeviceType), path
            if "--threads" in p.opts or "--batch-size" in p.opts:
                assert isinstance(p.type, click.IntRange) and p.type.min == 1, (path, p.opts)
    by_hand = re.compile(r"^\s*(device|threads|batch_size)\s*:[^=]*=\s*option\(", re.M)
    for rel, text in _sources().items():
        assert not by_hand.search(text), f"{rel}: declares a shared option itself (use device_option & co.)"


def test_no_click_option_outside_the_plans():
    """click options and arguments are declared only where plans become CLIs (retrieval_core/cli.py)."""
    pattern = re.compile(r"click\.(option|argument)\(")
    offenders = [rel for rel, text in _sources((*cli_reference.FLOORS, "scripts")).items()
                 if pattern.search(text) and rel != CLI_MODULE]
    assert offenders == []

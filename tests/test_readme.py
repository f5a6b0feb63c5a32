"""The README is the front door: short, and every command in it runs as shown; the docs' links and named tests exist.

Every line of the README's ``bash`` blocks is a comment, ``bash scripts/<name>.sh`` or a ``python -m`` command. A
``python -m`` command is parsed by its own click command (options, types, choices, required options), and what the
command passes on to Beam must be flags Beam knows, as the pipelines check before they run. Running them is what
the demo, the walkthrough (tests/test_walkthrough.py) and the pipeline tests do; this test makes sure a command
the README shows has not drifted from its CLI.
"""
from __future__ import annotations

import importlib
import re
import shlex
from collections import Counter
from pathlib import Path

import click
import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md")) + [REPO_ROOT / "data_manifests" / "README.md",
                                                    REPO_ROOT / "docker" / "README.md"]
MAX_README_LINES = 250  # the README is a front door of about 200 lines; the rest lives in docs/


def bash_lines(text: str) -> list[str]:
    """The logical lines of the ``bash`` blocks (backslash continuations joined), comments and blanks left out."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                lines.append(line)
    return lines


def click_command(module: str) -> click.Command:
    """The click command ``python -m module`` runs (a pipeline package's lives in its ``run`` module)."""
    found = importlib.import_module(module)
    return getattr(found, "main", None) or importlib.import_module(f"{module}.run").main


def parse(command: click.Command, prog: str, args: list[str]) -> click.Context:
    """Parse ``args`` as click would before invoking ``command`` (a group: down to its subcommand)."""
    ctx = command.make_context(prog, list(args))
    if isinstance(command, click.Group):
        name, sub, rest = command.resolve_command(ctx, list(ctx.protected_args) + list(ctx.args))
        return parse(sub, f"{prog} {name}", rest)
    return ctx


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move details to docs/"


def test_every_readme_command_runs_as_shown():
    from pipelines.beam_kit import unknown_beam_flags

    lines = bash_lines(README.read_text(encoding="utf-8"))
    modules = set()
    for line in lines:
        tokens = shlex.split(line, comments=True)
        assert "$" not in line, f"README command uses a shell variable, so it does not run as shown: {line!r}"
        if tokens[0] == "bash":
            assert len(tokens) == 2 and re.fullmatch(r"scripts/[\w-]+\.sh", tokens[1]), line
            assert (REPO_ROOT / tokens[1]).is_file(), f"README runs {tokens[1]}, which does not exist"
            continue
        assert tokens[:2] == ["python", "-m"] and len(tokens) > 2, \
            f"README bash line is neither a comment, bash scripts/... nor python -m: {line!r}"
        module, args = tokens[2], tokens[3:]
        command = click_command(module)
        try:
            ctx = parse(command, f"python -m {module}", args)
        except click.ClickException as exc:
            pytest.fail(f"README command does not parse: {line!r}: {exc.format_message()}")
        if ctx.args:  # what the command hands on to Beam
            assert command.context_settings.get("allow_extra_args"), f"{module} takes no extra arguments: {line!r}"
            assert not unknown_beam_flags(ctx.args), f"flags Beam does not know in {line!r}: {ctx.args}"
        modules.add(module)
    # the front door shows every pipeline and the steps around it
    assert {"pipelines.stage", "retrieval_core.training.train", "pipelines.encode", "pipelines.build_index",
            "pipelines.rerank", "benchmarks.evaluate", "benchmarks.run"} <= modules
    assert "bash scripts/demo.sh" in [ln.split("#")[0].strip() for ln in lines]
    assert "bash scripts/test.sh" in [ln.split("#")[0].strip() for ln in lines]


def test_a_mistyped_readme_option_would_fail_the_parse():
    """The check above can fail: an option a CLI does not have, or a value its choices refuse, does not parse."""
    with pytest.raises(click.NoSuchOption):
        parse(click_command("benchmarks.evaluate"), "evaluate",
              ["--rankings", "r", "--staged", "s", "--output", "o", "--top-k", "5"])
    with pytest.raises(click.BadParameter):
        parse(click_command("pipelines.rerank"), "rerank", ["--staged", "s", "--embeddings", "e", "--output", "o",
                                                            "--mode", "rerank"])
    from pipelines.beam_kit import unknown_beam_flags

    ctx = parse(click_command("pipelines.encode"), "encode", ["--staged", "s", "--model", "m", "--output", "o",
                                                              "--quantise", "int8"])
    assert unknown_beam_flags(ctx.args) == ["--quantise"]


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen, out, fenced = Counter(), set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            base = slug(m.group(1))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: link to {target} leads nowhere"
        if anchor:
            assert anchor in anchors(dest), f"{doc.name}: no heading #{anchor} in {dest.name}"


def test_the_tests_the_docs_name_exist():
    named = set()
    for doc in (README, *DOCS):
        named |= set(re.findall(r"(test_\w+\.py)::(test_\w+)", doc.read_text(encoding="utf-8")))
    assert named, "the docs name no test"
    for file, test in sorted(named):
        source = REPO_ROOT / "tests" / file
        assert source.is_file(), f"the docs name {file}, which does not exist"
        assert re.search(rf"^def {test}\(", source.read_text(encoding="utf-8"), flags=re.M), \
            f"the docs name {file}::{test}, which does not exist"

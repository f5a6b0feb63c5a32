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
DOCS = sorted((REPO_ROOT / "docs").rglob("*.md")) + [REPO_ROOT / "data_manifests" / "README.md",
                                                     REPO_ROOT / "docker" / "README.md"]
MAX_README_LINES = 150  # the README is a front door; the rest lives in docs/
#: The pages a user reads to get something done (the README, the tutorials, the how-tos); the reference is
#: generated, the explanations and the log are read by choice.
TUTORIALS = ("docs/DEMO.md", "docs/OWN_FEATURES.md", "docs/OWN_PHOTOS.md")
HOW_TOS = ("docs/CLUSTER.md", "docs/GPU.md", "docs/RESUME.md", "docs/BENCHMARKS.md", "docs/QUERY.md")
USER_PATH = ("README.md", *TUTORIALS, *HOW_TOS)
MAX_USER_PAGE_LINES = 300
#: What a new user asks, and the page that answers it: reachable from the README by links, its commands first.
QUESTIONS = {
    "run the demo": "docs/DEMO.md",
    "stage your own features": "docs/OWN_FEATURES.md",
    "stage your own photos": "docs/OWN_PHOTOS.md",
    "run on Dask or Dataflow": "docs/CLUSTER.md",
    "run on a GPU": "docs/GPU.md",
    "reproduce a paper table": "docs/BENCHMARKS.md",
    "query an index": "docs/QUERY.md",
}
#: Lines of prose an answer page may open with before its first command block (a title and a sentence or two).
MAX_LINES_BEFORE_COMMANDS = 8


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
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES, f"README.md has {len(text.splitlines())} lines"
    # what a new reader must not miss: the numbers are synthetic, and which suite stands for which paper table
    assert "synthetic benchmark" in text and "No number here is\non real COCO" in text
    for suite in ("standard", "distractor_20k", "multilingual", "scale_1m", "k_ablation", "combination"):
        assert re.search(rf"^\|[^\n]*`{suite}`[^\n]*\| [^\n]*Table", text, flags=re.M), suite


@pytest.mark.parametrize("page", USER_PATH)
def test_no_page_on_the_user_path_is_long(page):
    n = len((REPO_ROOT / page).read_text(encoding="utf-8").splitlines())
    assert n <= MAX_USER_PAGE_LINES, f"{page} has {n} lines: move what is not a step to the reference or the log"


def check_commands(page: Path) -> set[str]:
    """Every ``python -m`` line of the page's ``bash`` blocks parses with its own CLI, and what it hands on to Beam
    are flags Beam knows; returns the modules run. In the README every line is a comment, ``bash scripts/...`` or
    ``python -m``, with no shell variable; other pages may set variables (their lines with ``$`` are run as written
    by the walkthrough tests) and start other programs (a Dask scheduler)."""
    from pipelines.beam_kit import unknown_beam_flags

    readme = page == README
    modules = set()
    for line in bash_lines(page.read_text(encoding="utf-8")):
        tokens = shlex.split(line, comments=True)
        if "$" in line:
            assert not readme, f"README command uses a shell variable, so it does not run as shown: {line!r}"
            continue
        if tokens[0] == "bash":
            assert len(tokens) == 2 and re.fullmatch(r"scripts/[\w-]+\.sh", tokens[1]), line
            assert (REPO_ROOT / tokens[1]).is_file(), f"{page.name} runs {tokens[1]}, which does not exist"
            continue
        if tokens[:2] != ["python", "-m"] or len(tokens) < 3:
            assert not readme, f"README bash line is neither a comment, bash scripts/... nor python -m: {line!r}"
            continue
        module, args = tokens[2], tokens[3:]
        command = click_command(module)
        try:
            ctx = parse(command, f"python -m {module}", args)
        except click.ClickException as exc:
            pytest.fail(f"{page.name} command does not parse: {line!r}: {exc.format_message()}")
        if ctx.args:  # what the command hands on to Beam
            assert command.context_settings.get("allow_extra_args"), f"{module} takes no extra arguments: {line!r}"
            assert not unknown_beam_flags(ctx.args), f"flags Beam does not know in {line!r}: {ctx.args}"
        modules.add(module)
    return modules


@pytest.mark.parametrize("page", [*USER_PATH, "docs/PIPELINES.md"])
def test_every_command_on_the_user_path_runs_as_shown(page):
    check_commands(REPO_ROOT / page)


def test_the_readme_shows_the_two_commands_and_the_pipelines_page_every_pipeline():
    lines = bash_lines(README.read_text(encoding="utf-8"))
    assert "bash scripts/demo.sh" in [ln.split("#")[0].strip() for ln in lines]
    assert "bash scripts/test.sh" in [ln.split("#")[0].strip() for ln in lines]
    assert {"pipelines.stage", "retrieval_core.training.train", "pipelines.encode", "pipelines.build_index",
            "pipelines.rerank", "pipelines.query", "benchmarks.evaluate", "benchmarks.run"} <= \
        check_commands(REPO_ROOT / "docs" / "PIPELINES.md")


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


def links(page: Path) -> list[Path]:
    """The Markdown pages ``page`` links to (relative links, anchors dropped)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path = target.partition("#")[0]
        if not path or re.match(r"[a-z]+:", path):
            continue
        dest = (page.parent / path).resolve()
        if dest.is_dir():  # a folder's page is its README
            dest = dest / "README.md"
        if dest.suffix == ".md":
            out.append(dest)
    return out


def reachable(start: Path) -> dict[Path, int]:
    """{page: clicks from ``start``} over relative links."""
    seen, frontier = {start.resolve(): 0}, [start.resolve()]
    while frontier:
        page = frontier.pop(0)
        for dest in links(page):
            if dest.is_file() and dest not in seen:
                seen[dest] = seen[page] + 1
                frontier.append(dest)
    return seen


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_readme_leads_to_the_page_that_answers_each_question_and_it_starts_with_the_commands(question):
    page = REPO_ROOT / QUESTIONS[question]
    clicks = reachable(README)
    assert clicks.get(page.resolve()) == 1, f"{question}: {page.name} is not linked from the README"
    lines = page.read_text(encoding="utf-8").splitlines()
    first_block = next(i for i, line in enumerate(lines) if line.startswith("```"))
    prose = [line for line in lines[1:first_block] if line.strip() and not line.startswith("#")]
    assert len(prose) <= MAX_LINES_BEFORE_COMMANDS, f"{question}: {page.name} opens with {len(prose)} lines of prose"


def test_every_docs_page_is_reachable_from_the_readme():
    clicks = reachable(README)
    missing = [str(p.relative_to(REPO_ROOT)) for p in DOCS if p.resolve() not in clicks]
    assert missing == []

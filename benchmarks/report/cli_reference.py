"""docs/CLI.md: every command-line entry point's options (flag, type, default, help), generated from the click
commands that the plans build (retrieval_core.cli), so the reference cannot drift from the code.

    python -m benchmarks.report docs            # rewrites docs/CLI.md with the result tables
    python -m benchmarks.report docs --check    # exit 1 when docs/CLI.md differs from what the code generates

The walk over the CLIs is the one tests/test_cli_options.py checks the plans with.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Iterator

import click

#: The generated page, from the repository root.
REFERENCE = "docs/CLI.md"
FLOORS = ("pipelines", "benchmarks", "retrieval_core")
SCRIPTS = ("perf_ab",)  # scripts/*.py with a click CLI (imported from scripts/, beside their helpers)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sources(floors=FLOORS, root: str = ROOT) -> dict[str, str]:
    """{path from the root: text} of every .py file under ``floors``."""
    out = {}
    for floor in floors:
        for folder, _, files in os.walk(os.path.join(root, floor)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        out[os.path.relpath(path, root)] = f.read()
    return out


def cli_modules() -> list[str]:
    """Every module that defines a click command or group (its __main__ modules' commands live beside them)."""
    mods = []
    for rel, text in sources().items():
        if re.search(r"@((click|main)\.(command|group)|plan_command)\b", text) and not rel.endswith("__main__.py") \
                or rel.endswith(os.path.join("report", "__main__.py")):
            mods.append(rel[:-3].replace(os.sep, "."))
    return sorted(mods)


def _commands(cmd: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            yield from _commands(cmd.commands[name], f"{path} {name}")


def _script(name: str):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def all_commands() -> list[tuple[str, click.Command]]:
    """(module path [subcommand], click command) of every CLI of pipelines/, benchmarks/, retrieval_core/ and the
    scripts with one, each command once."""
    seen: dict[int, tuple[str, click.Command]] = {}
    for mod_name in cli_modules() + list(SCRIPTS):
        mod = importlib.import_module(mod_name) if mod_name not in SCRIPTS else _script(mod_name)
        for attr in vars(mod).values():
            if isinstance(attr, click.Command) and getattr(attr.callback, "__module__", "") == mod_name:
                for path, cmd in _commands(attr, mod_name):
                    seen.setdefault(id(cmd), (path, cmd))
    return list(seen.values())


def invocation(path: str) -> str:
    """How a user types the command: ``python -m pipelines.stage`` for pipelines/stage/run.py (its package's
    __main__ runs it), ``python -m benchmarks.report docs``, ``python scripts/perf_ab.py versions``."""
    module, _, sub = path.partition(" ")
    if module in SCRIPTS:
        head = f"python scripts/{module}.py"
    else:
        if module.endswith(".__main__"):
            module = module[: -len(".__main__")]
        elif module.endswith(".run") and os.path.isfile(os.path.join(ROOT, *module.split(".")[:-1], "__main__.py")):
            module = module[: -len(".run")]
        head = f"python -m {module}"
    return f"{head} {sub}".strip()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type(p: click.Parameter) -> str:
    if isinstance(p, click.Option) and p.is_flag:
        return "flag"
    t = p.type
    if isinstance(t, click.Choice):
        return " | ".join(t.choices)
    if isinstance(t, (click.IntRange, click.FloatRange)):
        lo = "" if t.min is None else f"{t.min} <= "
        hi = "" if t.max is None else f" <= {t.max}"
        return f"{lo}{'int' if isinstance(t, click.IntRange) else 'float'}{hi}"
    if isinstance(t, click.Path):
        return "file" if not t.dir_okay else "folder" if not t.file_okay else "path"
    name = getattr(t, "name", "") or type(t).__name__
    return {"integer": "int", "text": "text", "boolean": "bool"}.get(name, name)


def _default(p: click.Parameter) -> str:
    if p.required:
        return "required"
    if isinstance(p, click.Option) and p.is_flag:
        if p.flag_value is False:  # a True-by-default setting's off switch (--no-amp)
            return "on; this flag turns it off"
        return "on" if p.default is True else "off"
    d = p.default
    if d is None or d == () or d == "" or type(d).__name__ == "Sentinel":  # click's UNSET: no default
        return "-"
    if isinstance(d, (tuple, list)):
        return ", ".join(f"`{v}`" for v in d)
    return f"`{d}`"


def _flags(p: click.Parameter) -> str:
    if isinstance(p, click.Argument):
        return f"`{p.name.upper()}`" + (" ..." if p.nargs == -1 else "")
    return ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts)) + (" (repeatable)" if p.multiple else "")


def command_section(path: str, cmd: click.Command) -> str:
    doc = (cmd.help or "").strip().split("\n\n")[0]
    lines = [f"## `{invocation(path)}`", ""]
    if doc:
        lines += [_cell(doc), ""]
    if isinstance(cmd, click.Group):
        lines += ["Commands: " + ", ".join(f"`{n}`" for n in sorted(cmd.commands)) + ".", ""]
    params = [p for p in cmd.params if p.name != "help"]
    if params:
        lines += ["| option | type | default | help |", "|---|---|---|---|"]
        lines += [f"| {_flags(p)} | {_cell(_type(p))} | {_cell(_default(p))} | {_cell(getattr(p, 'help', '') or '')} |"
                  for p in params]
        lines.append("")
    if cmd.context_settings.get("allow_extra_args"):
        lines += ["Other `--flags` go to Apache Beam (`--runner`, Dataflow's options); a flag Beam does not know is "
                  "refused.", ""]
    return "\n".join(lines)


def reference() -> str:
    """The text of docs/CLI.md."""
    commands = sorted(all_commands(), key=lambda pc: invocation(pc[0]))
    head = ["# Command-line reference", "",
            "<!-- generated by python -m benchmarks.report docs from the click commands; do not edit -->", "",
            "Every command's options: flag, type, default and help, as `--help` prints them. Generated from the "
            "plans that declare the options (`retrieval_core/cli.py`); `python -m benchmarks.report docs --check` "
            "fails when this page differs from the code. `-h` is `--help` everywhere. How the options combine, "
            "with examples: [PIPELINES](PIPELINES.md).", "",
            *(f"- [`{invocation(p)}`](#{_anchor(invocation(p))})" for p, _ in commands), ""]
    return "\n".join(head + [command_section(p, c) for p, c in commands]).rstrip() + "\n"


def _anchor(title: str) -> str:
    """GitHub's anchor of the heading ``## `title` ``."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def check(root: str) -> list[str]:
    path = os.path.join(root, REFERENCE)
    if not os.path.isfile(path):
        return [f"{REFERENCE} is missing (python -m benchmarks.report docs writes it)"]
    with open(path, encoding="utf-8") as f:
        if f.read() != reference():
            return [f"{REFERENCE} differs from the CLIs' options (python -m benchmarks.report docs rewrites it)"]
    return []


def write(root: str) -> str:
    """Rewrite docs/CLI.md; returns its report line."""
    path = os.path.join(root, REFERENCE)
    new = reference()
    old = open(path, encoding="utf-8").read() if os.path.isfile(path) else None
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return f"{REFERENCE}: {'rewritten' if new != old else 'unchanged'}"

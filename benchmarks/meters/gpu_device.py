"""The lent GPU machine's two constraints: which carried wheels its bare image needs (and whether their declared
requirements hold there), and what it gives back (``check-out``: at most 8 files of 16 MiB, two folders down).

The GPU machine has torch, transformers, numpy, pyarrow, pandas and a few more, but not apache-beam or faiss, and
no network: ``scripts/gpu_pipelines.sh prepare`` downloads their wheels here, the run carries them, and
``install`` puts them on a ``--target`` folder there. ``pip install --no-deps`` alone would hide a conflict (Beam
2.77 declares numpy < 2.5; the image has 2.5.2), so before installing, this check:

1. prints the image's versions of the packages the run leans on (numpy, protobuf, pyarrow, pandas, torch,
   transformers);
2. picks the carried wheels to install: every one whose distribution the image lacks, or holds at a version a
   carried wheel's requirement refuses (the carried one then shadows it on ``PYTHONPATH``);
3. checks every requirement of the picked wheels (markers evaluated for this interpreter, no extras) against what
   the interpreter will then import: a conflict listed in ``benchmarks/gpu_run.json`` (``harmless_conflicts``)
   for exactly the installed version is printed with the evidence that it is harmless; any other conflict, or a
   requirement nothing provides, fails naming it. The rehearsal (``--rehearsal``) lets such conflicts through,
   listed, and runs every part on them: its pass is the evidence a listed conflict cites.

Runs before Beam exists: the standard library, ``packaging`` (transformers needs it), click and
``retrieval_core.cli``.

    python -m benchmarks.meters.gpu_device plan-install --wheels runs/gpu-wheels --plan /tmp/wheels.txt  # a path a line
    python -m benchmarks.meters.gpu_device check-out --out "$OUT"    # fails where the device would not return it
"""
from __future__ import annotations

import email.parser
import json
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

import click
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from retrieval_core.cli import CONTEXT_SETTINGS, CheckedPlan, cli_errors, option, plan_from_cli, plan_options

#: The packages whose versions the run's results depend on, printed first.
WATCHED = ("numpy", "protobuf", "pyarrow", "pandas", "torch", "transformers")
RATES_FILE = Path(__file__).parent.parent / "gpu_run.json"  # benchmarks/gpu_run.json


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str        # canonical distribution name
    version: Version
    requires: tuple[Requirement, ...]


def read_wheel(path: Path) -> Wheel:
    """A wheel's name, version and unconditional requirements (extras left out), from its METADATA."""
    with zipfile.ZipFile(path) as z:
        meta_name = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta_name is None:
            raise ValueError(f"{path.name}: no .dist-info/METADATA")
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode("utf-8"))
    reqs = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            reqs.append(req)
    return Wheel(path, canonicalize_name(meta["Name"]), Version(meta["Version"]), tuple(reqs))


def installed_versions() -> dict[str, Version]:
    """Every distribution this interpreter sees, by canonical name."""
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonicalize_name(name), Version(dist.version))
    return out


def harmless_conflicts(path: Path = RATES_FILE) -> list[dict]:
    with open(path) as f:
        return json.load(f).get("harmless_conflicts", [])


def plan_install(wheels: list[Wheel], have: dict[str, Version], harmless: list[dict]
                 ) -> tuple[list[Wheel], list[str], list[str], list[str]]:
    """(wheels to install, conflicts shown harmless with their evidence, other conflicts, requirements nothing
    provides): module docstring, 2-3."""
    carried = {w.name: w for w in wheels}
    refused = {canonicalize_name(r.name) for w in wheels for r in w.requires
               if canonicalize_name(r.name) in have and canonicalize_name(r.name) in carried
               and have[canonicalize_name(r.name)] not in r.specifier}
    picked = [w for w in wheels if w.name not in have or w.name in refused]
    after = {**have, **{w.name: w.version for w in picked}}
    notes, conflicts, missing = [], [], []
    for w in picked:
        for req in w.requires:
            name = canonicalize_name(req.name)
            if name not in after:
                missing.append(f"{w.name} {w.version} requires {req}: not in the image and not carried")
                continue
            if after[name] in req.specifier:
                continue
            known = next((h for h in harmless if canonicalize_name(h["package"]) == w.name
                          and canonicalize_name(h["requirement_of"]) == name and h["installed"] == str(after[name])),
                         None)
            line = f"{w.name} {w.version} requires {req}; {name} {after[name]} is what runs"
            if known is None:
                conflicts.append(line)
            else:
                notes.append(f"{line}: harmless by {known['evidence']}")
    return picked, notes, conflicts, missing


@click.group(context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """The GPU machine's install plan and return limits (module docstring)."""


@dataclass(frozen=True)
class InstallPlan(CheckedPlan):
    """plan-install's options."""
    wheels: str = option(help="The carried wheels (scripts/gpu_pipelines.sh prepare).")
    plan: str = option(help="Written: the wheels to install, one path a line.")
    rehearsal: bool = option(False, help="Let version conflicts not yet shown harmless through, listed: the "
                                         "rehearsal runs every part on them (a missing requirement still stops).")


@main.command("plan-install", context_settings=CONTEXT_SETTINGS)
@plan_options(InstallPlan)
def plan_install_command(**values) -> None:
    """Print the image's versions, pick the wheels to install, stop on a conflict not shown harmless."""
    with cli_errors():
        p = plan_from_cli(InstallPlan, values)
        have = installed_versions()
        click.echo("image: " + ", ".join(f"{n} {have.get(n, 'absent')}" for n in WATCHED))
        wheels = [read_wheel(w) for w in sorted(Path(p.wheels).glob("*.whl"))]
        if not wheels:
            raise click.ClickException(f"no wheels in {p.wheels}: run 'bash scripts/gpu_pipelines.sh prepare' and "
                                       f"carry it")
        picked, notes, conflicts, missing = plan_install(wheels, have, harmless_conflicts())
        skipped = sorted(w.name for w in wheels if w not in picked)
        click.echo(f"install: {len(picked)} carried wheels" + (f"; the image's own kept: {', '.join(skipped)}"
                                                               if skipped else ""))
        for line in notes:
            click.echo(f"conflict, harmless: {line}")
        for line in conflicts:
            click.echo(f"conflict, {'under rehearsal' if p.rehearsal else 'not shown harmless'}: {line}")
        for line in missing:
            click.echo(f"missing: {line}")
        problems = missing + ([] if p.rehearsal else conflicts)
        if problems:
            raise click.ClickException(f"{len(problems)} requirement(s) of the carried wheels fail on this image "
                                       f"(first: {problems[0]})")
        Path(p.plan).write_text("".join(f"{w.path}\n" for w in picked))


@dataclass(frozen=True)
class CheckOutPlan(CheckedPlan):
    """check-out's option."""
    out: str = option(help="The folder the device returns.")


@main.command("check-out", context_settings=CONTEXT_SETTINGS)
@plan_options(CheckOutPlan)
def check_out_command(**values) -> None:
    """Fail, naming it, where --out holds what the device would not return."""
    with cli_errors():
        out = plan_from_cli(CheckOutPlan, values).out
        problem = check_out_folder(out)
        if problem:
            raise click.ClickException(problem)
    click.echo(f"check-out: {out} fits what the device returns")


def check_out_folder(out: str, max_files: int = 8, max_bytes: int = 16 * 2 ** 20, max_depth: int = 2
                     ) -> Optional[str]:
    """What the device would not return from ``out`` (its limits: 8 files of 16 MiB, two folders down), or None."""
    files = [p for p in Path(out).rglob("*") if p.is_file()]
    if len(files) > max_files:
        return f"{len(files)} files under {out} (the device returns {max_files})"
    for p in files:
        if p.stat().st_size > max_bytes:
            return f"{p} is {p.stat().st_size / 2 ** 20:.1f} MiB (the device returns files up to 16 MiB)"
        if len(p.relative_to(out).parts) > max_depth + 1:
            return f"{p} lies more than {max_depth} folders down"
    return None


if __name__ == "__main__":
    main()

"""Learning curves of training runs: what ``train_log.jsonl`` recorded, and what each kept model tells apart.

    python -m benchmarks.probes.learning_curves --run join=runs/join [--run sep_ce=runs/sep_ce] [--window 20] \\
        [--staged runs/staged_demo --manifest demo --split dev --max-captions 500] --output results/curves

Per run (a ``retrieval_core.training.train`` output folder):

* from its ``train_log.jsonl``: each objective's loss as the mean over windows of ``--window`` steps (one
  step's loss is one batch: noisy), the BE's R@1 at every mining of CE negatives, and every dev evaluation (mR,
  CE pair accuracy against a random and against the nearest dev image);
* with ``--staged`` and ``--manifest`` (a synthetic collection): ``benchmarks.probes.family_probe`` on every model the
  run kept (``--keep-checkpoints``; the final step is kept too): the pairwise accuracy, gold image against
  its attribute and its binding sibling, of each head the run trained. The loss cannot show whether a head
  learns binding (a list holding a binding sibling costs ln 2 at a tie, like any other 50/50 list); this
  curve does.

Writes ``learning_curves.csv`` (run, step, series, value; long format) and ``learning_curves.png`` (a panel
per kind of series) and prints the probe curve.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Sequence

import click
import pandas as pd

from benchmarks.probes.family_probe import probe
from benchmarks.report.plots import _pyplot
from pipelines.files import write_atomic
from retrieval_core.cli import (
    CheckedPlan,
    apply_device_and_threads,
    batch_size_option,
    cli_errors,
    device_option,
    option,
    plan_command,
    plan_from_cli,
    threads_option,
)
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.training.trainer import LOG_FILE, kept_checkpoints

DEV_SERIES = ("mR", "t2i_R@1", "i2t_R@1", "ce_pair_acc", "ce_hard_pair_acc")
PROBE_CHANGES = ("attribute", "binding", "all")
HEAD_OF_OBJECTIVE = {"be": ("BE",), "ce": ("CE",)}
GRADIENT_SERIES = "trunk gradient norm"


def read_log(train_dir: str) -> list[dict]:
    path = os.path.join(train_dir, LOG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{train_dir} has no {LOG_FILE}: not a retrieval_core.training.train output folder")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trained_heads(records: Sequence[dict]) -> tuple[str, ...]:
    """The heads a run trained, from the objectives of its steps (a JOIN run logs both)."""
    objectives = {r["objective"] for r in records if "objective" in r}
    return tuple(h for o in ("be", "ce") if o in objectives for h in HEAD_OF_OBJECTIVE[o])


def log_curves(records: Sequence[dict], window: int) -> pd.DataFrame:
    """Rows (step, series, value): ``<objective> loss`` and, where the trainer logged it, ``<objective> trunk
    gradient norm`` (before clipping, the transformer's weights both objectives share) per window of steps (at the
    window's last step), ``mining BE t2i R@1`` and ``dev <metric>`` where they were recorded."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    rows = []
    steps = pd.DataFrame([r for r in records if "objective" in r and "loss" in r])
    if len(steps):  # a run killed between checkpoints and resumed logs those steps again: the rerun counts
        steps = steps.drop_duplicates(["objective", "step"], keep="last")
    for objective, g in (steps.groupby("objective", sort=True) if len(steps) else ()):
        g = g.sort_values("step")
        bins = (g["step"].to_numpy() - 1) // window
        for _, w in g.groupby(bins, sort=True):
            rows.append({"step": int(w["step"].max()), "series": f"{objective} loss", "value": float(w["loss"].mean())})
            if "grad_norm_trunk" in w and w["grad_norm_trunk"].notna().all():
                rows.append({"step": int(w["step"].max()), "series": f"{objective} {GRADIENT_SERIES}",
                             "value": float(w["grad_norm_trunk"].mean())})
    for r in records:
        if "mined" in r and "be_t2i_R@1" in r["mined"]:
            rows.append({"step": int(r["step"]), "series": "mining BE t2i R@1",
                         "value": float(r["mined"]["be_t2i_R@1"])})
        if "eval" in r:
            rows += [{"step": int(r["step"]), "series": f"dev {k}", "value": float(r["eval"][k])}
                     for k in DEV_SERIES if k in r["eval"]]
    # a resumed run logs the evaluations and minings it redoes again, later in the file: the later one counts
    return pd.DataFrame(rows, columns=["step", "series", "value"]).drop_duplicates(["series", "step"], keep="last")


def probe_curves(train_dir: str, heads: Sequence[str], staged, spec, split: str = "dev",
                 max_captions: Optional[int] = 500, batch_size: int = 128, device: str = "cpu") -> pd.DataFrame:
    """Rows (step, series, value): ``<head> pairwise <change>`` (family_probe, %) for every kept model."""
    kept = kept_checkpoints(train_dir)
    if not kept:
        raise ValueError(f"{train_dir} kept no checkpoints: train it with --checkpoint-every N --keep-checkpoints")
    rows = []
    for step, folder in kept:
        model = VLRetrievalModel.load(folder)
        t = probe(staged, spec, model, model, split, max_captions, batch_size=batch_size, device=device)
        t = t[(t["table"] == "pairwise") & t["head"].isin(heads) & t["change"].isin(PROBE_CHANGES)]
        rows += [{"step": step, "series": f"{r.head} pairwise {r.change}", "value": float(r.accuracy)}
                 for r in t.itertuples()]
        print(f"  step {step}: " + ", ".join(f"{r.head} {r.change} {r.accuracy:.1f}" for r in t.itertuples()),
              flush=True)
    return pd.DataFrame(rows, columns=["step", "series", "value"])


PANELS = ("loss", "dev and mining (%)", "within-family pairwise accuracy (%)", "gradient norm")


def _panel(series: str) -> str:
    return PANELS[0] if series.endswith(" loss") else PANELS[2] if " pairwise " in series else \
        PANELS[3] if series.endswith(GRADIENT_SERIES) else PANELS[1]


def plot_curves(curves: pd.DataFrame, path: str) -> str:
    """One panel per kind of series (losses, dev/mining metrics, probe accuracies), a line per run and series."""
    plt = _pyplot()
    present = set(curves["series"].map(_panel))
    panels = [p for p in PANELS if p in present]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        sub = curves[curves["series"].map(_panel) == panel]
        for (run, series), g in sub.groupby(["run", "series"], sort=True):
            g = g.sort_values("step")
            ax.plot(g["step"], g["value"], marker="o" if len(g) < 30 else None, ms=3, label=f"{run}: {series}")
        if panel == PANELS[2]:
            ax.axhline(50, color="grey", lw=0.8, ls="--")  # chance for a pair
        ax.set_title(panel)
        ax.set_xlabel("training step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def _run_spec(value: str) -> tuple[str, str]:
    label, sep, folder = value.partition("=")
    if not sep or not label or not folder:
        raise click.BadParameter(f"expected LABEL=TRAIN_DIR, got {value!r}", param_hint="--run")
    return label, folder


@dataclasses.dataclass(frozen=True, kw_only=True)  # kw_only: required options may follow optional ones
class CurvesPlan(CheckedPlan):
    """The learning curves' options, each a typed field (checked when built)."""
    run: tuple[str, ...] = option(multiple=True, metavar="LABEL=TRAIN_DIR",
                                  help="A retrieval_core.training.train output folder and its label in the curves "
                                       "(repeatable).")
    window: int = option(20, type=click.IntRange(min=1), help="Steps per loss point (their mean).")
    staged: Optional[str] = option(None, help="Staged synthetic collection: probe every kept model "
                                              "(benchmarks.probes.family_probe).")
    manifest: Optional[str] = option(None, help="The manifest --staged was staged from (name or path).")
    split: str = option("dev", help="Split the probe reads.")
    max_captions: int = option(500, help="Seeded sample of captions per probe (0 = all).")
    output: str = option(help="Folder for learning_curves.csv and learning_curves.png.")
    batch_size: int = batch_size_option(128)
    device: str = device_option()
    threads: Optional[int] = threads_option()

    def __post_init__(self):
        super().__post_init__()
        if not self.run:
            raise ValueError("give at least one --run LABEL=TRAIN_DIR")
        if bool(self.staged) != bool(self.manifest):
            raise ValueError("--staged and --manifest go together (the probe needs both)")


@plan_command(CurvesPlan)
def main(**values) -> None:
    """Learning curves of training runs: losses, minings and dev evaluations from their logs, and the
    within-family probe of every model they kept."""
    try:
        plan = plan_from_cli(CurvesPlan, values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    apply_device_and_threads(plan.device, plan.threads)
    staged, split, output = plan.staged, plan.split, plan.output
    parsed = [_run_spec(r) for r in plan.run]
    labels = [label for label, _ in parsed]
    if len(set(labels)) != len(labels):  # one label's curves would mix two runs
        raise click.UsageError(f"--run labels must differ, got {', '.join(labels)}")
    frames = []
    with cli_errors(KeyError):  # a folder that is no training run, a bad manifest or staged dir: one line
        spec = ds = None
        if staged:

            m = load_manifest(plan.manifest)
            spec = m.synthetic_spec(m.benchmark.get("query_collection") or next(iter(m.collections)))
            ds = StagedDataset(staged)
        for label, folder in parsed:
            records = read_log(folder)
            frames.append(log_curves(records, plan.window).assign(run=label))
            if ds is not None:
                click.echo(f"{label}: probing the kept models of {folder} ({split} split)")
                frames.append(probe_curves(folder, trained_heads(records), ds, spec, split,
                                           plan.max_captions or None, plan.batch_size, plan.device).assign(run=label))
    curves = pd.concat(frames, ignore_index=True)[["run", "step", "series", "value"]]
    os.makedirs(output, exist_ok=True)
    csv_path = os.path.join(output, "learning_curves.csv")
    write_atomic(csv_path, curves.to_csv(index=False).encode("utf-8"))
    png = plot_curves(curves, os.path.join(output, "learning_curves.png"))
    probe_rows = curves[curves["series"].str.contains(" pairwise ")]
    if len(probe_rows):
        wide = probe_rows.pivot_table(index=["run", "step"], columns="series", values="value")
        click.echo(wide.to_string(float_format=lambda v: f"{v:.1f}"))
    click.echo(f"wrote {csv_path} and {png}")


if __name__ == "__main__":
    main()

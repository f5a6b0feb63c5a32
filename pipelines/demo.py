"""The end-to-end demo on the embedded default (the README's main command).

    python -m pipelines.demo [--k 20] [--with-sep] [Beam options]

Stages the synthetic demo collection, trains the demo JOIN model from the shipped all-MiniLM-L6-v2, encodes
the test split, builds a FAISS index, retrieves and reranks (EMB and JOIN+CO; SEP+CO with --with-sep),
evaluates, and prints the recall table. Every step runs the same CLI a user would run (printed with a
leading '+'), so the demo doubles as a worked example. Everything lands under $RR_WORKDIR/demo
(default ./runs/demo); finished steps are reused by a rerun.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import click
import numpy as np
import pandas as pd

from pipelines import demo_assets
from pipelines.common import BEAM_CLI_CONTEXT


def _run(args: list[str]) -> float:
    print("+ " + " ".join(args), flush=True)
    t0 = time.time()
    subprocess.run(args, check=True)
    return time.time() - t0


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _done(path: str) -> bool:
    return os.path.exists(path)


def run_demo(k: int, with_sep: bool, beam_args: tuple[str, ...]) -> pd.DataFrame:
    t_start = time.time()
    root = demo_assets.demo_dir()
    timings: dict[str, float] = {}

    t0 = time.time()
    staged = demo_assets.ensure_staged(beam_args)
    timings["stage"] = time.time() - t0
    t0 = time.time()
    join_model = demo_assets.ensure_model(staged)
    timings["train JOIN"] = time.time() - t0
    models = {"JOIN": join_model}
    if with_sep:
        t0 = time.time()
        models["SEP-BE"], models["SEP-CE"] = demo_assets.ensure_sep_models(staged)
        timings["train SEP"] = time.time() - t0

    results = os.path.join(root, "results")
    runs = []  # (label, be model, ce model or None)
    runs.append(("EMB", "JOIN", None))
    runs.append(("JOIN+CO", "JOIN", "JOIN"))
    if with_sep:
        runs.append(("EMB", "SEP-BE", None))
        runs.append(("SEP+CO", "SEP-BE", "SEP-CE"))

    for be_name in dict.fromkeys(r[1] for r in runs):
        emb_dir = os.path.join(root, f"embeddings-{be_name}")
        index_dir = os.path.join(root, f"index-{be_name}")
        t0 = time.time()
        _run(_py("pipelines.encode", "--staged", staged, "--model", models[be_name], "--output", emb_dir,
                 "--split", "test", *beam_args))
        _run(_py("pipelines.build_index", "--embeddings", emb_dir, "--output", index_dir, "--modality", "image",
                 "--index-factory", "Flat", *beam_args))
        timings[f"encode+index {be_name}"] = time.time() - t0
        for label, be, ce in runs:
            if be != be_name:
                continue
            out = os.path.join(root, f"rankings-{label}-{be_name}".replace("+", ""))
            args = ["--staged", staged, "--embeddings", emb_dir, "--index", index_dir, "--split", "test",
                    "--k", str(k), "--output", out]
            args += ["--mode", "emb"] if ce is None else ["--mode", "co", "--ce-model", models[ce]]
            t0 = time.time()
            _run(_py("pipelines.rerank", *args, *beam_args))
            timings[f"rerank {label} ({be_name})"] = time.time() - t0
            _run(_py("benchmarks.evaluate", "--rankings", os.path.join(out, "rankings"), "--staged", staged,
                     "--output", results, "--split", "test", "--model", result_model(be, ce),
                     "--label", label))

    # metrics.csv keeps the rows of earlier runs (another --k, --with-sep): show this run's rows only.
    table = this_run_rows(pd.read_csv(os.path.join(results, "metrics.csv")), k,
                          [(result_model(be, ce), label) for label, be, ce in runs])
    cols = [c for c in ("model", "mode", "k", "direction", "R@1", "R@5", "R@10", "mR", "queries",
                        "collection_size") if c in table.columns]
    print("\nDemo results (synthetic demo collection, test split; recall in %, NOTES.md section 2 convention):")
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    for line in r1_changes(table):
        print(line)
    print("\nwall time per step (s): " + ", ".join(f"{name} {sec:.0f}" for name, sec in timings.items()))
    print(f"total {time.time() - t_start:.0f} s on {os.cpu_count()} CPU cores; outputs under {root}")
    return table


def result_model(be: str, ce: str | None) -> str:
    """The model name a demo run records in metrics.csv: the bi-encoder, or "BE/CE" for a reranking run."""
    return be if ce is None else f"{be}/{ce}"


def this_run_rows(table: pd.DataFrame, k: int, runs: list[tuple[str, str]]) -> pd.DataFrame:
    """The metrics.csv rows of one demo run: test split, rerank depth ``k`` and the (model, mode) pairs in
    ``runs``. The results folder is shared by every demo run, and benchmarks.evaluate only replaces rows of
    the same configuration, so rows of an earlier --k or --with-sep run are still in the file."""
    wanted = set(runs)
    keep = (table["k"] == k) & np.array([(m, md) in wanted for m, md in zip(table["model"], table["mode"])],
                                        dtype=bool)
    if "split" in table.columns:
        keep &= table["split"] == "test"
    return table[keep].reset_index(drop=True)


def r1_changes(table: pd.DataFrame) -> list[str]:
    """One line per reranking mode: its R@1 minus the R@1 of EMB with the same bi-encoder, per direction -
    the paper's claim (reranking lifts R@1) checked on this run rather than asserted.

    Rows are compared within the same collection, split and k (where the table has those columns); a
    repeated configuration counts once, its last row (the newest in metrics.csv)."""
    context = [c for c in ("collection", "split", "k") if c in table.columns]
    table = table.drop_duplicates(subset=["model", "mode", *context, "direction"], keep="last")
    emb_rows = table[table["mode"] == "EMB"]
    emb = {(m, *ctx, d): r for m, *ctx, d, r in zip(emb_rows["model"], *(emb_rows[c] for c in context),
                                                     emb_rows["direction"], emb_rows["R@1"])}
    several_k = "k" in table.columns and table["k"].nunique() > 1
    lines = []
    for (model, mode, *ctx), rows in table[table["mode"] != "EMB"].groupby(["model", "mode", *context],
                                                                            sort=False, dropna=False):
        be = str(model).split("/")[0]
        deltas = [f"{d} {r - emb[(be, *ctx, d)]:+.2f}" for d, r in zip(rows["direction"], rows["R@1"])
                  if (be, *ctx, d) in emb]
        if deltas:
            lifted = all(float(x.split()[1]) > 0 for x in deltas)
            where = f"{be}, k={ctx[context.index('k')]}" if several_k else be
            lines.append(f"R@1 of {mode} minus EMB ({where}): {', '.join(deltas)} points -> "
                         f"{'reranking lifts R@1' if lifted else 'reranking does NOT lift R@1 in this run'}")
    return lines


@click.command(context_settings=BEAM_CLI_CONTEXT)
@click.option("--k", default=20, show_default=True, help="Rerank depth (the paper's k).")
@click.option("--with-sep", is_flag=True, help="Also train a separate BE and CE (SEP) and add SEP+CO rows.")
@click.pass_context
def main(ctx: click.Context, k: int, with_sep: bool) -> None:
    """Run the whole retrieve-and-rerank demo on the embedded synthetic default. Extra --flags go to Beam."""
    try:
        run_demo(k, with_sep, tuple(ctx.args))
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"demo step failed (exit {exc.returncode}): {' '.join(map(str, exc.cmd))}")


if __name__ == "__main__":
    main()

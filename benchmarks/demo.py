"""The end-to-end demo on the embedded default (the README's main command).

    python -m benchmarks.demo [--k 10] [--queries 500] [--with-sep] [Beam options]

Stages the synthetic demo collection, trains the demo JOIN model from the shipped all-MiniLM-L6-v2, encodes
the test and dev splits, builds a FAISS index, selects the queries (``benchmarks.queries --scale``: every test
image and one caption of each, as the scale suites do; ``--queries 0`` ranks every test caption too), retrieves and
reranks once per model family with rerank's default (``--mode auto``: the ranking chosen on the dev split, whose
pool is the test pool's size), evaluates, prints the recall table with 95 % intervals (EMB, the paper's CO and the
default) and the verdicts, and ends by writing the inspection page of the default vs EMB (``benchmarks.inspect``)
and printing its path; last, three queries in a user's own words against the demo index (``pipelines.query``,
ranked as the JOIN default was: docs/QUERY.md), their top hits printed. Score once, evaluate many: the rerank
run stores the BE top-k with its BE and CE scores, so the EMB and CO rows are derived from the same run
(``benchmarks.evaluate --mode``) instead of runs of their own.
``--quantize bf16`` then runs the encode and rerank steps again with the model served in bf16 and writes each bf16
ranking paired with the float32 run's same ranking (``benchmarks.evaluate --against``): the effect of the precision
on R@1 and mR with paired intervals, and on the scores, as ``demo_bf16.csv``.
Every step runs the same CLI a user would run (printed with a leading '+'), so the demo doubles as a worked
example. Everything lands under $RR_WORKDIR/demo (default ./runs/demo); finished steps are reused by a rerun.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import click
import pandas as pd

from benchmarks import report
from benchmarks.evaluate import EvaluatePlan, csv_rows, evaluate_ranking
from benchmarks.inspect import InspectPlan
from benchmarks.queries import QueriesPlan
from benchmarks.suites import launch
from pipelines.beam_kit import BEAM_CLI_CONTEXT, check_beam_flags
from pipelines.build_index.plan import IndexPlan
from pipelines.encode.plan import EncodePlan
from pipelines.query.plan import HITS_JSONL, QueryPlan
from pipelines.rerank.plan import RerankPlan
from retrieval_core.cli import (
    AUTO_DEVICE,
    CheckedPlan,
    cli_errors,
    describe_device,
    k_option,
    option,
    plan_command,
    plan_from_cli,
    quantize_option,
    resolve_device,
    to_argv,
)
from retrieval_core.data.store import StagedDataset
from retrieval_core.evaluation.runs import read_run_manifest
from retrieval_core.evaluation.stats import Bootstrap, verdict
from retrieval_core.pages import ItemViews
from retrieval_core.precision import resolve_quantize
from retrieval_core.training import cache, recipes

#: The demo's table in the suites' CSV schema (benchmarks.report), beside metrics.csv in <demo>/results.
DEMO_CSV = "demo.csv"

launch.preload("benchmarks.queries", "benchmarks.evaluate", "benchmarks.inspect",  # the demo's own steps
               "pipelines.query.run")
#: The tutorial's last step: queries in a user's own words (the demo generator's vocabulary: colours, objects,
#: places, relations), asked of the demo index with pipelines.query.
OWN_WORDS = ("a red cup on a table", "two brown dogs on the grass", "a purple lamp left of a green sofa")
#: Hits printed per query.
OWN_WORDS_SHOWN = 3


def _run(module: str, plan, beam_args: tuple[str, ...] = ()) -> float:
    """Launch ``plan`` as the command a user would type (``to_argv``), printed with a leading '+'."""
    args = [sys.executable, "-m", module, *to_argv(plan), *beam_args]
    print("+ " + " ".join(args), flush=True)
    t0 = time.time()
    launch.run_module(args)  # forked from the preloaded interpreter (benchmarks.suites.launch): no imports per step
    return time.time() - t0


def run_demo(k: int, with_sep: bool, beam_args: tuple[str, ...], queries: int = 500, seed: int = 0,
             recipe: recipes.Recipe = recipes.DEMO_RECIPE, quantize: str = "none") -> pd.DataFrame:
    """The demo as its steps, each the CLI a user would run: stage, train, select the queries, then per model
    family encode + index + rerank + evaluate; print the table and the wall times, write the table's CSV and the
    inspection page of the JOIN default against EMB. Returns the table."""
    t_start = time.time()
    root = demo_root(seed, recipe)
    timings: dict[str, float] = {}
    staged, models = _stage_and_train(recipe, seed, with_sep, beam_args, timings)
    query_file = _select_queries(root, staged, queries)
    results = os.path.join(root, "results" if quantize == "none" else os.path.join(quantize, "results"))
    rows, run_dirs = [], {}
    for family, be, ce in [("JOIN", "JOIN", "JOIN")] + ([("SEP", "SEP-BE", "SEP-CE")] if with_sep else []):
        run_dirs[family], family_rows = _rank_and_evaluate(root, staged, models, (family, be, ce), k, queries,
                                                           query_file, beam_args, timings, quantize, results)
        rows += family_rows
    table = pd.DataFrame(rows)
    steps = _print_table(table, recipe, quantize, timings)
    _write_table_csv(rows, results, root, recipe, seed, quantize, steps, time.time() - t_start)
    # the queries behind the numbers: where the default ranking moved the gold item relative to EMB (one run)
    page = os.path.join(results, "inspect_JOIN-default_vs_EMB.html")
    _run("benchmarks.inspect", InspectPlan(rankings=run_dirs["JOIN"], against_mode="emb", staged=staged, output=page))
    print(f"inspection page (EMB vs the JOIN default, query by query): {page}")
    if quantize == "none":
        _query_own_words(root, staged, run_dirs["JOIN"], k, beam_args)
    return table


def _query_own_words(root: str, staged: str, run: str, k: int, beam_args: tuple[str, ...]) -> None:
    """The tutorial's end: OWN_WORDS as a user's query file, asked of the JOIN index with pipelines.query, ranked
    as the JOIN default was (--mode auto --tune-on the demo's run); the top hits printed with their scenes."""
    path, out = os.path.join(root, "my_queries.txt"), os.path.join(root, "my_hits")
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(q + "\n" for q in OWN_WORDS))
    print(f"\nYour own words against the demo index (docs/QUERY.md): {path}")
    _run("pipelines.query", QueryPlan(staged=staged, embeddings=os.path.join(root, "embeddings-JOIN"),
                                      index=os.path.join(root, "index-JOIN"), queries=path, output=out,
                                      mode="auto", tune_on=run, k=k), beam_args)
    hits = pd.read_json(os.path.join(out, HITS_JSONL), lines=True, dtype={"query_id": str, "source_id": str})
    shown = hits[hits["rank"] <= OWN_WORDS_SHOWN]
    views = ItemViews(StagedDataset(staged), None, None)  # the scene of each synthetic image, as the page shows it
    views.load(set(), set(shown["item_id"].tolist()))
    for _, g in shown.groupby("query_id", sort=False):
        print(f'  "{g["query"].iloc[0]}":')
        for _, h in g.iterrows():
            scene = views.scene(*views.image_source(int(h["item_id"])))
            print(f"    {h['rank']}. image {h['source_id']} (BE {h['be_score']:.3f}, CE {h['ce_score']:.2f})"
                  + (f": {scene}" if scene else ""))


def demo_root(seed: int, recipe: recipes.Recipe) -> str:
    """Where a demo's models and outputs live: another training seed's apart, the pixel demo's apart (the staged
    collection of a recipe is shared by its seeds)."""
    root = recipes.demo_dir() if seed == 0 else os.path.join(recipes.demo_dir(), f"seed{seed}")
    return root if recipe == recipes.DEMO_RECIPE else os.path.join(root, recipe.name)


def _stage_and_train(recipe: recipes.Recipe, seed: int, with_sep: bool, beam_args: tuple[str, ...],
                     timings: dict) -> tuple[str, dict]:
    """The staged collection and the trained models ({"JOIN": ..., and with SEP "SEP-BE", "SEP-CE"}), each built
    on first use."""
    t0 = time.time()
    staged = cache.ensure_staged(beam_args, recipe.manifest, run=launch.run_module)
    timings["stage"] = time.time() - t0
    t0 = time.time()
    trained = cache.ensure_models(recipe, seed, sep=False, beam_args=beam_args, run=launch.run_module)
    timings["train JOIN"] = time.time() - t0
    models = {"JOIN": trained.join}
    if with_sep:
        t0 = time.time()
        trained = cache.ensure_models(recipe, seed, sep=True, beam_args=beam_args, run=launch.run_module)
        models["SEP-BE"], models["SEP-CE"] = trained.be, trained.ce
        timings["train SEP"] = time.time() - t0
    return staged, models


def _select_queries(root: str, staged: str, queries: int) -> Optional[str]:
    """The test queries (benchmarks.queries --scale): ``queries`` images and one caption of each; None = all.
    The CE cost is queries x k pairs: one caption per image keeps the demo within 10 minutes."""
    if not queries:
        return None
    query_dir = os.path.join(root, f"queries-test-{queries}")
    _run("benchmarks.queries", QueriesPlan(staged=staged, collection=recipes.DEMO_MANIFEST, split="test",
                                           output=query_dir, scale=queries))
    return os.path.join(query_dir, "queries.parquet")


def _rank_and_evaluate(root: str, staged: str, models: dict, family_models: tuple[str, str, str], k: int,
                       queries: int, query_file: Optional[str], beam_args: tuple[str, ...], timings: dict,
                       quantize: str, results: str) -> tuple[str, list[dict]]:
    """One family's (family, BE model, CE model) rerank run and its rows: EMB, CO and the run's default, each
    evaluated against EMB; served in ``quantize``, each row is paired with the float32 run's same ranking."""
    family, be, ce = family_models
    out = _encode_and_rerank(root, staged, models, family, be, ce, k, queries, query_file, beam_args, timings)
    reference = None
    if quantize != "none":  # the same steps served in `quantize`; every row paired with float32's same ranking
        reference, out = out, _encode_and_rerank(os.path.join(root, quantize), staged, models, family, be, ce, k,
                                                 queries, query_file, beam_args, timings, quantize)
    rows = []
    default = f"{family} default ({chosen_label(out)})"
    for mode, row_label, model in (("emb", "EMB", be), ("co", f"{family}+CO", result_model(be, ce)),
                                   (None, default, result_model(be, ce))):
        if reference is None:
            against = "emb" if mode != "emb" else None  # the paired difference the verdict reads
            # mode None: the run's own (the default's) ranking
            _run("benchmarks.evaluate", EvaluatePlan(rankings=out, staged=staged, output=results, split="test",
                                                     model=model, mode=mode, k=k if mode else None,
                                                     label=row_label, against_mode=against))
            rows += [{**r, "rankings": os.path.relpath(out, root)}  # relative: the CSV names no machine's paths
                     for r in table_rows(out, staged, mode, k if mode else None, model, row_label, against)]
            continue
        # the same ranking of the float32 run (the default: each run's own choice, which may differ)
        ref_label = row_label if mode else f"{family} default ({chosen_label(reference)})"
        _run("benchmarks.evaluate", EvaluatePlan(rankings=out, staged=staged, output=results, split="test",
                                                 model=model, mode=mode, k=k if mode else None, label=row_label,
                                                 against=reference, against_mode=mode,
                                                 tag=(f"quantize={quantize}",)))
        rows += [{**r, "against": f"{ref_label} in float32", "quantize": quantize,
                  "rankings": f"{os.path.relpath(out, root)} against {os.path.relpath(reference, root)}"}
                 for r in table_rows(out, staged, mode, k if mode else None, model, row_label, mode,
                                     against=reference)]
    return out, rows


def _print_table(table: pd.DataFrame, recipe: recipes.Recipe, quantize: str, timings: dict) -> str:
    """Print the recall table, the R@1 verdicts (or the precision's differences) and the wall time per step;
    returns that last line (the CSV's notes)."""
    what = "demo scenes drawn as pictures, staged from pixels" if recipe == recipes.PIXELS_RECIPE \
        else "synthetic demo collection"
    print(f"\nDemo results ({what}, test split; recall in %, convention: "
          "docs/CONVENTIONS.md#the-recall-convention; "
          f"[95 % interval]: {Bootstrap().label}):")
    print(compact_table(table))
    for line in (r1_changes(table) if quantize == "none" else precision_changes(table, quantize)):
        print(line)
    steps = "wall time per step (s): " + ", ".join(f"{name} {sec:.0f}" for name, sec in timings.items())
    print("\n" + steps)
    return steps


def _write_table_csv(rows: list[dict], results: str, root: str, recipe: recipes.Recipe, seed: int, quantize: str,
                     steps: str, wall: float) -> str:
    """The table once more in the suites' schema, with where, when and from which commit it ran: the file the
    docs' demo table is generated from (benchmarks.report docs)."""
    # the cores this process may run on (taskset / a container's cpuset), not the machine's count (Linux only)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = resolve_device(AUTO_DEVICE)  # the steps' default (--device auto), resolved here as they resolve it
    print(f"total {wall:.0f} s on {cores} CPU cores; device: {describe_device(device)}; outputs under {root}")
    csv_name = DEMO_CSV if quantize == "none" else DEMO_CSV.replace(".csv", f"_{quantize}.csv")
    csv_path = report.write_csv(os.path.join(results, csv_name), [
        {**r, "suite": "demo", "wall_s": round(wall), "recipe": recipe.name, "model_seed": seed,
         "measured": True, "notes": steps, **report.environment(device), "quantize": r.get("quantize", "none")}
        for r in rows])
    print(f"the table with its environment and commit: {csv_path}")
    return csv_path


def _encode_and_rerank(root: str, staged: str, models: dict, family: str, be: str, ce: str, k: int, queries: int,
                       query_file: Optional[str], beam_args: tuple[str, ...], timings: dict,
                       quantize: str = "none") -> str:
    """Encode the test and dev splits with ``be``, index the test images, rerank the test queries with ``ce`` and
    rerank's default (``--mode auto``), each served in ``quantize``, under ``root``; returns the rerank run. The
    wall times go into ``timings``."""
    tag = "" if quantize == "none" else f" {quantize}"
    t0 = time.time()
    emb_dir, dev_dir = os.path.join(root, f"embeddings-{be}"), os.path.join(root, f"embeddings-{be}-dev")
    index_dir = os.path.join(root, f"index-{be}")
    serve = {} if quantize == "none" else {"quantize": quantize}  # float32: the plans' own default, as users run
    for split, out_dir in (("test", emb_dir), ("dev", dev_dir)):  # dev: the pool the default is chosen on
        _run("pipelines.encode", EncodePlan(staged=staged, model=models[be], output=out_dir, split=split, **serve),
             beam_args)
    _run("pipelines.build_index", IndexPlan(embeddings=emb_dir, output=index_dir, modality="image",
                                            factory="Flat"), beam_args)
    timings[f"encode+index {be}{tag}"] = time.time() - t0
    t0 = time.time()
    out = os.path.join(root, f"rankings-{family}-k{k}-q{queries or 'all'}")
    # rerank's default, --mode auto: first CO on --queries sampled dev queries (dev pool = test pool size), then
    # the test queries ranked as chosen there; the run keeps every CE score, so CO is derived from it too
    _run("pipelines.rerank", RerankPlan(staged=staged, embeddings=emb_dir, index=index_dir, split="test", k=k,
                                        output=out, ce_model=models[ce], tune_embeddings=dev_dir,
                                        tune_queries=queries or 500, queries=query_file, **serve), beam_args)
    timings[f"rerank {family} (with its dev pass){tag}"] = time.time() - t0
    return out


def chosen_label(run: str) -> str:
    """What rerank's --mode auto chose for a run (its manifest's fusion_choice), e.g. co or norm_add_0.5."""
    return read_run_manifest(run)[1]["fusion_choice"]["label"]


def result_model(be: str, ce: str | None) -> str:
    """The model name a demo run records in metrics.csv: the bi-encoder, or "BE/CE" for a reranking run."""
    return be if ce is None else f"{be}/{ce}"


def table_rows(run: str, staged: str, mode: Optional[str], k: Optional[int], model: str, label: str,
               against_mode: Optional[str] = None, against: Optional[str] = None) -> list[dict]:
    """The demo table's two rows (t2i, i2t) of one rerank run evaluated in ``mode`` (EMB is derived from the
    run's stored BE scores), with their intervals and, given ``against_mode``, the paired difference to that
    mode's ranking of the same run (of the run ``against``, where given: also the score differences):
    benchmarks.evaluate's metrics.csv rows (``csv_rows``) of the same result."""
    res = evaluate_ranking(run, staged, k=k, mode=mode, split="test", against=against, against_mode=against_mode)
    return csv_rows(res, collection=res["collection"], split="test", model=model, mode=label, k=res["k"], tags={})


def compact_table(table: pd.DataFrame) -> str:
    """The demo table: each recall with its 95 % interval in one cell, then queries and pool size."""
    def cell(r, m):
        lo, hi = r.get(f"{m}_lo"), r.get(f"{m}_hi")
        return f"{r[m]:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and lo == lo else "")

    shown = pd.DataFrame([{"model": r["model"], "mode": r["mode"], "k": r["k"], "direction": r["direction"],
                           **{m: cell(r, m) for m in ("R@1", "R@5", "R@10", "mR")}, "queries": r["queries"],
                           "collection_size": r["collection_size"]} for r in table.to_dict("records")])
    return shown.to_string(index=False)


def r1_changes(table: pd.DataFrame) -> list[str]:
    """One line per reranking mode: its R@1 minus the R@1 of EMB with the same bi-encoder, per direction, with the
    paired 95 % interval of the difference and what the interval says ("lifts" when it lies above 0, "lowers"
    below, else "no significant difference"): the paper's claim (reranking lifts R@1) checked on this run, never
    decided from the point estimate.

    The differences are the rows' own (``delta_R@1`` with ``_lo`` / ``_hi`` against ``emb``: benchmarks.evaluate
    --against-mode emb, which pairs the same queries of the same run). Rows are grouped by model, mode and, where
    the table has them, collection, split and k; a repeated configuration counts once, its last row (the newest in
    metrics.csv)."""
    context = [c for c in ("collection", "split", "k") if c in table.columns]
    table = table.drop_duplicates(subset=["model", "mode", *context, "direction"], keep="last")
    several_k = "k" in table.columns and table["k"].nunique() > 1
    lines = []
    for (model, mode, *ctx), rows in table[table["mode"] != "EMB"].groupby(["model", "mode", *context],
                                                                            sort=False, dropna=False):
        be = str(model).split("/")[0]
        where = f"{be}, k={ctx[context.index('k')]}" if several_k else be
        parts = [f"{r['direction']} R@1 {_difference(r)}" for r in rows.to_dict("records")]
        lines.append(f"R@1 of {mode} minus EMB ({where}): " + "; ".join(parts))
    return lines


def precision_changes(table: pd.DataFrame, quantize: str) -> list[str]:
    """One line per ranking of the demo served in ``quantize``: its R@1 and mR minus those of the float32 run's
    same ranking (the same queries: paired 95 % intervals and what they say), and how far the CE scores moved."""
    lines = []
    for r in table.to_dict("records"):
        parts = [f"{m} {_paired(r, m) or 'has no paired interval'}" for m in ("R@1", "mR")]
        for score in ("be", "ce"):  # the stored scores of the pairs both runs hold
            mx = r.get(f"{score}_score_max_abs_diff")
            if mx is not None and mx == mx:
                mean = r[f"{score}_score_mean_abs_diff"]
                parts.append(f"{score.upper()} scores max |diff| {mx:.3g}, mean {mean:.3g}")
        lines.append(f"{r['mode']} {r['direction']} in {quantize} minus {r['against']}: " + "; ".join(parts))
    return lines


def _difference(r: dict) -> str:
    """``+3.10 [+1.20, +5.00] -> lifts`` from a row's difference to EMB, or why there is none."""
    if str(r.get("against", "")).lower() != "emb":
        return "has no interval of its difference to EMB (benchmarks.evaluate --against-mode emb)"
    return _paired(r, "R@1") or "has no interval of its difference to EMB (benchmarks.evaluate --against-mode emb)"


def _paired(r: dict, metric: str) -> Optional[str]:
    """``+3.10 [+1.20, +5.00] -> lifts`` from a row's delta columns of ``metric``; None where it has none."""
    values = [r.get(f"delta_{metric}{e}") for e in ("", "_lo", "_hi")]
    if any(v is None or v == "" or v != v for v in values):
        return None
    est, lo, hi = (float(v) for v in values)
    return f"{est:+.2f} [{lo:+.2f}, {hi:+.2f}] -> {verdict(lo, hi)}"


@dataclass(frozen=True)
class DemoPlan(CheckedPlan):
    """The demo's options, each a typed field (checked when built)."""
    k: int = k_option(10, help="Rerank depth (the paper's k: 10 or 20).")
    queries: int = option(500, type=click.IntRange(min=0),
                          help="Queries per direction: N seeded test images and one caption of each (0: every test "
                               "caption and image; ~5x the CE pairs).")
    with_sep: bool = option(False, help="Also train a separate BE and CE (SEP) and add SEP+CO rows.")
    seed: int = option(0, type=click.IntRange(min=0),
                       help="Training seed of the demo recipe's models (another seed: models and outputs under "
                            "<demo>/seed<N>, the staged collection shared).")
    pixels: bool = option(False, help="The same demo on the demo scenes drawn as pictures and staged from their PNGs "
                                      "(EfficientNet-Lite0 grid regions; outputs under <demo>/demo-pixels), "
                                      "to set beside the region-feature demo's table.")
    quantize: str = quantize_option("none",
                                    help="Also serve encode and rerank in this precision (outputs under "
                                         "<demo>/<quantize>): each row is that run's ranking, paired with the "
                                         "float32 run's same ranking of the same queries (R@1 / mR differences with "
                                         "95 % intervals, score differences); the table is written as "
                                         "demo_<quantize>.csv; auto: bf16 where the jobs' default would serve it (a "
                                         "CUDA device), else none.")

    def __post_init__(self):
        super().__post_init__()
        # auto as the jobs resolve it on this host (their device is auto too): one vocabulary for --quantize
        object.__setattr__(self, "quantize", resolve_quantize(self.quantize, resolve_device(AUTO_DEVICE)))


@plan_command(DemoPlan, **BEAM_CLI_CONTEXT)
@click.pass_context
def main(ctx: click.Context, **values) -> None:
    """Run the whole retrieve-and-rerank demo on the embedded synthetic default. Extra --flags go to Beam."""
    check_beam_flags(ctx.args)
    with cli_errors():
        plan = plan_from_cli(DemoPlan, values)
    try:
        run_demo(plan.k, plan.with_sep, tuple(ctx.args), plan.queries, plan.seed,
                 recipes.PIXELS_RECIPE if plan.pixels else recipes.DEMO_RECIPE, plan.quantize)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"demo step failed (exit {exc.returncode}): {' '.join(map(str, exc.cmd))}")


if __name__ == "__main__":
    main()

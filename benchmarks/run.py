"""Benchmark suites: ``python -m benchmarks.run --suite NAME [options] [Beam flags]``.

Suites (paper tables in brackets):
  standard        synthetic_coco5k 5k + 1k (mean over 5 folds) and synthetic_f30k1k: EMB (SEP, JOIN),
                  SEP+CO, JOIN+CO, exhaustive CE within --ce-pair-budget                        [Table 1]
  distractor_20k  each task's queries/gold against pools enlarged with the other collections' images
                  and captions (synthetic_distractor20k)                                        [Table 5]
  scale_100k      synthetic_100k: 5k caption queries against all 100,000 images and 5k image queries
                  against all 500,000 captions, EMB and CO                                      [Table 4]
  scale_1m        the same protocol on synthetic_1m (1M images / 5M captions): a cluster job; on one
                  machine use --plan (the jobs and their estimated cost)
  k_ablation      SEP+CO / JOIN+CO at k = 10, 20, 50, 100 from one k = 100 run (synthetic_f30k1k)  [Table 8]
  combination     CO vs ADD_λ / NORM_ADD_λ, λ in 0.1/0.5/0.9, from one CO run (synthetic_f30k1k) [Table 11]
  baseline        the training-free mapped baseline (fit on the demo train split) as an EMB row
  memory          peak RSS of every pipeline job at 20k, 100k and 200k images (synthetic_memory; EMB and CO
                  rows too): memory must stay flat as collections grow (--memory-sizes)
  latency         per-query latency 1k..1M (in-process) and total evaluation time 1k/5k/100k (pipeline
                  jobs), vs the paper's code                                                    [Tables 3, 4]

Every recall number comes from the pipelines a user would run by hand: the suite is planned as a list of
jobs (``pipelines.stage``, ``benchmarks.queries``, ``pipelines.encode``, ``pipelines.build_index``,
``pipelines.rerank``), each run as ``python -m <module> <args> <the Beam flags given here>``, and its rows
are read from the rerank runs by ``benchmarks.evaluate.evaluate_run``. Unknown ``--flags`` go to every
pipeline job, so the same suite runs on Beam's DaskRunner or Dataflow::

    python -m benchmarks.run --suite distractor_20k \\
        --runner=apache_beam.runners.dask.dask_runner.DaskRunner --dask_client_address=127.0.0.1:8786

Writes <output>/<suite>.csv (one row per collection, model, mode, k, λ and direction; timing columns from
the jobs that produced the row, peak RSS included), <output>/<suite>_jobs.csv (every job: wall time, peak
RSS, reused or run, command) and PNG plots; prints a summary table. Jobs write under <workdir>/bench/ and a
finished job is reused by the next run (benchmarks.suites.jobs). ``--plan`` prints the jobs without running any.

Models default to the benchmark recipe's (retrieval_core.training.recipes.BENCH_RECIPE; ``--recipe demo`` for the
demo's, ``--model-seed N`` for another training seed), trained on first use and cached per recipe and seed.
Synthetic manifests are staged at the model's feature_dim (``--set feature_dim=``);
a manifest with real (file) features and another feature_dim is refused with both dimensions named.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

import click

from benchmarks import report
from benchmarks.suites import jobs, latency, launch, per_query, suites
from benchmarks.suites.planner import Models, Plan, SuiteConfig, model_feature_dim, model_max_regions
from benchmarks.suites.rows import RowHits, ce_pairs_scored, evaluate_row
from pipelines.beam_kit import UnknownFlagError, unknown_beam_flags
from retrieval_core.cli import cli_errors, plan_command, plan_from_cli
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.errors import UsageFault
from retrieval_core.model import baseline as bl
from retrieval_core.training import cache, recipes


def unit_costs_path(cfg: SuiteConfig) -> str:
    """Rates learned by runs of this serving precision (a bf16 rate must not estimate a float32 job)."""
    return os.path.join(cfg.root, "unit_costs.json" if cfg.quantize == "none" else f"unit_costs-{cfg.quantize}.json")


#: The jobs CSV's columns that say where the run was (benchmarks.report.JOB_COLUMNS).
JOB_PROVENANCE = ("quantize",) + report.ENVIRONMENT_COLUMNS


def job_rows(results: Sequence[jobs.JobResult], beam_args: Sequence[str], env: Mapping) -> list[dict]:
    """One row per job: its cost, when it finished and its command as it ran (a reused job's from its stamp), and
    where the run was (the machine, library versions and commit are a reused job's too: it is reused only by the
    code that wrote it)."""
    where = {c: env[c] for c in JOB_PROVENANCE}
    rows = []
    for r in results:
        command = r.command or r.job.command(beam_args)
        earlier = earlier_runs_s(r.job)
        rows.append({"job": r.job.name, "step": r.job.module, "wall_s": round(r.wall_s, 3),
                     "earlier_runs_s": round(earlier, 1) if earlier else "", "peak_rss_mb": round(r.peak_rss_mb, 1),
                     "reused": r.reused, "output": r.job.output,
                     "command": command, "finished": r.finished, "job_threads": _given_threads(command), **where})
    return rows


def earlier_runs_s(job: jobs.Job) -> float:
    """Seconds that interrupted earlier runs of a finished encode job spent on the batches it resumed from (its
    manifest's ``resumed_from_spill``); 0 for other jobs and for an encode that ran in one go."""
    if job.module != "pipelines.encode":
        return 0.0
    try:
        with open(os.path.join(job.output, job.done)) as f:
            return float(json.load(f).get("resumed_from_spill", {}).get("earlier_runs_s", 0.0))
    except (OSError, ValueError):
        return 0.0


def _given_threads(command: str) -> str:
    """The --threads a job's command gave it ('' where it gave none: torch's default)."""
    m = re.search(r"--threads[ =](\d+)", command)
    return m.group(1) if m else ""


def execute(plan: Plan, beam_args: Sequence[str], costs: jobs.UnitCosts, costs_path: str, env: dict,
            log=print, preload: bool = True) -> tuple[list[dict], list[jobs.JobResult], list[Optional[RowHits]]]:
    """Run the plan's jobs in order (learning unit costs from each), then evaluate its rows. ``preload``:
    jobs forked from the preloaded forkserver (``benchmarks.suites.jobs``), not fresh interpreters. Returns the CSV
    rows, the job results and, for each CSV row, the per-query hits behind it (the seed summary's input)."""
    runner = jobs.JobRunner(tuple(beam_args), log, preload=preload)
    for job in plan.jobs:
        res = runner.run(job)
        if not res.reused:
            if job.module == "pipelines.rerank":  # the pairs it really scored, not the planned upper bound
                pairs = ce_pairs_scored(job.output)
                res = replace(res, job=jobs.Job(**{**job.__dict__, "work": (("ce_pairs", pairs),) if pairs else ()}))
            if not earlier_runs_s(job):  # a resumed encode's wall covers only part of its work: no rate
                costs.learn(res)
                costs.save(costs_path)
    rows, hits, memo = [], [], {}
    for row in plan.rows:
        got, row_hits = evaluate_row(row, runner.results, env, memo=memo)
        peak = round(_own_peak_rss_mb(), 1)  # after reading this row's rankings and gold
        rows += [{**r, "launcher_peak_rss_mb": peak} for r in got]
        hits += [row_hits] * len(got)
    return rows, list(runner.results.values()), hits


def _own_peak_rss_mb() -> float:
    """This process's high-water RSS (ru_maxrss, KiB on Linux); the jobs are children and not included."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --------------------------------------------------------------------------------------------- CLI
@dataclass(frozen=True)
class RunOptions:
    """What main() does besides the suite plan itself."""
    output: str
    plan_only: bool
    beam_args: tuple[str, ...]
    recipe: str = ""  # the cached models' recipe and seed, recorded in every row ("" for given model folders)
    model_seed: object = ""
    # jobs forked from the preloaded forkserver (benchmarks.suites.jobs); False: fresh interpreters
    preload: bool = True


def check_beam_args(beam_args: Sequence[str]) -> None:
    """Refuse, before anything runs (training the demo models, staging), a flag no pipeline would take."""
    unknown = unknown_beam_flags(beam_args)
    if unknown:
        raise UnknownFlagError(f"unknown option(s) {' '.join(unknown)}: neither benchmarks.run nor Beam's "
                               f"pipeline options know them (see --help)")
    if any(a == "--dry_run" or a.startswith("--dry_run=") for a in beam_args):
        raise UsageFault("--dry_run would make every job write nothing for the next to read; use --plan "
                         "to see the jobs without running them")


#: Suites whose SEP rows need the SEP models named (--be-model, --ce-model): latency times the JOIN model; at
#: scale, SEP doubles the encoding of the whole collection (docs/BENCHMARKS.md, "Models").
JOIN_BY_DEFAULT = ("latency", "scale_100k", "scale_1m")
#: The multilingual suite's model families: (label, recipes.ML_RECIPES key).
ML_FAMILIES = (("JOIN-e5-en (zero-shot)", "zero_shot"), ("JOIN-e5-all", "all_languages"),
               ("JOIN-MiniLM-en", "english_reference"))


def _recipe_label(cli) -> str:
    """The recipe(s) of the cached models a run uses, for its rows: the multilingual suite's own, else --recipe."""
    if cli.suite == "multilingual":
        return " / ".join(recipes.ML_RECIPES[r].name for _, r in ML_FAMILIES)
    return cli.recipe


def resolve_models(join_dir, be_dir, ce_dir, no_sep: bool, suite: str, plan_only: bool, beam_args,
                   recipe_name: str = "bench", seed: int = 0) -> Models:
    """Model folders: the given ones, else the cached models of ``recipe_name`` at ``seed``
    (retrieval_core.training.cache; trained on first use, with --plan only named). The multilingual suite's models are
    its own recipes' JOIN models (recipes.ML_RECIPES), whatever --recipe says."""
    if suite == "multilingual" and not (join_dir or be_dir or ce_dir):
        named = []
        for label, recipe in ML_FAMILIES:
            r = recipes.ML_RECIPES[recipe]
            folder = cache.trained_model_path(recipes.model_dirs(r, seed).join) if plan_only else \
                cache.ensure_models(r, seed, beam_args=tuple(beam_args), run=launch.run_module).join
            named.append((label, os.path.abspath(folder)))
        return Models(named=tuple(named))
    recipe = recipes.RECIPES[recipe_name]
    no_sep = no_sep or (suite in JOIN_BY_DEFAULT and not (be_dir and ce_dir))
    need_sep = not no_sep and (be_dir is None or ce_dir is None)
    if plan_only:  # name the recipe's model folders without training them
        dirs = recipes.model_dirs(recipe, seed)
        trained = recipes.ModelSet(*(cache.trained_model_path(d) for d in (dirs.join, dirs.be, dirs.ce)))
    elif join_dir is None or need_sep:
        trained = cache.ensure_models(recipe, seed, sep=need_sep, beam_args=tuple(beam_args),
                                     run=launch.run_module)
    else:
        trained = recipes.ModelSet(join_dir)
    join_dir, be_dir, ce_dir = join_dir or trained.join, be_dir or trained.be, ce_dir or trained.ce
    return Models(join=os.path.abspath(join_dir), be=None if no_sep or not be_dir else os.path.abspath(be_dir),
                  ce=None if no_sep or not ce_dir else os.path.abspath(ce_dir))


def baseline_model(cfg: SuiteConfig, plan_only: bool) -> str:
    """Fit (or reuse) the training-free mapped baseline on the demo train split; returns its folder."""
    out = os.path.join(cfg.root, "baseline" + ("-quick" if cfg.quick else ""))
    if plan_only or bl.MappedBaseline.is_baseline_dir(out):
        return out
    import pandas as pd


    ds = StagedDataset(cache.ensure_staged(run=launch.run_module))
    caps = ds.captions(split="train")
    if cfg.quick:  # a seeded subset of training images keeps the smoke run short
        keep = pd.Series(caps["image_item_id"].unique()).sample(n=min(300, caps["image_item_id"].nunique()),
                                                                random_state=0)
        caps = caps[caps["image_item_id"].isin(keep)].reset_index(drop=True)
    images = ds.load_images(item_ids=caps["image_item_id"].unique().tolist())
    print(f"baseline: fitting on {len(caps)} train pairs of the demo set -> {out}", flush=True)
    bl.MappedBaseline.fit(caps, images, progress=True, image_backbone=ds.image_backbone).save(out)
    return out


def plan_costs(plan_jobs: Sequence[jobs.Job], cfg: SuiteConfig) -> jobs.UnitCosts:
    """Unit costs for --plan: from earlier runs' JSON; missing model rates measured now on a small sample."""
    costs = jobs.UnitCosts.load(unit_costs_path(cfg))
    missing = set(costs.missing(plan_jobs))
    if missing and model_feature_dim(cfg.models.first) is not None:

        for unit, per_s in latency.sample_rates(cfg.models.first, cfg.batch_size, cfg.threads,
                                                quantize=cfg.quantize).items():
            if unit in missing:
                what = "; generation + validation, no writes" if unit == "stage_records" else ""
                costs.set(unit, per_s, f"measured now on a small in-process sample ({cfg.models.first}, batch "
                                       f"{cfg.batch_size}, --quantize {cfg.quantize}{what})")
        costs.save(unit_costs_path(cfg))
    return costs


@plan_command(SuiteConfig, ignore_unknown_options=True, allow_extra_args=True)
@click.pass_context
def main(ctx, **values):
    """Run one benchmark suite through the pipeline jobs and write <output>/<suite>.csv plus a summary.
    Unknown --flags go to every pipeline job (--runner, --dask_client_address, Dataflow options)."""
    beam_args = tuple(ctx.args)
    # one line for what the user can mend: a wrong command line (exit 2), bad input, a failed job (exit 1)
    with cli_errors(jobs.JobFailed):
        check_beam_args(beam_args)
        try:  # before any model is trained for the suite
            cli = plan_from_cli(SuiteConfig, values)
        except ValueError as exc:
            raise UsageFault(str(exc)) from None
        _check_anns(cli.ann)
        run_seeds(cli, beam_args)


def run_seeds(cli: SuiteConfig, beam_args: tuple[str, ...]) -> None:
    """The suite once per model seed (--model-seed), then with several seeds their summary, <suite>_seeds.csv."""
    if cli.workdir:
        os.environ["RR_WORKDIR"] = os.path.abspath(cli.workdir)
    seeds, output = cli.model_seeds, cli.output
    rows_by_seed, hits_by_seed = {}, {}
    for seed in seeds:
        t_start = time.time()
        models = resolve_models(cli.join_dir, cli.be_dir, cli.ce_dir, cli.no_sep, cli.suite, cli.plan_only,
                                beam_args, cli.recipe, seed)
        cfg = replace(cli, workdir=recipes.workdir(), models=models,
                      feature_dim=model_feature_dim(models.first) or _demo_feature_dim(),
                      model_regions=_model_regions(models, cli.recipe))
        # which cached models the rows came from (none when every model folder was given)
        trained = not (cli.join_dir and (cli.no_sep or cli.suite in JOIN_BY_DEFAULT or (cli.be_dir and cli.ce_dir)))
        opts = RunOptions(output=output if len(seeds) == 1 else os.path.join(output, f"seed{seed}"),
                          plan_only=cli.plan_only, beam_args=beam_args, recipe=_recipe_label(cli) if trained else "",
                          model_seed=seed if trained else "", preload=not cli.fresh_interpreters)
        rows_by_seed[seed], hits_by_seed[seed] = run_suite(cfg, opts, t_start) or (None, None)
    if len(seeds) > 1 and all(rows_by_seed.values()):
        summary = report.seed_summary(rows_by_seed, hits_by_seed)
        path = report.write_csv(os.path.join(output, f"{cli.suite}_seeds.csv"), summary, report.SEED_COLUMNS)
        print(report.seed_summary_table(summary, f"{cli.suite}: mean ± std over model seeds "
                                                 f"{','.join(map(str, seeds))}; [95 % interval of the seed mean]"))
        print(f"wrote {path}")


def run_suite(cfg: SuiteConfig, opts: RunOptions,
              t_start: float) -> Optional[tuple[list[dict], list[Optional[RowHits]]]]:
    """One suite run for one model set: its jobs, <output>/<suite>.csv, the jobs CSV, plots and the summary.
    Returns the rows and, per row, the per-query hits behind it (None without a plan run)."""
    suite, output, beam_args = cfg.suite, opts.output, opts.beam_args
    if not opts.plan_only:
        os.makedirs(output, exist_ok=True)
    if suite == "latency":
        rows, results = run_latency_suite(cfg, opts)
        hits = [None] * len(rows or [])
    else:
        plan = suites.plan_suite(cfg, baseline_model(cfg, opts.plan_only) if suite == "baseline" else None)
        if opts.plan_only:
            print(f"{suite}: {len(plan.jobs)} jobs, {len(plan.rows)} row groups")
            print(jobs.format_plan(plan.jobs, beam_args, plan_costs(plan.jobs, cfg)))
            return None
        env = {**report.environment(cfg.device, cfg.batch_size, cfg.threads), "quantize": cfg.quantize,
               "recipe": opts.recipe,
               "model_seed": opts.model_seed}
        # the memory suite's figure is each job's RSS: fresh interpreters, without the preloaded modules
        rows, results, hits = execute(plan, beam_args, jobs.UnitCosts.load(unit_costs_path(cfg)),
                                      unit_costs_path(cfg), env, preload=opts.preload and suite != "memory")
    if rows is None:
        return None
    path = report.write_csv(os.path.join(output, f"{suite}.csv"), rows)
    if suite in report.SIZE_SUITES:  # R@1 vs collection size across whichever suite CSVs exist
        report.plot_recall_vs_size_from(output)
    where = {**report.environment(cfg.device, cfg.batch_size, cfg.threads), "quantize": cfg.quantize}
    report.write_jobs_csv(os.path.join(output, f"{suite}_jobs.csv"), job_rows(results, beam_args, where))
    if suite == "memory":  # from the CSVs just written: `python -m benchmarks.report memory-table` prints it again
        print(report.memory_table_from(output))
    if suite == "k_ablation":
        report.plot_recall_vs_k(rows, os.path.join(output, "k_ablation.png"))
    print(report.summary_table(rows, f"{suite} ({time.time() - t_start:.0f}s)"))
    print(f"wrote {path}")
    return rows, hits


def _model_regions(models: Models, recipe: str) -> int:
    """The most regions per image any of the suite's models reads: from their folders, or for a recipe model not
    trained yet (--plan) the recipe's max_regions."""
    found = [model_max_regions(folder) for _, be, ce in models.families() for folder in (be, ce)]
    return max(n if n is not None else recipes.RECIPES[recipe].max_regions for n in found)


def _demo_feature_dim() -> int:

    return load_manifest(recipes.DEMO_MANIFEST).feature_dim


def _check_anns(kinds: Sequence[str]) -> None:
    """--ann "IVF-Flat,HNSW32": each kind checked (benchmarks.suites.per_query.ann_factory)."""
    for k in kinds:
        try:
            per_query.ann_factory(k, 1000)
        except ValueError as exc:
            raise UsageFault(f"--ann: {exc}") from None


def run_latency_suite(cfg: SuiteConfig, opts: RunOptions):
    """Per-query latency in-process; Table 4 (total evaluation time) through the pipeline jobs."""
    lcfg = latency.quick_config() if cfg.quick else latency.LatencyConfig()
    lcfg = latency.LatencyConfig(**{**lcfg.__dict__, "batch_size": cfg.batch_size, "threads": cfg.threads,
                                    "anns": cfg.ann, "hnsw_max_n": cfg.hnsw_max_n,
                                    "eval_budget_s": cfg.eval_budget})
    if opts.plan_only:
        if model_feature_dim(cfg.models.join) is None:
            raise ValueError(f"latency --plan measures unit costs with the JOIN model; {cfg.models.join} does not "
                             f"exist yet (pass --model, or run the demo first)")
        plan = latency.plan_eval_time(cfg, lcfg, latency.measured_units(cfg.models.join, lcfg))
        print(f"latency: per-query rows run in-process; Table 4 jobs within --eval-budget {lcfg.eval_budget_s:.0f}s:")
        print(jobs.format_plan(plan.jobs, opts.beam_args, plan_costs(plan.jobs, cfg)))
        return None, []
    rows, results = latency.run_latency(cfg, lcfg, opts.beam_args, log=lambda m: print(
        f"[{time.strftime('%H:%M:%S')}] {m}", flush=True))
    report.plot_latency([r for r in rows if str(r.get("collection", "")).startswith("per_query")],
                        os.path.join(opts.output, "latency.png"))
    report.plot_roofline(rows, os.path.join(opts.output, "roofline.png"))
    return rows, results


if __name__ == "__main__":
    main()

"""The default ranking (AUTO) of finished suite runs, chosen again by today's ``choose_fusion`` from their stored
scores: no job reruns, so a change of the choice rule is measured on the very runs the published tables came from.

    python -m benchmarks.probes.fusion_rule --work runs/work --output results/fusion_rule.csv

``--work`` is a suite's work folder (``benchmarks.run``'s ``RR_WORKDIR``); every model pair there that has ranked
both a test collection and the dev pool of the same size is evaluated. The suites choose each test row's fusion on
the dev queries ranked against a pool of the test row's size (``benchmarks.suites.planner``, DEV_POOL): the 5k rows on
``distractors4500x5``, the 1k folds and the Flickr-like 1k on ``distractors500x5``, the 20k rows on
``distractors19500x2``, the 100k row (scale_100k) on ``distractors99500x5``. Per (model, test row), three
rankings, each with its R@1 per direction and the paired 95 % bootstrap interval of its difference to EMB: EMB
itself, the ``previous`` rule's choice (CHOICE_CRITERION without the noise check: pure CO whenever it ranks first
on dev) and ``today``'s (``choose_fusion``); then per (family, test
row, rule) the mean over the model seeds of that difference with its Student t interval over seeds
(``stats.seed_mean_interval``). Models: ``bench-models/seed<N>`` of the work folder, float32 rankings only.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import click
import numpy as np

from benchmarks.report.schema import environment, write_csv
from benchmarks.suites.planner import model_key
from retrieval_core.cli import CheckedPlan, option, plan_command, plan_from_cli
from retrieval_core.evaluation.metrics import DIRECTIONS
from retrieval_core.evaluation.runs import LoadedRun, choose_fusion
from retrieval_core.evaluation.stats import Bootstrap, difference_intervals, fold_hits, seed_mean_interval

#: Test rows: (name, runs folder under bench/runs, subset glob, collection, dev pool the suites choose on).
ROWS = (
    ("coco5k", "synthetic_coco5k", "all-*", None, "synthetic_dev_pool-distractors4500x5"),
    ("coco5k/1k", "synthetic_coco5k", "fold*", None, "synthetic_dev_pool-distractors500x5"),
    ("f30k1k (out of domain)", "synthetic_f30k1k", "all-*", None, "synthetic_dev_pool-distractors500x5"),
    ("coco5k+20k", "synthetic_distractor20k", "all-synthetic_coco5k-*", "synthetic_coco5k",
     "synthetic_dev_pool-distractors19500x2"),
    ("f30k1k+20k (out of domain)", "synthetic_distractor20k", "all-synthetic_f30k1k-*", "synthetic_f30k1k",
     "synthetic_dev_pool-distractors19500x2"),
    ("100k", "synthetic_100k", "all-*", None, "synthetic_dev_pool-distractors99500x5"),
)
RUN = "co-k20"  # the CO k=20 run whose stored scores every row of the suites derives from
#: The CSV's columns (report.COLUMN_DOCS says what each holds).
COLUMNS = ("collection", "model", "model_seed", "rule", "fusion", "direction", "R@1", "against", "delta_R@1",
           "delta_R@1_lo", "delta_R@1_hi", "interval", "queries", "co_lead", "device", "cpu_model", "threads", "torch",
           "faiss", "transformers", "commit", "date", "rankings")


def model_seeds(work: str) -> dict[str, tuple[str, int]]:
    """The suites' folder key of every bench model of ``work`` (``planner.model_key`` of
    ``bench-models/seed<N>/<join|sep_be>/best``) -> (family, seed)."""
    out = {}
    for folder in glob.glob(os.path.join(work, "bench-models", "seed*", "*", "best")):
        role = os.path.basename(os.path.dirname(folder))
        seed = int(os.path.basename(os.path.dirname(os.path.dirname(folder)))[len("seed"):])
        if role in ("join", "sep_be"):
            out[model_key(folder)] = ("JOIN" if role == "join" else "SEP", seed)
    return out


def evaluate_pairs(work: str, boot: Bootstrap = Bootstrap()) -> list[dict]:
    """One row per (model pair, test row, rule, direction): its R@1 and its paired difference to EMB."""
    runs, staged = os.path.join(work, "bench", "runs"), os.path.join(work, "bench", "staged")
    seeds, out = model_seeds(work), []
    for name, folder, subset, collection, dev_pool in ROWS:
        dev_staged = os.path.join(staged, dev_pool)
        for pair_dir in sorted(glob.glob(os.path.join(runs, dev_pool, "dev-*", "*"))):
            family, be_key = os.path.basename(pair_dir).split("-", 1)
            known = [(k, v) for k, v in seeds.items() if be_key.startswith(k + "-")]
            if len(known) != 1 or be_key[len(known[0][0]) + 1:].startswith("bf16"):
                continue  # not a float32 bench model of this work folder (a bf16 serving, a model from elsewhere)
            seed = known[0][1][1]
            tests = sorted(glob.glob(os.path.join(runs, folder, subset, os.path.basename(pair_dir), RUN)))
            dev_run = os.path.join(pair_dir, RUN)
            if not tests or not os.path.isdir(dev_run):
                continue
            choice = choose_fusion(dev_run, dev_staged, 20)
            # the rules differ only where CO ranked first on dev (co_lead is set): the previous rule then took CO
            previous = ("co", "co", None) if choice["co_lead"] is not None else \
                (choice["label"], choice["mode"], choice["lam"])
            rankings = {"EMB": ("emb", "emb", None), "previous": previous,
                        "today": (choice["label"], choice["mode"], choice["lam"])}
            loaded = [LoadedRun.read(t, os.path.join(staged, folder), collection) for t in tests]
            emb = fold_hits([r.hits(20, "emb") for r in loaded])
            lead = choice["co_lead"]
            for rule, (label, mode, lam) in rankings.items():
                hits = fold_hits([r.hits(20, mode, lam) for r in loaded])
                delta = difference_intervals(hits, emb, boot, ks=(1,))
                for d in DIRECTIONS:
                    iv = delta[f"{d}_R@1"]
                    r1 = float(np.mean([h.recall(1) for h in hits[d]]))  # the mean over folds
                    out.append({
                        "collection": name, "model": family, "model_seed": seed, "rule": rule, "fusion": label,
                        "direction": d, "R@1": round(r1, 4),
                        "against": "emb", "delta_R@1": round(iv.estimate, 4), "delta_R@1_lo": round(iv.lo, 4),
                        "delta_R@1_hi": round(iv.hi, 4), "interval": boot.label,
                        "queries": sum(len(h.query_ids) for h in hits[d]),
                        "co_lead": "" if lead is None else " ".join(
                            f"{k[:3]} {v[0]:+.1f} [{v[1]:+.1f}, {v[2]:+.1f}]" for k, v in lead.items()),
                        "rankings": ";".join(tests + [dev_run])})
    return out


def seed_means(rows: list[dict]) -> list[dict]:
    """Per (test row, family, rule, direction) over >= 2 seeds: the mean difference to EMB, t interval over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["collection"], r["model"], r["rule"], r["direction"]), []).append(r)
    out = []
    for (name, family, rule, d), g in groups.items():
        g = sorted(g, key=lambda r: r["model_seed"])
        if len(g) < 2:
            continue
        iv = seed_mean_interval([r["delta_R@1"] for r in g])
        out.append({"collection": name, "model": family, "rule": rule, "direction": d,
                    "model_seed": ",".join(str(r["model_seed"]) for r in g),
                    "fusion": ";".join(r["fusion"] for r in g), "R@1": round(float(np.mean([r["R@1"] for r in g])), 4),
                    "against": "emb", "delta_R@1": round(iv.estimate, 4), "delta_R@1_lo": round(iv.lo, 4),
                    "delta_R@1_hi": round(iv.hi, 4), "queries": g[0]["queries"],
                    "interval": f"95 % Student t interval of the mean over the {len(g)} seeds' differences",
                    "rankings": ""})
    return out


@dataclass(frozen=True)
class FusionRulePlan(CheckedPlan):
    """The re-evaluation's options, each a typed field."""
    work: str = option(help="A suite's work folder (RR_WORKDIR of benchmarks.run).")
    output: str = option(help="The CSV to write.")


@plan_command(FusionRulePlan)
def main(**values) -> None:
    """AUTO of finished suite runs chosen again by today's rule, beside the previous rule's choice and EMB."""
    try:
        plan = plan_from_cli(FusionRulePlan, values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not os.path.isdir(os.path.join(plan.work, "bench", "runs")):
        raise click.UsageError(f"--work {plan.work}: no bench/runs folder (not a suite's work folder)")
    rows = evaluate_pairs(plan.work)
    if not rows:
        raise click.ClickException(f"{plan.work}: no bench model ranked both a test row and its dev pool ({RUN})")
    env = {c: v for c, v in environment(threads=1).items() if c in COLUMNS}
    table = [{**r, **env} for r in rows + seed_means(rows)]
    write_csv(plan.output, table, COLUMNS)
    for r in table:
        click.echo(f"{r['collection']:<27} {r['model']} {str(r['model_seed']):<6} {r['rule']:<9} "
                   f"{r['fusion'][:40]:<40} "
                   f"{r['direction']} R@1 {r['R@1']:6.2f}  minus EMB {r['delta_R@1']:+.2f} "
                   f"[{r['delta_R@1_lo']:+.2f}, {r['delta_R@1_hi']:+.2f}]")


if __name__ == "__main__":
    main()

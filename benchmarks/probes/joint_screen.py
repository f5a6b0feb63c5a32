"""Screen training recipes by what the reranker is for: each model pair's R@1 on the dev split, BE alone and with
its CE reranking the BE's top k, and its CE's binding accuracy.

    python -m benchmarks.probes.joint_screen --staged runs/demo/staged --manifest demo \\
        --pair join=runs/screen/join/best --pair sep=runs/demo/model_sep_be/best:runs/demo/model_sep_ce/best \\
        --queries 500 --k 20 --output results/joint_screen.csv

``--pair NAME=BE[:CE]`` (a JOIN model is its own CE). Every pair ranks the same seeded sample of ``--queries`` dev
captions (t2i) and dev images (i2t) (``retrieval_core.training.dev_eval.reranked_recall``); the binding probe
(``benchmarks.probes.family_probe``, pairwise, binding) scores the split's captions with each CE. Rows per pair and
direction: EMB and CO R@1, CO minus EMB and CO minus the first pair's CO, each difference with its paired 95 %
bootstrap interval over the queries; the CE's pairwise binding accuracy. Appends to ``--output`` (a row per pair
and direction, with ``--label`` and the training seed read from the model), so screens of several runs share
one CSV.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import time
from typing import Optional

import click
import numpy as np

from benchmarks.probes.family_probe import ProbeInputs, probe
from benchmarks.report.schema import environment
from retrieval_core.cli import (
    apply_device_and_threads,
    cli_errors,
    count_option,
    device_option,
    k_option,
    option,
    plan_command,
    plan_from_cli,
    threads_option,
)
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.evaluation.stats import Bootstrap, percentile_interval, resample_sums
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.training.dev_eval import reranked_recall
from retrieval_core.training.train_data import load_split

COLUMNS = ("label", "pair", "be_model", "ce_model", "train_seed", "split", "queries", "k", "direction", "emb_R@1",
           "co_R@1", "co_minus_emb", "co_minus_emb_lo", "co_minus_emb_hi", "co_minus_first", "co_minus_first_lo",
           "co_minus_first_hi", "binding_pairwise", "binding_lo", "binding_hi", "be_grad_trunk", "ce_grad_trunk",
           "be_loss_end", "ce_loss_end", "train_seconds", "bootstrap", "date", "commit", "cpu_model", "device",
           "threads", "torch", "seconds")
#: Steps at the end of a run whose mean loss is its ``<objective>_loss_end``.
LAST_STEPS = 40


def logged_seconds(records: list[dict]) -> float:
    """A training's own time from its log: its steps' seconds (a step replayed by a resumed run counted once, as
    last logged), its minings' and its dev evaluations' - what a run of the recipe costs, without start-up."""
    steps = {(r["step"], r["objective"]): r["seconds"] for r in records if "objective" in r and "seconds" in r}
    return (sum(steps.values()) + sum(r["mined"]["seconds"] for r in records if "mined" in r)
            + sum(r["eval"]["seconds"] for r in records if "eval" in r))


def training_summary(be_dir: str, ce_dir: Optional[str]) -> dict:
    """From the training logs beside the models (``<run>/best`` -> ``<run>/train_log.jsonl``): per objective, the
    mean trunk gradient norm (before clipping) over the steps it ran while the CE objective ran too (a JOIN's CE
    phase; a SEP model's whole run), and the mean loss of its last LAST_STEPS steps; the pair's training seconds
    (``logged_seconds`` of its one run, or of both for a SEP pair). Blank where the log lacks them (a run logged
    before the trainer recorded gradient norms)."""
    out, seconds, logs = {}, {}, set()
    for objective, folder in (("be", be_dir), ("ce", ce_dir or be_dir)):
        path = os.path.join(os.path.dirname(os.path.abspath(folder.rstrip("/"))), "train_log.jsonl")
        logs.add(path)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            records = [json.loads(line) for line in f]
        seconds[path] = logged_seconds(records)
        steps = [r for r in records if "objective" in r]
        ce_steps = {r["step"] for r in steps if r.get("objective") == "ce"}
        mine = [r for r in steps if r.get("objective") == objective]
        during = [r for r in mine if r["step"] in ce_steps or not ce_steps]
        if during and all("grad_norm_trunk" in r for r in during):
            out[f"{objective}_grad_trunk"] = round(float(np.mean([r["grad_norm_trunk"] for r in during])), 3)
        if mine:
            out[f"{objective}_loss_end"] = round(float(np.mean([r["loss"] for r in mine[-LAST_STEPS:]])), 4)
    if seconds.keys() == logs:  # every run of the pair logged (one run: a JOIN, or one folder named twice)
        out["train_seconds"] = round(sum(seconds.values()), 1)
    return out


def paired(a: np.ndarray, b: np.ndarray, boot: Bootstrap) -> tuple[float, float, float]:
    """Mean of a - b (percent points) and its percentile interval, the queries resampled."""
    d = (a.astype(np.float64) - b.astype(np.float64)) * 100.0
    sums = resample_sums(d[:, None], boot.resamples, np.random.default_rng(boot.seed))[:, 0]  # the suites' resampler
    iv = percentile_interval(float(d.mean()), sums / len(d), boot.level)
    return round(iv.estimate, 2), round(iv.lo, 2), round(iv.hi, 2)


def _pair(value: str) -> tuple[str, str, Optional[str]]:
    name, sep, dirs = value.partition("=")
    if not sep or not name or not dirs:
        raise click.BadParameter(f"{value!r}: expected NAME=BE[:CE]")
    be, _, ce = dirs.partition(":")
    return name, be, ce or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScreenPlan(ProbeInputs):
    pair: tuple[str, ...] = option(multiple=True, help="NAME=BE[:CE]: a model (JOIN: its own CE) or a SEP pair; the "
                                                       "first is the reference of co_minus_first.")
    output: str = option(help="CSV to append the rows to.")
    label: str = option("", help="What this screen compares (a column of every row).")
    split: str = option("dev")
    queries: int = count_option(500, help="Seeded sample of dev captions (t2i) and of dev images (i2t).")
    k: int = k_option(20, help="The BE's top k the CE reranks.")
    binding_captions: int = count_option(1000, help="Seeded sample of captions of the binding probe (0: skip it).")
    device: str = device_option()
    threads: Optional[int] = threads_option()


@plan_command(ScreenPlan)
def main(**values) -> None:
    """EMB and CO R@1 on the dev split and the CE's binding accuracy, per model pair, paired against the first."""
    with cli_errors(KeyError):
        plan = plan_from_cli(ScreenPlan, values)
        pairs = [_pair(v) for v in plan.pair]
        apply_device_and_threads(plan.device, plan.threads)
        staged = StagedDataset(plan.staged)
        m = load_manifest(plan.manifest)
        spec = m.synthetic_spec(plan.collection or m.benchmark.get("query_collection") or next(iter(m.collections)))
        dev = load_split(staged, plan.split)
        env, boot = environment(plan.device, threads=plan.threads), Bootstrap()
        rows, first = [], None
        for name, be_dir, ce_dir in pairs:
            t0 = time.perf_counter()
            be = VLRetrievalModel.load(be_dir, device=plan.device)
            ce = VLRetrievalModel.load(ce_dir, device=plan.device) if ce_dir else be
            res = reranked_recall(be, ce, dev, plan.queries, plan.k, plan.device)
            first = first or res
            binding = {}
            if plan.binding_captions:
                probed = probe(staged, spec, be, ce, plan.split, plan.binding_captions, device=plan.device)
                sel = probed[(probed["table"] == "pairwise") & (probed["head"] == "CE")
                             & (probed["change"] == "binding")].iloc[0]
                binding = {"binding_pairwise": round(float(sel["accuracy"]), 1),
                           "binding_lo": round(float(sel["accuracy_lo"]), 1),
                           "binding_hi": round(float(sel["accuracy_hi"]), 1)}
            seed = (be.cfg.provenance.get("training") or {}).get("seed", "")
            for d in ("t2i", "i2t"):
                lift = paired(res[f"co_{d}_hits"], res[f"emb_{d}_hits"], boot)
                vs_first = paired(res[f"co_{d}_hits"], first[f"co_{d}_hits"], boot)
                rows.append({"label": plan.label, "pair": name, "be_model": be_dir, "ce_model": ce_dir or be_dir,
                             "train_seed": seed, "split": plan.split, "queries": len(res[f"co_{d}_hits"]),
                             "k": plan.k, "direction": d, "emb_R@1": round(res[f"emb_{d}_R@1"], 2),
                             "co_R@1": round(res[f"co_{d}_R@1"], 2), "co_minus_emb": lift[0],
                             "co_minus_emb_lo": lift[1], "co_minus_emb_hi": lift[2], "co_minus_first": vs_first[0],
                             "co_minus_first_lo": vs_first[1], "co_minus_first_hi": vs_first[2], **binding,
                             **training_summary(be_dir, ce_dir),
                             "bootstrap": boot.label + " (paired)", **env,
                             "seconds": round(time.perf_counter() - t0, 1)})
                r = rows[-1]
                click.echo(f"{name:>12} {d}: EMB {r['emb_R@1']:.1f} -> CO {r['co_R@1']:.1f} "
                           f"({r['co_minus_emb']:+.1f} [{r['co_minus_emb_lo']:+.1f}, {r['co_minus_emb_hi']:+.1f}]); "
                           f"CO minus {pairs[0][0]} {r['co_minus_first']:+.1f} [{r['co_minus_first_lo']:+.1f}, "
                           f"{r['co_minus_first_hi']:+.1f}]; binding {r.get('binding_pairwise', '-')}")
    new = not os.path.exists(plan.output)
    os.makedirs(os.path.dirname(os.path.abspath(plan.output)), exist_ok=True)
    with open(plan.output, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    click.echo(f"appended {len(rows)} rows to {plan.output}")


if __name__ == "__main__":
    main()

"""Benchmark suites: ``python -m benchmarks.run --suite NAME``.

Suites (paper tables in brackets):
  standard        synthetic_coco5k 5k + 1k (mean over 5 folds) and synthetic_f30k1k: EMB (SEP, JOIN),
                  SEP+CO, JOIN+CO, exhaustive CE within --ce-pair-budget                        [Table 1]
  distractor_20k  each task's queries/gold against pools enlarged with the other collections' images
                  and captions (synthetic_distractor20k)                                        [Table 5]
  scale_100k      synthetic_100k: 5k t2i queries against all 100,000 images, CO end to end      [Table 4]
  k_ablation      SEP+CO / JOIN+CO at k = 10, 20, 50 (synthetic_f30k1k)                        [Table 8]
  combination     pure CE vs ADD_λ / NORM_ADD_λ, λ in 0.1/0.5/0.9 (synthetic_f30k1k)            [Table 11]
  baseline        the training-free mapped baseline (fit on the demo train split) as an EMB row
  latency         per-query latency 1k..1M and total evaluation time 1k/5k/100k, vs the paper's code
                                                                                          [Tables 3, 4]
Writes <output>/<suite>.csv (+ rankings/ and PNG plots) and prints a summary table.

Models default to the demo assets (JOIN: pipelines.demo_assets.ensure_demo_assets; SEP:
ensure_sep_models), trained on first use. Synthetic manifests are staged on demand with
``python -m pipelines.stage`` into <workdir>/staged/<manifest>[-f<dim>][-quick] (reused when complete);
when the model's feature_dim differs from a synthetic manifest's, the manifest is staged at the model's
(``--set feature_dim=``): the synthetic world's codebooks depend only on (world_seed, feature_dim). A manifest
with real (file) features and another feature_dim is refused with both dimensions named.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

import click
import pandas as pd

# Default query caps per direction: a CE pair costs ~10-25 ms on 2 CPU cores with the halved MiniLM, so the
# full protocol (COCO 5k CO: ~550k pairs per model) takes hours there. Pools are never cut; --max-queries 0
# runs every query (use it on a GPU).
DEFAULT_MAX_QUERIES = {"standard": 500, "distractor_20k": 500, "k_ablation": 500, "combination": 500,
                       "baseline": 0, "scale_100k": 0, "latency": 0}

SUITES = ("standard", "distractor_20k", "scale_100k", "k_ablation", "combination", "baseline", "latency")

# --quick: every collection shrunk to this many images (staged for real, through the same stage CLI).
QUICK_IMAGES = {"synthetic_coco5k": 100, "synthetic_f30k1k": 40, "synthetic_cc14k": 60, "synthetic_100k": 300}


def stage(manifest: str, workdir: str, feature_dim: Optional[int], quick: bool) -> str:
    """Staged dir of ``manifest`` (staged now unless a complete one exists)."""
    from retrieval_core.manifest import load_manifest

    m = load_manifest(manifest)
    sets = []
    suffix = ""
    if feature_dim and feature_dim != m.feature_dim:
        # Only generated features can be made at another dimension; restaging real features (read from files)
        # with --set feature_dim would reject every image as having the wrong width.
        real = sorted(name for name, c in m.collections.items() if c.images.format != "synthetic")
        if real:
            raise click.ClickException(
                f"manifest {m.name!r} has {m.feature_dim}-d region features (collection(s) {', '.join(real)} "
                f"read them from files), but the model expects {feature_dim}-d features; pass models trained on "
                f"{m.feature_dim}-d features (--model, --be-model, --ce-model)")
        sets.append(f"feature_dim={feature_dim}")
        suffix += f"-f{feature_dim}"
    if quick:
        for name in m.collections:
            n = QUICK_IMAGES.get(name, 50)
            sets += [f"{name}.images.num_images={n}", f"{name}.expected_images=null",
                     f"{name}.expected_captions=null"]
        suffix += "-quick"
    out = os.path.join(workdir, "staged", m.name + suffix)
    if os.path.exists(os.path.join(out, "summary.json")):
        return out
    args = [sys.executable, "-m", "pipelines.stage", "--manifest", manifest, "--output", out]
    for s in sets:
        args += ["--set", s]
    print("+ " + " ".join(args), flush=True)
    subprocess.run(args, check=True)
    return out


def tasks_for(suite: str, workdir: str, feature_dim: int, quick: bool, manifest: Optional[str]):
    from benchmarks.suites import COCO_1K_FOLDS, COCO_1K_SIZE, StagedSource, Task
    from retrieval_core.manifest import load_manifest

    def single(name, folds=0):
        m = load_manifest(name)
        src = StagedSource(stage(name, workdir, feature_dim, quick))
        q = m.benchmark.get("query_collection") or next(iter(m.collections))
        fold_size = QUICK_IMAGES.get(q, 50) // COCO_1K_FOLDS if quick else COCO_1K_SIZE
        return Task(m.name, src, q, m.benchmark.get("split", "test"), folds=folds, fold_size=fold_size)

    if manifest:  # one user-chosen manifest, its own benchmark block
        m = load_manifest(manifest)
        if suite == "distractor_20k" or m.benchmark.get("distractor_collections"):
            return _distractor_tasks(manifest, workdir, feature_dim, quick)
        return [single(manifest)]
    if suite == "standard":
        return [single("synthetic_coco5k", folds=COCO_1K_FOLDS), single("synthetic_f30k1k")]
    if suite == "distractor_20k":
        return _distractor_tasks("synthetic_distractor20k", workdir, feature_dim, quick)
    if suite == "scale_100k":
        return [single("synthetic_100k")]
    if suite in ("k_ablation", "combination"):
        return [single("synthetic_f30k1k")]
    if suite == "baseline":
        return [single("synthetic_coco5k"), single("synthetic_f30k1k")]
    raise click.UsageError(f"suite {suite!r} takes no tasks")


def _distractor_tasks(manifest, workdir, feature_dim, quick):
    """Each collection with captions of a COCO/Flickr kind is a task in turn; all others are distractors
    (the paper rotates COCO and Flickr30k; CC dev only ever serves as distractors)."""
    from benchmarks.suites import StagedSource, Task
    from retrieval_core.manifest import load_manifest

    m = load_manifest(manifest)
    src = StagedSource(stage(manifest, workdir, feature_dim, quick))
    split = m.benchmark.get("split", "test")
    first = m.benchmark.get("query_collection")
    names = list(m.collections)
    order = [first] + [n for n in names if n != first and "cc" not in n.lower()]
    return [Task(f"{q}+distractors", src, q, split, distractors=tuple(n for n in names if n != q),
                 distractor_split=split) for q in order]


def _baseline_ref(ctx, workdir: str, staged_demo: str, be_dir: Optional[str], quick: bool):
    """Fit (or load the cached) training-free mapped baseline on the demo train split."""
    from benchmarks.engine import ModelRef
    from retrieval_core import baseline as bl

    out = os.path.join(workdir, "baseline" + ("-quick" if quick else ""))
    if bl.MappedBaseline.is_baseline_dir(out):
        model = bl.MappedBaseline.load(out)
        ctx.log(f"baseline: loaded {out}")
    else:
        from retrieval_core.store import StagedDataset

        ds = StagedDataset(staged_demo)
        caps = ds.captions(split="train")
        if quick:  # a seeded subset of training images keeps the smoke run short
            keep = pd.Series(caps["image_item_id"].unique()).sample(n=min(300, caps["image_item_id"].nunique()),
                                                                    random_state=0)
            caps = caps[caps["image_item_id"].isin(keep)].reset_index(drop=True)
        images = ds.load_images(item_ids=caps["image_item_id"].unique().tolist())
        ctx.log(f"baseline: fitting ({len(caps)} train pairs of the demo set) -> {out}")
        model = bl.MappedBaseline.fit(caps, images, progress=True)
        model.save(out)
    label = f"MappedBaseline-{model.method}"
    return ModelRef(model, os.path.abspath(out), label), f"training-free; fit on the demo train split ({out})"


@click.command()
@click.option("--suite", type=click.Choice(SUITES), required=True, help="Which benchmark suite to run.")
@click.option("--manifest", default=None, help="Run the suite on this manifest instead of its default ones.")
@click.option("--model", "join_dir", default=None, help="JOIN model folder [demo JOIN model].")
@click.option("--be-model", "be_dir", default=None, help="SEP bi-encoder model folder [demo SEP BE model].")
@click.option("--ce-model", "ce_dir", default=None, help="SEP cross-encoder model folder [demo SEP CE model].")
@click.option("--no-sep", is_flag=True, help="Skip the SEP rows (do not train the SEP demo models).")
@click.option("--output", default="results", show_default=True, help="Folder for <suite>.csv, rankings, plots.")
@click.option("--workdir", default=None, help="Staged data and cached models [$RR_WORKDIR or ./runs].")
@click.option("--quick", is_flag=True, help="Tiny sizes everywhere: a smoke run in a few minutes.")
@click.option("--batch-size", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--threads", default=None, type=click.IntRange(min=1), help="torch + faiss threads [torch default].")
@click.option("--ce-pair-budget", default=200_000, show_default=True, type=click.IntRange(min=0),
              help="Exhaustive CE rows only below this many (query, item) pairs; otherwise skipped with a note.")
@click.option("--max-queries", default=None, type=click.IntRange(min=0),
              help="Seeded sample of at most this many queries per direction, pools unchanged (noted in every "
                   "row); 0 = the full protocol. Default: per suite, sized for the 2-core CPU budgets "
                   "(DEFAULT_MAX_QUERIES).")
@click.option("--index-factory", default="Flat", show_default=True, help="FAISS factory for the BE search.")
@click.option("--ann", default="IVF", show_default=True, help="latency: ANN index, IVF or HNSW32.")
@click.option("--eval-budget", default=600.0, show_default=True,
              help="latency: seconds of end-to-end Table 4 runs; larger settings are extrapolated.")
def main(suite, manifest, join_dir, be_dir, ce_dir, no_sep, output, workdir, quick, batch_size, device, threads,
         ce_pair_budget, max_queries, index_factory, ann, eval_budget):
    """Run one benchmark suite and write <output>/<suite>.csv plus a terminal summary."""
    from benchmarks import report, suites
    from pipelines import demo_assets

    if workdir:
        os.environ["RR_WORKDIR"] = os.path.abspath(workdir)
    workdir = demo_assets.workdir()
    os.makedirs(output, exist_ok=True)
    report.set_threads(threads)
    t_start = time.time()

    staged_demo = None
    if join_dir is None:
        staged_demo, join_dir = demo_assets.ensure_demo_assets()
    if not no_sep and suite not in ("latency",) and (be_dir is None or ce_dir is None):
        staged_demo = staged_demo or demo_assets.ensure_staged()
        d_be, d_ce = demo_assets.ensure_sep_models(staged_demo)
        be_dir, ce_dir = be_dir or d_be, ce_dir or d_ce
    models = suites.ModelSet(join_dir, None if no_sep else be_dir, None if no_sep else ce_dir, device=device)
    if max_queries is None:
        max_queries = DEFAULT_MAX_QUERIES[suite]
    ctx = suites.SuiteContext(output=output, models=models, batch_size=batch_size, device=device,
                              ce_pair_budget=ce_pair_budget, max_queries=max_queries or None, quick=quick,
                              index_factory=index_factory)
    feature_dim = models.ref("join").model.feature_dim

    if suite == "latency":
        from benchmarks import latency

        cfg = latency.quick_config() if quick else latency.LatencyConfig()
        cfg.batch_size, cfg.threads, cfg.ann, cfg.eval_budget_s = batch_size, threads, ann, eval_budget
        rows = latency.run_latency(models.ref("join").model, cfg, ctx.env(), log=ctx.log)
        report.plot_latency([r for r in rows if r.get("collection", "").startswith("per_query")],
                            os.path.join(output, "latency.png"))
    else:
        tasks = tasks_for(suite, workdir, feature_dim, quick, manifest)
        if suite == "standard":
            rows = suites.standard(ctx, tasks)
        elif suite == "distractor_20k":
            rows = suites.distractor(ctx, tasks)
        elif suite == "scale_100k":
            rows = suites.scale(ctx, tasks[0], num_queries=50 if quick else 5000)
        elif suite == "k_ablation":
            rows = suites.k_ablation(ctx, tasks)
            report.plot_recall_vs_k(rows, os.path.join(output, "k_ablation.png"))
        elif suite == "combination":
            rows = suites.combination(ctx, tasks)
        else:
            staged_demo = staged_demo or demo_assets.ensure_staged()
            ref, note = _baseline_ref(ctx, workdir, staged_demo, be_dir, quick)
            rows = suites.baseline(ctx, tasks, ref, note)
    path = report.write_csv(os.path.join(output, f"{suite}.csv"), rows)
    print(report.summary_table(rows, f"{suite} ({time.time() - t_start:.0f}s)"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Side-by-side speed comparisons behind docs/log/PERFORMANCE-2026-11.md (Beam-free: runs where
benchmarks.meters.roofline runs).

    python scripts/perf_ab.py prepare --images 1000 --output /tmp/ab                     # synthetic data, once
    python scripts/perf_ab.py versions --base OLD_CHECKOUT --backbone B --data /tmp/ab --threads 2 --reps 3
    python scripts/perf_ab.py variants --backbone B --data /tmp/ab --threads 2 --reps 5

``versions`` runs the same measurement (``rates``, scripts/perf_rates.py: CE pairs/s, BE captions/s and
images/s, and JOIN steps of the demo recipe) in fresh processes, alternately under OLD_CHECKOUT's code
(PYTHONPATH) and this checkout's, and prints each pair's ratio: the before/after of whole versions on one
machine. perf_rates uses only APIs both versions have. ``batches --thread-counts 1,2`` compares thread counts.
``variants`` compares, in one process on the same pre-collated batches, float32 with sdpa attention, with
eager attention, bf16 weights (--quantize bf16) and bf16 autocast (what --quantize bf16 ran before).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import click
import numpy as np
import torch
from perf_rates import load as _load
from perf_rates import measure_rates
from perf_rates import pairs as _pairs

from retrieval_core.cli import CONTEXT_SETTINGS, CheckedPlan, option, plan_from_cli, plan_options, threads_option

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, kw_only=True)  # kw_only: the required --output may follow
class PreparePlan:
    images: int = option(1000, type=int)
    output: str = option()


@dataclass(frozen=True, kw_only=True)  # kw_only: each command adds options with defaults after these
class ModelData:
    """--backbone (a write-backbone folder) and --data (a prepare folder): every measuring command takes both."""
    backbone: str = option(help="A `benchmarks.meters.roofline write-backbone` folder.")
    data: str = option(help="A `prepare` folder.")


@dataclass(frozen=True, kw_only=True)
class RatesPlan(ModelData):
    threads: int = threads_option(2)
    steps: int = option(6, type=int)


@dataclass(frozen=True, kw_only=True)
class VersionsPlan(ModelData):
    base: str = option(help="The older checkout (its retrieval_core goes on PYTHONPATH).")
    threads: int = threads_option(2)
    reps: int = option(3, type=int)


@dataclass(frozen=True, kw_only=True)
class VariantsPlan(ModelData):
    threads: int = threads_option(2)
    reps: int = option(5, type=int)


@dataclass(frozen=True, kw_only=True)
class BatchesPlan(ModelData, CheckedPlan):
    thread_counts: tuple[int, ...] = option((1, 2), sep=",", type=click.IntRange(min=1),
                                            help="Thread counts to compare.")
    batch_sizes: tuple[int, ...] = option((32, 64, 128, 256), sep=",", type=click.IntRange(min=1))
    reps: int = option(3, type=int)


@click.group(context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """Side-by-side speed comparisons (module docstring)."""


@main.command(context_settings=CONTEXT_SETTINGS)
@plan_options(PreparePlan)
def prepare(**values) -> None:
    """Synthetic demo-like images (1024-d features, 5 captions each) saved as arrays, for every process of a
    comparison."""
    from retrieval_core.data.synthetic.collection import synthetic_collection
    from retrieval_core.data.synthetic.spec import SyntheticSpec

    plan = plan_from_cli(PreparePlan, values)
    images, output = plan.images, plan.output
    table, caps = synthetic_collection(SyntheticSpec("perf_ab", images, seed=5, domain="coco", feature_dim=1024))
    os.makedirs(output, exist_ok=True)
    np.savez(os.path.join(output, "images.npz"), item_ids=table.item_ids, offsets=table.offsets,
             features=table.features, boxes=table.boxes)
    caps.to_json(os.path.join(output, "captions.json"), orient="records")
    click.echo(f"{len(table)} images, {len(caps)} captions -> {output}")


@main.command(context_settings=CONTEXT_SETTINGS)
@plan_options(RatesPlan)
def rates(**values) -> None:
    """One process's rates with whatever retrieval_core is importable (this checkout's, or PYTHONPATH's)."""
    plan = plan_from_cli(RatesPlan, values)
    click.echo(json.dumps(measure_rates(plan.backbone, plan.data, plan.threads, plan.steps)))


@main.command(context_settings=CONTEXT_SETTINGS)
@plan_options(VersionsPlan)
def versions(**values) -> None:
    """``rates`` in fresh processes, old and new checkout alternately; each pair's new/old ratio."""
    plan = plan_from_cli(VersionsPlan, values)
    base_dir, reps = plan.base, plan.reps
    settings = json.dumps({"backbone": os.path.abspath(plan.backbone), "data": os.path.abspath(plan.data),
                           "threads": plan.threads, "steps": RatesPlan.steps})
    here = os.path.dirname(HERE)
    runs = {"old": [], "new": []}
    for rep in range(reps):
        for label, path in (("old", os.path.abspath(base_dir)), ("new", here)):
            env = {**os.environ, "PYTHONPATH": path}
            # perf_rates, not this CLI: it runs under the older checkout's library, which may lack the CLI helpers
            res = subprocess.run([sys.executable, os.path.join(HERE, "perf_rates.py"), settings], env=env, cwd="/",
                                 capture_output=True, text=True)
            if res.returncode:
                raise click.ClickException(f"{label} run failed: {res.stderr[-2000:]}")
            runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
            click.echo(f"{label} {rep}: {runs[label][-1]}", err=True)
    keys = list(runs["new"][0])
    for key in keys:
        old = np.array([r[key] for r in runs["old"]])
        new = np.array([r[key] for r in runs["new"]])
        ratio = new / old if key.endswith("per_s") else old / new  # > 1: the new version is faster
        click.echo(f"{key:16s} old {np.median(old):9.3f}  new {np.median(new):9.3f}  speed-up per pair "
                   f"{' '.join(f'{x:.2f}' for x in ratio)}  median {np.median(ratio):.2f}")


@main.command(context_settings=CONTEXT_SETTINGS)
@plan_options(VariantsPlan)
def variants(**values) -> None:
    """float32 sdpa / eager, bf16 weights, bf16 autocast on the same batches, alternately in one process."""
    from retrieval_core.model.collate import collate_images, collate_pairs
    from retrieval_core.model.quantize import cpu_has_native_bf16, quantize_model

    plan = plan_from_cli(VariantsPlan, values)
    reps = plan.reps
    torch.set_num_threads(plan.threads)
    model, images, captions, _ = _load(plan.backbone, plan.data)
    model.eval()
    collate = model.text_collator()
    texts = captions["text"].tolist()[:1024]
    order = np.argsort(collate.token_lengths(texts), kind="stable")
    text_batches = [collate([texts[i] for i in order[a:a + 128]]) for a in range(0, len(texts), 128)]
    n_img = min(512, len(images))
    image_batches = [collate_images([images.regions(i) for i in range(a, min(a + 128, n_img))], model.cfg.max_regions)
                     for a in range(0, n_img, 128)]
    pt, pr = _pairs(captions, images, 512)
    order = np.lexsort((collate.token_lengths(pt), [min(len(f), model.cfg.max_regions) for f, _ in pr]))
    pair_batches = [collate_pairs(collate, [pt[i] for i in order[a:a + 128]], [pr[i] for i in order[a:a + 128]],
                                  model.cfg.max_regions) for a in range(0, 512, 128)]
    eager = copy.deepcopy(model)
    eager.set_attention("eager")
    served = {"fp32": (model, False), "fp32 eager": (eager, False)}
    if cpu_has_native_bf16():
        served.update({"bf16 weights": (quantize_model(copy.deepcopy(model), "bf16"), False),
                       "bf16 autocast": (model, True)})
    work = {"CE pairs": (pair_batches, "ce_logits", 512), "captions": (text_batches, "embed_text", len(texts)),
            "images": (image_batches, "embed_image", n_img)}
    rates = {(v, w): [] for v in served for w in work}
    for rep in range(reps + 1):
        for v, (m, autocast) in served.items():
            for w, (batches, fn, n) in work.items():
                with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    t0 = time.perf_counter()
                    for batch in batches:
                        getattr(m, fn)(batch)
                    if rep:  # the first round warms every variant up
                        rates[(v, w)].append(n / (time.perf_counter() - t0))
    for w in work:
        base = np.array(rates[("fp32", w)])
        click.echo(f"{w}: " + "; ".join(f"{v} {np.median(rates[(v, w)]):.1f}/s "
                                        f"({np.median(np.array(rates[(v, w)]) / base):.2f}x fp32)" for v in served))
    for w in work if "bf16 weights" in served else ():
        r = np.array(rates[("bf16 weights", w)]) / np.array(rates[("bf16 autocast", w)])
        click.echo(f"{w}: bf16 weights / bf16 autocast per round {' '.join(f'{x:.2f}' for x in r)}, median "
                   f"{np.median(r):.2f}")


@main.command(context_settings=CONTEXT_SETTINGS)
@plan_options(BatchesPlan)
def batches(**values) -> None:
    """CE pairs/s, captions/s and images/s of the model's own batched calls (float32) at each batch size and
    thread count, alternately in one process: what the batch-size and thread defaults rest on."""
    plan = plan_from_cli(BatchesPlan, values)
    reps = plan.reps
    model, images, captions, _ = _load(plan.backbone, plan.data)
    texts = captions["text"].tolist()[:1024]
    pt, pr = _pairs(captions, images, 512)
    some = images.take(range(min(512, len(images))))
    work = {"CE pairs": lambda bs: model.score(pt, pr, batch_size=bs), "captions": lambda bs: model.encode_text(
        texts, batch_size=bs), "images": lambda bs: model.encode_image(some, batch_size=bs)}
    sizes = {"CE pairs": len(pt), "captions": len(texts), "images": len(some)}
    settings = [(t, b) for t in plan.thread_counts for b in plan.batch_sizes]
    rates = {(s, w): [] for s in settings for w in work}
    for rep in range(reps + 1):
        for t, bs in settings:
            torch.set_num_threads(t)
            for w, fn in work.items():
                t0 = time.perf_counter()
                fn(bs)
                if rep:
                    rates[((t, bs), w)].append(sizes[w] / (time.perf_counter() - t0))
    for w in work:
        click.echo(f"{w}: " + "; ".join(f"{t} thr batch {bs}: {np.median(rates[((t, bs), w)]):.1f}/s"
                                        for t, bs in settings))


if __name__ == "__main__":
    main()

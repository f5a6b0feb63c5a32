"""Side-by-side speed comparisons behind docs/PERFORMANCE.md (Beam-free: runs where benchmarks.roofline runs).

    python scripts/perf_ab.py prepare --images 1000 --output /tmp/ab                     # synthetic data, once
    python scripts/perf_ab.py versions --base OLD_CHECKOUT --backbone B --data /tmp/ab --threads 2 --reps 3
    python scripts/perf_ab.py variants --backbone B --data /tmp/ab --threads 2 --reps 5

``versions`` runs the same measurement (``rates``: CE pairs/s, BE captions/s and images/s, and JOIN steps of the
demo recipe) in fresh processes, alternately under OLD_CHECKOUT's code (PYTHONPATH) and this checkout's, and
prints each pair's ratio: the before/after of whole versions on one machine. It uses only APIs both versions
have. ``variants`` compares, in one process on the same pre-collated batches, float32 with sdpa attention, with
eager attention, bf16 weights (--quantize bf16) and bf16 autocast (what --quantize bf16 ran before).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import click
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(backbone: str, data: str):
    import pandas as pd

    from retrieval_core.data.schema import ImageTable
    from retrieval_core.model.checkpoints import from_text_backbone

    spec = json.load(open(os.path.join(backbone, "recipes.json")))
    arrays = np.load(os.path.join(data, "images.npz"))
    images = ImageTable(arrays["item_ids"], arrays["offsets"], arrays["features"], arrays["boxes"], {})
    captions = pd.read_json(os.path.join(data, "captions.json"), orient="records")
    # the [CLS]-only CE head the documented A/B ratios were measured with (docs/PERFORMANCE.md)
    model = from_text_backbone(backbone, int(arrays["features"].shape[1]), max_regions=int(spec["max_regions"]),
                               ce_agreement="none")
    return model, images, captions, spec


def _pairs(captions, images, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    texts = captions["text"].tolist()
    return ([texts[i] for i in rng.integers(0, len(texts), n)],
            [images.regions(int(p)) for p in rng.integers(0, len(images), n)])


def _model_and_data(f):
    """--backbone (a write-backbone folder) and --data (a prepare folder): every measuring command takes both."""
    f = click.option("--data", required=True, help="A `prepare` folder.")(f)
    return click.option("--backbone", required=True, help="A `benchmarks.roofline write-backbone` folder.")(f)


@click.group()
def main() -> None:
    """Side-by-side speed comparisons (module docstring)."""


@main.command()
@click.option("--images", type=int, default=1000, show_default=True)
@click.option("--output", required=True)
def prepare(images, output) -> None:
    """Synthetic demo-like images (1024-d features, 5 captions each) saved as arrays, for every process of a
    comparison."""
    from retrieval_core.data.synthetic.collection import synthetic_collection
    from retrieval_core.data.synthetic.spec import SyntheticSpec

    table, caps = synthetic_collection(SyntheticSpec("perf_ab", images, seed=5, domain="coco", feature_dim=1024))
    os.makedirs(output, exist_ok=True)
    np.savez(os.path.join(output, "images.npz"), item_ids=table.item_ids, offsets=table.offsets,
             features=table.features, boxes=table.boxes)
    caps.to_json(os.path.join(output, "captions.json"), orient="records")
    click.echo(f"{len(table)} images, {len(caps)} captions -> {output}")


@main.command()
@_model_and_data
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--steps", type=int, default=6, show_default=True)
def rates(backbone, data, threads, steps) -> None:
    """One process's rates with whatever retrieval_core is importable (this checkout's, or PYTHONPATH's)."""
    from retrieval_core.training.config import TrainConfig
    from retrieval_core.training.train_data import TrainData
    from retrieval_core.training.trainer import Trainer

    torch.set_num_threads(threads)
    model, images, captions, spec = _load(backbone, data)
    texts = captions["text"].tolist()[:2048]
    pair_texts, pair_regions = _pairs(captions, images, 1024)
    model.encode_text(texts[:64], batch_size=128)  # warm-up: allocator, OpenMP pool, tokenizer
    model.score(pair_texts[:16], pair_regions[:16], batch_size=128)
    out = {}
    t0 = time.perf_counter()
    model.score(pair_texts, pair_regions, batch_size=128)
    out["ce_pairs_per_s"] = len(pair_texts) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    model.encode_text(texts, batch_size=128)
    out["captions_per_s"] = len(texts) / (time.perf_counter() - t0)
    some = images.take(range(min(512, len(images))))
    t0 = time.perf_counter()
    model.encode_image(some, batch_size=128)
    out["images_per_s"] = len(some) / (time.perf_counter() - t0)
    cfg = replace(TrainConfig(**spec["recipes"]["demo"]), progress=False, hard_negative_prob=0.0,
                  mined_negative_prob=0.0)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model, TrainData(captions, images), cfg, tmp)
        model.train()
        torch.use_deterministic_algorithms(True, warn_only=True)  # as Trainer.train sets it on CPU
        trainer.train_step(cfg.ce_start_step)
        secs = [[r["seconds"] for r in trainer.train_step(s)]
                for s in range(cfg.ce_start_step + 1, cfg.ce_start_step + 1 + steps)]
    out["be_step_s"], out["ce_step_s"] = (float(np.median([s[i] for s in secs])) for i in (0, 1))
    out["join_step_s"] = float(np.median([sum(s) for s in secs]))
    click.echo(json.dumps(out))


@main.command()
@click.option("--base", "base_dir", required=True, help="The older checkout (its retrieval_core goes on PYTHONPATH).")
@_model_and_data
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--reps", type=int, default=3, show_default=True)
def versions(base_dir, backbone, data, threads, reps) -> None:
    """``rates`` in fresh processes, old and new checkout alternately; each pair's new/old ratio."""
    here = os.path.dirname(HERE)
    runs = {"old": [], "new": []}
    for rep in range(reps):
        for label, path in (("old", os.path.abspath(base_dir)), ("new", here)):
            env = {**os.environ, "PYTHONPATH": path}
            args = ["rates", "--backbone", os.path.abspath(backbone), "--data", os.path.abspath(data), "--threads",
                    str(threads)]
            res = subprocess.run([sys.executable, os.path.join(HERE, "perf_ab.py"), *args], env=env, cwd="/",
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


@main.command()
@_model_and_data
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--reps", type=int, default=5, show_default=True)
def variants(backbone, data, threads, reps) -> None:
    """float32 sdpa / eager, bf16 weights, bf16 autocast on the same batches, alternately in one process."""
    from retrieval_core.model.collate import collate_images, collate_pairs
    from retrieval_core.model.quantize import cpu_has_native_bf16, quantize_model

    torch.set_num_threads(threads)
    model, images, captions, _ = _load(backbone, data)
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


@main.command()
@_model_and_data
@click.option("--threads", default="1,2", show_default=True, help="Thread counts to compare.")
@click.option("--batch-sizes", default="32,64,128,256", show_default=True)
@click.option("--reps", type=int, default=3, show_default=True)
def batches(backbone, data, threads, batch_sizes, reps) -> None:
    """CE pairs/s, captions/s and images/s of the model's own batched calls (float32) at each batch size and
    thread count, alternately in one process: what the batch-size and thread defaults rest on."""
    model, images, captions, _ = _load(backbone, data)
    texts = captions["text"].tolist()[:1024]
    pt, pr = _pairs(captions, images, 512)
    some = images.take(range(min(512, len(images))))
    work = {"CE pairs": lambda bs: model.score(pt, pr, batch_size=bs), "captions": lambda bs: model.encode_text(
        texts, batch_size=bs), "images": lambda bs: model.encode_image(some, batch_size=bs)}
    sizes = {"CE pairs": len(pt), "captions": len(texts), "images": len(some)}
    settings = [(int(t), int(b)) for t in threads.split(",") for b in batch_sizes.split(",")]
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

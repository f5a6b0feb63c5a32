"""The pipelines end to end on one machine (a GPU one: ``--device cuda``), with the job-vs-device ratios and a
verdict per target.

Steps, each timed (``scripts/gpu_pipelines.sh`` runs this on a bare GPU machine with the carried wheels):

  1. stage      pipelines.stage: the synthetic demo collection at ``--images`` images (5 captions each)
  2. train      a model of ``--size`` (benchmarks.feeding.build_model: random init, vocabulary pruned to the
                collection's words) fine-tuned ``--train-steps`` JOIN steps on the train split, on the device
  3. encode     pipelines.encode of every image and caption (DirectRunner), on the device, ``--precision``
  4. index      pipelines.build_index (Flat) over the images
  5. rerank     pipelines.rerank --mode co --k ``--k`` of the test split's queries (both directions)
  6. evaluate   benchmarks.evaluate: R@1/5/10 and mR with 95 % intervals, CO and EMB
  7. feeding    benchmarks.feeding rows (job path / library / model alone) at the demo size and at ``--feed-size``,
                fp32 and bf16; on CUDA also sdpa with PyTorch's own kernel choice against the encoder's
                (cuDNN left out in 16-bit) and eager, on varied length-sorted batches; then the batch-size
                sweep (``--sweep``: job path and model alone at each size, the best size per task printed)
  8. co         a 5k CO of a BERT-base-size CE at library level: ``--co-pairs`` pairs through VLRetrievalModel.score

Writes ``<out>/pipeline_rows.csv`` (steps, rates, ratios, recall rows: report.CSV_COLUMNS) and prints one verdict
line per target of the GPU work (docs/PERFORMANCE.md "The pipelines on a GPU machine").

    python -m benchmarks.gpu_pipelines --device cuda --out runs/gpu        # the full run (GPU machine)
    python -m benchmarks.gpu_pipelines --device cpu --images 60 --tiny     # seconds: what the test suite runs
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import click
import torch

from benchmarks import feeding
from benchmarks.report import write_csv
from retrieval_core.cli import (
    CheckedPlan,
    batch_size_option,
    cli_errors,
    device_option,
    option,
    plan_command,
    plan_from_cli,
    threads_option,
)

BEAM_ARGS = ("--runner=DirectRunner",)
#: Targets (docs/PERFORMANCE.md): job path / device fed in bf16 on a GPU; the 5k CO's seconds; bf16 vs fp32.
GPU_JOB_RATIO, CPU_JOB_RATIO, CO_SECONDS = 0.7, 0.9, 60.0


def _timed(log, what: str, fn):
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    log(f"{what}: {wall:.1f} s")
    return out, wall


@contextlib.contextmanager
def _pytorch_attention_choice():
    """sdpa with PyTorch's own kernel choice (cuDNN included): the encoder's restriction lifted, to time both."""
    from retrieval_core.model import attention

    kept = attention.sdpa_backends
    attention.sdpa_backends = lambda device, dtype: None
    try:
        yield
    finally:
        attention.sdpa_backends = kept


def attention_rows(model, texts, table, n: int, batch_size: int, log, common: dict) -> list[dict]:
    """CE pairs/s of the bf16 model (already on CUDA) on ``n`` varied, length-sorted pairs: sdpa as the encoder
    runs it, sdpa with PyTorch's own choice, eager. Scores of each against the first: max abs difference."""
    import numpy as np

    ids = model.text_collator().ids(list(texts[:n]))
    regions = [table.regions((i // 5) % len(table)) for i in range(len(ids))]
    variants = {"sdpa (cuDNN left out)": contextlib.nullcontext, "sdpa (PyTorch's choice)": _pytorch_attention_choice,
                "eager": contextlib.nullcontext}
    rows, first = [], None
    for name, ctx in variants.items():
        model.set_attention("eager" if name == "eager" else "sdpa")
        with ctx():
            model.score(ids[:batch_size * 2], regions[:batch_size * 2], batch_size=batch_size, device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            scores = model.score(ids, regions, batch_size=batch_size, device="cuda")
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        first = scores if first is None else first
        diff = float(np.max(np.abs(scores - first)))
        log(f"attention {name}: {len(ids) / wall:,.0f} pairs/s, max |score - first| {diff:.3g}")
        rows.append({**common, "collection": "attention_bf16", "mode": f"CE pairs: {name}", "collection_size": len(ids),
                     "rate_per_s": len(ids) / wall, "quantize": "bf16", "measured": True,
                     "notes": f"library loop, varied length-sorted batches; max abs score difference to the first "
                              f"row {diff:.3g}"})
    model.set_attention("sdpa")
    return rows


def run_pipelines(out: str, device: str, images: int, size: str, precision: str, k: int, batch_size: int,
                  train_steps: int, log) -> tuple[list[dict], dict]:
    """Steps 1-6 (module docstring): rows and {step: wall seconds, rates}."""
    import pandas as pd

    from benchmarks.evaluate import evaluate_ranking
    from pipelines.build_index.plan import IndexPlan
    from pipelines.build_index.run import run as run_index
    from pipelines.encode.plan import EncodePlan
    from pipelines.encode.run import run as run_encode
    from pipelines.rerank.plan import RerankPlan
    from pipelines.rerank.run import run as run_rerank
    from pipelines.stage.plan import StagePlan
    from pipelines.stage.run import run as run_stage
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.training.config import TrainConfig
    from retrieval_core.training.train import TrainPlan
    from retrieval_core.training.train import run as run_train

    feature_dim = feeding.SIZES[size]["feature_dim"]
    staged = os.path.join(out, "staged")
    overrides = (f"feature_dim={feature_dim}", f"demo.images.num_images={images}", f"demo.expected_images={images}",
                 f"demo.expected_captions={5 * images}")
    info: dict = {}
    _, info["stage_s"] = _timed(log, f"stage {images} images", lambda: run_stage(
        StagePlan(staged, "demo", overrides=overrides, images_per_shard=max(50, images // 8)), BEAM_ARGS))
    ds = StagedDataset(staged)
    texts = ds.captions()["text"].tolist()
    base = os.path.join(out, "model-init")
    feeding.build_model(size, texts, base)
    trained = os.path.join(out, "model")
    cfg = TrainConfig(steps=train_steps, batch_size=min(64, images), device=device, progress=False,
                      eval_every=0, checkpoint_every=0)
    result, info["train_s"] = _timed(log, f"train {train_steps} JOIN steps", lambda: run_train(
        TrainPlan(staged=staged, output=trained, base_model=base, config=cfg)))
    model_dir = result["best_dir"]
    emb, index, ranked = (os.path.join(out, d) for d in ("embeddings", "index", "rerank"))
    quantize = "bf16" if precision == "bf16" else "none"
    summary, info["encode_s"] = _timed(log, "encode", lambda: run_encode(
        EncodePlan(staged, model_dir, emb, device=device, batch_size=batch_size, quantize=quantize), BEAM_ARGS))
    for modality, m in summary["modalities"].items():
        model_s = m["metrics"].get("inference_batch_latency_micro_secs", (0, 0))[0] / 1e6
        info[f"encode_{modality}"] = {"items": m["encoded"], "model_s": model_s}
    _, info["index_s"] = _timed(log, "build_index", lambda: run_index(
        IndexPlan(embeddings=emb, output=index, modality="image", factory="Flat"), BEAM_ARGS))
    manifest, info["rerank_s"] = _timed(log, f"rerank co k={k}", lambda: run_rerank(
        RerankPlan(staged, emb, ranked, mode="co", k=k, index=index, ce_model=model_dir, device=device,
                   batch_size=batch_size, quantize=quantize), BEAM_ARGS))
    info["ce_pairs"] = int(manifest.get("counts", {}).get("ce_pairs_scored", 0)) if manifest else 0
    rows = []
    for mode in ("co", "emb"):
        res = evaluate_ranking(ranked, staged, mode=mode, k=k)
        for r in _result_rows(res):
            rows.append({"suite": "gpu_pipelines", "model": f"{size} JOIN ({train_steps} steps)", "mode": mode.upper(),
                         "k": k, "quantize": precision, "device": device, "measured": True, **r})
    info["recall"] = pd.DataFrame(rows)[["mode", "direction", "R@1", "mR"]].to_dict("records") if rows else []
    other = "fp32" if precision == "bf16" else ("bf16" if _bf16_here(device) else None)
    if other is not None:  # the same rerank in the other precision: the paired effect on recall
        other_dir = os.path.join(out, f"rerank-{other}")
        run_rerank(RerankPlan(staged, emb, other_dir, mode="co", k=k, index=index, ce_model=model_dir, device=device,
                              batch_size=batch_size, quantize="bf16" if other == "bf16" else "none"), BEAM_ARGS)
        bf16_dir, fp32_dir = (ranked, other_dir) if precision == "bf16" else (other_dir, ranked)
        res = evaluate_ranking(bf16_dir, staged, mode="co", k=k, against=fp32_dir)
        for r in _result_rows(res):
            d = r["direction"]
            delta = {f"delta_{m}{e}": getattr(res["delta"][f"{d}_{m}" if m != "mR" else "mR"], attr)
                     for m in ("R@1", "R@5", "R@10", "mR") for e, attr in (("", "estimate"), ("_lo", "lo"),
                                                                           ("_hi", "hi"))}
            rows.append({"suite": "gpu_pipelines", "model": f"{size} JOIN ({train_steps} steps)", "mode": "CO",
                         "k": k, "quantize": "bf16", "device": device, "measured": True, "against": "fp32 CO",
                         **r, **delta, "notes": "bf16 CE minus fp32 CE on the same queries: paired 95 % intervals"})
        info["score_diff"] = _score_difference(model_dir, staged, device, log)
    return rows, info


def _bf16_here(device: str) -> bool:
    from retrieval_core.model.quantize import cpu_has_native_bf16, cuda_bf16_supported

    return cuda_bf16_supported() if device.startswith("cuda") else cpu_has_native_bf16()


def _score_difference(model_dir: str, staged: str, device: str, log, n: int = 2000) -> float:
    """Max |bf16 - fp32| CE score over ``n`` (caption, its image) test pairs of the trained model."""
    import numpy as np

    from retrieval_core.data.store import StagedDataset
    from retrieval_core.model.checkpoints import load_model_folder

    ds = StagedDataset(staged)
    caps = ds.captions(split="test").head(n)
    table = ds.load_images(caps["image_item_id"].unique().tolist())
    pos = {int(i): p for p, i in enumerate(table.item_ids.tolist())}
    regions = [table.regions(pos[int(i)]) for i in caps["image_item_id"]]
    scores = {}
    for q in ("none", "bf16"):
        model = load_model_folder(model_dir, quantize=q, device=device)
        scores[q] = model.score(caps["text"].tolist(), regions, device=device)
    diff = float(np.max(np.abs(scores["bf16"] - scores["none"])))
    log(f"CE scores bf16 vs fp32 on {len(caps)} test pairs: max abs difference {diff:.4f} (score spread "
        f"{float(np.std(scores['none'])):.3f})")
    return diff


def _result_rows(res: dict) -> list[dict]:
    """evaluate_ranking's result as one row per direction: R@1/5/10 and mR with their 95 % intervals."""
    out = []
    for d in ("t2i", "i2t"):
        if not res.get(f"{d}_queries"):
            continue
        row = {"direction": d, "queries": res[f"{d}_queries"], "collection_size": res["collection_size"],
               "collection": "demo", "split": res.get("split") or "", "mR": res["mR"]}
        for m in ("R@1", "R@5", "R@10"):
            row[m] = res[f"{d}_{m}"]
            iv = res["intervals"][f"{d}_{m}"]
            row[f"{m}_lo"], row[f"{m}_hi"] = iv.lo, iv.hi
        row["mR_lo"], row["mR_hi"] = res["intervals"]["mR"].lo, res["intervals"]["mR"].hi
        out.append(row)
    return out


def verdicts(device: str, rows: list[dict], info: dict, co_s: Optional[float]) -> list[str]:
    """One line per target: the measured value, the target and met / MISSED."""
    lines = []
    target = GPU_JOB_RATIO if device.startswith("cuda") else CPU_JOB_RATIO
    for r in rows:
        if r.get("collection", "").startswith("feeding_") and "job path" in r.get("mode", ""):
            ok = r["roofline_fraction"] >= target
            lines.append(f"{r['recipe']} {r['mode']} {r['quantize']}: job / model alone {r['roofline_fraction']:.2f} "
                         f"(target >= {target}) -> {'met' if ok else 'MISSED'}")
    by = {(r.get("recipe"), r.get("collection"), r.get("mode"), r.get("quantize")): r["rate_per_s"] for r in rows
          if r.get("collection", "").startswith("feeding_")}
    for (recipe, coll, mode, q), rate in by.items():
        if q == "bf16" and "job path" in mode and (recipe, coll, mode, "fp32") in by:
            fp32 = by[(recipe, coll, mode, "fp32")]
            lines.append(f"{recipe} {mode}: bf16 {rate:,.0f}/s vs fp32 {fp32:,.0f}/s -> "
                         f"{'met' if rate >= fp32 else 'MISSED'} (bf16 never slower)")
    for r in rows:
        if r.get("against") == "fp32 CO":
            lines.append(f"bf16 - fp32 CO {r['direction']}: R@1 {r['delta_R@1']:+.2f} [{r['delta_R@1_lo']:+.2f}, "
                         f"{r['delta_R@1_hi']:+.2f}], mR {r['delta_mR']:+.2f} [{r['delta_mR_lo']:+.2f}, "
                         f"{r['delta_mR_hi']:+.2f}] (paired 95 % intervals; informational)")
    if "score_diff" in info:
        lines.append(f"CE scores bf16 vs fp32: max abs difference {info['score_diff']:.4f} (informational)")
    for what, (bs, rate) in info.get("best_batch", {}).items():
        lines.append(f"best batch size on {device}, demo {what}: {bs} (job path {rate:,.0f}/s; the jobs' default "
                     f"--batch-size 64: set this device's from it; informational)")
    if co_s is not None:
        lines.append(f"5k CO, BERT-base-size CE, library level: {co_s:.1f} s (target <= {CO_SECONDS:.0f} s) -> "
                     f"{'met' if co_s <= CO_SECONDS else 'MISSED'}")
    total = info.get("total_s")
    if total is not None:
        lines.append(f"script run time {total:.0f} s (target <= 300 s) -> {'met' if total <= 300 else 'MISSED'}")
    return lines


@dataclass(frozen=True)
class GpuPipelinesPlan(CheckedPlan):
    """The run's options, each a typed field (checked when built)."""
    device: str = device_option("cuda")
    out: str = option("runs/gpu_pipelines", help="Work folder; pipeline_rows.csv.")
    images: int = option(20_000, type=click.IntRange(min=20), help="Synthetic images staged (5 captions each).")
    size: str = option("demo", type=click.Choice(sorted(feeding.SIZES)), help="Model of the pipeline steps.")
    feed_size: str = option("base", type=click.Choice(sorted(feeding.SIZES)),
                            help="The second model size of the feeding rows.")
    feed_items: int = option(5000, type=click.IntRange(min=1))
    train_steps: int = option(300, type=click.IntRange(min=1))
    k: int = option(20, type=click.IntRange(min=1))
    batch_size: int = batch_size_option(256)
    sweep: str = option("64,256,1024,2048", help="Batch sizes of the sweep at the demo size in the run's precision "
                                                 "(job path and model alone, CE pairs and BE images): the best size "
                                                 "on this device, from which its default is set (empty: no sweep).")
    co_pairs: int = option(600_000, type=click.IntRange(min=0), help="Pairs of the library-level CO of a "
                                                                     "--feed-size CE (0: skip).")
    threads: Optional[int] = threads_option()
    tiny: bool = option(False, help="The test suite's size: small steps everywhere (seconds on a CPU).")


@plan_command(GpuPipelinesPlan)
def main(**values) -> None:
    """Stage -> train -> encode -> build_index -> rerank -> evaluate, feeding rows, a 5k CO; verdicts."""
    with cli_errors():
        p = plan_from_cli(GpuPipelinesPlan, values)
        device, out, images, size, feed_size, feed_items, train_steps, k, batch_size, co_pairs, threads, tiny = (
            p.device, p.out, p.images, p.size, p.feed_size, p.feed_items, p.train_steps, p.k, p.batch_size,
            p.co_pairs, p.threads, p.tiny)
        sweep = feeding.parse_sizes(p.sweep)
        if tiny:
            feed_size, feed_items, train_steps, k, batch_size, co_pairs = "demo", 24, 1, 3, 8, 24
            sweep = (4, 8) if sweep else ()
        rows = run_all(device, out, images, size, feed_size, feed_items, train_steps, k, batch_size, co_pairs,
                       threads, reps=1 if tiny else 3, sweep=sweep)
        click.echo(f"wrote {os.path.join(out, 'pipeline_rows.csv')}: {len(rows)} rows")


def run_all(device, out, images, size, feed_size, feed_items, train_steps, k, batch_size, co_pairs, threads,
            reps: int = 3, sweep: tuple[int, ...] = ()) -> list[dict]:
    t_start = time.perf_counter()
    log = lambda m: click.echo(f"[{time.strftime('%H:%M:%S')}] {m}", err=True)  # noqa: E731
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise click.ClickException(f"--device {device}: torch {torch.__version__} sees no CUDA device")
    os.makedirs(out, exist_ok=True)
    precision = "bf16" if dev.type == "cuda" else "fp32"  # the jobs' own default on each device
    env = feeding.environment(dev, threads, batch_size)
    rows, info = run_pipelines(out, device, images, size, precision, k, batch_size, train_steps, log)
    rows = [{**env, **r} for r in rows]
    for step in ("stage", "train", "encode", "index", "rerank"):
        rows.append({**env, "suite": "gpu_pipelines", "collection": "steps", "mode": step, "wall_s": info[f"{step}_s"],
                     "collection_size": images, "quantize": precision, "measured": True})
    for modality in ("image", "text"):
        m = info.get(f"encode_{modality}")
        if m and m["model_s"]:
            rows.append({**env, "suite": "gpu_pipelines", "collection": "steps", "mode": f"encode {modality}s",
                         "rate_per_s": m["items"] / info["encode_s"], "roofline_fraction": None,
                         "collection_size": m["items"], "quantize": precision, "measured": True,
                         "notes": f"items / the job's wall (start-up included); its RunInference model time alone "
                                  f"{m['items'] / m['model_s']:,.0f}/s"})
    if info["ce_pairs"]:
        rows.append({**env, "suite": "gpu_pipelines", "collection": "steps", "mode": "rerank CE pairs",
                     "rate_per_s": info["ce_pairs"] / info["rerank_s"], "ce_pairs": info["ce_pairs"],
                     "quantize": precision, "measured": True, "notes": "CE pairs / the rerank job's wall"})
    table, texts = feeding.synthetic_data(max(1, -(-feed_items // 5)), feeding.SIZES["demo"]["feature_dim"])
    for fsize in dict.fromkeys(("demo", feed_size)):
        if fsize != "demo":
            table, texts = feeding.synthetic_data(max(1, -(-feed_items // 5)), feeding.SIZES[fsize]["feature_dim"])
        folder = os.path.join(out, f"feed-{fsize}")
        for prec in ("fp32", "bf16") if dev.type == "cuda" else ("fp32",):
            from retrieval_core.model.quantize import quantize_model
            model = quantize_model(feeding.build_model(fsize, texts, folder), "bf16" if prec == "bf16" else None,
                                   device).to(dev).eval()
            rows += feeding.feeding_rows(model, folder, texts, table, feed_items, batch_size, prec, reps,
                                         ("pairs", "images"), log, {**env, "recipe": fsize, "suite": "gpu_pipelines"})
            if dev.type == "cuda" and prec == "bf16":
                rows += attention_rows(model, texts, table, feed_items, batch_size, log, {**env, "recipe": fsize,
                                                                                           "suite": "gpu_pipelines"})
    if sweep:  # the demo size in the jobs' precision on this device: which batch size feeds it best
        table, texts = feeding.synthetic_data(max(1, -(-feed_items // 5)), feeding.SIZES["demo"]["feature_dim"])
        from retrieval_core.model.quantize import quantize_model
        folder = os.path.join(out, "feed-demo")
        model = quantize_model(feeding.build_model("demo", texts, folder), "bf16" if precision == "bf16" else None,
                               device).to(dev).eval()
        swept = []
        for bs in sweep:
            swept += feeding.feeding_rows(model, folder, texts, table, feed_items, bs, precision, reps,
                                          ("pairs", "images"), log, {**feeding.environment(dev, threads, bs),
                                                                     "recipe": "demo", "suite": "gpu_pipelines"},
                                          ways=("job", "model"))
        info["best_batch"] = {f"{task} {q}": v for (task, q), v in feeding.best_batch_sizes(swept).items()}
        # apart from the feeding rows at --batch-size, which the ratio verdicts read
        rows += [{**r, "collection": r["collection"].replace("feeding_", "batch_sweep_")} for r in swept]
    co_s = None
    if co_pairs:
        model = feeding.build_model(feed_size, texts, os.path.join(out, f"feed-{feed_size}"))
        from retrieval_core.model.quantize import quantize_model
        model = quantize_model(model, precision if precision == "bf16" else None, device).to(dev).eval()
        ids = model.text_collator().ids(texts)
        pair_texts = [ids[i % len(ids)] for i in range(co_pairs)]
        pair_regions = [table.regions((i // 5) % len(table)) for i in range(co_pairs)]
        model.score(pair_texts[:batch_size], pair_regions[:batch_size], batch_size=batch_size, device=device)
        _, co_s = _timed(log, f"5k CO at library level: {co_pairs:,} pairs", lambda: model.score(
            pair_texts, pair_regions, batch_size=batch_size, device=device))
        rows.append({**env, "suite": "gpu_pipelines", "recipe": feed_size, "collection": "co_5k",
                     "mode": "CE pairs (library)", "wall_s": co_s, "ce_pairs": co_pairs,
                     "rate_per_s": co_pairs / co_s, "quantize": precision, "measured": True})
    if "score_diff" in info:
        rows.append({**env, "suite": "gpu_pipelines", "collection": "precision", "mode": "CE score bf16 - fp32",
                     "quantize": "bf16", "measured": True,
                     "notes": f"max abs difference of the trained model's CE scores: {info['score_diff']:.4g}"})
    info["total_s"] = time.perf_counter() - t_start
    write_csv(os.path.join(out, "pipeline_rows.csv"), rows)
    lines = verdicts(device, rows, info, co_s)
    with open(os.path.join(out, "verdicts.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
        f.write(json.dumps({k: v for k, v in info.items() if k != "recall"}, default=str) + "\n")
    for line in lines:
        click.echo(line)
    return rows


if __name__ == "__main__":
    main()

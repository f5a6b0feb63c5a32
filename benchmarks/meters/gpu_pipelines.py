"""The GPU run, in parts that each finish and report (``scripts/gpu_pipelines.sh part NAME`` on the lent machine).

Each part prints its estimate before it starts (``benchmarks/gpu_run.json``'s rates x the part's sizes, for the
H200 the rates were measured on), then runs its steps; after every step it rewrites ``<out>/rows.csv`` (every row
so far: report.CSV_COLUMNS) and ``<out>/verdicts.txt``, so a part stopped at the device's time limit keeps what
finished; it stops at the first failure with one line ``FAILED <part>/<step>: <cause>``, and ends by printing its
measured time over its estimate, so a wrong rate shows. The work folder (``--work``) holds the staged data, models
and runs: never under ``$OUT``, which the device returns (at most 8 files).

  pipelines  the demo-size JOIN: stage -> train -> encode -> build_index -> rerank (CO, k=20) -> evaluate, then
             the rerank in the other precision and the paired bf16 - fp32 intervals (DirectRunner throughout)
  co5k       a BERT-base-size CE (2,048-d regions, 36 per image) through pipelines.rerank: the 5k CO of the
             targets (5,000 test images, 25,000 captions, k = 20: 600k pairs), against the model alone on the
             same kind of pairs (device-fed rate)
  feeding    job path / library loop / model alone at both sizes and precisions (benchmarks.meters.feeding), the
             attention kernels on CUDA, the batch-size sweep, and region collation by worker count
  train      JOIN training steps per second at both sizes, fp32 against the 16-bit mode

``--scale``: ``full`` (the GPU machine), ``rehearsal`` (the same parts at small counts on a CPU: minutes), ``test``
(the test suite's: one encoder layer, seconds). Every scale runs the same code at both model sizes' real input
shapes (demo: 1,024-d regions, 12 per image; base: 2,048-d, 36).

    python -m benchmarks.meters.gpu_pipelines --part co5k --out $OUT --work /tmp/rr-gpu  # on the GPU machine
    python -m benchmarks.meters.gpu_pipelines --part all --scale rehearsal --device cpu    # here
    python -m benchmarks.meters.gpu_pipelines --estimate                                   # the full run's estimates
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import click

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

PARTS = ("pipelines", "co5k", "feeding", "train")
#: Interleaved repetitions of the collation rows (their median is the row).
COLLATE_REPS = 5
RATES_FILE = Path(__file__).parent.parent / "gpu_run.json"  # benchmarks/gpu_run.json
ROWS_FILE, VERDICTS_FILE = "rows.csv", "verdicts.txt"
BEAM_ARGS = ("--runner=DirectRunner",)
#: Targets: job / device-fed rate in bf16 on a GPU (CPU: of the model alone); the 5k CO's seconds; minutes per part.
GPU_JOB_RATIO, CPU_JOB_RATIO, CO_SECONDS, PART_SECONDS = 0.7, 0.9, 60.0, 240.0


@dataclass(frozen=True)
class Scale:
    """The counts of one scale (module docstring)."""
    images: int            # pipelines: synthetic demo images staged (5 captions each; 10 % test)
    train_steps: int       # pipelines: JOIN steps of the demo-size model
    k: int                 # rerank depth
    co_images: int         # co5k: test images (5 captions each)
    fed_pairs: int         # co5k: pairs of the model-alone rate
    feed_items: int        # feeding: items per task
    sweep: tuple[int, ...]  # feeding: batch sizes of the sweep
    reps: int              # feeding: interleaved repetitions
    step_rows: int         # train: timed steps per (size, precision)
    train_images: int      # train: images of its collection
    layers: Optional[int]  # encoder layers of both sizes (None: the size's own)
    waves: bool            # small waves, so the rerank runs several Beam jobs at any count


SCALES = {
    "full": Scale(images=20_000, train_steps=300, k=20, co_images=5_000, fed_pairs=50_000, feed_items=5_000,
                  sweep=(64, 256, 1024, 2048), reps=3, step_rows=20, train_images=2_000, layers=None, waves=False),
    "rehearsal": Scale(images=200, train_steps=4, k=5, co_images=40, fed_pairs=64, feed_items=96, sweep=(16, 32),
                       reps=1, step_rows=2, train_images=40, layers=None, waves=True),
    "test": Scale(images=40, train_steps=1, k=3, co_images=12, fed_pairs=16, feed_items=16, sweep=(4, 8), reps=1,
                  step_rows=1, train_images=12, layers=1, waves=True),
}


# ------------------------------------------------------------------------------------------------ estimates
def load_rates(path: Path = RATES_FILE) -> dict:
    with open(path) as f:
        return json.load(f)


def estimate(part: str, scale: Scale, rates: Optional[dict] = None) -> dict[str, float]:
    """Seconds per step of ``part`` at ``scale`` on the machine the rates were measured on (gpu_run.json): model
    work = items / the device-fed rate, plus host work = items / the Beam host rate (one DirectRunner process:
    the handler runs the model between its host steps), plus each job's fixed start."""
    rates = rates or load_rates()
    r, o = rates["rates"], rates["overheads_s"]
    ce, be_img, be_cap, col = r["ce_pairs_per_s"], r["be_images_per_s"], r["be_captions_per_s"], r["collate"]
    job, proc, beam = o["beam_job"], o["process_start"], r["beam_elements_per_s"]

    def encode_s(size: str, images: int) -> float:
        return 2 * job + images / be_img[size] + 5 * images / be_cap[size] + 6 * images / beam

    if part == "pipelines":
        test = round(scale.images * PIPELINES_SPLITS["test"])
        pairs = test * 5 * scale.k + test * scale.k  # t2i: every caption's top k; i2t: every image's
        rerank = job * (2 + _waves(scale, pairs)) + pairs / beam
        return {"start": proc,
                "stage": job + scale.images / r["stage_images_per_s"]["demo"],
                "train": o["train_start"] + scale.train_steps / r["train_steps_per_s"]["demo"]["fp32"],
                "encode": encode_s("demo", scale.images),
                "index": job,
                "rerank": rerank + pairs / ce["demo"]["bf16"],
                "evaluate": o["evaluate"],
                "rerank other precision": rerank + pairs / ce["demo"]["fp32"],
                "paired": o["evaluate"] + o["model_load"]}
    if part == "co5k":
        n = scale.co_images
        pairs = 5 * n * scale.k + n * scale.k
        collate = pairs / (col["base"] * r["host_cores"])
        return {"start": proc,
                "stage": job + n / r["stage_images_per_s"]["base"],
                "encode": encode_s("base", n),
                "index": job,
                "rerank": job * (2 + _waves(scale, pairs)) + pairs / beam + collate + pairs / ce["base"]["bf16"],
                "model alone": o["model_load"] + scale.fed_pairs / ce["base"]["bf16"]}
    if part == "feeding":
        n, reps = scale.feed_items, scale.reps
        ways = 3 * (reps + 1)  # job, library, model alone; a warm-up pass
        demo = sum(ways * n / ce["demo"][p] + ways * n / be_img["demo"] for p in ("fp32", "bf16"))
        base = sum(ways * n / ce["base"][p] + ways * n / be_img["base"] for p in ("fp32", "bf16"))
        return {"start": proc,
                "demo": o["model_load"] * 2 + demo + 3 * n / ce["demo"]["bf16"],
                "base": o["model_load"] * 2 + base + 3 * n / ce["base"]["bf16"],
                "sweep": len(scale.sweep) * 2 * (reps + 1) * (n / ce["demo"]["bf16"] + n / be_img["demo"]),
                "collate": sum(COLLATE_REPS * max(8 * 256, n) / (col["base"] * w)
                               for w in _worker_counts(r["host_cores"]))}
    if part == "train":
        steps = scale.step_rows + 1
        return {"start": proc,
                "demo": 2 * (o["model_load"] + steps / r["train_steps_per_s"]["demo"]["fp32"]),
                "base": 2 * (o["model_load"] + steps / r["train_steps_per_s"]["base"]["fp32"])}
    raise ValueError(f"part must be one of {PARTS}, got {part!r}")


def _waves(scale: Scale, pairs: int) -> int:
    per_wave = WAVES["small" if scale.waves else "full"]["pairs_per_wave"]
    return max(1, -(-pairs // per_wave))


def _worker_counts(cores: int) -> tuple[int, ...]:
    return tuple(w for w in (1, 2, 4, 8, 16, 32) if w <= max(2, cores))


def estimate_table(rates: Optional[dict] = None) -> tuple[list[str], float]:
    """Lines of the full run's estimates per part (one call each, its install included) and their total."""
    rates = rates or load_rates()
    install = float(rates["overheads_s"]["install"])
    lines, total = [], 0.0
    for part in PARTS:
        steps = estimate(part, SCALES["full"], rates)
        s = sum(steps.values())
        total += install + s
        verdict = "fits" if s <= PART_SECONDS else "OVER"
        lines.append(f"{part}: {s:.0f} s ({verdict} the {PART_SECONDS:.0f} s of a part) + install {install:.0f} s: "
                     + ", ".join(f"{k} {v:.0f}" for k, v in steps.items()))
    lines.append(f"all parts, one call each: {total:.0f} s ({'fits' if total <= 600 else 'OVER'} 600 s)")
    return lines, total


# ------------------------------------------------------------------------------------------------ reporting
class PartFailed(Exception):
    """A step failed: one line naming the part, the step and the cause."""


class Report:
    """The rows and verdicts of one part, rewritten to ``out`` after every step (what finished is kept)."""

    def __init__(self, part: str, out: str, env: dict, estimates: dict[str, float],
                 rows: Optional[list] = None, verdicts: Optional[list] = None):
        self.part, self.out, self.env, self.estimates = part, out, env, estimates
        self.rows: list[dict] = rows if rows is not None else []  # shared with the parts before in this call
        self.verdicts: list[str] = verdicts if verdicts is not None else []
        self.t0 = time.perf_counter()
        os.makedirs(out, exist_ok=True)

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {self.part}: {message}", flush=True)

    def row(self, **values) -> dict:
        row = {**self.env, "suite": "gpu_pipelines", "recipe": self.part, "measured": True, **values}
        self.rows.append(row)
        return row

    def verdict(self, line: str) -> None:
        self.verdicts.append(line)
        self.log(line)

    @contextlib.contextmanager
    def step(self, name: str):
        """Times the step, logs it against its estimate, writes the files; a failure becomes PartFailed."""
        est = self.estimates.get(name)
        self.log(f"{name} ..." + (f" (estimate {est:.1f} s on the H200)" if est is not None else ""))
        t0 = time.perf_counter()
        try:
            yield
        except PartFailed:
            raise
        except BaseException as exc:  # noqa: BLE001 -- named and re-raised as the part's one-line failure
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise PartFailed(f"FAILED {self.part}/{name}: {type(exc).__name__}: {exc}") from exc
        wall = time.perf_counter() - t0
        self.row(collection="steps", mode=name, wall_s=wall,
                 notes=f"estimate {est:.1f} s on the H200 (benchmarks/gpu_run.json)" if est is not None else "")
        self.log(f"{name}: {wall:.1f} s" + (f" (estimate {est:.1f} s)" if est is not None else ""))
        self.write()

    def write(self) -> None:
        from benchmarks.report import write_csv

        write_csv(os.path.join(self.out, ROWS_FILE), self.rows, write_atomic=_write_atomic)
        _write_atomic(os.path.join(self.out, VERDICTS_FILE), ("\n".join(self.verdicts) + "\n").encode())

    def finish(self) -> None:
        wall = time.perf_counter() - self.t0
        est = sum(self.estimates.values())
        self.verdict(f"{self.part}: {wall:.0f} s measured / {est:.0f} s estimated on the H200 = {wall / est:.2f}")
        self.write()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ shared steps
#: The pipelines part's splits: 5 % test keeps its two reranks (k = 20 over every test query) within the part's
#: minutes at 20,000 images; a dev split for the trainer's evaluation.
PIPELINES_SPLITS = {"train": 0.9, "dev": 0.05, "test": 0.05}
#: Rerank waves: the full run's (few Beam jobs), and small ones so that any count runs several jobs.
WAVES = {"full": dict(pairs_per_wave=100_000, queries_per_shard=1_000, shards_per_wave=10),
         "small": dict(pairs_per_wave=100, queries_per_shard=24, shards_per_wave=2)}


def stage(work: str, name: str, images: int, size: str, splits: Optional[dict] = None) -> str:
    """The synthetic demo collection at ``images`` images in ``size``'s feature shape, staged by pipelines.stage."""
    from benchmarks.meters import feeding
    from pipelines.stage.plan import StagePlan
    from pipelines.stage.run import run as run_stage

    shape = feeding.SIZES[size]
    regions = shape["max_regions"]
    overrides = [f"feature_dim={shape['feature_dim']}", f"demo.images.num_images={images}"]
    if size == "base":  # bottom-up-attention's 36 boxes per image, staged in float16 as real features are
        overrides += [f"demo.images.min_regions={regions}", f"demo.images.max_regions={regions}",
                      f"max_regions={regions}", "feature_dtype=float16"]
    if splits:
        overrides.append("demo.images.splits={" + ", ".join(f"{k}: {v}" for k, v in splits.items()) + "}")
    out = os.path.join(work, name)
    run_stage(StagePlan(out, "demo", overrides=tuple(overrides), images_per_shard=max(50, images // 8)), BEAM_ARGS)
    return out


def model_for(size: str, staged: str, folder: str, layers: Optional[int]):
    """A random-init model of ``size`` with a vocabulary of the staged captions' words (benchmarks.meters.feeding)."""
    from benchmarks.meters import feeding
    from retrieval_core.data.store import StagedDataset

    texts = StagedDataset(staged).captions()["text"].tolist()
    return feeding.build_model(size, texts, folder, layers=layers)


def encode(staged: str, model_dir: str, work: str, device: str, batch_size: int) -> tuple[str, dict]:
    """pipelines.encode of every staged image and caption: (embeddings folder, the job's summary)."""
    from pipelines.encode.plan import EncodePlan
    from pipelines.encode.run import run as run_encode

    emb = os.path.join(work, "embeddings")
    return emb, run_encode(EncodePlan(staged, model_dir, emb, device=device, batch_size=batch_size), BEAM_ARGS)


def build_index(emb: str, work: str) -> str:
    """pipelines.build_index: a Flat index of the image embeddings."""
    from pipelines.build_index.plan import IndexPlan
    from pipelines.build_index.run import run as run_index

    index = os.path.join(work, "index")
    run_index(IndexPlan(embeddings=emb, output=index, modality="image", factory="Flat"), BEAM_ARGS)
    return index


def rerank(staged: str, emb: str, index: str, model_dir: str, out: str, device: str, k: int, batch_size: int,
           quantize: str, scale: Scale, collate_workers: Optional[int] = None) -> dict:
    from pipelines.rerank.plan import RerankPlan
    from pipelines.rerank.run import run as run_rerank

    waves = WAVES["small" if scale.waves else "full"]
    plan = RerankPlan(staged, emb, out, mode="co", k=k, index=index, ce_model=model_dir, device=device,
                      batch_size=batch_size, quantize=quantize, collate_workers=collate_workers, **waves)
    return run_rerank(plan, BEAM_ARGS)


def recall_rows(report: Report, ranked: str, staged: str, k: int, model: str, precision: str) -> None:
    from benchmarks.evaluate import evaluate_ranking

    for mode in ("co", "emb"):
        res = evaluate_ranking(ranked, staged, mode=mode, k=k)
        for r in _result_rows(res):
            report.row(model=model, mode=mode.upper(), k=k, quantize=precision, **r)
            report.log(f"{mode.upper()} {r['direction']}: R@1 {r['R@1']:.1f} [{r['R@1_lo']:.1f}, {r['R@1_hi']:.1f}]")


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


def bf16_here(device: str) -> bool:
    from retrieval_core.precision import cpu_has_native_bf16, cuda_bf16_supported

    return cuda_bf16_supported() if device.startswith("cuda") else cpu_has_native_bf16()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ the parts
def part_pipelines(report: Report, ctx: "Context") -> None:
    """The demo-size JOIN through every pipeline (module docstring)."""
    from retrieval_core.training.config import TrainConfig
    from retrieval_core.training.train import TrainPlan
    from retrieval_core.training.train import run as run_train

    s, work, device = ctx.scale, ctx.work, ctx.device
    with report.step("stage"):
        staged = stage(work, "staged-demo", s.images, "demo", PIPELINES_SPLITS)
    with report.step("train"):
        init = os.path.join(work, "model-init")
        model_for("demo", staged, init, s.layers)
        cfg = TrainConfig(steps=s.train_steps, batch_size=min(64, s.images), device=device, progress=False,
                          eval_every=0, checkpoint_every=0)
        model_dir = run_train(TrainPlan(staged=staged, output=os.path.join(work, "model"), base_model=init,
                                        config=cfg))["best_dir"]
    with report.step("encode"):
        emb, summary = encode(staged, model_dir, work, device, ctx.batch_size)
        for modality, m in summary["modalities"].items():
            model_s = m["metrics"].get("inference_batch_latency_micro_secs", (0, 0))[0] / 1e6
            report.row(collection="steps", mode=f"encode {modality}s", collection_size=m["encoded"],
                       quantize=summary.get("quantize", ""),
                       rate_per_s=m["encoded"] / model_s if model_s else None,
                       notes="items / RunInference's model time (collation included)")
    with report.step("index"):
        index = build_index(emb, work)
    ranked = os.path.join(work, "rerank")
    with report.step("rerank"):
        manifest = rerank(staged, emb, index, model_dir, ranked, device, s.k, ctx.batch_size, "auto", s)
        precision = "bf16" if manifest["quantize"] == "bf16" else "fp32"
        _pairs_row(report, manifest, "rerank CE pairs (demo)")
    with report.step("evaluate"):
        recall_rows(report, ranked, staged, s.k, f"demo JOIN ({s.train_steps} steps)", precision)
    other = "fp32" if precision == "bf16" else ("bf16" if bf16_here(device) else None)
    if other is None:
        report.verdict(f"bf16 - fp32: not measured ({device} has no native bf16)")
        return
    other_dir = os.path.join(work, f"rerank-{other}")
    with report.step("rerank other precision"):
        rerank(staged, emb, index, model_dir, other_dir, device, s.k, ctx.batch_size,
               "bf16" if other == "bf16" else "none", s)
    with report.step("paired"):
        _paired_rows(report, ranked if precision == "bf16" else other_dir, other_dir if precision == "bf16" else ranked,
                     staged, s, device, model_dir)


def _pairs_row(report: Report, manifest: dict, label: str) -> float:
    pairs = int(manifest["ce_pairs_scored"])
    wall = float(manifest["wall_s"])
    rate = pairs / wall if wall else 0.0
    report.row(collection="steps", mode=label, ce_pairs=pairs, wall_s=wall, rate_per_s=rate,
               quantize=manifest["quantize"], notes=f"CE pairs / the rerank job's wall ({manifest['waves_run']} "
                                                    f"Beam waves; their start-up and the search included)")
    report.log(f"{label}: {pairs:,} pairs in {wall:.1f} s = {rate:,.0f} pairs/s, {manifest['waves_run']} waves")
    return rate


def _paired_rows(report: Report, bf16_dir: str, fp32_dir: str, staged: str, s: Scale, device: str,
                 model_dir: str) -> None:
    from benchmarks.evaluate import evaluate_ranking

    res = evaluate_ranking(bf16_dir, staged, mode="co", k=s.k, against=fp32_dir)
    for r in _result_rows(res):
        d = r["direction"]
        delta = {f"delta_{m}{e}": getattr(res["delta"][f"{d}_{m}" if m != "mR" else "mR"], attr)
                 for m in ("R@1", "R@5", "R@10", "mR") for e, attr in (("", "estimate"), ("_lo", "lo"), ("_hi", "hi"))}
        report.row(model="demo JOIN", mode="CO", k=s.k, quantize="bf16", **r, **delta,
                   notes="bf16 CE minus fp32 CE on the same queries: paired 95 % intervals")
        report.verdict(f"bf16 - fp32 CO {d}: R@1 {delta['delta_R@1']:+.2f} [{delta['delta_R@1_lo']:+.2f}, "
                       f"{delta['delta_R@1_hi']:+.2f}] (paired 95 % interval; informational)")
    diff = res.get("score_diff")
    if diff:
        report.verdict(f"CE scores bf16 vs fp32: {json.dumps(diff, default=str)} (informational)")


def part_co5k(report: Report, ctx: "Context") -> None:
    """The 5k CO of a BERT-base-size CE through pipelines.rerank, against the model alone (module docstring)."""
    s, work, device = ctx.scale, ctx.work, ctx.device
    with report.step("stage"):
        staged = stage(work, "staged-base", s.co_images, "base", {"test": 1.0})
    with report.step("encode"):
        model_dir = os.path.join(work, "model-base")
        model_for("base", staged, model_dir, s.layers)
        emb, _ = encode(staged, model_dir, work, device, ctx.batch_size)
    with report.step("index"):
        index = build_index(emb, work)
    with report.step("rerank"):
        manifest = rerank(staged, emb, index, model_dir, os.path.join(work, "rerank-base"), device, s.k,
                          ctx.batch_size, "auto", s, ctx.collate_workers)
        job_rate = _pairs_row(report, manifest, "rerank CE pairs (base)")
        precision = manifest["quantize"]
    with report.step("model alone"):
        fed = _fed_rate(staged, model_dir, device, precision, ctx.batch_size, s.fed_pairs, report.log)
        report.row(collection="co_5k", mode="CE pairs: model alone (batches collated ahead)", rate_per_s=fed,
                   quantize=precision, batch_size=ctx.batch_size)
    target = GPU_JOB_RATIO if device.startswith("cuda") else CPU_JOB_RATIO
    ratio = job_rate / fed if fed else 0.0
    wall = float(manifest["wall_s"])
    report.row(collection="co_5k", mode="CE pairs: pipelines.rerank", rate_per_s=job_rate, roofline_fraction=ratio,
               wall_s=wall, ce_pairs=manifest["ce_pairs_scored"], quantize=precision,
               collection_size=s.co_images, k=s.k, batch_size=ctx.batch_size,
               notes="roofline_fraction = the job's pairs/s over the model alone's (device fed)")
    report.verdict(f"5k CO through pipelines.rerank: job / device fed {ratio:.2f} (target >= {target}) -> "
                   f"{'met' if ratio >= target else 'MISSED'}")
    if s is SCALES["full"]:
        report.verdict(f"5k CO through pipelines.rerank: {wall:.1f} s (target <= {CO_SECONDS:.0f} s) -> "
                       f"{'met' if wall <= CO_SECONDS else 'MISSED'}")


def _fed_rate(staged: str, model_dir: str, device: str, precision: str, batch_size: int, n: int, log) -> float:
    """CE pairs/s of the model alone on ``n`` of the staged test split's (caption, image) pairs, batches collated
    and on the device beforehand (benchmarks.meters.feeding's "model alone"): what the job's rate is a fraction of."""
    from benchmarks.meters import feeding
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.model.checkpoints import load_model_folder

    ds = StagedDataset(staged)
    caps = ds.captions(split="test")
    table = ds.load_images(caps["image_item_id"].unique().tolist())
    model = load_model_folder(model_dir, quantize=None if precision == "none" else precision, device=device)
    rows = feeding.feeding_rows(model, model_dir, caps["text"].tolist(), table, n, batch_size, precision, reps=1,
                                tasks=("pairs",), log=log, ways=("model",))
    return float(rows[0]["rate_per_s"])


def part_feeding(report: Report, ctx: "Context") -> None:
    """benchmarks.meters.feeding's rows at both sizes, the attention kernels (CUDA), the sweep, collation by workers."""
    import torch

    from benchmarks.meters import feeding
    from retrieval_core.model.quantize import quantize_model

    s, device = ctx.scale, ctx.device
    dev = torch.device(device)
    precisions = ("fp32", "bf16") if bf16_here(device) else ("fp32",)
    common = {k: v for k, v in report.env.items() if k not in ("batch_size",)}
    for size in ("demo", "base"):
        with report.step(size):
            table, texts = feeding.synthetic_data(max(1, -(-s.feed_items // 5)), feeding.SIZES[size]["feature_dim"])
            folder = os.path.join(ctx.work, f"feed-{size}")
            base = feeding.build_model(size, texts, folder, layers=s.layers)
            for prec in precisions:
                model = quantize_model(copy.deepcopy(base), "bf16" if prec == "bf16" else None, device).to(dev).eval()
                rows = feeding.feeding_rows(model, folder, texts, table, s.feed_items, ctx.batch_size, prec, s.reps,
                                            ("pairs", "images"), report.log, {**common, "recipe": size})
                report.rows += [{**r, "suite": "gpu_pipelines"} for r in rows]
                for r in rows:
                    if "job path" in r["mode"]:
                        target = GPU_JOB_RATIO if dev.type == "cuda" else CPU_JOB_RATIO
                        ok = r["roofline_fraction"] >= target
                        report.verdict(f"{size} {r['mode']} {prec}: job / model alone {r['roofline_fraction']:.2f} "
                                       f"(target >= {target}) -> {'met' if ok else 'MISSED'}")
                if dev.type == "cuda" and prec == "bf16":
                    report.rows += attention_rows(model, texts, table, s.feed_items, ctx.batch_size, report.log,
                                                  {**common, "recipe": size, "suite": "gpu_pipelines"})
                del model
    with report.step("sweep"):
        precision = "bf16" if dev.type == "cuda" else "fp32"  # the jobs' own default on each device
        table, texts = feeding.synthetic_data(max(1, -(-s.feed_items // 5)), feeding.SIZES["demo"]["feature_dim"])
        folder = os.path.join(ctx.work, "feed-demo")
        model = quantize_model(feeding.build_model("demo", texts, folder, layers=s.layers),
                               "bf16" if precision == "bf16" else None, device).to(dev).eval()
        swept = []
        for bs in s.sweep:
            swept += feeding.feeding_rows(model, folder, texts, table, s.feed_items, bs, precision, s.reps,
                                          ("pairs", "images"), report.log,
                                          {**common, "batch_size": bs, "recipe": "demo"}, ways=("job", "model"))
        report.rows += [{**r, "suite": "gpu_pipelines", "collection": r["collection"].replace("feeding_", "sweep_")}
                        for r in swept]
        for (task, q), (bs, rate) in feeding.best_batch_sizes(swept).items():
            report.verdict(f"best batch size on {device}, demo {task} {q}: {bs} (job path {rate:,.0f}/s; "
                           f"informational)")
    with report.step("collate"):
        collate_rows(report, ctx)


def collate_rows(report: Report, ctx: "Context") -> None:
    """BERT-base-size CE pairs/s of the handler's collation alone (BatchMaker.pairs into a reused block, as the
    jobs make them) by collating threads: 1, 2, 4, ... up to the machine's cores, interleaved repetitions."""
    import numpy as np
    import torch

    from benchmarks.meters import feeding
    from retrieval_core.data.synthetic.collection import synthetic_collection
    from retrieval_core.data.synthetic.spec import SyntheticSpec
    from retrieval_core.model.collate import BatchMaker, TextCollator

    shape = feeding.SIZES["base"]
    n_images = max(8, -(-ctx.scale.feed_items // 5))
    table, captions = synthetic_collection(SyntheticSpec("collate", n_images, feature_dim=shape["feature_dim"],
                                                         min_regions=shape["max_regions"],
                                                         max_regions=shape["max_regions"]))
    folder = os.path.join(ctx.work, "feed-base")
    model = feeding.build_model("base", captions["text"].tolist(), folder, layers=1)
    texts = model.text_collator().ids(captions["text"].tolist())
    pairs = [(texts[i % len(texts)], table.regions((i // 5) % len(table)))
             for i in range(max(ctx.batch_size * 8, ctx.scale.feed_items))]
    pairs = [(t, (f.astype(np.float16), b)) for t, (f, b) in pairs]  # staged as real features are: float16
    counts = _worker_counts(os.cpu_count() or 1)
    dtype = torch.bfloat16 if ctx.device.startswith("cuda") else torch.float32
    makers = {w: BatchMaker(TextCollator(model.tokenizer, model.cfg.max_text_len), shape["max_regions"], dtype,
                            pin=ctx.device.startswith("cuda"), workers=w, ring=2) for w in counts}
    batches = [pairs[a:a + ctx.batch_size] for a in range(0, len(pairs), ctx.batch_size)]
    times: dict[int, list[float]] = {w: [] for w in counts}
    for rep in range(max(COLLATE_REPS, ctx.scale.reps)):
        for w, make in makers.items():
            make.pairs(*zip(*batches[0]))  # warm: the ring's blocks, the pool's threads
            t0 = time.perf_counter()
            for b in batches:
                make.pairs([t for t, _ in b], [r for _, r in b])
            times[w].append(time.perf_counter() - t0)
    rates = {w: len(pairs) / statistics.median(v) for w, v in times.items()}
    for w, rate in rates.items():
        report.row(collection="collate", mode=f"collate base pairs: {w} threads", rate_per_s=rate,
                   roofline_fraction=rate / rates[1], batch_size=ctx.batch_size, collection_size=len(pairs),
                   notes=f"BatchMaker.pairs of float16 2,048-d x 36-region pairs into a reused "
                         f"{'pinned ' if ctx.device.startswith('cuda') else ''}block, median of "
                         f"{len(times[w])} interleaved repetitions; roofline_fraction = this / 1 thread")
        report.log(f"collate base pairs, {w} threads: {rate:,.0f}/s ({rate / rates[1]:.2f}x one thread)")
    if 2 in rates:
        ok = rates[2] / rates[1] >= 1.8
        report.verdict(f"collation, 2 threads / 1: {rates[2] / rates[1]:.2f}x (target >= 1.8) -> "
                       f"{'met' if ok else 'MISSED'} ({os.cpu_count()} cores)")


def attention_rows(model, texts, table, n: int, batch_size: int, log, common: dict) -> list[dict]:
    """CE pairs/s of the bf16 model (already on CUDA) on ``n`` varied, length-sorted pairs: sdpa as the encoder
    runs it, sdpa with PyTorch's own choice, eager. Scores of each against the first: max abs difference."""
    import numpy as np
    import torch

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


def part_train(report: Report, ctx: "Context") -> None:
    """Seconds per JOIN step (a BE and a CE optimizer step) at both sizes, fp32 and the 16-bit mode (CUDA: bf16
    autocast, TrainConfig.amp; a CPU with native bf16: cpu_bf16), the Trainer's own steps on a staged collection."""
    import torch

    from retrieval_core.data.store import StagedDataset
    from retrieval_core.training.config import TrainConfig
    from retrieval_core.training.train_data import load_split
    from retrieval_core.training.trainer import Trainer

    s, device = ctx.scale, ctx.device
    cuda = device.startswith("cuda")
    precisions = ("fp32", "bf16") if bf16_here(device) else ("fp32",)
    for size in ("demo", "base"):
        with report.step(size):
            staged = stage(ctx.work, f"staged-train-{size}", s.train_images, size)
            base = model_for(size, staged, os.path.join(ctx.work, f"train-init-{size}"), s.layers)
            data = load_split(StagedDataset(staged), "train")
            rates = {}
            for prec in precisions:
                bf16 = prec == "bf16"
                cfg = TrainConfig(steps=s.step_rows + 2, batch_size=min(32, len(data)), device=device, progress=False,
                                  amp=bf16 and cuda, cpu_bf16=bf16 and not cuda, ce_negatives=1)
                model = copy.deepcopy(base).to(torch.device(device))
                trainer = Trainer(model, data, cfg, os.path.join(ctx.work, f"train-{size}-{prec}"))
                model.train()
                trainer.train_step(0)  # untimed: kernels, allocator
                _sync(device)
                seconds = []
                for step in range(1, 1 + s.step_rows):
                    t0 = time.perf_counter()
                    trainer.train_step(step)
                    _sync(device)
                    seconds.append(time.perf_counter() - t0)
                rates[prec] = 1.0 / statistics.median(seconds)
                report.row(collection="training", mode=f"JOIN step ({size}, {prec})", rate_per_s=rates[prec],
                           batch_size=cfg.batch_size, quantize="bf16" if bf16 else "none",
                           notes=f"Trainer.train_step: a BE and a CE optimizer step of {cfg.batch_size} captions "
                                 f"(CE {2 * cfg.batch_size} pairs), median of {len(seconds)} steps after one untimed"
                                 + ("; bf16 autocast" if bf16 else ""))
                report.log(f"train {size} {prec}: {rates[prec]:.2f} JOIN steps/s")
                del model, trainer
            if "bf16" in rates:
                ok = rates["bf16"] >= rates["fp32"]
                report.verdict(f"training {size}: bf16 {rates['bf16']:.2f} vs fp32 {rates['fp32']:.2f} steps/s -> "
                               f"{'met' if ok else 'MISSED'} (16-bit never slower)")


RUNNERS: dict[str, Callable] = {"pipelines": part_pipelines, "co5k": part_co5k, "feeding": part_feeding,
                                "train": part_train}


# ------------------------------------------------------------------------------------------------ entry point
@dataclass(frozen=True)
class Context:
    scale: Scale
    device: str
    work: str
    batch_size: int
    collate_workers: Optional[int]


@dataclass(frozen=True)
class GpuPipelinesPlan(CheckedPlan):
    """The run's options, each a typed field (checked when built)."""
    part: str = option("all", type=click.Choice(PARTS + ("all",)), help="The part to run (all: one after another).")
    scale: str = option("full", type=click.Choice(sorted(SCALES)), help="full: the GPU machine's counts; rehearsal: "
                                                                        "small counts; test: the test suite's.")
    device: str = device_option()
    out: str = option("runs/gpu_pipelines", help="Results: rows.csv and verdicts.txt (a few small files).")
    work: str = option("runs/gpu_work", help="Staged data, models and runs (never under --out).")
    batch_size: int = batch_size_option(256)
    collate_workers: Optional[int] = option(None, type=click.IntRange(min=1),
                                            help="Collating threads of the co5k rerank [the torch threads].")
    threads: Optional[int] = threads_option()
    estimate: bool = option(False, help="Print the full run's estimate per part and exit.")


@plan_command(GpuPipelinesPlan)
def main(**values) -> None:
    """The GPU run's parts (module docstring)."""
    with cli_errors():
        p = plan_from_cli(GpuPipelinesPlan, values)
        if p.estimate:
            lines, _ = estimate_table()
            for line in lines:
                click.echo(line)
            return
        code = run_parts(p)
    sys.exit(code)


def run_parts(p: GpuPipelinesPlan) -> int:
    """Runs the plan's part(s); 0, or 1 after the one line of the first failure."""
    import torch

    from benchmarks.meters.feeding import environment

    out, work = os.path.abspath(p.out), os.path.abspath(p.work)
    if os.path.commonpath([out, work]) == out:
        raise ValueError(f"--work {p.work} lies under --out {p.out}: the device returns only a few files")
    if p.threads:
        torch.set_num_threads(p.threads)
    scale = SCALES[p.scale]
    ctx = Context(scale, p.device, work, p.batch_size, p.collate_workers)
    env = environment(torch.device(p.device), p.threads, p.batch_size)
    parts = PARTS if p.part == "all" else (p.part,)
    rows: list[dict] = []
    verdicts: list[str] = []
    for part in parts:
        estimates = estimate(part, scale)
        report = Report(part, out, env, estimates, rows, verdicts)
        full = sum(estimate(part, SCALES["full"]).values())
        report.log(f"{p.scale} scale on {p.device}: estimate {sum(estimates.values()):.0f} s at this scale on the "
                   f"H200 (the full part: {full:.0f} s)")
        try:
            RUNNERS[part](report, ctx)
        except PartFailed as exc:
            report.write()
            print(str(exc), flush=True)
            return 1
        report.finish()
    return 0


if __name__ == "__main__":
    main()

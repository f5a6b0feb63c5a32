"""Job path against model alone: how much of the model's rate the jobs' host work leaves, on CPU or GPU.

For one model as served (fp32 or bf16 weights) and one set of synthetic images and captions, three ways over the
SAME batches (length-sorted as the jobs sort them), timed interleaved in one process so a shared machine's load
falls on all of them alike:

  job       the Beam jobs' per-batch path: ``VLModelHandler.run_inference`` on the elements the encode / rerank
            readers hand it (captions as token ids from the store, regions as staged), collating each batch
            itself, copying it and returning numpy results (one sync per batch, as RunInference needs them)
  library   ``VLRetrievalModel.score`` / ``encode_image`` / ``encode_text`` (tokenise once, batches collated
            ahead by a worker thread, results gathered with one sync)
  model     the model alone: every batch collated beforehand and already on the device, one sync at the end
            (the ceiling of a job whose host work is done once and overlapped: "device fed")

Rows: ``rate_per_s`` items per second (median over ``reps`` interleaved repetitions) and, for job and library,
``roofline_fraction`` = rate / the model-alone rate of the same run. Tasks: CE pairs, BE images, BE captions.

Models (``build_model``): "demo" (the demo JOIN's shape: 3 layers, 384 wide, 12 regions, 1024-d features) and
"base" (BERT-base: 12 layers, 768 wide, 36 regions, 2048-d), randomly initialised (speed does not depend on the
weights), with a WordPiece vocabulary pruned to the synthetic collection's words, so nothing is downloaded.

    python -m benchmarks.meters.feeding --size demo --items 5000 --device cpu --threads 2 --output feeding.csv
    python -m benchmarks.meters.feeding --sweep 16,32,64,128,256 --tasks pairs,images --output feeding_sweep.csv

``--sweep``: the job path and the model alone at each batch size, and the best size per task and precision: what a
device's default batch size is read from (measured once and committed, never timed inside a job, whose outputs
must not depend on the machine's load).
"""
from __future__ import annotations

import os
import statistics
import string
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import click
import torch

from benchmarks.report import environment as report_environment
from benchmarks.report import write_csv
from pipelines.handlers import TASK_EMBED_IMAGE, TASK_EMBED_TEXT, TASK_SCORE_PAIRS, VLModelHandler, element_length
from retrieval_core.cli import (
    CheckedPlan,
    apply_device_and_threads,
    batch_size_option,
    cli_errors,
    device_option,
    option,
    plan_command,
    plan_from_cli,
    threads_option,
)
from retrieval_core.data.synthetic.collection import synthetic_collection
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.model.collate import to_device
from retrieval_core.model.network import VLModelConfig, VLRetrievalModel
from retrieval_core.model.quantize import quantize_model

#: Model shapes: BertConfig sizes, regions per image and feature width.
SIZES = {
    "demo": dict(hidden_size=384, num_hidden_layers=3, num_attention_heads=12, intermediate_size=1536,
                 max_regions=12, feature_dim=1024),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_regions=36, feature_dim=2048),
}
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TASKS = ("pairs", "images", "captions")
#: The three ways over the same batches (module docstring) and each one's label in the rows' ``mode``.
WAYS = {"job": "job path (handler)", "library": "library loop", "model": "model alone (batches collated ahead)",
        "compiled": "model alone, torch.compile"}
#: The ways measured unless asked otherwise: compiling costs minutes on a CPU (docs/log/PERFORMANCE-2026-11.md),
#: so only on request.
DEFAULT_WAYS = ("job", "library", "model")


def collection_vocab(texts: Sequence[str]) -> list[str]:
    """A WordPiece vocabulary for ``texts``: the special tokens, every lower-cased word and punctuation mark they
    use, and single characters (plain and ##) so any other ASCII word still tokenises without [UNK]."""
    import re

    words = sorted({w for t in texts for w in re.findall(r"[a-z0-9]+|[^\sa-z0-9]", t.lower())})
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = SPECIAL_TOKENS + words + [c for c in chars if c not in words]
    return list(dict.fromkeys(vocab + ["##" + c for c in string.ascii_lowercase + string.digits]))


def build_model(size: str, texts: Sequence[str], folder: str, seed: int = 0,
                layers: Optional[int] = None) -> VLRetrievalModel:
    """A randomly initialised VLRetrievalModel of ``size`` (SIZES; ``layers``: that many encoder layers instead of
    the size's, its input shapes kept) with a vocabulary pruned to ``texts`` (collection_vocab), saved to
    ``folder`` (a model folder the jobs load)."""
    from transformers import BertConfig, BertTokenizerFast

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    shape = dict(SIZES[size])
    if layers is not None:
        shape["num_hidden_layers"] = int(layers)
    max_regions, feature_dim = shape.pop("max_regions"), shape.pop("feature_dim")
    os.makedirs(folder, exist_ok=True)
    vocab = collection_vocab(texts)
    # transformers 5 takes the vocabulary itself: given vocab_file= it builds a 5-token tokenizer, every word [UNK]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    if tokenizer.vocab_size != len(vocab):
        raise RuntimeError(f"tokenizer has {tokenizer.vocab_size} tokens, the vocabulary {len(vocab)}")
    config = BertConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=512, type_vocab_size=2,
                        pad_token_id=0, **shape)
    torch.manual_seed(seed)
    model = VLRetrievalModel(config, VLModelConfig(feature_dim=feature_dim, max_regions=max_regions,
                                                   ce_agreement="maxsim"), tokenizer)
    model.save(folder)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _job_batches(task: str, elements: list, batch_size: int) -> list[list]:
    """The elements in the jobs' batches: sorted by (padded-length proxy, position), cut every batch_size."""
    order = sorted(range(len(elements)), key=lambda i: (element_length(task, elements[i]), i))
    return [[elements[i] for i in order[a:a + batch_size]] for a in range(0, len(order), batch_size)]


def feeding_rows(model: VLRetrievalModel, model_dir: str, texts: Sequence[str], images, n: int, batch_size: int,
                 precision: str, reps: int = 3, tasks: Sequence[str] = TASKS, log: Callable = print,
                 common: Optional[dict] = None, ways: Sequence[str] = DEFAULT_WAYS) -> list[dict]:
    """Rows of the job, library and model-alone rates (module docstring) of ``model`` (already served in
    ``precision``, on its device) on ``n`` items of each task: CE pairs (caption i with image i // 5, the
    synthetic collection's layout), BE images and BE captions. ``images``: an ImageTable. ``ways``: a subset of
    WAYS (the model alone always: the others' fractions are of its rate). "compiled" is the model alone through
    ``torch.compile(dynamic=True)``: its first pass over the batches (compilation included) is timed apart, and its
    notes give the model time after which compiling pays back in a job."""
    unknown = sorted(set(ways) - set(WAYS))
    if unknown or "model" not in ways:
        raise ValueError(f"ways must be of {sorted(WAYS)} and hold 'model', got {list(ways)}")
    dev = model.device
    make = model.batch_maker()
    ids = make.text_collator.ids(list(texts[:n]))
    regions = [images.regions(i) for i in range(len(images))]
    handler_task = {"pairs": TASK_SCORE_PAIRS, "images": TASK_EMBED_IMAGE, "captions": TASK_EMBED_TEXT}
    rows = []
    for task in tasks:
        count = n  # the collection's captions and images repeated up to n where it has fewer
        if task == "pairs":
            elements = [(ids[i % len(ids)], *regions[(i // 5) % len(regions)]) for i in range(count)]
            lib = lambda: model.score([e[0] for e in elements], [(e[1], e[2]) for e in elements],  # noqa: E731
                                      batch_size=batch_size, device=str(dev))
        elif task == "images":
            elements = [regions[i % len(regions)] for i in range(count)]
            lib = lambda: model.encode_image(elements, batch_size=batch_size, device=str(dev))  # noqa: E731
        else:
            elements = [ids[i % len(ids)] for i in range(count)]
            lib = lambda: model.encode_text(elements, batch_size=batch_size, device=str(dev))  # noqa: E731
        htask = handler_task[task]
        batches = _job_batches(htask, elements, batch_size)
        handler = VLModelHandler(model_dir, htask, device=dev.type, max_batch_size=batch_size)
        fed = [to_device(handler.collate(b, model), dev) for b in batches]  # collated ahead, on the device
        forward = getattr(model, htask)

        def job(upto=None):
            for b in batches[:upto]:
                handler.run_inference(b, model)

        def alone(upto=None):
            with torch.inference_mode():
                out = [forward(b) for b in fed[:upto]]
            _sync(dev)
            return out

        first_pass = None
        if "compiled" in ways:
            compiled_forward = torch.compile(forward, dynamic=True)

            def compiled(upto=None):
                with torch.inference_mode():
                    out = [compiled_forward(b) for b in fed[:upto]]
                _sync(dev)
                return out

            t0 = time.perf_counter()
            compiled()  # every batch shape once: compilation and any recompilation it triggers
            first_pass = time.perf_counter() - t0
        ways_run = {k: v for k, v in {"job": job, "library": lib, "model": alone,
                                      "compiled": compiled if first_pass is not None else None}.items() if k in ways}
        job(2)  # warm-up on the first batches: allocator, kernels, OpenMP pool (the library loop runs the same)
        alone(2)
        times = {k: [] for k in ways_run}
        for _ in range(reps):
            for name, fn in ways_run.items():
                _sync(dev)
                t0 = time.perf_counter()
                fn()
                _sync(dev)
                times[name].append(time.perf_counter() - t0)
        fed.clear()  # the device copies go before the next task
        rates = {k: count / statistics.median(v) for k, v in times.items()}
        medians = ", ".join(f"{statistics.median(v):.2f}" for v in times.values())
        log(f"feeding {task} {precision} on {dev}, batch {batch_size}: " + ", ".join(
            f"{way} {rate:,.0f}/s" for way, rate in rates.items()) + "; " + ", ".join(
            f"{way} / model {rates[way] / rates['model']:.2f}" for way in rates if way != "model"))
        for way in ways_run:
            label = WAYS[way]
            extra = ""
            if way == "compiled":  # compile cost c = first pass - steady pass; saved per model second: 1 - 1/speedup
                cost = first_pass - statistics.median(times["compiled"])
                gain = 1.0 - rates["model"] / rates["compiled"]
                extra = (f"; first pass (compiling) {first_pass:.1f} s, compile cost {cost:.1f} s: pays back after "
                         + (f"{cost / gain:.0f} s of eager model time" if gain > 0 else "never (no faster)"))
                log(f"feeding {task} {precision}: torch.compile {rates['compiled'] / rates['model']:.2f}x the eager "
                    f"model" + extra)
            rows.append({**(common or {}), "suite": "latency", "collection": f"feeding_{task}",
                         "collection_size": count, "mode": f"{task}: {label}", "rate_per_s": rates[way],
                         "roofline_fraction": rates[way] / rates["model"], "quantize": precision,
                         "device": str(dev), **(common or {}), "batch_size": batch_size, "measured": True,
                         "notes": (f"{task} per second, median of {reps} repetitions interleaved with the other "
                                   f"way(s) in one process ({medians} s: {', '.join(ways_run)}); "
                                   f"roofline_fraction = this way / model alone{extra}")})
    return rows


def best_batch_sizes(rows: Sequence[dict], way: str = "job") -> dict[tuple[str, str], tuple[int, float]]:
    """Per (task, precision) of a batch-size sweep's rows: the batch size whose ``way`` (WAYS) rate was highest,
    with that rate. What a device's default batch size is read from (docs/log/PERFORMANCE-2026-11.md), never chosen
    inside a job: a size picked by timing would make a job's batches, and so its outputs' rounding, vary between
    reruns."""
    best: dict[tuple[str, str], tuple[int, float]] = {}
    for r in rows:
        if r["mode"] != f"{r['collection'].removeprefix('feeding_')}: {WAYS[way]}":
            continue
        key = (r["collection"].removeprefix("feeding_"), r["quantize"])
        if key not in best or r["rate_per_s"] > best[key][1]:
            best[key] = (int(r["batch_size"]), float(r["rate_per_s"]))
    return best


def synthetic_data(n_images: int, feature_dim: int, seed: int = 0):
    """(ImageTable, caption texts) of the project's synthetic generator: ``n_images`` images, 5 captions each."""
    table, captions = synthetic_collection(SyntheticSpec("feeding", n_images, seed=seed, feature_dim=feature_dim))
    return table, captions["text"].tolist()


def environment(device: torch.device, threads: Optional[int], batch_size: int) -> dict:
    """The suites' environment columns (commit and date included, so the CSV can be published) for these rows."""
    return {**report_environment(str(device), batch_size, threads), "model": "random-init", "direction": ""}


@dataclass(frozen=True)
class FeedingPlan(CheckedPlan):
    """The measurement's options, each a typed field (checked when built)."""
    size: str = option("demo", type=click.Choice(sorted(SIZES)), help="Model shape.")
    items: int = option(5000, type=click.IntRange(min=1), help="CE pairs, images and captions per task.")
    device: str = device_option()
    threads: Optional[int] = threads_option()
    batch_size: int = batch_size_option(128)
    precisions: str = option("fp32,bf16", help="fp32 and/or bf16 (comma-separated).")
    tasks: str = option(",".join(TASKS), help="pairs, images, captions.")
    reps: int = option(3, type=click.IntRange(min=1))
    sweep: str = option("", help="Comma-separated batch sizes: the job path and the model alone at each size (rows "
                                 "per size; the best size per task and precision printed) instead of the three "
                                 "ways at --batch-size.")
    compile: bool = option(False, help="Also the model alone through torch.compile (its compile time and after how "
                                       "much model time it pays back).")
    workdir: str = option("runs/feeding", help="Where the model folder is written.")
    output: Optional[str] = option(None, help="CSV to write (report.CSV_COLUMNS) [print only].")


@plan_command(FeedingPlan)
def main(**values) -> None:
    """Job path, library loop and model alone on the same batches (module docstring)."""
    with cli_errors():
        p = plan_from_cli(FeedingPlan, values)
        apply_device_and_threads(p.device, p.threads)
        measure(p.size, p.items, p.device, p.threads, p.batch_size, p.precisions, p.tasks, p.reps, p.workdir,
                p.output, parse_sizes(p.sweep), p.compile)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"32,64,128"`` -> (32, 64, 128); anything but positive integers is an error."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isdigit() and int(t) > 0 for t in parts):
        raise ValueError(f"--sweep: batch sizes must be positive integers, got {text!r}")
    return tuple(int(t) for t in parts)


def measure(size, items, device, threads, batch_size, precisions, tasks, reps, workdir, output,
            sweep: Sequence[int] = (), compile_model: bool = False) -> list[dict]:
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    wanted = [p.strip() for p in precisions.split(",") if p.strip()]
    bad = [p for p in wanted if p not in ("fp32", "bf16")] + [t for t in tasks.split(",") if t not in TASKS]
    if bad:
        raise ValueError(f"unknown precision or task {bad} (--precisions fp32,bf16; --tasks {','.join(TASKS)})")
    feature_dim = SIZES[size]["feature_dim"]
    table, texts = synthetic_data(max(1, -(-items // 5)), feature_dim)
    rows = []
    log = lambda m: click.echo(f"[{time.strftime('%H:%M:%S')}] {m}")  # noqa: E731
    for precision in wanted:
        model = build_model(size, texts, os.path.join(workdir, f"model-{size}"))
        model = quantize_model(model, "bf16" if precision == "bf16" else None, str(dev)).to(dev).eval()
        for bs in sweep or (batch_size,):
            rows += feeding_rows(model, os.path.join(workdir, f"model-{size}"), texts, table, items, bs,
                                 precision, reps, tasks.split(","), log=log,
                                 common={**environment(dev, threads, bs), "recipe": size},
                                 ways=("job", "model") if sweep else DEFAULT_WAYS
                                 + (("compiled",) if compile_model else ()))
    if sweep:
        for (task, precision), (bs, rate) in best_batch_sizes(rows).items():
            log(f"best batch size on {dev}, {task} {precision}: {bs} (job path {rate:,.0f}/s)")
    if output:
        write_csv(output, rows)
        click.echo(f"wrote {output}: {len(rows)} rows")
    return rows


if __name__ == "__main__":
    main()

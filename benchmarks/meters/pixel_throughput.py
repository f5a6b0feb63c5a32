"""Images per second of staging from pixels: JPEG decode + resize to 224, EfficientNet-Lite0 grid regions, and the
whole pipelines.stage job, measured in one run so their ratios hold on a shared machine.

Rows: ``decode`` (read + decode + EXIF + RGB + resize, one thread); the backbone alone on decoded batches:
``backbone_plain`` (the reference modules, BatchNorm folded: a pad copy and a ReLU6 pass per layer, the whole
batch at once), ``backbone_float32`` and, where the CPU computes bf16 natively (or on CUDA),
``backbone_bfloat16`` (the fused path the stager runs); ``library_inline`` and ``library`` (retrieval_core's
image_files reader, what one stage worker runs: decoding between batches, ``decode_threads`` 0, and with the
plan's decode threads working ahead) and, unless ``--no-stage``, ``stage`` (the Beam job on the folder,
DirectRunner, launch included). ``library`` and ``stage`` run the plan's ``--precision``. The same command on a
GPU machine (``--device cuda``) is the GPU step; its decode row says how many CPU decoders a GPU needs::

    python -m benchmarks.meters.pixel_throughput --images 512 --threads 2 --output runs/pixels_cpu.json
    python -m benchmarks.meters.pixel_throughput --images 4096 --device cuda --batch-size 256 --decode-threads 12 \
        --output runs/pixels_gpu.json
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional

import click
import numpy as np

from benchmarks.report import cpu_model, gemm_gflops
from retrieval_core.cli import (
    apply_device_and_threads,
    batch_size_option,
    cli_errors,
    device_option,
    option,
    plan_command,
    plan_from_cli,
    threads_option,
)
from retrieval_core.precision import cpu_has_native_bf16


@dataclass(frozen=True, kw_only=True)
class ThroughputPlan:
    images: int = option(512, type=click.IntRange(min=8), help="JPEGs staged (copies of the source photos)")
    source: Optional[str] = option(None, help="folder of JPEGs to copy from [$RR_SHARED_DIR's AllenNLP fixture "
                                              "photos, else rendered demo scenes saved as JPEG]")
    device: str = device_option("cpu")  # cpu, not auto: the plain command is the CPU measurement (module doc)
    threads: Optional[int] = threads_option()
    batch_size: int = batch_size_option(64, help="images per backbone call")
    decode_threads: int = option(1, type=click.IntRange(min=0), help="files decoded ahead in parallel "
                                 "(image_files decode_threads; 0 = between batches; a GPU needs several)")
    grids: str = option("1,3", help="grid sizes (image_files grids)")
    precision: str = option("float32", type=click.Choice(["float32", "bfloat16"]),
                            help="backbone arithmetic of the library and stage rows (image_files precision)")
    no_stage: bool = option(False, help="skip timing the pipelines.stage job on the folder")
    output: Optional[str] = option(None, help="JSON to write [print only]")


def _source_jpegs(source: Optional[str], folder: str) -> list[str]:
    """The photos to copy: ``source``'s JPEGs, the real fixture photos, or rendered scenes written as JPEG."""
    if source is None:
        real = os.environ.get("RR_SHARED_DIR")
        subs = (("realdata",), ()) if real else ()
        cands = [os.path.join(real, *sub, "allennlp_vision_fixtures", "images") for sub in subs]
        source = next((c for c in cands if os.path.isdir(c)), None)
    if source:
        found = sorted(os.path.join(r, n) for r, _, ns in os.walk(source) for n in ns if n.lower().endswith(".jpg"))
        if found:
            return found
    from retrieval_core.data.manifest import load_manifest
    from retrieval_core.data.synthetic.render import render_scene

    spec = load_manifest("demo").synthetic_spec("demo")
    out = []
    for i in range(16):
        path = os.path.join(folder, f"_scene{i}.jpg")
        render_scene(spec, i, scale=1.0).save(path, "JPEG", quality=90)
        out.append(path)
    return out


class _Clock:
    """Wall and process CPU time since creation. Images per CPU-second (every thread of this process, the
    in-process stage job's included) is the row's cost, which other jobs on the machine disturb far less than
    its wall-clock rate; 2 cores at full use would give twice it."""
    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def row(self, rows: dict, cpu_rows: dict, name: str, images: int) -> None:
        rows[name] = images / (time.perf_counter() - self.wall)
        cpu_rows[name] = images / max(time.process_time() - self.cpu, 1e-9)


def measure(plan: ThroughputPlan) -> dict:
    import torch

    from retrieval_core.data.pixels.backbone import MEAN, STD, cached_backbone, parse_grids
    from retrieval_core.data.pixels.decode import decode_image
    from retrieval_core.data.readers.images import read_image_files

    apply_device_and_threads(plan.device, plan.threads)
    work = tempfile.mkdtemp(prefix="pixel_throughput_")
    try:
        photos = os.path.join(work, "photos")
        os.makedirs(photos)
        sources = _source_jpegs(plan.source, work)
        paths = []
        for i in range(plan.images):
            paths.append(os.path.join(photos, f"{i:06d}.jpg"))
            shutil.copy(sources[i % len(sources)], paths[-1])
        sizes = [decode_image(open(p, "rb").read(), 224).width for p in sources]
        grids = parse_grids(plan.grids)
        cuda = plan.device.startswith("cuda")
        precisions = ["float32"] + (["bfloat16"] if cuda or cpu_has_native_bf16() else [])
        backbones = {p: cached_backbone(grids, plan.device, p) for p in precisions}
        rows, cpu_rows = {}, {}
        gemm = gemm_gflops(plan.device)

        clock = _Clock()
        pixels = np.stack([decode_image(open(p, "rb").read(), 224).pixels for p in paths])
        clock.row(rows, cpu_rows, "decode", plan.images)

        def plain(batch):  # the reference modules, as the stager ran them before the fused path
            with torch.inference_mode():
                x = torch.from_numpy(batch).to(plan.device).permute(0, 3, 1, 2).float()
                return backbones["float32"].model.features((x - MEAN) / STD).cpu()

        runs = {"backbone_plain": plain, **{f"backbone_{p}": b.regions for p, b in backbones.items()}}
        for name, fn in runs.items():
            fn(pixels[:plan.batch_size])  # warm-up (first call allocates, CUDA initialises)
            if cuda:
                torch.cuda.synchronize()
            clock = _Clock()
            for a in range(0, plan.images, plan.batch_size):
                fn(pixels[a:a + plan.batch_size])
            if cuda:
                torch.cuda.synchronize()
            clock.row(rows, cpu_rows, name, plan.images)

        for name, threads in (("library_inline", 0), ("library", plan.decode_threads)):
            clock = _Clock()
            n = sum(1 for _ in read_image_files(paths, None, plan.device, grids=list(grids),
                                                batch_size=plan.batch_size, decode_threads=threads,
                                                precision=plan.precision))
            clock.row(rows, cpu_rows, name, n)

        if not plan.no_stage:
            from pipelines.stage import run as stage_run
            from pipelines.stage.plan import StagePlan

            manifest = os.path.join(work, "m.yaml")
            with open(manifest, "w") as f:
                f.write(f"name: throughput\nfeature_dim: 1280\ncollections:\n  photos:\n    images: "
                        f"{{format: image_files, path: {photos}, grids: {list(grids)}, batch_size: {plan.batch_size}, "
                        f"decode_threads: {plan.decode_threads}, precision: {plan.precision}}}"
                        f"\n    captions: {{format: caption_lines, path: {work}/caps.txt, ids_path: {work}/ids.txt}}\n")
            with open(os.path.join(work, "caps.txt"), "w") as f:
                f.write("".join(f"photo {i}\n" for i in range(plan.images)))
            with open(os.path.join(work, "ids.txt"), "w") as f:
                f.write("".join(f"{i:06d}\n" for i in range(plan.images)))
            clock = _Clock()
            summary = stage_run.run(StagePlan(os.path.join(work, "staged"), manifest, device=plan.device,
                                              threads=plan.threads))
            clock.row(rows, cpu_rows, "stage", summary["collections"]["photos"]["images"]["staged"])
        return {"images_per_s": {k: round(v, 1) for k, v in rows.items()},
                "images_per_cpu_s": {k: round(v, 1) for k, v in cpu_rows.items()},
                "backbone_over_stage": round(rows[f"backbone_{plan.precision}"] / rows["stage"], 2)
                if "stage" in rows else None,
                "gemm_gflops": round(gemm, 1), "load_average": os.getloadavg()[0],
                "images": plan.images, "source_photos": len(sources), "source_widths": sorted(set(sizes)),
                "device": plan.device, "torch_threads": torch.get_num_threads(), "cpu": cpu_model(),
                "cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name() if plan.device.startswith("cuda") else None,
                "date": time.strftime("%Y-%m-%d"), "plan": asdict(plan)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


@plan_command(ThroughputPlan)
def main(**values):
    """Images per second of staging from pixels: JPEG decode + resize to 224, EfficientNet-Lite0 grid regions,
    and the whole pipelines.stage job, measured in one run so their ratios hold on a shared machine."""
    with cli_errors():
        plan = plan_from_cli(ThroughputPlan, values)
        result = measure(plan)
    text = json.dumps(result, indent=2)
    click.echo(text)
    if plan.output:
        os.makedirs(os.path.dirname(os.path.abspath(plan.output)), exist_ok=True)
        with open(plan.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

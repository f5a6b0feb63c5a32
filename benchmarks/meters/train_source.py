"""The training source's rate and memory (issue 55, item 4): the step rate of a recipe's training with the streamed
source (regions read by position from the staged folder's region file) against the in-memory table, over the SAME
steps and batches, and the source's own batch rate alone; the peak anonymous memory of each.

Every measurement is a child process of its own (a fresh interpreter: its memory peak is its own), run interleaved
in one invocation (memory, streamed, streamed, memory, ...) so a shared machine's load falls on both alike:

  train   resume the recipe's run from a checkpoint at step ``--start`` (made once, here) and train ``--steps``
          steps: its mining at ``--start`` (the BE encodes every train image from the source) and the JOIN steps
          after it. ``steps_per_s`` counts the steps after the first two (the mining step, and the step after it,
          whose CE reads are made on its path), wall clock from one step's start to the next's (the read-ahead
          wait included), and ``median_step_s`` their median (less swayed by a burst of other jobs);
          ``mining_s`` is the mining's own seconds; ``losses_equal`` says whether the run's losses are bit for
          bit those of the first in-memory run.
  source  the reads alone, no model: each of the same steps' images (its batch's and its CE groups') read from
          the source, ``steps_per_s`` the steps read per second on one thread.

Memory: ``peak_rss_anon_mb`` the highest RssAnon of /proc/self/status sampled every 5 ms by a thread (anonymous
memory: the table, the model and its activations; not the page cache a pread fills, nor mapped libraries),
``vm_hwm_mb`` the kernel's high-water resident set (libraries included).

    python -m benchmarks.meters.train_source --staged runs/staged_demo --work runs/train_source \\
        --output docs/results/train_source.csv --recipe demo --repeats 3
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Optional

import click

from benchmarks.report import cpu_flags, cpu_model, source_commit
from retrieval_core.cli import CheckedPlan, option, plan_command, plan_from_cli, to_argv
from retrieval_core.training.recipes import RECIPES

COLUMNS = ("measurement", "recipe", "source", "rep", "order", "steps", "first_step", "steps_per_s", "median_step_s",
           "mining_s",
           "startup_s", "wall_s", "losses_equal", "peak_rss_anon_mb", "vm_hwm_mb", "table_mb", "region_file_mb",
           "cpu_bf16", "device", "cpu_model", "cpu_flags", "threads", "torch", "faiss", "commit", "date", "load_avg",
           "command")
SOURCES = ("memory", "streamed")


class AnonPeak:
    """The highest RssAnon of this process, sampled every ``every`` seconds by a daemon thread."""

    def __init__(self, every: float = 0.005):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    @staticmethod
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) << 10
        return 0

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.status("RssAnon"))
            time.sleep(every)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.status("RssAnon"))
        return {"peak_rss_anon_mb": round(self.peak / 2**20, 1), "vm_hwm_mb": round(self.status("VmHWM") / 2**20, 1)}


# ---------------------------------------------------------------------------------------------------- set-up
def _setup(staged_dir: str, recipe_name: str, source: str, cpu_bf16: bool):
    """(trainer config, model, train data, dev data, region file or None, seconds) as the train CLI builds them."""
    from retrieval_core.data.region_file import ensure_region_file
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.training.model_init import build_model
    from retrieval_core.training.train_data import load_split

    t0 = time.perf_counter()
    recipe = RECIPES[recipe_name]
    cfg = replace(recipe.join, progress=False, cpu_bf16=cpu_bf16)
    staged = StagedDataset(staged_dir)
    model = build_model(recipe.base_model, staged.feature_dim, recipe.halve_layers, cfg.seed, recipe.ce_agreement,
                        staged.image_backbone)
    model.cfg.max_regions = recipe.max_regions
    regions = ensure_region_file(staged, recipe.max_regions) if source == "streamed" else None
    train = load_split(staged, "train", None, cfg.seed, recipe.languages, regions)
    dev = load_split(staged, "dev", languages=recipe.languages, regions=regions)
    return cfg, model, train, dev, regions, time.perf_counter() - t0


def _table_mb(data) -> float:
    from retrieval_core.data.region_file import StreamedImages

    images = data.images
    if isinstance(images, StreamedImages):
        return 0.0
    return round((images.features.nbytes + images.boxes.nbytes) / 1e6, 1)


def prepare(staged_dir: str, work: str, recipe: str, start: int, cpu_bf16: bool) -> str:
    """The checkpoint of the recipe's run at ``start`` (trained once, streamed: both sources train the same steps),
    and one at ``start + 1`` (after its mining: the source-alone runs plan the CE groups from its negatives)."""
    from retrieval_core.training.trainer import Trainer

    folder = os.path.join(work, f"ckpt-{recipe}-{start}{'-bf16' if cpu_bf16 else ''}")
    if os.path.isfile(os.path.join(folder, "after", "last", "trainer_state.json")):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    cfg, model, train, dev, _, _ = _setup(staged_dir, recipe, "streamed", cpu_bf16)
    out = os.path.join(folder, "run")
    trainer = Trainer(model, train, cfg, out, dev)
    trainer.train(stop_at=start)
    shutil.copytree(os.path.join(out, "last"), os.path.join(folder, "at", "last"))
    trainer.train(stop_at=start + 1)
    shutil.copytree(os.path.join(out, "last"), os.path.join(folder, "after", "last"))
    return folder


# ----------------------------------------------------------------------------------------------------- children
def child_train(staged_dir: str, recipe: str, source: str, ckpt: str, out: str, start: int, steps: int,
                cpu_bf16: bool) -> dict:
    from retrieval_core.training.trainer import Trainer

    meter, begin = AnonPeak(), time.perf_counter()
    cfg, model, train, dev, regions, setup_s = _setup(staged_dir, recipe, source, cpu_bf16)
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(os.path.join(ckpt, "at", "last"), os.path.join(out, "last"))
    trainer = Trainer(model, train, cfg, out, dev)
    startup = setup_s + time.perf_counter() - t0  # splits loaded (or the file opened), model built, neighbours
    starts: list[float] = []
    step_fn = trainer.train_step

    def timed(step):
        starts.append(time.perf_counter())
        return step_fn(step)

    trainer.train_step = timed
    trainer.train(resume=True, stop_at=start + steps)
    starts.append(time.perf_counter())  # a bound past the last step (its checkpoint write excluded below)
    walls = [b - a for a, b in zip(starts, starts[1:])]
    log = [json.loads(line) for line in open(os.path.join(out, "train_log.jsonl"))]
    mining = [r["mined"]["seconds"] for r in log if "mined" in r and r["step"] >= start]
    losses = [(r["step"], r["objective"], r["loss"]) for r in log if "loss" in r and r["step"] > start]
    timed_walls = walls[2:-1]  # the mining step and the next out; the last step's wall holds the final save
    return {"steps_per_s": round(len(timed_walls) / sum(timed_walls), 4), "steps": len(timed_walls),
            "median_step_s": round(statistics.median(timed_walls), 4),
            "first_step": start + 2, "mining_s": round(sum(mining), 2), "startup_s": round(startup, 2),
            "wall_s": round(time.perf_counter() - begin, 1),
            "losses": losses, "table_mb": _table_mb(train) + _table_mb(dev),
            "region_file_mb": round(regions.nbytes / 1e6, 1) if regions is not None else 0.0, **meter.stop()}


def child_source(staged_dir: str, recipe: str, source: str, ckpt: str, start: int, steps: int, cpu_bf16: bool
                 ) -> dict:
    """The reads of steps start+1 .. start+steps-1 alone (their CE groups planned from the negatives mined at
    ``start``), on this thread, no model run."""
    import numpy as np

    from retrieval_core.training.trainer import Trainer

    meter = AnonPeak()
    cfg, model, train, dev, regions, _ = _setup(staged_dir, recipe, source, cpu_bf16)
    trainer = Trainer(model, train, cfg, os.path.join(ckpt, "after"), dev)
    trainer.load_state(os.path.join(ckpt, "after", "last"))
    plans = []
    for step in range(start + 1, start + steps):
        caps = trainer._batch_indices(step)
        imgs = trainer._ce_groups(caps[:cfg.ce_batch_size], step)[1].reshape(-1)
        plans.append(np.unique(np.concatenate([train.image_pos[caps], imgs])))
    t0 = time.perf_counter()
    read_bytes = 0
    for positions in plans:
        for feats, boxes in train.images.read(positions):
            read_bytes += feats.nbytes + boxes.nbytes
    seconds = time.perf_counter() - t0
    return {"steps_per_s": round(len(plans) / seconds, 2), "steps": len(plans), "first_step": start + 1,
            "mb_per_step": round(read_bytes / len(plans) / 1e6, 2), "table_mb": _table_mb(train) + _table_mb(dev),
            "region_file_mb": round(regions.nbytes / 1e6, 1) if regions is not None else 0.0, **meter.stop()}


def _run_child(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, "-m", "benchmarks.meters.train_source", *args],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"child {' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------- CLI
@dataclass(frozen=True)
class MeterPlan(CheckedPlan):
    """One meter run; ``child``, ``source``, ``ckpt`` and ``out`` are set by the meter for its children."""
    staged: str = option(help="A staged folder (the demo's: pipelines.stage --manifest demo).")
    work: str = option(help="Scratch folder (checkpoints, the children's outputs).")
    output: str = option(help="CSV to append the rows to.")
    recipe: str = option("demo", type=click.Choice(sorted(RECIPES)), help="The recipe whose JOIN trains.")
    repeats: int = option(3, type=click.IntRange(min=1), help="Repetitions of each source, interleaved.")
    start: int = option(40, type=click.IntRange(min=1), help="The step the timed runs resume from (a mining step).")
    steps: int = option(30, type=click.IntRange(min=4), help="Steps each timed run trains.")
    cpu_bf16: bool = option(False, help="bf16 autocast for the training steps (the trainer's --cpu-bf16).")
    child: Optional[str] = option(None, type=click.Choice(["train", "source"]), help="(internal) a child's role.")
    source: Optional[str] = option(None, type=click.Choice(SOURCES), help="(internal) a child's source.")
    ckpt: Optional[str] = option(None, help="(internal) the checkpoint folder a child starts from.")
    out: Optional[str] = option(None, help="(internal) a training child's output folder.")


@plan_command(MeterPlan)
def main(**values) -> None:
    """Step rate and peak anonymous memory of training with the streamed source against the in-memory table,
    interleaved, each in a child process; one CSV row per measurement."""
    plan = plan_from_cli(MeterPlan, values)
    staged, work, output, recipe, start, steps = plan.staged, plan.work, plan.output, plan.recipe, plan.start, \
        plan.steps
    if plan.child is not None:
        result = child_train(staged, recipe, plan.source, plan.ckpt, plan.out, start, steps, plan.cpu_bf16) \
            if plan.child == "train" else child_source(staged, recipe, plan.source, plan.ckpt, start, steps,
                                                       plan.cpu_bf16)
        print(json.dumps(result))
        return
    import faiss
    import torch

    env = {"recipe": recipe, "cpu_bf16": plan.cpu_bf16, "device": "cpu", "cpu_model": cpu_model(),
           "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "faiss": faiss.__version__, "commit": source_commit(), "date": datetime.date.today().isoformat(),
           "command": " ".join(["python -m benchmarks.meters.train_source", *sys.argv[1:]])}
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    folder = prepare(staged, work, recipe, start, plan.cpu_bf16)
    print(f"checkpoint at step {start}: {folder} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows, reference, order = [], None, 0
    for measurement in ("train", "source"):
        for rep in range(plan.repeats):
            for src in SOURCES if rep % 2 == 0 else SOURCES[::-1]:  # memory, streamed, streamed, memory, ...
                result = _run_child(to_argv(replace(plan, child=measurement, source=src, ckpt=folder,
                                                    out=os.path.join(work, f"run-{src}"))))
                order += 1
                losses = result.pop("losses", None)
                if losses is not None and reference is None and src == "memory":
                    reference = losses
                row = {**env, "measurement": measurement, "source": src, "rep": rep, "order": order,
                       "load_avg": round(os.getloadavg()[0], 2),
                       "losses_equal": "" if losses is None or reference is None else losses == reference,
                       **{k: v for k, v in result.items() if k in COLUMNS}}
                rows.append(row)
                print(f"{measurement} {src} rep {rep}: {result}", flush=True)
    new = not os.path.exists(output)
    with open(output, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    for measurement in ("train", "source"):
        rates = {s: [r["steps_per_s"] for r in rows if r["measurement"] == measurement and r["source"] == s]
                 for s in SOURCES}
        med = {s: statistics.median(v) for s, v in rates.items()}
        print(f"{measurement}: median steps/s memory {med['memory']}, streamed {med['streamed']} "
              f"(streamed / memory {med['streamed'] / med['memory']:.3f})")


if __name__ == "__main__":
    main()

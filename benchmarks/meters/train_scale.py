"""Training at a collection's full size (issue 55, item 3): the train CLI run as users run it (the real-data recipe of
docs/OWN_FEATURES.md on a staged collection), watched from outside for its memory, with its phases' times from its log.

The child is ``python -m retrieval_core.training.train`` with this meter's options; the meter samples the child's
``RssAnon`` (anonymous memory: regions held, model, activations; not the page cache its preads fill) and ``VmHWM``
from /proc/<pid>/status every 50 ms and writes one CSV row: peak RssAnon over the whole run (region file, start,
neighbours, steps, the mining, the dev evaluation) and over the start-up alone (until the first step is logged:
the region file, the least-squares start, the neighbour table and step 1), the median BE and CE step, the
minings' and the dev evaluations' seconds and the dev metrics, with the machine (CPU, flags, a float32 GEMM rate
measured before the run) and the command. A timeline of the samples (one per second) goes beside the CSV.

    python -m benchmarks.meters.train_scale --staged runs/coco/staged --manifest synthetic_coco_train \\
        --work runs/coco/train --output docs/results/train_scale.csv --steps 6 --ce-start-step 2 --mine-start-step 3
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import click

from benchmarks.report import cpu_flags, cpu_model, gemm_gflops, source_commit
from retrieval_core.cli import CheckedPlan, batch_size_option, option, plan_command, plan_from_cli

COLUMNS = ("manifest", "train_images", "train_captions", "region_file_gb", "steps", "batch_size", "max_regions",
           "startup_s", "median_be_step_s", "median_ce_step_s", "minings", "mining_s", "evals", "eval_s", "dev_mR",
           "dev_t2i_R@1", "dev_i2t_R@1", "wall_s", "peak_rss_anon_mb", "peak_rss_anon_mb_startup", "vm_hwm_mb",
           "train_source", "cpu_model", "cpu_flags", "gemm_gflops", "threads", "torch", "commit", "date", "command")


def _status(pid: int) -> dict[str, int]:
    """RssAnon and VmHWM of a live process, in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("RssAnon", "VmHWM"):
                    out[key] = int(line.split()[1]) << 10
    except (OSError, ValueError):
        pass
    return out


def _phase(record: dict) -> str:
    if "mined" in record:
        return "mining"
    if "eval" in record:
        return "eval"
    return "steps" if "objective" in record else "startup"


class Watch:
    """Samples a child's memory every ``every`` s and tags each sample with the phase its log last showed."""

    def __init__(self, pid: int, log_path: str, timeline: str, every: float = 0.05):
        self.pid, self.log_path, self.every = pid, log_path, every
        self.phase, self.peaks, self.hwm, self._offset = "startup", {}, 0, 0
        self.startup_s: Optional[float] = None  # launch to the first step's start
        self._t0 = time.monotonic()
        self._timeline = open(timeline, "w", newline="")
        self._writer = csv.writer(self._timeline)
        self._writer.writerow(["t_s", "rss_anon_mb", "phase"])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _read_log(self) -> None:
        # the trainer logs a step, a mining or an evaluation when it ends: a sample's tag is the last thing that
        # ended before it (the timeline's reader knows what ran next from the log)
        try:
            with open(self.log_path) as f:
                f.seek(self._offset)
                for line in f:
                    if line.endswith("\n"):
                        self._offset += len(line.encode())
                        record = json.loads(line)
                        self.phase = _phase(record)
                        if self.startup_s is None and "objective" in record:
                            self.startup_s = time.monotonic() - self._t0 - float(record["seconds"])
        except OSError:
            pass

    def _run(self) -> None:
        last = -1.0
        while not self._stop.is_set():
            self._read_log()
            s = _status(self.pid)
            if s:
                rss = s.get("RssAnon", 0)
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
                self.hwm = max(self.hwm, s.get("VmHWM", 0))
                t = time.monotonic() - self._t0
                if t - last >= 1.0:
                    self._writer.writerow([round(t, 1), round(rss / 2**20, 1), self.phase])
                    last = t
            time.sleep(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._timeline.close()


def summarise(log_path: str) -> dict:
    """Phase times and the last dev evaluation from a train_log.jsonl."""
    records = [json.loads(line) for line in open(log_path)]
    be = [r["seconds"] for r in records if r.get("objective") == "be"]
    ce = [r["seconds"] for r in records if r.get("objective") == "ce"]
    mined = [r["mined"]["seconds"] for r in records if "mined" in r]
    evals = [r["eval"] for r in records if "eval" in r]
    last = evals[-1] if evals else {}
    return {"median_be_step_s": round(statistics.median(be), 2) if be else "",
            "median_ce_step_s": round(statistics.median(ce), 2) if ce else "",
            "minings": len(mined), "mining_s": round(sum(mined), 1),
            "evals": len(evals), "eval_s": round(sum(e["seconds"] for e in evals), 1),
            "dev_mR": round(last["mR"], 2) if last else "", "dev_t2i_R@1": round(last["t2i_R@1"], 2) if last else "",
            "dev_i2t_R@1": round(last["i2t_R@1"], 2) if last else "", "steps_logged": len(be)}


@dataclass(frozen=True)
class ScalePlan(CheckedPlan):
    """One training run at full size: the real-data recipe of docs/OWN_FEATURES.md with a step budget for measuring."""
    staged: str = option(help="The staged collection (pipelines.stage) with a train and a dev split.")
    manifest: str = option(help="The manifest it was staged from.")
    work: str = option(help="The run's output folder (the model, train_log.jsonl, the child's stdout).")
    output: str = option(help="CSV to append the row to (its timeline goes beside it: <name>_timeline.csv).")
    steps: int = option(6, type=click.IntRange(min=1), help="Training steps (enough to measure, not to converge).")
    batch_size: int = batch_size_option(128, help="Captions per step (the paper's 128).")
    max_regions: int = option(36, type=click.IntRange(min=1), help="Regions per image the model reads.")
    ce_micro_batch: int = option(16, type=click.IntRange(min=0),
                                 help="CE captions per forward/backward pass (the trainer's --ce-micro-batch).")
    ce_start_step: int = option(2, type=click.IntRange(min=0), help="The first step with a CE objective.")
    mine_start_step: int = option(3, type=click.IntRange(min=0),
                                  help="The step of the one mining (the BE encodes every train image).")
    train_split: str = option("train", help="Split to train on.")
    dev_split: str = option("dev", help="Split of the dev evaluation (at the end).")


def train_argv(plan: ScalePlan) -> list[str]:
    """The train CLI's arguments: docs/OWN_FEATURES.md's COCO recipe, plus one mining (mined_negative_prob 0.25)."""
    return ["--staged", plan.staged, "--manifest", plan.manifest, "--objective", "joint", "--base-model", "minilm",
            "--be-loss", "infonce", "--image-init", "lstsq", "--new-layers-lr-mult", "20", "--ce-loss", "listwise",
            "--ce-negatives", "3", "--hard-negative-prob", "0.5", "--mined-negative-prob", "0.25",
            "--mine-start-step", str(plan.mine_start_step), "--mine-every", str(plan.steps + 1),
            "--ce-start-step", str(plan.ce_start_step), "--ce-micro-batch", str(plan.ce_micro_batch),
            "--train-split", plan.train_split,
            "--dev-split", plan.dev_split, "--steps", str(plan.steps), "--batch-size", str(plan.batch_size),
            "--lr", "5e-5", "--max-regions", str(plan.max_regions), "--device", "cpu", "--no-progress",
            "--output", plan.work]


@plan_command(ScalePlan)
def main(**values) -> None:
    """Peak memory, step times, mining and dev evaluation of one training run at full size; one CSV row."""
    plan = plan_from_cli(ScalePlan, values)
    import torch

    os.makedirs(plan.work, exist_ok=True)
    gemm = round(gemm_gflops("cpu"), 1)
    code = source_commit()  # the code the child runs (HEAD may move during a long run)
    argv = train_argv(plan)
    log_path = os.path.join(plan.work, "train_log.jsonl")
    if os.path.exists(log_path):
        raise click.UsageError(f"{plan.work} holds a run already (train_log.jsonl): give a new --work")
    timeline = os.path.splitext(plan.output)[0] + "_timeline.csv"
    t0 = time.perf_counter()
    with open(os.path.join(plan.work, "stdout.log"), "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "retrieval_core.training.train", *argv], stdout=out,
                                 stderr=subprocess.STDOUT)
        watch = Watch(child.pid, log_path, timeline)
        rc = child.wait()
        watch.stop()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise click.ClickException(f"training exited {rc}: see {os.path.join(plan.work, 'stdout.log')}")
    stdout = open(os.path.join(plan.work, "stdout.log")).read()
    source = next((line.split(":", 1)[1].strip().split(" ")[0] for line in stdout.splitlines()
                   if line.startswith("train source:")), "")
    region_gb = round(sum(os.path.getsize(os.path.join(d, f)) for d, _, files in
                          os.walk(os.path.join(plan.staged, "regions")) for f in files) / 1e9, 2)
    summary = summarise(log_path)
    startup = "" if watch.startup_s is None else round(watch.startup_s, 1)
    counts = _split_counts(plan.staged, plan.train_split)
    peaks = {k: round(v / 2**20, 1) for k, v in watch.peaks.items()}
    row = {"manifest": plan.manifest, **counts, "region_file_gb": region_gb, "steps": plan.steps,
           "batch_size": plan.batch_size, "max_regions": plan.max_regions, "startup_s": startup,
           **{k: v for k, v in summary.items() if k in COLUMNS}, "wall_s": round(wall, 1),
           "peak_rss_anon_mb": max(peaks.values()), "peak_rss_anon_mb_startup": peaks.get("startup", ""),
           "vm_hwm_mb": round(watch.hwm / 2**20, 1), "train_source": source, "cpu_model": cpu_model(),
           "cpu_flags": cpu_flags(), "gemm_gflops": gemm, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "commit": code,
           "date": datetime.date.today().isoformat(),
           "command": " ".join(["python -m benchmarks.meters.train_scale", *sys.argv[1:]])}
    new = not os.path.exists(plan.output)
    with open(plan.output, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)
    print(json.dumps(row, indent=1))


def _split_counts(staged: str, split: str) -> dict:
    """Images and captions of ``split`` from the staged summary."""
    summary = json.load(open(os.path.join(staged, "summary.json")))
    images = captions = 0
    for coll in summary["collections"].values():
        images += int(coll["images"]["staged_by_split"].get(split, 0))
        captions += int(coll["captions"]["staged_by_split"].get(split, 0))
    return {"train_images": images, "train_captions": captions}


if __name__ == "__main__":
    main()

"""The embedded default: the staged synthetic demo collection and the demo JOIN model, built on first use.

`python -m pipelines.encode` with no --staged/--model, and `python -m pipelines.demo`, call
:func:`ensure_demo_assets`. Both assets are cached under ``$RR_WORKDIR/demo`` (default ``./runs/demo``);
a complete asset is reused, a missing or incomplete one is (re)built by running the same CLIs a user
would run, so what the demo does is exactly what the README shows.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

DEMO_MANIFEST = "demo"

# The demo training recipe: JOIN (shared weights, BE and CE objectives alternating) from the shipped
# all-MiniLM-L6-v2 with every second layer kept (the paper's "halved" model), sized for about five minutes
# on 2 CPU cores (1.45-1.75 s per JOIN step at batch 32 with 20 regions per image; 150 steps keep the
# whole demo under 10 minutes with margin, dev mR 59.6 at step 120 vs 61.0 at 180). The image embedding starts
# from the least-squares fit to the captions' word embeddings (train.lstsq_image_embedding; from a random
# start InfoNCE could sit at ln(batch) for 100 of 180 steps), the new layers get a 20x learning rate,
# and InfoNCE is the BE loss: with one learning rate, or with the batch-hard triplet loss, 60-step runs
# stayed at chance (README "The demo").
DEMO_RECIPE = {
    "objective": "joint",
    "be_loss": "infonce",
    "image_init": "lstsq",
    "steps": 150,
    "batch_size": 32,
    "lr": 1e-4,
    "new_layers_lr_mult": 20,
    "max_regions": 20,
    "halve_layers": True,
    "eval_every": 75,
    "seed": 0,
}


def workdir() -> str:
    return os.path.abspath(os.environ.get("RR_WORKDIR", "runs"))


def demo_dir() -> str:
    return os.path.join(workdir(), "demo")


def staged_dir() -> str:
    return os.path.join(demo_dir(), "staged")


def model_dir() -> str:
    return os.path.join(demo_dir(), "model")


def _run(args: list[str]) -> None:
    log.info("running: %s", " ".join(args))
    print("+ " + " ".join(args), flush=True)
    subprocess.run(args, check=True)


def ensure_staged(beam_args: tuple[str, ...] = ()) -> str:
    out = staged_dir()
    if os.path.exists(os.path.join(out, "summary.json")):
        return out
    _run([sys.executable, "-m", "pipelines.stage", "--manifest", DEMO_MANIFEST, "--output", out, *beam_args])
    return out


def trained_model_path(train_output: str) -> str:
    """The trainer keeps the dev-best checkpoint in <output>/best."""
    return os.path.join(train_output, "best")


def ensure_model(staged: str) -> str:
    return _ensure_trained(staged, model_dir(), DEMO_RECIPE["objective"])


def sep_model_dir(objective: str) -> str:
    return os.path.join(demo_dir(), f"model_sep_{objective}")


def ensure_sep_models(staged: str) -> tuple[str, str]:
    """(be_dir, ce_dir): the SEP pair - one model trained with the BE objective only and one with the CE
    objective only, each with the demo recipe (same steps, batch, lr, halved MiniLM, seed) as the JOIN model,
    so SEP vs JOIN rows differ only in how the objectives share weights."""
    return (_ensure_trained(staged, sep_model_dir("be"), "be"),
            _ensure_trained(staged, sep_model_dir("ce"), "ce"))


def _ensure_trained(staged: str, out: str, objective: str) -> str:
    best = trained_model_path(out)
    if os.path.exists(os.path.join(best, "rr_model.json")):
        return best
    r = DEMO_RECIPE
    args = [sys.executable, "-m", "retrieval_core.train", "--manifest", DEMO_MANIFEST, "--staged", staged,
            "--objective", objective, "--base-model", "minilm", "--steps", str(r["steps"]),
            "--batch-size", str(r["batch_size"]), "--lr", str(r["lr"]), "--eval-every", str(r["eval_every"]),
            "--be-loss", r["be_loss"], "--image-init", r["image_init"],
            "--new-layers-lr-mult", str(r["new_layers_lr_mult"]),
            "--max-regions", str(r["max_regions"]), "--seed", str(r["seed"]), "--output", out]
    if r["halve_layers"]:
        args.append("--halve-layers")
    if os.path.exists(os.path.join(out, "last")):
        args.append("--resume")  # an interrupted earlier demo run continues where it stopped
    _run(args)
    return best


def ensure_demo_assets(beam_args: tuple[str, ...] = ()) -> tuple[str, str]:
    """(staged_dir, model_dir) of the embedded default, building whichever is missing."""
    staged = ensure_staged(beam_args)
    return staged, ensure_model(staged)

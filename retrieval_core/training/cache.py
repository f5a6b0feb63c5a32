"""The demo's and the suites' cached assets, built on first use: the staged synthetic collection and the models a
recipe (:mod:`.recipes`) trains on it.

``python -m pipelines.encode`` with no --staged/--model and ``python -m benchmarks.demo`` call
:func:`ensure_demo_assets`; ``python -m benchmarks.run`` calls :func:`ensure_models`. Each step is a command a
user could run, ``python -m pipelines.stage`` and ``python -m retrieval_core.training.train`` (a ``TrainPlan``
written back as its arguments), named by module so this library imports neither Beam nor the pipelines; a
caller passes ``run`` to launch them its own way (benchmarks: forked from a preloaded interpreter). A complete
asset is reused, a missing or incomplete one is (re)built, and one built otherwise is rebuilt: the staged
collection by another generator version (``assets.json``), a model by another training command or staged content
(its ``recipe.json``).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from typing import Callable, Optional, Sequence

from retrieval_core.cli import to_argv
from retrieval_core.data.paths import local_folder_sha256, write_local_atomic
from retrieval_core.data.pixels.backbone import INPUT_SIZE
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.render import RENDER_VERSION, RenderPlan
from retrieval_core.data.synthetic.spec import DEFAULT_SIBLING_CHANGES
from retrieval_core.model.backbones import is_backbone_name
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.recipes import (
    DEMO_MANIFEST,
    DEMO_RECIPE,
    RENDERED_MANIFEST,
    ModelSet,
    Recipe,
    demo_dir,
    model_dir,
    model_dirs,
    staged_dir,
    workdir,
)
from retrieval_core.training.train import TrainPlan

log = logging.getLogger(__name__)

#: Runs one step, ``[python, -m, MODULE, ARGS...]``, to completion; raises on a non-zero exit.
StepRunner = Callable[[Sequence[str]], None]

# Bump when what the cached assets contain changes in a way the recipes do not show.
ASSETS_VERSION = 5  # 3: fused AdamW, one dev evaluation; 4: length-chunked steps; 5: typed recipes
# Write <model>/last every N steps so that a killed run resumes instead of restarting. Not part of the fingerprint:
# a resumed run reproduces an uninterrupted one bit for bit (CPU), so it does not change what the cache holds.
CHECKPOINT_EVERY = 85


def run_subprocess(argv: Sequence[str]) -> None:
    """The default step runner: ``argv`` (``[python, -m, MODULE, ARGS...]``) in a fresh interpreter."""
    subprocess.run(list(argv), check=True)


def _run(args: list[str], run: StepRunner) -> None:
    log.info("running: %s", " ".join(args))
    print("+ " + " ".join(args), flush=True)
    run(args)


def _write_stamp(path: str, want: dict) -> None:
    write_local_atomic(path, (json.dumps(want, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def _stamp_matches(path: str, want: dict) -> bool:
    try:
        with open(path) as f:
            return json.load(f) == want
    except (OSError, ValueError):
        return False


def ensure_rendered(run: StepRunner = run_subprocess) -> tuple[str, dict]:
    """The demo collection drawn as PNGs with its captions (``$RR_WORKDIR/rendered/demo``): (the manifest that
    stages them, the stamp it was drawn under); redrawn when the generator or the renderer changes."""
    root = os.path.join(workdir(), "rendered", DEMO_MANIFEST)
    stamp = os.path.join(root, "rendered.json")
    plan = RenderPlan(output=root, manifest=DEMO_MANIFEST)
    # the staging settings the written manifest holds: other grids or layers, other features
    want = {"assets_version": ASSETS_VERSION, "synthetic_sibling_changes": list(DEFAULT_SIBLING_CHANGES),
            "render_version": RENDER_VERSION, "grids": plan.grids, "layers": plan.layers,
            "cell_norm": plan.cell_norm}
    if plan.input_size != INPUT_SIZE:  # named only when not the default: collections drawn before keep their stamp
        want["input_size"] = plan.input_size
    if not _stamp_matches(stamp, want):
        shutil.rmtree(root, ignore_errors=True)
        _run([sys.executable, "-m", "retrieval_core.data.synthetic.render", *to_argv(plan)], run)
        _write_stamp(stamp, want)
    return os.path.join(root, "manifest.yaml"), want


def ensure_staged(beam_args: tuple[str, ...] = (), manifest: str = DEMO_MANIFEST,
                  run: StepRunner = run_subprocess) -> str:
    """The staged demo collection (or another manifest's, under ``$RR_WORKDIR/staged/<manifest>``). Staged by
    another generator version, it (and every model trained on it) is rebuilt: it would silently give other
    numbers. ``beam_args``: runner flags for the staging job (``python -m pipelines.stage``)."""
    root = demo_dir() if manifest == DEMO_MANIFEST else os.path.join(workdir(), "staged", manifest)
    stamp = os.path.join(root, "assets.json")
    want = {"assets_version": ASSETS_VERSION, "synthetic_sibling_changes": list(DEFAULT_SIBLING_CHANGES)}
    source = manifest
    if manifest == RENDERED_MANIFEST:  # its pictures first; redrawn ones are staged again
        source, want["rendered"] = ensure_rendered(run)
    if not _stamp_matches(stamp, want):
        if os.path.isdir(root):
            print(f"note: {root} was built by another generator or assets version: rebuilding it", flush=True)
            shutil.rmtree(root)
        os.makedirs(root)
        _write_stamp(stamp, want)
    out = staged_dir() if manifest == DEMO_MANIFEST else os.path.join(root, "staged")
    if os.path.exists(os.path.join(out, "summary.json")):
        return out
    _run([sys.executable, "-m", "pipelines.stage", "--manifest", source, "--output", out, *beam_args], run)
    return out


def trained_model_path(train_output: str) -> str:
    """The trainer keeps the dev-best checkpoint in <output>/best."""
    return os.path.join(train_output, "best")


def training_finished(train_output: str, steps: int) -> bool:
    """True once the trainer reached ``steps``: it writes ``last/`` at the final step, while ``best/`` already
    exists after the first dev evaluation, so ``best/`` alone may be a half-trained model of a killed run."""
    try:
        with open(os.path.join(train_output, "last", "trainer_state.json")) as f:
            return int(json.load(f)["step"]) >= steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _ensure_trained(staged: str, out: str, cfg: TrainConfig, recipe: Recipe, base_model: Optional[str] = None,
                    run: StepRunner = run_subprocess) -> str:
    """Trains one model into ``out`` unless a finished run of exactly this command on this staged content is there
    (``out/recipe.json``); a folder trained otherwise is rebuilt, a killed run of this command resumes.
    ``base_model``: a checkpoint to start from instead of the recipe's backbone (the SEP CE's is the SEP BE)."""
    best = trained_model_path(out)
    base_model = base_model or recipe.base_model
    backbone = is_backbone_name(base_model)
    plan = TrainPlan(staged=staged, output=out, config=cfg, base_model=base_model, manifest=recipe.manifest,
                     max_regions=recipe.max_regions, languages=recipe.languages, ce_agreement=recipe.ce_agreement,
                     halve_layers=backbone and recipe.halve_layers)  # a checkpoint brings its own layers
    args = to_argv(plan)
    ds = StagedDataset(staged)
    content = {f"{kind}/{c}": ds.content_sha256(kind, c) for c in ds.collections for kind in ("images", "captions")}
    want = {"assets_version": ASSETS_VERSION, "train_args": args, "staged": content}
    if not backbone:  # a checkpoint (the SEP CE's is the SEP BE) retrained in place retrains this one
        want["base_model_sha256"] = local_folder_sha256(base_model)
    stamp = os.path.join(out, "recipe.json")
    if _stamp_matches(stamp, want):
        if training_finished(out, cfg.steps) and os.path.exists(os.path.join(best, "rr_model.json")):
            return best
    else:
        if os.path.isdir(out):
            print(f"note: {out} was trained by another recipe, seed or staged collection: retraining it", flush=True)
            shutil.rmtree(out)
        os.makedirs(out)
        _write_stamp(stamp, want)
    resume = os.path.exists(os.path.join(out, "last", "trainer_state.json"))
    # checkpoints let a killed run resume; not in the stamp: a resumed run reproduces an uninterrupted one (CPU)
    resumable = replace(plan, config=replace(cfg, checkpoint_every=CHECKPOINT_EVERY), resume=resume)
    _run([sys.executable, "-m", "retrieval_core.training.train", *to_argv(resumable)], run)
    return best


def ensure_models(recipe: Recipe = DEMO_RECIPE, seed: int = 0, sep: bool = False,
                  beam_args: tuple[str, ...] = (), run: StepRunner = run_subprocess) -> ModelSet:
    """The models of ``recipe`` at ``seed`` (the JOIN model; with ``sep`` the SEP pair too), training whichever
    is missing on the staged demo collection (staged first if needed)."""
    staged = ensure_staged(beam_args, recipe.manifest, run)
    r, dirs = recipe.with_seed(seed), model_dirs(recipe, seed)
    join = _ensure_trained(staged, dirs.join, r.join, r, run=run)
    if not sep:
        return ModelSet(join)
    be = _ensure_trained(staged, dirs.be, r.sep_be, r, run=run)
    ce_cfg = replace(r.sep_ce, mine_model=be) if r.sep_ce.mined_negative_prob else r.sep_ce
    return ModelSet(join, be, _ensure_trained(staged, dirs.ce, ce_cfg, r, base_model=be, run=run))


def ensure_demo_assets(beam_args: tuple[str, ...] = (), run: StepRunner = run_subprocess) -> tuple[str, str]:
    """(staged_dir, model_dir) of the embedded default (the demo JOIN model), building whichever is missing."""
    staged = ensure_staged(beam_args, run=run)
    return staged, _ensure_trained(staged, model_dir(), DEMO_RECIPE.join, DEMO_RECIPE, run=run)

"""The embedded default and the suites' models: the staged synthetic demo collection and the models a recipe
trains on it, built on first use.

`python -m pipelines.encode` with no --staged/--model, and `python -m benchmarks.demo`, call
:func:`ensure_demo_assets`; `python -m benchmarks.run` calls :func:`ensure_models` with BENCH_RECIPE. A recipe
(:class:`Recipe`) is typed: one ``training.config.TrainConfig`` per model it trains (JOIN, and the SEP pair:
a bi-encoder, then a cross-encoder fine-tuned from that bi-encoder's checkpoint), run through the same
``python -m retrieval_core.training.train``
a user would run (a ``TrainPlan`` written back as its arguments), so what the
demo does is exactly what docs/TRAINING.md shows. Caches: the staged collection and the demo models under
``$RR_WORKDIR/demo`` (default ``./runs/demo``), the benchmark models under ``$RR_WORKDIR/bench-models/seed<N>``; a
complete asset is reused, a missing or incomplete one is (re)built, and one built otherwise is rebuilt: the staged
collection by another generator version (``demo/assets.json``), a model by another training command or staged
content (its ``recipe.json``).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, replace
from typing import Optional

from pipelines import files, launch
from retrieval_core.cli import to_argv
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.spec import DEFAULT_SIBLING_CHANGES
from retrieval_core.model.backbones import is_backbone_name
from retrieval_core.model.network import ce_agreement_default
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.train import TrainPlan

log = logging.getLogger(__name__)

DEMO_MANIFEST = "demo"


@dataclass(frozen=True)
class Recipe:
    """How one cached model set is trained on the demo collection's train split (its dev split selects the
    checkpoint): the JOIN model; the SEP bi-encoder; the SEP cross-encoder, fine-tuned with the CE objective from
    the SEP bi-encoder's checkpoint (a separate CE from the text-only backbone does not leave chance in a CPU
    budget: it borrows the bi-encoder's image-text alignment) and, where its config mines negatives, mining them
    with that bi-encoder (``--mine-model``): the lists it will rerank. JOIN and the SEP bi-encoder start from the
    shipped MiniLM (``halve_layers``: every other layer kept)."""
    name: str
    join: TrainConfig
    sep_be: TrainConfig
    sep_ce: TrainConfig
    halve_layers: bool = True
    max_regions: int = 12
    manifest: str = DEMO_MANIFEST  # the staged collection whose train split trains and dev split selects
    base_model: str = "minilm"  # a backbones name (or a BERT folder) the JOIN and SEP BE start from
    languages: tuple[str, ...] = ()  # train and select on captions of these languages only (all when empty)
    ce_agreement: str = ce_agreement_default("new")  # the CE head's agreement term of every model (TrainPlan's)

    def __post_init__(self):
        for role, want in (("join", "joint"), ("sep_be", "be"), ("sep_ce", "ce")):
            if getattr(self, role).objective != want:
                raise ValueError(f"recipe {self.name}: {role} must have objective {want!r}")

    def with_seed(self, seed: int) -> "Recipe":
        return replace(self, join=replace(self.join, seed=seed), sep_be=replace(self.sep_be, seed=seed),
                       sep_ce=replace(self.sep_ce, seed=seed))


@dataclass(frozen=True)
class ModelSet:
    """Model folders of one recipe and seed: JOIN, and the SEP pair (None when not asked for)."""
    join: str
    be: Optional[str] = None
    ce: Optional[str] = None


# The demo training recipe: JOIN (shared weights, BE and CE objectives) from the shipped all-MiniLM-L6-v2 with
# every second layer kept (the paper's "halved" model), sized for about five minutes on 2 CPU cores. Each choice
# was measured on the demo dev split; the numbers are in docs/TRAINING.md, "The demo recipe":
# - the image embedding starts from the least-squares fit to the captions' word embeddings
#   (model_init.lstsq_image_embedding): from a random start InfoNCE sat at ln(batch) for many steps;
# - the new layers get a 20x learning rate; InfoNCE is the BE loss (the triplet loss stayed at chance);
# - the CE objective starts at step 40: a CE on a text-only backbone stays at chance until the BE has aligned
#   image and text tokens, so earlier CE steps cost time;
# - CE steps use the listwise (LCE) loss over the gold image and 3 negatives, half of them drawn from the gold
#   image's 8 nearest images by pooled features: the near misses a reranker sees. With the paper's pair loss
#   and random negatives the CE learned class-level matching only, and reranking lowered R@1;
# - each CE negative comes with p = 0.5 from the model's own BE top-8 (re-mined every 100 steps): the lists the
#   CE will rerank (the rest: 1/4 nearest images, 1/4 random). Without them the lift swung with the seed; a
#   cheaper CE lost it;
# - the CE head's late-interaction term (Recipe.ce_agreement = "maxsim"): with the [CLS] classifier alone the CE
#   loss sat at chance until a seed-dependent step and reranking lowered R@1 for some seeds; with it the CE learns
#   from its first step;
# - 12 regions per image (stored most-confident first: the object detections, little clutter);
# - captions and CE pairs go through the model in length-sorted chunks of 16 rows, each padded to its own longest
#   caption: less padding, the losses of one padded batch up to rounding;
# - frozen word embeddings: faster steps, so more of them fit; the CE was still improving at the end, and fewer
#   steps reranked worse.
_DEMO_JOIN = TrainConfig(
    objective="joint", be_loss="infonce", image_init="lstsq", steps=340, batch_size=32, lr=1e-4,
    new_layers_lr_mult=20, ce_loss="listwise", ce_negatives=3, ce_batch_size=16, ce_start_step=40,
    hard_negative_prob=0.5, hard_negative_k=8, mined_negative_prob=0.5, mine_every=100,
    freeze_word_embeddings=True, length_chunk_rows=16,
    eval_every=0,  # one dev evaluation, at the end: the mid-run one never won (docs/TRAINING.md)
    seed=0, progress=True)
DEMO_RECIPE = Recipe(
    name="demo", join=_DEMO_JOIN,
    sep_be=TrainConfig(objective="be", be_loss="infonce", image_init="lstsq", steps=340, batch_size=32, lr=1e-4,
                       new_layers_lr_mult=20, freeze_word_embeddings=True, length_chunk_rows=16, seed=0),
    # the SEP CE keeps the recipe it was measured with (no mined negatives; docs/TRAINING.md)
    sep_ce=TrainConfig(objective="ce", be_loss="infonce", steps=260, batch_size=32, lr=1e-4, new_layers_lr_mult=20,
                       ce_loss="listwise", ce_negatives=3, ce_batch_size=16, hard_negative_prob=0.5,
                       hard_negative_k=8, freeze_word_embeddings=True, length_chunk_rows=16, seed=0))

# The benchmark suites' recipe: every model a few times the demo's training, and every CE trained on the
# lists it will rerank - listwise over 7 negatives, 3 in 4 drawn from its bi-encoder's own top-20 (the suites'
# rerank depth), the rest as in the demo. What each choice bought, measured: docs/TRAINING.md.
BENCH_RECIPE = Recipe(
    name="bench",
    join=replace(_DEMO_JOIN, steps=800, ce_negatives=7, mined_negative_prob=0.75, mine_k=20, mine_every=150,
                 mine_start_step=140),
    sep_be=replace(DEMO_RECIPE.sep_be, steps=600),
    sep_ce=replace(DEMO_RECIPE.sep_ce, steps=600, ce_negatives=7, mined_negative_prob=0.75, mine_k=20,
                   mine_start_step=100))
# The multilingual suite's recipes: the demo recipe's JOIN trained on synthetic_multi30k (en/de/fr/cs
# captions of the same scenes) from multilingual-e5-small, halved (6 of 12 layers), its 96M word-embedding weights
# frozen (docs/MULTILINGUAL.md): on English captions only (the zero-shot setting: de/fr/cs are never trained on)
# or on all four languages; and the English-only MiniLM on English captions, the monolingual reference.
# They keep the [CLS]-only CE head they were measured with (docs/MULTILINGUAL.md predates the agreement term).
_ML_ZERO_SHOT = Recipe(name="ml-e5-en", join=_DEMO_JOIN, sep_be=DEMO_RECIPE.sep_be, sep_ce=DEMO_RECIPE.sep_ce,
                       manifest="synthetic_multi30k", base_model="multilingual-e5-small", languages=("en",),
                       ce_agreement=ce_agreement_default("multilingual_recipe"))
ML_RECIPES = {"zero_shot": _ML_ZERO_SHOT, "all_languages": replace(_ML_ZERO_SHOT, name="ml-e5-all", languages=()),
              "english_reference": replace(_ML_ZERO_SHOT, name="ml-minilm-en", base_model="minilm")}
#: The demo collection drawn as pictures (retrieval_core.data.synthetic.render) and staged from its PNGs through the
#: image backbone: the pixel path on scenes whose contrasts are known, trained with the demo's recipe.
RENDERED_MANIFEST = "demo_rendered"
PIXELS_RECIPE = replace(DEMO_RECIPE, name="demo-pixels", manifest=RENDERED_MANIFEST)
RECIPES = {r.name: r for r in (DEMO_RECIPE, BENCH_RECIPE, *ML_RECIPES.values(), PIXELS_RECIPE)}

# Bump when what the cached assets contain changes in a way the recipes do not show.
ASSETS_VERSION = 5  # 3: fused AdamW, one dev evaluation; 4: length-chunked steps; 5: typed recipes
# Write <model>/last every N steps so that a killed run resumes instead of restarting. Not part of the fingerprint:
# a resumed run reproduces an uninterrupted one bit for bit (CPU), so it does not change what the cache holds.
CHECKPOINT_EVERY = 85


def workdir() -> str:
    return os.path.abspath(os.environ.get("RR_WORKDIR", "runs"))


def demo_dir() -> str:
    return os.path.join(workdir(), "demo")


def staged_dir() -> str:
    return os.path.join(demo_dir(), "staged")


def _is_demo(recipe: Recipe, seed: int) -> bool:
    return recipe == DEMO_RECIPE and seed == DEMO_RECIPE.join.seed


def recipe_dir(recipe: Recipe, seed: int = 0) -> str:
    """Where a recipe's models live: the demo's beside the staged collection, any other per recipe and seed."""
    return demo_dir() if _is_demo(recipe, seed) else os.path.join(workdir(), f"{recipe.name}-models", f"seed{seed}")


def model_dirs(recipe: Recipe, seed: int = 0) -> ModelSet:
    """The training output folders of a recipe's three models (their ``best/`` is the model)."""
    root = recipe_dir(recipe, seed)
    if _is_demo(recipe, seed):
        return ModelSet(os.path.join(root, "model"), os.path.join(root, "model_sep_be"),
                        os.path.join(root, "model_sep_ce"))
    return ModelSet(*(os.path.join(root, name) for name in ("join", "sep_be", "sep_ce")))


def model_dir() -> str:
    """The demo JOIN model's training folder."""
    return model_dirs(DEMO_RECIPE).join


def _run(args: list[str]) -> None:
    log.info("running: %s", " ".join(args))
    print("+ " + " ".join(args), flush=True)
    launch.run_module(args)  # forked from the preloaded interpreter: no imports per step (docs/PERFORMANCE.md)


def _stamp_matches(path: str, want: dict) -> bool:
    try:
        with open(path) as f:
            return json.load(f) == want
    except (OSError, ValueError):
        return False


def ensure_rendered() -> tuple[str, dict]:
    """The demo collection drawn as PNGs with its captions (``$RR_WORKDIR/rendered/demo``): (the manifest that
    stages them, the stamp it was drawn under); redrawn when the generator or the renderer changes."""
    from retrieval_core.data.synthetic.render import RENDER_VERSION, RenderPlan

    root = os.path.join(workdir(), "rendered", DEMO_MANIFEST)
    stamp = os.path.join(root, "rendered.json")
    want = {"assets_version": ASSETS_VERSION, "synthetic_sibling_changes": list(DEFAULT_SIBLING_CHANGES),
            "render_version": RENDER_VERSION}
    if not _stamp_matches(stamp, want):
        shutil.rmtree(root, ignore_errors=True)
        _run([sys.executable, "-m", "retrieval_core.data.synthetic.render",
              *to_argv(RenderPlan(output=root, manifest=DEMO_MANIFEST))])
        files.write_json_atomic(stamp, want)
    return os.path.join(root, "manifest.yaml"), want


def ensure_staged(beam_args: tuple[str, ...] = (), manifest: str = DEMO_MANIFEST) -> str:
    """The staged demo collection (or another manifest's, under ``$RR_WORKDIR/staged/<manifest>``). Staged by
    another generator version, it (and every model trained on it) is rebuilt: it would silently give other
    numbers."""
    root = demo_dir() if manifest == DEMO_MANIFEST else os.path.join(workdir(), "staged", manifest)
    stamp = os.path.join(root, "assets.json")
    want = {"assets_version": ASSETS_VERSION, "synthetic_sibling_changes": list(DEFAULT_SIBLING_CHANGES)}
    source = manifest
    if manifest == RENDERED_MANIFEST:  # its pictures first; redrawn ones are staged again
        source, want["rendered"] = ensure_rendered()
    if not _stamp_matches(stamp, want):
        if os.path.isdir(root):
            print(f"note: {root} was built by another generator or assets version: rebuilding it", flush=True)
            shutil.rmtree(root)
        os.makedirs(root)
        files.write_json_atomic(stamp, want)
    out = staged_dir() if manifest == DEMO_MANIFEST else os.path.join(root, "staged")
    if os.path.exists(os.path.join(out, "summary.json")):
        return out
    _run([sys.executable, "-m", "pipelines.stage", "--manifest", source, "--output", out, *beam_args])
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


def _ensure_trained(staged: str, out: str, cfg: TrainConfig, recipe: Recipe, base_model: Optional[str] = None) -> str:
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
        want["base_model_sha256"] = files.folder_sha256(base_model)
    stamp = os.path.join(out, "recipe.json")
    if _stamp_matches(stamp, want):
        if training_finished(out, cfg.steps) and os.path.exists(os.path.join(best, "rr_model.json")):
            return best
    else:
        if os.path.isdir(out):
            print(f"note: {out} was trained by another recipe, seed or staged collection: retraining it", flush=True)
            shutil.rmtree(out)
        os.makedirs(out)
        files.write_json_atomic(stamp, want)
    resume = os.path.exists(os.path.join(out, "last", "trainer_state.json"))
    # checkpoints let a killed run resume; not in the stamp: a resumed run reproduces an uninterrupted one (CPU)
    run = replace(plan, config=replace(cfg, checkpoint_every=CHECKPOINT_EVERY), resume=resume)
    _run([sys.executable, "-m", "retrieval_core.training.train", *to_argv(run)])
    return best


def ensure_models(recipe: Recipe = DEMO_RECIPE, seed: int = 0, sep: bool = False,
                  beam_args: tuple[str, ...] = ()) -> ModelSet:
    """The models of ``recipe`` at ``seed`` (the JOIN model; with ``sep`` the SEP pair too), training whichever
    is missing on the staged demo collection (staged first if needed)."""
    staged = ensure_staged(beam_args, recipe.manifest)
    r, dirs = recipe.with_seed(seed), model_dirs(recipe, seed)
    join = _ensure_trained(staged, dirs.join, r.join, r)
    if not sep:
        return ModelSet(join)
    be = _ensure_trained(staged, dirs.be, r.sep_be, r)
    ce_cfg = replace(r.sep_ce, mine_model=be) if r.sep_ce.mined_negative_prob else r.sep_ce
    return ModelSet(join, be, _ensure_trained(staged, dirs.ce, ce_cfg, r, base_model=be))


def ensure_model(staged: str) -> str:
    """The demo JOIN model (trained on first use)."""
    return _ensure_trained(staged, model_dir(), DEMO_RECIPE.join, DEMO_RECIPE)


def ensure_demo_assets(beam_args: tuple[str, ...] = ()) -> tuple[str, str]:
    """(staged_dir, model_dir) of the embedded default, building whichever is missing."""
    staged = ensure_staged(beam_args)
    return staged, ensure_model(staged)

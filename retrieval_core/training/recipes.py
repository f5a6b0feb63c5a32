"""The training recipes of the demo and the suites, and where their cached models live.

A recipe (:class:`Recipe`) is typed: one ``training.config.TrainConfig`` per model it trains (JOIN, and the SEP
pair: a bi-encoder, then a cross-encoder fine-tuned from that bi-encoder's checkpoint). :mod:`.cache` trains
them on first use through the same ``python -m retrieval_core.training.train`` a user would run, so what the demo
does is exactly what docs/TRAINING.md shows. Folders: the staged demo collection and the demo models under
``$RR_WORKDIR/demo`` (default ``./runs/demo``), any other recipe's models under
``$RR_WORKDIR/<recipe>-models/seed<N>``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

from retrieval_core.model.network import ce_agreement_default
from retrieval_core.training.config import TrainConfig

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
# was measured on the demo dev split; the numbers are in docs/log/TRAINING-2026-11.md, "The demo recipe":
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
# The demo's JOIN trains 260 of those 340 steps and re-mines every 110 (two minings instead of three): the max-sim
# CE head learns from its first CE step (the [CLS]-only head left chance at step 98-233, which the 340 were sized
# for), and 340 steps missed the demo's 10 minutes on the slower 2-core class (docs/log/TRAINING-2026-11.md,
# "The demo recipe").
# The other recipes built on _DEMO_JOIN keep the 340 steps they were measured with.
DEMO_RECIPE = Recipe(
    name="demo", join=replace(_DEMO_JOIN, steps=260, mine_every=110),
    sep_be=TrainConfig(objective="be", be_loss="infonce", image_init="lstsq", steps=340, batch_size=32, lr=1e-4,
                       new_layers_lr_mult=20, freeze_word_embeddings=True, length_chunk_rows=16, seed=0),
    # the SEP CE keeps the recipe it was measured with (no mined negatives; docs/TRAINING.md)
    sep_ce=TrainConfig(objective="ce", be_loss="infonce", steps=260, batch_size=32, lr=1e-4, new_layers_lr_mult=20,
                       ce_loss="listwise", ce_negatives=3, ce_batch_size=16, hard_negative_prob=0.5,
                       hard_negative_k=8, freeze_word_embeddings=True, length_chunk_rows=16, seed=0))

# The benchmark suites' recipe: every model a few times the demo's training, and every CE trained on the
# lists it will rerank - listwise over 7 negatives, 3 in 4 drawn from its bi-encoder's own top-20 (the suites'
# rerank depth), the rest as in the demo. What each choice bought, measured: docs/TRAINING.md.
# The JOIN keeps one AdamW state per objective: with one state its CE reranked text to image far below SEP's
# (issue 56); with two, at the same steps and cost, at SEP's level on the dev split (docs/TRAINING.md).
BENCH_RECIPE = Recipe(
    name="bench",
    join=replace(_DEMO_JOIN, steps=800, ce_negatives=7, mined_negative_prob=0.75, mine_k=20, mine_every=150,
                 mine_start_step=140, joint_optimizer="separate"),
    sep_be=replace(DEMO_RECIPE.sep_be, steps=600),
    sep_ce=replace(DEMO_RECIPE.sep_ce, steps=600, ce_negatives=7, mined_negative_prob=0.75, mine_k=20,
                   mine_start_step=100))
# The multilingual suite's recipes: the demo recipe's JOIN trained on synthetic_multi30k (en/de/fr/cs
# captions of the same scenes) from multilingual-e5-small, halved (6 of 12 layers), its 96M word-embedding weights
# frozen (docs/MULTILINGUAL.md): on English captions only (the zero-shot setting: de/fr/cs are never trained on)
# or on all four languages; and the English-only MiniLM on English captions, the monolingual reference. They build
# the max-sim CE head like every recipe from a text backbone.
_ML_ZERO_SHOT = Recipe(name="ml-e5-en", join=_DEMO_JOIN, sep_be=DEMO_RECIPE.sep_be, sep_ce=DEMO_RECIPE.sep_ce,
                       manifest="synthetic_multi30k", base_model="multilingual-e5-small", languages=("en",))
# All four languages get the English recipe's 340 steps each: trained 340 steps on the four languages, English
# saw a quarter of its captions' steps and lost 26.9 points of mR (docs/log/MULTILINGUAL-2026-11.md). Steps
# draw captions of every language at random; a mining still covers the next 100 steps' captions.
ML_ALL_STEPS = 4 * _DEMO_JOIN.steps
ML_RECIPES = {"zero_shot": _ML_ZERO_SHOT,
              "all_languages": replace(_ML_ZERO_SHOT, name="ml-e5-all", languages=(),
                                       join=replace(_DEMO_JOIN, steps=ML_ALL_STEPS)),
              "english_reference": replace(_ML_ZERO_SHOT, name="ml-minilm-en", base_model="minilm")}
#: The demo collection drawn as pictures (retrieval_core.data.synthetic.render) and staged from its PNGs through the
#: image backbone: the pixel path on scenes whose contrasts are known, trained with the demo's recipe.
RENDERED_MANIFEST = "demo_rendered"
# Its JOIN differs from the demo's in two choices measured on the dev split (docs/log/PIXELS-2026-11-27.md,
# "Training levers"): the new layers at 5x instead of 20x (the least-squares start already fits the grid features;
# 20x moved the image embedding away from it faster than the text side followed) and 520 steps instead of 260
# (dev R@1 still rising).
# Its features are staged at 288 pixels (render.RENDERED_INPUT): the grid cells are the scenes' layout cells.
PIXELS_RECIPE = replace(DEMO_RECIPE, name="demo-pixels", manifest=RENDERED_MANIFEST,
                        join=replace(DEMO_RECIPE.join, steps=520, new_layers_lr_mult=5))
RECIPES = {r.name: r for r in (DEMO_RECIPE, BENCH_RECIPE, *ML_RECIPES.values(), PIXELS_RECIPE)}


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

"""`TrainConfig`: every training hyper-parameter, each a plan field (``retrieval_core.cli.option``), validated when
built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import click

from retrieval_core.cli import CheckedPlan, batch_size_option, count_option, device_option, option

OBJECTIVES = ("be", "ce", "joint")
IMAGE_INITS = ("random", "lstsq")
BE_LOSSES = ("triplet", "infonce")
CE_LOSSES = ("pair", "listwise")
JOINT_OPTIMIZERS = ("shared", "separate")


@dataclass(frozen=True)
class TrainConfig(CheckedPlan):
    """Every training hyper-parameter, checked when built: each option by its type, as typed on the command line,
    and the options together by ``check`` (one line naming the bad value)."""
    objective: str = option("joint", type=click.Choice(OBJECTIVES, case_sensitive=False), help="What is trained.")
    be_loss: str = option("triplet", type=click.Choice(BE_LOSSES, case_sensitive=False), help="BE loss.")
    margin: float = option(0.1, help="Triplet margin.")
    temperature: float = 0.05
    steps: int = option(1000)
    batch_size: int = batch_size_option(32, "Captions per step (CE: 2x pairs).")  # a CE step scores 2x this many pairs
    lr: float = option(5e-5)
    # The image embedding and CE head start from random init while the encoder is pretrained: they get
    # lr * new_layers_lr_mult, so a short CPU run aligns the image space before it drifts the encoder.
    new_layers_lr_mult: float = option(
        1.0, help="Learning-rate multiplier for the randomly initialised image embedding and CE head.")
    # "lstsq": before step 1, fit the image embedding by ridge regression (lstsq_image_embedding) instead of
    # starting it at random; a short run then skips the plateau where InfoNCE sits at ln(batch).
    image_init: str = option("random", type=click.Choice(IMAGE_INITS, case_sensitive=False),
                             help="Image embedding start: random, or a least-squares fit to the captions' word "
                                  "embeddings.")
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    # Keep the backbone's word embeddings (65 % of the halved MiniLM's weights) fixed: a CPU step is faster
    # (no dense embedding gradient, a third of the AdamW work), and the image embedding's least-squares start
    # (image_init="lstsq") keeps aiming at a word space that does not move.
    freeze_word_embeddings: bool = option(False, help="Keep the backbone's word embeddings fixed.")
    p_replace_image: float = 0.5
    # "pair": the paper's binary loss over 1 positive + ce_negatives negatives per caption; "listwise": softmax
    # over the positive and its negatives (LCE), which learns to separate near misses from fewer steps.
    ce_loss: str = option("pair", type=click.Choice(CE_LOSSES, case_sensitive=False),
                          help="pair: binary loss per (caption, image) pair (the paper); listwise: softmax over "
                               "each caption's positive and its negatives (LCE).")
    ce_negatives: int = option(1, help="Negatives per caption in a CE step.")
    ce_batch_size: Optional[int] = count_option(None, help="Captions per CE step [--batch-size].")
    # A CE step's activations grow with its pairs (captions x (1 + ce_negatives)): at the paper's batch of 128 with
    # 3 negatives and 36 regions they took most of 10 GB on the CPU. Micro-batches bound that; the step's gradient
    # is the same sum (in another float order, and with other dropout draws), one optimizer step as before.
    ce_micro_batch: int = option(0, type=click.IntRange(min=0),
                                 help="CE captions per forward/backward pass; the step's gradient accumulates "
                                      "over its micro-batches, bounding a CE step's activation memory (0: the "
                                      "whole CE batch in one pass).")
    # JOIN: steps before this one run the BE objective only. A CE on a text-only backbone stays at chance until
    # the BE has aligned image and text tokens (docs/TRAINING.md), so earlier CE steps only cost time.
    ce_start_step: int = option(0, help="joint: run the BE objective alone before this step.")
    # JOIN: from ce_start_step on, the BE objective on every Nth step only, the CE on every step: CE steps bought
    # with BE updates in a fixed training time. Every third step at the bench recipe lost to every step on the dev
    # split (docs/TRAINING.md, "The joint model's CE"): the CE needs the BE's updates of the shared weights too.
    be_every: int = option(1, type=click.IntRange(min=1),
                           help="joint: from --ce-start-step on, run the BE objective on every Nth step only.")
    # JOIN: one AdamW over the shared weights ("shared": its first moment blends the last ~10 updates of both
    # objectives, so a CE step moves the weights mostly along the BE's recent direction) or one AdamW state per
    # objective over the same weights ("separate": each objective follows its own momentum; no parameter added).
    # What it changed on the dev split: docs/TRAINING.md, "The joint model's CE".
    joint_optimizer: str = option("shared", type=click.Choice(JOINT_OPTIMIZERS, case_sensitive=False),
                                  help="joint: one AdamW state for both objectives (shared) or one per objective "
                                       "over the same weights (separate).")
    # Share of CE negatives drawn from the gold image's hard_negative_k nearest images by pooled region
    # features (feature_neighbours) instead of the whole set: what a reranker must reject are near-duplicates.
    hard_negative_prob: float = option(0.0, help="Share of CE negatives drawn from the gold image's nearest images "
                                                 "by pooled region features.")
    hard_negative_k: int = option(8, help="How many nearest images form that pool.")
    # Share of CE negatives from the BE's own top-k: for a caption, wrong images the BE ranks high (t2i); for its
    # gold image, wrong captions the BE ranks high (i2t) - the lists the CE will rerank. Mined with the model
    # being trained (JOIN: refreshed every mine_every steps; 0 = once, at the first CE step) or with a given BE
    # checkpoint (mine_model), for the captions of the coming steps; the i2t caption pool is those captions plus
    # a seeded sample up to mine_pool captions.
    mined_negative_prob: float = option(0.0, help="Share of CE negatives from the BE's own top-k (t2i: wrong images "
                                                  "it ranks high for the caption; i2t: wrong captions it ranks high "
                                                  "for the gold image).")
    mine_k: int = option(8, help="BE top-k depth the mined negatives come from.")
    mine_every: int = option(0, help="Re-mine with the current model every N steps (0: once, at the first CE step).")
    # Steps before this one draw no mined negatives (the other sources only): a CE head that starts at chance on
    # a bi-encoder checkpoint (the SEP CE) first learns from random and nearest images, then from the BE's lists,
    # on which alone it stayed at chance (docs/TRAINING.md).
    mine_start_step: int = option(0, help="No mined negatives before this step.")
    mine_pool: int = option(4000, help="Captions encoded per mining (the coming steps' captions + a seeded "
                                       "sample): the i2t pool.")
    mine_model: Optional[str] = option(None, help="Mine with this BE checkpoint instead of the model being trained.")
    eval_every: int = option(0, help="Dev evaluation every M steps (0: at the end).")
    checkpoint_every: int = option(0, help="Write output/last every N steps (0: at the end).")
    # Also keep a copy of the model at every checkpoint_every step (output/checkpoints/step-NNNNNN, model only, no
    # optimizer): what benchmarks.probes.learning_curves probes to draw a head's learning curve.
    keep_checkpoints: bool = option(False, help="Also keep the model of every --checkpoint-every step "
                                                "(output/checkpoints/step-N; for benchmarks.probes.learning_curves).")
    seed: int = option(0)
    device: str = device_option()
    amp: bool = option(True, off="--no-amp", help="No bf16 autocast on CUDA.")
    # bf16 autocast for training steps on the CPU too (dev evaluation and inference stay float32): worth it only
    # where the CPU computes bf16 natively (avx512_bf16 / AMX); elsewhere it is slower than float32
    cpu_bf16: bool = option(False, help="bf16 autocast for CPU training steps (CPUs with native bf16 only).")
    eval_batch_size: int = 128
    # Forward text and (caption, image) pairs in length-sorted chunks of this many rows (0: one batch padded to its
    # longest caption): less padding, and attention masks keep each row's result that of the padded batch (up to
    # float rounding).
    length_chunk_rows: int = option(16, type=click.IntRange(min=0),
                                    help="Forward captions and CE pairs in length-sorted chunks of this many rows "
                                         "(0: one padded batch).")
    progress: bool = option(True, off="--no-progress", help="No progress bars.")
    # An exponential moving average of the trained weights is what gets evaluated and saved (best/, kept
    # checkpoints): the average of the last ~1/(1-decay) steps, less at the mercy of the last few updates, which
    # swing a short CPU run with the seed and the CPU's rounding. last/ keeps the raw weights (and the average) for
    # a resume. 0: off.
    ema_decay: float = option(0.0, help="Evaluate and save an exponential moving average of the weights with this "
                                        "decay (e.g. 0.98; 0: the weights as trained).")

    def __post_init__(self):
        super().__post_init__()  # every option's type; --device auto resolved on the launching host
        self.check()

    def check(self) -> None:
        if self.ce_negatives < 1 or (self.ce_batch_size is not None and self.ce_batch_size < 1):
            raise ValueError(f"need ce_negatives >= 1 and ce_batch_size >= 1, got {self.ce_negatives}, "
                             f"{self.ce_batch_size}")
        if self.ce_start_step < 0 or (self.objective == "joint" and self.ce_start_step >= self.steps):
            raise ValueError(f"ce_start_step must be in [0, steps) for a joint run, got {self.ce_start_step}")
        if not 0.0 <= self.hard_negative_prob <= 1.0 or self.hard_negative_k < 1:
            raise ValueError(f"need 0 <= hard_negative_prob <= 1 and hard_negative_k >= 1, "
                             f"got {self.hard_negative_prob}, {self.hard_negative_k}")
        if not 0.0 <= self.mined_negative_prob <= 1.0 or self.mine_k < 1 or self.mine_every < 0 \
                or self.mine_pool < 1 or self.mine_start_step < 0:
            raise ValueError(f"need 0 <= mined_negative_prob <= 1, mine_k >= 1, mine_every >= 0, mine_pool >= 1 and "
                             f"mine_start_step >= 0, got {self.mined_negative_prob}, {self.mine_k}, {self.mine_every}, "
                             f"{self.mine_pool}, {self.mine_start_step}")
        if self.mine_model is not None and not self.mined_negative_prob:
            raise ValueError("mine_model is the BE that mines CE negatives: set mined_negative_prob > 0 too")
        if self.joint_optimizer != "shared" and self.objective != "joint":
            raise ValueError(f"joint_optimizer {self.joint_optimizer!r} is for a joint run; {self.objective!r} has "
                             f"one objective")
        if self.length_chunk_rows < 0:
            raise ValueError(f"length_chunk_rows must be >= 0, got {self.length_chunk_rows}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.keep_checkpoints and self.checkpoint_every < 1:
            raise ValueError("keep_checkpoints keeps the model of every checkpoint_every step: set checkpoint_every")
        if self.steps < 1 or self.batch_size < 2:
            raise ValueError(f"need steps >= 1 and batch_size >= 2, got {self.steps}, {self.batch_size}")

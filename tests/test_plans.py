"""Typed plans all the way: every pipeline's plan written back as arguments (``to_argv``) builds the same plan
through its own CLI, so what the suites and the demo launch is exactly the plan they built."""
from __future__ import annotations

import dataclasses

import click
import pytest

from benchmarks.queries import QueriesPlan
from benchmarks.queries import main as queries_main
from pipelines.build_index.plan import IndexPlan
from pipelines.build_index.run import main as index_main
from pipelines.encode.plan import EncodePlan
from pipelines.encode.run import main as encode_main
from pipelines.rerank.plan import RerankPlan
from pipelines.rerank.run import main as rerank_main
from pipelines.stage.plan import StagePlan
from pipelines.stage.run import main as stage_main
from retrieval_core.cli import plan_from_cli, to_argv
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.train import TrainPlan
from retrieval_core.training.train import main as train_main

PLANS = {
    "stage": (StagePlan(output="out", manifest="coco_5k", overrides=("coco_5k.images.path=/x.tsv", "a.b=1"),
                        feature_format="hdf5", feature_dtype="float16", max_regions=12, images_per_shard=7,
                        max_reject_fraction=0.25, chunk_size=3, allow_empty=True), stage_main),
    "encode": (EncodePlan(staged="s", model="m", output="o", modality="image", batch_size=3, device="cuda",
                          collection="c", split="test", images_per_shard=5, texts_per_shard=6, model_copies=1,
                          threads=2, quantize="bf16"), encode_main),
    "build_index": (IndexPlan(embeddings="e", output="o", modality="text", factory="auto", metric="l2",
                              train_sample=9, seed=4, threads=1, ids="ids.parquet", max_index_memory=4_000_000,
                              max_query_ms=2.5, recall_target=0.9, auto_sample=50, auto_queries=20), index_main),
    "rerank": (RerankPlan(staged="s", embeddings="e", output="o", mode="add", k=7, lam=0.3, directions=("i2t",),
                          index="i", text_index="ti", ce_model="ce", be_model="be", collection="c", split="dev",
                          queries="q.parquet", batch_size=5, search_batch_size=9, threads=1, model_copies=2,
                          max_exhaustive_pairs=10, queries_per_shard=3, shards_per_wave=2, pairs_per_wave=11,
                          nprobe=4, quantize="int8"), rerank_main),
    "train": (TrainPlan(staged="s", output="o", base_model="b", halve_layers=True, max_regions=12,
                        max_train_captions=100, train_split="tr", dev_split="dv", manifest="demo", resume=True,
                        threads=1,
                        config=TrainConfig(objective="ce", be_loss="infonce", steps=7, batch_size=4, lr=1e-4,
                                           ce_loss="listwise", ce_negatives=3, ce_batch_size=2, amp=False,
                                           mined_negative_prob=0.5, mine_model="be", freeze_word_embeddings=True,
                                           length_chunk_rows=0, progress=False)), train_main),
    "queries": (QueriesPlan(staged="s", collection="c", output="o", split="dev", max_queries=3, seed=2, fold=1,
                            folds=5, fold_size=10), queries_main),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_plan_written_back_as_arguments_builds_the_same_plan(name):
    plan, main = PLANS[name]
    argv = to_argv(plan)
    assert plan_from_cli(type(plan), main.make_context(name, list(argv)).params) == plan
    required = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    extra = {"mode": "emb"} if isinstance(plan, RerankPlan) else {}  # co (the default) needs a CE model
    assert len(to_argv(type(plan)(**required, **extra))) == 2 * (len(required) + len(extra))  # defaults: not written


def test_an_option_is_declared_once_on_the_plan():
    """The CLI's options are the plan's fields: renaming a field renames its flag, and an unknown flag is an
    error (here in the train CLI, which has no Beam pass-through)."""
    names = {p.name for p in train_main.params}
    assert {"staged", "output", "steps", "ce_negatives", "device", "threads", "amp"} <= names
    with pytest.raises(click.UsageError, match="No such option"):
        train_main.make_context("train", ["--staged", "s", "--output", "o", "--stepz", "3"])

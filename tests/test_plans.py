"""Typed plans all the way: every pipeline's plan written back as arguments (``to_argv``) builds the same plan
through its own CLI, so what the suites and the demo launch is exactly the plan they built."""
from __future__ import annotations

import dataclasses
import json

import click
import pytest
import torch

from benchmarks.demo import DemoPlan
from benchmarks.demo import main as demo_main
from benchmarks.evaluate import EvaluatePlan
from benchmarks.evaluate import main as evaluate_main
from benchmarks.inspect import InspectPlan
from benchmarks.inspect import main as inspect_main
from benchmarks.queries import QueriesPlan
from benchmarks.queries import main as queries_main
from benchmarks.run import main as run_main
from benchmarks.suites.planner import Models, SuiteConfig
from pipelines.build_index.plan import IndexPlan
from pipelines.build_index.run import main as index_main
from pipelines.encode.plan import EncodePlan
from pipelines.encode.run import main as encode_main
from pipelines.rerank.plan import RerankPlan
from pipelines.rerank.run import main as rerank_main
from pipelines.stage.plan import StageError, StagePlan
from pipelines.stage.run import main as stage_main
from retrieval_core.cli import check_device, describe_device, plan_from_cli, resolve_device, to_argv
from retrieval_core.training import recipes
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
    "evaluate": (EvaluatePlan(rankings="r", staged="s", output="o", collection="c", split="dev", model="m", mode="add",
                              k=5, lam=0.2, label="L", collection_size=9, tag=("a=1", "b=2"), pretrained="p",
                              lang="de", against="r2", against_mode="emb", against_k=3, against_lam=0.1, bootstrap=500,
                              seed=3), evaluate_main),
    "inspect": (InspectPlan(rankings="r", against="r2", staged="s", output="o.html", mode="co", against_mode="ce",
                            k=4, against_k=2, lam=0.3, against_lam=0.7, images="i", manifest="m", per_group=0, show=3),
                inspect_main),
    "demo": (DemoPlan(k=20, queries=0, with_sep=True, seed=2), demo_main),
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


def test_the_suite_config_is_the_benchmark_clis_plan():
    """benchmarks.run's 24 options are SuiteConfig's fields: written back as arguments, they build the same
    config; the models a run resolves are no options (left out, and resolved again from the same arguments)."""
    cfg = SuiteConfig(suite="memory", manifest="m", join_dir="j", be_dir="b", ce_dir="c", recipe="demo",
                      model_seeds=(2,), no_sep=True, output="out", workdir="w", plan_only=True, quick=True,
                      batch_size=7, device="cuda:1", threads=2, quantize="bf16", ce_pair_budget=5, max_queries=9,
                      index_factory="HNSW32", memory_sizes=(300, 600), ann=("IVF-PQ",), hnsw_max_n=10,
                      eval_budget=1.5, fresh_interpreters=True)
    assert plan_from_cli(SuiteConfig, run_main.make_context("run", to_argv(cfg)).params) == cfg
    resolved = dataclasses.replace(cfg, models=Models(join="j"), feature_dim=16)
    assert to_argv(resolved) == to_argv(cfg)
    assert SuiteConfig(suite="latency").max_queries == 0 and SuiteConfig(suite="standard").max_queries == 500
    for bad, message in (({"model_seeds": ("1", "x")}, "--model-seed takes comma-separated seeds"),
                         ({"model_seeds": (1, 1)}, "distinct non-negative seeds"),
                         ({"memory_sizes": (300,)}, "--memory-sizes is for --suite memory"),
                         ({"device": "gpu"}, r"device must be one of auto\|cpu\|cuda\|cuda:N, got 'gpu'"),
                         ({"quantize": "int8", "device": "cuda"}, "--quantize int8 runs on CPU only")):
        with pytest.raises(ValueError, match=message):
            SuiteConfig(suite="standard", **bad)


#: The plans whose --device defaults to auto, each built from its required values plus ``device`` where given.
AUTO_DEVICE_PLANS = {
    "stage": lambda **d: StagePlan(output="o", **d),
    "encode": lambda **d: EncodePlan(staged="s", model="m", output="o", **d),
    "rerank": lambda **d: RerankPlan(staged="s", embeddings="e", output="o", mode="co", ce_model="ce", **d),
    "train": lambda **d: TrainPlan(staged="s", output="o", config=TrainConfig(**d)),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine resolves auto to cuda")
@pytest.mark.parametrize("name", sorted(AUTO_DEVICE_PLANS))
def test_device_auto_is_the_plan_of_device_cpu_on_a_machine_without_cuda(name):
    """--device auto (the default) resolves to cpu here, when the plan is built: the plan, everything it writes into
    a fingerprint (its fields as JSON) and the arguments it launches (the training recipe stamps) are those of
    --device cpu, so runs finished before auto became the default resume; only the summary says it was auto."""
    build = AUTO_DEVICE_PLANS[name]
    auto, cpu = build(), build(device="cpu")
    assert auto == cpu and hash(auto) == hash(cpu) and repr(auto) == repr(cpu)
    assert json.dumps(dataclasses.asdict(auto), sort_keys=True) == json.dumps(dataclasses.asdict(cpu), sort_keys=True)
    assert to_argv(auto) == to_argv(cpu) and "--device" not in to_argv(auto)
    assert build(device="AUTO") == auto
    device = auto.config.device if name == "train" else auto.device
    assert device == "cpu" and describe_device(device) == "cpu (auto: torch sees no CUDA device)"
    assert describe_device(cpu.config.device if name == "train" else cpu.device) == "cpu"
    _, main = PLANS[name]
    assert plan_from_cli(type(auto), main.make_context(name, to_argv(auto)).params) == cpu
    if name == "rerank":  # --quantize auto follows the device: float32 on the CPU
        assert auto.precision == "none"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine resolves auto to cuda")
def test_the_training_recipe_stamps_stay_those_of_device_cpu():
    """The cache's stamp of a trained model is its train arguments (cache._ensure_trained: to_argv of the recipe's
    TrainPlan): with auto on this machine they hold no --device, as with the old cpu default."""
    for recipe in (recipes.DEMO_RECIPE, recipes.BENCH_RECIPE):
        for cfg in (recipe.join, recipe.sep_be, recipe.sep_ce):
            assert cfg.device == "cpu"
            argv = to_argv(TrainPlan(staged="s", output="o", config=cfg))
            assert "--device" not in argv
            assert argv == to_argv(TrainPlan(staged="s", output="o", config=dataclasses.replace(cfg, device="cpu")))


def test_device_auto_resolves_to_cuda_where_torch_sees_one(monkeypatch):
    """Where torch sees a GPU, auto is cuda (and --quantize auto bf16 on a card with native bf16); --device cpu still
    forces the CPU, and is then written out for the launched command, which would resolve auto to cuda."""
    from retrieval_core import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precision, "cuda_bf16_supported", lambda: True)
    assert resolve_device("auto") == "cuda" and describe_device(resolve_device("auto")) == "cuda (auto)"
    plan = AUTO_DEVICE_PLANS["rerank"]()
    assert plan.device == "cuda" and describe_device(plan.device) == "cuda (auto)" and plan.precision == "bf16"
    assert "--device" not in to_argv(plan)
    assert describe_device(dataclasses.replace(plan, k=3).device) == "cuda (auto)"  # a derived plan keeps it
    forced = AUTO_DEVICE_PLANS["rerank"](device="cpu")
    assert forced.device == "cpu" and describe_device(forced.device) == "cpu" and forced.precision == "none"
    assert to_argv(forced)[-2:] == ["--device", "cpu"]
    assert AUTO_DEVICE_PLANS["train"]().config.device == "cuda"
    assert describe_device(AUTO_DEVICE_PLANS["rerank"](device="cuda:1").device) == "cuda:1"


def test_unknown_device_spellings_are_still_refused():
    assert [check_device(d) for d in ("auto", "AUTO", "cpu", "CUDA", "cuda:1")] == ["auto", "auto", "cpu", "cuda",
                                                                                     "cuda:1"]
    for bad in ("gpu", "cpu:0", "cuda:x", "auto:0", "", "mps"):
        with pytest.raises(ValueError, match=f"device must be one of auto.cpu.cuda.cuda:N, got {bad!r}"):
            resolve_device(bad)
    for name, build in AUTO_DEVICE_PLANS.items():
        with pytest.raises((ValueError, StageError), match="device must be one of auto.cpu.cuda.cuda:N, got 'gpu'"):
            build(device="gpu")  # the plan's own one-line error
    with pytest.raises(click.BadParameter, match="device must be one of auto.cpu.cuda.cuda:N, got 'gpu'"):
        encode_main.make_context("encode", ["--staged", "s", "--model", "m", "--output", "o", "--device", "gpu"])

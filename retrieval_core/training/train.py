"""``python -m retrieval_core.training.train``: trains a VLRetrievalModel (BE, CE or JOIN) on a staged dataset as a
`TrainPlan` says (the data, the model to start from, the trainer's `TrainConfig`); the loop is
``retrieval_core.training.trainer``'s."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import click

from retrieval_core.cli import (
    CONTEXT_SETTINGS,
    CheckedPlan,
    apply_device_and_threads,
    cli_errors,
    count_option,
    describe_device,
    option,
    option_group,
    plan_from_cli,
    plan_options,
    threads_option,
)
from retrieval_core.data.outputs import holds_output
from retrieval_core.data.region_file import RegionFile, ensure_region_file
from retrieval_core.data.store import StagedDataset
from retrieval_core.memory import available_bytes
from retrieval_core.model.backbones import E5_NAMES
from retrieval_core.model.network import CE_AGREEMENTS, ce_agreement_default
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.model_init import build_model
from retrieval_core.training.train_data import TRAIN_SOURCES, choose_train_source, load_split
from retrieval_core.training.trainer import Trainer


@dataclass(frozen=True)
class TrainPlan(CheckedPlan):
    """One ``python -m retrieval_core.training.train`` run: where the data comes from and goes, the model to start
    from, and the trainer's config; checked when built (one line naming the bad value)."""
    staged: str = option(help="Staged dataset directory (pipelines.stage output).")
    output: str = option(help="Output folder: last/, best/, train_log.jsonl.")
    config: TrainConfig = option_group(TrainConfig)
    base_model: str = option("minilm", help="'minilm', 'multilingual-e5-small' (alias 'e5'; the multilingual extra), "
                                            "a plain HF BERT folder, or a retrieval model folder to continue "
                                            "fine-tuning.")
    halve_layers: bool = option(False, help="Keep every other backbone layer (0, 2, 4, ..).")
    max_regions: Optional[int] = count_option(None, help="Regions per image the model uses (kept with the model; "
                                                         "fewer = faster on CPU).")
    ce_agreement: Optional[str] = option(
        None, type=click.Choice(CE_AGREEMENTS, case_sensitive=False),
        help="The CE's match logit also adds a learned multiple of the agreement of the pair's caption and region "
             "states entering the last layer: mean = cosine of their means, maxsim = caption tokens' best cosine "
             "with a region, averaged; none = the [CLS] classifier alone (added to a model folder that has none) "
             f"[a model built from a text backbone: {ce_agreement_default('new')}; a model folder keeps its own]")
    max_train_captions: Optional[int] = count_option(None, help="Train on a seeded random subset of this many "
                                                                "captions.")
    train_split: str = option("train")
    dev_split: str = option("dev")
    manifest: Optional[str] = option(None, help="Data manifest the staged dir came from (recorded in provenance).")
    languages: tuple[str, ...] = option((), sep=",", help="Train and select on captions of these languages only, "
                                                          "e.g. en (the zero-shot setting) [all]")
    train_source: str = option(
        "auto", type=click.Choice(TRAIN_SOURCES, case_sensitive=False),
        help="Where the splits' regions come from: streamed = read by position from a region file beside the staged "
             "shards (built on first use: the --max-regions regions of every staged image, in the staged "
             "precision), memory = one float32 table of them; auto = streamed unless the table fits and was "
             "measured faster (docs/TRAINING.md, \"Training memory\"). The model trained is the same.")
    resume: bool = option(False, help="Continue from output/last/.")
    threads: Optional[int] = threads_option()



@holds_output("train")
def run(plan: TrainPlan) -> dict:
    """Trains as ``plan`` says; returns Trainer.train's result (steps, best_dir, best_metric, best_eval)."""
    staged = StagedDataset(plan.staged)
    cfg = plan.config
    model = build_model(plan.base_model, staged.feature_dim, plan.halve_layers, cfg.seed, plan.ce_agreement,
                        staged.image_backbone)
    if plan.ce_agreement is not None and model.cfg.ce_agreement != plan.ce_agreement:
        if model.cfg.ce_agreement != "none":  # dropping a trained term would silently change what the CE computes
            raise ValueError(f"base model {plan.base_model!r} has the {model.cfg.ce_agreement!r} CE agreement term: "
                             f"continue with --ce-agreement {model.cfg.ce_agreement}")
        click.echo(f"note: {plan.base_model} has no CE agreement term: {plan.ce_agreement!r} starts at its initial "
                   f"scale", err=True)
        model.add_ce_agreement(plan.ce_agreement)
    if plan.base_model in E5_NAMES and not cfg.freeze_word_embeddings:
        click.echo("note: multilingual-e5-small's 96M word-embedding weights train too (more memory, slower "
                   "steps, and rows of the training language drift from the other languages'); "
                   "--freeze-word-embeddings keeps them (docs/MULTILINGUAL.md)", err=True)
    if plan.max_regions is not None:
        model.cfg.max_regions = plan.max_regions
    has_dev = len(staged.captions(split=plan.dev_split)) > 0
    regions = region_source(staged, plan, model.cfg.max_regions, has_dev)
    train = load_split(staged, plan.train_split, plan.max_train_captions, cfg.seed, plan.languages, regions)
    dev = None
    if has_dev:
        dev = load_split(staged, plan.dev_split, languages=plan.languages, regions=regions)
    else:
        click.echo(f"note: no captions in split {plan.dev_split!r}: no dev evaluation, best = last", err=True)
    model.cfg.provenance.update({"base_model": plan.base_model, "staged": os.path.abspath(plan.staged),
                                 "manifest": plan.manifest, "train_split": plan.train_split,
                                 "train_captions": len(train),
                                 **({"languages": list(plan.languages)} if plan.languages else {})})
    return Trainer(model, train, cfg, plan.output, dev).train(resume=plan.resume)


def region_source(staged: StagedDataset, plan: TrainPlan, max_regions: int, has_dev: bool) -> Optional[RegionFile]:
    """The region file the splits are read from, or None for the in-memory table, as choose_train_source rules on
    the splits' float32 table bytes (their staged region counts); says which on stderr."""
    splits = [plan.train_split] + ([plan.dev_split] if has_dev else [])
    counts = sum(int(staged.images_meta(split=s)["num_boxes"].sum()) for s in splits)
    table_bytes = counts * (staged.feature_dim + 6) * 4
    source, why = choose_train_source(plan.train_source.lower(), table_bytes, available_bytes())
    click.echo(f"train source: {source} ({why})", err=True)
    return ensure_region_file(staged, max_regions, log=lambda line: click.echo(line, err=True)) \
        if source == "streamed" else None


@click.command(context_settings=CONTEXT_SETTINGS,
               help="Fine-tune a VLRetrievalModel (BE, CE or JOIN) on a staged dataset: writes OUTPUT/last, "
                    "OUTPUT/best (the dev-best model) and OUTPUT/train_log.jsonl.")
@plan_options(TrainPlan)
def main(**values) -> None:
    # missing staged folder, bad model folder, bad value, out of memory: one line, exit 1
    with cli_errors(memory_options=("--batch-size", "--ce-batch-size")):
        apply_device_and_threads(values["device"], values["threads"])
        plan = plan_from_cli(TrainPlan, values)
        result = run(plan)
    click.echo(f"device: {describe_device(plan.config.device)}")  # recorded in the model's provenance.training
    if result["best_eval"] is not None:
        ev = result["best_eval"]
        extra = (f", CE pair accuracy vs random / nearest image {ev['ce_pair_acc']:.1f}% / "
                 f"{ev['ce_hard_pair_acc']:.1f}%" if "ce_pair_acc" in ev else "")
        click.echo(f"best model: {result['best_dir']} (step {ev['step']}, dev mR {ev['mR']:.2f}{extra})")
    else:
        click.echo(f"model: {result['best_dir']} (no dev evaluation)")


if __name__ == "__main__":
    main()

"""Which near-duplicates each head tells apart: within-family accuracy on a synthetic collection.

    python -m benchmarks.probes.family_probe --staged runs/demo/staged --manifest demo --model runs/demo/model/best \\
        [--ce-model DIR] --split test --output results/ [--device cpu|cuda] [--threads N]

Every caption of the split (or a seeded sample, ``--max-captions``) is scored against each member of its
image's family (the synthetic generator: a base scene and siblings that differ from it in one way) by the
bi-encoder (cosine of the embeddings) and by the cross-encoder. Two tables, written to
``family_probe.csv`` and printed:

* ``top1``: the share of captions whose own image scores highest in its family, by the change that made the
  gold image (``base`` for member 0); chance = 1 / family size;
* ``pairwise``: the share of (caption, sibling) pairs where the gold image scores above the sibling, by the
  change separating the two scenes (a base caption against an attribute sibling, or an attribute caption
  against the base, are both ``attribute``; two siblings differ by both changes, ``attribute+binding``);
  chance = 50 %.

A third head, ``oracle``, is the ceiling the features allow: it decodes each region the CE sees to the
(class, colour) it correlates with most in the generator's codebook (``synthetic.regions.decode_regions``) and scores
an image by how many of the caption's two focus (class, colour) pairs it contains (ties count as misses in
``pairwise``). It separates binding siblings although mean pooling cannot: a miss of a learned head there is a
learning failure, not missing information.

This is what the recall tables cannot show: R@1 on a synthetic collection is decided inside families, and the
per-change rows say which differences the CE resolves that the pooled BE does not.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import click
import numpy as np
import pandas as pd

from retrieval_core.cli import (
    CheckedPlan,
    apply_device_and_threads,
    batch_size_option,
    cli_errors,
    device_option,
    option,
    plan_command,
    plan_from_cli,
    threads_option,
)
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.regions import decode_regions
from retrieval_core.data.synthetic.scenes import describe_scene, focus_pairs
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.evaluation.stats import Bootstrap, percentile_interval
from retrieval_core.model.network import VLRetrievalModel


def _difference(a: dict, b: dict) -> str:
    """What separates two members of one family: the non-base member's change, or both changes
    ("attribute+binding") when neither is the base."""
    changes = sorted(c for c in (a["change"], b["change"]) if c)
    return "+".join(changes)


def sampled_captions(staged: StagedDataset, spec: SyntheticSpec, split: str,
                     max_captions: Optional[int], seed: int = 0, stream: int = 11) -> tuple[pd.DataFrame, dict]:
    """The captions of a synthetic collection's split (a seeded sample of ``max_captions``, drawn from random
    stream ``stream``, when given) and ``{image item_id: generator index}`` of the split's images."""
    meta = staged.images_meta(collection=spec.collection, split=split)
    caps = staged.captions(collection=spec.collection, split=split)
    if len(caps) == 0:
        raise ValueError(f"no captions of collection {spec.collection!r} in split {split!r}")
    if max_captions and len(caps) > max_captions:
        keep = np.sort(np.random.default_rng([seed, stream]).choice(len(caps), max_captions, replace=False))
        caps = caps.iloc[keep].reset_index(drop=True)
    return caps, dict(zip(meta["item_id"].astype(np.int64), meta["source_id"].astype(int)))


def probe(staged: StagedDataset, spec: SyntheticSpec, be_model: VLRetrievalModel,
          ce_model: VLRetrievalModel, split: str = "test", max_captions: Optional[int] = None, seed: int = 0,
          batch_size: int = 128, device: str = "cpu", boot: Bootstrap = Bootstrap()) -> pd.DataFrame:
    """Rows (table, head, change, correct, total, accuracy % with its bootstrap interval: captions resampled, each
    with all its pairs) for one synthetic collection."""
    caps, index_of = sampled_captions(staged, spec, split, max_captions, seed)
    item_of = {i: item for item, i in index_of.items()}
    fam_size = spec.family_size
    table = staged.load_images(item_ids=np.fromiter(index_of, np.int64, len(index_of)))  # the split's images
    pos = table.position_of()

    texts, members, golds, scenes = [], [], [], {}
    for text, img in zip(caps["text"], caps["image_item_id"].astype(np.int64)):
        gold = index_of[int(img)]
        first = gold - gold % fam_size
        family = [i for i in range(first, min(first + fam_size, spec.num_images)) if i in item_of]
        if len(family) < 2:
            continue  # a family cut by the collection's end has nothing to compare
        for i in family:
            scenes.setdefault(i, describe_scene(spec, i))
        texts.append(text)
        members.append(family)
        golds.append(gold)
    if not texts:
        raise ValueError("no caption has a family of two or more images in this split")
    flat = [i for fam in members for i in fam]
    regions = [table.regions(pos[item_of[i]]) for i in flat]
    pair_texts = [t for t, fam in zip(texts, members) for _ in fam]
    ce = ce_model.score(pair_texts, regions, batch_size=batch_size, device=device, progress=True)
    text_emb = be_model.encode_text(texts, batch_size=batch_size, device=device)
    img_emb = be_model.encode_image(regions, batch_size=batch_size, device=device)
    be = np.einsum("pd,pd->p", np.repeat(text_emb, [len(f) for f in members], axis=0), img_emb)
    # The ceiling: how many of the caption's focus (class, colour) pairs the regions the CE sees contain
    # (the codebook is drawn per (world_seed, feature width): take the width staged, which a --set may change)
    codebook = dataclasses.replace(spec, feature_dim=int(regions[0][0].shape[1]))
    decoded: dict[int, set] = {}
    for i, (feats, _) in zip(flat, regions):
        if i not in decoded:
            decoded[i] = set(decode_regions(codebook, feats[:ce_model.cfg.max_regions]))
    oracle = np.array([len(focus_pairs(scenes[gold]) & decoded[i])
                       for fam, gold in zip(members, golds) for i in fam], dtype=np.float64)

    # one resample of the captions for every head and change: a caption's pairs stay together (they share it)
    weights = np.random.default_rng(boot.seed).multinomial(len(texts), np.full(len(texts), 1 / len(texts)),
                                                            size=boot.resamples)
    rows = []
    for head, scores in (("BE", be), ("CE", ce), ("oracle", oracle)):
        top1: dict[str, list[tuple[int, int]]] = {}  # change -> (caption, hit) pairs
        pairwise: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for c, (fam, gold) in enumerate(zip(members, golds)):
            s = scores[start:start + len(fam)]
            start += len(fam)
            g = fam.index(gold)
            kind = scenes[gold]["change"] or "base"
            top1.setdefault(kind, []).append((c, int(np.argmax(s) == g)))
            for j, other in enumerate(fam):
                if j != g:
                    pairwise.setdefault(_difference(scenes[gold], scenes[other]), []).append((c, int(s[g] > s[j])))
        for name, groups in (("top1", top1), ("pairwise", pairwise)):
            for change, pairs in sorted(groups.items()) + [("all", [p for v in groups.values() for p in v])]:
                caption, hit = (np.array(x) for x in zip(*pairs))
                acc = 100.0 * float(hit.mean())
                w = weights[:, caption]
                iv = percentile_interval(acc, 100.0 * (w @ hit) / np.maximum(w.sum(1), 1), boot.level)
                rows.append({"table": name, "head": head, "change": change, "correct": int(hit.sum()),
                             "total": len(hit), "accuracy": acc, "accuracy_lo": iv.lo, "accuracy_hi": iv.hi})
    out = pd.DataFrame(rows)
    out.attrs["chance_top1"] = 100.0 / fam_size
    return out


def summary_table(rows: pd.DataFrame) -> str:
    wide = rows.pivot_table(index=["table", "change"], columns="head", values="accuracy", sort=False)
    totals = rows[rows["head"] == "BE"].set_index(["table", "change"])["total"]
    wide["n"] = totals
    return wide.to_string(float_format=lambda v: f"{v:.1f}")


@dataclasses.dataclass(frozen=True, kw_only=True)  # kw_only: required options may follow optional ones
class ProbeInputs(CheckedPlan):
    """What every probe of a synthetic collection reads (the probes' plans add their own options)."""
    staged: str = option(help="Staged synthetic collection (pipelines.stage output).")
    manifest: str = option(help="The manifest it was staged from (name or path).")
    collection: Optional[str] = option(None, help="Synthetic collection [the manifest's query collection].")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilyProbePlan(ProbeInputs):
    """The probe's options, each a typed field (checked when built)."""
    model: tuple[str, ...] = option(multiple=True, help="Bi-encoder model folder (also the CE unless --ce-model); "
                                                        "repeat it to probe several models (e.g. seeds) in one CSV.")
    ce_model: tuple[str, ...] = option((), multiple=True, help="Cross-encoder model folder (SEP) [--model]; one per "
                                                               "--model when given.")
    split: str = option("test")
    max_captions: int = option(1000, help="Seeded sample of captions (0 = all).")
    output: Optional[str] = option(None, help="Folder for family_probe.csv [print only].")
    batch_size: int = batch_size_option(128)
    device: str = device_option()
    threads: Optional[int] = threads_option()

    def __post_init__(self):
        super().__post_init__()
        if self.ce_model and len(self.ce_model) != len(self.model):
            raise ValueError(f"--ce-model: give one per --model ({len(self.model)}) or none, got "
                             f"{len(self.ce_model)}")


@plan_command(FamilyProbePlan)
def main(**values) -> None:
    """Within-family accuracy of the BE and the CE, by the kind of difference (synthetic collections only)."""
    from benchmarks.report import environment

    with cli_errors(KeyError):  # bad manifest, staged dir, model folder or collection: one line, exit 1
        plan = plan_from_cli(FamilyProbePlan, values)
        apply_device_and_threads(plan.device, plan.threads)
        split, boot = plan.split, Bootstrap()
        m = load_manifest(plan.manifest)
        name = plan.collection or m.benchmark.get("query_collection") or next(iter(m.collections))
        spec = m.synthetic_spec(name)
        staged = StagedDataset(plan.staged)
        env = environment(plan.device, plan.batch_size, plan.threads)
        tables = []
        for be_model, ce_model in zip(plan.model, plan.ce_model or plan.model):
            be = VLRetrievalModel.load(be_model)
            ce = VLRetrievalModel.load(ce_model) if ce_model != be_model else be
            rows = probe(staged, spec, be, ce, split, plan.max_captions or None, batch_size=plan.batch_size,
                         device=plan.device, boot=boot)
            click.echo(f"\nwithin-family accuracy (%), {name}/{split}, families of {spec.family_size} "
                       f"(top1 chance {rows.attrs['chance_top1']:.0f} %, pairwise chance 50 %), {be_model}"
                       + (f" / {ce_model}" if ce_model != be_model else "") + ":")
            click.echo(summary_table(rows))
            tables.append(rows.assign(collection=name, split=split, be_model=be_model, ce_model=ce_model,
                                      bootstrap=boot.label + " (captions, each with all its pairs)", **env))
    if plan.output:
        os.makedirs(plan.output, exist_ok=True)
        path = os.path.join(plan.output, "family_probe.csv")
        pd.concat(tables, ignore_index=True).to_csv(path, index=False)
        click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What stands at rank 1 when a ranking is wrong, on a synthetic collection: the cause analysis of a reranker.

    python -m benchmarks.probes.rerank_errors --rankings RUN --staged STAGED --manifest demo --output results/ \\
        [--modes emb,co] [--k 10]

For every query of a rerank run, ranked by each mode (derived from the run's stored scores), the rank-1 item is
compared with the gold by the scene it shows (``synthetic.scenes.describe_scene``): a sibling of the gold's
family (by the change that separates them: attribute, binding, ...), another scene that shares both, one or none of
the gold's two focus classes. The CE's margin at a wrong first place (its score of the rank-1 item minus its score
of the gold, when the gold is in the reranked top-k) says how sure it was. Queries one mode gets right and the other
wrong (hurt / improved) are classified the same way. Two CSVs: ``rerank_errors.csv`` (mode, direction, category,
count, share, median CE margin) and ``rerank_flips.csv`` (what the second mode put first where it hurt the first).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import click
import numpy as np
import pandas as pd

from benchmarks.probes.family_probe import _difference
from pipelines.files import BEAM_FILES, write_atomic
from retrieval_core.cli import CheckedPlan, cli_errors, k_option, option, plan_command, plan_from_cli
from retrieval_core.data import schema
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.synthetic.scenes import describe_scene
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.evaluation.runs import LoadedRun, RunError

CORRECT = "correct"


def category(spec: SyntheticSpec, first: int, gold: int) -> str:
    """How the scene at rank 1 (generator index ``first``) relates to the gold scene (``gold``)."""
    if first == gold:
        return CORRECT
    a, b = describe_scene(spec, first), describe_scene(spec, gold)
    if a["family"] == b["family"]:
        return f"sibling: {_difference(a, b)}"
    shared = len({a["groups"][g]["class"] for g in a["focus"]} & {b["groups"][g]["class"] for g in b["focus"]})
    return {2: "other scene, both focus classes", 1: "other scene, one focus class"}.get(shared,
                                                                                      "other scene, no focus class")


def first_places(run: LoadedRun, mode: str, k: Optional[int], caption_image: Optional[dict] = None) -> pd.DataFrame:
    """Per query (direction, query_id): the rank-1 item, the gold item it is judged against (t2i: the caption's
    image; i2t: the query image itself, the rank-1 caption standing for its image), and the CE / BE margins of the
    rank-1 item over the best-ranked gold item (NaN where the gold is outside the reranked top-k).
    ``caption_image``: every ranked caption's image (the run's gold maps only its query captions when it ranked a
    query selection; an i2t first place is any caption of the pool) [read from the staged folder]."""
    if caption_image is None:
        caption_image = run.dataset.gold()[0]
    table = run.ranked(k, mode, None).to_pandas()
    rows = []
    for (direction, qid), g in table.groupby(["direction", "query_id"], sort=True):
        g = g.sort_values("rank")
        top = g.iloc[0]
        if direction == schema.DIRECTION_T2I:
            gold_items = {run.caption_to_image[int(qid)]}
            first_image, gold_image = int(top["item_id"]), run.caption_to_image[int(qid)]
        else:
            gold_items = set(run.image_to_captions.get(int(qid), ()))
            first_image, gold_image = caption_image.get(int(top["item_id"]), -1), int(qid)
        gold_rows = g[g["item_id"].isin(gold_items)]
        best_gold = gold_rows.iloc[0] if len(gold_rows) else None
        rows.append({"direction": direction, "query_id": int(qid), "first_image": first_image,
                     "gold_image": gold_image, "hit": int(top["item_id"]) in gold_items,
                     "ce_margin": float(top["ce_score"] - best_gold["ce_score"]) if best_gold is not None else np.nan,
                     "be_margin": float(top["be_score"] - best_gold["be_score"]) if best_gold is not None else np.nan})
    return pd.DataFrame(rows)


def analyse(run: LoadedRun, spec: SyntheticSpec, modes: tuple[str, ...], k: Optional[int]
            ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(errors, flips): per mode and direction the categories of the first places, and where the second mode hurt
    (or improved) the first, what each put first."""
    index_of = dict(zip(run.dataset.images_meta(collection=spec.collection)["item_id"].astype(np.int64),
                        run.dataset.images_meta(collection=spec.collection)["source_id"].astype(int)))
    places, caption_image = {}, run.dataset.gold()[0]
    for mode in modes:
        p = first_places(run, mode, k if mode != "emb" else None, caption_image)
        p["category"] = [category(spec, index_of[f], index_of[g]) if f in index_of else "not in the collection"
                         for f, g in zip(p["first_image"], p["gold_image"])]
        places[mode] = p
    errors = []
    for mode, p in places.items():
        for direction, d in p.groupby("direction"):
            for cat, c in d.groupby("category"):
                errors.append({"mode": mode, "direction": direction, "category": cat, "count": len(c),
                               "share_of_queries": round(100 * len(c) / len(d), 2),
                               "share_of_errors": round(100 * len(c) / max(1, int((~d["hit"]).sum())), 2)
                               if cat != CORRECT else "",
                               "median_ce_margin": round(float(c["ce_margin"].median()), 4)
                               if cat != CORRECT and c["ce_margin"].notna().any() else ""})
    flips = []
    if len(modes) == 2:
        a, b = (places[m].set_index(["direction", "query_id"]) for m in modes)
        both = a.merge(b, left_index=True, right_index=True, suffixes=("_a", "_b"))
        for direction, d in both.groupby(level="direction"):
            for what, sel, cat_col in (("hurt", d["hit_a"] & ~d["hit_b"], "category_b"),
                                       ("improved", ~d["hit_a"] & d["hit_b"], "category_a")):
                for cat, c in d[sel].groupby(cat_col):
                    flips.append({"flip": f"{what} by {modes[1]} (vs {modes[0]})", "direction": direction,
                                  "first_place_of_the_wrong_one": cat, "count": len(c),
                                  "median_ce_margin": round(float(c["ce_margin_b"].median()), 4)
                                  if what == "hurt" and c["ce_margin_b"].notna().any() else ""})
    return pd.DataFrame(errors), pd.DataFrame(flips)


@dataclass(frozen=True, kw_only=True)  # kw_only: required options may follow optional ones
class RerankErrorsPlan(CheckedPlan):
    """The analysis's options, each a typed field (checked when built)."""
    rankings: str = option(help="A pipelines.rerank run with CE scores (its dir).")
    staged: str = option(help="Its staged folder (a synthetic collection).")
    manifest: str = option(help="The synthetic manifest the collection was staged from.")
    collection: Optional[str] = option(None, help="The synthetic collection [the run's].")
    modes: tuple[str, ...] = option(("emb", "co"), sep=",", help="The rankings compared (from the stored scores).")
    k: Optional[int] = k_option(None, help="Rerank depth [the run's].")
    output: str = option(help="Folder for rerank_errors.csv and rerank_flips.csv.")


@plan_command(RerankErrorsPlan)
def main(**values):
    """Classify the first places of each ranking of a run: correct, a sibling (by change), another scene."""
    with cli_errors(RunError):
        plan = plan_from_cli(RerankErrorsPlan, values)
        run = LoadedRun.read(plan.rankings, plan.staged, plan.collection, files=BEAM_FILES)
        spec = load_manifest(plan.manifest).synthetic_spec(run.collection)
        errors, flips = analyse(run, spec, plan.modes, plan.k)
    output = plan.output
    for name, frame in (("rerank_errors.csv", errors), ("rerank_flips.csv", flips)):
        write_atomic(os.path.join(output, name), frame.to_csv(index=False).encode("utf-8"))
    with pd.option_context("display.width", 160, "display.max_rows", 200):
        click.echo(errors.to_string(index=False))
        if len(flips):
            click.echo("\n" + flips.to_string(index=False))
    click.echo(f"wrote {os.path.join(output, 'rerank_errors.csv')} and rerank_flips.csv")


if __name__ == "__main__":
    main()

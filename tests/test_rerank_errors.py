"""benchmarks.probes.rerank_errors on a staged tiny synthetic collection: every query's first place is classified once
per mode, the correct ones are the ranking's R@1, and the flips are the queries one mode gets right and the other
wrong."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from benchmarks.probes import rerank_errors
from pipelines.build_index.plan import IndexPlan
from pipelines.build_index.run import run as build_index
from pipelines.encode.plan import EncodePlan
from pipelines.encode.run import run as encode
from pipelines.rerank.plan import RerankPlan
from pipelines.rerank.run import run as rerank
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.scenes import describe_scene
from retrieval_core.evaluation.runs import LoadedRun
from tests.helpers_model import staged_demo_and_tiny_model
from tests.test_family_probe import OVERRIDES, F


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    staged, model = staged_demo_and_tiny_model(str(root), OVERRIDES, F)
    encode(EncodePlan(staged, model, str(root / "emb"), batch_size=16))
    build_index(IndexPlan(str(root / "emb"), str(root / "index"), threads=1))
    rerank(RerankPlan(staged, str(root / "emb"), str(root / "run"), mode="co", k=5, index=str(root / "index"),
                      ce_model=model, batch_size=16))
    # a run of a query selection, as the demo and the suites rank: its gold maps only the query captions
    gold_c, gold_i = StagedDataset(staged).gold()
    queries = pd.DataFrame({"direction": ["t2i"] * 12 + ["i2t"] * 6,
                            "query_id": sorted(gold_c)[::3][:12] + sorted(gold_i)[::2][:6]})
    queries.to_parquet(root / "queries.parquet", index=False)
    rerank(RerankPlan(staged, str(root / "emb"), str(root / "run_q"), mode="co", k=5, index=str(root / "index"),
                      ce_model=model, batch_size=16, queries=str(root / "queries.parquet")))
    spec = load_manifest("demo", OVERRIDES).synthetic_spec("demo")
    return {"all": (LoadedRun.read(str(root / "run"), staged), spec),
            "selection": (LoadedRun.read(str(root / "run_q"), staged), spec)}


@pytest.mark.parametrize("which", ["all", "selection"])
def test_first_places_are_classified_once_and_correct_ones_are_r_at_1(run, which):
    loaded, spec = run[which]
    errors, flips = rerank_errors.analyse(loaded, spec, ("emb", "co"), 5)
    for mode in ("emb", "co"):
        recall = loaded.evaluate(5 if mode == "co" else None, mode)
        for d in ("t2i", "i2t"):
            rows = errors[(errors["mode"] == mode) & (errors["direction"] == d)].set_index("category")
            assert rows["count"].sum() == recall[f"{d}_queries"]
            correct = rows["count"].get(rerank_errors.CORRECT, 0)
            assert 100 * correct / recall[f"{d}_queries"] == pytest.approx(recall[f"{d}_R@1"])
            assert set(rows.index) <= {rerank_errors.CORRECT, "other scene, both focus classes",
                                       "other scene, one focus class", "other scene, no focus class"} | \
                {f"sibling: {c}" for c in ("attribute", "binding", "attribute+attribute", "attribute+binding")}
    emb_hits, co_hits = (loaded.hits(k, m) for k, m in ((None, "emb"), (5, "co")))
    for d in ("t2i", "i2t"):
        hurt = int(((emb_hits[d].first_hit == 0) & (co_hits[d].first_hit != 0)).sum())
        got = flips[(flips["direction"] == d) & flips["flip"].str.startswith("hurt")]["count"].sum()
        assert got == hurt


def test_a_sibling_is_named_by_its_change():
    spec = load_manifest("demo", OVERRIDES).synthetic_spec("demo")
    changes = [describe_scene(spec, i)["change"] for i in range(4)]
    assert rerank_errors.category(spec, 0, 0) == rerank_errors.CORRECT
    assert rerank_errors.category(spec, 2, 0) == f"sibling: {changes[2]}"
    assert rerank_errors.category(spec, 1, 2).startswith("sibling: ") and "+" in rerank_errors.category(spec, 1, 2)
    other = next(i for i in range(4, 48) if rerank_errors.category(spec, i, 0).startswith("other scene"))
    assert np.isscalar(other)

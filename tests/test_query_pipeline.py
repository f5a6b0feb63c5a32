"""pipelines.query and its Python entry point (retrieval_core.search.query) on the tiny staged set: for queries that
are staged items, the job, the entry point and pipelines.rerank give the same rankings and scores; bad queries are
rejected with their reason (queries in = answered + rejected); mismatched inputs are refused; a killed run resumes;
DaskRunner writes the same bytes as DirectRunner; --mode auto reuses a finished auto run's choice."""
from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipelines.build_index import plan as build_index_plan
from pipelines.build_index import run as build_index_run
from pipelines.encode import plan as encode_plan
from pipelines.encode import run as encode_run
from pipelines.query import plan as query_plan
from pipelines.query import run as query_run
from pipelines.rerank import plan as rerank_plan
from pipelines.rerank import run as rerank_run
from retrieval_core.data.store import StagedDataset
from retrieval_core.search.query import QueryEngine, QueryError
from tests.helpers_dask import dask_args, local_cluster
from tests.test_encode_pipeline import write_tiny_model

#: BE and CE scores of the same query and item computed in other batches (the rerank job batches pairs of many
#: queries by length; the entry point one batch of queries) agree to float32 rounding of the batch: ~1e-7 seen.
SCORE_TOL = 1e-5
K = 4


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_encoded):
    """(a folder of this module's own, staged, model, embeddings, a Flat image index of them)."""
    staged, model, emb_dir = tiny_encoded
    root = str(tmp_path_factory.mktemp("query"))
    index = os.path.join(root, "index")
    build_index_run.run(build_index_plan.IndexPlan(embeddings=emb_dir, output=index, threads=1))
    return root, staged, model, emb_dir, index


def test_job_entry_point_and_rerank_give_the_same_rankings_and_scores(assets, tmp_path):
    root, staged, model, emb_dir, index = assets
    ds = StagedDataset(staged)
    caps = ds.captions(split="test")
    images = ds.images_meta(split="test")["item_id"].tolist()
    rerank_out = str(tmp_path / "rerank")
    rerank_run.run(rerank_plan.RerankPlan(staged, emb_dir, rerank_out, mode="co", k=K, index=index, ce_model=model,
                                          split="test"))
    ranked = pd.concat([pq.read_table(os.path.join(rerank_out, "rankings", f)).to_pandas()
                        for f in sorted(os.listdir(os.path.join(rerank_out, "rankings")))])
    ranked = ranked[ranked["rank"] <= K]

    engine = QueryEngine(staged=staged, embeddings=emb_dir, index=index)
    from retrieval_core.search.query import Query
    api = pd.concat([engine.search_text([Query(str(c), t) for c, t in zip(caps["caption_id"], caps["text"])], k=K),
                     engine.search_images([Query(str(i), image=str(i)) for i in images], k=K)])

    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": str(c), "text": t}) + "\n"
                               for c, t in zip(caps["caption_id"], caps["text"])))
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in images))
    job = []
    for direction, arg in (("t2i", {"queries": str(queries)}), ("i2t", {"image_ids": str(ids)})):
        out = str(tmp_path / f"job-{direction}")
        manifest = query_run.run(query_plan.QueryPlan(staged, emb_dir, out, index=index, k=K, **arg))
        assert manifest["queries"] == {"in": len(caps) if direction == "t2i" else len(images),
                                       "answered": len(caps) if direction == "t2i" else len(images), "rejected": 0,
                                       "rejected_by_reason": {}, "truncated": 0}
        hits = pq.read_table(os.path.join(out, "hits"))
        assert hits.to_pylist() == [json.loads(line) for line in open(os.path.join(out, "hits.jsonl"))]
        job.append(hits.to_pandas())
    job = pd.concat(job)

    # the job calls the entry point per batch: the same batches (all queries in one) give the same bits
    cols = ["direction", "query_id", "rank", "item_id", "be_rank", "be_score", "ce_score", "final_score"]
    pd.testing.assert_frame_equal(job[cols].reset_index(drop=True), api[cols].reset_index(drop=True))
    # and pipelines.rerank ranks the staged items alike: same items in the same order, scores within SCORE_TOL
    for (d, q), g in api.groupby(["direction", "query_id"]):
        r = ranked[(ranked["direction"] == d) & (ranked["query_id"] == int(q))].sort_values("rank")
        assert g["item_id"].tolist() == r["item_id"].tolist(), (d, q)
        for col in ("be_score", "ce_score", "final_score"):
            np.testing.assert_allclose(g[col].to_numpy(), r[col].to_numpy(), atol=SCORE_TOL, rtol=0)
    assert len(api) == K * (len(caps) + len(images))


def test_the_engine_scores_without_onednn_and_leaves_it_as_it_was(assets):
    """float32 CPU: the models' calls run with oneDNN off (its per-shape primitives grew a long-lived engine's
    memory), counted across threads, and the process's setting is back once the last call has left."""
    import threading

    import torch

    from retrieval_core.memory import without_onednn

    root, staged, model, emb_dir, index = assets
    engine = QueryEngine(staged=staged, embeddings=emb_dir, index=index)
    seen, score = [], engine.ce_model.score
    engine.ce_model.score = lambda *a, **kw: (seen.append(torch.backends.mkldnn.enabled), score(*a, **kw))[1]
    before = torch.backends.mkldnn.enabled
    engine.search_text(["a small red cube"], k=K)
    assert seen == [False] and torch.backends.mkldnn.enabled == before
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with without_onednn():
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(30)
    with without_onednn():
        pass
    assert torch.backends.mkldnn.enabled is False  # the other holder is still inside
    leave.set()
    t.join()
    assert torch.backends.mkldnn.enabled == before


def test_bad_queries_are_rejected_with_their_reason_and_counted(assets, tmp_path, capsys):
    root, staged, model, emb_dir, index = assets
    text = tmp_path / "q.txt"
    text.write_text("a red dog and a blue car\n\n" + "a red dog and a blue car\n" + "a green tree " * 60 + "\n")
    out = str(tmp_path / "t2i")
    manifest = query_run.run(query_plan.QueryPlan(staged, emb_dir, out, queries=str(text), mode="emb", k=3))
    assert manifest["queries"] == {"in": 4, "answered": 2, "rejected": 2, "truncated": 1,
                                   "rejected_by_reason": {"empty query": 1, "duplicate": 1}}
    assert "queries in: 4 = 2 answered + 2 rejected (1 empty query, 1 duplicate); 1 cut" in capsys.readouterr().out
    rejects = [json.loads(line) for line in open(os.path.join(out, "rejects.jsonl"))]
    assert [(r["query_id"], r["reason"].split(":")[0]) for r in rejects] == [("2", "empty query"), ("3", "duplicate")]
    assert manifest["ce_model"] is None and set(pq.read_table(os.path.join(out, "hits")).column("query_id")
                                                .to_pylist()) == {"1", "4"}

    image = StagedDataset(staged).images_meta()
    ids = tmp_path / "ids.txt"
    ids.write_text(f"{image['item_id'][0]}\n12345\n{image['source_id'][1]}\n")
    (tmp_path / "pics").mkdir()
    out = str(tmp_path / "i2t")
    manifest = query_run.run(query_plan.QueryPlan(staged, emb_dir, out, image_ids=str(ids), k=3))
    assert manifest["queries"]["in"] == 3 and manifest["queries"]["answered"] == 2
    assert manifest["queries"]["rejected_by_reason"] == {"unknown id": 1}
    assert json.loads(open(os.path.join(out, "rejects.jsonl")).read())["query_id"] == "12345"
    # pictures need the backbone the staged folder was built with: these features were extracted elsewhere
    engine = QueryEngine(staged=staged, embeddings=emb_dir, device="cpu")
    (tmp_path / "pic.png").write_bytes(b"x")
    with pytest.raises(QueryError, match="extracted elsewhere"):
        engine.search_images([str(tmp_path / "pic.png")])


def test_mismatched_inputs_are_refused_in_one_line(assets, tmp_path):
    from click.testing import CliRunner

    root, staged, model, emb_dir, index = assets
    other_model = write_tiny_model(str(tmp_path / "model1"), str(tmp_path), seed=1)
    other_emb = str(tmp_path / "emb1")
    encode_run.run(encode_plan.EncodePlan(staged, other_model, other_emb, batch_size=8, modality="image"))
    (tmp_path / "q.txt").write_text("a red dog\n")
    args = ["--staged", staged, "--queries", str(tmp_path / "q.txt"), "--output", str(tmp_path / "out")]
    res = CliRunner().invoke(query_run.main, args + ["--embeddings", other_emb, "--index", index])
    assert res.exit_code == 1 and res.output.startswith(f"Error: index {index} was built from the image embeddings "
                                                        f"in {emb_dir}"), res.output
    res = CliRunner().invoke(query_run.main, args + ["--embeddings", emb_dir, "--model", other_model])
    assert res.exit_code == 1 and "is not the model that encoded the embeddings" in res.output, res.output
    res = CliRunner().invoke(query_run.main, args + ["--embeddings", emb_dir, "--images", str(tmp_path)])
    assert res.exit_code == 2 and "pass one of --queries" in res.output, res.output
    assert not os.path.exists(tmp_path / "out")


def _sample_queries(staged, tmp_path) -> str:
    caps = StagedDataset(staged).captions(split="test")["text"].drop_duplicates().tolist()
    (tmp_path / "q.txt").write_text("\n".join(caps) + "\n")
    return str(tmp_path / "q.txt")


def test_a_killed_run_resumes_its_unfinished_shards(assets, tmp_path):
    root, staged, model, emb_dir, index = assets
    kw = dict(queries=_sample_queries(staged, tmp_path), index=index, k=3, queries_per_shard=4, queries_per_batch=2)
    out = str(tmp_path / "direct")
    first = query_run.run(query_plan.QueryPlan(staged, emb_dir, out, **kw))
    names = [s["name"] for s in first["shards"]]
    assert len(names) == 3 and first["shards_reused"] == 0
    jsonl = open(os.path.join(out, "hits.jsonl")).read()
    os.remove(os.path.join(out, "hits", names[1]))  # a run killed before this shard was written
    with open(os.path.join(out, "hits", names[2]), "ab") as f:  # and one cut short: its checksum fails
        f.write(b"x")
    again = query_run.run(query_plan.QueryPlan(staged, emb_dir, out, **kw))
    assert again["shards_reused"] == 1 and again["shards"] == first["shards"]
    assert open(os.path.join(out, "hits.jsonl")).read() == jsonl


def test_dask_writes_the_bytes_direct_writes(assets, tmp_path):
    """At the same --threads (torch's CPU kernels round by thread count, as in encode)."""
    root, staged, model, emb_dir, index = assets
    kw = dict(queries=_sample_queries(staged, tmp_path), index=index, k=3, queries_per_shard=4, queries_per_batch=2,
              threads=1)
    direct = query_run.run(query_plan.QueryPlan(staged, emb_dir, str(tmp_path / "direct"), **kw))
    with local_cluster() as cluster:
        manifest = query_run.run(query_plan.QueryPlan(staged, emb_dir, str(tmp_path / "dask"), **kw),
                                 dask_args(cluster))
    assert manifest["runner"] == "DaskRunner" and manifest["shards"] == direct["shards"]


def test_mode_auto_reuses_the_choice_of_a_finished_auto_run(assets, tmp_path):
    root, staged, model, emb_dir, index = assets
    one = dict(k=K, ce_model=model, batch_size=1)
    dev, auto = str(tmp_path / "dev"), str(tmp_path / "auto")
    rerank_run.run(rerank_plan.RerankPlan(staged, emb_dir, dev, mode="co", split="train", **one))
    choice = rerank_run.run(rerank_plan.RerankPlan(staged, emb_dir, auto, mode="auto", tune_on=dev, split="test",
                                                   **one))["fusion_choice"]
    (tmp_path / "q.txt").write_text("a red dog and a blue car\n")
    queries = str(tmp_path / "q.txt")
    manifest = query_run.run(query_plan.QueryPlan(staged, emb_dir, str(tmp_path / "out"), queries=queries,
                                                  mode="auto", tune_on=auto, k=K))
    assert (manifest["mode"], manifest["fusion_choice"]["label"]) == (choice["mode"], choice["label"])
    # the Python entry point reads the same record and ranks alike
    engine = QueryEngine(staged=staged, embeddings=emb_dir)
    api = engine.search_text(["a red dog and a blue car"], k=K, rerank="auto", tune_on=auto)
    assert (api.attrs["mode"], api.attrs["fusion_choice"]["label"]) == (choice["mode"], choice["label"])
    job = pq.read_table(os.path.join(tmp_path, "out", "hits")).to_pandas()
    cols = ["rank", "item_id", "be_score", "ce_score", "final_score"]
    pd.testing.assert_frame_equal(api[cols].reset_index(drop=True), job[cols].reset_index(drop=True))
    for kw, refused in ((dict(rerank="auto"), "takes tune_on"), (dict(rerank="co", tune_on=auto), "takes tune_on"),
                        (dict(rerank="auto", tune_on=dev), "chose nothing"),
                        (dict(rerank="auto", tune_on=auto, k=K + 1), f"at k = {K}, not at k={K + 1}")):
        with pytest.raises(QueryError, match=refused):
            engine.search_text(["a red dog"], **{"k": K, **kw})
    with pytest.raises(query_plan.QueryJobError, match="chose nothing"):
        query_run.run(query_plan.QueryPlan(staged, emb_dir, str(tmp_path / "x"), queries=str(tmp_path / "q.txt"),
                                           mode="auto", tune_on=dev, k=K))
    with pytest.raises(query_plan.QueryJobError, match="at k = 4, not at --k 5"):
        query_run.run(query_plan.QueryPlan(staged, emb_dir, str(tmp_path / "x"), queries=str(tmp_path / "q.txt"),
                                           mode="auto", tune_on=auto, k=5))


def test_pictures_go_through_the_staged_backbone_and_unreadable_ones_are_rejected(tmp_path):
    """A staged folder built from pictures records its backbone; a picture query is turned into regions by that
    backbone, rebuilt from the record (an undecodable file is a reject with the stager's reason), and ranks like
    the staged image with the same regions."""
    from PIL import Image

    from retrieval_core.data.pixels.backbone import GridSpec, backbone_for, fingerprint
    from retrieval_core.model.checkpoints import inspect_model_folder
    from tests.helpers_model import tiny_model
    from tests.test_encode_pipeline import write_tiny_staged

    desc = fingerprint(GridSpec(grids=(1, 2)))
    backbone = backbone_for(desc)
    pictures = tmp_path / "pics"
    pictures.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8)).save(pictures / "noise.png")
    (pictures / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    staged = write_tiny_staged(str(tmp_path / "staged"), num_images=8, feature_dim=backbone.feature_dim)
    summary = json.load(open(os.path.join(staged, "summary.json")))
    json.dump({**summary, "image_backbone": desc}, open(os.path.join(staged, "summary.json"), "w"))
    model = tiny_model(str(tmp_path / "src"), feature_dim=backbone.feature_dim)
    model.cfg.image_backbone = desc["fingerprint"]
    model.save(str(tmp_path / "model"))
    ds = StagedDataset(staged)
    caps = ds.captions()
    from retrieval_core.search import embeddings as emb_io

    emb = tmp_path / "emb"
    (emb / "embeddings" / "text").mkdir(parents=True)
    data = emb_io.embedding_shard_bytes(caps["caption_id"].to_numpy(), model.encode_text(caps["text"].tolist()))
    (emb / "embeddings" / "text" / "tiny.parquet").write_bytes(data)
    manifest = emb_io.make_embeddings_manifest(str(tmp_path / "model"), inspect_model_folder(str(tmp_path / "model"))
                                               .fingerprint, model.embedding_dim,
                                               {"text": [emb_io.shard_info("tiny.parquet", data, len(caps))]}, "test")
    (emb / "embeddings_manifest.json").write_text(json.dumps(manifest))

    engine = QueryEngine(staged=staged, embeddings=str(emb), device="cpu", directions=("i2t",))
    hits = engine.search_images([str(pictures / "noise.png"), str(pictures / "broken.png")], k=3)
    assert hits["query_id"].unique().tolist() == ["0"] and len(hits) == 3
    assert [r["reason"].split(":")[0] for r in hits.attrs["rejected"]] == ["unreadable picture"]
    # the same regions given directly rank alike: the picture went through the recorded backbone
    from retrieval_core.data.pixels import decode

    pixels = decode.decode_image((pictures / "noise.png").read_bytes(), backbone.input_size).pixels
    regions = (backbone.regions(np.stack([pixels]))[0], backbone.boxes)
    same = engine.search_images([regions], k=3)
    assert same["item_id"].tolist() == hits["item_id"].tolist()
    np.testing.assert_allclose(same["ce_score"], hits["ce_score"], atol=1e-6)
    # and a staged folder of another backbone is refused before anything loads
    json.dump({**summary, "image_backbone": fingerprint(GridSpec(grids=(2,)))},
              open(os.path.join(staged, "summary.json"), "w"))
    with pytest.raises(QueryError, match="trained on"):
        QueryEngine(staged=staged, embeddings=str(emb), device="cpu", directions=("i2t",))


def test_a_pool_over_the_cache_budget_reads_the_region_file_with_the_same_hits(assets, tmp_path, monkeypatch):
    """A pool larger than CACHED_IMAGE_BYTES reads each candidate from the region file (one pread), not its whole
    shard: the same regions, so the same hits and scores bit for bit."""
    import shutil

    from retrieval_core.search import query as query_module
    from retrieval_core.search.query import Query

    root, staged, model, emb_dir, index = assets
    local = str(tmp_path / "staged")
    shutil.copytree(staged, local)  # the region file is written beside the staged shards: not in a shared fixture
    caps = StagedDataset(local).captions(split="test")
    queries = [Query(str(c), t) for c, t in zip(caps["caption_id"], caps["text"])]
    cached = QueryEngine(staged=local, embeddings=emb_dir, index=index)
    hits = cached.search_text(queries, k=K)
    assert cached.images.file is None
    monkeypatch.setattr(query_module, "CACHED_IMAGE_BYTES", 0)
    streamed = QueryEngine(staged=local, embeddings=emb_dir, index=index)
    pd.testing.assert_frame_equal(streamed.search_text(queries, k=K), hits)
    assert streamed.images.file is not None and os.path.isdir(os.path.join(local, "regions"))

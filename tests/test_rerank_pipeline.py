"""pipelines.rerank on a tiny staged set: EMB vs exact numpy top-k, CE scores vs the model, pair dedupe,
rerun idempotency, and identical rankings on DirectRunner and DaskRunner."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.build_index import plan as build_index_plan
from pipelines.build_index import run as build_index_run
from pipelines.encode import plan as encode_plan
from pipelines.encode import run as encode_run
from pipelines.rerank import graph as rerank_graph
from pipelines.rerank import plan as rerank_plan
from pipelines.rerank import run as rerank_run
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.search import embeddings
from retrieval_core.search.exact import exact_topk
from retrieval_core.search.rerank import RANKINGS_MANIFEST, _sigmoid
from tests.test_encode_pipeline import write_tiny_model, write_tiny_staged

NUM_IMAGES = 24  # 6 test images, 12 test captions; pools: 24 images, 48 captions


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_encoded):
    """(a folder of this module's own, and the run's shared tiny staged collection, model and embeddings)."""
    staged, model, emb_dir = tiny_encoded
    assert len(StagedDataset(staged).images_meta()) == NUM_IMAGES
    return str(tmp_path_factory.mktemp("rerank")), staged, model, emb_dir


def run_rerank(staged, emb_dir, output, beam_args=(), **kw):
    return rerank_run.run(rerank_plan.RerankPlan(staged, emb_dir, output, **kw), beam_args)


def read_rankings(out: str, direction: str):
    files = sorted(f for f in os.listdir(os.path.join(out, "rankings")) if f.startswith(direction))
    return pq.read_table([os.path.join(out, "rankings", f) for f in files][0]).to_pandas() if len(files) == 1 \
        else None


def per_query(df):
    return {q: g.sort_values("rank") for q, g in df.groupby("query_id")}


def test_emb_rankings_equal_exact_topk(assets, tmp_path):
    root, staged, _, emb_dir = assets
    index_dir = str(tmp_path / "index")
    build_index_run.run(build_index_plan.IndexPlan(embeddings=emb_dir, output=index_dir, threads=1))
    out = str(tmp_path / "run")
    manifest = run_rerank(staged, emb_dir, out, mode="emb", k=3, index=index_dir, split="test")
    ds = StagedDataset(staged)
    assert manifest["queries"] == {"t2i": 12, "i2t": 6}
    assert "FAISS" in manifest["search"]["t2i"] and "exact" in manifest["search"]["i2t"]
    assert manifest["device"] is None  # no CE scored

    img_ids, img_vecs = embeddings.read_embeddings(emb_dir, "image")
    txt_ids, txt_vecs = embeddings.read_embeddings(emb_dir, "text")
    for direction, q_ids, (p_ids, p_vecs), (qa_ids, qa_vecs) in (
            ("t2i", ds.captions(split="test")["caption_id"].to_numpy(), (img_ids, img_vecs), (txt_ids, txt_vecs)),
            ("i2t", ds.images_meta(split="test")["item_id"].to_numpy(), (txt_ids, txt_vecs), (img_ids, img_vecs))):
        pos = {int(i): n for n, i in enumerate(qa_ids)}
        queries = qa_vecs[[pos[int(q)] for q in q_ids]]
        scores, ids = exact_topk(queries, p_vecs, p_ids, 10)  # keep = max(k, 10)
        got = per_query(read_rankings(out, direction))
        assert sorted(got) == sorted(int(q) for q in q_ids)
        for row, q in enumerate(q_ids):
            g = got[int(q)]
            assert g["rank"].tolist() == list(range(1, 11))
            assert g["item_id"].tolist() == ids[row].tolist()
            np.testing.assert_allclose(g["be_score"].to_numpy(), scores[row], atol=1e-5)
            assert g["ce_score"].isna().all()
            assert np.all(np.diff(g["final_score"].to_numpy()) <= 0)  # best first


def test_ce_scores_come_from_the_model_and_pairs_are_scored_once(assets, tmp_path):
    root, staged, model_dir, emb_dir = assets
    out = str(tmp_path / "run")
    # Exhaustive CE: t2i 12 captions x 24 images, i2t 6 images x 48 captions; the 12 x 6 test-test pairs are
    # requested by both directions and must be scored once.
    with pytest.raises(rerank_plan.RerankError, match="max-exhaustive-pairs"):
        run_rerank(staged, emb_dir, out, mode="ce", ce_model=model_dir, max_exhaustive_pairs=500)
    manifest = run_rerank(staged, emb_dir, out, mode="ce", k=5, ce_model=model_dir, batch_size=16)
    assert manifest["ce_pairs_requested"] == 12 * 24 + 6 * 48
    assert manifest["ce_pairs_scored"] == 12 * 24 + 6 * 48 - 12 * 6

    ds = StagedDataset(staged)
    model = VLRetrievalModel.load(model_dir)
    texts = ds.captions().set_index("caption_id")["text"]
    t2i = read_rankings(out, "t2i")
    assert t2i.groupby("query_id").size().eq(24).all()  # exhaustive: the whole pool is stored
    table = ds.load_images(t2i["item_id"].tolist())
    expected = model.score(texts.loc[t2i["query_id"]].tolist(), table, batch_size=32)
    np.testing.assert_allclose(t2i["ce_score"].to_numpy(), expected, atol=1e-4)
    for _, g in per_query(t2i).items():  # exhaustive CE: best CE first
        assert np.all(np.diff(g["ce_score"].to_numpy()) <= 0)


def test_co_add_rank_top_k_and_keep_be_tail(assets, tmp_path):
    root, staged, model_dir, emb_dir = assets
    k = 4
    co = run_rerank(staged, emb_dir, str(tmp_path / "co"), mode="co", k=k, ce_model=model_dir,
                           directions=("i2t",))
    emb_run = run_rerank(staged, emb_dir, str(tmp_path / "emb"), mode="emb", k=k, directions=("i2t",))
    add = run_rerank(staged, emb_dir, str(tmp_path / "add"), mode="add", lam=0.3, k=k,
                            be_model=model_dir, directions=("i2t",))
    assert co["queries"] == emb_run["queries"] == add["queries"] == {"i2t": 6}
    be = per_query(read_rankings(str(tmp_path / "emb"), "i2t"))
    for q, g in per_query(read_rankings(str(tmp_path / "co"), "i2t")).items():
        top, tail = g.iloc[:k], g.iloc[k:]
        assert set(top["item_id"]) == set(be[q]["item_id"].iloc[:k])  # same top-k, reordered by CE
        assert np.all(np.diff(top["ce_score"].to_numpy()) <= 0) and top["ce_score"].notna().all()
        assert tail["item_id"].tolist() == be[q]["item_id"].iloc[k:].tolist() and tail["ce_score"].isna().all()
    for q, g in per_query(read_rankings(str(tmp_path / "add"), "i2t")).items():
        top = g.iloc[:k]
        fused = 0.3 * top["be_score"].to_numpy(np.float64) + 0.7 * _sigmoid(top["ce_score"].to_numpy(np.float64))
        np.testing.assert_allclose(top["final_score"].to_numpy(), fused, atol=1e-5)


def test_rerun_is_idempotent(assets, tmp_path):
    root, staged, model_dir, emb_dir = assets
    out = str(tmp_path / "run")
    first = run_rerank(staged, emb_dir, out, mode="co", k=3, ce_model=model_dir, queries_per_shard=5)
    second = run_rerank(staged, emb_dir, out, mode="co", k=3, ce_model=model_dir, queries_per_shard=5)
    assert [s["name"] for s in first["shards"]] == ["i2t-00000-of-00002.parquet", "i2t-00001-of-00002.parquet",
                                                    "t2i-00000-of-00003.parquet", "t2i-00001-of-00003.parquet",
                                                    "t2i-00002-of-00003.parquet"]
    assert first["shards"] == second["shards"]  # same bytes (sha256) on the rerun
    assert second["shards_reused"] == 5 and second["ce_pairs_scored"] == 0  # nothing recomputed
    assert sorted(os.listdir(os.path.join(out, "rankings"))) == [s["name"] for s in first["shards"]]
    assert not os.path.exists(os.path.join(out, "_run"))


def test_direct_and_dask_runners_give_identical_rankings(assets, tmp_path):
    distributed = pytest.importorskip("distributed")
    root, staged, model_dir, emb_dir = assets
    direct = str(tmp_path / "direct")
    run_rerank(staged, emb_dir, direct, mode="co", k=5, ce_model=model_dir, batch_size=8,
                      search_batch_size=4)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) \
            as cluster:
        dask = str(tmp_path / "dask")
        manifest = run_rerank(
            staged, emb_dir, dask, mode="co", k=5, ce_model=model_dir, batch_size=8, search_batch_size=4,
            beam_args=("--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                       f"--dask_client_address={cluster.scheduler_address}"))
    assert manifest["runner"].endswith("DaskRunner") and manifest["queries"] == {"t2i": 12, "i2t": 6}
    for name in sorted(os.listdir(os.path.join(direct, "rankings"))):
        a = pq.read_table(os.path.join(direct, "rankings", name))
        b = pq.read_table(os.path.join(dask, "rankings", name))
        assert a.num_rows > 0 and a.equals(b), name


def test_l2_index_reranks_with_negated_distances_as_be_scores(assets, tmp_path):
    """An L2 index returns distances (smaller is better); rerank must turn them into higher-is-better BE
    scores (-distance) instead of failing rank_query's "BE order" check."""
    root, staged, model_dir, emb_dir = assets
    index_dir = str(tmp_path / "index_l2")
    build_index_run.run(build_index_plan.IndexPlan(embeddings=emb_dir, output=index_dir, metric="l2", threads=1))
    out = str(tmp_path / "run")
    k = 3
    manifest = run_rerank(staged, emb_dir, out, mode="co", k=k, index=index_dir, ce_model=model_dir,
                                 directions=("t2i",), split="test")
    assert manifest["queries"] == {"t2i": 12}

    img_ids, img_vecs = embeddings.read_embeddings(emb_dir, "image")
    txt_ids, txt_vecs = embeddings.read_embeddings(emb_dir, "text")
    pos = {int(i): n for n, i in enumerate(txt_ids)}
    got = per_query(read_rankings(out, "t2i"))
    for q, g in got.items():
        dist = ((img_vecs - txt_vecs[pos[q]]) ** 2).sum(axis=1)
        order = np.argsort(dist, kind="stable")[:10]  # keep = max(k, 10), nearest first
        assert set(g["item_id"].iloc[:k]) == set(img_ids[order[:k]].tolist())  # CE reorders the top k
        assert g["item_id"].iloc[k:].tolist() == img_ids[order[k:]].tolist()  # the tail keeps BE order
        expected = dict(zip(img_ids[order].tolist(), -dist[order]))
        np.testing.assert_allclose(g["be_score"].to_numpy(), [expected[i] for i in g["item_id"]], atol=1e-4)
        assert g["ce_score"].iloc[:k].notna().all()


def test_rerun_with_fewer_shards_drops_stale_shards_and_evaluate_reads_the_manifests(assets, tmp_path):
    """A rerun with another shard count must not leave the first run's shards where evaluate finds them:
    rerank deletes the shards its manifest does not list, and evaluate reads only the listed ones."""
    from click.testing import CliRunner

    from benchmarks.evaluate import main as evaluate_main

    root, staged, _, emb_dir = assets
    out = str(tmp_path / "run")
    first = run_rerank(staged, emb_dir, out, mode="emb", k=3, queries_per_shard=5)  # t2i 3, i2t 2 shards
    assert len(first["shards"]) == 5
    # a stale shard of an even older run that the new run does not overwrite (evaluate must ignore it even
    # before rerank deletes it)
    stale = os.path.join(out, "rankings", "t2i-00000-of-00004.parquet")
    with open(os.path.join(out, "rankings", "t2i-00000-of-00003.parquet"), "rb") as src, open(stale, "wb") as dst:
        dst.write(src.read())
    second = run_rerank(staged, emb_dir, out, mode="emb", k=3)  # one shard per direction
    names = [s["name"] for s in second["shards"]]
    assert names == ["i2t-00000-of-00001.parquet", "t2i-00000-of-00001.parquet"]
    assert sorted(os.listdir(os.path.join(out, "rankings"))) == names

    results = tmp_path / "results"
    for rankings in (os.path.join(out, "rankings"), out):  # the rankings dir or the run dir
        with open(stale, "wb") as f:  # a leftover the manifest does not list
            f.write(pq.read_table(os.path.join(out, "rankings", names[1])).to_pandas().to_parquet())
        res = CliRunner().invoke(evaluate_main, ["--rankings", rankings, "--staged", staged, "--output",
                                                 str(results), "--mode", "EMB", "--k", "3"])
        assert res.exit_code == 0, res.output
        assert "t2i 12 / i2t 6 queries" in res.output


def test_nprobe_sets_ivf_search_depth_and_is_recorded(assets, tmp_path):
    """--nprobe reaches every IVF shard: recall@10 against the exact top-10 grows with nprobe and is exact
    when every list is probed (faiss' default nprobe=1 searches one list of 4)."""
    from click.testing import CliRunner

    root, staged, _, emb_dir = assets
    nlist = 4
    index_dir = str(tmp_path / "ivf")
    with pytest.warns(RuntimeWarning, match="fewer than"):  # 24 images: few training points per list
        build_index_run.run(build_index_plan.IndexPlan(embeddings=emb_dir, output=index_dir, factory=f"IVF{nlist},Flat",
                                                   train_sample=1000, threads=1))
    exact = str(tmp_path / "exact")
    run_rerank(staged, emb_dir, exact, mode="emb", k=10, directions=("t2i",))
    truth = {q: set(g["item_id"]) for q, g in per_query(read_rankings(exact, "t2i")).items()}

    def recall(out):
        got = per_query(read_rankings(out, "t2i"))
        assert sorted(got) == sorted(truth)
        return np.mean([len(set(g["item_id"]) & truth[q]) / 10 for q, g in got.items()])

    recalls, manifests = {}, {}
    for nprobe in (1, 2):
        out = str(tmp_path / f"nprobe{nprobe}")
        manifests[nprobe] = run_rerank(staged, emb_dir, out, mode="emb", k=10, index=index_dir,
                                              directions=("t2i",), nprobe=nprobe)
        recalls[nprobe] = recall(out)
    out = str(tmp_path / f"nprobe{nlist}")  # the CLI option
    res = CliRunner().invoke(rerank_run.main, ["--staged", staged, "--embeddings", emb_dir, "--index", index_dir,
                                           "--mode", "emb", "--k", "10", "--directions", "t2i", "--output", out,
                                           "--nprobe", str(nlist)])
    assert res.exit_code == 0, res.output
    recalls[nlist] = recall(out)
    with open(os.path.join(out, RANKINGS_MANIFEST)) as f:
        manifests[nlist] = json.load(f)

    assert recalls[1] < 1.0  # the default depth really misses neighbours here
    assert recalls[1] <= recalls[2] <= recalls[nlist] == 1.0
    for nprobe, manifest in manifests.items():
        assert manifest["search_params"] == {"nprobe": nprobe, "efSearch": None}
    # a parameter the index does not have is refused before the job runs
    with pytest.raises(rerank_plan.RerankError, match="efSearch"):
        run_rerank(staged, emb_dir, str(tmp_path / "bad"), mode="emb", index=index_dir,
                          directions=("t2i",), ef_search=64)
    with pytest.raises(rerank_plan.RerankError, match="--index"):  # exact search has no parameters
        run_rerank(staged, emb_dir, str(tmp_path / "bad"), mode="emb", directions=("t2i",), nprobe=2)
    assert manifests[1]["search_params_used"] == {"t2i": {"params": {"nprobe": 1}, "source": "command line"}}

    # parameters recorded in the index manifest (as build_index --index-factory auto writes them) are used
    # when no --nprobe is given; the run says where its parameters came from
    path = os.path.join(index_dir, "index_manifest.json")
    with open(path) as f:
        im = json.load(f)
    with open(path, "w") as f:
        json.dump({**im, "search_params": {"nprobe": nlist}}, f)
    out = str(tmp_path / "recorded")
    m = run_rerank(staged, emb_dir, out, mode="emb", k=10, index=index_dir, directions=("t2i",))
    assert recall(out) == 1.0
    assert m["search_params_used"] == {"t2i": {"params": {"nprobe": nlist}, "source": "index manifest"}}
    out = str(tmp_path / "default")
    with open(path, "w") as f:
        json.dump(im, f)
    m = run_rerank(staged, emb_dir, out, mode="emb", k=10, index=index_dir, directions=("t2i",))
    assert recall(out) == recalls[1] and m["search_params_used"]["t2i"] == {"params": {}, "source": "faiss defaults"}


def read_run(out: str):
    """Every ranking row of a run, in (direction, query, rank) order."""
    import pyarrow as pa

    names = sorted(f for f in os.listdir(os.path.join(out, "rankings")) if f.endswith(".parquet"))
    return in_rank_order(pa.concat_tables([pq.read_table(os.path.join(out, "rankings", n)) for n in names]))


def in_rank_order(table):
    return table.sort_by([("direction", "ascending"), ("query_id", "ascending"), ("rank", "ascending")])


def test_score_once_evaluate_many_gives_exactly_the_fresh_runs(assets, tmp_path):
    """CO at k'=10 derived from a k=20 run's stored scores is exactly a k=10 run, and EMB derived from it is
    the EMB run. CE batches of one pair (--batch-size 1) make a pair's CE score independent of the other
    pairs a run scores, so the comparison can be exact (in batches of 16, 9 of these 180 pairs' scores move by
    up to 7e-9, and this tiny random CE's scores are that close)."""
    from retrieval_core.evaluation.runs import evaluate_run
    from retrieval_core.search.rerank import derive_rankings

    root, staged, model_dir, emb_dir = assets
    out = {name: str(tmp_path / name) for name in ("co20", "co10", "emb")}
    one = dict(directions=("i2t",), batch_size=1)  # i2t: 6 queries over a 48-caption pool
    run_rerank(staged, emb_dir, out["co20"], mode="co", k=20, ce_model=model_dir, **one)
    run_rerank(staged, emb_dir, out["co10"], mode="co", k=10, ce_model=model_dir, **one)
    run_rerank(staged, emb_dir, out["emb"], mode="emb", k=20, **one)
    stored = read_run(out["co20"])
    assert stored.num_rows == 6 * 20 and stored.column("ce_score").null_count == 0  # all CE-scored
    assert in_rank_order(derive_rankings(stored, 10, "ce")).equals(read_run(out["co10"]))
    assert in_rank_order(derive_rankings(stored, 20, "emb")).equals(read_run(out["emb"]))

    def metrics(run_dir, **derive):  # a direction the run lacks has NaN recalls
        return {key: None if v != v else v for key, v in evaluate_run(run_dir, staged, **derive).items()}

    derived = metrics(out["co20"], k=10)
    assert derived == metrics(out["co10"]) and (derived["mode"], derived["k"]) == ("co", 10)
    assert metrics(out["co20"], mode="emb") == metrics(out["emb"])
    with pytest.raises(ValueError, match="EMB run"):
        evaluate_run(out["emb"], staged, mode="add")


def write_queries(path, rows):
    import pyarrow as pa

    pq.write_table(pa.table({"direction": pa.array([d for d, _ in rows], pa.string()),
                             "query_id": pa.array([q for _, q in rows], pa.int64())}), path)
    return str(path)


def test_queries_file_restricts_the_run_and_evaluate_to_those_queries(assets, tmp_path):
    from retrieval_core.evaluation.runs import evaluate_run

    root, staged, _, emb_dir = assets
    ds = StagedDataset(staged)
    captions = ds.captions(split="test")["caption_id"].tolist()
    images = ds.images_meta(split="test")["item_id"].tolist()
    chosen = [("t2i", q) for q in captions[:5]] + [("i2t", q) for q in images[:2]]
    queries = write_queries(tmp_path / "sample.parquet", chosen)
    out = str(tmp_path / "run")
    manifest = run_rerank(staged, emb_dir, out, mode="emb", k=10, queries=queries)
    assert manifest["queries"] == {"t2i": 5, "i2t": 2}
    assert manifest["queries_file"]["counts"] == {"t2i": 5, "i2t": 2}
    assert manifest["queries_file"]["sha256"] == common_sha256(queries)
    ranked = read_run(out).to_pandas()
    assert set(ranked.loc[ranked["direction"] == "t2i", "query_id"]) == set(captions[:5])
    res = evaluate_run(out, staged)  # the gold of the ranked queries only
    assert res["t2i_queries"] == 5 and res["i2t_queries"] == 2

    train_caption = int(ds.captions(split="train")["caption_id"].iloc[0])
    for rows, message in (
            (chosen + [("t2i", train_caption)], "not captions of collection=None, split=test"),
            (chosen + [("x2y", 1)], "unknown direction"),
            (chosen + chosen[:1], "duplicate t2i"),
            (chosen[:5], "lists no i2t queries")):
        with pytest.raises(rerank_plan.RerankError, match=message):
            run_rerank(staged, emb_dir, str(tmp_path / "bad"), mode="emb",
                       queries=write_queries(tmp_path / "bad.parquet", rows))
    assert not os.path.exists(tmp_path / "bad")  # refused before anything was written


def common_sha256(path):
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_waves_hold_at_most_their_shards_and_pairs_but_never_split_a_shard():
    pairs = {"a": 30, "b": 30, "c": 90, "d": 10, "e": 10, "f": 10}
    waves = rerank_run.plan_waves(list(pairs), pairs.get, shards_per_wave=2, pairs_per_wave=60)
    assert waves == [["a", "b"], ["c"], ["d", "e"], ["f"]]  # c alone is over the cap: a wave of its own
    assert rerank_run.plan_waves(list(pairs), pairs.get, shards_per_wave=10, pairs_per_wave=1) == [[n] for n in pairs]
    assert rerank_run.plan_waves(list(pairs), lambda _: 0, shards_per_wave=4, pairs_per_wave=1) == \
        [["a", "b", "c", "d"], ["e", "f"]]  # EMB runs score no pairs: shards alone decide


def test_killed_run_resumes_its_unfinished_shards_only(assets, tmp_path):
    """A killed run (no manifest, the shards of its last wave missing) rerun with the same plan keeps its
    finished shards (checksum-verified) and computes only the missing ones, giving the uninterrupted run's
    bytes; a shard that no longer matches its record is recomputed; another plan reuses nothing."""
    root, staged, model_dir, emb_dir = assets
    plan = dict(mode="co", k=3, ce_model=model_dir, batch_size=8, queries_per_shard=3, shards_per_wave=2)
    whole = run_rerank(staged, emb_dir, str(tmp_path / "whole"), **plan)
    # 6 shards in 3 waves: (i2t 0, i2t 1), (t2i 0, t2i 1), (t2i 2, t2i 3)
    assert whole["waves_run"] == 3 and whole["shards_reused"] == 0 and len(whole["shards"]) == 6

    out = str(tmp_path / "killed")
    run_rerank(staged, emb_dir, out, **plan)
    os.remove(os.path.join(out, RANKINGS_MANIFEST))  # killed during its last wave
    lost = ["t2i-00002-of-00004.parquet", "t2i-00003-of-00004.parquet"]
    for name in lost:
        os.remove(os.path.join(out, "rankings", name))
    resumed = run_rerank(staged, emb_dir, out, **plan)
    assert resumed["shards_reused"] == 4 and resumed["waves_run"] == 1
    assert resumed["shards"] == whole["shards"]  # the uninterrupted run's bytes
    # one search pass per direction; the resumed run searches only the group of its t2i queries
    assert whole["search_passes"] == 2 and resumed["search_passes"] == 1
    assert not os.path.exists(os.path.join(out, rerank_plan.CANDIDATES_DIR))  # the rankings hold them now
    recomputed = sum(s["queries"] for s in whole["shards"] if s["name"] in lost)
    assert resumed["ce_pairs_requested"] == recomputed * 3 < whole["ce_pairs_requested"]
    if not torch.cuda.is_available():  # the default --device auto is --device cpu here: its runs are reused
        explicit = run_rerank(staged, emb_dir, out, **plan, device="cpu")
        assert explicit["shards_reused"] == 6 and explicit["waves_run"] == 0 and explicit["search_passes"] == 0
        assert explicit["plan_fingerprint"] == resumed["plan_fingerprint"] and explicit["device"] == "cpu"
    assert 0 < resumed["ce_pairs_scored"] < whole["ce_pairs_scored"]

    torn = "t2i-00001-of-00004.parquet"  # no longer matches its record: recomputed alone
    with open(os.path.join(out, "rankings", torn), "ab") as f:
        f.write(b"torn")
    again = run_rerank(staged, emb_dir, out, **plan)
    assert again["shards_reused"] == 5 and [s["name"] for s in again["shards"]] == [s["name"] for s in whole["shards"]]
    # computed without the other shard of its wave, its CE batches differ: scores may move in the last bits
    a = pq.read_table(os.path.join(out, "rankings", torn)).to_pandas().sort_values(["query_id", "item_id"])
    b = pq.read_table(os.path.join(str(tmp_path / "whole"), "rankings", torn)).to_pandas().sort_values(
        ["query_id", "item_id"])
    assert a["item_id"].tolist() == b["item_id"].tolist()
    np.testing.assert_allclose(a["ce_score"].to_numpy(float), b["ce_score"].to_numpy(float), atol=1e-6)

    capped = run_rerank(staged, emb_dir, str(tmp_path / "capped"), **{**plan, "pairs_per_wave": 1,
                                                                       "queries_per_pass": 2})
    assert capped["waves_run"] == 6  # one shard per wave; each ranks its queries like the 3-wave run
    groups = {d: -(-n // 2) for d, n in capped["queries"].items()}  # ids hash into them unevenly
    groups_searched = {(s["direction"], rerank_graph.group_of(q, 0, groups[s["direction"]]))
                for s in capped["shards"] for q in pq.read_table(
                    os.path.join(str(tmp_path / "capped"), "rankings", s["name"])).column("query_id").to_pylist()}
    assert capped["search_passes"] == len(groups_searched) > 2
    for s_capped, s_whole in zip(capped["shards"], whole["shards"]):
        a, b = (pq.read_table(os.path.join(d, "rankings", s_capped["name"])).to_pandas()
                for d in (str(tmp_path / "capped"), str(tmp_path / "whole")))
        assert a["item_id"].tolist() == b["item_id"].tolist()
        np.testing.assert_allclose(a["ce_score"].to_numpy(float), b["ce_score"].to_numpy(float), atol=1e-6)

    # a run killed after its search job left the candidates files: the rerun reads them and searches nothing
    searched = str(tmp_path / "searched")
    res = rerank_plan.resolve(rerank_plan.RerankPlan(staged, emb_dir, searched, **plan))
    os.makedirs(searched)
    have, passes, _ = rerank_run.search(PipelineOptions([]), res, rerank_run._expected_shards(res), {})
    assert passes == 2 and sorted(have) == ["i2t-00000-of-00001.parquet", "t2i-00000-of-00001.parquet"]
    after = run_rerank(staged, emb_dir, searched, **plan)
    assert after["search_passes"] == 0 and after["shards"] == whole["shards"]

    other = run_rerank(staged, emb_dir, out, **{**plan, "k": 4})  # another plan: nothing is reused
    assert other["shards_reused"] == 0 and other["plan_fingerprint"] != whole["plan_fingerprint"]
    assert sorted(os.listdir(os.path.join(out, rerank_plan.PROGRESS_DIR))) == sorted(
        s["name"] + ".json" for s in other["shards"])


def test_index_built_from_other_embeddings_is_refused_naming_both(assets, tmp_path):
    """An index of another model's embeddings used to run and score R@1 0.00; now it is refused, naming both."""
    from click.testing import CliRunner

    root, staged, _, emb_dir = assets
    index_dir = str(tmp_path / "index")
    build_index_run.run(build_index_plan.IndexPlan(embeddings=emb_dir, output=index_dir, threads=1))
    other_model = write_tiny_model(str(tmp_path / "model1"), str(tmp_path), seed=1)
    other_emb = str(tmp_path / "emb1")
    encode_run.run(encode_plan.EncodePlan(staged, other_model, other_emb, batch_size=8))
    with pytest.raises(rerank_plan.RerankError, match=f"--index {index_dir} was built from the image embeddings in "
                                                 f"{emb_dir} .* not from --embeddings {other_emb}"):
        run_rerank(staged, other_emb, str(tmp_path / "run"), mode="emb", index=index_dir)
    res = CliRunner().invoke(rerank_run.main, ["--staged", staged, "--embeddings", other_emb, "--index", index_dir,
                                           "--mode", "emb", "--output", str(tmp_path / "run")])
    assert res.exit_code == 1 and res.output.count("Error: --index") == 1, res.output
    assert not os.path.exists(tmp_path / "run")
    # the embeddings it was built from are accepted
    assert run_rerank(staged, emb_dir, str(tmp_path / "ok"), mode="emb", index=index_dir,
                      directions=("t2i",))["queries"] == {"t2i": 12}


def test_embeddings_or_gold_of_another_staging_are_refused(assets, tmp_path):
    """Artifacts carry the fingerprint of the staged shards they came from. Embeddings encoded from
    one staging and a --staged folder of another (same ids, other captions and regions) used to rerank
    silently; a run evaluated against another staging's gold likewise."""
    from retrieval_core.evaluation.runs import RunError as EvaluationError
    from retrieval_core.evaluation.runs import evaluate_run

    root, staged, _, emb_dir = assets
    other = write_tiny_staged(str(tmp_path / "other"), num_images=NUM_IMAGES, seed=1)
    item_ids = lambda d: sorted(StagedDataset(d).images_meta()["item_id"])  # noqa: E731
    assert item_ids(other) == item_ids(staged)
    with pytest.raises(rerank_plan.RerankError,
                       match=r"--embeddings .* were encoded from other (image|text)/tiny shards "
                                                 r".* than --staged .*other holds"):
        run_rerank(other, emb_dir, str(tmp_path / "run"), mode="emb")
    assert not os.path.exists(tmp_path / "run")
    out = str(tmp_path / "ok")
    manifest = run_rerank(staged, emb_dir, out, mode="emb", directions=("t2i",))
    assert set(manifest["staged_sha256"]) == {"images/tiny", "captions/tiny"}
    assert evaluate_run(out, staged)["t2i_queries"] == 12
    with pytest.raises(EvaluationError, match="ranked the captions/tiny shards of another staging"):
        evaluate_run(out, other)


def test_mode_auto_runs_the_ranking_whose_worse_direction_gains_most_on_dev_and_records_it(assets, tmp_path):
    """--mode auto --tune-on DEV: every candidate's dev R@1 and mR are what evaluate gives for that derivation
    of the dev run; the chosen one has the largest R@1 gain over EMB in its worse direction (EMB itself is a
    candidate: never below 0), ties by mR, pure CO only with its lead beyond noise (else the best of the others);
    the run is exactly a run of the chosen mode/lam."""
    from retrieval_core.evaluation.runs import AUTO_LAMS, evaluate_run, mode_label

    root, staged, model_dir, emb_dir = assets
    one = dict(k=5, ce_model=model_dir, batch_size=1)  # batch 1: CE scores independent of the batch
    dev, test_auto = str(tmp_path / "dev"), str(tmp_path / "auto")
    run_rerank(staged, emb_dir, dev, mode="co", split="train", **one)
    manifest = run_rerank(staged, emb_dir, test_auto, mode="auto", tune_on=dev, split="test", **one)
    choice = manifest["fusion_choice"]
    candidates = [("emb", None), ("co", None)] + [(m, lam) for m in ("add", "norm_add") for lam in AUTO_LAMS]
    got = {mode_label(m, lam): evaluate_run(dev, staged, k=5, mode=m, lam=lam) for m, lam in candidates}
    assert choice["dev_mR"] == {label: round(r["mR"], 4) for label, r in got.items()}
    assert choice["dev_split"] == "train" and choice["dev_pool_size"] == choice["pool_size"]
    worst = {label: min(r[f"{d}_R@1"] - got["emb"][f"{d}_R@1"] for d in ("t2i", "i2t")) for label, r in got.items()}
    co_first = choice["co_lead"] is not None
    assert co_first == (max(got, key=lambda label: (worst[label], got[label]["mR"])) == "co")
    pool = [label for label in got if label != "co" or not co_first or choice["label"] == "co"]
    best = max(worst[label] for label in pool)
    assert best >= 0 and worst[choice["label"]] == best
    assert got[choice["label"]]["mR"] == max(got[label]["mR"] for label in pool if worst[label] == best)
    assert (manifest["mode"], manifest["lam"]) == (choice["mode"], choice["lam"])
    fixed = run_rerank(staged, emb_dir, str(tmp_path / "fixed"), mode=choice["mode"],
                       lam=choice["lam"] if choice["lam"] is not None else 0.5, split="test",
                       score_ce=choice["mode"] == "emb", **one)  # an auto run always keeps the CE scores
    assert read_run(test_auto).equals(read_run(str(tmp_path / "fixed"))) and fixed["fusion_choice"] is None


def test_mode_auto_chooses_on_its_own_dev_run_from_the_dev_embeddings(assets, tmp_path):
    """The default mode: with --tune-embeddings the job first ranks a seeded sample of the dev split's queries with
    CO (<output>/_tune, a run of its own) and chooses on it exactly as --tune-on that run would."""
    from retrieval_core.evaluation.runs import choose_fusion

    root, staged, model_dir, emb_dir = assets
    out = str(tmp_path / "auto")
    plan = dict(k=4, ce_model=model_dir, batch_size=1, tune_embeddings=emb_dir, tune_split="train", tune_queries=6)
    assert rerank_plan.RerankPlan(staged, emb_dir, out, **plan).mode == "auto"  # the default
    manifest = run_rerank(staged, emb_dir, out, **plan)
    dev = json.load(open(os.path.join(out, "_tune", RANKINGS_MANIFEST)))
    assert dev["mode"] == "co" and dev["split"] == "train" and dev["queries"] == {"t2i": 6, "i2t": 6}
    choice = manifest["fusion_choice"]
    expected = choose_fusion(os.path.join(out, "_tune"), staged, 4)
    assert {key: choice[key] for key in expected} == {**expected, "dev_run": os.path.join(out, "_tune")}
    assert (manifest["mode"], manifest["lam"]) == (choice["mode"], choice["lam"])
    again = run_rerank(staged, emb_dir, out, **plan)  # a rerun keeps the dev run's and its own shards
    assert again["shards_reused"] == len(again["shards"]) and again["fusion_choice"]["label"] == choice["label"]


def test_mode_auto_refuses_a_dev_run_of_the_evaluated_split_or_other_models(assets, tmp_path):
    root, staged, model_dir, emb_dir = assets
    with pytest.raises(rerank_plan.RerankError, match=r"--mode auto \(the default\) chooses the ranking on a dev"):
        rerank_plan.RerankPlan(staged, emb_dir, str(tmp_path / "x"), ce_model=model_dir)
    same = str(tmp_path / "same")
    run_rerank(staged, emb_dir, same, mode="co", k=3, split="test", ce_model=model_dir, directions=("i2t",))
    with pytest.raises(rerank_plan.RerankError, match="held-out split"):
        run_rerank(staged, emb_dir, str(tmp_path / "a"), mode="auto", tune_on=same, k=3, split="test",
                   ce_model=model_dir)
    other = write_tiny_model(str(tmp_path / "other_model"), str(tmp_path), seed=1)
    dev = str(tmp_path / "dev")
    run_rerank(staged, emb_dir, dev, mode="co", k=3, split="train", ce_model=model_dir, directions=("i2t",))
    with pytest.raises(rerank_plan.RerankError, match="another cross-encoder"):
        run_rerank(staged, emb_dir, str(tmp_path / "b"), mode="auto", tune_on=dev, k=3, split="test",
                   ce_model=other)


@pytest.mark.parametrize("quantize, near_served, near_fp32", [("int8", 2e-3, 5e-3), ("bf16", 2e-2, 5e-2)])
def test_a_quantized_ce_scores_the_pairs_and_is_recorded(assets, tmp_path, monkeypatch, quantize, near_served,
                                                         near_fp32):
    """--quantize int8 / bf16: the CE scores are the served model's (close to fp32, not equal: the CE really
    ran quantised), the manifest says so, and it is refused where it has nothing to quantise (emb) or, for
    int8, cannot run (cuda). Native bf16 is taken as given here (the refusal on CPUs that emulate it: test_model)."""
    from retrieval_core.model import quantize as quantize_mod
    from retrieval_core.model.checkpoints import load_model_folder

    monkeypatch.setattr(quantize_mod, "cpu_has_native_bf16", lambda: True)
    root, staged, model_dir, emb_dir = assets
    out = str(tmp_path / quantize)
    manifest = run_rerank(staged, emb_dir, out, mode="co", k=4, ce_model=model_dir, directions=("t2i",),
                          quantize=quantize)
    assert manifest["quantize"] == quantize
    ds = StagedDataset(staged)
    texts = ds.captions().set_index("caption_id")["text"]
    t2i = read_rankings(out, "t2i").dropna(subset=["ce_score"])
    table = ds.load_images(t2i["item_id"].tolist())
    q_texts = texts.loc[t2i["query_id"]].tolist()
    served = load_model_folder(model_dir, need=("ce",), quantize=quantize).score(q_texts, table, batch_size=32)
    fp32 = VLRetrievalModel.load(model_dir).score(q_texts, table, batch_size=32)
    got = t2i["ce_score"].to_numpy()
    # int8 activations are quantised per batch (bf16 rounding depends on the batch's padding too), so scores
    # depend a little on the batch: close to the served model's and to fp32's, but not fp32's
    assert np.abs(got - served).max() < near_served and np.abs(got - fp32).max() < near_fp32
    assert np.abs(got - fp32).max() > 1e-5 and np.abs(served - fp32).max() > 1e-5
    refusals = [({"mode": "emb"}, "scores nothing")] + ([({"device": "cuda"},
                                                          "CPU only")] if quantize == "int8" else [])
    for bad, match in refusals:
        kw = {"mode": "co", "ce_model": model_dir, "quantize": quantize, **bad}
        with pytest.raises(rerank_plan.RerankError, match=match):
            run_rerank(staged, emb_dir, str(tmp_path / "bad"), **kw)


def test_pairs_are_routed_to_the_staged_shard_holding_them_and_strangers_are_refused(assets):
    """RouteToShard (what replaced the joins that shuffled every caption's text and every image id): each id
    goes to the one staged shard that holds it; an id no shard holds, or two shards hold, fails the job in
    one line."""
    _, staged, _, _ = assets
    ds = StagedDataset(staged)
    reader = rerank_graph.StagedReader(staged)
    for kind, column, what in (("images", "item_id", "image"), ("captions", "caption_id", "caption")):
        rels = tuple(ds.shard_names(kind))
        fn = rerank_graph.RouteToShard(reader, rels, column, what)
        fn.setup()
        pairs_of_shards = rerank_graph.RouteToShard(reader, rels, column, what, shards_per_group=2)
        pairs_of_shards.setup()
        for n, rel in enumerate(rels):
            for item_id in ds.read_shard_columns(rel, (column,)).column(column).to_pylist()[:3]:
                assert list(fn.process((item_id, "v"))) == [(n, (rel, item_id, "v"))]
                assert list(pairs_of_shards.process((item_id, "v"))) == [(n // 2, (rel, item_id, "v"))]
        with pytest.raises(rerank_plan.RerankError, match=f"{what} 12345 is not staged in --staged"):
            list(fn.process((12345, "v")))
        twice = rerank_graph.RouteToShard(reader, rels + rels[:1], column, what)
        twice.setup()
        first = ds.read_shard_columns(rels[0], (column,)).column(column).to_pylist()[0]
        with pytest.raises(rerank_plan.RerankError, match=f"{what} {first} is staged twice"):
            list(twice.process((first, "v")))


def test_image_shard_groups_hold_about_the_pairs_asked_for():
    """Groups of consecutive image shards sized to ~pairs_per_group of a wave's pairs: at least one shard, at
    most all of them."""
    assert rerank_graph.shards_per_group(200, 20_000, 1_024) == 10  # 100k images, a 20k-pair wave: ~1k pairs a group
    assert rerank_graph.shards_per_group(10, 20_000, 1_024) == 1  # 5k images: one shard already holds 2k pairs
    assert rerank_graph.shards_per_group(10, 100, 1_024) == 10  # a tiny wave: one group of every shard
    assert rerank_graph.shards_per_group(10, 0, 1_024) == 1

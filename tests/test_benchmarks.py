"""Miniatures of every benchmark suite on tiny models and tiny in-memory synthetic collections.

Each row's recalls are recomputed here from the rankings file the row names, with a few lines of recall code
of our own (not benchmarks.evaluate / retrieval_core.metrics), so a row cannot claim numbers its rankings do
not support.
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from benchmarks import engine, latency, report, suites
from retrieval_core.synthetic import SyntheticSpec
from tests.helpers_model import tiny_model

F = 16


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bench"))
    for name, seed in (("join", 0), ("be", 1), ("ce", 2)):
        tiny_model(os.path.join(tmp, "src_" + name), feature_dim=F, seed=seed).save(os.path.join(tmp, name))
    data = {}
    for name, n, domain in (("coco", 18, "coco"), ("f30k", 12, "f30k"), ("cc", 16, "cc")):
        spec = SyntheticSpec(name, n, seed=len(name), domain=domain, feature_dim=F, min_regions=3, max_regions=6)
        data[name] = suites.synthetic_collection(spec)
    src = suites.InMemorySource(data)
    models = suites.ModelSet(os.path.join(tmp, "join"), os.path.join(tmp, "be"), os.path.join(tmp, "ce"))
    return {"tmp": tmp, "src": src, "data": data, "models": models}


def _ctx(env, name, **kw):
    return suites.SuiteContext(output=os.path.join(env["tmp"], name), models=env["models"], progress=False,
                               batch_size=16, **kw)


# ------------------------------------------------------------------------------ independent checking
def _my_recall(rankings: pd.DataFrame, direction: str, captions: pd.DataFrame) -> tuple[dict, int]:
    """Percent of queries with a gold item within the first K ranks, K = 1, 5, 10."""
    cap_img = dict(zip(captions["caption_id"].tolist(), captions["image_item_id"].tolist()))
    sub = rankings[rankings["direction"] == direction].sort_values(["query_id", "rank"])
    hits = {1: 0, 5: 0, 10: 0}
    groups = sub.groupby("query_id")["item_id"].apply(list)
    queries = groups.index.tolist()
    for q, ranked in zip(queries, groups.tolist()):
        for k in hits:
            top = ranked[:k]
            if direction == "t2i":
                ok = cap_img[q] in top
            else:
                ok = any(cap_img.get(c) == q for c in top)
            hits[k] += ok
    return {k: 100.0 * v / len(queries) for k, v in hits.items()}, len(queries)


def _check_rows(rows, output, captions):
    """Every measured row's R@K / queries / mR equal what its rankings give (mean over fold files)."""
    path = report.write_csv(os.path.join(output, "check.csv"), rows)
    back = report.read_csv(path)
    with open(path) as f:
        assert f.readline().strip().split(",") == list(report.CSV_COLUMNS)
    checked = 0
    for r in back:
        if r["measured"] != "true":
            assert r["notes"].startswith("skipped"), r
            continue
        files = r["rankings"].split(";")
        per_file = [_my_recall(pq.read_table(os.path.join(output, f)).to_pandas(), r["direction"], captions)
                    for f in files]
        for k in (1, 5, 10):
            assert float(r[f"R@{k}"]) == pytest.approx(np.mean([p[0][k] for p in per_file]), abs=1e-4), (r, k)
        assert int(r["queries"]) == round(np.mean([p[1] for p in per_file]))
        assert r["threads"] and r["cpu_model"] and r["torch"] and r["faiss"] and r["device"]
        checked += 1
    # mR: the mean of the six recalls of the two direction rows of one setting
    groups: dict = {}
    for r in back:
        if r["measured"] == "true":
            groups.setdefault((r["collection"], r["model"], r["mode"], r["k"], r["lam"]), []).append(r)
    for g in groups.values():
        six = [float(r[f"R@{k}"]) for r in g for k in (1, 5, 10)]
        assert all(float(r["mR"]) == pytest.approx(np.mean(six), abs=1e-4) for r in g)
    assert checked > 0
    return back


def _all_captions(env):
    return pd.concat([c for _, c in env["data"].values()], ignore_index=True)


# -------------------------------------------------------------------------------------------- suites
def test_standard_rows_match_their_rankings(env):
    ctx = _ctx(env, "standard", ce_pair_budget=3000)
    task = suites.Task("coco", env["src"], "coco", split="test", folds=3, fold_size=6)
    rows = suites.standard(ctx, [task], k=5)
    back = _check_rows(rows, ctx.output, _all_captions(env))
    by = {(r["collection"], r["model"], r["mode"]) for r in back}
    for fam in ("SEP", "JOIN"):
        for mode in ("EMB", "CO", "CE"):
            assert ("coco/6", fam, mode) in by
    # 18 images x 90 captions x 2 directions is over the budget: skipped with the reason, not silently lost
    skipped = [r for r in back if r["collection"] == "coco" and r["mode"] == "CE"]
    assert skipped and all(r["measured"] == "false" and "pair budget" in r["notes"] for r in skipped)
    folds = [r for r in back if r["collection"] == "coco/6" and r["measured"] == "true"]
    assert all(len(r["rankings"].split(";")) == 3 and "mean over 3 folds" in r["notes"] for r in folds)
    # CO: the top k are ordered by CE score and carry one; exhaustive CE ranks by CE score throughout
    co = [r for r in back if r["collection"] == "coco" and r["mode"] == "CO"][0]
    rk = pq.read_table(os.path.join(ctx.output, co["rankings"])).to_pandas()
    for _, g in rk.groupby(["direction", "query_id"]):
        g = g.sort_values("rank")
        top = g[g["rank"] <= 5]
        assert top["ce_score"].notna().all() and g[g["rank"] > 5]["ce_score"].isna().all()
        assert np.all(np.diff(top["ce_score"].to_numpy()) <= 1e-6)
    assert float(co["ce_pairs"]) > 0 and float(co["rerank_s"]) > 0


def test_distractor_pool_keeps_queries_and_gold(env):
    ctx = _ctx(env, "distractor")
    task = suites.Task("f30k+", env["src"], "f30k", split="test", distractors=("coco", "cc"), distractor_split="test")
    rows = suites.distractor(ctx, [task], k=5)
    back = _check_rows(rows, ctx.output, _all_captions(env))
    f30k_caps = env["data"]["f30k"][1]
    assert all(r["collection_size"] == str(12 + 18 + 16) for r in back)
    t2i = [r for r in back if r["direction"] == "t2i"]
    assert all(int(r["queries"]) == len(f30k_caps) for r in t2i)
    rk = pd.concat([pq.read_table(os.path.join(ctx.output, r["rankings"])).to_pandas() for r in back])
    # queries only from the task; ranked items include distractors of the other collections
    assert set(rk[rk["direction"] == "t2i"]["query_id"]) <= set(f30k_caps["caption_id"])
    distractor_imgs = set(env["data"]["coco"][0].item_ids.tolist()) | set(env["data"]["cc"][0].item_ids.tolist())
    assert set(rk["item_id"]) & distractor_imgs


def test_scale_is_t2i_with_sampled_queries(env):
    ctx = _ctx(env, "scale")
    rows = suites.scale(ctx, suites.Task("coco", env["src"], "coco"), num_queries=10, k=5)
    back = _check_rows(rows, ctx.output, _all_captions(env))
    assert {r["direction"] for r in back} == {"t2i"}
    assert all(r["queries"] == "10" and r["collection_size"] == "18" for r in back)


def test_k_ablation_and_combination_reuse_ce_scores(env):
    ctx = _ctx(env, "kab")
    task = suites.Task("f30k", env["src"], "f30k")
    rows = suites.k_ablation(ctx, [task], ks=(3, 6))
    back = _check_rows(rows, ctx.output, _all_captions(env))
    assert {r["k"] for r in back} == {"3", "6"}
    k3 = [r for r in back if r["k"] == "3"]
    assert all("cached CE scores" in r["notes"] for r in k3)  # k=6 ran first; k=3 reused its scores
    assert report.plot_recall_vs_k(rows, os.path.join(ctx.output, "k.png"))
    rows = suites.combination(ctx, [task], lams=(0.1, 0.9), k=4)
    back = _check_rows(rows, ctx.output, _all_captions(env))
    modes = {(r["model"], r["mode"], r["lam"]) for r in back}
    assert ("JOIN", "CO", "") in modes and ("SEP", "CO-ADD", "0.9") in modes and ("JOIN", "CO-NORM_ADD", "0.1") in modes


def test_baseline_suite_rows(env):
    from retrieval_core.baseline import MappedBaseline
    from tests.helpers_model import write_tiny_bert

    imgs, caps = env["data"]["cc"]
    fitted = MappedBaseline.fit(caps, imgs, text_model=write_tiny_bert(os.path.join(env["tmp"], "bl_bert")))
    ref = engine.ModelRef(fitted, "baseline-tiny", "MappedBaseline")
    ctx = _ctx(env, "baseline")
    rows = suites.baseline(ctx, [suites.Task("f30k", env["src"], "f30k")], ref, "fit on cc")
    back = _check_rows(rows, ctx.output, _all_captions(env))
    assert {r["model"] for r in back} == {"MappedBaseline", "SEP", "JOIN"}
    assert all(r["mode"] == "EMB" for r in back)


def test_engine_cache_keeps_cost_and_budget_skip(env):
    pool_imgs, caps = env["data"]["f30k"]
    pool = engine.Pool(pool_imgs, caps)
    gold = suites.gold_of(caps)
    join = env["models"].ref("join")
    cache = engine.EvalCache()
    first = engine.evaluate_collection(join, None, pool, gold, mode="emb", cache=cache, progress=False)
    again = engine.evaluate_collection(join, None, pool, gold, mode="emb", cache=cache, progress=False)
    assert first.timings["encode_fresh_s"] > 0 and again.timings["encode_fresh_s"] == 0
    assert again.timings["encode_s"] == pytest.approx(first.timings["encode_s"])
    assert first.metrics == again.metrics
    with pytest.raises(engine.SkipRow, match="pair budget"):
        engine.evaluate_collection(join, join, pool, gold, mode="ce", exhaustive=True, ce_pair_budget=10,
                                   progress=False)


def test_latency_rows(env, tmp_path):
    cfg = latency.LatencyConfig(sizes=(100, 400), eval_sizes=(6,), ks=(4,), reps=3, warmup=1, paper_reps=1,
                                base_images=12, recall_queries=8, ce_measure_budget_s=0.0, eval_budget_s=30.0,
                                batch_size=16, threads=1)
    model = env["models"].ref("join").model
    rows = latency.run_latency(model, cfg, report.environment(), log=lambda m: None)
    back = report.read_csv(report.write_csv(str(tmp_path / "latency.csv"), rows))
    per_q = [r for r in back if r["collection"].startswith("per_query")]
    assert {(r["model"], r["mode"]) for r in per_q} >= {("JOIN", "EMB-Flat"), ("JOIN", "CO"), ("JOIN", "CE"),
                                                        ("paper-code", "EMB"), ("paper-code", "CO")}
    for r in per_q:
        p = [float(r[c]) for c in ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")]
        assert 0 < p[0] <= p[1] <= p[2]
        assert r["threads"] == "1"
        if r["mode"] == "CE":  # the budget is 0: whole-collection CE is extrapolated and says so
            assert r["measured"] == "false" and r["notes"].startswith("extrapolated")
        if r["model"] == "JOIN":
            assert float(r["speedup_vs_paper_code"]) > 0
    ann = [r for r in per_q if r["mode"].startswith("EMB-IVF")]
    assert len(ann) == 2 and all(0 <= float(r["ann_recall@10"]) <= 1 for r in ann)
    totals = [r for r in back if r["collection"].startswith("eval_total")]
    assert {(r["mode"], r["measured"]) for r in totals if r["model"] == "JOIN"} == \
        {("EMB", "true"), ("CO", "true"), ("CE", "false")}
    png = report.plot_latency(per_q, str(tmp_path / "latency.png"))
    assert png and os.path.getsize(png) > 1000


def test_cli_help_lists_suites():
    from benchmarks.run import main

    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for s in ("standard", "distractor_20k", "scale_100k", "k_ablation", "combination", "baseline", "latency",
              "--quick"):
        assert s in res.output


def test_staged_source_keeps_float16_collections_in_float16(tmp_path):
    """A 100k collection staged as float16 is ~6 GB; loading it as float32 doubled that and the scale suite
    was OOM-killed on a 24 GB machine. The suites keep the stored precision (collate casts per batch)."""
    from benchmarks.run import stage

    staged = stage("synthetic_100k", str(tmp_path), F, quick=True)  # 300 images, float16 per the manifest
    src = suites.StagedSource(staged)
    images, caps = src.load("synthetic_100k", "test")
    assert images.features.dtype == np.float16 and len(images) == 300 and len(caps) == 1500
    full = src.ds.load_images(collection="synthetic_100k", split="test", dtype=np.float32)
    np.testing.assert_array_equal(images.features.astype(np.float32), full.features)

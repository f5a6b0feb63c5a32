"""The benchmark suites run through the pipeline jobs: a --quick suite end to end on a tiny model and a tiny
staged collection, the --plan of scale_1m, Beam-flag pass-through, the fold/--ids wiring, job reuse.

Each row's recalls are recomputed here from the run's rankings with a few lines of recall code of our own
(not benchmarks.evaluate / retrieval_core.evaluation.metrics), and the pipeline's rankings are compared with a
reference computed in the test from retrieval_core calls (exact search, the model's CE scores,
retrieval_core.search.rerank.rank_query), so neither a row nor the pipeline can claim what the other does not.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from benchmarks import queries, report
from benchmarks.suites import jobs, latency, launch, planner, suites
from retrieval_core.data.manifest import load_manifest
from tests.helpers_model import tiny_model

F = 16
K = 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_model")
    path = str(tmp / "join")
    tiny_model(str(tmp / "src"), feature_dim=F, seed=0).save(path)
    return path


@pytest.fixture(scope="module")
def quick(model, tmp_path_factory):
    """One quick suite through the pipelines: synthetic_f30k1k cut to 40 images, 30 queries per direction."""
    tmp = tmp_path_factory.mktemp("bench_quick")
    args = ["--suite", "standard", "--manifest", "synthetic_f30k1k", "--quick", "--no-sep", "--model", model,
            "--workdir", str(tmp / "work"), "--output", str(tmp / "out"), "--max-queries", "30",
            "--ce-pair-budget", "0"]
    res = _bench(*args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {"args": args, "tmp": tmp, "out": str(tmp / "out"), "work": str(tmp / "work"), "stdout": res.stdout,
            "rows": report.read_csv(str(tmp / "out" / "standard.csv")),
            "jobs": report.read_csv(str(tmp / "out" / "standard_jobs.csv"))}


# ------------------------------------------------------------------------------ independent checking
def _rankings(run_dir: str) -> pd.DataFrame:
    with open(os.path.join(run_dir, "rankings_manifest.json")) as f:
        shards = json.load(f)["shards"]
    return pd.concat([pq.read_table(os.path.join(run_dir, "rankings", s["name"])).to_pandas() for s in shards])


def _my_recall(rankings: pd.DataFrame, direction: str, order: str, cap_img: dict) -> dict:
    """Percent of queries with a gold item within the first K by ``order`` (rank or be_rank), K = 1, 5, 10."""
    sub = rankings[rankings["direction"] == direction].sort_values(["query_id", order])
    hits = {1: 0, 5: 0, 10: 0}
    groups = sub.groupby("query_id")["item_id"].apply(list)
    for q, ranked in zip(groups.index.tolist(), groups.tolist()):
        for k in hits:
            top = ranked[:k]
            hits[k] += (cap_img[q] in top) if direction == "t2i" else any(cap_img.get(c) == q for c in top)
    return {k: 100.0 * v / len(groups) for k, v in hits.items()}


def _staged_gold(staged: str) -> dict:
    from retrieval_core.data.store import StagedDataset

    caps = StagedDataset(staged).captions()
    return dict(zip(caps["caption_id"].tolist(), caps["image_item_id"].tolist()))


# -------------------------------------------------------------------------------------------- suites
def test_quick_suite_runs_the_pipeline_jobs_and_rows_match_their_rankings(quick):
    steps = [j["step"] for j in quick["jobs"]]
    one_pool = ["pipelines.stage", "benchmarks.queries", "pipelines.encode", "pipelines.build_index",
                "pipelines.rerank"]
    assert steps == one_pool * 2  # ONE rerank job for EMB and CO; then the dev run AUTO chooses on
    assert [j["job"] for j in quick["jobs"]][5].startswith("stage synthetic_dev_pool") and \
        "/dev" in quick["jobs"][7]["job"]
    assert all(float(j["peak_rss_mb"]) > 0 and float(j["wall_s"]) > 0 and j["reused"] == "false"
               for j in quick["jobs"])
    rows = {(r["mode"], r["direction"]): r for r in quick["rows"]}
    assert set(rows) == {("EMB", "t2i"), ("EMB", "i2t"), ("CO", "t2i"), ("CO", "i2t"), ("AUTO", "t2i"),
                         ("AUTO", "i2t"), ("CE", "both")}
    ce = rows[("CE", "both")]
    assert ce["measured"] == "false" and "over the pair budget 0" in ce["notes"]

    run_dir = rows[("CO", "t2i")]["rankings"].split(" (")[0]
    rk = _rankings(run_dir)
    cap_img = _staged_gold(os.path.join(quick["work"], "bench", "staged", "synthetic_f30k1k-f16-quick"))
    for mode, order in (("EMB", "be_rank"), ("CO", "rank")):
        six = []
        for d in ("t2i", "i2t"):
            r = rows[(mode, d)]
            mine = _my_recall(rk, d, order, cap_img)
            for k in (1, 5, 10):
                assert float(r[f"R@{k}"]) == pytest.approx(mine[k], abs=1e-4), (mode, d, k)
                six.append(mine[k])
            assert r["queries"] == "30" and r["collection_size"] == "40" and r["measured"] == "true"
            assert f"{d} queries: seeded sample of 30" in r["notes"]
            assert float(r["encode_s"]) > 0 and float(r["index_s"]) > 0 and float(r["peak_rss_mb"]) > 0
            assert r["threads"] and r["cpu_model"] and r["torch"] and r["faiss"] and r["device"] == "cpu"
        assert float(rows[(mode, "t2i")]["mR"]) == pytest.approx(np.mean(six), abs=1e-4)
    co = rows[("CO", "t2i")]
    assert float(co["rerank_s"]) > 0 and int(co["ce_pairs"]) > 0
    assert float(co["wall_s"]) >= float(co["encode_s"]) + float(co["index_s"]) + float(co["rerank_s"])
    emb_t2i = rows[("EMB", "t2i")]
    assert emb_t2i["ce_pairs"] == "" and "derived from the stored BE scores" in emb_t2i["notes"]

    # AUTO: the fusion chosen on the demo dev run, applied to the same CO run's stored scores
    from retrieval_core.evaluation.runs import choose_fusion, evaluate_run
    dev_run = [j["output"] for j in quick["jobs"] if j["step"] == "pipelines.rerank"][1]
    dev_staged = [j["output"] for j in quick["jobs"] if j["step"] == "pipelines.stage"][1]
    choice = choose_fusion(dev_run, dev_staged, K)
    auto = rows[("AUTO", "t2i")]
    assert f"chosen on dev: {choice['label']}" in auto["notes"]
    want = evaluate_run(run_dir, os.path.join(quick["work"], "bench", "staged", "synthetic_f30k1k-f16-quick"),
                        k=K, mode=choice["mode"], lam=choice["lam"])
    for d in ("t2i", "i2t"):
        assert float(rows[("AUTO", d)]["R@1"]) == pytest.approx(want[f"{d}_R@1"], abs=1e-4)

    # intervals: every recall row has them; reranked rows carry their paired difference to EMB of the same run,
    # the same numbers benchmarks.evaluate --mode co --against-mode emb writes for that run
    from benchmarks.evaluate import evaluate_ranking
    staged = os.path.join(quick["work"], "bench", "staged", "synthetic_f30k1k-f16-quick")
    co = evaluate_ranking(run_dir, staged, k=K, mode="co", against_mode="emb", files=None)
    for (mode, d), r in rows.items():
        if mode == "CE":
            continue
        for m in ("R@1", "R@5", "R@10", "mR"):
            assert float(r[f"{m}_lo"]) <= float(r[m]) <= float(r[f"{m}_hi"]), (mode, d, m)
        assert "1000 bootstrap resamples" in r["bootstrap"] and "intervals: queries resampled" in r["notes"]
        if mode == "EMB":
            assert r["against"] == "" and r["delta_R@1"] == ""
        else:
            assert r["against"] == "EMB"
            assert float(r["delta_R@1"]) == pytest.approx(float(r["R@1"]) - float(rows[("EMB", d)]["R@1"]), abs=1e-3)
    for d in ("t2i", "i2t"):
        r = rows[("CO", d)]
        assert (float(r["R@1_lo"]), float(r["R@1_hi"])) == pytest.approx(
            (co["intervals"][f"{d}_R@1"].lo, co["intervals"][f"{d}_R@1"].hi), abs=1e-4)
        assert (float(r["delta_R@1_lo"]), float(r["delta_R@1_hi"])) == pytest.approx(
            (co["delta"][f"{d}_R@1"].lo, co["delta"][f"{d}_R@1"].hi), abs=1e-4)
    assert "R@1 minus EMB [95% CI]" in quick["stdout"]


def test_pipeline_rankings_equal_a_reference_from_retrieval_core(quick):
    """What benchmarks/engine.py used to compute in-process (exact BE top-k, CE scores of the top k,
    rank_query), recomputed from retrieval_core calls: the pipeline's top-10 lists must be the same."""
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.model.network import VLRetrievalModel
    from retrieval_core.search import embeddings
    from retrieval_core.search.rerank import rank_query

    co = next(r for r in quick["rows"] if r["mode"] == "CO")
    run_dir = co["rankings"].split(" (")[0]
    with open(os.path.join(run_dir, "rankings_manifest.json")) as f:
        manifest = json.load(f)
    rk = _rankings(run_dir)
    staged = StagedDataset(os.path.join(quick["work"], "bench", "staged", "synthetic_f30k1k-f16-quick"))
    model = VLRetrievalModel.load(manifest["ce_model"])
    img_ids, img_vecs = embeddings.read_embeddings(manifest["embeddings"], "image")
    txt_ids, txt_vecs = embeddings.read_embeddings(manifest["embeddings"], "text")
    text_of = dict(zip(staged.captions()["caption_id"].tolist(), staged.captions()["text"].tolist()))
    images = staged.load_images()
    pos = images.position_of()
    same = {}
    for d, (q_ids, q_vecs, t_ids, t_vecs) in {"t2i": (txt_ids, txt_vecs, img_ids, img_vecs),
                                              "i2t": (img_ids, img_vecs, txt_ids, txt_vecs)}.items():
        want = set(rk[rk["direction"] == d]["query_id"].tolist())
        same[d] = [0, len(want)]
        for qi, q in enumerate(q_ids.tolist()):
            if q not in want:
                continue
            scores = t_vecs @ q_vecs[qi]
            top = np.lexsort((t_ids, -scores))[:K]  # best first; ties: smaller id
            pairs = [(q, int(t)) if d == "t2i" else (int(t), q) for t in t_ids[top]]
            ce = model.score([text_of[c] for c, _ in pairs], [images.regions(pos[i]) for _, i in pairs])
            ref = {m: rank_query(t_ids[top], scores[top], ce, k=K, mode=m)["item_id"][:10].tolist()
                   for m in ("emb", "ce")}
            got = rk[(rk["direction"] == d) & (rk["query_id"] == q)]
            same[d][0] += (got.sort_values("rank")["item_id"].tolist()[:10] == ref["ce"]
                           and got.sort_values("be_rank")["item_id"].tolist()[:10] == ref["emb"])
    print(f"identical top-10 lists (EMB and CO) pipeline vs retrieval_core reference: {same}")
    assert all(n == total and total == 30 for n, total in same.values()), same


def test_a_rerun_reuses_every_finished_job(quick):
    res = _bench(*quick["args"])
    assert res.returncode == 0, res.stderr[-2000:]
    jobs = report.read_csv(os.path.join(quick["out"], "standard_jobs.csv"))
    assert [j["reused"] for j in jobs] == ["true"] * 10
    rows = report.read_csv(os.path.join(quick["out"], "standard.csv"))
    # the same numbers, and the job costs as measured by the first run (only evaluate's time is new)
    def key(r):
        return r["mode"], r["direction"], r["R@1"], r["R@5"], r["R@10"], r["encode_s"], r["rerank_s"]
    assert sorted(map(key, rows)) == sorted(map(key, quick["rows"]))


def test_fold_queries_and_ids_files(quick):
    staged = os.path.join(quick["work"], "bench", "staged", "synthetic_f30k1k-f16-quick")
    img, cap, cap_img = queries.staged_ids(staged, "synthetic_f30k1k", "test")
    sel = queries.select(staged, "synthetic_f30k1k", "test", max_queries=7, fold=1, folds=2, fold_size=20)
    np.testing.assert_array_equal(sel["image_ids"], np.sort(img)[20:40])
    np.testing.assert_array_equal(np.sort(sel["caption_ids"]), np.sort(cap[np.isin(cap_img, np.sort(img)[20:40])]))
    assert len(sel["t2i"]) == 7 and set(sel["t2i"]) <= set(sel["caption_ids"].tolist())
    assert len(sel["i2t"]) == 7 and set(sel["i2t"]) <= set(sel["image_ids"].tolist())


def test_scale_queries_are_seeded_images_and_the_smallest_caption_of_each(quick):
    staged = os.path.join(quick["work"], "bench", "staged", "synthetic_f30k1k-f16-quick")
    img, cap, cap_img = queries.staged_ids(staged, "synthetic_f30k1k", "test")
    sel = queries.select(staged, "synthetic_f30k1k", "test", scale=9, seed=3)
    chosen = np.random.default_rng(3).choice(np.unique(cap_img), 9, replace=False)
    np.testing.assert_array_equal(sel["i2t"], np.sort(chosen))
    smallest = sorted(min(c for c, i in zip(cap.tolist(), cap_img.tolist()) if i == int(g)) for g in chosen)
    np.testing.assert_array_equal(sel["t2i"], smallest)


def test_standard_plan_wires_each_fold_through_ids_and_its_own_queries(model, tmp_path):
    cfg = planner.SuiteConfig(suite="standard", workdir=str(tmp_path), models=planner.Models(join=model),
                             feature_dim=F, quick=True, max_queries=500)
    plan = suites.plan_suite(cfg)
    by_name = {j.name: j for j in plan.jobs}
    fold_rows = [r for r in plan.rows if r.collection.startswith("synthetic_coco5k/") and r.mode == "CO"]
    assert len(fold_rows) == 1 and len(fold_rows[0].runs) == suites.COCO_1K_FOLDS
    for f, run_dir in enumerate(fold_rows[0].runs):
        rerank = next(j for j in plan.jobs if j.module == "pipelines.rerank" and j.output == run_dir).plan
        qdir = os.path.dirname(rerank.queries)
        qjob = next(j for j in plan.jobs if j.output == qdir).plan
        assert (qjob.fold, qjob.fold_size, qjob.max_queries) == (f, 20, 100)
        img_idx = next(j for j in by_name.values() if j.output == rerank.index).plan
        txt_idx = next(j for j in by_name.values() if j.output == rerank.text_index).plan
        assert img_idx.ids == os.path.join(qdir, queries.IMAGE_IDS_FILE) and img_idx.modality == "image"
        assert txt_idx.ids == os.path.join(qdir, queries.CAPTION_IDS_FILE) and txt_idx.modality == "text"
    # one encode per (model, staged collection), shared by the 5k pool and every fold
    # (+ one dev pool per evaluated pool size, the AUTO rows choose their fusion on: 100, 20 and 40 images)
    assert sum(j.module == "pipelines.encode" for j in plan.jobs) == 2 + 3


@pytest.mark.parametrize("suite", ["standard", "distractor_20k", "scale_100k"])
def test_auto_rows_choose_on_a_dev_pool_the_size_of_the_evaluated_pool(model, tmp_path, suite):
    """The dev run of every AUTO row ranks the demo's dev queries (held out from the demo models' training)
    against as many images as the evaluated pool has (unseen distractors added), and about as many captions;
    planned only, at full size."""
    cfg = planner.SuiteConfig(suite=suite, workdir=str(tmp_path), models=planner.Models(join=model), feature_dim=F)
    plan = suites.plan_suite(cfg)
    by_out = {j.output: j for j in plan.jobs}
    autos = [r for r in plan.rows if r.mode == "AUTO"]
    assert autos
    for r in autos:
        dev = by_out[r.tune_on].plan
        assert dev.split == planner.TUNE_SPLIT and dev.mode == "co"
        stage = by_out[r.tune_staged]
        m = load_manifest(stage.plan.manifest, overrides=stage.plan.overrides)
        images = {n: c.images.options["num_images"] for n, c in m.collections.items()}
        dev_images = round(images["demo"] * 0.1) + images.get(planner.DEV_DISTRACTORS, 0)
        assert dev_images == r.pool_images, (r.collection, stage.name)
        evaluated = by_out[r.staged].plan
        pool = load_manifest(evaluated.manifest, overrides=evaluated.overrides).collections.values()
        captions = r.pool_images * sum(c.images.options["num_images"] * c.captions.options["captions_per_image"]
                                       for c in pool) / sum(c.images.options["num_images"] for c in pool)
        dev_caps = round(images["demo"] * 0.1) * 5 + images.get(planner.DEV_DISTRACTORS, 0) * \
            m.collections.get(planner.DEV_DISTRACTORS, m.collections["demo"]).captions.options["captions_per_image"]
        assert abs(dev_caps - captions) <= 0.1 * captions, (r.collection, dev_caps, captions)


def test_quantize_goes_to_the_model_jobs_and_their_outputs_are_kept_apart(model, tmp_path):
    """--quantize bf16: every encode and every CE-scoring rerank carries it, EMB-only reranks and model-free jobs
    do not; embeddings, indexes and runs go to folders of their own (float32 results are never overwritten),
    staged data and query selections are shared."""
    plans = {q: suites.plan_suite(planner.SuiteConfig(suite="standard", workdir=str(tmp_path), quantize=q, quick=True,
                                                     models=planner.Models(join=model), feature_dim=F))
             for q in ("none", "bf16")}
    for job in plans["bf16"].jobs:
        runs_model = job.module == "pipelines.encode" or (job.module == "pipelines.rerank" and job.plan.mode != "emb")
        assert ("--quantize" in job.args) == runs_model, job.name
        if runs_model:
            assert job.plan.quantize == "bf16"
    assert not any("--quantize" in j.args for j in plans["none"].jobs)
    outputs = {q: {j.module: set() for j in p.jobs} for q, p in plans.items()}
    for q, p in plans.items():
        for j in p.jobs:
            outputs[q][j.module].add(j.output)
    for module in ("pipelines.encode", "pipelines.build_index", "pipelines.rerank"):
        assert not outputs["none"][module] & outputs["bf16"][module], module
    for module in ("pipelines.stage", "benchmarks.queries"):
        assert outputs["none"][module] == outputs["bf16"][module], module
    with pytest.raises(ValueError, match="CPU only"):
        planner.SuiteConfig(suite="standard", workdir=str(tmp_path), quantize="int8", device="cuda",
                           models=planner.Models(join=model), feature_dim=F)


def test_k_ablation_and_combination_plan_one_rerank_per_family(model, tmp_path):
    for suite, rows in (("k_ablation", {("CO", 10, None), ("CO", 20, None), ("CO", 50, None), ("CO", 100, None)}),
                        ("combination", {("CO", 20, None)} | {(m, 20, lam) for m in ("CO-ADD", "CO-NORM_ADD")
                                                             for lam in suites.COMBINATION_LAMS})):
        cfg = planner.SuiteConfig(suite=suite, workdir=str(tmp_path), models=planner.Models(join=model), feature_dim=F)
        plan = suites.plan_suite(cfg)
        reranks = [j for j in plan.jobs if j.module == "pipelines.rerank"]
        assert len(reranks) == 1 and reranks[0].plan.k == (100 if suite == "k_ablation" else 20)
        assert {(r.mode, r.k, r.lam) for r in plan.rows} == rows
        assert all(r.runs == (reranks[0].output,) for r in plan.rows)


# ------------------------------------------------------------------------------- plan and Beam flags
def test_scale_suites_plan_sep_only_when_its_models_are_named(model):
    from benchmarks.run import resolve_models

    for suite in ("scale_100k", "scale_1m", "latency"):
        assert resolve_models(model, None, None, False, suite, True, ()).families()[0][0] == "JOIN"
        assert len(resolve_models(model, None, None, False, suite, True, ()).families()) == 1
        named = resolve_models(model, model, model, False, suite, True, ())
        assert [f for f, _, _ in named.families()] == ["SEP", "JOIN"]
    assert [f for f, _, _ in resolve_models(model, None, None, False, "standard", True, ()).families()] == \
        ["SEP", "JOIN"]


def test_scale_100k_reports_the_dev_chosen_fusion_beside_co(model, tmp_path):
    """scale_100k's AUTO row: the fusion chosen on the dev run, applied to the stored scores of its one CO run
    (no second CE pass over the 100k pool)."""
    cfg = planner.SuiteConfig(suite="scale_100k", workdir=str(tmp_path), models=planner.Models(join=model),
                              feature_dim=F)
    plan = suites.plan_suite(cfg)
    rows = {r.mode: r for r in plan.rows}
    assert set(rows) == {"EMB", "CO", "AUTO", "CE"}
    assert rows["AUTO"].runs == rows["CO"].runs and rows["AUTO"].tune_on
    pool_reranks = {j.plan.mode: j for j in plan.jobs if j.module == "pipelines.rerank" and "synthetic_100k" in j.name}
    assert set(pool_reranks) == {"co", "emb"}  # one CE pass; the search alone timed for the per-query table
    co, search = pool_reranks["co"], pool_reranks["emb"]
    assert (co.plan.queries, co.plan.index, co.plan.k) == (search.plan.queries, search.plan.index, search.plan.k)
    assert rows["EMB"].runs == (search.output,) and ("rerank_s", search.name) in rows["EMB"].timing
    assert rows["CO"].runs == (co.output,) and rows["CO"].emb_runs == (co.output,)
    assert rows["CE"].extrapolated == (co.name, search.name) and not rows["CE"].skip
    assert (rows["CE"].pool_images, rows["CE"].pool_captions) == (100_000, 500_000)


def test_a_scale_suites_exhaustive_ce_row_is_extrapolated_from_its_co_and_search_jobs(tmp_path):
    """Per query (the paper's Table 3 from a measured run): the CE share of the CO job (its wall minus the
    search-only job's) over the CE pairs it scored gives the pair rate; exhaustive CE costs each direction's pool at
    that rate, measured=false. A CO job resumed from finished shards scored nothing: no rate, said so."""
    from benchmarks.suites.rows import evaluate_row
    from retrieval_core.data.schema import RANKINGS_SCHEMA_VERSION

    run = tmp_path / "co"
    run.mkdir()
    manifest = {"schema_version": RANKINGS_SCHEMA_VERSION, "ce_pairs_scored": 200_000}
    (run / "rankings_manifest.json").write_text(json.dumps(manifest))
    co = jobs.Job("rerank co", "pipelines.rerank", (), str(run), "rankings_manifest.json")
    search = jobs.Job("rerank emb", "pipelines.rerank", (), str(tmp_path / "emb"), "rankings_manifest.json")
    results = {co.name: jobs.JobResult(co, 430.0, 1), search.name: jobs.JobResult(search, 30.0, 1)}
    row = planner.Row(suite="scale_1m", collection="c", model="JOIN", mode="CE", k="all", runs=(str(run),),
                      pool_images=1_000_000, pool_captions=5_000_000, extrapolated=(co.name, search.name))
    out, hits = evaluate_row(row, results, {"threads": 2})
    assert hits is None and [r["direction"] for r in out] == ["t2i", "i2t"]
    assert [(r["rate_per_s"], r["per_query_ms"], r["ce_pairs"], r["measured"]) for r in out] == \
        [(500.0, 2_000_000.0, 1_000_000, False), (500.0, 10_000_000.0, 5_000_000, False)]
    (run / "rankings_manifest.json").write_text(json.dumps({**manifest, "ce_pairs_scored": 0}))
    out, _ = evaluate_row(row, results, {})
    assert len(out) == 1 and "not extrapolated: the CO job scored 0 CE pairs" in out[0]["notes"]
    (run / "rankings_manifest.json").write_text(json.dumps({**manifest, "shards_reused": 3}))
    out, _ = evaluate_row(row, results, {})
    assert len(out) == 1 and "3 of its ranking shards reused" in out[0]["notes"]


def test_a_rerank_job_resumed_from_finished_shards_reports_no_per_query_time(quick, tmp_path):
    """Its wall timed only the shards it computed: that over every query of the row would flatter it."""
    import shutil

    from benchmarks.suites.rows import evaluate_row

    rows = {(r["mode"], r["direction"]): r for r in quick["rows"]}
    run = tmp_path / "co"
    shutil.copytree(rows[("CO", "t2i")]["rankings"].split(" (")[0], run)
    staged = os.path.join(quick["work"], "bench", "staged", "synthetic_f30k1k-f16-quick")
    job = jobs.Job("rerank co", "pipelines.rerank", (), str(run), "rankings_manifest.json")
    results = {job.name: jobs.JobResult(job, 12.0, 1)}
    row = planner.Row(suite="standard", collection="c", model="JOIN", mode="CO", k=K, runs=(str(run),),
                      staged=staged, eval_collection="synthetic_f30k1k", eval_k=K, eval_mode="co",
                      timing=(("rerank_s", job.name),), emb_runs=(str(run),))
    out, _ = evaluate_row(row, results, {})
    assert [r["per_query_ms"] for r in out] == [pytest.approx(12_000.0 / 60)] * 2
    manifest = json.loads((run / "rankings_manifest.json").read_text())
    (run / "rankings_manifest.json").write_text(json.dumps({**manifest, "shards_reused": 2}))
    out, _ = evaluate_row(row, results, {})
    assert [r["per_query_ms"] for r in out] == ["", ""]
    assert "per_query_ms left out: 2 of the rerank job's ranking shards reused" in out[0]["notes"]


def test_scale_1m_plan_prints_jobs_and_estimates_without_running(model, tmp_path):
    work = tmp_path / "work"
    costs = jobs.UnitCosts()
    for unit, per_s in (("stage_records", 10_000), ("images_encoded", 1_000), ("captions_encoded", 2_000),
                        ("ce_pairs", 500)):
        costs.set(unit, per_s, "test")
    costs.save(str(work / "bench" / "unit_costs.json"))
    dask = ["--runner=apache_beam.runners.dask.dask_runner.DaskRunner", "--dask_client_address=127.0.0.1:1"]
    res = _bench("--suite", "scale_1m", "--plan", "--no-sep", "--model", model, "--workdir", str(work), *dask,
                 timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    # staged compact: the regions the model reads (the tiny model: 50), float16
    assert "stage synthetic_1m-f16-r50-float16 (6,000,000 stage records; estimate 10.0 min)" in out
    assert "1,000,000 images encoded, 5,000,000 captions encoded; estimate 58.3 min" in out
    assert "(200,000 ce pairs; estimate 6.7 min)" in out
    # + the AUTO row's dev run: the demo's dev queries against a dev pool of scale_100k's size
    assert "stage synthetic_dev_pool-f16-distractors99500x5-r50-float16 (627,000 stage records" in out
    assert "dev (100,000 images encoded, 500,000 captions encoded; estimate 5.8 min)" in out
    assert "estimated work: 82.5 min" in out
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("python -m ")]
    pool_run = ["pipelines.stage", "benchmarks.queries", "pipelines.encode", "pipelines.build_index",
                "pipelines.build_index", "pipelines.rerank"]
    # the pool's CO run and its search-only twin (the per-query table's EMB), then the dev pool's CO run
    assert [c.split()[2] for c in commands] == pool_run + ["pipelines.rerank"] + pool_run
    assert "--mode emb" in commands[6] and "--ce-model" not in commands[6]
    assert all("--manifest synthetic_dev_pool" in c or "synthetic_dev_pool-f16" in c
               for c in commands[len(pool_run) + 1:])
    assert all("--feature-dtype float16 --max-regions 50 --spill-compression lzf" in c
               for c in commands if "pipelines.stage" in c)
    for c in commands:  # Beam flags go to every pipeline job, not to the queries helper
        assert all(f in c.split() for f in dask) == c.startswith("python -m pipelines.")
    assert "--modality text" in commands[4] and "--text-index" in commands[5] and "--scale 5000" in commands[1]
    assert sorted(os.listdir(work / "bench")) == ["unit_costs.json"]  # nothing ran


def test_unknown_flag_is_refused_in_one_line_before_anything_runs(model, tmp_path):
    res = _bench("--suite", "combination", "--quick", "--no-sep", "--model", model, "--workdir", str(tmp_path / "w"),
                 "--output", str(tmp_path / "o"), "--bogus_flag=1", timeout=120)
    assert res.returncode == 2
    err = [line for line in res.stderr.splitlines() if line.startswith("Error")]
    assert len(err) == 1 and "--bogus_flag" in err[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("preload", [False, True], ids=["fresh interpreter", "preloaded fork"])
def test_a_failing_job_is_one_line_naming_the_step(tmp_path, preload):
    job = jobs.Job("stage demo", "pipelines.stage", ("--manifest", "demo", "--output", str(tmp_path / "s")),
                   str(tmp_path / "s"), "summary.json")
    with pytest.raises(jobs.JobFailed) as err:  # the job itself refuses a flag Beam does not know
        jobs.run_job(job, ("--bogus_flag=1",), log=lambda m: None, preload=preload)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("stage demo failed (exit ") and "unknown option(s) --bogus_flag" in msg


def test_a_preloaded_job_runs_its_module_as_python_m_would(tmp_path, monkeypatch, capsys):
    """Forked from the preloaded forkserver: the module runs as __main__ with the job's argv, the launcher's
    cwd and environment; its output streams back, its exit status and its own peak RSS are reported."""
    script = tmp_path / "pkg_job.py"
    script.write_text("import os, sys\n"
                      "if __name__ == '__main__':\n"
                      "    open(sys.argv[1], 'w').write(os.environ['RR_JOB_TEST'] + ' ' + os.getcwd())\n"
                      "    print('written', sys.argv[1])\n"
                      "    sys.exit(int(sys.argv[2]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RR_JOB_TEST", "set after the forkserver started")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    job = jobs.Job("write", "pkg_job", (str(out / "done.txt"), "0"), str(out), "done.txt", beam=False)
    launch.forkserver()  # started before the variable changes below: the job must still see the launcher's
    monkeypatch.setenv("RR_JOB_TEST", "the launcher's environment now")
    res = jobs.run_job(job, log=lambda m: None, preload=True)
    assert (out / "done.txt").read_text() == f"the launcher's environment now {tmp_path}"
    assert "  | written " in capsys.readouterr().out and res.peak_rss_kib > 0 and not res.reused
    failing = jobs.Job("exit 3", "pkg_job", (str(out / "x.txt"), "3"), str(out), "x.txt", beam=False)
    with pytest.raises(jobs.JobFailed, match=r"exit 3 failed \(exit 3\): written"):
        jobs.run_job(failing, log=lambda m: None, preload=True)


@pytest.mark.parametrize("preload", [True, False])
def test_a_demo_step_passes_its_output_through_as_it_comes(tmp_path, monkeypatch, capfd, preload):
    """benchmarks.suites.launch.run_module (the demo's steps): the step's output reaches ours unchanged, a progress
    bar's carriage returns included (not held back until a newline), and a failing step raises as subprocess.run
    (check=True) would."""
    script = tmp_path / "bar_step.py"
    script.write_text("import sys\n"
                      "if __name__ == '__main__':\n"
                      "    sys.stdout.write('step 1/2\\rstep 2/2\\r'); sys.stdout.flush()\n"
                      "    print('done'); sys.exit(int(sys.argv[1]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.chdir(tmp_path)
    launch.run_module([sys.executable, "-m", "bar_step", "0"], preload=preload)
    assert capfd.readouterr().out == "step 1/2\rstep 2/2\rdone\n"
    with pytest.raises(subprocess.CalledProcessError) as err:
        launch.run_module([sys.executable, "-m", "bar_step", "4"], preload=preload)
    assert err.value.returncode == 4 and err.value.cmd[-2:] == ["bar_step", "4"]


def test_job_reuse_follows_its_output_and_inputs(tmp_path):
    out, src = tmp_path / "out", tmp_path / "input.json"
    out.mkdir()
    src.write_text('{"a": 1}')
    # any module works as a job: json.tool copies its input to the output's "manifest"
    job = jobs.Job("copy", "json.tool", (str(src), str(out / "done.json")), str(out), "done.json", beam=False,
                   inputs=(str(src),))
    first = jobs.run_job(job, log=lambda m: None)
    assert not first.reused and first.peak_rss_kib > 0 and first.wall_s > 0
    again = jobs.run_job(job, log=lambda m: None)
    assert again.reused and again.wall_s == pytest.approx(first.wall_s, abs=1e-3)
    src.write_text('{"a": 2}')  # an input changed: the output is stale
    assert not jobs.run_job(job, log=lambda m: None).reused
    (out / "done.json").write_text("{}")  # the output changed behind the stamp's back
    assert jobs.finished(job) is None


def test_a_finished_job_is_not_reused_by_other_code(tmp_path, monkeypatch):
    out, src = tmp_path / "out", tmp_path / "input.json"
    out.mkdir()
    src.write_text('{"a": 1}')
    job = jobs.Job("copy", "json.tool", (str(src), str(out / "done.json")), str(out), "done.json", beam=False)
    jobs.run_job(job, log=lambda m: None)
    assert jobs.finished(job) is not None
    monkeypatch.setattr(jobs, "code_version", lambda: "another checkout")  # e.g. a staging writer changed
    assert jobs.finished(job) is None and not jobs.run_job(job, log=lambda m: None).reused


def test_source_digest_changes_with_any_source_file(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    before = jobs.source_digest([str(pkg)])
    assert before == jobs.source_digest([str(pkg)]) and len(before) == 64
    (pkg / "notes.txt").write_text("not code")
    assert jobs.source_digest([str(pkg)]) == before
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert jobs.source_digest([str(pkg)]) != before
    assert len(jobs.code_version()) == 64


def test_unit_costs_learn_and_estimate():
    costs = jobs.UnitCosts()
    enc = jobs.Job("encode", "pipelines.encode", (), "/x", "m.json",
                   (("images_encoded", 100), ("captions_encoded", 300)))
    assert costs.estimate(enc) is None and costs.missing([enc]) == ["captions_encoded", "images_encoded"]
    costs.learn(jobs.JobResult(enc, 30.0, 1))  # too short: start-up would dominate, nothing learned
    assert costs.rates == {}
    # no rates yet: an image counts as a caption (400 items in 90 s, less the job's start-up)
    costs.learn(jobs.JobResult(enc, 90.0 + jobs.JOB_START_S, 1))
    assert costs.rates["images_encoded"]["per_s"] == pytest.approx(400 / 90)
    costs.set("images_encoded", 1.0, "sample")  # images cost twice a caption
    costs.set("captions_encoded", 2.0, "sample")
    costs.learn(jobs.JobResult(enc, 250.0 + jobs.JOB_START_S, 1))
    assert costs.estimate(enc) == pytest.approx(250.0)
    assert costs.rates["images_encoded"]["per_s"] == pytest.approx(costs.rates["captions_encoded"]["per_s"] / 2)
    small = jobs.Job("encode small", "pipelines.encode", (), "/y", "m.json", (("images_encoded", 10),
                                                                              ("captions_encoded", 30)))
    costs.learn(jobs.JobResult(small, 500.0, 1))  # less work than the job the rates came from: ignored
    assert costs.estimate(enc) == pytest.approx(250.0)


# ------------------------------------------------------------------------------------------- latency
def test_latency_per_query_rows_and_extrapolated_totals(model, tmp_path):
    lcfg = latency.LatencyConfig(sizes=(100, 400), eval_sizes=(6,), ks=(4,), reps=3, warmup=1, paper_reps=1,
                                 base_images=12, recall_queries=8, ce_measure_budget_s=0.0, eval_budget_s=0.0,
                                 batch_size=16, threads=1, hnsw_max_n=100, pipeline_overhead_images=0,
                                 train_steps=1, feeding_items=20, entry_point_images=8, entry_point_k=4)
    cfg = planner.SuiteConfig(suite="latency", workdir=str(tmp_path), models=planner.Models(join=model), feature_dim=F)
    rows, results = latency.run_latency(cfg, lcfg, log=lambda m: None)
    entry = {r["mode"]: r for r in rows if r.get("collection") == "entry_point"}  # the Python query entry point
    assert set(entry) == {"entry point EMB", "entry point CO"}
    assert all(r["k"] == 4 and r["collection_size"] == 8 and 0 < r["latency_p50_ms"] for r in entry.values())
    assert results == []  # a zero budget runs no Table 4 job
    back = report.read_csv(report.write_csv(str(tmp_path / "latency.csv"), rows))
    per_q = [r for r in back if r["collection"].startswith("per_query")]
    assert {(r["model"], r["mode"]) for r in per_q} >= {
        ("JOIN", "EMB-Flat"), ("JOIN", "EMB-Exact"), ("JOIN", "EMB-bound"), ("JOIN", "EMB-IVF-Flat"),
        ("JOIN", "EMB-IVF-SQ8"), ("JOIN", "CO"), ("JOIN", "CE"), ("paper-code", "EMB"), ("paper-code", "CO")}
    for r in per_q:
        if r["mode"] == "EMB-HNSW32" and r["collection_size"] == "400":  # above hnsw_max_n: a marked skip
            assert r["measured"] == "false" and "hnsw-max-n" in r["notes"]
            continue
        if r["mode"].startswith("EMB"):  # search alone beside the whole query, and the bandwidth bound
            assert float(r["search_p50_ms"]) > 0 and float(r["bound_ms"] or r["search_p50_ms"]) > 0
        if r["mode"].startswith(("EMB-IVF", "EMB-HNSW")):
            assert 0 <= float(r["ann_recall@10"]) <= 1 and int(r["index_bytes"]) > 0
            assert ("efSearch=" if "HNSW" in r["mode"] else "nprobe=") in r["notes"]
        p = [float(r[c]) for c in ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")]
        assert 0 < p[0] <= p[1] <= p[2] and r["threads"] == "1"
        if r["mode"] == "CE":  # the budget is 0: whole-collection CE is extrapolated and says so
            assert r["measured"] == "false" and r["notes"].startswith("extrapolated")
    roof = {r["mode"]: r for r in back if r["collection"] == "roofline"}
    from retrieval_core.model.quantize import cpu_has_native_bf16
    variants = ("fp32", "int8") + (("bf16",) if cpu_has_native_bf16() else ())  # bf16 rows where the CPU has it
    assert set(roof) == {f"{t} ({v})" for t in ("CE pairs", "BE images", "BE captions") for v in variants}
    for r in roof.values():  # a measured rate below what the GEMMs at the model's shapes allow
        assert float(r["rate_per_s"]) > 0 and 0 < float(r["roofline_fraction"]) and "MFLOP per unit" in r["notes"]
    assert all(0 < float(roof[f"{t} (fp32)"]["roofline_fraction"]) < 1.5 for t in ("CE pairs", "BE images"))
    for r in roof.values():  # the padding of the measured batches, and the kernels that ran
        assert 0 < float(r["useful_token_fraction"]) <= 1
        assert ("attention eager: aten::_softmax" if r["mode"].endswith("(bf16)") else  # CPU bf16 serves eager
                "attention sdpa: aten::_scaled_dot_product") in r["notes"]
    if cpu_has_native_bf16():
        assert "matmul brg_matmul:" in roof["CE pairs (bf16)"]["notes"]  # bf16 GEMMs run in oneDNN
    # training rows: BE, CE and JOIN steps of both recipes, fp32 and (native) bf16, with FLOPs and padding
    train = {r["mode"]: r for r in back if r["collection"] == "training"}
    assert set(train) == {f"{o} step ({recipe}, {v})" for o in ("BE", "CE", "JOIN") for recipe in ("demo", "bench")
                          for v in ("fp32",) + (("bf16",) if cpu_has_native_bf16() else ())}
    for r in train.values():
        assert r["measured"] == "true" and float(r["rate_per_s"]) > 0 and float(r["roofline_fraction"]) > 0
        assert 0 < float(r["useful_token_fraction"]) <= 1 and "GFLOP forward + backward" in r["notes"]
    for recipe in ("demo", "bench"):  # a JOIN step is a BE step and a CE step
        join = float(train[f"JOIN step ({recipe}, fp32)"]["rate_per_s"])
        assert join < min(float(train[f"{o} step ({recipe}, fp32)"]["rate_per_s"]) for o in ("BE", "CE"))
    assert report.plot_roofline(back, str(tmp_path / "roofline.png"))
    totals = [r for r in back if r["collection"].startswith("eval_total")]
    assert {(r["mode"], r["measured"]) for r in totals if r["model"] == "JOIN"} == \
        {("EMB", "false"), ("CO", "false"), ("CE", "false")}
    assert all("job start-up" in r["notes"] for r in totals if r["model"] == "JOIN")
    png = report.plot_latency(per_q, str(tmp_path / "latency.png"))
    assert png and os.path.getsize(png) > 1000
    # job path vs model alone on the same batches, fp32 and (native) bf16: the ratio to the model-alone row
    feed = [r for r in back if r["collection"].startswith("feeding_")]
    ways = ("job path (handler)", "library loop", "model alone (batches collated ahead)")
    assert {(r["mode"], r["quantize"]) for r in feed} == {(f"{t}: {w}", v) for t in ("pairs", "images") for w in ways
                                                          for v in variants if v != "int8"}
    for r in feed:
        assert float(r["rate_per_s"]) > 0 and float(r["roofline_fraction"]) > 0 and r["collection_size"] == "20"
        if "model alone" in r["mode"]:
            assert float(r["roofline_fraction"]) == 1.0


def test_cli_help_lists_suites():
    from benchmarks.run import main

    res = CliRunner().invoke(main, ["-h"])
    assert res.exit_code == 0
    for s in planner.SUITES + ("--quick", "--plan", "--threads", "--device"):
        assert s in res.output


def test_memory_plan_runs_every_pipeline_at_each_size(model, tmp_path):
    res = _bench("--suite", "memory", "--plan", "--no-sep", "--model", model, "--workdir", str(tmp_path / "w"),
                 "--memory-sizes", "300,600", timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    commands = [line.strip() for line in res.stdout.splitlines() if line.strip().startswith("python -m ")]
    steps = ["pipelines.stage", "benchmarks.queries", "pipelines.encode", "pipelines.build_index", "pipelines.rerank"]
    assert [c.split()[2] for c in commands] == steps * 2
    assert "synthetic_memory.images.num_images=300" in commands[0]
    assert "synthetic_memory.images.num_images=600" in commands[5]
    bad = _bench("--suite", "standard", "--plan", "--no-sep", "--model", model, "--memory-sizes", "300", timeout=120)
    assert bad.returncode == 2 and "--memory-sizes is for --suite memory" in bad.stderr


def test_memory_table_reports_each_steps_peak_rss_per_size_and_growth_from_the_csvs(tmp_path):
    from benchmarks.run import JOB_PROVENANCE, job_rows

    def result(name, module, mb):
        return jobs.JobResult(jobs.Job(name, module, (), str(tmp_path), "m.json"), 1.0, int(mb * 1024))

    where = dict.fromkeys(JOB_PROVENANCE, "x")

    results = [result("stage synthetic_memory-n300", "pipelines.stage", 500),
               result("index m synthetic_memory-n300/all image", "pipelines.build_index", 300),
               result("index m synthetic_memory-n300/all text", "pipelines.build_index", 350),
               result("rerank JOIN co k=20 synthetic_memory-n300/all", "pipelines.rerank", 900),
               result("stage synthetic_memory-n600", "pipelines.stage", 550),
               result("encode m synthetic_memory-n600", "pipelines.encode", 700)]
    report.write_jobs_csv(str(tmp_path / "memory_jobs.csv"), job_rows(results, (), where))
    rows = [{"suite": "memory", "collection_size": n, "launcher_peak_rss_mb": mb, "cpu_model": "CPU X",
             "threads": 2, "batch_size": 128, "direction": d} for n, mb in ((300, 400.0), (600, 420.0))
            for d in ("t2i", "i2t")]
    report.write_csv(str(tmp_path / "memory.csv"), rows)
    table = report.memory_table_from(str(tmp_path))
    assert "| 300 | 500 | - | - | 350 | 900 | 400 |" in table  # the larger of the two index jobs
    assert "| 600 | 550 | - | 700 | - | - | 420 |" in table
    assert "| growth 300 -> 600 | +10 % | - | - | - | - | +5 % |" in table
    assert "DirectRunner" in table and "CPU X" in table and "threads 2" in table
    again = tmp_path / "again"  # a later run of the 600-image stage job replaces that cell, marked
    again.mkdir()
    report.write_jobs_csv(str(again / "memory_jobs.csv"), job_rows([result("stage synthetic_memory-n600",
                                                                           "pipelines.stage", 660)], (), where))
    table = report.memory_table_from(str(tmp_path), str(again))
    assert "| 600 | 660* | - | 700 | - | - | 420 |" in table and "| growth 300 -> 600 | +32 % |" in table


def test_distractor_plan_ranks_each_task_in_its_own_job(model, tmp_path):
    """distractor_20k ranks the COCO-like and the Flickr-like queries against one shared pool: two rerank jobs
    per model and mode, told apart by their query selection (they once collided on one name and the suite
    refused to plan)."""
    res = _bench("--suite", "distractor_20k", "--plan", "--no-sep", "--model", model,
                 "--workdir", str(tmp_path / "w"), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    reranks = [line.split("--queries ")[1].split()[0] for line in res.stdout.splitlines()
               if line.strip().startswith("python -m pipelines.rerank") and "--mode co" in line
               and "/bench/runs/synthetic_distractor20k" in line]
    assert len(reranks) == 2 and len(set(reranks)) == 2, res.stdout[-3000:]


def test_the_seed_summary_keeps_one_auto_row_whatever_fusion_each_seed_chose():
    """AUTO is one configuration: each seed's dev run may choose another fusion (and lam); the summary averages
    the AUTO rows of all seeds and lists the choices, while a fixed-lam ADD row stays keyed by its lam."""
    def rows(seed, auto_lam, fusion, r1):
        base = {"suite": "standard", "collection": "c", "model": "JOIN", "k": 20, "R@5": 1.0, "R@10": 1.0,
                "mR": 1.0, "queries": 10, "recipe": "bench", "model_seed": seed}
        return [{**base, "mode": "AUTO", "lam": auto_lam, "fusion": fusion, "direction": "t2i", "R@1": r1},
                {**base, "mode": "ADD", "lam": 0.5, "direction": "t2i", "R@1": 2.0 * r1}]
    summary = report.seed_summary({0: rows(0, 0.3, "norm_add_0.3", 50.0), 1: rows(1, "", "co", 54.0),
                                   2: rows(2, 0.1, "add_0.1", 58.0)})
    auto = [r for r in summary if r["mode"] == "AUTO"]
    assert len(auto) == 1 and auto[0]["lam"] == "" and auto[0]["R@1_mean"] == pytest.approx(54.0)
    assert auto[0]["fusion"] == "0:norm_add_0.3 1:co 2:add_0.1"
    add = [r for r in summary if r["mode"] == "ADD"]
    assert len(add) == 1 and add[0]["lam"] == "0.5" and add[0]["fusion"] == ""
    assert "(chosen per seed: 0:norm_add_0.3 1:co 2:add_0.1)" in report.seed_summary_table(summary)
    # a row one seed lacks is still an error: the seeds must have run the same plan
    with pytest.raises(ValueError, match="missing for seed"):
        report.seed_summary({0: rows(0, 0.3, "norm_add_0.3", 50.0), 1: rows(1, "", "co", 54.0)[:1]})


def test_the_seed_summary_gives_the_interval_of_each_seed_mean_and_of_its_difference_to_emb(tmp_path):
    """Three seeds rank the same queries: the seed-mean difference CO - EMB and its interval come from one resample
    of the queries applied to every seed's CO and EMB hits (evaluation.stats), not from the CSV numbers."""
    from benchmarks.suites.rows import RowHits
    from retrieval_core.evaluation.metrics import DirectionHits
    from retrieval_core.evaluation.stats import Bootstrap, difference_intervals, recall_intervals

    rng = np.random.default_rng(0)
    ids = {"t2i": np.arange(300), "i2t": np.arange(1000, 1100)}
    miss = np.iinfo(np.int64).max

    def hits(p_first):
        return {d: DirectionHits(d, q, np.where(rng.random(len(q)) < p_first, 0, miss), 10) for d, q in ids.items()}

    rows_by_seed, hits_by_seed, per_seed = {}, {}, {}
    for seed in (0, 1, 2):
        emb, co = hits(0.4), hits(0.6)
        per_seed[seed] = (co, emb)
        rows, row_hits = [], []
        for mode, h, base in (("EMB", emb, None), ("CO", co, emb)):
            for d in ("t2i", "i2t"):
                r1 = 100 * float(np.mean(h[d].first_hit < 1))
                rows.append({"suite": "standard", "collection": "c", "model": "JOIN", "mode": mode,
                             "k": 20 if mode == "CO" else "", "direction": d, "R@1": r1, "R@5": r1, "R@10": r1,
                             "mR": 0.0, "queries": len(ids[d]), "against": "EMB" if base else ""})
                row_hits.append(RowHits(h, base))
        rows_by_seed[seed], hits_by_seed[seed] = rows, row_hits
    summary = report.seed_summary(rows_by_seed, hits_by_seed)
    co_t2i = next(r for r in summary if r["mode"] == "CO" and r["direction"] == "t2i")
    boot = Bootstrap()
    want = difference_intervals([per_seed[s][0] for s in (0, 1, 2)], [per_seed[s][1] for s in (0, 1, 2)], boot)
    mean = recall_intervals([per_seed[s][0] for s in (0, 1, 2)], boot)
    assert co_t2i["delta_R@1_mean"] == pytest.approx(
        np.mean([100 * (np.mean(per_seed[s][0]["t2i"].first_hit < 1) - np.mean(per_seed[s][1]["t2i"].first_hit < 1))
                 for s in (0, 1, 2)]), abs=1e-3)
    assert (co_t2i["delta_R@1_mean_lo"], co_t2i["delta_R@1_mean_hi"]) == pytest.approx(
        (want["t2i_R@1"].lo, want["t2i_R@1"].hi), abs=1e-3)
    assert co_t2i["delta_R@1_mean_lo"] > 0  # a 20-point lift over 300 queries and 3 seeds: the interval excludes 0
    assert (co_t2i["R@1_mean_lo"], co_t2i["R@1_mean_hi"]) == pytest.approx((mean["t2i_R@1"].lo, mean["t2i_R@1"].hi),
                                                                           abs=1e-3)
    assert co_t2i["against"] == "EMB" and "jointly across the seeds" in co_t2i["bootstrap"]
    emb_t2i = next(r for r in summary if r["mode"] == "EMB" and r["direction"] == "t2i")
    assert "delta_R@1_mean" not in emb_t2i and emb_t2i["R@1_mean_lo"] < emb_t2i["R@1_mean"] < emb_t2i["R@1_mean_hi"]
    table = report.seed_summary_table(summary)
    assert "seed-mean R@1 minus EMB: t2i +" in table and "lifts" in table
    path = report.write_csv(str(tmp_path / "x_seeds.csv"), summary, report.SEED_COLUMNS)
    assert set(report.read_csv(path)[0]) == set(report.SEED_COLUMNS)
    # seeds that ranked other queries cannot be resampled jointly
    other = dict(hits_by_seed)
    shifted = {d: DirectionHits(d, q + 1, per_seed[2][0][d].first_hit, 10) for d, q in ids.items()}
    other[2] = [RowHits(shifted, h.baseline) if h.baseline is not None else h for h in hits_by_seed[2]]
    with pytest.raises(ValueError, match="rank different queries"):
        report.seed_summary(rows_by_seed, other)


def test_multilingual_plan_ranks_each_language_against_its_own_captions(model, tmp_path):
    """multilingual: per family and language one CO run whose t2i queries are that language's test captions and whose
    i2t pool is a caption index of exactly those captions (--ids from the language's selection); its AUTO row chooses
    on a dev run of the same language and pool; every row is evaluated on that language."""
    cfg = planner.SuiteConfig(suite="multilingual", workdir=str(tmp_path), quick=True, feature_dim=F,
                             models=planner.Models(named=(("A", model), ("B", model))))
    plan = suites.plan_suite(cfg)
    reranks = [j for j in plan.jobs if j.module == "pipelines.rerank"]
    assert len(reranks) == 2 * len(suites.ML_LANGUAGES) * 2  # families x languages x (test, dev): A and B share none
    for lang in suites.ML_LANGUAGES:
        rows = [r for r in plan.rows if r.lang == lang and r.model == "A"]
        assert {r.mode for r in rows} == {"EMB", "CO", "AUTO"} and all(r.collection.endswith(f"/{lang}") for r in rows)
        run = next(j.plan for j in reranks if j.output == rows[0].runs[0])
        q = next(j.plan for j in plan.jobs if j.output == os.path.dirname(run.queries))
        txt = next(j.plan for j in plan.jobs if j.output == run.text_index)
        assert (q.lang, q.split, txt.modality) == (lang, "test", "text")
        assert txt.ids == os.path.join(q.output, queries.CAPTION_IDS_FILE)
        auto = next(r for r in rows if r.mode == "AUTO")
        dev = next(j.plan for j in reranks if j.output == auto.tune_on)
        assert dev.split == "dev" and next(j.plan for j in plan.jobs
                                           if j.output == os.path.dirname(dev.queries)).lang == lang


def test_recall_table_is_one_markdown_line_per_ranking_with_intervals_and_verdicts(tmp_path):
    base = dict(suite="multilingual", collection="synthetic_multi30k/de", model="JOIN-e5", k=20)
    rows = [dict(base, mode="EMB", direction=d, **{"R@1": r1, "R@5": 80.0, "R@10": 90.0, "mR": 70.0,
                                                  "R@1_lo": r1 - 3, "R@1_hi": r1 + 3, "mR_lo": 68.0, "mR_hi": 72.0})
            for d, r1 in (("t2i", 50.0), ("i2t", 60.0))]
    rows += [dict(base, mode="CO", direction=d, **{"R@1": r1, "R@5": 81.0, "R@10": 91.0, "mR": 72.0,
                                                  "R@1_lo": r1 - 3, "R@1_hi": r1 + 3, "mR_lo": 70.0, "mR_hi": 74.0,
                                                  "delta_R@1": dl, "delta_R@1_lo": lo, "delta_R@1_hi": hi})
             for d, r1, dl, lo, hi in (("t2i", 54.0, 4.0, 1.5, 6.5), ("i2t", 59.0, -1.0, -3.0, 1.0))]
    rows.append(dict(base, mode="CO", direction="both", notes="skipped: over the budget"))  # no recall: left out
    path = report.write_csv(str(tmp_path / "multilingual.csv"), rows)
    lines = report.recall_table(report.read_csv(path)).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| collection |")
    emb, co = lines[2].split(" | "), lines[3].split(" | ")
    assert emb[2] == "EMB" and emb[3] == "50.0 [47.0, 53.0]" and emb[9] == "70.0 [68.0, 72.0]" and emb[10] == "-"
    assert co[2] == "CO k=20" and co[6] == "59.0 [56.0, 62.0]"
    assert co[10] == "+4.0 [+1.5, +6.5] lifts" and co[11].startswith("-1.0 [-3.0, +1.0] no significant difference")


def test_the_seed_summary_of_finished_runs_gives_the_t_interval_over_seeds_and_its_table(tmp_path):
    """``report seeds`` re-summarises a finished several-seed run from its per-seed CSVs: the t interval of the mean
    of the seeds' own CO - EMB differences (t(0.975, 2) = 4.303 for 3 seeds), their range, the environment, and the
    seed table the docs generate; a summary beside them lends its query-bootstrap columns only to rows with its
    means."""
    from click.testing import CliRunner

    from benchmarks.report import published
    from benchmarks.report.__main__ import main as report_main

    env = {"suite": "standard", "collection": "c5k", "model": "JOIN", "queries": 500, "collection_size": 5000,
           "split": "test", "recipe": "bench", "device": "cpu", "cpu_model": "X", "threads": 1, "torch": "2.13.0",
           "faiss": "1.15.1", "commit": "abc", "date": "2026-11-27"}
    deltas = {0: 15.2, 1: 9.0, 2: 12.1}
    for seed, d in deltas.items():
        rows = []
        for direction in ("t2i", "i2t"):
            rows.append({**env, "model_seed": seed, "mode": "EMB", "direction": direction, "R@1": 50.0 + seed,
                         "R@5": 70.0, "R@10": 80.0, "mR": 66.0})
            rows.append({**env, "model_seed": seed, "mode": "CO", "k": 20, "direction": direction,
                         "R@1": 50.0 + seed + d, "R@5": 71.0, "R@10": 80.0, "mR": 67.0, "against": "EMB",
                         "delta_R@1": d, "delta_R@5": 1.0, "delta_R@10": 0.0, "delta_mR": 1.0})
        (tmp_path / f"seed{seed}").mkdir()
        report.write_csv(str(tmp_path / f"seed{seed}" / "standard.csv"), rows)
    res = CliRunner().invoke(report_main, ["seeds", str(tmp_path), "--suite", "standard"])
    assert res.exit_code == 0, res.output
    rows = report.read_csv(str(tmp_path / "standard_seeds.csv"))
    co = next(r for r in rows if r["mode"] == "CO" and r["direction"] == "t2i")
    vals = np.array(list(deltas.values()))
    half = 4.302653 * vals.std(ddof=1) / np.sqrt(3)
    assert float(co["delta_R@1_mean"]) == pytest.approx(vals.mean(), abs=1e-3)
    assert (float(co["delta_R@1_mean_t_lo"]), float(co["delta_R@1_mean_t_hi"])) == pytest.approx(
        (vals.mean() - half, vals.mean() + half), abs=1e-3)
    assert (float(co["delta_R@1_min"]), float(co["delta_R@1_max"])) == (9.0, 15.2)
    assert co["against"] == "EMB" and co["commit"] == "abc" and "3 seeds" in co["seed_interval"]
    block = published.seed_block(rows)
    assert f"{vals.mean():+.1f} [{vals.mean() - half:+.1f}, {vals.mean() + half:+.1f}] lifts; seeds +9.0 to +15.2" \
        in block
    assert published.block_numbers_problems(block, rows, "t") == []
    # a summary beside the seeds lends its query-bootstrap columns only to the rows it summarises with the same
    # means, differences to EMB included: the CO rows, as if rerun (t2i: another R@1 mean; i2t: the same means but
    # another difference), keep none; the EMB rows' are carried
    beside = [{**r, "R@1_mean_lo": 1.0, "R@1_mean_hi": 2.0, "bootstrap": "queries",
               "R@1_mean": float(r["R@1_mean"]) + (r["mode"] == "CO" and r["direction"] == "t2i"),
               "delta_R@1_mean": float(r["delta_R@1_mean"]) + 1 if r["mode"] == "CO" and r["direction"] == "i2t"
               else r["delta_R@1_mean"]} for r in rows]
    report.write_csv(str(tmp_path / "standard_seeds.csv"), beside, report.SEED_COLUMNS)
    res = CliRunner().invoke(report_main, ["seeds", str(tmp_path), "--suite", "standard"])
    assert res.exit_code == 0, res.output
    assert res.output.count("no query-bootstrap columns for standard c5k JOIN CO 20") == 2
    again = report.read_csv(str(tmp_path / "standard_seeds.csv"))
    assert {(r["mode"], str(r["R@1_mean_lo"]), str(r["bootstrap"])) for r in again} == {
        ("EMB", "1.0", "queries"), ("CO", "", "")}
    assert [r["R@1_mean"] for r in again] == [r["R@1_mean"] for r in rows]


def test_the_seed_summary_gives_join_minus_sep_with_the_welch_interval_over_their_own_seeds(tmp_path):
    """JOIN and SEP train on their own seeds (not paired): the summary's JOIN - SEP gap interval is Welch's, as
    scipy's unequal-variance t test gives it from the seeds' values; the docs' gap table shows it and names each
    model's commit."""
    from scipy import stats

    from benchmarks.report import published

    join, sep = {0: 78.0, 1: 73.4, 2: 70.4}, {0: 77.4, 1: 66.2, 2: 71.0}
    env = {"suite": "standard", "collection": "c5k", "mode": "CO", "k": 20, "direction": "t2i", "queries": 500,
           "split": "test", "recipe": "bench", "device": "cpu", "cpu_model": "X", "threads": 1, "torch": "2.13.0",
           "faiss": "1.15.1", "date": "2026-11-29", "R@5": 90.0, "R@10": 95.0, "mR": 80.0}
    rows_by_seed = {s: [{**env, "model": "JOIN", "R@1": join[s], "commit": "new"},
                        {**env, "model": "SEP", "R@1": sep[s], "commit": "old"}] for s in join}
    summary = report.seed_summary(rows_by_seed)
    ci = stats.ttest_ind(list(join.values()), list(sep.values()), equal_var=False).confidence_interval(0.95)
    diff = np.mean(list(join.values())) - np.mean(list(sep.values()))
    row = next(r for r in summary if r["model"] == "JOIN")
    assert row["gap_against"] == "SEP" and (row["gap_R@1_mean"], row["gap_R@1_welch_lo"], row["gap_R@1_welch_hi"]) \
        == pytest.approx((diff, ci.low, ci.high), abs=1e-3)
    assert row["gap_R@5_mean"] == 0.0 and "gap_against" not in next(r for r in summary if r["model"] == "SEP")
    written = report.read_csv(report.write_csv(str(tmp_path / "standard_seeds.csv"), summary, report.SEED_COLUMNS))
    block = published.model_gap_block(written)
    assert published.block_numbers_problems(block, written, "gap") == []
    assert f"| c5k | CO k=20 | 73.9 | 71.5 | {diff:+.1f} [{ci.low:+.1f}, {ci.high:+.1f}] no significant difference " \
           "| - | - | - |" in block
    assert "commit `new` (JOIN rows), `old` (SEP rows)" in block


def test_the_multilingual_suite_rows_name_its_own_recipes():
    """The multilingual suite trains its ML_RECIPES whatever --recipe says; its rows must not name --recipe's."""
    from types import SimpleNamespace

    from benchmarks.run import _recipe_label

    assert _recipe_label(SimpleNamespace(suite="multilingual", recipe="bench")) == "ml-e5-en / ml-e5-all / ml-minilm-en"
    assert _recipe_label(SimpleNamespace(suite="standard", recipe="bench")) == "bench"

import json
from types import MappingProxyType

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from benchmarks.evaluate import main
from retrieval_core.data import schema
from retrieval_core.data.shards import caption_shard_parquet
from retrieval_core.evaluation.metrics import evaluate_rankings
from retrieval_core.search.rerank import rank_query, rankings_table

# images 100, 200, 300 with captions 1-2, 3-5, 6
C2I = {1: 100, 2: 100, 3: 200, 4: 200, 5: 200, 6: 300}
I2C = {100: frozenset({1, 2}), 200: frozenset({3, 4, 5}), 300: frozenset({6})}
# t2i: captions 1,3,6 hit at rank 1; 2 at rank 2; 4 at rank 3; 5 never (only distractor 999 and others)
T2I = {1: [100, 200, 300], 2: [200, 100, 300], 3: [200, 999, 100], 4: [999, 300, 200],
       5: [999, 100, 300], 6: [300, 100, 200]}
# i2t: image 100 hits at rank 2 (caption 2), 200 at rank 1 (caption 5 — any of its captions), 300 never
I2T = {100: [3, 2, 6], 200: [5, 1, 2], 300: [1, 2, 3]}


def _table(t2i=T2I, i2t=I2T):
    parts = []
    for direction, runs in ((schema.DIRECTION_T2I, t2i), (schema.DIRECTION_I2T, i2t)):
        results = [rank_query(np.array(items), np.linspace(1, 0, len(items)), None, k=3, mode="emb")
                   for items in runs.values()]
        parts.append(rankings_table(direction, list(runs), results))
    return parts


def _expected():
    return {"t2i_R@1": 50.0, "t2i_R@5": 500 / 6, "i2t_R@1": 100 / 3, "i2t_R@5": 200 / 3}


def test_evaluate_rankings_hand_values_and_read_only_gold():
    import pyarrow as pa
    table = pa.concat_tables(_table())
    c2i, i2c = MappingProxyType(dict(C2I)), MappingProxyType(dict(I2C))
    res = evaluate_rankings(table, c2i, i2c)
    for key, value in _expected().items():
        assert res[key] == pytest.approx(value)
    assert res["t2i_R@10"] == res["t2i_R@5"]
    assert res["mR"] == pytest.approx(np.mean([50, 500 / 6, 500 / 6, 100 / 3, 200 / 3, 200 / 3]))
    assert res["t2i_queries"] == 6 and res["i2t_queries"] == 3 and res["collection_size"] == 3
    assert dict(c2i) == C2I and dict(i2c) == I2C


def test_missing_or_unknown_queries_are_errors_naming_them():
    import pyarrow as pa
    t2i = {q: v for q, v in T2I.items() if q != 4}
    with pytest.raises(ValueError, match="gold caption query 4 is missing"):
        evaluate_rankings(pa.concat_tables(_table(t2i=t2i)), C2I, I2C)
    i2t = {**I2T, 777: [1, 2, 3]}
    with pytest.raises(ValueError, match="image query 777 is not in the gold"):
        evaluate_rankings(pa.concat_tables(_table(i2t=i2t)), C2I, I2C)
    df = pa.concat_tables(_table()).to_pandas()
    dup = pd.concat([df, df.iloc[:1]])
    with pytest.raises(ValueError, match="same rank twice"):
        evaluate_rankings(dup, C2I, I2C)


def _staged_dir(root):
    rows = []
    for cap, img in C2I.items():
        rows.append({"caption_id": cap, "image_item_id": img, "collection": "toy", "source_id": f"s{cap}",
                     "text": f"caption {cap}", "lang": "en", "split": "test"})
    rows.append({"caption_id": 50, "image_item_id": 500, "collection": "toy", "source_id": "s50",
                 "text": "a train caption", "lang": "en", "split": "train"})
    (root / "captions").mkdir(parents=True)
    (root / "captions" / "toy-00000-of-00001.parquet").write_bytes(caption_shard_parquet(rows))
    summary = {"complete": True, "feature_dim": 8, "collections": {"toy": {
        "images": {"shards": []},
        "captions": {"shards": [{"name": "captions/toy-00000-of-00001.parquet", "rows": len(rows)}]}}}}
    (root / "summary.json").write_text(json.dumps(summary))
    return root


def write_run(run_dir, tables, *, mode="emb", k=3, lam=None, queries_file=None, schema_version=None):
    """A run directory as pipelines.rerank leaves it: rankings/ shards + rankings_manifest.json (the fields
    benchmarks.evaluate reads)."""
    import hashlib

    (run_dir / "rankings").mkdir(parents=True, exist_ok=True)
    shards = []
    for t in tables:
        d = t.column("direction")[0].as_py()
        name = f"{d}-00000-of-00001.parquet"
        pq.write_table(t, run_dir / "rankings" / name)
        shards.append({"direction": d, "name": name, "queries": len(set(t.column("query_id").to_pylist())),
                       "rows": t.num_rows, "sha256": hashlib.sha256((run_dir / "rankings" / name).read_bytes())
                       .hexdigest()})
    directions = [s["direction"] for s in shards]
    manifest = {"schema_version": schema_version or schema.RANKINGS_SCHEMA_VERSION, "mode": mode, "k": k,
                "lam": lam, "directions": directions, "collection": "toy", "split": "test",
                "ce_depth": {d: 0 if mode == "emb" else k for d in directions},
                "pool_size": {"t2i": 3, "i2t": 6}, "queries_file": queries_file, "shards": shards}
    (run_dir / "rankings_manifest.json").write_text(json.dumps(manifest))
    return run_dir


def test_cli_writes_csv_and_json_and_merges(tmp_path):
    staged = _staged_dir(tmp_path / "staged")
    run_dir = write_run(tmp_path / "run", _table())
    out = tmp_path / "results"
    runner = CliRunner()
    args = ["--rankings", str(run_dir / "rankings"), "--staged", str(staged), "--output", str(out),
            "--model", "toy-m", "--tag", "hardware=cpu"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "metrics.csv")
    assert list(df["direction"]) == ["t2i", "i2t"]
    t2i = df[df["direction"] == "t2i"].iloc[0]
    assert t2i["R@1"] == pytest.approx(50.0) and t2i["queries"] == 6 and t2i["collection_size"] == 3
    # the run's own mode and k (an EMB run used to be recorded as k=0 and, without --mode, as "ce")
    assert t2i["collection"] == "toy" and t2i["mode"] == "emb" and t2i["k"] == 3 and t2i["hardware"] == "cpu"
    i2t = df[df["direction"] == "i2t"].iloc[0]
    assert i2t["R@5"] == pytest.approx(200 / 3, abs=1e-3)
    payload = json.loads((out / "toy_toy-m_emb_k3.json").read_text())
    assert payload["task"] == "zeroshot_retrieval" and payload["dataset"] == "toy"
    assert payload["metrics"]["image_retrieval_recall@1"] == pytest.approx(0.5)
    assert payload["metrics"]["text_retrieval_recall@5"] == 0.6667  # rounded like CLIP_benchmark
    assert payload["mode"] == "emb" and payload["k"] == 3 and payload["lam"] is None

    # rerun with the same config replaces its rows; another label adds rows
    assert runner.invoke(main, args).exit_code == 0
    assert len(pd.read_csv(out / "metrics.csv")) == 2
    assert runner.invoke(main, args + ["--label", "EMB"]).exit_code == 0
    assert len(pd.read_csv(out / "metrics.csv")) == 4

    # CE modes on an EMB run, a deeper k, and a missing gold query are one-line errors
    res = runner.invoke(main, args + ["--mode", "co"])
    assert res.exit_code == 1 and "EMB run" in res.output
    res = runner.invoke(main, args + ["--k", "5"])
    assert res.exit_code == 1 and "k=5 is deeper than" in res.output
    write_run(run_dir, _table(t2i={q: v for q, v in T2I.items() if q != 2}))
    res = runner.invoke(main, args)
    assert res.exit_code == 1 and "query 2 is missing" in res.output


def test_evaluate_run_refuses_old_rankings_and_unlisted_or_changed_shards(tmp_path):
    from retrieval_core.evaluation.runs import evaluate_run

    staged = _staged_dir(tmp_path / "staged")
    with pytest.raises(ValueError, match="rankings path not found"):
        evaluate_run(str(tmp_path / "nowhere"), str(staged))
    run_dir = write_run(tmp_path / "old", _table(), schema_version="1")
    with pytest.raises(ValueError, match="rankings schema 1.*rerun pipelines.rerank"):
        evaluate_run(str(run_dir), str(staged))
    run_dir = write_run(tmp_path / "run", [t.drop_columns(["be_rank"]) for t in _table()])
    with pytest.raises(ValueError, match=r"missing \[.be_rank.\]\); rerun pipelines.rerank"):
        evaluate_run(str(run_dir), str(staged))
    run_dir = write_run(tmp_path / "changed", _table())
    pq.write_table(_table()[0].slice(0, 3), run_dir / "rankings" / "t2i-00000-of-00001.parquet")
    with pytest.raises(ValueError, match="changed since"):
        evaluate_run(str(run_dir), str(staged))


def _ce_tables(k=3, ce_shift=0.0):
    """A CO run of the toy gold: BE lists T2I / I2T, CE scores that put the last of the top k first (``ce_shift``
    added to the last one's: the same order, other scores)."""
    parts = []
    ce = np.arange(k, dtype=float) + np.eye(k)[k - 1] * ce_shift
    for direction, runs in ((schema.DIRECTION_T2I, T2I), (schema.DIRECTION_I2T, I2T)):
        results = [rank_query(np.array(items), np.linspace(1, 0, len(items)), ce, k=k, mode="ce")
                   for items in runs.values()]
        parts.append(rankings_table(direction, list(runs), results))
    return parts


def test_evaluate_run_derives_modes_k_and_lam_from_stored_scores(tmp_path):
    from retrieval_core.evaluation.runs import evaluate_run

    staged = _staged_dir(tmp_path / "staged")
    co = write_run(tmp_path / "co", _ce_tables(), mode="co", k=3)
    own = evaluate_run(str(co), str(staged))
    assert (own["mode"], own["k"], own["lam"]) == ("co", 3, None)
    # CE reverses each BE top-3: t2i first hits are at BE ranks 1,2,1,3,-,1 -> reversed 3,2,3,1,-,3
    assert own["t2i_R@1"] == pytest.approx(100 / 6)
    emb = evaluate_run(str(co), str(staged), mode="emb")  # the BE order, from the same stored rows
    assert emb["t2i_R@1"] == pytest.approx(50.0) and emb["i2t_R@1"] == pytest.approx(100 / 3)
    assert (emb["mode"], emb["k"]) == ("emb", 3)
    k1 = evaluate_run(str(co), str(staged), k=1)  # CO at k'=1 keeps the BE order
    assert k1["t2i_R@1"] == pytest.approx(50.0) and k1["k"] == 1
    add = evaluate_run(str(co), str(staged), mode="add")
    assert add["lam"] == 0.5 and add["mode"] == "add"
    heavy_be = evaluate_run(str(co), str(staged), mode="norm_add", lam=1.0)  # all BE weight: the BE order
    assert heavy_be["t2i_R@1"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="needs a --mode ce run"):
        evaluate_run(str(co), str(staged), mode="ce")
    with pytest.raises(ValueError, match="k=4 is deeper than"):
        evaluate_run(str(co), str(staged), k=4)
    with pytest.raises(ValueError, match="--lam applies to add / norm_add only"):
        evaluate_run(str(co), str(staged), lam=0.3)


def test_evaluate_run_of_restricted_queries_and_one_direction(tmp_path):
    from retrieval_core.evaluation.runs import evaluate_run

    staged = _staged_dir(tmp_path / "staged")
    t2i = {q: T2I[q] for q in (1, 2, 5)}  # R@1: 1 hit, 2 miss, 5 miss
    run = write_run(tmp_path / "sample", _table(t2i=t2i), queries_file={"path": "q.parquet", "sha256": "x",
                                                                        "counts": {"t2i": 3, "i2t": 3}})
    res = evaluate_run(str(run), str(staged))
    assert res["t2i_queries"] == 3 and res["t2i_R@1"] == pytest.approx(100 / 3) and res["i2t_queries"] == 3
    # without --queries every gold query must be ranked
    with pytest.raises(ValueError, match="missing from the rankings"):
        evaluate_run(str(write_run(tmp_path / "partial", _table(t2i=t2i))), str(staged))
    only_t2i = write_run(tmp_path / "t2i", _table()[:1])
    res = evaluate_run(str(only_t2i), str(staged))
    assert res["i2t_queries"] == 0 and np.isnan(res["i2t_R@1"])
    assert res["mR"] == pytest.approx(np.mean([50, 500 / 6, 500 / 6]))


def _clip_benchmark_build_rows(paths):
    """What ``clip_benchmark build`` does with result files (clip_benchmark/cli.py main_build, restated): the
    metrics flattened into the row, the top-level keys over them, a full name from model and pretrained, one
    CSV over the union of the fields."""
    import csv
    import io

    rows, fields = [], set()
    for path in paths:
        data = json.load(open(path))
        row = dict(data["metrics"])
        row.update(data)
        del row["metrics"]
        row["model_fullname"] = row["model"] + " " + row["pretrained"]
        fields.update(row)
        rows.append(row)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=sorted(fields))
    writer.writeheader()
    writer.writerows(rows)
    return list(csv.DictReader(io.StringIO(buf.getvalue())))


def test_json_is_read_by_clip_benchmark_build(tmp_path):
    staged = _staged_dir(tmp_path / "staged")
    run_dir = write_run(tmp_path / "run", _table())
    out = tmp_path / "results"
    res = CliRunner().invoke(main, ["--rankings", str(run_dir), "--staged", str(staged), "--output", str(out),
                                    "--model", "toy-m"])
    assert res.exit_code == 0, res.output
    (path,) = out.glob("*.json")
    payload = json.loads(path.read_text())
    assert {"dataset", "model", "pretrained", "task", "metrics", "language"} <= set(payload)
    # rounded like CLIP_benchmark's published numbers: 2/3 is 0.6667, not 0.6666666666666666
    assert payload["metrics"]["text_retrieval_recall@5"] == 0.6667
    assert all(len(repr(v).split(".")[-1]) <= 4 for v in payload["metrics"].values())
    (row,) = _clip_benchmark_build_rows([path])
    assert row["model_fullname"] == "toy-m emb_k3" and row["language"] == "en"
    assert row["task"] == "zeroshot_retrieval" and float(row["image_retrieval_recall@1"]) == 0.5


def test_clip_benchmark_json_refuses_extra_keys_that_clash():
    from benchmarks.evaluate import clip_benchmark_json

    result = {"t2i_queries": 1, "i2t_queries": 0, "t2i_R@1": 2.24, "mR": 2.24}
    out = clip_benchmark_json(result, collection="c", model="m", pretrained="p", ks=[1], extra={"k": 1})
    assert out["metrics"] == {"image_retrieval_recall@1": 0.0224, "mean_recall": 0.0224}
    with pytest.raises(ValueError, match="pretrained"):
        clip_benchmark_json(result, collection="c", model="m", pretrained="p", ks=[1], extra={"pretrained": "x"})


def test_cli_writes_intervals_and_the_paired_difference_to_another_mode(tmp_path):
    from retrieval_core.evaluation.metrics import DirectionHits
    from retrieval_core.evaluation.stats import Bootstrap, difference_intervals, recall_intervals

    staged = _staged_dir(tmp_path / "staged")
    co = write_run(tmp_path / "co", _ce_tables(), mode="co", k=3)
    out = tmp_path / "results"
    args = ["--rankings", str(co), "--staged", str(staged), "--output", str(out), "--model", "toy-m",
            "--bootstrap", "2000", "--seed", "5"]
    res = CliRunner().invoke(main, args + ["--against-mode", "emb"])
    assert res.exit_code == 0, res.output
    assert "minus emb (paired): t2i_R@1 -33.33 [" in res.output
    row = pd.read_csv(out / "metrics.csv").set_index("direction").loc["t2i"]
    # the same intervals from the per-query first gold ranks written out by hand (T2I / I2T above; CO reverses each
    # BE top 3): EMB t2i first ranks 0,1,0,2,-,0 -> CO 2,1,2,0,-,2; i2t EMB 1,0,- -> CO 1,2,-
    miss = np.iinfo(np.int64).max
    emb = {"t2i": DirectionHits("t2i", np.arange(1, 7), np.array([0, 1, 0, 2, miss, 0]), 3),
           "i2t": DirectionHits("i2t", np.array([100, 200, 300]), np.array([1, 0, miss]), 3)}
    mine = {"t2i": DirectionHits("t2i", np.arange(1, 7), np.array([2, 1, 2, 0, miss, 2]), 3),
            "i2t": DirectionHits("i2t", np.array([100, 200, 300]), np.array([1, 2, miss]), 3)}
    boot = Bootstrap(2000, 5)
    want, delta = recall_intervals(mine, boot), difference_intervals(mine, emb, boot)
    assert row["R@1"] == pytest.approx(100 / 6, abs=1e-3)
    assert (row["R@1_lo"], row["R@1_hi"]) == pytest.approx((want["t2i_R@1"].lo, want["t2i_R@1"].hi), abs=1e-4)
    assert (row["mR_lo"], row["mR_hi"]) == pytest.approx((want["mR"].lo, want["mR"].hi), abs=1e-4)
    assert row["against"] == "emb" and row["delta_R@1"] == pytest.approx(100 / 6 - 50, abs=1e-3)
    assert (row["delta_R@1_lo"], row["delta_R@1_hi"]) == pytest.approx(
        (delta["t2i_R@1"].lo, delta["t2i_R@1"].hi), abs=1e-4)
    assert row["delta_R@1_lo"] <= row["delta_R@1"] <= row["delta_R@1_hi"]
    assert "2000 bootstrap resamples" in row["bootstrap"] and "seed 5" in row["bootstrap"]
    payload = json.loads((out / "toy_toy-m_co_k3.json").read_text())
    assert payload["metrics"]["image_retrieval_recall@1"] == pytest.approx(0.1667)  # CLIP_benchmark keys as before
    assert payload["bootstrap"] == {"method": "percentile", "resampled": "queries", "resamples": 2000, "seed": 5,
                                    "level": 0.95}
    assert payload["intervals"]["t2i_R@1"] == [round(want["t2i_R@1"].lo, 4), round(want["t2i_R@1"].hi, 4)]
    diff = payload["difference"]
    assert diff["against"]["mode"] == "emb" and diff["t2i_R@1"]["estimate"] == pytest.approx(-33.3333, abs=1e-4)
    assert diff["mR"]["verdict"] == delta["mR"].verdict

    # the same seed gives the same intervals; without --against-mode there are intervals but no difference
    again = tmp_path / "again"
    assert CliRunner().invoke(main, args[:5] + [str(again)] + args[6:]).exit_code == 0
    plain = pd.read_csv(again / "metrics.csv").set_index("direction").loc["t2i"]
    assert (plain["R@1_lo"], plain["R@1_hi"]) == (row["R@1_lo"], row["R@1_hi"]) and "delta_R@1" not in plain


def test_a_difference_to_a_run_of_other_queries_is_refused_in_one_line(tmp_path):
    staged = _staged_dir(tmp_path / "staged")
    full = write_run(tmp_path / "full", _table())
    some = write_run(tmp_path / "some", _table(t2i={q: T2I[q] for q in (1, 2, 5)}),
                     queries_file={"path": "q.parquet", "sha256": "x", "counts": {"t2i": 3, "i2t": 3}})
    base = ["--rankings", str(full), "--staged", str(staged), "--output", str(tmp_path / "out")]
    res = CliRunner().invoke(main, base + ["--against", str(some)])
    assert res.exit_code == 1 and res.output.count("\n") == 1
    assert "t2i: the rankings rank different queries (6 and 3; 3 only in the first" in res.output
    res = CliRunner().invoke(main, base + ["--bootstrap", "10"])
    assert res.exit_code == 2 and "--bootstrap" in res.output


def test_against_another_run_also_compares_the_stored_scores_of_the_same_pairs(tmp_path):
    """Two runs of the same queries (one model served in two precisions): the paired recall difference, and how far
    their BE and CE scores of the same (query, item) pairs lie apart."""
    staged = _staged_dir(tmp_path / "staged")
    a = write_run(tmp_path / "a", _ce_tables(ce_shift=0.5), mode="co", k=3)
    b = write_run(tmp_path / "b", _ce_tables(), mode="co", k=3)
    out = tmp_path / "results"
    res = CliRunner().invoke(main, ["--rankings", str(a), "--staged", str(staged), "--output", str(out),
                                    "--model", "m", "--against", str(b), "--against-mode", "co",
                                    "--against-label", "m in float32, CO"])
    assert res.exit_code == 0, res.output
    assert "t2i scores against it, same (query, item) pairs: be_score max |diff| 0, mean 0 (18 pairs); ce_score " \
           "max |diff| 0.5, mean 0.167 (18 pairs)" in res.output
    rows = pd.read_csv(out / "metrics.csv").set_index("direction")
    assert rows.loc["t2i", "delta_R@1"] == 0 and rows.loc["i2t", "ce_pairs_compared"] == 9
    assert rows.loc["t2i", "ce_score_max_abs_diff"] == pytest.approx(0.5)
    assert rows.loc["t2i", "ce_score_mean_abs_diff"] == pytest.approx(0.5 / 3)
    assert rows.loc["t2i", "be_score_max_abs_diff"] == 0 and rows.loc["t2i", "be_pairs_compared"] == 18
    # the against column as named, and where it was measured: a published comparison needs both
    assert set(rows["against"]) == {"m in float32, CO"} and rows.loc["t2i", "device"] == "cpu"
    assert str(rows.loc["t2i", "commit"]) != "" and str(rows.loc["t2i", "torch"]).startswith("2.")
    payload = json.loads((out / "toy_m_co_k3.json").read_text())
    assert payload["score_differences"]["i2t"]["ce_score_max_abs"] == pytest.approx(0.5)
    # a difference to another mode of the same run compares no scores
    same = CliRunner().invoke(main, ["--rankings", str(a), "--staged", str(staged), "--output", str(tmp_path / "o2"),
                                     "--against-mode", "emb"])
    assert same.exit_code == 0 and "scores against it" not in same.output


def test_a_lead_counts_only_beyond_noise():
    """AUTO's rule for pure CO (runs.lead_beyond_noise): a lead of a query or two is noise, a large lead in one
    direction with none lost in the other is not, and a large lead bought with a loss in the other is refused."""
    from retrieval_core.evaluation.metrics import DirectionHits
    from retrieval_core.evaluation.runs import lead_beyond_noise

    n, miss = 400, np.iinfo(np.int64).max

    def hits(t2i_hits: int, i2t_hits: int) -> dict:
        return {d: DirectionHits(d, np.arange(n), np.where(np.arange(n) < h, 0, miss), 10)
                for d, h in (("t2i", t2i_hits), ("i2t", i2t_hits))}

    base = hits(200, 200)
    beyond, lead = lead_beyond_noise(hits(201, 200), base)
    assert not beyond and lead["t2i_R@1"][0] == pytest.approx(0.25) and lead["t2i_R@1"][1] <= 0 < lead["t2i_R@1"][2]
    beyond, lead = lead_beyond_noise(hits(240, 200), base)
    assert beyond and lead["t2i_R@1"][1] > 0 and lead["i2t_R@1"] == [0.0, 0.0, 0.0]
    beyond, lead = lead_beyond_noise(hits(240, 199), base)
    assert not beyond and lead["i2t_R@1"][0] < 0

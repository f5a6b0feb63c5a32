import json
from types import MappingProxyType

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from benchmarks.evaluate import evaluate_rankings, main
from retrieval_core import schema, staging
from retrieval_core.rerank import rank_query, rankings_table

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
    (root / "captions" / "toy-00000-of-00001.parquet").write_bytes(staging.caption_shard_parquet(rows))
    summary = {"complete": True, "feature_dim": 8, "collections": {"toy": {
        "images": {"shards": []},
        "captions": {"shards": [{"name": "captions/toy-00000-of-00001.parquet", "rows": len(rows)}]}}}}
    (root / "summary.json").write_text(json.dumps(summary))
    return root


def test_cli_writes_csv_and_json_and_merges(tmp_path):
    staged = _staged_dir(tmp_path / "staged")
    rank_dir = tmp_path / "rankings"
    rank_dir.mkdir()
    for i, t in enumerate(_table()):
        pq.write_table(t, rank_dir / f"part-{i}.parquet")
    out = tmp_path / "results"
    runner = CliRunner()
    args = ["--rankings", str(rank_dir), "--staged", str(staged), "--output", str(out), "--model", "toy-m",
            "--mode", "emb", "--tag", "hardware=cpu"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "metrics.csv")
    assert list(df["direction"]) == ["t2i", "i2t"]
    t2i = df[df["direction"] == "t2i"].iloc[0]
    assert t2i["R@1"] == pytest.approx(50.0) and t2i["queries"] == 6 and t2i["collection_size"] == 3
    assert t2i["collection"] == "toy" and t2i["k"] == 0 and t2i["hardware"] == "cpu"
    i2t = df[df["direction"] == "i2t"].iloc[0]
    assert i2t["R@5"] == pytest.approx(200 / 3, abs=1e-3)
    payload = json.loads((out / "toy_toy-m_emb_k0.json").read_text())
    assert payload["task"] == "zeroshot_retrieval" and payload["dataset"] == "toy"
    assert payload["metrics"]["image_retrieval_recall@1"] == pytest.approx(0.5)
    assert payload["metrics"]["text_retrieval_recall@5"] == pytest.approx(2 / 3)

    # rerun with the same config replaces its rows; a new mode adds rows
    assert runner.invoke(main, args).exit_code == 0
    assert len(pd.read_csv(out / "metrics.csv")) == 2
    assert runner.invoke(main, args[:-4] + ["--mode", "ce", "--tag", "hardware=cpu"]).exit_code == 0
    assert len(pd.read_csv(out / "metrics.csv")) == 4

    # a rankings run missing a gold query fails loudly
    pq.write_table(_table(t2i={q: v for q, v in T2I.items() if q != 2})[0], rank_dir / "part-0.parquet")
    res = runner.invoke(main, args)
    assert res.exit_code != 0 and "query 2 is missing" in res.output

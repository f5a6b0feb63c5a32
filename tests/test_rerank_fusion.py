import numpy as np
import pyarrow as pa
import pytest

from retrieval_core import schema
from retrieval_core.rerank import fuse, rank_query, rankings_table


def test_fuse_modes_hand_values():
    e = np.array([0.9, 0.5, 0.1])
    c = np.array([0.0, 2.0, -2.0])
    np.testing.assert_allclose(fuse(e, c, "emb"), e)
    np.testing.assert_allclose(fuse(e, c, "ce"), c)
    sig = 1 / (1 + np.exp(-c))
    np.testing.assert_allclose(fuse(e, c, "add", lam=0.3), 0.3 * e + 0.7 * sig)
    # minmax(e) = [1, .5, 0], minmax(c) = [.5, 1, 0]
    np.testing.assert_allclose(fuse(e, c, "norm_add", lam=0.5), [0.75, 0.75, 0.0])
    # constant vectors normalise to zeros, never NaN
    out = fuse(np.ones(4), np.full(4, 3.0), "norm_add")
    assert np.all(out == 0) and not np.any(np.isnan(out))
    # extreme logits do not overflow
    assert np.all(np.isfinite(fuse(np.zeros(2), np.array([1e4, -1e4]), "add")))
    with pytest.raises(ValueError, match="mode"):
        fuse(e, c, "bogus")
    with pytest.raises(ValueError, match="CE"):
        fuse(e, None, "ce")


def test_rank_query_ce_reorders_top_k_and_tail_keeps_be_order():
    # BE order: ids 10..16; a CE that prefers larger ids reverses the top 4.
    ids = np.arange(10, 17, dtype=np.int64)
    be = np.linspace(1.0, 0.4, 7)
    ce = ids[:4].astype(float)  # known rule: score = id
    res = rank_query(ids, be, ce, k=4, mode="ce", keep=7)
    assert res["item_id"].tolist() == [13, 12, 11, 10, 14, 15, 16]
    assert res["rank"].tolist() == list(range(1, 8))
    np.testing.assert_allclose(res["ce_score"][:4], [13, 12, 11, 10])
    assert np.all(np.isnan(res["ce_score"][4:]))
    np.testing.assert_allclose(res["be_score"], be[[3, 2, 1, 0, 4, 5, 6]], rtol=1e-6)
    # final_score sorts exactly like rank: tail strictly below the reranked block
    assert np.all(np.diff(res["final_score"]) < 0)
    # default keep = max(k, 10) truncated by n
    assert len(rank_query(ids, be, ce, k=4, mode="ce")["item_id"]) == 7


def test_rank_query_ties_broken_by_be_rank_and_emb_mode():
    ids = np.array([5, 3, 9, 1], dtype=np.int64)
    be = np.array([0.9, 0.8, 0.7, 0.6])
    res = rank_query(ids, be, np.array([1.0, 2.0, 2.0]), k=3, mode="ce")
    assert res["item_id"].tolist() == [3, 9, 5, 1]
    emb = rank_query(ids, be, None, k=3, mode="emb")
    assert emb["item_id"].tolist() == [5, 3, 9, 1]
    assert np.all(np.isnan(emb["ce_score"]))


def test_rank_query_k_larger_than_candidates_and_errors():
    ids = np.array([1, 2], dtype=np.int64)
    res = rank_query(ids, np.array([0.5, 0.4]), np.array([0.0, 1.0]), k=20, mode="add")
    assert res["item_id"].tolist() == [2, 1]
    with pytest.raises(ValueError, match="BE order"):
        rank_query(ids, np.array([0.1, 0.9]), np.array([0.0, 1.0]), k=2, mode="ce")
    with pytest.raises(ValueError, match="CE scores"):
        rank_query(ids, np.array([0.5, 0.4]), np.array([0.0]), k=2, mode="ce")
    with pytest.raises(ValueError, match="duplicate"):
        rank_query(np.array([1, 1]), np.array([0.5, 0.4]), np.array([0.0, 1.0]), k=2, mode="ce")


def test_rankings_table_schema_and_nulls():
    r1 = rank_query(np.array([1, 2, 3]), np.array([0.3, 0.2, 0.1]), np.array([0.0, 1.0]), k=2, mode="ce")
    r2 = rank_query(np.array([4, 5]), np.array([0.3, 0.2]), np.array([1.0, 0.0]), k=2, mode="ce")
    t = rankings_table(schema.DIRECTION_T2I, [100, 200], [r1, r2])
    assert t.schema.equals(schema.RANKING_SCHEMA)
    assert t.column("query_id").to_pylist() == [100, 100, 100, 200, 200]
    assert t.column("item_id").to_pylist() == [2, 1, 3, 4, 5]
    assert t.column("ce_score").null_count == 1
    with pytest.raises(ValueError, match="direction"):
        rankings_table("x2y", [100], [r1])

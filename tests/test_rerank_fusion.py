import numpy as np
import pyarrow as pa
import pytest

from retrieval_core.data import schema
from retrieval_core.search.rerank import fuse, rank_query, rankings_table


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


def test_query_pairs_orient_pairs_by_direction_and_requests_are_deduplicated():
    from retrieval_core.search.rerank import merge_requesters, pair_requests, query_pairs

    assert query_pairs("t2i", 7, np.array([100, 200, 300]), k=2) == [(7, 100), (7, 200)]
    assert query_pairs("i2t", 100, [7, 8], k=5) == [(7, 100), (8, 100)]
    with pytest.raises(ValueError, match="direction"):
        query_pairs("x", 1, [2], 1)
    assert merge_requesters([("t2i", 7), ("i2t", 100), ("t2i", 7)]) == (("i2t", 100), ("t2i", 7))
    # caption 7's top-2 holds image 100 and image 100's top-2 holds caption 7: one pair, two requesters
    asked = pair_requests([(("t2i", 7), [100, 200]), (("i2t", 100), [7, 8])], k=2)
    assert asked == {(7, 100): (("i2t", 100), ("t2i", 7)), (7, 200): (("t2i", 7),), (8, 100): (("i2t", 100),)}


def test_ce_scores_of_reads_the_top_k_and_refuses_a_gap():
    from retrieval_core.search.rerank import ce_scores_of

    np.testing.assert_array_equal(ce_scores_of([5, 6, 7], 2, {5: 0.5, 6: -1.0, 9: 3.0}), [0.5, -1.0])
    with pytest.raises(ValueError, match="q1: no CE score for candidate\\(s\\) \\[6\\]"):
        ce_scores_of([5, 6], 2, {5: 0.5}, "q1")


def _stored_run(k, mode="ce", seed=0):
    """A rankings table as pipelines.rerank stores it: per query its BE top-n (n = max(k, 10)) in final order,
    with the CE scores of the top k."""
    rng = np.random.default_rng(seed)
    n = max(k, 10)
    parts = []
    for direction in (schema.DIRECTION_T2I, schema.DIRECTION_I2T):
        qids, results = [], []
        for q in range(5):
            ids = rng.permutation(1000)[:n].astype(np.int64)
            be = np.sort(rng.normal(size=n).astype(np.float32))[::-1]
            ce = rng.normal(size=n).astype(np.float32)  # the pipeline's CE scores are float32
            results.append(rank_query(ids, be, None if mode == "emb" else ce[:k], k, mode, keep=n))
            qids.append(q)
        parts.append(rankings_table(direction, qids, results))
    return pa.concat_tables(parts), parts


def test_derive_rankings_reproduces_the_stored_run_and_a_smaller_k():
    from retrieval_core.search.rerank import derive_rankings

    table, _ = _stored_run(k=12)
    assert derive_rankings(table, 12, "ce").equals(table)  # the run's own mode: the stored ranking
    # CO at k=4 from the stored run equals a fresh k=4 ranking of the same BE list and CE scores
    derived = derive_rankings(table, 4, "ce").to_pandas()
    for (d, q), rows in table.to_pandas().groupby(["direction", "query_id"]):
        be_order = rows.sort_values("be_rank")
        fresh = rank_query(be_order["item_id"].to_numpy(), be_order["be_score"].to_numpy(),
                           be_order["ce_score"].to_numpy()[:4], 4, "ce")
        got = derived[(derived["direction"] == d) & (derived["query_id"] == q)]
        assert got["item_id"].tolist() == fresh["item_id"].tolist()
        assert got["be_rank"].tolist() == fresh["be_rank"].tolist()
        assert got["ce_score"].iloc[4:].isna().all()  # CE scores below k' are not part of a k'=4 run
    emb = derive_rankings(table, 4, "emb").to_pandas()
    assert (emb.groupby(["direction", "query_id"])["be_rank"].apply(list) == [list(range(1, 11))] * 10).all()
    add = derive_rankings(table, 12, "add", lam=0.3).to_pandas()
    top = add[add["rank"] <= 12]
    np.testing.assert_allclose(top["final_score"], 0.3 * top["be_score"].astype(float)
                               + 0.7 / (1 + np.exp(-top["ce_score"].astype(float))), rtol=1e-6)


def test_derive_rankings_refuses_missing_ce_scores():
    from retrieval_core.search.rerank import derive_rankings

    table, _ = _stored_run(k=4)
    with pytest.raises(ValueError, match="no stored CE score at BE rank 5"):
        derive_rankings(table, 6, "ce")
    emb_table, _ = _stored_run(k=4, mode="emb")
    with pytest.raises(ValueError, match="BE rank 1"):
        derive_rankings(emb_table, 4, "norm_add")
    with pytest.raises(ValueError, match="be_rank"):
        derive_rankings(table.drop_columns(["be_rank"]), 4, "ce")

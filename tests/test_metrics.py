from types import MappingProxyType

import numpy as np
import pytest

from retrieval_core.evaluation.metrics import bidirectional_recall, recall_at_k
from retrieval_core.search import exact
from retrieval_core.search.exact import exact_topk, exact_topk_shards


def _brute_topk(queries, items, ids, k):
    scores = queries.astype(np.float32) @ items.astype(np.float32).T
    out_s, out_i = [], []
    for row in scores:
        order = np.lexsort((ids, -row))[:k]  # score desc, then id asc
        out_s.append(row[order])
        out_i.append(ids[order])
    return np.array(out_s, dtype=np.float32), np.array(out_i, dtype=np.int64)


def test_exact_topk_matches_brute_force():
    rng = np.random.default_rng(0)
    q, x = rng.normal(size=(37, 8)), rng.normal(size=(200, 8))
    ids = rng.permutation(10_000)[:200].astype(np.int64)
    s, i = exact_topk(q, x, ids, 10, batch_size=16)
    bs, bi = _brute_topk(q, x, ids, 10)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_allclose(s, bs, rtol=1e-6)
    assert s.dtype == np.float32 and i.dtype == np.int64
    assert np.all(np.diff(s, axis=1) <= 0)


def test_exact_topk_ties_broken_by_smaller_id_and_order_independent():
    # Quantised vectors make many exact ties, including at the k-th position.
    rng = np.random.default_rng(1)
    q = rng.integers(-1, 2, size=(50, 4)).astype(np.float32)
    x = rng.integers(-1, 2, size=(60, 4)).astype(np.float32)
    ids = rng.permutation(1000)[:60].astype(np.int64)
    s, i = exact_topk(q, x, ids, 7)
    bs, bi = _brute_topk(q, x, ids, 7)
    np.testing.assert_array_equal(i, bi)
    perm = rng.permutation(60)
    s2, i2 = exact_topk(q, x[perm], ids[perm], 7)
    np.testing.assert_array_equal(i, i2)
    np.testing.assert_array_equal(s, s2)


def test_exact_topk_shards_equals_exact_topk_over_all_items_ties_included():
    """Shard by shard (what rerank's exact search does, one embedding shard in memory): the same ids in the
    same order as one exact_topk over every item, ties by smaller id across shards too."""
    rng = np.random.default_rng(3)
    q = rng.integers(-1, 2, size=(40, 4)).astype(np.float32)  # quantised: many ties, across shards
    x = rng.integers(-1, 2, size=(90, 4)).astype(np.float32)
    ids = rng.permutation(5000)[:90].astype(np.int64)
    s, i = exact_topk(q, x, ids, 8)
    parts = [(ids[a:b], x[a:b]) for a, b in ((0, 5), (5, 50), (50, 50), (50, 90))]  # one shard empty
    (s2, i2), (s4, i4) = exact_topk_shards([q, q[:7]], iter(parts), 8)  # two batches, one pass
    np.testing.assert_array_equal(i2, i)
    np.testing.assert_array_equal(s2, s)
    np.testing.assert_array_equal(i4, i[:7])
    [(s3, i3)] = exact_topk_shards([q], [(ids[:3], x[:3])], 8)  # fewer items than k
    assert i3.shape == (40, 3)
    [(s5, i5)] = exact_topk_shards([q], [], 8)  # no items at all
    assert i5.shape == (40, 0)


def test_exact_topk_k_larger_than_collection():
    x = np.eye(3, dtype=np.float32)
    s, i = exact_topk(np.array([[0.0, 1.0, 0.5]]), x, np.array([30, 10, 20]), k=10)
    assert i.tolist() == [[10, 20, 30]]
    assert s.tolist() == [[1.0, 0.5, 0.0]]
    with pytest.raises(ValueError):
        exact_topk(x, x, np.array([1, 2, 3]), k=0)
    with pytest.raises(ValueError, match="dimension"):
        exact_topk(np.ones((1, 2)), x, np.array([1, 2, 3]), k=1)


def test_recall_at_k_hand_case():
    ranked = np.array([[5, 1, 2], [3, 4, 9], [7, 8, 6]])
    gold = [{1}, {9, 4}, {0}]
    # q0: first hit at pos 1; q1: pos 1 (4 is gold, any-of); q2: never.
    r = recall_at_k(ranked, gold, ks=(1, 2, 3, 10))
    assert r == {1: 0.0, 2: pytest.approx(200 / 3), 3: pytest.approx(200 / 3), 10: pytest.approx(200 / 3)}
    # ragged lists: a shorter list has fewer chances
    assert recall_at_k([[1], [2, 3]], [{3}, {3}], ks=(1, 2)) == {1: 0.0, 2: 50.0}
    with pytest.raises(ValueError, match="at least one"):
        recall_at_k(np.zeros((0, 3), dtype=np.int64), [])
    with pytest.raises(ValueError, match="no gold"):
        recall_at_k([[1]], [set()])


def test_bidirectional_recall_hand_case_and_no_mutation():
    # images 100, 200; captions 1,2 -> 100 and 3,4,5 -> 200
    c2i = MappingProxyType({1: 100, 2: 100, 3: 200, 4: 200, 5: 200})
    i2c = MappingProxyType({100: frozenset({1, 2}), 200: frozenset({3, 4, 5})})
    t2i_q = np.array([1, 2, 3, 4, 5])
    t2i_r = np.array([[100, 200], [200, 100], [200, 100], [100, 200], [200, 100]])
    i2t_q = np.array([100, 200])
    i2t_r = np.array([[3, 4, 2], [1, 2, 5]])  # 100: hit at rank 3; 200: hit at rank 3 (5 is one of 3,4,5)
    before = (t2i_r.copy(), i2t_r.copy())
    res = bidirectional_recall(t2i_r, t2i_q, i2t_r, i2t_q, c2i, i2c, ks=(1, 2, 3))
    assert res["t2i_R@1"] == pytest.approx(60.0)
    assert res["t2i_R@2"] == 100.0 and res["t2i_R@3"] == 100.0
    assert res["i2t_R@1"] == 0.0 and res["i2t_R@2"] == 0.0 and res["i2t_R@3"] == 100.0
    assert res["mR"] == pytest.approx((60 + 100 + 100 + 0 + 0 + 100) / 6)
    assert res["t2i_queries"] == 5 and res["i2t_queries"] == 2
    np.testing.assert_array_equal(t2i_r, before[0])
    np.testing.assert_array_equal(i2t_r, before[1])
    default = bidirectional_recall(t2i_r, t2i_q, i2t_r, i2t_q, c2i, i2c)
    assert set(default) == {"t2i_R@1", "t2i_R@5", "t2i_R@10", "i2t_R@1", "i2t_R@5", "i2t_R@10", "mR",
                            "t2i_queries", "i2t_queries"}


def test_bidirectional_recall_errors_name_the_query():
    c2i = {1: 100}
    i2c = {100: frozenset({1}), 300: frozenset()}
    with pytest.raises(ValueError, match="caption\\) 99"):
        bidirectional_recall([[100]], [99], [[1]], [100], c2i, i2c)
    with pytest.raises(ValueError, match="image\\) 300"):
        bidirectional_recall([[100]], [1], [[1]], [300], c2i, i2c)
    with pytest.raises(ValueError, match="more than once"):
        bidirectional_recall([[100], [100]], [1, 1], [[1]], [100], c2i, i2c)


@pytest.mark.parametrize("n_q", [1, 3, 45])  # the small-batch scan (< SMALL_BATCH queries) and the GEMM path
def test_exact_topk_chunked_kernels_keep_ties_exact(monkeypatch, n_q):
    # Chunks of a few items: ties at the k-th score straddle chunks, so a chunk's top-k leaves tied items out.
    monkeypatch.setattr(exact, "SCAN_CHUNK_SCORES", 36)
    monkeypatch.setattr(exact, "GEMM_CHUNK_ROWS", 11)
    rng = np.random.default_rng(2)
    q = rng.integers(-1, 2, size=(n_q, 4)).astype(np.float32)
    x = rng.integers(-1, 2, size=(101, 4)).astype(np.float32)
    ids = rng.permutation(5000)[:101].astype(np.int64)
    s, i = exact_topk(q, x, ids, 7, batch_size=20)
    bs, bi = _brute_topk(q, x, ids, 7)
    np.testing.assert_array_equal(i, bi)
    np.testing.assert_array_equal(s, bs)
    # float data, many chunks: the same as one brute-force pass
    q, x = rng.normal(size=(n_q, 16)).astype(np.float32), rng.normal(size=(300, 16)).astype(np.float32)
    s, i = exact_topk(q, x, np.arange(300), 10)
    np.testing.assert_array_equal(i, _brute_topk(q, x, np.arange(300), 10)[1])


import faiss
import numpy as np
import pytest

from retrieval_core.search import embeddings
from retrieval_core.search.exact import exact_topk
from retrieval_core.search.index import (
    IndexIntegrityError,
    ShardedIndex,
    build_shard,
    index_bytes,
    needs_training,
    read_id_list,
    train_index,
    training_sample,
)
from retrieval_core.search.index_folder import (
    INDEX_MANIFEST,
    StreamedIndex,
    load_sharded_index,
    make_index_manifest,
    shard_file_name,
)

D = 16


def _data(n=1200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = rng.choice(2**40, size=n, replace=False).astype(np.int64)
    return ids, x


def _shards(factory, ids, x, parts=3, sample_n=800):
    sample = training_sample(ids, x, sample_n, seed=0) if needs_training(factory, D) else None
    trained = train_index(factory, D, "ip", sample)
    return [build_shard(trained, ids[i::parts], x[i::parts]) for i in range(parts)]


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW16", "IVF8,PQ4x4"])
def test_sharded_ids_and_ntotal(factory):
    ids, x = _data()
    sharded = ShardedIndex(_shards(factory, ids, x))
    assert sharded.ntotal == len(ids)
    np.testing.assert_array_equal(sharded.all_ids(), np.sort(ids))
    assert sharded.id_set() == frozenset(ids.tolist())
    # every returned id is a real global id, never a shard-local position
    if "IVF" in factory:
        sharded.set_params(nprobe=8)
    if "HNSW" in factory:
        sharded.set_params(efSearch=64)
    _, found = sharded.search(x[:20], 5)
    assert set(found.ravel().tolist()) <= set(ids.tolist())
    if "PQ" not in factory:  # exhaustive enough to find each vector itself
        np.testing.assert_array_equal(found[:, 0], ids[:20])


def test_flat_sharded_search_equals_exact_topk():
    ids, x = _data(seed=1)
    q = np.random.default_rng(2).normal(size=(30, D)).astype(np.float32)
    scores, found = ShardedIndex(_shards("Flat", ids, x, parts=4)).search(q, 10)
    es, ei = exact_topk(q, x, ids, 10)
    np.testing.assert_array_equal(found, ei)
    np.testing.assert_allclose(scores, es, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_search_scores_are_higher_is_better_for_every_metric(metric):
    ids, x = _data(n=300, seed=4)
    trained = train_index("Flat", D, metric, None)
    sharded = ShardedIndex([build_shard(trained, ids[i::3], x[i::3]) for i in range(3)])
    q = np.random.default_rng(5).normal(size=(8, D)).astype(np.float32)
    raw, raw_ids = sharded.search(q, 10)
    scores, found = sharded.search_scores(q, 10)
    np.testing.assert_array_equal(found, raw_ids)
    np.testing.assert_array_equal(scores, raw if metric == "ip" else -raw)
    assert np.all(np.diff(scores, axis=1) <= 0)  # best (largest) first


def test_index_shards_successive_ids_regression():
    """IndexShards' default successive_ids=True rewrites global ids; ShardedIndex must not."""
    ids, x = _data(n=300, seed=3)
    shards = _shards("Flat", ids, x, parts=3)
    good = faiss.IndexShards(D, False, False)
    bad = faiss.IndexShards(D, False)  # successive_ids=True default
    for s in shards:
        good.add_shard(s)
        bad.add_shard(s)
    _, ours = ShardedIndex(shards).search(x[:10], 3)
    _, g = good.search(x[:10], 3)
    _, b = bad.search(x[:10], 3)
    np.testing.assert_array_equal(ours, g)
    assert not np.array_equal(ours, b)  # the trap is real: offsets are added to global ids


def test_training_sample_is_order_independent_and_warns():
    ids, x = _data(n=500)
    perm = np.random.default_rng(0).permutation(500)
    a = training_sample(ids, x, 100, seed=5)
    b = training_sample(ids[perm], x[perm], 100, seed=5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, training_sample(ids, x, 100, seed=6))
    with pytest.warns(RuntimeWarning, match="fewer than 39"):
        train_index("IVF8,Flat", D, "ip", a)
    with pytest.raises(ValueError, match="needs training"):
        train_index("IVF8,Flat", D, "ip", None)
    assert not needs_training("Flat") and not needs_training("HNSW32") and needs_training("IVF16,Flat")


def test_build_shard_rejects_duplicates_and_bad_shapes():
    ids, x = _data(n=10)
    trained = train_index("Flat", D, "ip", None)
    with pytest.raises(ValueError, match="duplicate"):
        build_shard(trained, np.array([1] * 10), x)
    with pytest.raises(ValueError):
        build_shard(trained, ids, x[:, :8])


def _index_dir(tmp_path, ids, x, factory="Flat", parts=2):
    emb_dir, index_dir = tmp_path / "emb", tmp_path / "index"
    (emb_dir / "embeddings" / "image").mkdir(parents=True)
    (index_dir / "shards").mkdir(parents=True)
    emb_entries, idx_entries = [], []
    sample = training_sample(ids, x, len(ids), seed=0) if needs_training(factory, D) else None
    trained = train_index(factory, D, "ip", sample)
    for i in range(parts):
        name = f"toy-{i:05d}-of-{parts:05d}.parquet"
        data = embeddings.embedding_shard_bytes(ids[i::parts], x[i::parts])
        (emb_dir / "embeddings" / "image" / name).write_bytes(data)
        emb_entries.append(embeddings.shard_info(name, data, len(ids[i::parts])))
        shard_bytes = index_bytes(build_shard(trained, ids[i::parts], x[i::parts]))
        (index_dir / "shards" / shard_file_name(name)).write_bytes(shard_bytes)
        idx_entries.append(dict(embeddings.shard_info(shard_file_name(name), shard_bytes, len(ids[i::parts])),
                                source=name, source_sha256=emb_entries[-1]["sha256"]))
    import hashlib
    import json
    m = embeddings.make_embeddings_manifest("model", "0" * 64, D, {"image": emb_entries}, "test")
    mb = json.dumps(m).encode()
    (emb_dir / embeddings.EMBEDDINGS_MANIFEST).write_bytes(mb)
    im = make_index_manifest(factory, D, "ip", "image", idx_entries,
                             {"dir": str(emb_dir), "manifest_sha256": hashlib.sha256(mb).hexdigest(),
                              "count": len(ids)}, {"sha256": "", "train_sample": 0, "seed": 0}, "test")
    (index_dir / INDEX_MANIFEST).write_text(json.dumps(im))
    return emb_dir, index_dir


def test_load_sharded_index_verifies(tmp_path):
    ids, x = _data(n=200)
    emb_dir, index_dir = _index_dir(tmp_path, ids, x)
    loaded = load_sharded_index(str(index_dir))
    assert loaded.ntotal == 200
    np.testing.assert_array_equal(loaded.all_ids(), np.sort(ids))
    # embeddings read back intact through the manifest
    rids, rx = embeddings.read_embeddings(str(emb_dir), "image")
    assert sorted(rids.tolist()) == sorted(ids.tolist()) and rx.shape == (200, D)

    shard = index_dir / "shards" / "toy-00001-of-00002.faiss"
    good = shard.read_bytes()
    shard.write_bytes(good[:-8] + b"\0" * 8)
    with pytest.raises(IndexIntegrityError, match="sha256"):
        load_sharded_index(str(index_dir))
    shard.write_bytes(good)

    emb_shard = emb_dir / "embeddings" / "image" / "toy-00000-of-00002.parquet"
    emb_shard.write_bytes(emb_shard.read_bytes() + b"x")
    with pytest.raises(embeddings.EmbeddingsError, match="sha256"):
        embeddings.read_embeddings(str(emb_dir), "image")


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_streamed_index_gives_the_loaded_index_results_holding_one_shard(tmp_path, factory):
    """StreamedIndex (what rerank workers search) returns ShardedIndex's exact bits, per query batch, while
    reading one shard at a time; it runs the same checks when opened and re-verifies shards per search.
    Four shards, each vector twice in two of them (ties across shards), k above a shard's size (-1 padding):
    the shard-by-shard merge keeps the one-merge order."""
    ids, x = _data(n=200)
    x = np.concatenate([x[:50]] * 4)
    _, index_dir = _index_dir(tmp_path, ids, x, factory=factory, parts=4)
    loaded, streamed = load_sharded_index(str(index_dir)), StreamedIndex(str(index_dir))
    assert streamed.ntotal == loaded.ntotal == 200 and streamed.keep_max
    if "IVF" in factory:
        loaded.set_params(nprobe=3)
        streamed.set_params(nprobe=3)
    batches = [x[:7], x[7:40] + 0.1, x[40:41]]
    for k in (12, 60):
        got = streamed.search_scores_batches(batches, k)
        for q, (scores, found) in zip(batches, got):
            want_s, want_i = loaded.search_scores(q, k)
            np.testing.assert_array_equal(found, want_i)
            np.testing.assert_array_equal(scores, want_s)

    shard = index_dir / "shards" / "toy-00001-of-00004.faiss"
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(IndexIntegrityError, match="sha256"):
        streamed.search_batches(batches, 3)  # changed after opening: caught on the next read
    with pytest.raises(IndexIntegrityError, match="sha256"):
        StreamedIndex(str(index_dir))


def test_load_sharded_index_detects_id_mismatch(tmp_path):
    ids, x = _data(n=100)
    emb_dir, index_dir = _index_dir(tmp_path, ids, x)
    # rewrite one embedding shard with different ids but keep the manifest consistent -> index ids differ
    import json
    name = "toy-00000-of-00002.parquet"
    data = embeddings.embedding_shard_bytes(ids[0::2] + 1, x[0::2])
    (emb_dir / "embeddings" / "image" / name).write_bytes(data)
    with pytest.raises(IndexIntegrityError, match="ids differ"):
        load_sharded_index(str(index_dir))
    m = json.loads((emb_dir / embeddings.EMBEDDINGS_MANIFEST).read_text())
    m["dim"] = 3
    (emb_dir / embeddings.EMBEDDINGS_MANIFEST).write_text(json.dumps(m))
    with pytest.raises(IndexIntegrityError, match="changed"):
        load_sharded_index(str(index_dir))


def test_read_id_list_refuses_what_is_not_a_clean_int64_id_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(name, table):
        pq.write_table(table, str(tmp_path / name))
        return str(tmp_path / name)

    good = write("good.parquet", pa.table({"item_id": pa.array([5, 1, 3], pa.int64())}))
    np.testing.assert_array_equal(read_id_list(good), [1, 3, 5])
    with pytest.raises(ValueError, match="must be int64, got int32"):
        read_id_list(write("i32.parquet", pa.table({"item_id": pa.array([1], pa.int32())})))
    with pytest.raises(ValueError, match="1 null item_id"):
        read_id_list(write("null.parquet", pa.table({"item_id": pa.array([1, None], pa.int64())})))
    with pytest.raises(ValueError, match="cannot read an int64 'item_id' column"):
        read_id_list(write("other.parquet", pa.table({"id": pa.array([1], pa.int64())})))
    with pytest.raises(ValueError, match="listed more than once"):
        read_id_list(write("dup.parquet", pa.table({"item_id": pa.array([2, 2], pa.int64())})))


def test_search_batch_benchmark_writes_one_documented_row_per_size(tmp_path):
    """benchmarks.meters.search_batch (the evidence for rerank's --search-batch-size): a row per queries-per-call size,
    the timed search's FLOP rate consistent with its time, and the CSV's columns documented beside it."""
    import pandas as pd
    from click.testing import CliRunner

    from benchmarks.meters import search_batch

    out = tmp_path / "search_batch.csv"
    res = CliRunner().invoke(search_batch.main, ["--shard-size", "2000", "--queries-per-call", "8,64",
                                                 "--repeats", "1", "--threads", "1", "--output", str(out)])
    assert res.exit_code == 0, res.output
    rows = pd.read_csv(out)
    assert rows["queries_per_call"].tolist() == [8, 64] and (rows["shard_size"] == 2000).all()
    flops = 2.0 * rows["queries_per_call"] * 2000 * 384
    np.testing.assert_allclose(rows["search_gflops"], flops / (rows["search_ms"] / 1e3) / 1e9, rtol=0.05, atol=0.2)
    assert (tmp_path / "search_batch.schema.json").exists()
    bad = CliRunner().invoke(search_batch.main, ["--queries-per-call", "8,x"])
    assert bad.exit_code == 2 and "--queries-per-call" in bad.output


def test_a_few_queries_search_the_shards_side_by_side_with_the_same_results(monkeypatch):
    # below SMALL_BATCH queries the shards are searched in threads; the merge is the sequential one's
    import faiss

    from retrieval_core.search import index as index_module

    rng = np.random.default_rng(0)
    shards = []
    for s in range(4):
        shard = faiss.IndexIDMap2(faiss.IndexFlatIP(16))
        shard.add_with_ids(rng.standard_normal((500, 16)).astype("float32"), np.arange(s * 500, (s + 1) * 500))
        shards.append(shard)
    sharded = index_module.ShardedIndex(shards)
    queries = rng.standard_normal((3, 16)).astype("float32")
    side_by_side = sharded.search(queries, 10)
    monkeypatch.setattr(index_module, "SMALL_BATCH", 0)
    one_by_one = sharded.search(queries, 10)
    for a, b in zip(side_by_side, one_by_one):
        np.testing.assert_array_equal(a, b)

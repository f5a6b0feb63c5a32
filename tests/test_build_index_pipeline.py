import json

import numpy as np
import pytest
from click.testing import CliRunner

from pipelines.build_index.plan import IndexPlan
from pipelines.build_index.run import main, run
from retrieval_core.search import embeddings
from retrieval_core.search.exact import exact_topk
from retrieval_core.search.index_folder import INDEX_MANIFEST, load_sharded_index

D = 16


def _write_embeddings(root, n=600, parts=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = rng.choice(2**40, size=n, replace=False).astype(np.int64)
    (root / "embeddings" / "image").mkdir(parents=True)
    entries = []
    for i in range(parts):
        name = f"toy-{i:05d}-of-{parts:05d}.parquet"
        data = embeddings.embedding_shard_bytes(ids[i::parts], x[i::parts])
        (root / "embeddings" / "image" / name).write_bytes(data)
        entries.append(embeddings.shard_info(name, data, len(ids[i::parts])))
    manifest = embeddings.make_embeddings_manifest("toy-model", "0" * 64, D, {"image": entries}, "test")
    (root / embeddings.EMBEDDINGS_MANIFEST).write_text(json.dumps(manifest))
    return ids, x


def _run(args):
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, (res.output, res.exception)
    return res.output


def test_flat_index_pipeline_and_rerun_keeps_shards(tmp_path):
    emb_dir, out = tmp_path / "emb", tmp_path / "index"
    ids, x = _write_embeddings(emb_dir)
    args = ["--embeddings", str(emb_dir), "--output", str(out), "--index-factory", "Flat", "--threads", "1"]
    text = _run(args)
    assert "600 vectors in 3 shards (3 built, 0 kept)" in text
    index = load_sharded_index(str(out))
    q = x[:7] + 0.01
    _, got = index.search(q, 5)
    np.testing.assert_array_equal(got, exact_topk(q, x, ids, 5)[1])

    shard = out / "shards" / "toy-00001-of-00003.faiss"
    before = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    shard.write_bytes(b"corrupt")  # a damaged shard is rebuilt, the other two are kept
    text = _run(args)
    assert "(1 built, 2 kept)" in text
    after = {p.name: p.stat().st_mtime_ns for p in (out / "shards").iterdir()}
    assert after["toy-00000-of-00003.faiss"] == before["toy-00000-of-00003.faiss"]
    assert load_sharded_index(str(out)).ntotal == 600
    assert not list((out / "_work").glob("shard_infos*"))


def test_ivf_pipeline_trains_once_and_reuses_training(tmp_path):
    emb_dir, out = tmp_path / "emb", tmp_path / "index"
    ids, _ = _write_embeddings(emb_dir)
    args = ["--embeddings", str(emb_dir), "--output", str(out), "--index-factory", "IVF4,Flat",
            "--train-sample", "400", "--threads", "1"]
    _run(args)
    manifest = json.loads((out / INDEX_MANIFEST).read_text())
    assert manifest["ntotal"] == 600 and manifest["trained"]["train_sample"] == 400
    index = load_sharded_index(str(out))
    np.testing.assert_array_equal(index.all_ids(), np.sort(ids))
    assert "(0 built, 3 kept)" in _run(args)
    # a different factory rebuilds everything
    assert "(3 built, 0 kept)" in _run(args[:5] + ["IVF2,Flat"] + args[6:])


def test_corrupt_embedding_shard_fails_the_build(tmp_path):
    emb_dir, out = tmp_path / "emb", tmp_path / "index"
    _write_embeddings(emb_dir)
    p = emb_dir / "embeddings" / "image" / "toy-00002-of-00003.parquet"
    p.write_bytes(p.read_bytes()[:-3])
    res = CliRunner().invoke(main, ["--embeddings", str(emb_dir), "--output", str(out)])
    assert res.exit_code != 0
    assert isinstance(res.exception, SystemExit)  # reported by the CLI (one line), not an uncaught error
    assert "sha256" in res.output and "does not match the manifest" in res.output


def _write_ids(path, ids):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"item_id": pa.array(np.asarray(ids), type=pa.int64())}), str(path))
    return str(path)


def test_ids_index_holds_only_the_listed_items(tmp_path):
    emb_dir, out = tmp_path / "emb", tmp_path / "index"
    ids, x = _write_embeddings(emb_dir)
    fold = ids[::3][:150]
    ids_file = _write_ids(tmp_path / "fold.parquet", fold[::-1])  # file order does not matter
    text = _run(["--embeddings", str(emb_dir), "--output", str(out), "--modality", "image",
                 "--ids", ids_file, "--index-factory", "IVF2,Flat", "--train-sample", "100", "--threads", "1"])
    assert "150 vectors of the 150 ids in" in text and "(3 built, 0 kept)" in text
    manifest = json.loads((out / INDEX_MANIFEST).read_text())
    import hashlib
    assert manifest["ids"] == {"path": ids_file, "count": 150,
                               "sha256": hashlib.sha256(open(ids_file, "rb").read()).hexdigest()}
    index = load_sharded_index(str(out))  # checks the id set against the id list
    np.testing.assert_array_equal(index.all_ids(), np.sort(fold))
    assert "(0 built, 3 kept)" in _run(["--embeddings", str(emb_dir), "--output", str(out), "--ids", ids_file,
                                        "--index-factory", "IVF2,Flat", "--train-sample", "100"])
    # another id list rebuilds every shard; without --ids the index holds every embedding again
    other = _write_ids(tmp_path / "other.parquet", ids[:50])
    assert "(3 built, 0 kept)" in _run(["--embeddings", str(emb_dir), "--output", str(out), "--ids", other])
    assert "600 vectors in 3 shards (3 built, 0 kept)" in _run(["--embeddings", str(emb_dir), "--output", str(out)])
    assert json.loads((out / INDEX_MANIFEST).read_text())["ids"] is None


def test_ids_missing_from_the_embeddings_are_refused_before_anything_is_written(tmp_path):
    emb_dir, out = tmp_path / "emb", tmp_path / "index"
    ids, _ = _write_embeddings(emb_dir)
    bad = _write_ids(tmp_path / "bad.parquet", np.concatenate([ids[:10], [7, 8, 9]]))
    res = CliRunner().invoke(main, ["--embeddings", str(emb_dir), "--output", str(out), "--ids", bad])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert "3 of 13 id(s) have no image embedding" in res.output and "[7, 8, 9]" in res.output
    assert not out.exists()
    dup = _write_ids(tmp_path / "dup.parquet", [ids[0], ids[0]])
    res = CliRunner().invoke(main, ["--embeddings", str(emb_dir), "--output", str(out), "--ids", dup])
    assert res.exit_code == 1 and "listed more than once" in res.output


def test_unknown_flag_and_bad_plan_values_are_one_line_errors(tmp_path):

    emb_dir = tmp_path / "emb"
    _write_embeddings(emb_dir)
    res = CliRunner().invoke(main, ["--embeddings", str(emb_dir), "--output", str(tmp_path / "o"), "--top-k", "3"])
    assert res.exit_code == 2 and "unknown option(s) --top-k" in res.output
    with pytest.raises(ValueError, match="--metric: 'cos' is not one of 'ip', 'l2'"):
        IndexPlan(str(emb_dir), str(tmp_path / "o"), metric="cos")
    with pytest.raises(ValueError, match="--threads: 0 is not in the range x>=1"):
        IndexPlan(str(emb_dir), str(tmp_path / "o"), threads=0)


@pytest.fixture(scope="module")
def dask_cluster():
    from tests.helpers_dask import local_cluster

    with local_cluster() as cluster:
        yield cluster


def test_direct_and_dask_runners_write_identical_indexes(tmp_path, dask_cluster):
    from tests.helpers_dask import assert_same_bytes, dask_args, relative_files

    emb_dir = tmp_path / "emb"
    ids, _ = _write_embeddings(emb_dir)
    ids_file = _write_ids(tmp_path / "fold.parquet", ids[::2])
    outs = {}
    for runner, args in (("direct", ()), ("dask", dask_args(dask_cluster))):
        outs[runner] = str(tmp_path / runner)
        summary = run(IndexPlan(str(emb_dir), outs[runner], factory="IVF4,Flat", train_sample=200, threads=1,
                                ids=ids_file), args)
        assert summary["ntotal"] == 300 and summary["built"] == 3
    assert summary["runner"] == "DaskRunner"
    files = relative_files(outs["direct"])
    assert files == relative_files(outs["dask"])  # no _run/, _work/ or beam-temp leftovers either
    assert files == ["index_manifest.json", "shards/toy-00000-of-00003.faiss", "shards/toy-00001-of-00003.faiss",
                     "shards/toy-00002-of-00003.faiss", "trained.faiss"]
    a, b = (json.loads(open(f"{o}/index_manifest.json").read()) for o in outs.values())
    assert a == b
    assert_same_bytes(outs["direct"], outs["dask"], files[1:])

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pipelines.build_index import main
from retrieval_core import embeddings as emb
from retrieval_core import index as ix
from retrieval_core.metrics import exact_topk

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
        data = emb.embedding_shard_bytes(ids[i::parts], x[i::parts])
        (root / "embeddings" / "image" / name).write_bytes(data)
        entries.append(emb.shard_info(name, data, len(ids[i::parts])))
    manifest = emb.make_embeddings_manifest("toy-model", "0" * 64, D, {"image": entries}, "test")
    (root / emb.EMBEDDINGS_MANIFEST).write_text(json.dumps(manifest))
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
    index = ix.load_sharded_index(str(out))
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
    assert ix.load_sharded_index(str(out)).ntotal == 600
    assert not list((out / "_work").glob("shard_infos*"))


def test_ivf_pipeline_trains_once_and_reuses_training(tmp_path):
    emb_dir, out = tmp_path / "emb", tmp_path / "index"
    ids, _ = _write_embeddings(emb_dir)
    args = ["--embeddings", str(emb_dir), "--output", str(out), "--index-factory", "IVF4,Flat",
            "--train-sample", "400", "--threads", "1"]
    _run(args)
    manifest = json.loads((out / ix.INDEX_MANIFEST).read_text())
    assert manifest["ntotal"] == 600 and manifest["trained"]["train_sample"] == 400
    index = ix.load_sharded_index(str(out))
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

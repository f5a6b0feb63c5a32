"""build_index --index-factory auto: the choice under budgets, what the manifest records, rerank's use of it."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from pipelines.build_index.run import main
from retrieval_core.search import embeddings, index_choice
from retrieval_core.search.index import select_training_ids
from retrieval_core.search.index_folder import INDEX_MANIFEST, load_sharded_index

D = 16


def _write_embeddings(root, n=800, n_text=300, parts=2):
    """Clustered unit vectors (images) and nearby queries (text), as pipelines.encode lays them out."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(20, D))
    def unit(x):
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    x = unit(centres[rng.integers(0, 20, n)] + 0.4 * rng.normal(size=(n, D)))
    t = unit(centres[rng.integers(0, 20, n_text)] + 0.4 * rng.normal(size=(n_text, D)))
    entries = {}
    for modality, vecs, base in (("image", x, 10**6), ("text", t, 2 * 10**6)):
        ids = base + np.arange(len(vecs), dtype=np.int64)
        (root / "embeddings" / modality).mkdir(parents=True)
        entries[modality] = []
        for i in range(parts):
            name = f"toy-{i:05d}-of-{parts:05d}.parquet"
            data = embeddings.embedding_shard_bytes(ids[i::parts], vecs[i::parts])
            (root / "embeddings" / modality / name).write_bytes(data)
            entries[modality].append(embeddings.shard_info(name, data, len(ids[i::parts])))
    manifest = embeddings.make_embeddings_manifest("toy-model", "0" * 64, D, entries, "test")
    (root / embeddings.EMBEDDINGS_MANIFEST).write_text(json.dumps(manifest))
    return x, t


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_auto_chooses_within_the_memory_budget_and_records_measured_recall(tmp_path):
    emb_dir, out = tmp_path / "emb", tmp_path / "index"
    _write_embeddings(emb_dir)
    # 25 KB leaves out Flat (~58 KB), IVF-Flat and HNSW (~270 KB): a quantised IVF must be chosen and its nprobe tuned
    res = _invoke("--embeddings", emb_dir, "--output", out, "--index-factory", "auto", "--max-index-memory", "25KB",
                  "--max-query-ms", "50", "--recall-target", "0.95", "--threads", "1")
    assert res.exit_code == 0, (res.output, res.exception)
    m = json.loads((out / INDEX_MANIFEST).read_text())
    assert m["factory"].startswith("IVF") and ("SQ8" in m["factory"] or "PQ" in m["factory"])
    assert set(m["search_params"]) == {"nprobe"} and m["search_params"]["nprobe"] >= 1
    measured = m["auto"]["measured"]
    assert measured["recall@10"] >= 0.95 and 0 < measured["memory_bytes"] <= 25_000
    assert 0 < measured["query_ms"] <= 50
    assert m["auto"]["budget"] == {"max_memory_bytes": 25_000, "max_query_ms": 50.0, "recall_target": 0.95}
    assert "200 text embeddings" in m["auto"]["queries"]
    rejected = {c["factory"]: c["rejected"] for c in m["auto"]["candidates"]}
    assert "KB > 25.0 KB" in rejected["Flat"] and "KB > 25.0 KB" in rejected["HNSW32"]
    # the recorded recall is real: the loaded index with the recorded nprobe finds what exact search finds
    index = load_sharded_index(str(out))
    index.set_params(**m["search_params"])
    ids, x = embeddings.read_embeddings(str(emb_dir), "image")
    t_ids, t = embeddings.read_embeddings(str(emb_dir), "text")
    held_out = select_training_ids(t_ids, 200, 2)  # the queries build_index drew (seed + 2)
    order = np.argsort(t_ids)
    t = t[order[np.searchsorted(t_ids[order], held_out)]]
    exact = index_choice.exact_topk(t, x, ids, 10)[1]
    assert index_choice.recall_at_10(index.search(t, 10)[1], exact) == pytest.approx(measured["recall@10"])


def test_auto_refuses_a_budget_nothing_meets_in_one_line(tmp_path):
    emb_dir = tmp_path / "emb"
    _write_embeddings(emb_dir, n=300, n_text=50)
    res = _invoke("--embeddings", emb_dir, "--output", tmp_path / "i", "--index-factory", "auto",
                  "--max-index-memory", "1KB")
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: no index meets the budget") and "Flat:" in lines[0]
    assert not (tmp_path / "i" / INDEX_MANIFEST).exists()
    bad = _invoke("--embeddings", emb_dir, "--output", tmp_path / "j", "--max-query-ms", "5")
    assert bad.exit_code == 1 and "need --index-factory auto" in bad.output
    bad = _invoke("--embeddings", emb_dir, "--output", tmp_path / "j", "--index-factory", "auto",
                  "--max-index-memory", "4 parsecs")
    assert bad.exit_code == 2 and "memory size" in bad.output  # a bad option value: click's usage error


def test_parse_bytes_and_estimates():
    assert index_choice.parse_bytes("4GB") == 4 * 10**9 and index_choice.parse_bytes("512MiB") == 512 * 2**20
    assert index_choice.parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        index_choice.parse_bytes("-3GB")
    n, d = 1_000_000, 384
    assert index_choice.estimated_bytes("Flat", n, d) > index_choice.estimated_bytes("IVF1024,SQ8", n, d) > \
        index_choice.estimated_bytes("IVF1024,PQ96x8", n, d)

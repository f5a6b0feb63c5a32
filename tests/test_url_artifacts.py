"""Every artifact by URL, as on Dataflow (gs://): stage -> encode -> build_index -> rerank -> evaluate with the
model folder, staged data, embeddings, index and outputs all under the test-only ``rrtest://`` Beam FileSystem
(tests/helpers_beamfs.py: a real FileSystem over local files) write the bytes the same chain writes on local
paths, and their read-backs (resume, --tune-on, evaluate's CSV) work there too. A URL that reached a local file
call (open, os.path.exists, faiss.read_index, from_pretrained) would fail: ``rrtest:///x`` is no local path.
Also: the local cache of URL model folders (checkpoints.local_model_folder)."""
from __future__ import annotations

import csv
import io
import json
import os

import pytest

from benchmarks import evaluate
from pipelines.beam_kit import RUN_DIR
from pipelines.build_index import plan as build_index_plan
from pipelines.build_index import run as build_index_run
from pipelines.encode import plan as encode_plan
from pipelines.encode import run as encode_run
from pipelines.files import BEAM_FILES, SPILL_DIR
from pipelines.rerank import plan as rerank_plan
from pipelines.rerank import run as rerank_run
from pipelines.stage import plan as stage_plan
from pipelines.stage import run as stage_run
from retrieval_core.evaluation import runs
from retrieval_core.model.backbones import MODEL_CACHE_ENV
from retrieval_core.model.checkpoints import (
    CheckpointError,
    inspect_model_folder,
    load_model_folder,
    local_model_folder,
)
from retrieval_core.search import embeddings
from retrieval_core.search.index_folder import INDEX_MANIFEST
from tests.helpers_beamfs import PREFIX, url
from tests.test_dataflow import MANIFEST  # a synthetic collection of 16 images (8 test), 2 captions each
from tests.test_encode_pipeline import write_tiny_model


def local(path: str) -> str:
    """The local file behind an rrtest:// URL (to compare bytes)."""
    return path[len(PREFIX):] if path.startswith(PREFIX) else path


def read(path: str) -> bytes:
    with open(local(path), "rb") as f:
        return f.read()


def run_chain(manifest: str, model: str, out: str) -> dict:
    """stage -> encode (every split) -> Flat image index -> JOIN+CO rerank of the test split -> recall; the
    outputs under ``out`` (a local folder or a URL)."""
    staged, emb_dir, index_dir, run_dir = (f"{out}/{name}" for name in ("staged", "emb", "index", "rank"))
    summary = stage_run.run(stage_plan.StagePlan(staged, manifest))
    problems = summary["problems"]
    assert problems == []
    encode_run.run(encode_plan.EncodePlan(staged, model, emb_dir, batch_size=8, images_per_shard=6, texts_per_shard=12))
    build_index_run.run(build_index_plan.IndexPlan(emb_dir, index_dir, threads=1))
    ranked = rerank_run.run(rerank_plan.RerankPlan(staged, emb_dir, run_dir, mode="co", k=4, index=index_dir,
                                                   ce_model=model,
                                          batch_size=8, queries_per_shard=5))
    return {"staged": staged, "summary": summary, "emb": emb_dir, "index": index_dir, "run": run_dir,
            "rankings": ranked, "recall": runs.evaluate_run(run_dir, staged, files=BEAM_FILES)}


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    root = tmp_path_factory.mktemp("url")
    (root / "tiny.yaml").write_text(MANIFEST)
    model = write_tiny_model(str(root / "model"), str(root))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MODEL_CACHE_ENV, str(root / "model_cache"))  # this module's copies of URL models
        on_disk = run_chain(str(root / "tiny.yaml"), model, str(root / "local"))
        by_url = run_chain(str(root / "tiny.yaml"), url(model), url(root / "remote"))
        yield root, model, on_disk, by_url


def shard_entries(manifest: dict, keys=("name", "rows", "sha256")) -> list[dict]:
    return [{k: s[k] for k in keys} for s in manifest["shards"]]


def test_url_chain_writes_the_bytes_of_the_local_chain(chains):
    root, _, on_disk, by_url = chains
    for kind in ("images", "captions"):
        a, b = (c["summary"]["collections"]["syn"][kind]["shards"] for c in (on_disk, by_url))
        assert [(s["name"], s["sha256"]) for s in b] == [(s["name"], s["sha256"]) for s in a] and a
    emb_a, emb_b = (json.loads(read(embeddings.manifest_path(c["emb"]))) for c in (on_disk, by_url))
    assert emb_b["model"]["sha256"] == emb_a["model"]["sha256"]  # fingerprinted from the cached copy
    assert emb_b["model"]["path"].startswith(PREFIX)
    for modality in ("image", "text"):
        a, b = emb_a["modalities"][modality]["shards"], emb_b["modalities"][modality]["shards"]
        assert a == b and len(a) == 3
        for s in a:
            rel = embeddings.shard_relpath(modality, s["name"])
            assert read(f"{by_url['emb']}/{rel}") == read(f"{on_disk['emb']}/{rel}")

    ix_a, ix_b = (json.loads(read(f"{c['index']}/{INDEX_MANIFEST}")) for c in (on_disk, by_url))
    keys = ("name", "rows", "sha256", "source", "source_sha256")
    assert shard_entries(ix_b, keys) == shard_entries(ix_a, keys)
    assert ix_b["trained"]["sha256"] == ix_a["trained"]["sha256"]
    assert ix_b["embeddings"]["dir"] == by_url["emb"]

    rank_a, rank_b = on_disk["rankings"], by_url["rankings"]
    assert shard_entries(rank_b) == shard_entries(rank_a) and len(rank_a["shards"]) == 4 + 2
    assert rank_b["queries"] == rank_a["queries"] == {"t2i": 16, "i2t": 8}
    assert rank_b["ce_pairs_scored"] == rank_a["ce_pairs_scored"] > 0
    assert "FAISS index rrtest://" in rank_b["search"]["t2i"] and "exact search" in rank_b["search"]["i2t"]
    for s in rank_a["shards"]:
        assert read(f"{by_url['run']}/rankings/{s['name']}") == read(f"{on_disk['run']}/rankings/{s['name']}")
    assert by_url["recall"] == on_disk["recall"] and by_url["recall"]["t2i_queries"] == 16
    assert os.listdir(root / "model_cache")  # the workers loaded the URL model from a local copy
    for out in (by_url["staged"], by_url["emb"], by_url["index"], by_url["run"]):  # scratch files removed by URL too
        assert [f for d in (RUN_DIR, SPILL_DIR) for f in BEAM_FILES.walk(f"{out}/{d}")] == []


def test_url_reruns_resume_from_what_they_read_back(chains):
    root, model, _, by_url = chains
    staged, model = by_url["staged"], url(model)
    again = encode_run.run(encode_plan.EncodePlan(staged, model, by_url["emb"], batch_size=8, images_per_shard=6,
                                         texts_per_shard=12))
    assert {m: (v["encoded"], v["reused"]) for m, v in again["modalities"].items()} == {"image": (0, 16),
                                                                                        "text": (0, 32)}
    index = build_index_run.run(build_index_plan.IndexPlan(by_url["emb"], by_url["index"], threads=1))
    assert (index["built"], index["kept"]) == (0, 3)
    ranked = rerank_run.run(rerank_plan.RerankPlan(staged, by_url["emb"], by_url["run"], mode="co", k=4,
                                                   index=by_url["index"],
                                          ce_model=model, batch_size=8, queries_per_shard=5))
    assert (ranked["shards_reused"], ranked["waves_run"]) == (4 + 2, 0)
    assert ranked["shards"] == by_url["rankings"]["shards"]
    # last: re-staging rewrites summary.json (timings), which rerank's plan fingerprint includes
    summary = stage_run.run(stage_plan.StagePlan(staged, str(root / "tiny.yaml")))
    assert summary["resume"] == {"kept": 2, "written": 0, "stale_removed": 0}


def test_mode_auto_tunes_on_a_url_run_as_on_the_local_one(chains):
    """--tune-on a URL run (its manifest, CE model and stored scores read by URL) chooses what the same local
    run gives; here the test-split run is the held-out one and the train split is ranked."""
    _, model, on_disk, by_url = chains
    out = by_url["run"] + "_train_auto"
    ranked = rerank_run.run(rerank_plan.RerankPlan(by_url["staged"], by_url["emb"], out, mode="auto",
                                                   tune_on=by_url["run"], k=4,
                                          index=by_url["index"], ce_model=url(model), split="train", batch_size=8))
    expected = runs.choose_fusion(on_disk["run"], on_disk["staged"], 4)
    chosen = ranked["fusion_choice"]
    assert (chosen["mode"], chosen["lam"], chosen["dev_mR"]) == (expected["mode"], expected["lam"], expected["dev_mR"])
    assert chosen["dev_run"] == by_url["run"] and ranked["queries"] == {"t2i": 16, "i2t": 8}


def test_evaluate_cli_reads_and_merges_its_csv_by_url(chains):
    from click.testing import CliRunner

    root, _, _, by_url = chains
    out = url(root / "results")
    for label in ("JOIN+CO", "EMB"):
        args = ["--rankings", f"{by_url['run']}/rankings", "--staged", by_url["staged"], "--output", out,
                "--model", "tiny", "--label", label] + (["--mode", "emb"] if label == "EMB" else [])
        res = CliRunner().invoke(evaluate.main, args)
        assert res.exit_code == 0, (res.output, res.exception)
    rows = list(csv.DictReader(io.StringIO(read(f"{out}/{evaluate.METRICS_CSV}").decode())))
    assert len(rows) == 4 and {r["mode"] for r in rows} == {"JOIN+CO", "EMB"}  # rows merged
    assert os.path.isfile(root / "results" / "syn_tiny_JOIN_CO_k4.json")


# ----------------------------------------------------------------------------------- model-folder cache
def test_url_model_folder_is_copied_once_and_again_after_a_change(tmp_path, monkeypatch):
    model = write_tiny_model(str(tmp_path / "model"), str(tmp_path))
    cache = str(tmp_path / "cache")
    names = sorted(os.listdir(model))

    first = local_model_folder(url(model), BEAM_FILES, cache)
    assert os.path.dirname(first) == cache and sorted(os.listdir(first)) == names
    assert all(read(os.path.join(first, n)) == read(os.path.join(model, n)) for n in names)
    stamps = {n: os.stat(os.path.join(first, n)) for n in names}
    assert local_model_folder(url(model) + "/", BEAM_FILES, cache) == first  # unchanged: not copied again
    assert all(os.stat(os.path.join(first, n)).st_mtime_ns == stamps[n].st_mtime_ns for n in names)
    assert os.listdir(cache) == [os.path.basename(first)]  # no temporary folder left behind

    config = json.loads(read(os.path.join(model, "rr_model.json")))
    config["provenance"]["note"] = "fine-tuned again"
    with open(os.path.join(model, "rr_model.json"), "w") as f:
        json.dump(config, f)
    changed = local_model_folder(url(model), BEAM_FILES, cache)
    assert changed != first
    assert read(os.path.join(changed, "rr_model.json")) == read(os.path.join(model, "rr_model.json"))

    os.remove(os.path.join(changed, "model.safetensors"))  # a copy pruned from the cache is made again
    assert local_model_folder(url(model), BEAM_FILES, cache) == changed
    assert read(os.path.join(changed, "model.safetensors")) == read(os.path.join(model, "model.safetensors"))

    monkeypatch.setenv(MODEL_CACHE_ENV, cache)  # inspect / load / fingerprint by URL read that same copy
    info = inspect_model_folder(url(model), BEAM_FILES)
    assert (info.path, info.local_dir, info.heads) == (url(model), changed, ("be", "ce"))
    assert inspect_model_folder(url(model), BEAM_FILES).fingerprint == inspect_model_folder(model).fingerprint
    by_url, on_disk = load_model_folder(url(model), need=("ce",), files=BEAM_FILES), load_model_folder(model)
    assert all((by_url.state_dict()[k] == v).all() for k, v in on_disk.state_dict().items())

    with pytest.raises(CheckpointError, match="rrtest://.*nothing' does not exist"):
        local_model_folder(url(tmp_path / "nothing"), BEAM_FILES, cache)
    with pytest.raises(CheckpointError, match="is a URL: pass files="):
        inspect_model_folder(url(model))
    os.remove(os.path.join(model, "config.json"))  # errors name the URL folder, not its cache copy
    with pytest.raises(CheckpointError, match=f"^{url(model)} has rr_model.json but no config.json"):
        inspect_model_folder(url(model), BEAM_FILES)

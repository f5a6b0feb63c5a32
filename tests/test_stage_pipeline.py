"""The Beam staging pipeline: its DoFns under TestPipeline, and `pipelines.stage` end to end on a tiny manifest
(a synthetic collection plus a BUTD TSV collection with deliberately bad rows)."""
import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from pipelines.files import BEAM_FILES, SPILL_DIR, sha256_file
from pipelines.stage import run as stage_run
from pipelines.stage.graph import (
    T_COUNT,
    T_IMAGE_REFS,
    T_INFO,
    T_OWNERS,
    T_REJECT,
    T_STAGED,
    ReadAndStage,
    WriteImageShard,
    _load_rows,
    pick_all,
    spill_path,
)
from pipelines.stage.plan import Settings, StageError, StagePlan, default_chunk_size
from retrieval_core.data import schema, staging
from retrieval_core.data.readers import plan_read_tasks
from retrieval_core.data.spill import FeatureSpill, load_spilled
from retrieval_core.data.store import INCOMPLETE_FILE, StagedDataset

F = 16
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def b64(a) -> str:
    return base64.b64encode(np.asarray(a, dtype=np.float32).tobytes()).decode()


def tsv_row(image_id, n=3, dim=F, num_boxes=None, w=100, h=80, nan=False, seed=0):
    rng = np.random.default_rng(seed)
    feats = rng.random((n, dim)).astype(np.float32)
    if nan:
        feats[0, 0] = np.nan
    boxes = np.array([[5, 5, 50, 40]] * n, dtype=np.float32)
    return "\t".join([image_id, str(w), str(h), str(n if num_boxes is None else num_boxes), b64(boxes), b64(feats)])


def write_inputs(tmp_path):
    """A tiny manifest: 60 synthetic images x 2 captions + a TSV with 4 good rows and 6 bad ones."""
    rows = [
        tsv_row("a", seed=1), tsv_row("b", n=1, seed=2), tsv_row("c", n=5, seed=3), tsv_row("d", seed=4),
        tsv_row("e", dim=8),                                  # wrong feature dim (stager)
        tsv_row("f", nan=True),                               # NaN (stager)
        # num_boxes says 3 and features have 3 rows, but boxes hold 4 (stager: num_boxes mismatch)
        "\t".join(["g", "100", "80", "3", b64(np.tile([[5, 5, 50, 40]], (4, 1))), b64(np.zeros((3, F)))]),
        tsv_row("a", seed=9),                                 # duplicate id (stager, pipeline)
        "trunc\t100\t80\t3",                                  # truncated row (reader)
        "badb64\t100\t80\t1\t!!notbase64!!\t" + b64(np.zeros((1, F))),  # bad base64 (reader)
    ]
    (tmp_path / "feats.tsv").write_text("\n".join(rows) + "\n")
    images = [{"filename": f"{x}.jpg", "split": "test",
               "sentences": [{"sentid": i * 10 + k, "raw": f"photo {x} number {k}"} for k in range(2)]}
              for i, x in enumerate("abcd")]
    images.append({"filename": "f.jpg", "split": "test", "sentences": [{"sentid": 99, "raw": "of a rejected image"}]})
    images.append({"filename": "zzz.jpg", "split": "test", "sentences": [{"sentid": 98, "raw": "of no image"}]})
    images.append({"filename": "b.jpg", "split": "test", "sentences": [{"sentid": 97, "raw": "   "},
                                                                       {"sentid": 96, "raw": "BADUTF8"}]})
    data = json.dumps({"images": images}).encode().replace(b"BADUTF8", b"caf\xff")  # not UTF-8
    (tmp_path / "caps.json").write_bytes(data)
    manifest = f"""
name: tiny
feature_dim: {F}
max_regions: 12
collections:
  syn:
    images: {{format: synthetic, num_images: 60, seed: 3, min_regions: 5, max_regions: 20,
             splits: {{train: 0.5, test: 0.5}}}}
    captions: {{format: synthetic, captions_per_image: 2}}
    expected_images: 60
  tsv:
    images: {{format: butd_tsv, path: {tmp_path / 'feats.tsv'}}}
    captions: {{format: karpathy_json, path: {tmp_path / 'caps.json'}, image_id: filename_stem}}
    role: distractor
"""
    (tmp_path / "tiny.yaml").write_text(manifest)
    return str(tmp_path / "tiny.yaml")


def run_cli(*args):
    result = CliRunner().invoke(stage_run.main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


# ------------------------------------------------------------------------------------- Beam parts
def _read_and_stage(settings, task) -> list:
    dofn = ReadAndStage(settings)
    dofn.setup()
    return list(dofn.process(task))


def test_read_and_stage_dofn_routes_rejects(tmp_path):
    write_inputs(tmp_path)
    tasks = plan_read_tasks("tsv", "image", "butd_tsv", str(tmp_path / "feats.tsv"), {}, F)
    settings = Settings(output=str(tmp_path / "out"), feature_dim=F, max_regions=50, feature_format="parquet",
                        feature_dtype="float32", images_per_shard=10, spill_dir=str(tmp_path / "spill"))
    out = [el for task in tasks for el in _read_and_stage(settings, task)]  # one output of (tag, payload)
    refs = [ref for (_coll, _bucket), block in pick_all(out, T_IMAGE_REFS) for ref in block]
    assert sorted(r["source_id"] for r in _load_rows(settings, "tsv", refs)) == ["a", "a", "b", "c", "d"]
    assert sorted((c, staging.reason_category(r["reason"])) for c, r in pick_all(out, T_REJECT)) == \
        sorted([("tsv", staging.R_FEATURE_DIM), ("tsv", staging.R_NOT_FINITE), ("tsv", staging.R_NUM_BOXES),
                ("tsv", "expected 6 tab-separated columns"),  # reader rejects
                ("tsv", "column 'boxes' is not valid base64")])
    assert pick_all(out, T_INFO) == [{"type": "in", "collection": "tsv", "kind": "image",
                                                              "n": 10}]
    assert pick_all(out, T_COUNT) == [("tsv", 5)]
    owners = [o for _, block in pick_all(out, T_OWNERS) for o in block]
    assert sorted(o[3] for o in owners) == ["a", "a", "b", "c", "d"] and {o[2] for o in owners} == {"image"}


def _spilled_refs(tmp_path, settings, coll, rows, key=7):
    """Rows written to a read task's spill file (as ReadAndStage does) and their refs."""
    path = spill_path(settings.spill_dir, coll, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    spill = FeatureSpill(path, path, F, settings.feature_dtype)
    refs = [(key, int(r["item_id"]), spill.add_row(spill.append(r))) for r in rows]
    spill.close()
    return refs


def test_image_shard_writer_dedupes_and_writes_atomically(tmp_path):
    def row(sid, loc):
        raw = schema.RawImage(sid, np.ones((2, F), np.float32), np.array([[0, 0, 10, 10]] * 2, np.float32),
                              image_w=20, image_h=20, split="test", locator=loc)
        return staging.stage_image(raw, collection="c", feature_dim=F, max_regions=50, source="s")

    settings = Settings(output=str(tmp_path), feature_dim=F, max_regions=50, feature_format="hdf5",
                        feature_dtype="float16", images_per_shard=10, expected_images={"c": 3},
                        spill_dir=str(tmp_path / "_spill" / "run"))
    refs = _spilled_refs(tmp_path, settings, "c", [row("x", "s:2"), row("x", "s:1"), row("y", "s:3")])
    out = list(WriteImageShard(settings).process((("c", 0), [(1, refs[:2]), (1, refs[2:]), (1, None)])))
    ids = sorted([schema.make_item_id("c", "image", s) for s in "xy"])
    assert pick_all(out, T_STAGED) == [(("c", 0), (1, [(i, "test") for i in ids]))]
    assert [cr[1]["locator"] + " " + cr[1]["reason"] for cr in pick_all(out, T_REJECT)] == \
        ["s:2 duplicate image id: 'x' in collection 'c'; first seen at s:1"]
    assert [(i["name"], i["rows"], i["feature_shard"]["name"]) for i in pick_all(out, T_INFO)] == \
        [("images/c-00000-of-00001.parquet", 2, "features/c-00000-of-00001.h5")]
    assert sorted(os.listdir(tmp_path / "features")) == ["c-00000-of-00001.h5"]  # no temp files left


# ------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage")
    manifest = write_inputs(tmp)
    out = tmp / "out"
    code, output = run_cli("--manifest", manifest, "--output", str(out), "--images-per-shard", "20")
    return tmp, manifest, out, code, output


def test_end_to_end_counts_summary_and_rejects(staged):
    tmp, manifest, out, code, output = staged
    # the TSV collection has far more than 1% rejects: non-zero exit after writing everything
    assert code == 1, output
    assert "Error: tsv images: 6 of 10 records rejected" in output
    assert "syn images: 60 in = 60 staged + 0 rejected" in output
    assert "syn captions: 120 in = 120 staged + 0 rejected" in output
    assert "tsv images: 10 in = 4 staged + 6 rejected" in output
    assert "tsv captions: 12 in = 8 staged + 4 rejected" in output
    assert "syn region cap 12:" in output and "kept the most confident" in output

    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["feature_dim"] == F and summary["manifest"]["name"] == "tiny"
    syn, tsv = summary["collections"]["syn"], summary["collections"]["tsv"]
    assert [s["name"] for s in syn["images"]["shards"]] == [f"images/syn-{i:05d}-of-00003.parquet" for i in range(3)]
    assert sum(s["rows"] for s in syn["images"]["shards"]) == 60 and syn["images"]["expected"] == 60
    assert syn["images"]["region_cap"]["policy"] == "confidence" and syn["images"]["region_cap"]["capped_images"] > 0
    assert tsv["images"]["reject_reasons"][staging.R_DUPLICATE] == 1
    assert tsv["captions"]["reject_reasons"] == {staging.R_UNKNOWN_IMAGE: 2, staging.R_NOT_UTF8: 1,
                                                 "sentence has no 'raw' text": 1}  # the last from the reader
    for c in summary["collections"].values():
        for key in ("images", "captions"):
            src = c[key]
            assert src["records_in"] == src["staged"] + src["rejected"]
            for shard in src["shards"]:
                assert sha256_file(str(out / shard["name"])) == shard["sha256"]

    rejects = [json.loads(x) for x in (out / "rejects" / "tsv-images.jsonl").read_text().splitlines()]
    assert len(rejects) == 6 and all({"source", "locator", "reason"} <= set(r) for r in rejects)
    assert any(r["locator"].endswith("feats.tsv:8") and "first seen at" in r["reason"] for r in rejects)
    cap_rejects = (out / "rejects" / "tsv-captions.jsonl").read_text()
    assert "zzz" in cap_rejects and staging.R_UNKNOWN_IMAGE in cap_rejects
    assert (out / "rejects" / "syn-images.jsonl").read_text() == ""

    ds = StagedDataset(str(out))
    assert ds.collections == ["syn", "tsv"]
    meta = ds.images_meta("tsv")
    assert sorted(meta.source_id) == ["a", "b", "c", "d"]
    table = ds.load_images(collection="syn")
    assert len(table) == 60 and table.num_boxes().max() <= 12
    a_row = meta[meta.source_id == "a"].iloc[0]
    feats, boxes = ds.load_images([int(a_row.item_id)]).regions(0)
    np.testing.assert_array_equal(feats, np.random.default_rng(1).random((3, F)).astype(np.float32))  # line 1 won
    np.testing.assert_allclose(boxes[0], [0.05, 5 / 80, 0.5, 0.5, 0.45, 35 / 80], rtol=1e-6)
    cap2img, img2caps = ds.gold("tsv")
    assert len(cap2img) == 8 and set(img2caps) == set(meta.item_id)


def test_rerun_keeps_valid_shards_and_rewrites_damaged_ones(staged):
    tmp, manifest, out, _, _ = staged
    code, output = run_cli("--manifest", manifest, "--output", str(out), "--images-per-shard", "20",
                           "--max-reject-fraction", "1")
    assert code == 0, output
    first = json.loads((out / "summary.json").read_text())
    assert first["resume"]["written"] == 0 and first["resume"]["kept"] == 8  # 4 image + 4 caption shards

    os.remove(out / "images" / "syn-00001-of-00003.parquet")
    damaged = out / "captions" / "syn-00002-of-00003.parquet"
    damaged.write_bytes(damaged.read_bytes()[:100])
    (out / "images" / "syn-00000-of-00003.parquet.tmp-deadbeef0000").write_bytes(b"left by a killed run")
    code, output = run_cli("--manifest", manifest, "--output", str(out), "--images-per-shard", "20",
                           "--max-reject-fraction", "1")
    assert code == 0, output
    assert "shards: 2 written, 6 kept unchanged, 1 stale removed" in output
    second = json.loads((out / "summary.json").read_text())
    for c in ("syn", "tsv"):
        for key in ("images", "captions"):
            assert [s["sha256"] for s in second["collections"][c][key]["shards"]] == \
                   [s["sha256"] for s in first["collections"][c][key]["shards"]]
    assert not (out / "images" / "syn-00000-of-00003.parquet.tmp-deadbeef0000").exists()
    assert len(StagedDataset(str(out)).load_images(collection="syn")) == 60


def test_hdf5_float16_layout_reads_back_like_parquet(staged, tmp_path):
    _, manifest, parquet_out, _, _ = staged
    out = tmp_path / "h5"
    code, output = run_cli("--manifest", manifest, "--output", str(out), "--images-per-shard", "20",
                           "--max-reject-fraction", "1", "--feature-format", "hdf5", "--feature-dtype", "float16")
    assert code == 0, output
    assert sorted(os.listdir(out / "features")) == ["syn-00000-of-00003.h5", "syn-00001-of-00003.h5",
                                                    "syn-00002-of-00003.h5", "tsv-00000-of-00001.h5"]
    a, b = StagedDataset(str(parquet_out)).load_images(), StagedDataset(str(out)).load_images()
    np.testing.assert_array_equal(a.item_ids, b.item_ids)
    np.testing.assert_array_equal(a.boxes, b.boxes)
    np.testing.assert_allclose(a.features, b.features, rtol=1e-3, atol=1e-3)


def test_bad_input_gives_clear_message_not_traceback(tmp_path):
    manifest = write_inputs(tmp_path)
    os.remove(tmp_path / "feats.tsv")
    code, output = run_cli("--manifest", manifest, "--output", str(tmp_path / "o"))
    assert code == 1 and "input file(s) missing" in output and "feats.tsv" in output
    assert "Traceback" not in output
    bad = tmp_path / "bad.yaml"
    bad.write_text("feature_dim: 16\ncollections: {x: {images: {format: nope}}}\n")
    code, output = run_cli("--manifest", str(bad), "--output", str(tmp_path / "o"))
    assert code == 1 and "invalid manifest" in output and "Traceback" not in output


def test_module_help():
    res = subprocess.run([sys.executable, "-m", "pipelines.stage", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "--images-per-shard" in res.stdout and "--max-reject-fraction" in res.stdout


def test_read_and_stage_spills_rows_and_regions_so_shuffles_carry_refs_only(tmp_path):
    """Beam's local runners keep a shuffle's whole input in memory: a read task's rows and regions go to its
    spill file, and what it emits for the shuffles is (spill key, id, row number) refs and owner tuples, not
    rows; the rows and regions read back are the staged ones."""
    from retrieval_core.data.readers import read_task

    write_inputs(tmp_path)
    tasks = plan_read_tasks("tsv", "image", "butd_tsv", str(tmp_path / "feats.tsv"), {}, F)
    settings = Settings(output=str(tmp_path / "out"), feature_dim=F, max_regions=50, feature_format="parquet",
                        feature_dtype="float32", images_per_shard=10, spill_dir=str(tmp_path / "spill"))
    out = _read_and_stage(settings, tasks[0])
    refs = [ref for _, block in pick_all(out, T_IMAGE_REFS) for ref in block]
    assert len(refs) == 5 and all(len(r) == 3 and all(isinstance(v, int) for v in r) for r in refs)
    assert {tag for tag, _ in out} == {T_IMAGE_REFS, T_OWNERS, T_REJECT,
                                       T_INFO,
                                       T_COUNT}
    assert not [f for f in os.listdir(tmp_path / "spill") if ".tmp-" in f]  # published under its final name
    direct = [staging.stage_image(r, collection="tsv", feature_dim=F, max_regions=50,
                                  source=str(tmp_path / "feats.tsv"))
              for r in read_task(tasks[0]) if isinstance(r, schema.RawImage)]
    direct = {r[staging.K_LOCATOR]: r for r in direct if isinstance(r, dict)}
    back = load_spilled(_load_rows(settings, "tsv", refs))
    assert len(back) == len(direct) == 5
    for r in back:
        orig = direct[r[staging.K_LOCATOR]]
        assert {k: v for k, v in r.items() if k not in ("features", "boxes")} == \
            {k: v for k, v in orig.items() if k not in ("features", "boxes")}
        np.testing.assert_array_equal(r["features"], orig["features"])
        np.testing.assert_array_equal(r["boxes"], orig["boxes"])

    # a collection whose shard count is known before reading spills its rows in shard order (id % N, id), so a
    # shard reads one run of rows per file; otherwise in reading order
    ordered = Settings(**{**settings.__dict__, "expected_images": {"tsv": 5}, "images_per_shard": 2,
                          "spill_dir": str(tmp_path / "spill2")})
    n = ordered.num_shards("tsv", {})
    by_row = sorted((row, i) for _, block in pick_all(_read_and_stage(ordered, tasks[0]), T_IMAGE_REFS)
                    for _, i, row in block)
    assert n == 3 and [i for _, i in by_row] == sorted((i for _, i in by_row), key=lambda i: (i % n, i))
    assert [i for _, i in by_row] != [i for _, i, _ in sorted(refs, key=lambda r: r[2])]  # reading order differs


def test_staging_run_leaves_no_spill_files(staged):
    _, _, out, code, _ = staged
    assert (out / "summary.json").exists() and not os.path.exists(out / SPILL_DIR)


# ------------------------------------------------------------------------ URL inputs (gs:// on Dataflow)
# The inputs are reached through Beam FileSystems (BEAM_FILES), so any scheme with a registered Beam
# FileSystem works. tests/helpers_beamfs.py registers a real one, rrtest:///abs/path = /abs/path.
def write_url_inputs(root):
    """A BUTD TSV split over two files (read through a glob, beside a file the glob must skip), Karpathy
    captions in a directory, one bad row; a manifest naming them by local path."""
    (root / "in").mkdir()
    (root / "caps").mkdir()
    (root / "in" / "feats-0.tsv").write_text("\n".join([tsv_row("a", seed=1), tsv_row("b", n=1, seed=2)]) + "\n")
    (root / "in" / "feats-1.tsv").write_text("\n".join([tsv_row("c", n=5, seed=3), "trunc\t100\t80\t3"]) + "\n")
    (root / "in" / "notes.txt").write_text("not a feature file\n")
    images = [{"filename": f"{x}.jpg", "split": "test",
               "sentences": [{"sentid": i * 10 + k, "raw": f"photo {x} number {k}"} for k in range(2)]}
              for i, x in enumerate("abc")]
    (root / "caps" / "caps.json").write_text(json.dumps({"images": images}))
    (root / "m.yaml").write_text(f"""
name: url
feature_dim: {F}
collections:
  u:
    images: {{format: butd_tsv, path: "{root / 'in' / '*.tsv'}"}}
    captions: {{format: karpathy_json, path: "{root / 'caps'}", image_id: filename_stem}}
""")
    return str(root / "m.yaml")


def test_inputs_by_url_stage_like_the_same_files_by_local_path(tmp_path):
    from tests.helpers_beamfs import url

    manifest = write_url_inputs(tmp_path)
    local_sum = stage_run.run(StagePlan(str(tmp_path / "out_local"), manifest, max_reject_fraction=1))
    local_problems = local_sum["problems"]
    # the README's way: --set <collection>.<images|captions>.path=<URL>; a glob and a directory, as URLs
    overrides = [f"u.images.path={url(tmp_path / 'in')}/*.tsv", f"u.captions.path={url(tmp_path / 'caps')}"]
    url_sum = stage_run.run(StagePlan(str(tmp_path / "out_url"), manifest, overrides=overrides,
                                                 max_reject_fraction=1))
    url_problems = url_sum["problems"]
    assert local_problems == url_problems == []
    src_local, src_url = local_sum["collections"]["u"], url_sum["collections"]["u"]
    assert src_url["images"]["path"] == f"rrtest://{tmp_path}/in/*.tsv"  # kept as written, not made local
    assert url_sum["options"]["read_tasks"] == local_sum["options"]["read_tasks"] == 3  # 2 TSVs + 1 JSON
    for key in ("images", "captions"):
        for field_ in ("records_in", "staged", "rejected", "reject_reasons"):
            assert src_url[key][field_] == src_local[key][field_], (key, field_)
        # same rows -> byte-identical shards (rows carry no locator)
        assert [(s["name"], s["sha256"]) for s in src_url[key]["shards"]] == \
               [(s["name"], s["sha256"]) for s in src_local[key]["shards"]]
    assert (src_url["images"]["staged"], src_url["images"]["rejected"]) == (3, 1)

    a, b = StagedDataset(str(tmp_path / "out_local")), StagedDataset(str(tmp_path / "out_url"))
    assert sorted(b.images_meta().source_id) == ["a", "b", "c"]
    ta, tb = a.load_images(), b.load_images()
    np.testing.assert_array_equal(ta.item_ids, tb.item_ids)
    np.testing.assert_array_equal(ta.features, tb.features)
    np.testing.assert_array_equal(ta.boxes, tb.boxes)
    assert a.captions().equals(b.captions()) and len(b.captions()) == 6
    rejects = (tmp_path / "out_url" / "rejects" / "u-images.jsonl").read_text()
    assert f"rrtest://{tmp_path}/in/feats-1.tsv:2" in rejects  # locators name the URL that was read


def test_missing_url_input_is_reported_before_the_pipeline_runs(tmp_path):
    from tests.helpers_beamfs import url

    manifest = write_url_inputs(tmp_path)
    missing = f"{url(tmp_path / 'in')}/nothing-*.tsv"
    with pytest.raises(StageError, match="input file\\(s\\) missing: rrtest://.*nothing-\\*.tsv"):
        stage_run.run(StagePlan(str(tmp_path / "o"), manifest, overrides=(f"u.images.path={missing}",)))
    empty_dir = tmp_path / "empty"
    (empty_dir / "sub").mkdir(parents=True)
    (empty_dir / "sub" / "x.tsv").write_text("")  # a "directory" (prefix) whose only TSV is one level down
    with pytest.raises(StageError, match="cannot plan the reads: .*matches no directory with .tsv files"):
        stage_run.run(StagePlan(str(tmp_path / "o"), manifest,
                                           overrides=(f"u.images.path={url(empty_dir)}",)))
    # a scheme no installed Beam FileSystem serves (gs:// without apache-beam[gcp]): Beam's reason, one line
    with pytest.raises(StageError, match="cannot check the input paths: Unable to get filesystem"):
        stage_run.run(StagePlan(str(tmp_path / "o"), manifest,
                                           overrides=("u.images.path=nosuchfs://b/x.tsv",)))


def test_beam_file_access_reads_urls_raw_and_lists_like_local(tmp_path):
    """BEAM_FILES on URLs gives the readers what LOCAL_FILES gives them on the same local files (gzip bytes
    are not unpacked by name: the readers detect gzip themselves)."""
    import gzip as gz

    from retrieval_core.data.readers import LOCAL_FILES, read_multi30k
    from tests.helpers_beamfs import url

    files = BEAM_FILES
    gz_bytes = gz.compress(b"ein Hund\nzwei Katzen\n")
    (tmp_path / "test_2016.de.gz").write_bytes(gz_bytes)
    (tmp_path / "images.txt").write_text("1.jpg\n2.jpg\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deeper.de.gz").write_bytes(gz_bytes)
    with files.open(url(tmp_path / "test_2016.de.gz")) as f:
        assert f.read() == gz_bytes
    for local, remote in ((str(tmp_path), url(tmp_path)), (str(tmp_path / "*.gz"), url(tmp_path) + "/*.gz")):
        listed = LOCAL_FILES.listdir(local) if "*" not in local else LOCAL_FILES.match(local)
        got = files.listdir(remote) if "*" not in remote else files.match(remote)
        assert got == [url(p) for p in listed]  # files only, not recursive, sorted
    assert files.isdir(url(tmp_path)) and files.isdir(url(tmp_path) + "/sub/")
    assert not files.isdir(url(tmp_path / "images.txt")) and not files.exists(url(tmp_path / "nope.txt"))
    assert files.exists(url(tmp_path / "images.txt"))
    with pytest.raises(FileNotFoundError):
        files.open(url(tmp_path / "nope.txt"))
    by_local = list(read_multi30k(str(tmp_path / "test_2016.de.gz"), image_list=str(tmp_path / "images.txt")))
    by_url = list(read_multi30k(url(tmp_path / "test_2016.de.gz"), files, image_list=url(tmp_path / "images.txt")))
    assert [(c.image_source_id, c.text, c.lang) for c in by_url] == \
           [(c.image_source_id, c.text, c.lang) for c in by_local] == [("1", "ein Hund", "de"),
                                                                        ("2", "zwei Katzen", "de")]


def test_multi_processing_runner_stages_everything_with_smaller_read_tasks(tmp_path):
    """The multi-processing DirectRunner (worker processes) stages a synthetic collection completely: the run
    reconciles in = staged + rejected, and the CLI picks 100-record read tasks for that mode by default."""
    assert default_chunk_size(["--direct_running_mode=multi_processing"]) == 100
    assert default_chunk_size(["--direct_running_mode", "multi_processing"]) == 100
    in_memory = default_chunk_size(["--direct_running_mode=in_memory"])
    assert default_chunk_size([]) == in_memory == 500
    out = tmp_path / "out"
    code, output = run_cli("--manifest", "demo", "--output", str(out), "--set", "feature_dim=8",
                           "--set", "demo.images.num_images=240", "--set", "demo.expected_images=240",
                           "--set", "demo.expected_captions=1200", "--chunk-size", "60",
                           "--direct_running_mode=multi_processing", "--direct_num_workers=2")
    assert code == 0, output
    assert "demo images: 240 in = 240 staged + 0 rejected" in output
    assert "demo captions: 1200 in = 1200 staged + 0 rejected" in output


# --------------------------------------------------------------------- run marks, empty sources, runners
def test_incomplete_mark_stays_after_a_failed_run_and_goes_after_a_good_one(tmp_path):
    manifest = write_inputs(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "captions").write_text("a file where the caption shards must go: every caption write fails")
    code, output = run_cli("--manifest", manifest, "--output", str(out), "--max-reject-fraction", "1")
    assert code == 1 and "staging failed" in output
    mark = json.loads((out / INCOMPLETE_FILE).read_text())
    assert mark["run_id"] and mark["started"] and not (out / "summary.json").exists()
    (out / "captions").unlink()
    code, output = run_cli("--manifest", manifest, "--output", str(out), "--max-reject-fraction", "1")
    assert code == 0, output
    assert not (out / INCOMPLETE_FILE).exists() and (out / "summary.json").exists()


def test_a_source_that_yields_no_records_fails_unless_allowed(tmp_path):
    (tmp_path / "empty.tsv").write_text("")
    (tmp_path / "caps.json").write_text(json.dumps({"images": []}))
    (tmp_path / "m.yaml").write_text(f"""
name: empty
feature_dim: {F}
collections:
  e:
    images: {{format: butd_tsv, path: {tmp_path / 'empty.tsv'}}}
    captions: {{format: karpathy_json, path: {tmp_path / 'caps.json'}, image_id: filename_stem}}
""")
    summary = stage_run.run(StagePlan(str(tmp_path / "o1"), str(tmp_path / "m.yaml")))
    problems = summary["problems"]
    assert len(problems) == 2 and f"e images: the source butd_tsv:{tmp_path / 'empty.tsv'} yielded no records" \
        in problems[0] and "e captions: the source karpathy_json:" in problems[1]
    problems = stage_run.run(StagePlan(str(tmp_path / "o2"), str(tmp_path / "m.yaml"),
                                                  allow_empty=True))["problems"]
    assert problems == []


def test_plan_values_are_checked_when_built(tmp_path):
    with pytest.raises(StageError, match="--feature-format: 'npz' is not one of 'parquet', 'hdf5'"):
        StagePlan(str(tmp_path), feature_format="npz")
    with pytest.raises(StageError, match="override 'coco' is not KEY=VALUE"):
        StagePlan(str(tmp_path), overrides=("coco",))
    code, output = run_cli("--output", str(tmp_path / "o"), "--images_per_shard", "3")
    assert code == 2 and "unknown option(s) --images_per_shard" in output and not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def dask_cluster():
    from tests.helpers_dask import local_cluster

    with local_cluster() as cluster:
        yield cluster


def test_direct_and_dask_runners_stage_identical_files(tmp_path, dask_cluster):
    from tests.helpers_dask import assert_same_bytes, dask_args, relative_files

    manifest = write_inputs(tmp_path)
    outs, summaries = {}, {}
    for runner, args in (("direct", ()), ("dask", dask_args(dask_cluster))):
        outs[runner] = str(tmp_path / runner)
        summaries[runner] = stage_run.run(StagePlan(outs[runner], manifest, images_per_shard=20,
                                                               max_reject_fraction=1, feature_format="hdf5",
                                                               feature_dtype="float16", chunk_size=25), args)
    assert summaries["dask"]["runner"] == "DaskRunner"
    files = relative_files(outs["direct"])
    assert files == relative_files(outs["dask"])
    assert len([f for f in files if f.startswith(("images/", "features/", "captions/"))]) == 12
    assert_same_bytes(outs["direct"], outs["dask"], [f for f in files if f != "summary.json"])
    for s in summaries.values():  # what may differ: timings and how the runner was named
        s.pop("elapsed_s"), s.pop("runner"), s["options"].pop("beam_args")
    assert summaries["direct"] == summaries["dask"]
    assert summaries["dask"]["collections"]["syn"]["images"]["staged"] == 60


def test_python_m_stage_runs_on_a_dask_cluster_in_other_processes(tmp_path, dask_cluster):
    """The command a user runs: ``python -m pipelines.stage ... --runner=DaskRunner --dask_client_address=...``
    in its own process. Run as __main__, the graph's functions pickled by reference to '__main__', which the
    scheduler could not resolve ("Can't get attribute '_caption_splits' on <module '__main__'>");
    pipelines/stage/__main__.py runs the CLI imported from pipelines.stage.run."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT
    from tests.helpers_dask import assert_same_bytes, dask_args, relative_files

    manifest = write_inputs(tmp_path)
    opts = ["--images-per-shard", "20", "--max-reject-fraction", "1", "--chunk-size", "25"]
    direct = str(tmp_path / "direct")
    stage_run.run(StagePlan(direct, manifest, images_per_shard=20, max_reject_fraction=1, chunk_size=25))
    out = str(tmp_path / "dask")
    res = subprocess.run([sys.executable, "-m", "pipelines.stage", "--manifest", manifest, "--output", out, *opts,
                          *dask_args(dask_cluster)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    files = [f for f in relative_files(direct) if f != "summary.json"]
    assert files == [f for f in relative_files(out) if f != "summary.json"]
    assert_same_bytes(direct, out, files)


def test_an_lzf_compressed_spill_stages_the_same_bytes(tmp_path):
    """--spill-compression lzf (the 1M suite's: the spill and the shards coexist at the end of a stage job)
    changes the temporary spill only: every staged file is byte-identical to an uncompressed spill's."""
    from tests.helpers_dask import assert_same_bytes, relative_files

    manifest = write_inputs(tmp_path)
    outs = {c: str(tmp_path / c) for c in ("none", "lzf")}
    for c, out in outs.items():
        stage_run.run(StagePlan(out, manifest, images_per_shard=20, max_reject_fraction=1, feature_dtype="float16",
                                spill_compression=c))
    files = relative_files(outs["none"])
    assert files == relative_files(outs["lzf"]) and any(f.startswith("images/") for f in files)
    assert_same_bytes(outs["none"], outs["lzf"], [f for f in files if f != "summary.json"])
    with pytest.raises(StageError, match="--spill-compression"):
        StagePlan(str(tmp_path / "x"), manifest, spill_compression="gzip")

"""Validation and normalisation of single records (retrieval_core.data.staging)."""
import io

import numpy as np
import pyarrow.parquet as pq
import pytest

from retrieval_core.data import schema, staging
from retrieval_core.data.schema import RawCaption, RawImage, Reject
from retrieval_core.data.shards import caption_shard_parquet, image_shard_hdf5, image_shard_parquet
from retrieval_core.data.spill import K_SPILL_AT, FeatureSpill, load_spilled, load_spilled_rows

F = 8


def raw_image(n=4, source_id="img1", **kw):
    rng = np.random.default_rng(0)
    boxes = np.array([[10, 20, 50, 60]] * n, dtype=np.float32)
    defaults = dict(source_id=source_id, features=rng.standard_normal((n, F)).astype(np.float32), boxes=boxes,
                    image_w=100, image_h=200, num_boxes=n, split="train", locator="f.tsv:3")
    defaults.update(kw)
    return RawImage(**defaults)


def stage(raw, max_regions=50, feature_dim=F):
    return staging.stage_image(raw, collection="c", feature_dim=feature_dim, max_regions=max_regions, source="f.tsv")


def assert_reject(out, category, *fragments):
    assert isinstance(out, Reject), out
    assert out.reason.startswith(category + ": "), out.reason
    for frag in fragments:
        assert frag in out.reason, out.reason
    return out


def test_pixel_boxes_are_normalised_by_image_size():
    row = stage(raw_image(n=2))
    assert row["item_id"] == schema.make_item_id("c", "image", "img1")
    np.testing.assert_allclose(row["boxes"][0], [0.1, 0.1, 0.5, 0.3, 0.4, 0.2], rtol=1e-6)
    assert row["boxes"].dtype == np.float32 and row["features"].dtype == np.float32
    assert row["num_boxes"] == 2 and row["split"] == "train" and row[staging.K_CAP_POLICY] is None
    assert set(schema.IMAGE_COLUMNS) <= set(row)


def test_normalised_boxes_taken_as_is_and_uniter_area_dropped():
    b6 = np.array([[0.1, 0.2, 0.3, 0.4, 0.2, 0.2]], dtype=np.float32)
    row = stage(raw_image(n=1, boxes=b6, box_format="normalized6", image_w=0, image_h=0))
    np.testing.assert_array_equal(row["boxes"], b6)
    b7 = np.concatenate([b6, [[0.04]]], axis=1).astype(np.float32)
    row = stage(raw_image(n=1, boxes=b7, box_format="normalized6", image_w=0, image_h=0, num_boxes=None))
    np.testing.assert_array_equal(row["boxes"], b6)


def test_box_tolerance_clips_small_overshoot_but_rejects_large():
    row = stage(raw_image(n=1, boxes=np.array([[-1, 0, 101, 200]], np.float32)))
    assert row["boxes"][0, 0] == 0.0 and row["boxes"][0, 2] == 1.0
    assert_reject(stage(raw_image(n=1, boxes=np.array([[0, 0, 150, 20]], np.float32))), staging.R_BAD_BOX)
    assert_reject(stage(raw_image(n=1, boxes=np.array([[50, 0, 10, 20]], np.float32))), staging.R_BAD_BOX)


def test_region_cap_keeps_most_confident_in_confidence_order():
    n = 6
    feats = np.arange(n, dtype=np.float32)[:, None].repeat(F, axis=1)
    conf = np.array([0.1, 0.9, 0.3, 0.8, 0.2, 0.7])
    row = stage(raw_image(n=n, features=feats, confidences=conf), max_regions=3)
    assert row[staging.K_CAP_POLICY] == staging.POLICY_CONFIDENCE
    assert row["features"][:, 0].tolist() == [1, 3, 5] and row["num_boxes"] == 3
    assert row[staging.K_REGIONS_IN] == 6


def test_regions_are_stored_most_confident_first_even_below_the_cap():
    # Later stages truncate from the end (a model's --max-regions), so the order matters without capping too.
    feats = np.arange(5, dtype=np.float32)[:, None].repeat(F, axis=1)
    boxes = np.tile(np.array([[0, 0, 10, 10]], np.float32), (5, 1)) + np.arange(5, dtype=np.float32)[:, None]
    conf = np.array([0.2, 0.9, 0.5, 0.95, 0.1])
    row = stage(raw_image(n=5, features=feats, boxes=boxes, confidences=conf), max_regions=50)
    assert row[staging.K_CAP_POLICY] is None and row["num_boxes"] == 5
    assert row["features"][:, 0].tolist() == [3, 1, 2, 0, 4]
    # boxes travel with their features
    np.testing.assert_array_equal(row["boxes"][:, 0] * 100, np.array([3, 1, 2, 0, 4], np.float32))


def test_region_cap_without_confidences_keeps_stored_order():
    feats = np.arange(6, dtype=np.float32)[:, None].repeat(F, axis=1)
    row = stage(raw_image(n=6, features=feats), max_regions=4)
    assert row[staging.K_CAP_POLICY] == staging.POLICY_STORED_ORDER
    assert row["features"][:, 0].tolist() == [0, 1, 2, 3]
    cap = staging.cap_summary(4, {"stored_order": 1})
    assert cap == {"max_regions": 4, "capped_images": 1, "policy": "stored_order", "by_policy": {"stored_order": 1}}


@pytest.mark.parametrize("kw,category,fragments", [
    (dict(num_boxes=5), staging.R_NUM_BOXES, ["num_boxes says 5", "4 rows"]),
    (dict(boxes=np.zeros((3, 4), np.float32), num_boxes=None), staging.R_ROW_MISMATCH, ["4 rows", "3"]),
    (dict(features=np.zeros((4, 16), np.float32)), staging.R_FEATURE_DIM, ["16-d", f"feature_dim {F}"]),
    (dict(features=np.zeros((0, F), np.float32), boxes=np.zeros((0, 4), np.float32), num_boxes=0),
     staging.R_NO_REGIONS, []),
    (dict(image_w=0, image_h=0), staging.R_NO_SIZE, ["0x0"]),
    (dict(confidences=np.ones(3)), staging.R_BAD_CONF, ["3 confidences for 4"]),
])
def test_bad_images_are_rejected_with_reason(kw, category, fragments):
    out = assert_reject(stage(raw_image(**kw)), category, *fragments)
    assert out.locator == "f.tsv:3" and out.source == "f.tsv" and out.kind == "image"
    assert "img1" in out.reason


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features_and_boxes_rejected(bad):
    raw = raw_image()
    raw.features[1, 2] = bad
    assert_reject(stage(raw), staging.R_NOT_FINITE, "features")
    raw = raw_image()
    raw.boxes[0, 0] = bad
    assert_reject(stage(raw), staging.R_NOT_FINITE, "boxes")


def test_caption_ids_and_rejects():
    row = staging.stage_caption(RawCaption("img1", "  A dog.  ", "2", split="test", locator="caps:7"),
                                collection="c", source="caps")
    assert row["text"] == "A dog."
    assert row["caption_id"] == schema.make_item_id("c", "caption", schema.caption_source_id("img1", "2"))
    assert row["image_item_id"] == schema.make_item_id("c", "image", "img1")
    assert set(schema.CAPTION_COLUMNS) <= set(row)
    ok = staging.stage_caption(RawCaption("img1", "caf\xe9".encode("utf-8"), "0"), collection="c")
    assert ok["text"] == "caf\xe9"
    bad = staging.stage_caption(RawCaption("img1", b"caf\xe9 \xff", "0", locator="caps:9"), collection="c",
                                source="caps")
    assert_reject(bad, staging.R_NOT_UTF8, "img1")
    assert bad.kind == "caption" and bad.locator == "caps:9"
    for text in ("", "   \t", b"  "):
        assert_reject(staging.stage_caption(RawCaption("img1", text, "0"), collection="c"), staging.R_EMPTY_CAPTION)
    unknown = staging.unknown_image_reject(row, "img1")
    assert unknown.reason.startswith(staging.R_UNKNOWN_IMAGE + ": ") and "img1" in unknown.reason
    assert unknown.locator == "caps:7" and unknown.kind == "caption"


def test_duplicates_keep_smallest_locator_deterministically():
    rows = [stage(raw_image(locator=f"f.tsv:{i}")) for i in (10, 9, 11)]
    for order in (rows, rows[::-1]):
        kept, rejects = staging.resolve_duplicates(order)
        assert [r[staging.K_LOCATOR] for r in kept] == ["f.tsv:9"]  # natural order: 9 < 10
        assert sorted(r.locator for r in rejects) == ["f.tsv:10", "f.tsv:11"]
        for r in rejects:
            assert r.reason.startswith(staging.R_DUPLICATE + ": ") and "first seen at f.tsv:9" in r.reason


def test_hash_collisions_are_detected():
    a = stage(raw_image(source_id="a"))
    b = dict(stage(raw_image(source_id="b")), item_id=a["item_id"])  # forge a collision
    kept, rejects = staging.resolve_duplicates([a, b])
    assert len(kept) == 1 and rejects[0].reason.startswith(staging.R_ID_COLLISION)
    found = staging.find_id_collisions([(1, ("x", "image", "a")), (1, ("x", "image", "a")), (1, ("y", "image", "a")),
                                        (2, ("x", "caption", "q"))])
    assert found == [{"item_id": 1, "first": ["x", "image", "a"], "second": ["y", "image", "a"]}]


def test_shards_are_deterministic_and_sorted():
    rows = [stage(raw_image(n=1 + i % 3, source_id=f"s{i}")) for i in range(7)]
    b1 = image_shard_parquet(rows, F)
    assert b1 == image_shard_parquet(rows[::-1], F)
    table = pq.read_table(io.BytesIO(b1))
    ids = table.column("item_id").to_pylist()
    assert ids == sorted(ids) and table.schema.metadata[schema.META_FEATURE_DIM] == str(F).encode()
    h1, m1 = image_shard_hdf5(rows, "float16", feature_shard="features/x.h5")
    assert (h1, m1) == image_shard_hdf5(rows[::-1], "float16", feature_shard="features/x.h5")
    caps = [staging.stage_caption(RawCaption(f"s{i}", f"t{i}", "0"), collection="c") for i in range(5)]
    assert caption_shard_parquet(caps) == caption_shard_parquet(caps[::-1])


def test_float_arrays_are_not_dictionary_encoded():
    """A dictionary over float features overflows and falls back to plain pages: it only costs time (reads of
    a 100k-benchmark shard were 3.5x slower). Scalar columns keep their dictionaries."""
    rows = [stage(raw_image(n=2, source_id=f"s{i}")) for i in range(3)]
    meta = pq.ParquetFile(io.BytesIO(image_shard_parquet(rows, F, "float16"))).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema.split(".")[0]: meta.column(i).encodings
                 for i in range(meta.num_columns)}
    for column in ("features", "boxes"):
        assert not any("DICTIONARY" in e for e in encodings[column]), (column, encodings[column])
    assert any("DICTIONARY" in e for e in encodings["collection"])


def test_source_summary_counts_and_warnings():
    s = staging.source_summary(fmt="butd_tsv", path="x.tsv", records_in=10, staged=8,
                               rejects=["wrong feature dim: 3", "zero regions: x"], shards=[], expected=9,
                               rejects_file="rejects/c-images.jsonl", expected_key="c.expected_images")
    assert s["rejected"] == 2 and s["reject_reasons"] == {"wrong feature dim": 1, "zero regions": 1}
    assert s["warnings"] == ["expected 9 records but staged 8 (the manifest's check: set c.expected_images=8, "
                             "or null to drop it)"]
    assert staging.in_equals_line("c images", s) == "c images: 10 in = 8 staged + 2 rejected"


def test_source_summary_checks_each_split_and_counts_skipped_images():
    s = staging.source_summary(fmt="butd_tsv", path="x.tsv", records_in=20, staged=14, rejects=["zero regions: x"],
                               shards=[], expected={"train": 8, "val": 3, "test": 3}, rejects_file="r.jsonl",
                               skipped=5, staged_by_split={"train": 8, "val": 2, "test": 4},
                               expected_key="coco.expected_images")
    assert s["skipped"] == 5 and s["staged_by_split"] == {"test": 4, "train": 8, "val": 2}
    assert s["warnings"] == [
        "expected 3 in split 'test' but staged 4 (the manifest's check: set coco.expected_images.test=4, or "
        "coco.expected_images=null to drop the checks)",
        "expected 3 in split 'val' but staged 2 (the manifest's check: set coco.expected_images.val=2, or "
        "coco.expected_images=null to drop the checks)"]
    assert staging.in_equals_line("coco images", s) == \
        "coco images: 20 in = 14 staged + 1 rejected + 5 skipped (no caption names them) [test: 4, train: 8, val: 2]"
    lost = staging.source_summary(fmt="butd_tsv", path="x.tsv", records_in=20, staged=14, rejects=[], shards=[],
                                  expected=None, rejects_file="r.jsonl", skipped=5)
    assert lost["warnings"] == ["records_in 20 != staged 14 + rejected 0 + skipped 5"]


def test_an_image_takes_its_captions_split_or_is_skipped_or_rejected():
    raw = raw_image(source_id="42")
    assert staging.with_caption_split(raw, None, "x.tsv") is None  # no caption names it: skipped
    assert staging.with_caption_split(raw, frozenset({"val"}), "x.tsv").split == "val"
    rej = staging.with_caption_split(raw, frozenset({"val", "test"}), "x.tsv")
    assert isinstance(rej, Reject) and rej.kind == schema.KIND_IMAGE
    assert rej.reason.startswith(staging.R_SPLIT_CONFLICT + ": ") and "test, val" in rej.reason
    assert staging.split_counts([{"split": "a"}, {"split": None}, {"split": "a"}]) == {"a": 2, staging.NO_SPLIT: 1}


# ------------------------------------------------------------------------------------- feature spill
@pytest.mark.parametrize("dtype,compression", [("float32", None), ("float16", None), ("float16", "lzf")])
def test_feature_spill_round_trip_across_flushes(tmp_path, dtype, compression):
    rows = [stage(raw_image(n=n, source_id=f"img{n}")) for n in (3, 1, 5, 2)]
    path = str(tmp_path / "t.h5")
    spill = FeatureSpill(path, path, F, dtype, flush_regions=4, compression=compression)  # several partial flushes
    refs = [spill.append(r) for r in rows]
    spill.close()
    assert all("features" not in r and "boxes" not in r for r in refs)
    assert [r[K_SPILL_AT] for r in refs] == [0, 3, 4, 9]
    restored = load_spilled(list(reversed(refs)))[::-1]
    np_dtype = np.float16 if dtype == "float16" else np.float32
    for r, orig in zip(restored, rows):
        assert set(r) == set(orig)  # the pointer keys are gone, the arrays are back
        np.testing.assert_array_equal(r["features"], orig["features"].astype(np_dtype))
        np.testing.assert_array_equal(r["boxes"], orig["boxes"])
        assert r["features"].dtype == np_dtype and r["item_id"] == orig["item_id"]
    # rows that never went through a spill pass unchanged
    assert load_spilled([rows[0]])[0] is rows[0]


def test_spilled_rows_read_back_exactly_by_row_number_across_flushes(tmp_path):
    """The rows a read task spills (what the staging shuffles point into) come back equal, types included
    (None, big ints, unicode), in the order asked, however they were flushed."""
    path = str(tmp_path / "rows.h5")
    spill = FeatureSpill(path, path, F, flush_rows=3)
    rows = [{"caption_id": 2**62 + i, "text": f"caf\u00e9 n\u00b0{i}", "split": None if i % 2 else "test",
             staging.K_LOCATOR: f"f.json:{i}"} for i in range(8)]
    numbers = [spill.add_row(r) for r in rows]
    spill.close()
    assert numbers == list(range(8))
    order = [5, 0, 7, 5, 2]  # any order, repeats allowed
    assert load_spilled_rows([(path, n) for n in order]) == [rows[n] for n in order]
    other = str(tmp_path / "other.h5")
    spill2 = FeatureSpill(other, other, F)
    spill2.add_row({"x": 1})
    spill2.close()
    assert load_spilled_rows([(other, 0), (path, 1)]) == [{"x": 1}, rows[1]]

"""Readers: every format written in its exact real layout, read back value for value; bad records become
Rejects (or a clear error for a whole unreadable file); the real files when present."""
from __future__ import annotations

import base64
import gzip
import io
import json
import os
import pickle
from collections import Counter

import numpy as np
import pytest
import torch

from retrieval_core.data import readers
from retrieval_core.data.readers import features as feature_readers
from retrieval_core.data.schema import KIND_CAPTION, KIND_IMAGE, RawCaption, RawImage, Reject
from tests.conftest import require_realdata

RNG = np.random.default_rng(0)


def b64(arr: np.ndarray) -> bytes:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=np.float32).tobytes())


def by_type(records):
    good = [r for r in records if not isinstance(r, Reject)]
    bad = [r for r in records if isinstance(r, Reject)]
    return good, bad


# ------------------------------------------------------------------------------------------ BUTD TSV
def butd_row(image_id, w, h, boxes, feats, extra=()) -> bytes:
    fields = [str(image_id).encode(), str(w).encode(), str(h).encode(), str(len(boxes)).encode(), b64(boxes),
              b64(feats)]
    return b"\t".join(fields + list(extra))


def test_butd_tsv_round_trip(tmp_path):
    rows = []
    for image_id, n in ((391895, 36), (60623, 10), (42, 1)):
        boxes = RNG.uniform(0, 500, (n, 4)).astype(np.float32)
        feats = RNG.standard_normal((n, 2048)).astype(np.float32)
        rows.append((image_id, 640, 480, boxes, feats))
    path = tmp_path / "feats.tsv"
    path.write_bytes(b"\n".join(butd_row(*r) for r in rows) + b"\n")
    got = list(readers.read_butd_tsv(str(path), split="test"))
    assert len(got) == 3 and all(isinstance(g, RawImage) for g in got)
    for g, (image_id, w, h, boxes, feats) in zip(got, rows):
        assert g.source_id == str(image_id) and (g.image_w, g.image_h) == (w, h)
        assert g.num_boxes == len(boxes) and g.box_format == "xyxy" and g.split == "test"
        np.testing.assert_array_equal(g.boxes, boxes)
        np.testing.assert_array_equal(g.features, feats)
        assert g.confidences is None
    assert got[1].locator == f"{path}:2"


def test_butd_tsv_extra_columns_and_confidences(tmp_path):
    n = 5
    boxes, feats = RNG.uniform(0, 100, (n, 4)), RNG.standard_normal((n, 16))
    conf, cls_prob = RNG.uniform(0.2, 1, n), RNG.uniform(0, 1, (n, 1601))
    columns = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features", "cls_prob", "objects_conf")
    path = tmp_path / "adaptive.tsv"
    path.write_bytes(butd_row("img_7", 100, 90, boxes, feats, [b64(cls_prob), b64(conf)]) + b"\n")
    (g,) = readers.read_butd_tsv(str(path), columns=columns)
    np.testing.assert_array_equal(g.confidences, conf.astype(np.float32))
    np.testing.assert_array_equal(g.features, feats.astype(np.float32))
    assert g.num_boxes == n and g.source_id == "img_7"
    # the default column list does not fit 8 columns: a Reject, not a crash
    (r,) = readers.read_butd_tsv(str(path))
    assert isinstance(r, Reject) and "found 8" in r.reason and r.kind == KIND_IMAGE
    with pytest.raises(ValueError, match="include"):
        list(readers.read_butd_tsv(str(path), columns=("image_id", "boxes", "features")))


def test_butd_tsv_bad_records_are_rejected_and_reading_goes_on(tmp_path):
    n, f = 4, 9  # 3 rows of 9 values do not split into 4 regions
    boxes, feats = RNG.uniform(0, 50, (n, 4)), RNG.standard_normal((n, f))
    good = butd_row(1, 60, 60, boxes, feats)
    truncated = good[: len(good) - 7]  # cut inside the features column
    fields = good.split(b"\t")
    wrong_cols = b"\t".join(fields[:5])
    bad_b64 = b"\t".join(fields[:4] + [b"!!notbase64!!", fields[5]])
    short_feats = butd_row(5, 60, 60, boxes, feats[:3])  # 3*9 values for num_boxes=4
    fewer_boxes = b"\t".join([b"6", b"60", b"60", b"4", b64(boxes[:3]), b64(feats)])
    not_number = b"\t".join([b"7", b"wide", b"60"] + fields[3:])
    lines = [good, truncated, wrong_cols, bad_b64, b"", short_feats, fewer_boxes, not_number,
             good.replace(b"1", b"9", 1)]
    path = tmp_path / "bad.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    got = list(readers.read_butd_tsv(str(path)))
    assert len(got) == len(lines)
    kinds = ["ok" if isinstance(g, RawImage) else "rej" for g in got]
    assert kinds == ["ok", "rej", "rej", "rej", "rej", "rej", "ok", "rej", "ok"]
    reasons = {g.locator.rsplit(":", 1)[1]: g.reason for g in got if isinstance(g, Reject)}
    assert "not a whole number" in reasons["2"] or "base64" in reasons["2"]
    assert "found 5" in reasons["3"]
    assert "base64" in reasons["4"]
    assert "empty line" in reasons["5"]
    assert "not a multiple of num_boxes=4" in reasons["6"]
    assert "image_w" in reasons["8"]
    # boxes for 3 regions but 4 declared: parsed faithfully, the declared count travels to the stager
    assert got[6].num_boxes == 4 and got[6].boxes.shape == (3, 4)
    assert all(g.source == str(path) for g in got if isinstance(g, Reject))


# ------------------------------------------------------------------------------------------- npz
def test_bua_npz_both_orientations_and_bad_files(tmp_path):
    n, f = 12, 32
    x, bbox = RNG.standard_normal((n, f)).astype(np.float32), RNG.uniform(0, 300, (n, 4)).astype(np.float32)
    info = np.array({"objects_conf": np.ones(n)}, dtype=object)  # the pickled dict the real files carry
    np.savez_compressed(tmp_path / "100.npz", x=x, bbox=bbox, num_bbox=n, image_h=375, image_w=500, info=info)
    np.savez_compressed(tmp_path / "200.npz", x=x.T, bbox=bbox, num_bbox=n, image_h=375, image_w=500)
    np.savez_compressed(tmp_path / "300.npz", x=x, bbox=bbox, image_h=375, image_w=500)  # no num_bbox
    (tmp_path / "400.npz").write_bytes(b"PK\x03\x04 truncated zip")
    tasks = readers.plan_read_tasks("c", KIND_IMAGE, "bua_npz", str(tmp_path), {}, f)
    assert [os.path.basename(t.path) for t in tasks] == ["100.npz", "200.npz", "300.npz", "400.npz"]
    got = [r for t in tasks for r in readers.read_task(t)]
    for g, sid in zip(got[:2], ("100", "200")):
        assert isinstance(g, RawImage) and g.source_id == sid and g.num_boxes == n
        assert (g.image_w, g.image_h, g.box_format) == (500, 375, "xyxy")
        np.testing.assert_array_equal(g.features, x)
        np.testing.assert_array_equal(g.boxes, bbox)
    assert isinstance(got[2], Reject) and "num_bbox" in got[2].reason
    assert isinstance(got[3], Reject) and "not a readable npz" in got[3].reason


def test_uniter_npz_float16_area_column_and_source_id_pattern(tmp_path):
    n = 9
    feats = RNG.standard_normal((n, 2048)).astype(np.float16)
    nb = RNG.uniform(0, 1, (n, 6)).astype(np.float32)
    nb7 = np.concatenate([nb, nb[:, 4:5] * nb[:, 5:6]], axis=1)
    conf = RNG.uniform(0, 1, (n, 1)).astype(np.float32)
    soft = RNG.uniform(0, 1, (n, 1601)).astype(np.float32)
    path = tmp_path / "coco_test2014_000000391895.npz"
    np.savez(path, features=feats, norm_bb=nb7, conf=conf, soft_labels=soft)
    (g,) = readers.read_uniter_npz(str(path), source_id_pattern=r"(\d+)$")
    assert g.source_id == "391895" and g.box_format == "normalized6" and (g.image_w, g.image_h) == (0, 0)
    assert g.features.dtype == np.float16 and g.num_boxes is None
    np.testing.assert_array_equal(g.features, feats)
    np.testing.assert_array_equal(g.boxes, nb)
    np.testing.assert_array_equal(g.confidences, conf[:, 0])
    (plain,) = readers.read_uniter_npz(str(path))
    assert plain.source_id == "coco_test2014_000000391895"
    (r,) = readers.read_uniter_npz(str(path), source_id_pattern=r"val(\d+)$")
    assert isinstance(r, Reject) and "source_id_pattern" in r.reason
    np.savez(tmp_path / "nofeat.npz", norm_bb=nb, conf=conf)
    (r,) = readers.read_uniter_npz(str(tmp_path / "nofeat.npz"))
    assert isinstance(r, Reject) and "features" in r.reason and r.locator.endswith("nofeat.npz")


def test_plain_npz_sizes_from_options_keys_and_image_files(tmp_path):
    from PIL import Image

    n = 6
    feats, boxes = RNG.standard_normal((n, 64)).astype(np.float32), RNG.uniform(0, 90, (n, 4)).astype(np.float32)
    np.savez(tmp_path / "a.npz", features=feats, boxes=boxes)
    np.savez(tmp_path / "b.npz", features=feats, boxes=boxes, image_w=120, image_h=100, conf=np.arange(n))
    Image.new("RGB", (150, 110)).save(tmp_path / "a.png")
    (g,) = readers.read_plain_npz(str(tmp_path / "a.npz"), image_w=200, image_h=90)
    assert (g.image_w, g.image_h, g.box_format, g.confidences) == (200, 90, "xyxy", None)
    np.testing.assert_array_equal(g.features, feats)
    np.testing.assert_array_equal(g.boxes, boxes)
    (g,) = readers.read_plain_npz(str(tmp_path / "a.npz"), image_dir=str(tmp_path))
    assert (g.image_w, g.image_h) == (150, 110)
    (g,) = readers.read_plain_npz(str(tmp_path / "b.npz"), image_w=1, image_h=1)  # keys win
    assert (g.image_w, g.image_h) == (120, 100)
    np.testing.assert_array_equal(g.confidences, np.arange(n))
    (r,) = readers.read_plain_npz(str(tmp_path / "b.npz").replace("b.npz", "a.npz"), image_dir=str(tmp_path / "x"))
    assert isinstance(r, Reject) and "no image a.jpg" in r.reason
    (g,) = readers.read_plain_npz(str(tmp_path / "a.npz"))
    assert (g.image_w, g.image_h) == (0, 0)  # unknown size: the stager rejects pixel boxes without one


def test_image_header_parser_matches_pil(tmp_path, realdata):
    from PIL import Image

    Image.new("RGB", (37, 23)).save(tmp_path / "x.png")
    Image.new("RGB", (41, 29)).save(tmp_path / "x.jpg", quality=80)
    jpgs = sorted((realdata / "allennlp_vision_fixtures" / "images").glob("*/*.jpg"))
    for p in [tmp_path / "x.png", tmp_path / "x.jpg"] + jpgs:
        with open(p, "rb") as f:
            assert feature_readers._header_size(f, str(p)) == Image.open(p).size, p


# ------------------------------------------------------------------------------------------- OSCAR
class NotATensor:
    """Something only a full (unsafe) unpickle could rebuild."""


def test_oscar_pt_round_trip_and_refuses_pickles(tmp_path):
    a = torch.randn(10, 2048 + 6)
    b = torch.randn(3, 2048 + 6, dtype=torch.float16)
    path = tmp_path / "test_img_frcnn_feats.pt"
    torch.save({391895: a, 42: b, 7: torch.randn(4)}, path)
    got = list(readers.read_oscar_pt(str(path), split="test"))
    good, bad = by_type(got)
    assert [g.source_id for g in good] == ["42", "391895"]
    np.testing.assert_array_equal(good[1].features, a[:, :2048].numpy())
    np.testing.assert_array_equal(good[1].boxes, a[:, 2048:].numpy())
    assert good[0].features.dtype == np.float16 and good[0].box_format == "normalized6"
    assert len(bad) == 1 and bad[0].locator.endswith(":7") and "(4,)" in bad[0].reason

    evil = tmp_path / "evil.pt"
    torch.save({1: NotATensor()}, evil)
    with pytest.raises(ValueError, match="unpickle"):
        list(readers.read_oscar_pt(str(evil)))
    with open(tmp_path / "plain.pkl", "wb") as f:  # a bare pickle, not even a torch archive
        pickle.dump({1: NotATensor()}, f)
    with pytest.raises(ValueError, match="unpickle|not a readable torch file"):
        list(readers.read_oscar_pt(str(tmp_path / "plain.pkl")))
    torch.save(torch.zeros(2, 8), tmp_path / "tensor.pt")
    with pytest.raises(ValueError, match="expected a dict"):
        list(readers.read_oscar_pt(str(tmp_path / "tensor.pt")))
    with pytest.raises(FileNotFoundError):
        list(readers.read_oscar_pt(str(tmp_path / "missing.pt")))


# ---------------------------------------------------------------------------------- Karpathy JSON
def test_karpathy_json(tmp_path):
    doc = {"images": [
        {"filepath": "val2014", "filename": "COCO_val2014_000000391895.jpg", "cocoid": 391895, "imgid": 0,
         "split": "test", "sentids": [10, 11],
         "sentences": [{"raw": "A man riding a moped.", "sentid": 10, "tokens": ["a", "man"], "imgid": 0},
                       {"raw": "RAWBYTES", "sentid": 11, "tokens": [], "imgid": 0}]},
        {"filename": "COCO_val2014_000000000042.jpg", "cocoid": 42, "imgid": 1, "split": "restval",
         "sentences": [{"raw": " Two dogs. ", "sentid": 12}, {"sentid": 13, "tokens": ["x"]}]},
        {"filename": "COCO_val2014_000000000043.jpg", "cocoid": 43, "imgid": 2, "split": "val",
         "sentences": [{"raw": "A cat.", "sentid": 14}]},
    ], "dataset": "coco"}
    text = json.dumps(doc).encode().replace(b"RAWBYTES", b"caf\xe9 au lait")  # a latin-1 byte: not UTF-8
    path = tmp_path / "dataset_coco.json"
    path.write_bytes(text)
    got = list(readers.read_karpathy_json(str(path)))
    good, bad = by_type(got)
    assert [(g.image_source_id, g.caption_key, g.split) for g in good] == [
        ("391895", "10", "test"), ("391895", "11", "test"), ("42", "12", "train"), ("43", "14", "val")]
    assert good[0].text == "A man riding a moped." and good[2].text == "Two dogs." and good[0].lang == "en"
    assert good[1].text == b"caf\xe9 au lait"  # undecodable: bytes, for the stager to reject
    assert len(bad) == 1 and "raw" in bad[0].reason and bad[0].kind == KIND_CAPTION
    assert bad[0].locator.endswith("images[1].sentences[1]")
    test_only = list(readers.read_karpathy_json(str(path), split="test"))
    assert {c.image_source_id for c in test_only} == {"391895"}
    train = list(readers.read_karpathy_json(str(path), split="train"))
    assert {c.image_source_id for c in train if isinstance(c, RawCaption)} == {"42"}
    stems = list(readers.read_karpathy_json(str(path), split="val", image_id="filename_stem"))
    assert stems[0].image_source_id == "COCO_val2014_000000000043"
    flickr = {"images": [{"filename": "1000092795.jpg", "imgid": 0, "split": "test",
                          "sentences": [{"raw": "Two young guys.", "sentid": 0}]}]}
    (tmp_path / "dataset_flickr30k.json").write_text(json.dumps(flickr))
    (c,) = readers.read_karpathy_json(str(tmp_path / "dataset_flickr30k.json"))
    assert c.image_source_id == "1000092795"
    (tmp_path / "broken.json").write_text('{"images": [')
    with pytest.raises(ValueError, match="not valid JSON"):
        list(readers.read_karpathy_json(str(tmp_path / "broken.json")))


def _karpathy_splits_file(tmp_path):
    doc = {"images": [{"cocoid": i, "filename": f"COCO_val2014_{i:012d}.jpg", "split": split,
                       "sentences": [{"raw": f"caption {i}", "sentid": 10 * i}]}
                      for i, split in enumerate(["train", "restval", "val", "test", "restval"], start=1)]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("restval, split, want", [
    ("train", None, {"1": "train", "2": "train", "3": "val", "4": "test", "5": "train"}),
    ("restval", None, {"1": "train", "2": "restval", "3": "val", "4": "test", "5": "restval"}),
    ("skip", None, {"1": "train", "3": "val", "4": "test"}),
    ("train", "restval", {"1": "train", "2": "train", "5": "train"}),  # restval counts as train
    ("restval", "train", {"1": "train"}),  # the 82,783 of train2014 only
    ("train", ["val", "test"], {"3": "val", "4": "test"}),
])
def test_karpathy_json_restval_and_split_lists(tmp_path, restval, split, want):
    got = list(readers.read_karpathy_json(_karpathy_splits_file(tmp_path), split=split, restval=restval))
    assert {c.image_source_id: c.split for c in got} == want


def test_karpathy_json_bad_restval_or_split_is_a_clear_error(tmp_path):
    path = _karpathy_splits_file(tmp_path)
    with pytest.raises(ValueError, match="restval must be one of train, restval, skip"):
        list(readers.read_karpathy_json(path, restval="drop"))
    with pytest.raises(ValueError, match="split must be a split name or a list"):
        list(readers.read_karpathy_json(path, split=[]))


def test_caption_image_splits_names_each_captioned_image_with_its_splits(tmp_path):
    path = _karpathy_splits_file(tmp_path)
    got = readers.caption_image_splits("c", "karpathy_json", path, {"split": ["train", "test"]})
    assert got == {"1": frozenset({"train"}), "2": frozenset({"train"}), "4": frozenset({"test"}),
                   "5": frozenset({"train"})}
    # two caption files putting one image in two splits: both splits are reported (the stager rejects it)
    (tmp_path / "a_caps.txt").write_text("one\n")
    (tmp_path / "a_ids.txt").write_text("7\n")
    (tmp_path / "b_caps.txt").write_text("two\n")
    (tmp_path / "b_ids.txt").write_text("7\n")
    lines = [{"path": str(tmp_path / f"{x}_caps.txt"), "ids_path": str(tmp_path / f"{x}_ids.txt"), "split": x}
             for x in "ab"]
    merged = {}
    for spec in lines:
        for sid, splits in readers.caption_image_splits("c", "caption_lines", spec["path"],
                                                        {"ids_path": spec["ids_path"], "split": spec["split"]}).items():
            merged.setdefault(sid, set()).update(splits)
    assert merged == {"7": {"a", "b"}}
    with pytest.raises(ValueError, match="synthetic captions describe every generated image"):
        readers.caption_image_splits("c", "synthetic", None, {})
    (tmp_path / "empty.json").write_text('{"images": []}')
    with pytest.raises(readers.EmptySourceError):
        readers.caption_image_splits("c", "karpathy_json", str(tmp_path / "empty.json"), {})
    assert readers.caption_image_splits("c", "karpathy_json", str(tmp_path / "empty.json"), {}, allow_empty=True) == {}


# ---------------------------------------------------------------------------------- caption lines
def test_caption_lines_with_mapping_rejects_and_length_check(tmp_path):
    caps = [b"a dog .", b"a brown dog .", b"", b"caf\xe9", b"a cat ."]
    ids = [b"25", b"25", b"25", b"34", b"34"]
    (tmp_path / "test_caps.txt").write_bytes(b"\n".join(caps) + b"\n")
    (tmp_path / "test_ids.txt").write_bytes(b"\r\n".join(ids) + b"\r\n")  # CRLF ids still match
    (tmp_path / "id_mapping.json").write_text(json.dumps({"25": "1001545525.jpg", "34": "1002.jpg"}))
    got = list(readers.read_caption_lines(str(tmp_path / "test_caps.txt"),
                                          id_mapping=str(tmp_path / "id_mapping.json"), split="test"))
    assert [type(g).__name__ for g in got] == ["RawCaption", "RawCaption", "Reject", "RawCaption", "RawCaption"]
    assert [(g.image_source_id, g.caption_key) for g in got if isinstance(g, RawCaption)] == [
        ("1001545525", "0"), ("1001545525", "1"), ("1002", "0"), ("1002", "1")]
    assert got[2].locator.endswith("test_caps.txt:3") and "empty" in got[2].reason
    assert got[3].text == b"caf\xe9" and got[4].text == "a cat ." and got[4].split == "test"
    plain = list(readers.read_caption_lines(str(tmp_path / "test_caps.txt")))
    assert plain[0].image_source_id == "25"
    (tmp_path / "short_ids.txt").write_bytes(b"25\n")
    with pytest.raises(ValueError, match="5 lines but ids file"):
        list(readers.read_caption_lines(str(tmp_path / "test_caps.txt"), ids_path=str(tmp_path / "short_ids.txt")))
    (tmp_path / "id_mapping.json").write_text(json.dumps({"25": "x.jpg"}))
    got = list(readers.read_caption_lines(str(tmp_path / "test_caps.txt"),
                                          id_mapping=str(tmp_path / "id_mapping.json")))
    assert isinstance(got[-1], Reject) and "not in id_mapping" in got[-1].reason


# ------------------------------------------------------------------------------ Flickr30k Entities
def test_flickr30k_entities_markup(tmp_path):
    lines = ["[/EN#18/people A man] in [/EN#19/clothing/other an orange hat] starring at [/EN#0/notvisual something] .",
             "[/EN#20/other # 8] runs .", "", "[/EN#21/people broken markup ."]
    (tmp_path / "1000092795.txt").write_text("\n".join(lines) + "\n")
    got = list(readers.read_flickr30k_entities(str(tmp_path / "1000092795.txt")))
    assert got[0] == RawCaption("1000092795", "A man in an orange hat starring at something .", "0", "en", None,
                                f"{tmp_path / '1000092795.txt'}:1")
    assert got[1].text == "# 8 runs ." and got[1].caption_key == "1"
    assert isinstance(got[2], Reject) and "empty" in got[2].reason
    assert isinstance(got[3], Reject) and "markup" in got[3].reason


# ---------------------------------------------------------------------------- Conceptual Captions
def test_cc_tsv(tmp_path):
    rows = [b"author : a life in photography\thttps://x/1.jpg", b"a caption without url", b"\thttps://x/3.jpg",
            b"an angler fishes river\thttps://x/4.jpg"]
    (tmp_path / "val.tsv").write_bytes(b"\n".join(rows))  # no final newline, like the real file
    got = list(readers.read_cc_tsv(str(tmp_path / "val.tsv")))
    assert [type(g).__name__ for g in got] == ["RawCaption", "Reject", "Reject", "RawCaption"]
    assert (got[0].image_source_id, got[0].text, got[0].caption_key) == ("0", "author : a life in photography", "0")
    assert (got[3].image_source_id, got[3].caption_key) == ("3", "3")
    assert "2 tab-separated" in got[1].reason
    by_url = [g for g in readers.read_cc_tsv(str(tmp_path / "val.tsv"), image_id="url") if isinstance(g, RawCaption)]
    assert [g.image_source_id for g in by_url] == ["https://x/1.jpg", "https://x/4.jpg"]


# ---------------------------------------------------------------------------------------- Multi30k
def test_multi30k_task1_and_task2(tmp_path):
    images = ["1007129816.jpg", "1009434119.jpg", "COCO_train2014_000000117071.jpg#367178"]
    (tmp_path / "images.txt").write_text("\n".join(images) + "\n")
    for k in (1, 2):
        caps = [f"Der Mann {k}.", f"Ein Hund läuft {k}.", f"Ein Bus {k}."]
        (tmp_path / f"test_2016.{k}.de.gz").write_bytes(gzip.compress(("\n".join(caps) + "\n").encode()))
    (tmp_path / "test_2016_flickr.cs").write_bytes("Muž v oranžovém klobouku.\n\nBus.\n".encode())
    tasks = readers.plan_read_tasks("m30k", KIND_CAPTION, "multi30k", str(tmp_path / "test_2016.*.de.gz"),
                                    {"image_list": str(tmp_path / "images.txt"), "source_id_pattern": r"(\d+)$"}, 0)
    got = [r for t in tasks for r in readers.read_task(t)]
    assert [(g.image_source_id, g.caption_key, g.lang) for g in got] == [
        ("1007129816", "1.de", "de"), ("1009434119", "1.de", "de"), ("117071", "1.de", "de"),
        ("1007129816", "2.de", "de"), ("1009434119", "2.de", "de"), ("117071", "2.de", "de")]
    assert got[1].text == "Ein Hund läuft 1."
    cs = list(readers.read_multi30k(str(tmp_path / "test_2016_flickr.cs"), image_list=str(tmp_path / "images.txt")))
    assert cs[0].lang == "cs" and cs[0].caption_key == "0.cs" and isinstance(cs[1], Reject)
    assert cs[2].image_source_id == "COCO_train2014_000000117071"
    # English keys carry no language (as the synthetic captions'): an image's en, de and cs captions stay distinct
    (tmp_path / "test_2016.1.en").write_text("A man.\nA dog runs.\nA bus.\n")
    en = list(readers.read_multi30k(str(tmp_path / "test_2016.1.en"), image_list=str(tmp_path / "images.txt")))
    assert [(g.caption_key, g.lang) for g in en] == [("1", "en")] * 3
    (tmp_path / "two.txt").write_text("a.jpg\nb.jpg\n")
    with pytest.raises(ValueError, match="image list"):
        list(readers.read_multi30k(str(tmp_path / "test_2016.1.de.gz"), image_list=str(tmp_path / "two.txt")))


# ---------------------------------------------------------------------------------------- dispatch
def test_plan_read_tasks_validation_and_picklable_tasks(tmp_path):
    np.savez(tmp_path / "b.npz", features=np.zeros((2, 4), np.float32), boxes=np.zeros((2, 4), np.float32))
    np.savez(tmp_path / "a.npz", features=np.ones((1, 4), np.float32), boxes=np.ones((1, 4), np.float32))
    tasks = readers.plan_read_tasks("c", KIND_IMAGE, "plain_npz", [str(tmp_path / "*.npz"), str(tmp_path / "a.npz")],
                                    {"image_w": 10, "image_h": 10, "detector_resize": [800, 1333]}, 4)
    assert [os.path.basename(t.path) for t in tasks] == ["a.npz", "b.npz"]
    restored = pickle.loads(pickle.dumps(tasks))
    assert restored == tasks and len({hash(t) for t in tasks}) == 2
    assert dict(tasks[0].options)["detector_resize"] == (800, 1333)
    assert [r.source_id for t in restored for r in readers.read_task(t)] == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        readers.plan_read_tasks("c", KIND_IMAGE, "plain_npz", str(tmp_path / "nothing_here*.npz"), {}, 4)
    with pytest.raises(ValueError, match="does not take option"):
        readers.plan_read_tasks("c", KIND_IMAGE, "plain_npz", str(tmp_path), {"imagew": 3}, 4)
    with pytest.raises(ValueError, match="unknown image format"):
        readers.plan_read_tasks("c", KIND_IMAGE, "karpathy_json", str(tmp_path), {}, 4)
    with pytest.raises(ValueError, match="needs option"):
        readers.plan_read_tasks("c", KIND_CAPTION, "multi30k", str(tmp_path / "a.npz"), {}, 4)
    with pytest.raises(ValueError, match="kind"):
        readers.plan_read_tasks("c", "video", "plain_npz", str(tmp_path), {}, 4)
    assert set(readers.IMAGE_READERS) == {"butd_tsv", "bua_npz", "uniter_npz", "oscar_pt", "plain_npz", "image_files"}
    assert set(readers.CAPTION_READERS) == {"karpathy_json", "caption_lines", "flickr30k_entities", "cc_tsv",
                                            "multi30k"}


def test_local_file_access_refuses_urls_with_a_clear_error(tmp_path):
    """The readers' default file access is local: a gs:// path is an error saying what to pass (the pipelines
    pass Beam FileSystems), never the local file "gs:/b/..." or one record's reject."""
    msg = "gs://b/x.tsv is a URL: .*pass files=<a FileAccess for URLs>.*pipelines.files.BEAM_FILES"
    with pytest.raises(readers.URLAccessError, match=msg):
        readers.plan_read_tasks("c", KIND_IMAGE, "butd_tsv", "gs://b/x.tsv", {}, 4)
    with pytest.raises(ValueError, match=msg):  # URLAccessError is a ValueError: CLIs report it in one line
        list(readers.read_butd_tsv("gs://b/x.tsv"))
    with pytest.raises(readers.URLAccessError, match="gs://b/feats is a URL"):
        readers.list_inputs(["gs://b/feats"], "bua_npz")
    # a URL option of a local input: the setup error propagates instead of becoming a per-record reject
    np.savez(tmp_path / "a.npz", features=np.ones((1, 4), np.float32), boxes=np.ones((1, 4), np.float32))
    with pytest.raises(readers.URLAccessError, match="gs://b/imgs"):
        list(readers.read_plain_npz(str(tmp_path / "a.npz"), image_dir="gs://b/imgs"))
    (tmp_path / "a_caps.txt").write_text("a dog\n")
    with pytest.raises(readers.URLAccessError, match="gs://b/ids.txt"):
        list(readers.read_caption_lines(str(tmp_path / "a_caps.txt"), ids_path="gs://b/ids.txt"))
    # local inputs keep their messages
    with pytest.raises(FileNotFoundError, match="input file not found: .*missing.tsv"):
        list(readers.read_butd_tsv(str(tmp_path / "missing.tsv")))


def test_synthetic_tasks_cover_the_collection_in_chunks():
    synthetic = pytest.importorskip("retrieval_core.data.synthetic.spec", reason="no synthetic generator")
    options = {"num_images": 23}
    try:
        spec = synthetic.SyntheticSpec.from_options("syn", options, 16)
    except (TypeError, ValueError) as e:
        pytest.skip(f"synthetic options differ from the assumed {options}: {e}")
    tasks = readers.plan_read_tasks("syn", KIND_IMAGE, readers.SYNTHETIC, None, options, 16, chunk_size=10)
    assert [(t.start, t.stop) for t in tasks] == [(0, 10), (10, 20), (20, 23)]
    images = [r for t in pickle.loads(pickle.dumps(tasks)) for r in readers.read_task(t)]
    assert len(images) == spec.num_images == 23 and all(isinstance(r, RawImage) for r in images)
    assert len({r.source_id for r in images}) == 23
    captions = [r for t in readers.plan_read_tasks("syn", KIND_CAPTION, readers.SYNTHETIC, None, options, 16, 10)
                for r in readers.read_task(t)]
    assert captions and {c.image_source_id for c in captions} == {r.source_id for r in images}


# -------------------------------------------------------------------------------------- real files
def test_real_region_features_npz_with_image_sizes():
    root = require_realdata("allennlp_vision_fixtures")
    tasks = readers.plan_read_tasks("fixtures", KIND_IMAGE, "plain_npz", str(root / "region_features_npz"),
                                    {"image_dir": str(root / "images" / "*"), "detector_resize": (800, 1333)}, 1024)
    got = [r for t in tasks for r in readers.read_task(t)]
    assert len(got) == 12 and all(isinstance(g, RawImage) for g in got)
    assert "1339" in {g.source_id for g in got} and "COCO_val2014_000000262148" in {g.source_id for g in got}
    assert {g.features.shape[1] for g in got} == {1024}
    assert min(len(g.features) for g in got) == 7 and max(len(g.features) for g in got) == 98
    for g in got:
        assert g.boxes.shape == (len(g.features), 4) and g.image_w > 0 and g.image_h > 0
        # in the detector's resized frame every box fits the image ...
        assert g.boxes[:, 2].max() <= g.image_w and g.boxes[:, 3].max() <= g.image_h, g.source_id
    # ... while the original image sizes are far too small for these boxes (hence detector_resize)
    tasks = readers.plan_read_tasks("f", KIND_IMAGE, "plain_npz", str(root / "region_features_npz"),
                                    {"image_dir": str(root / "images" / "*")}, 1024)
    raw = [r for t in tasks for r in readers.read_task(t)]
    assert sum(g.boxes[:, 2].max() > g.image_w for g in raw) >= 6


def test_real_laps_karpathy_ids():
    coco = require_realdata("laps_karpathy_ids", "data", "coco", "testall_caps.txt")
    got = list(readers.read_caption_lines(str(coco), split="test"))
    assert len(got) == 25000 and all(isinstance(g, RawCaption) for g in got)
    per_image = Counter(g.image_source_id for g in got)
    assert len(per_image) == 5000 and set(per_image.values()) == {5}
    assert got[0].image_source_id == "391895" and {g.caption_key for g in got} == {"0", "1", "2", "3", "4"}
    f30k = require_realdata("laps_karpathy_ids", "data", "f30k", "test_caps.txt")
    got = list(readers.read_caption_lines(str(f30k), id_mapping=str(f30k.parent / "id_mapping.json")))
    assert len(got) == 5000 and all(isinstance(g, RawCaption) for g in got)
    per_image = Counter(g.image_source_id for g in got)
    assert len(per_image) == 1000 and set(per_image.values()) == {5}
    assert got[0].image_source_id == "1007129816"  # LAPS id 25 -> 1007129816.jpg, Multi30k's first test image


def test_real_conceptual_captions_val():
    path = require_realdata("conceptual_captions_val", "Validation_GCC-1.1.0-Validation.tsv")
    got = list(readers.read_cc_tsv(str(path)))
    assert len(got) == 15833 and all(isinstance(g, RawCaption) for g in got)
    assert got[-1].image_source_id == "15832" and len({g.image_source_id for g in got}) == 15833


def test_real_multi30k_task2_de_matches_laps_f30k_images():
    root = require_realdata("multi30k", "data", "task2")
    tasks = readers.plan_read_tasks("m30k", KIND_CAPTION, "multi30k", str(root / "raw" / "test_2016.*.de.gz"),
                                    {"image_list": str(root / "image_splits" / "test_2016_images.txt")}, 0)
    assert len(tasks) == 5
    got = [r for t in tasks for r in readers.read_task(t)]
    assert len(got) == 5000 and all(isinstance(g, RawCaption) and g.lang == "de" for g in got)
    keys = Counter(g.image_source_id for g in got)
    assert len(keys) == 1000 and set(keys.values()) == {5}
    assert {g.caption_key for g in got} == {"1.de", "2.de", "3.de", "4.de", "5.de"}
    f30k = require_realdata("laps_karpathy_ids", "data", "f30k", "test_caps.txt")
    laps = readers.read_caption_lines(str(f30k), id_mapping=str(f30k.parent / "id_mapping.json"))
    assert {c.image_source_id for c in laps} == set(keys)  # the two sources agree on image ids


def test_real_flickr30k_entities_sentences():
    root = require_realdata("allennlp_vision_fixtures", "flickr30k", "sentences")
    tasks = readers.plan_read_tasks("f30k", KIND_CAPTION, "flickr30k_entities", str(root), {}, 0)
    got = [r for t in tasks for r in readers.read_task(t)]
    assert len(tasks) == 5 and len(got) == 25 and all(isinstance(g, RawCaption) for g in got)
    assert all("[/EN#" not in g.text and "]" not in g.text for g in got)
    assert got[0].text.startswith("A girl with brown hair sits on the edge of a cement area overlooking water")


# ------------------------------------------------------------------------- never a silent wrong result
def test_undecodable_ids_are_rejects_never_replaced(tmp_path):
    """Two ids that differ only in bytes that are not UTF-8 used to be decoded with U+FFFD and collide (one then
    rejected as a 'duplicate' of an image it is not): each is now a reject saying why."""
    boxes, feats = np.zeros((1, 4), np.float32) + [0, 0, 5, 5], np.ones((1, 8), np.float32)
    tsv = tmp_path / "feats.tsv"
    tsv.write_bytes(b"\n".join(butd_row("ID", 10, 10, boxes, feats).replace(b"ID", raw, 1)
                               for raw in (b"caf\xe9", b"caf\xe8", b"cafe")) + b"\n")
    good, bad = by_type(list(readers.read_butd_tsv(str(tsv))))
    assert [g.source_id for g in good] == ["cafe"]
    assert len(bad) == 2 and all(r.reason.startswith("id not UTF-8: ") for r in bad)
    assert "b'caf\\xe9'" in bad[0].reason and bad[0].locator == f"{tsv}:1"

    (tmp_path / "t_caps.txt").write_bytes(b"a dog .\na cat .\n")
    (tmp_path / "t_ids.txt").write_bytes(b"1\xff\n1\xfe\n")
    got = list(readers.read_caption_lines(str(tmp_path / "t_caps.txt")))
    assert all(isinstance(g, Reject) and g.reason.startswith("id not UTF-8") for g in got)

    (tmp_path / "cc.tsv").write_bytes(b"a dog\thttps://x/\xe9.jpg\na cat\thttps://x/2.jpg\n")
    by_url = list(readers.read_cc_tsv(str(tmp_path / "cc.tsv"), image_id="url"))
    assert isinstance(by_url[0], Reject) and "image URL" in by_url[0].reason
    assert by_url[1].image_source_id == "https://x/2.jpg"
    by_line = list(readers.read_cc_tsv(str(tmp_path / "cc.tsv")))  # line ids never read the URL
    assert [g.image_source_id for g in by_line] == ["0", "1"]

    (tmp_path / "imgs.txt").write_bytes(b"caf\xe9.jpg\ncafe.jpg\n")
    (tmp_path / "m.en").write_bytes(b"A dog.\nA cat.\n")
    got = list(readers.read_multi30k(str(tmp_path / "m.en"), image_list=str(tmp_path / "imgs.txt")))
    assert isinstance(got[0], Reject) and got[0].reason.startswith("id not UTF-8") and got[1].image_source_id == "cafe"

    doc = json.dumps({"images": [
        {"filename": "FNAME.jpg", "split": "test", "sentences": [{"raw": "a dog", "sentid": 1}]},
        {"filename": "ok.jpg", "split": "test", "sentences": [{"raw": "a cat", "sentid": 2}]}]})
    (tmp_path / "k.json").write_bytes(doc.encode().replace(b"FNAME", b"caf\xe9"))
    got = list(readers.read_karpathy_json(str(tmp_path / "k.json"), image_id="filename_stem"))
    assert isinstance(got[0], Reject) and "b'caf\\xe9'" in got[0].reason and got[1].image_source_id == "ok"

    # file names: the npz readers' and Flickr30k Entities' ids are file stems (os.listdir's surrogateescape)
    npz_dir = tmp_path / "npz"
    npz_dir.mkdir()
    for name in (b"im\xff.npz", b"im.npz"):
        with open(os.path.join(os.fsencode(npz_dir), name), "wb") as f:
            np.savez(f, features=feats, boxes=boxes, image_w=10, image_h=10)
    tasks = readers.plan_read_tasks("c", KIND_IMAGE, "plain_npz", str(npz_dir), {}, 8)
    good, bad = by_type([r for t in tasks for r in readers.read_task(t)])
    assert [g.source_id for g in good] == ["im"] and bad[0].reason == \
        "id not UTF-8: image id b'im\\xff' is not valid UTF-8 (replacing its bytes could make it equal to another id)"
    with open(os.path.join(os.fsencode(tmp_path), b"12\xff.txt"), "wb") as f:
        f.write(b"[/EN#1/people A man] runs .\n")
    (ent,) = readers.read_flickr30k_entities(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"12\xff.txt")))
    assert isinstance(ent, Reject) and ent.reason.startswith("id not UTF-8")


def test_an_input_file_without_records_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty.tsv").write_bytes(b"")
    (tmp_path / "blank.tsv").write_bytes(b"\n")  # one empty line: a record, rejected
    doc = {"images": [{"cocoid": 1, "split": "train", "sentences": [{"raw": "a dog", "sentid": 1}]}]}
    (tmp_path / "k.json").write_text(json.dumps(doc))
    (task,) = readers.plan_read_tasks("c", KIND_IMAGE, "butd_tsv", str(tmp_path / "empty.tsv"), {}, 8)
    with pytest.raises(readers.EmptySourceError, match=r"empty\.tsv: the butd_tsv reader found no image records"):
        list(readers.read_task(task))
    assert list(readers.read_task(task, allow_empty=True)) == []  # the explicit opt-out
    (task,) = readers.plan_read_tasks("c", KIND_IMAGE, "butd_tsv", str(tmp_path / "blank.tsv"), {}, 8)
    assert [type(r).__name__ for r in readers.read_task(task)] == ["Reject"]
    # an option that selects nothing is the common way to stage nothing by mistake
    (task,) = readers.plan_read_tasks("c", KIND_CAPTION, "karpathy_json", str(tmp_path / "k.json"),
                                      {"split": "test"}, 0)
    with pytest.raises(readers.EmptySourceError, match=r"k\.json.*options: split='test'"):
        list(readers.read_task(task))
    assert issubclass(readers.EmptySourceError, ValueError)  # the CLIs' one-line error


def _bua_npz(path, n, conf, info_extra=None):
    x, bbox = RNG.standard_normal((n, 8)).astype(np.float32), RNG.uniform(0, 100, (n, 4)).astype(np.float32)
    bbox[:, 2:] += bbox[:, :2] + 1
    # the dict bottom-up-attention.pytorch's extract_utils.save_roi_features writes
    info = {"image_id": os.path.basename(path), "image_h": 200, "image_w": 300, "num_boxes": n,
            "objects_id": np.arange(n), "objects_conf": conf, **(info_extra or {})}
    np.savez_compressed(path, x=x, bbox=bbox, num_bbox=n, image_h=200, image_w=300, info=info)
    return x


def test_bua_npz_keeps_regions_most_confident_first_from_info(tmp_path):
    from retrieval_core.data import staging
    conf = np.array([0.3, 0.9, 0.2, 0.7, 0.5], np.float32)
    x = _bua_npz(tmp_path / "7.npz", 5, conf)
    (img,) = readers.read_bua_npz(str(tmp_path / "7.npz"))
    np.testing.assert_allclose(img.confidences, conf)
    row = staging.stage_image(img, collection="c", feature_dim=8, max_regions=3, source="s")
    np.testing.assert_array_equal(row["features"], x[[1, 3, 4]])  # the 3 most confident, in that order
    # numpy 1.x (the tool's era) pickled with protocol 3 and named numpy.core.multiarray
    import zipfile

    from numpy.lib import format as npy

    with np.load(tmp_path / "7.npz", allow_pickle=False) as z:
        members = {k: z.zip.read(k + ".npy") for k in z.files if k != "info"}
    info = np.array({"objects_conf": conf}, dtype=object)
    buf = io.BytesIO()
    npy.write_array_header_1_0(buf, npy.header_data_from_array_1_0(info))
    buf.write(pickle.dumps(info, protocol=3).replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    assert b"cnumpy.core.multiarray\n_reconstruct" in buf.getvalue()
    with zipfile.ZipFile(tmp_path / "8.npz", "w") as zf:
        for k, data in {**members, "info": buf.getvalue()}.items():
            zf.writestr(k + ".npy", data)
    (old,) = readers.read_bua_npz(str(tmp_path / "8.npz"))
    np.testing.assert_allclose(old.confidences, conf)


def test_bua_npz_info_is_never_unpickled_beyond_numpy(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    x = np.zeros((2, 8), np.float32)
    np.savez(tmp_path / "9.npz", x=x, bbox=np.ones((2, 4), np.float32), num_bbox=2, image_h=10, image_w=10,
             info=np.array({"objects_conf": Payload()}, dtype=object))
    (rej,) = readers.read_bua_npz(str(tmp_path / "9.npz"))
    assert isinstance(rej, Reject) and "refusing to unpickle posix.mkdir" in rej.reason
    assert not marker.exists()

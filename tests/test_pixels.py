"""Pixels in: the EfficientNet-Lite0 backbone against its ImageNet weights, every kind of bad or unusual image
file converted or rejected with its reason, staging a folder of images through pipelines.stage, and the
backbone fingerprint that keeps a model from reading features of another source."""
from __future__ import annotations

import io
import json
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from retrieval_core.data.pixels import decode
from retrieval_core.data.pixels.backbone import (
    FeatureSourceError,
    GridSpec,
    cached_backbone,
    check_same_features,
    grid_boxes,
)
from tests.conftest import require_realdata


def _png(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", **kw)
    return buf.getvalue()


def _jpeg(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", **kw)
    return buf.getvalue()


def _scene(w=64, h=48) -> Image.Image:
    """Left half red, right half blue: orientation and colour survive decoding visibly."""
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:, : w // 2] = (220, 20, 20)
    arr[:, w // 2:] = (20, 20, 220)
    return Image.fromarray(arr)


def _bomb_png(w: int, h: int) -> bytes:
    """A valid 1x1 PNG whose header declares w x h pixels (a decompression bomb's header, without the bytes)."""
    data = bytearray(_png(Image.new("L", (1, 1))))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr:ihdr + 8] = struct.pack(">II", w, h)
    crc = zlib.crc32(bytes(data[ihdr - 4:ihdr + 13])) & 0xFFFFFFFF
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


def _exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    return _jpeg(_scene(64, 48), exif=exif.tobytes())


#: name -> (file bytes, the conversions or the reject category expected)
CASES = {
    "rgb.jpg": (lambda: _jpeg(_scene()), ()),
    "grey.png": (lambda: _png(_scene().convert("L")), (decode.C_GREY,)),
    "palette.png": (lambda: _png(_scene().convert("P", palette=Image.Palette.ADAPTIVE)), (decode.C_PALETTE,)),
    "alpha.png": (lambda: _png(_scene().convert("RGBA")), (decode.C_ALPHA,)),
    "cmyk.jpg": (lambda: _jpeg(_scene().convert("CMYK")), (decode.C_CMYK,)),
    "deep16.png": (lambda: _png(Image.fromarray((np.arange(48 * 64).reshape(48, 64) * 20).astype(np.uint16))),
                   (decode.C_16BIT, decode.C_GREY)),  # 16-bit greyscale: both
    "rotated.jpg": (_exif_rotated, (decode.C_EXIF,)),
    "tiny.png": (lambda: _png(_scene(1, 1)), ()),
    "wide.jpg": (lambda: _jpeg(_scene(1500, 40)), ()),
    "empty.jpg": (lambda: b"", decode.R_EMPTY),
    "notes.jpg": (lambda: b"these are my holiday notes, not a picture\n", decode.R_NOT_IMAGE),
    "truncated.jpg": (lambda: _jpeg(_scene(256, 256), quality=95)[:400], decode.R_CORRUPT),
    "corrupt.png": (lambda: _png(_scene())[:60] + bytes(range(256)) * 4, decode.R_CORRUPT),
    "bomb.png": (lambda: _bomb_png(100_000, 100_000), decode.R_TOO_LARGE),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_file_is_converted_or_rejected_with_its_reason(name):
    make, expected = CASES[name]
    try:
        out = decode.decode_image(make(), 224)
    except decode.DecodeError as exc:
        assert isinstance(expected, str), f"{name} rejected: {exc}"
        assert exc.category == expected and str(exc).startswith(expected + ": ")
        return
    assert not isinstance(expected, str), f"{name} should be rejected ({expected})"
    assert out.conversions == expected
    assert out.pixels.shape == (224, 224, 3) and out.pixels.dtype == np.uint8
    if name == "rotated.jpg":  # displayed upright: 48 wide, 64 high, red on top (was the left half)
        assert (out.width, out.height) == (48, 64)
        assert out.pixels[20, 112, 0] > 150 > out.pixels[20, 112, 2]
        assert out.pixels[200, 112, 2] > 150 > out.pixels[200, 112, 0]
    if name == "deep16.png":  # scaled from 16 bits, not clipped to white
        assert 30 < out.pixels.mean() < 225
    if name == "alpha.png":
        assert out.pixels[10, 10, 0] > 150


def test_absurd_dimensions_follow_the_limit():
    with pytest.raises(decode.DecodeError, match="absurd dimensions: 1500 x 40"):
        decode.decode_image(CASES["wide.jpg"][0](), 224, max_pixels=10_000)


def test_grid_boxes_cover_the_picture_coarse_first():
    boxes = grid_boxes(GridSpec((7, 1, 3)))
    assert boxes.shape == (1 + 9 + 49, 6)
    assert boxes[0].tolist() == [0, 0, 1, 1, 1, 1]
    np.testing.assert_allclose(boxes[1:10, 4].min(), 3 / 7)  # adaptive pooling 7 -> 3 averages 3 cells
    np.testing.assert_allclose(boxes[10:, 4], 1 / 7)
    np.testing.assert_allclose(boxes[:, 2] - boxes[:, 0], boxes[:, 4], atol=1e-6)
    with pytest.raises(ValueError):
        GridSpec((8,))


def test_a_larger_input_gives_a_finer_final_map_and_exact_thirds():
    """``input_size`` 288: a 9 x 9 final map, so a 3 x 3 grid's cells are exact thirds of the picture (at 224 they
    overlap); its features are the reference model's at that size, under another fingerprint; sizes that are no
    multiple of the stride, and grids finer than the map, are refused."""
    import torch
    import torch.nn.functional as F

    from retrieval_core.data.pixels.backbone import fingerprint

    spec = GridSpec((1, 3), input_size=288)
    assert spec.final_grid == 9 and fingerprint(spec)["preprocessing"]["input"] == 288
    assert fingerprint(spec)["fingerprint"] != fingerprint(GridSpec((1, 3)))["fingerprint"]
    np.testing.assert_allclose(grid_boxes(spec)[1:, 4], 1 / 3, atol=1e-6)
    assert grid_boxes(GridSpec((9,), input_size=288)).shape == (81, 6)
    for bad in (300, 0, True, "big"):
        with pytest.raises(ValueError, match="input_size must be a multiple of 32"):
            GridSpec((1,), input_size=bad)
    with pytest.raises(ValueError, match=r"grids must be sizes in 1..7 \(the final map's side at a 224"):
        GridSpec((9,))
    backbone = cached_backbone((1, 3), "cpu", "float32", ("stage6", "head"), "none", 288)
    pixels = np.stack([np.asarray(_scene(288, 288).rotate(a)) for a in (0, 90)])
    got = backbone.regions(pixels)
    assert got.shape == (2, 10, 192 + 1280)
    with torch.inference_mode():
        fmap = backbone.model.features((torch.from_numpy(pixels).permute(0, 3, 1, 2).float() - 127.0) / 128.0)
        assert fmap.shape[-1] == 9
        ref = torch.cat([F.adaptive_avg_pool2d(fmap, g).flatten(2) for g in (1, 3)], 2).transpose(1, 2).numpy()
    np.testing.assert_allclose(got[..., 192:], ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"expected \(N, 288, 288, 3\)"):
        backbone.regions(pixels[:, :224, :224])


def test_lite0_names_real_photos_sensibly():
    """The model definition matches the weights: ImageNet top-1 on real photos is the right object."""
    root = require_realdata("allennlp_vision_fixtures", "images")
    backbone = cached_backbone((7,), "cpu")
    import torch

    expect = {"flickr30k/6338542128.jpg": {560},  # American football: football helmet
              "gqa/2405722.jpg": {89},  # a white cockatoo: sulphur-crested cockatoo
              "gqa/2331963.jpg": {981}}  # baseball: ballplayer
    pixels = np.stack([decode.decode_image((root / f).read_bytes(), 224).pixels for f in expect])
    with torch.inference_mode():
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float()
        top1 = backbone.model((x - 127.0) / 128.0).argmax(-1).tolist()
    assert [t in e for t, e in zip(top1, expect.values())] == [True] * len(expect), top1


def test_fused_backbone_gives_the_reference_features_and_bf16_another_fingerprint():
    """The fused float32 path (ReLU6 and residual adds inside the convolutions, SAME padding without a padded
    copy, chunks on parallel single-threaded streams) is the reference model's arithmetic; bfloat16 changes the
    features, so it has its own fingerprint."""
    import torch
    import torch.nn.functional as F

    from retrieval_core.data.pixels.backbone import fingerprint
    from retrieval_core.precision import cpu_has_native_bf16

    pictures = [_scene(224, 224).rotate(a) for a in (0, 90, 180, 270, 45)]
    pixels = np.stack([np.asarray(p) for p in pictures * 2])  # two CPU chunks, one per thread
    backbone = cached_backbone((1, 3), "cpu")
    with torch.inference_mode():
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float()
        fmap = backbone.model.features((x - 127.0) / 128.0)  # the plain modules: pad copies, separate ReLU6
        ref = torch.cat([F.adaptive_avg_pool2d(fmap, g).flatten(2) for g in (1, 3)], 2).transpose(1, 2).numpy()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        np.testing.assert_allclose(backbone.regions(pixels), ref, atol=1e-4, rtol=1e-4)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    fp32, bf16 = fingerprint(GridSpec((1, 3))), fingerprint(GridSpec((1, 3), "bfloat16"))
    assert "precision" not in fp32 and bf16["precision"] == "bfloat16" and fp32["fingerprint"] != bf16["fingerprint"]
    with pytest.raises(ValueError, match="precision must be one of"):
        GridSpec((1,), "float16")
    if cpu_has_native_bf16():
        got = cached_backbone((1, 3), "cpu", "bfloat16").regions(pixels)
        cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert cos.min() > 0.95 and np.abs(got - ref).max() > 1e-3  # close, yet not float32's features


def test_layers_concatenate_stage_maps_under_their_own_fingerprint():
    """``layers``: the chosen maps' cells side by side (a stride-8 map averaged to the 7 x 7 cells first), each
    equal to the reference model's map; the head alone keeps the fingerprint it had before the option."""
    import torch
    import torch.nn.functional as F

    from retrieval_core.data.pixels.backbone import fingerprint
    from retrieval_core.data.pixels.lite0 import STAGE_ENDS

    spec = GridSpec((3, 1), layers=("head", "stage3"))
    assert spec.layers == ("stage3", "head") and spec.feature_dim == 40 + 1280
    for bad in (("stage8",), ("head", "head"), ()):
        with pytest.raises(ValueError, match="layers must be distinct names"):
            GridSpec((1,), layers=bad)
    head, both = fingerprint(GridSpec((1, 3))), fingerprint(spec)
    assert "layers" not in head and head["feature_dim"] == 1280
    assert both["layers"]["maps"] == ["stage3", "head"] and both["feature_dim"] == 1320
    assert both["fingerprint"] != head["fingerprint"]
    pixels = np.stack([np.asarray(_scene(224, 224).rotate(a)) for a in (0, 90)])
    got = cached_backbone((1, 3), "cpu", "float32", ("stage3", "head")).regions(pixels)
    assert got.shape == (2, 10, 1320)
    np.testing.assert_allclose(got[..., 40:], cached_backbone((1, 3), "cpu").regions(pixels), atol=1e-5)
    model = cached_backbone((1, 3), "cpu").model
    with torch.inference_mode():
        x = F.relu6(model._bn0(model._conv_stem((torch.from_numpy(pixels).permute(0, 3, 1, 2).float() - 127) / 128)))
        for block in model._blocks[:STAGE_ENDS[2] + 1]:
            x = block(x)
        assert x.shape[-1] == 28
        x = F.avg_pool2d(x, 4)
        ref = torch.cat([F.adaptive_avg_pool2d(x, g).flatten(2) for g in (1, 3)], 2).transpose(1, 2).numpy()
    np.testing.assert_allclose(got[..., :40], ref, atol=1e-4, rtol=1e-4)
    # cell_norm unit: each map's part of a cell centred and scaled to unit length on its own, another fingerprint
    normed = GridSpec((1, 3), layers=("stage3", "head"), cell_norm="unit")
    assert fingerprint(normed)["fingerprint"] != both["fingerprint"] and "cell_norm" not in both
    with pytest.raises(ValueError, match="cell_norm must be one of"):
        GridSpec((1,), cell_norm="batch")
    z = cached_backbone((1, 3), "cpu", "float32", normed.layers, "unit").regions(pixels)
    for part, raw in ((z[..., :40], got[..., :40]), (z[..., 40:], got[..., 40:])):
        centred = raw - raw.mean(-1, keepdims=True)
        np.testing.assert_allclose(part, centred / np.linalg.norm(centred, axis=-1, keepdims=True), atol=1e-4)


def test_a_manifest_must_declare_its_layers_width(tmp_path):
    from pipelines.stage.plan import StageError, image_backbone
    from retrieval_core.data.manifest import load_manifest

    path = photo_manifest(tmp_path, str(tmp_path), str(tmp_path / "captions.json"))
    text = open(path).read().replace("      batch_size: 4\n", "      batch_size: 4\n      layers: [stage3, stage4]\n")
    open(path, "w").write(text)
    with pytest.raises(StageError, match=r"layers \['stage3', 'stage4'\] give 120-d features.*set feature_dim: 120"):
        image_backbone(load_manifest(path))
    open(path, "w").write(text.replace("feature_dim: 1280", "feature_dim: 120"))
    assert image_backbone(load_manifest(path))["feature_dim"] == 120


def test_features_from_another_source_are_refused():
    check_same_features("", "", "staged", "model")
    check_same_features("ab" * 32, "ab" * 32, "staged", "model")
    for staged, model in (("ab" * 32, ""), ("", "ab" * 32), ("ab" * 32, "cd" * 32)):
        with pytest.raises(FeatureSourceError, match="holds image features of .* but model was trained on"):
            check_same_features(staged, model, "staged", "model")


# ------------------------------------------------------------------------------ staging a folder of images
#: Files no caption names; the broken one is skipped, not rejected: it is never decoded.
UNCAPTIONED = {"zz-uncaptioned.jpg": lambda: _jpeg(_scene()), "zz-uncaptioned-broken.jpg": lambda: b"not a picture"}


def write_photo_folder(root) -> tuple[str, str]:
    """Every CASES file in root/photos plus a Karpathy JSON captioning them (train/dev/test by name), and the
    UNCAPTIONED files."""
    photos = root / "photos"
    photos.mkdir()
    (photos / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # hidden files are not inputs
    images = []
    for i, (name, (make, _)) in enumerate(sorted(CASES.items())):
        (photos / name).write_bytes(make())
        stem = name.rsplit(".", 1)[0]
        images.append({"filename": name, "split": ("train", "val", "test")[i % 3], "imgid": i,
                       "sentences": [{"raw": f"a picture called {stem} number {k}", "sentid": i * 10 + k}
                                     for k in range(2)]})
    for name, data in UNCAPTIONED.items():  # named by no caption: skipped unread (uncaptioned_images: skip)
        (photos / name).write_bytes(data())
    captions = root / "captions.json"
    captions.write_text(json.dumps({"images": images}))
    return str(photos), str(captions)


def photo_manifest(root, photos: str, captions: str, grids=(1, 3)) -> str:
    path = root / "photos.yaml"
    path.write_text(f"""name: photos
feature_dim: 1280
collections:
  photos:
    images:
      format: image_files
      path: {photos}
      grids: {list(grids)}
      batch_size: 4
    captions:
      format: karpathy_json
      path: {captions}
      image_id: filename_stem
    uncaptioned_images: skip
""")
    return str(path)


@pytest.fixture(scope="module")
def photo_staged(tmp_path_factory):
    """A folder of every CASES file staged with its Karpathy captions: (output folder, summary)."""
    from pipelines.stage import run as stage_run
    from pipelines.stage.plan import StagePlan

    root = tmp_path_factory.mktemp("photos")
    photos, captions = write_photo_folder(root)
    manifest = photo_manifest(root, photos, captions)
    out = str(root / "staged")
    plan = StagePlan(out, manifest, max_reject_fraction=1.0, chunk_size=5)
    return out, stage_run.run(plan), plan


def test_stage_a_folder_of_images(photo_staged):
    from pipelines.stage import run as stage_run
    from retrieval_core.data.store import StagedDataset

    out, summary, plan = photo_staged
    images = summary["collections"]["photos"]["images"]
    rejected = {n for n, (_, e) in CASES.items() if isinstance(e, str)}
    assert images["skipped"] == len(UNCAPTIONED)
    assert images["records_in"] == len(CASES) + len(UNCAPTIONED) == images["staged"] + images["rejected"] + \
        images["skipped"]
    assert images["rejected"] == len(rejected)
    assert images["reject_reasons"] == {decode.R_EMPTY: 1, decode.R_NOT_IMAGE: 1, decode.R_CORRUPT: 2,
                                        decode.R_TOO_LARGE: 1}
    once = (decode.C_PALETTE, decode.C_ALPHA, decode.C_CMYK, decode.C_16BIT, decode.C_EXIF)
    assert images["converted"] == {decode.C_GREY: 2, **{c: 1 for c in once}}
    rejects = [json.loads(line) for line in open(f"{out}/rejects/photos-images.jsonl")]
    assert sorted(r["locator"].rsplit("/", 1)[-1] for r in rejects) == sorted(rejected)
    assert summary["image_backbone"]["name"] == "efficientnet-lite0"
    assert summary["image_backbone"]["grids"] == [1, 3]
    # where the backbone ran: the default --device auto resolved (the CPU here), printed and in summary.json
    assert json.loads(open(f"{out}/summary.json").read())["device"] == plan.device
    if plan.device == "cpu":
        assert "image backbone device: cpu (auto: torch sees no CUDA device)" in stage_run.report_lines(summary)
    caps = summary["collections"]["photos"]["captions"]  # a rejected image's captions have no image to join
    assert (caps["staged"], caps["rejected"]) == (2 * images["staged"], 2 * len(rejected))
    ds = StagedDataset(out)
    assert ds.image_backbone == summary["image_backbone"]["fingerprint"] and ds.feature_dim == 1280
    table = ds.load_images(collection="photos")
    assert len(table) == len(CASES) - len(rejected) and set(table.num_boxes()) == {10}
    feats, boxes = table.regions(0)
    assert feats.shape == (10, 1280) and np.isfinite(feats).all() and boxes[0].tolist() == [0, 0, 1, 1, 1, 1]
    # a rerun keeps every shard (resume): the same bytes
    again = stage_run.run(plan)
    assert again["resume"]["written"] == 0 and again["resume"]["kept"] > 0


def _model_folder(root, image_backbone: str, feature_dim: int = 1280) -> str:
    from retrieval_core.model.checkpoints import from_text_backbone
    from tests.helpers_model import write_tiny_bert

    model = from_text_backbone(write_tiny_bert(str(root / f"bert{image_backbone[:4]}")), feature_dim)
    model.cfg.image_backbone = image_backbone
    folder = str(root / f"model{image_backbone[:4]}")
    model.save(folder)
    return folder


def test_a_model_reads_only_the_features_it_was_trained_on(photo_staged, tmp_path):
    """encode, rerank and train refuse staged features of another backbone than the model's; the same backbone
    encodes."""
    from pipelines.encode.plan import EncodeError, EncodePlan
    from pipelines.encode.run import run as encode
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.model.checkpoints import inspect_model_folder
    from retrieval_core.training.model_init import build_model

    out, summary, _ = photo_staged
    fp = summary["image_backbone"]["fingerprint"]
    region_model = _model_folder(tmp_path, "")  # trained on extracted region features of the same width
    with pytest.raises(EncodeError, match="efficientnet-lite0 backbone .* was trained on extracted region"):
        encode(EncodePlan(out, region_model, str(tmp_path / "emb_refused"), modality="image"))
    with pytest.raises(FeatureSourceError):
        build_model(region_model, 1280, False, 0, image_backbone=fp)
    pixel_model = _model_folder(tmp_path, fp)
    inspect_model_folder(pixel_model).require_features(StagedDataset(out))
    assert build_model(pixel_model, 1280, False, 0, image_backbone=fp).cfg.image_backbone == fp
    report = encode(EncodePlan(out, pixel_model, str(tmp_path / "emb"), modality="image"))
    assert report is not None


def test_rendered_scenes_stage_and_encode_end_to_end(tmp_path):
    """Two families of demo scenes drawn, staged from their PNGs with their captions, and encoded."""
    from PIL import Image as PILImage

    from pipelines.encode.plan import EncodePlan
    from pipelines.encode.run import run as encode
    from pipelines.stage import run as stage_run
    from pipelines.stage.plan import StagePlan
    from retrieval_core.data.manifest import load_manifest
    from retrieval_core.data.synthetic.render import RenderPlan, render_scene, shape_of, write_collection
    from retrieval_core.data.synthetic.scenes import describe_scene
    from retrieval_core.data.synthetic.vocabulary import DOMAINS

    spec = load_manifest("demo").synthetic_spec("demo")
    assert len({shape_of("coco", n.name) for n in DOMAINS["coco"]}) == len(DOMAINS["coco"])  # a shape per class
    base, swap = describe_scene(spec, 0), describe_scene(spec, 2)
    assert swap["change"] == "binding"
    a, b = (np.asarray(render_scene(spec, i), np.int16) for i in (0, 2))
    assert (np.abs(a - b).sum(-1) > 0).mean() > 0.002  # the swapped colours are visible in pixels
    out = write_collection(RenderPlan(str(tmp_path / "rendered"), limit=9))
    assert out["images"] == 8 and out["captions"] == 40
    size = PILImage.open(tmp_path / "rendered" / "images" / f"{base['source_id']}.png").size
    assert size == (round(base["image_w"] / 2), round(base["image_h"] / 2))
    staged = str(tmp_path / "staged")
    summary = stage_run.run(StagePlan(staged, out["manifest"]))
    assert summary["problems"] == []
    images = summary["collections"]["demo"]["images"]
    assert images["staged"] == 8 and images["staged_by_split"] == {base["split"]: 8}
    backbone = summary["image_backbone"]
    # the render default: the stride-8 to stride-32 stages, each standardised per cell, read at 288 pixels
    assert backbone["layers"]["maps"] == ["stage3", "stage4", "stage5", "stage6", "stage7"] and "cell_norm" in backbone
    assert backbone["preprocessing"]["input"] == 288
    model = _model_folder(tmp_path, backbone["fingerprint"], backbone["feature_dim"])
    report = encode(EncodePlan(staged, model, str(tmp_path / "emb")))
    assert report is not None


def test_real_photos_stage_with_their_flickr30k_sentences(tmp_path, monkeypatch):
    """The real JPEGs of the AllenNLP fixtures with their Flickr30k Entities sentences: the captioned images are
    staged (byte-identical copies give identical regions), the others counted as skipped, none rejected."""
    from pipelines.stage import run as stage_run
    from pipelines.stage.plan import StagePlan
    from retrieval_core.data.store import StagedDataset

    fixtures = require_realdata("allennlp_vision_fixtures")
    monkeypatch.setenv("RR_DATA_ROOT", str(fixtures))  # the data lives outside the manifest's folder: name its root
    photos, sentences = fixtures / "images" / "flickr30k", fixtures / "flickr30k" / "sentences"
    manifest = tmp_path / "f30k_photos.yaml"
    manifest.write_text(f"""name: f30k_photos
feature_dim: 1280
collections:
  f30k:
    images: {{format: image_files, path: {photos}}}
    captions: {{format: flickr30k_entities, path: {sentences}, split: test}}
    uncaptioned_images: skip
""")
    out = str(tmp_path / "staged")
    summary = stage_run.run(StagePlan(out, str(manifest)))
    images = summary["collections"]["f30k"]["images"]
    n_jpegs, n_captioned = len(list(photos.glob("*.jpg"))), len(list(sentences.glob("*.txt")))
    assert (images["records_in"], images["staged"], images["skipped"], images["rejected"]) == \
        (n_jpegs, n_captioned, n_jpegs - n_captioned, 0)
    assert summary["problems"] == [] and summary["collections"]["f30k"]["captions"]["rejected"] == 0
    ds = StagedDataset(out)
    meta = ds.images_meta("f30k").set_index("source_id")
    assert (meta.loc["6338542128", ["image_w", "image_h"]] > 100).all()
    table = ds.load_images(collection="f30k")
    pos = {int(i): k for k, i in enumerate(table.item_ids)}
    by_sid = {sid: table.regions(pos[int(row.item_id)])[0] for sid, row in meta.iterrows()}
    np.testing.assert_array_equal(by_sid["1"], by_sid["4945942737"])  # the same bytes (PROVENANCE.md)
    assert np.abs(by_sid["1"] - by_sid["6338542128"]).mean() > 0.05


def test_parallel_decoding_gives_the_serial_records(tmp_path):
    from retrieval_core.data.readers.images import list_image_files, read_image_files

    photos, _ = write_photo_folder(tmp_path)
    paths = list_image_files(photos)
    assert not any(p.endswith(".DS_Store") for p in paths) and len(paths) == len(CASES) + len(UNCAPTIONED)
    paths = paths[:6]  # three staged, three rejected
    serial, threaded = (list(read_image_files(paths, grids=[1], batch_size=2, decode_threads=n)) for n in (0, 3))
    assert [type(r).__name__ + getattr(r, "locator", "") for r in serial] == \
        [type(r).__name__ + getattr(r, "locator", "") for r in threaded]
    for a, b in zip(serial, threaded):
        if hasattr(a, "features"):
            np.testing.assert_array_equal(a.features, b.features)


def test_unwanted_files_are_skipped_unread(tmp_path):
    """An image id the stager does not want is neither decoded nor run through the backbone: a broken file is
    Skipped, not a Reject, and no features are computed for it."""
    from retrieval_core.data.readers.images import list_image_files, read_image_files
    from retrieval_core.data.schema import RawImage, Skipped

    photos, _ = write_photo_folder(tmp_path)
    paths = [p for p in list_image_files(photos) if p.rsplit("/", 1)[-1] in ("rgb.jpg", *UNCAPTIONED)]
    out = list(read_image_files(paths, grids=[1], batch_size=2, wanted=lambda sid: not sid.startswith("zz-")))
    assert sorted(type(r).__name__ for r in out) == [RawImage.__name__, Skipped.__name__, Skipped.__name__]
    assert sorted(r.source_id for r in out if isinstance(r, Skipped)) == sorted(n[:-4] for n in UNCAPTIONED)


def test_dask_stages_the_photos_as_the_direct_runner(photo_staged, tmp_path):
    """The image_files source on DaskRunner (2 worker processes): the same images, rejects and conversions, and
    the same regions up to the float rounding of another torch thread count."""
    from pipelines.stage import run as stage_run
    from retrieval_core.data.store import StagedDataset
    from tests.helpers_dask import dask_args, local_cluster

    out, summary, plan = photo_staged
    with local_cluster() as cluster:
        dask_out = str(tmp_path / "dask")
        dask_summary = stage_run.run(replace(plan, output=dask_out), dask_args(cluster))
    assert dask_summary["runner"] == "DaskRunner"
    for key in ("records_in", "staged", "rejected", "skipped", "reject_reasons", "converted", "staged_by_split"):
        assert dask_summary["collections"]["photos"]["images"][key] == summary["collections"]["photos"]["images"][key]
    assert dask_summary["image_backbone"] == summary["image_backbone"]
    direct, dask = (StagedDataset(o).load_images(collection="photos") for o in (out, dask_out))
    np.testing.assert_array_equal(direct.item_ids, dask.item_ids)
    np.testing.assert_allclose(direct.features, dask.features, atol=1e-4)

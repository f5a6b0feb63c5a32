"""Staged shards written by retrieval_core.data.staging read back through retrieval_core.data.store.StagedDataset."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from retrieval_core.data import schema, staging
from retrieval_core.data.paths import LOCAL_FILES, URLAccessError
from retrieval_core.data.schema import RawCaption, RawImage
from retrieval_core.data.shards import caption_shard_parquet, image_shard_hdf5, image_shard_parquet
from retrieval_core.data.store import INCOMPLETE_FILE, StagedDataset, to_torch
from retrieval_core.errors import StagedDataError


class MemFiles:
    """A FileAccess for the test-only URL folder mem://staged: its paths are the files under ``root``."""

    def __init__(self, root):
        self.root, self.opened = str(root), []

    def _local(self, url: str) -> str:
        assert url.startswith("mem://staged/"), url
        return os.path.join(self.root, url[len("mem://staged/"):])

    def open(self, path: str):
        self.opened.append(path)
        return LOCAL_FILES.open(self._local(path))

    def exists(self, path: str) -> bool:
        return LOCAL_FILES.exists(self._local(path))

F = 16


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_rows(n_images=12, seed=0):
    rng = np.random.default_rng(seed)
    images, captions = [], []
    for i in range(n_images):
        n = int(rng.integers(1, 9))
        x1 = rng.uniform(0, 50, n)
        y1 = rng.uniform(0, 50, n)
        boxes = np.stack([x1, y1, x1 + rng.uniform(1, 50, n), y1 + rng.uniform(1, 50, n)], 1).astype(np.float32)
        raw = RawImage(f"im{i}", rng.standard_normal((n, F)).astype(np.float32), boxes, image_w=100, image_h=100,
                       split="test" if i % 3 == 0 else "train", locator=f"x:{i}")
        images.append(staging.stage_image(raw, collection="c", feature_dim=F, max_regions=50, source="x"))
        for k in range(2):
            cap = staging.stage_caption(RawCaption(f"im{i}", f"caption {k} of {i}", str(k), split=raw.split),
                                        collection="c")
            captions.append(cap)
    return images, captions


def write_staged(root, images, captions, feature_format="parquet", feature_dtype="float32", num_shards=3):
    """A staged dir laid out as pipelines.stage writes it (shards with their sha256 + summary.json)."""
    shards = {"images": [], "captions": [], "feature_shards": []}
    for idx in range(num_shards):
        rows = [r for r in images if r["item_id"] % num_shards == idx]
        caps = [c for c in captions if c["image_item_id"] % num_shards == idx]
        name = f"images/c-{idx:05d}-of-{num_shards:05d}.parquet"
        if feature_format == "hdf5":
            h5name = f"features/c-{idx:05d}-of-{num_shards:05d}.h5"
            h5, data = image_shard_hdf5(rows, feature_dtype, feature_dim=F, feature_shard=h5name)
            os.makedirs(root / "features", exist_ok=True)
            (root / h5name).write_bytes(h5)
            shards["feature_shards"].append({"name": h5name, "rows": len(rows), "sha256": sha256(h5)})
        else:
            data = image_shard_parquet(rows, F, feature_dtype)
        os.makedirs(root / "images", exist_ok=True)
        (root / name).write_bytes(data)
        shards["images"].append({"name": name, "rows": len(rows), "sha256": sha256(data)})
        cname = f"captions/c-{idx:05d}-of-{num_shards:05d}.parquet"
        os.makedirs(root / "captions", exist_ok=True)
        (root / cname).write_bytes(cdata := caption_shard_parquet(caps))
        shards["captions"].append({"name": cname, "rows": len(caps), "sha256": sha256(cdata)})
    summary = {"complete": True, "feature_dim": F, "feature_format": feature_format, "feature_dtype": feature_dtype,
               "collections": {"c": {"images": {"shards": shards["images"],
                                                "feature_shards": shards["feature_shards"]},
                                     "captions": {"shards": shards["captions"]}}}}
    (root / "summary.json").write_text(json.dumps(summary))
    return StagedDataset(str(root))


@pytest.fixture(scope="module")
def rows():
    return make_rows()


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_round_trip_features_and_boxes_exact(tmp_path, rows, fmt):
    images, captions = rows
    ds = write_staged(tmp_path, images, captions, fmt)
    by_id = {r["item_id"]: r for r in images}
    table = ds.load_images()
    assert table.item_ids.tolist() == sorted(by_id)
    for i, item_id in enumerate(table.item_ids):
        f, b = table.regions(i)
        np.testing.assert_array_equal(f, by_id[int(item_id)]["features"])
        np.testing.assert_array_equal(b, by_id[int(item_id)]["boxes"])
    assert table.features.dtype == np.float32 and table.boxes.dtype == np.float32

    wanted = [images[5]["item_id"], images[0]["item_id"], images[7]["item_id"]]
    sub = ds.load_images(wanted)
    assert sub.item_ids.tolist() == wanted
    np.testing.assert_array_equal(sub.regions(1)[0], images[0]["features"])
    with pytest.raises(KeyError, match="not staged"):
        ds.load_images([12345])

    test = ds.load_images(split="test")
    assert sorted(test.item_ids.tolist()) == sorted(r["item_id"] for r in images if r["split"] == "test")

    meta = ds.images_meta()
    assert "features" not in meta.columns and "boxes" not in meta.columns
    assert meta.item_id.tolist() == sorted(by_id)
    assert meta.num_boxes.tolist() == [by_id[i]["num_boxes"] for i in meta.item_id]


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_float16_within_tolerance(tmp_path, rows, fmt):
    images, captions = rows
    ds = write_staged(tmp_path, images, captions, fmt, "float16")
    table = ds.load_images()
    assert table.features.dtype == np.float32
    pos = table.position_of()
    for r in images:
        f, b = table.regions(pos[r["item_id"]])
        np.testing.assert_allclose(f, r["features"], rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(b, r["boxes"])  # boxes stay float32
    assert ds.load_images(dtype=np.float16).features.dtype == np.float16


def test_parquet_and_hdf5_layouts_give_identical_tables(tmp_path, rows):
    images, captions = rows
    a = write_staged(tmp_path / "a", images, captions, "parquet").load_images()
    b = write_staged(tmp_path / "b", images, captions, "hdf5").load_images()
    for name in ("item_ids", "offsets", "features", "boxes"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_batches_stream_all_images_once(tmp_path, rows, fmt):
    images, captions = rows
    ds = write_staged(tmp_path, images, captions, fmt)
    full = ds.load_images()
    batches = list(ds.iter_image_batches(5))
    assert [len(b) for b in batches] == [5, 5, 2]
    got = np.concatenate([b.item_ids for b in batches])
    assert sorted(got.tolist()) == full.item_ids.tolist()
    pos = full.position_of()
    for b in batches:
        for i, item_id in enumerate(b.item_ids):
            np.testing.assert_array_equal(b.regions(i)[0], full.regions(pos[int(item_id)])[0])
    assert sum(len(b) for b in ds.iter_image_batches(4, split="test")) == 4


def test_captions_and_gold_are_fresh(tmp_path, rows):
    images, captions = rows
    ds = write_staged(tmp_path, images, captions)
    caps = ds.captions()
    assert list(caps.columns) == list(schema.CAPTION_COLUMNS) and len(caps) == len(captions)
    cap2img, img2caps = ds.gold(split="test")
    assert len(img2caps) == 4 and all(len(v) == 2 for v in img2caps.values())
    assert all(cap2img[c] == i for i, cs in img2caps.items() for c in cs)
    cap2img.clear()
    assert len(ds.gold(split="test")[0]) == 8  # a caller's mutation does not leak


def test_to_torch_shares_memory(tmp_path, rows):
    ds = write_staged(tmp_path, *rows)
    t = to_torch(ds.load_images())
    assert tuple(t["features"].shape[1:]) == (F,) and t["offsets"][-1].item() == t["features"].shape[0]


def test_missing_or_incomplete_summary_is_a_clear_error(tmp_path, rows):
    with pytest.raises(StagedDataError, match="summary.json not found"):
        StagedDataset(str(tmp_path))
    ds = write_staged(tmp_path, *rows)
    summary = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").write_text(json.dumps(dict(summary, complete=False)))
    with pytest.raises(StagedDataError, match="unfinished"):
        StagedDataset(str(tmp_path))
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    os.remove(tmp_path / ds.summary["collections"]["c"]["images"]["shards"][0]["name"])
    with pytest.raises(StagedDataError, match="missing"):
        StagedDataset(str(tmp_path)).load_images()


def test_a_folder_holding_the_incomplete_marker_is_refused(tmp_path, rows):
    """pipelines.stage writes _INCOMPLETE before it replaces the first shard and deletes it after summary.json:
    a re-stage killed midway leaves the old summary (complete: true) beside a mixture of old and new shards."""
    write_staged(tmp_path, *rows)
    (tmp_path / INCOMPLETE_FILE).write_bytes(b"")
    with pytest.raises(StagedDataError, match=rf"{tmp_path} holds _INCOMPLETE: .* re-stage it") as err:
        StagedDataset(str(tmp_path))
    assert "\n" not in str(err.value)
    # URL folders: through the caller's file access
    files = MemFiles(tmp_path)
    with pytest.raises(StagedDataError, match="_INCOMPLETE"):
        StagedDataset("mem://staged", files=files)
    os.remove(tmp_path / INCOMPLETE_FILE)
    assert len(StagedDataset("mem://staged", files=files).load_images()) == len(rows[0])


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_shards_that_do_not_match_the_summary_checksums_are_refused(tmp_path, rows, fmt):
    """Another run's shard under the same name (same ids, other features: read silently before) and a flipped
    byte are both refused when the shard is first read, naming it and what to do."""
    ds = write_staged(tmp_path / "a", *rows, feature_format=fmt)
    other = make_rows(seed=1)  # same source ids, hence same item ids; other regions
    write_staged(tmp_path / "b", *other, feature_format=fmt)
    kind = "feature_shards" if fmt == "hdf5" else "shards"
    name = ds.summary["collections"]["c"]["images"][kind][0]["name"]
    shutil.copyfile(tmp_path / "b" / name, tmp_path / "a" / name)
    with pytest.raises(StagedDataError, match=rf"{name} does not match the sha256 .* mixes shards of different "
                                              rf"staging runs .* re-stage it"):
        StagedDataset(str(tmp_path / "a")).load_images()
    ds = write_staged(tmp_path / "c", *rows, feature_format=fmt)
    assert len(ds.load_images()) == len(rows[0])  # intact: read (and verified once per shard)
    path = tmp_path / "c" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StagedDataError, match="does not match the sha256"):
        StagedDataset(str(tmp_path / "c")).load_images()
    caption_shard = tmp_path / "c" / ds.summary["collections"]["c"]["captions"]["shards"][0]["name"]
    caption_shard.write_bytes(caption_shard.read_bytes() + b"\0")
    with pytest.raises(StagedDataError, match="does not match the sha256"):
        StagedDataset(str(tmp_path / "c")).captions()


@pytest.mark.parametrize("fmt", ["parquet", "hdf5"])
def test_url_paths_are_read_through_the_given_file_access(tmp_path, rows, fmt):
    """retrieval_core has no Beam: a URL path (gs://...) is read through the caller's file access (the
    pipelines pass Beam FileSystems), and without one it is a clear error instead of a hidden Beam import."""
    write_staged(tmp_path, *rows, feature_format=fmt)
    local = StagedDataset(str(tmp_path))
    files = MemFiles(tmp_path)
    opened = files.opened
    remote = StagedDataset("mem://staged", files=files)
    assert remote.summary == local.summary
    a, b = local.load_images(), remote.load_images()
    np.testing.assert_array_equal(a.item_ids, b.item_ids)
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.boxes, b.boxes)
    assert remote.captions().equals(local.captions())
    assert "mem://staged/summary.json" in opened and any(p.endswith(".parquet") for p in opened)
    with pytest.raises(URLAccessError, match="gs://bucket/staged"):
        StagedDataset("gs://bucket/staged")


def test_retrieval_core_never_imports_beam():
    """Layering (docs/ARCHITECTURE.md): retrieval_core is a plain library. No import of apache_beam (or of
    pipelines, which imports it, or of benchmarks, the floor above) anywhere in its source, lazy ones included;
    and importing every module and opening a URL path leaves apache_beam out of sys.modules."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for path in sorted((root / "retrieval_core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.split(".")[0] in ("apache_beam", "pipelines", "benchmarks")]
            assert not bad, f"{path.relative_to(root)}:{node.lineno} imports {bad}"
    code = (
        "import importlib, pkgutil, sys\n"
        "import retrieval_core\n"
        "for m in pkgutil.walk_packages(retrieval_core.__path__, 'retrieval_core.'):\n"
        "    importlib.import_module(m.name)\n"
        "from retrieval_core.data.paths import URLAccessError\n"
        "from retrieval_core.data.store import StagedDataset\n"
        "try:\n"
        "    StagedDataset('gs://bucket/staged')\n"
        "except URLAccessError:\n"
        "    pass\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in ('apache_beam', 'pipelines'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=str(root), capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(root)))
    assert res.returncode == 0, res.stderr

"""Manifest loading: every shipped manifest validates, errors name file + key, env/CLI overrides, paths."""
from __future__ import annotations

import os
import re
import textwrap

import pytest

from retrieval_core.data.manifest import env_path_var, list_shipped_manifests, load_manifest, resolve_manifest_path
from retrieval_core.data.manifest_spec import CAPTION_FORMATS, IMAGE_FORMATS, Manifest, ManifestError
from retrieval_core.data.synthetic.scenes import split_of
from tests.conftest import require_realdata

SHIPPED = {"demo", "synthetic_coco5k", "synthetic_f30k1k", "synthetic_cc14k", "synthetic_distractor20k",
           "synthetic_100k", "coco_5k", "flickr30k_1k", "cc_dev", "distractor_20k", "multi30k", "coco_karpathy",
           "flickr30k_karpathy"}


def test_shipped_manifests_all_load():
    assert SHIPPED <= set(list_shipped_manifests())
    for name in list_shipped_manifests():
        m = load_manifest(name, env={})
        assert isinstance(m, Manifest) and m.name == name and m.feature_dim > 0 and m.collections
        for c in m.collections.values():
            assert c.images.format in IMAGE_FORMATS and c.captions.format in CAPTION_FORMATS
            # a folder of the user's own photos (photos_karpathy) has no size to check against
            assert c.expected_captions is not None or c.images.format == "image_files"


def test_karpathy_manifests_check_the_karpathy_sizes_per_split():
    coco = load_manifest("coco_karpathy", env={}).collection("coco")
    assert coco.expected_images == {"train": 113287, "val": 5000, "test": 5000}
    assert coco.expected_total("images") == 123287 and coco.uncaptioned_images == "skip"
    assert coco.expected_captions == {"train": 5 * 113287, "val": 25000, "test": 25000}
    assert (coco.images.format, coco.captions.format, coco.captions.options) == \
        ("butd_tsv", "karpathy_json", {"restval": "train"})
    f30k = load_manifest("flickr30k_karpathy", env={}).collection("flickr30k")
    assert f30k.expected_images == {"train": 29000, "val": 1014, "test": 1000}
    assert f30k.expected_captions == {"train": 145000, "val": 5070, "test": 5000}
    # overrides: one split's check, another feature format, restval out of train
    m = load_manifest("coco_karpathy", ["coco.expected_images.train=82783", "coco.captions.restval=skip",
                                        "coco.images.format=bua_npz", "coco.images.path=/npz/"], env={})
    c = m.collection("coco")
    assert c.expected_images == {"train": 82783, "val": 5000, "test": 5000}
    assert c.captions.options["restval"] == "skip" and (c.images.format, c.images.path) == ("bua_npz", "/npz/")


@pytest.mark.parametrize("block, error", [
    ("expected_images: {}", "collections.c.expected_images: an empty mapping"),
    ("expected_images: {test: 0}", "collections.c.expected_images.test: must be a positive integer"),
    ("expected_images: [5]", "collections.c.expected_images: must be a positive integer"),
    ("uncaptioned_images: drop", "collections.c.uncaptioned_images: unknown value 'drop'"),
])
def test_expected_counts_and_uncaptioned_images_are_validated(tmp_path, block, error):
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(f"""\
        feature_dim: 8
        collections:
          c:
            images: {{format: butd_tsv, path: x.tsv}}
            captions: {{format: karpathy_json, path: d.json}}
            {block}
        """))
    with pytest.raises(ManifestError, match=re.escape(error)):
        load_manifest(str(path), env={})


def test_uncaptioned_images_skip_takes_the_split_from_the_captions(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent("""\
        feature_dim: 8
        collections:
          c:
            images: {format: butd_tsv, path: x.tsv, split: test}
            captions: {format: karpathy_json, path: d.json}
            uncaptioned_images: skip
          syn:
            images: {format: synthetic, num_images: 4}
            captions: {format: synthetic}
        """))
    with pytest.raises(ManifestError, match=r"collections\.c\.images\.split: with uncaptioned_images: skip"):
        load_manifest(str(path), env={})
    with pytest.raises(ManifestError, match=r"collections\.syn\.uncaptioned_images: skip selects file images"):
        load_manifest(str(path), ["c.images.split=null", "syn.uncaptioned_images=skip"], env={})
    with pytest.raises(ManifestError, match=r"collections\.syn\.expected_images: per-split counts"):
        load_manifest(str(path), ["c.images.split=null", "syn.expected_images={test: 4}"], env={})


def test_demo_manifest_sizes():
    m = load_manifest("demo", env={})
    assert (m.feature_dim, m.max_regions, m.feature_format, m.feature_dtype) == (1024, 50, "parquet", "float32")
    spec = m.synthetic_spec("demo")
    assert spec.num_images == 5000 and spec.captions_per_image == 5 and spec.domain == "coco"
    from collections import Counter
    assert Counter(split_of(spec, i) for i in range(5000)) == {"train": 4000, "dev": 500, "test": 500}
    # synthetic captions carry the image options too (the generator needs both)
    assert m.collections["demo"].captions.options["num_images"] == 5000


def test_paper_sized_synthetic_manifests():
    sizes = {"synthetic_coco5k": (5000, 25000, "coco"), "synthetic_f30k1k": (1000, 5000, "f30k"),
             "synthetic_cc14k": (14000, 14000, "cc"), "synthetic_100k": (100000, 500000, "coco")}
    seeds = {load_manifest("demo", env={}).synthetic_spec("demo").seed}
    for name, (n_img, n_cap, domain) in sizes.items():
        m = load_manifest(name, env={})
        spec = m.synthetic_spec(name)
        assert (spec.num_images, spec.num_captions, spec.domain, m.feature_dim) == (n_img, n_cap, domain, 1024)
        seeds.add(spec.seed)
    assert len(seeds) == 5
    assert load_manifest("synthetic_100k", env={}).feature_dtype == "float16"
    d = load_manifest("synthetic_distractor20k", env={})
    assert sum(d.synthetic_spec(c).num_images for c in d.collections) == 20000
    assert d.benchmark["query_collection"] == "synthetic_coco5k"
    assert set(d.benchmark["distractor_collections"]) == {"synthetic_f30k1k", "synthetic_cc14k"}
    # same settings as the single-set manifests, so staged data is identical
    single = load_manifest("synthetic_f30k1k", env={})
    assert d.synthetic_spec("synthetic_f30k1k") == single.synthetic_spec("synthetic_f30k1k")


def test_coco_train_sized_manifest_has_karpathy_like_splits():
    # the training-at-scale collection (benchmarks.meters.train_scale): COCO trainval's size, dev/test of 5k
    from collections import Counter
    m = load_manifest("synthetic_coco_train", env={})
    spec = m.synthetic_spec("coco_train")
    assert (m.feature_dim, m.max_regions, m.feature_dtype) == (2048, 36, "float16")
    assert (spec.min_regions, spec.max_regions, spec.captions_per_image) == (36, 36, 5)
    counts = Counter(split_of(spec, i) for i in range(spec.num_images))
    assert counts == {"train": 113287, "dev": 5000, "test": 5000}


def test_real_manifests_expected_counts():
    expect = {"coco_5k": (5000, 25000), "flickr30k_1k": (1000, 5000), "cc_dev": (None, 15833),
              "multi30k": (1000, 7000)}
    for name, counts in expect.items():
        (coll,) = load_manifest(name, env={}).collections.values()
        assert (coll.expected_images, coll.expected_captions) == counts
    d = load_manifest("distractor_20k", env={})
    assert set(d.collections) == {"coco_5k", "flickr30k_1k", "cc_dev"}


# ------------------------------------------------------------------------------------ errors
GOOD = """
feature_dim: 64
collections:
  coco:
    images: {format: butd_tsv, path: feats.tsv}
    captions: {format: karpathy_json, path: caps.json, split: test}
  syn:
    images: {format: synthetic, num_images: 8}
    captions: {format: synthetic}
"""


def _write(tmp_path, text, name="bad.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def _error(tmp_path, text, overrides=(), env=None) -> str:
    with pytest.raises(ManifestError) as e:
        load_manifest(_write(tmp_path, text), overrides, env=env or {})
    return str(e.value)


@pytest.mark.parametrize("old,new,prefix,fragment", [
    ("format: butd_tsv", "format: tsv", "collections.coco.images.format", "unknown format 'tsv' (expected one of:"),
    ("feature_dim: 64", "feature_dim: -3", "feature_dim", "positive integer"),
    ("feature_dim: 64", "feature_dims: 64", "feature_dims", "unknown top-level key"),
    ("num_images: 8", "num_images: 0", "collections.syn.images", "num_images must be a positive integer"),
    ("num_images: 8", "num_images: 8, colour: red", "collections.syn.images", "colour"),
    ("{format: synthetic}", "{format: synthetic, path: x.txt}", "collections.syn.captions.path", "remove the path"),
    ("path: feats.tsv", "split: test", "collections.coco.images.path", "required for format 'butd_tsv'"),
    ("split: test}", "split: test, sentences: 5}", "collections.coco.captions.sentences", "unknown option"),
    ("{format: karpathy_json, path: caps.json, split: test}", "{format: caption_lines, path: caps.txt}",
     "collections.coco.captions.ids_path", "required for format 'caption_lines'"),
    ("{format: karpathy_json, path: caps.json, split: test}", "{format: multi30k, path: 'test.*.de.gz'}",
     "collections.coco.captions.image_list", "required for format 'multi30k'"),
    ("path: feats.tsv", "path: '${FEATS}'", "collections.coco.images.path", "FEATS is not set"),
    ("captions: {format: karpathy_json", "role: queen\n    captions: {format: karpathy_json",
     "collections.coco.role", "unknown role 'queen'"),
    ("{format: synthetic, num_images: 8}", "{format: synthetic, num_images: 8}\n    expected_images: 9",
     "collections.syn.expected_images", "9 but images.num_images is 8"),
    ("{format: synthetic}", "{format: synthetic}\n    expected_captions: 8",
     "collections.syn.expected_captions", "8 x 5 = 40"),
    ("captions: {format: synthetic}", "captions: {format: synthetic}\n    colour: red",
     "collections.syn.colour", "unknown key"),
    ("feature_dim: 64", "feature_dim: 64\nbenchmark: {query_collection: coco, distractor_collections: [f30k]}",
     "benchmark.distractor_collections", "no collection 'f30k'"),
    ("feature_dim: 64", "feature_dim: 64\nbenchmark: {query_collection: nope}", "benchmark.query_collection",
     "no collection 'nope'"),
    ("feature_dim: 64", "feature_dim: 64\nfeature_dtype: int8", "feature_dtype", "unknown value 'int8'"),
])
def test_errors_name_file_and_key(tmp_path, old, new, prefix, fragment):
    assert old in GOOD
    msg = _error(tmp_path, GOOD.replace(old, new, 1))
    assert msg.startswith(f"bad.yaml: {prefix}:"), msg
    assert fragment in msg, msg


def test_good_fixture_loads(tmp_path):
    m = load_manifest(_write(tmp_path, GOOD, "good.yaml"), env={})
    assert m.name == "good" and m.max_regions == 50 and m.collections["coco"].role == "query"


def test_structural_errors(tmp_path):
    assert "expected a mapping" in _error(tmp_path, "- a\n- b\n")
    assert "not valid YAML" in _error(tmp_path, "feature_dim: [\n")
    assert _error(tmp_path, "feature_dim: 8\n").startswith("bad.yaml: collections: missing or empty")
    assert _error(tmp_path, "collections: {}\n").startswith("bad.yaml: feature_dim: missing")
    msg = _error(tmp_path, GOOD, overrides=["f30k.images.path=/x"])
    assert "'f30k' is neither a top-level key" in msg and "coco, syn" in msg
    assert "not of the form" in _error(tmp_path, GOOD, overrides=["feature_dim"])


def test_unknown_manifest_name_lists_shipped():
    with pytest.raises(ManifestError, match="shipped: .*demo") as e:
        resolve_manifest_path("demo_typo")
    assert "synthetic_coco5k" in str(e.value)
    with pytest.raises(ManifestError, match="not found"):
        resolve_manifest_path("/nonexistent/x.yaml")
    assert resolve_manifest_path("demo").endswith(os.path.join("data_manifests", "demo.yaml"))


# --------------------------------------------------------------------------------- overrides
def test_env_and_cli_overrides_and_expansion(tmp_path):
    text = GOOD.replace("path: caps.json", "path: '${CAPS_DIR:-captions}/caps.json'")
    path = _write(tmp_path, text, "ok.yaml")
    root = str(tmp_path / "data")
    m = load_manifest(path, env={"RR_DATA_ROOT": root})
    assert m.collections["coco"].images.path == os.path.join(root, "feats.tsv")
    assert m.collections["coco"].captions.path == os.path.join(root, "captions", "caps.json")

    env = {"RR_DATA_ROOT": root, "CAPS_DIR": "/abs/caps", env_path_var("coco", "images"): "/env/feats.tsv"}
    assert env_path_var("coco", "images") == "RR_COCO_IMAGES_PATH"
    m = load_manifest(path, env=env)
    assert m.collections["coco"].images.path == "/env/feats.tsv"
    assert m.collections["coco"].captions.path == "/abs/caps/caps.json"

    m = load_manifest(path, ["coco.images.path=/cli/feats.tsv", "feature_dim=1024", "syn.images.num_images=200",
                             "collections.syn.images.domain=f30k", "benchmark.split=dev"], env=env)
    assert m.collections["coco"].images.path == "/cli/feats.tsv"  # CLI beats env
    assert m.feature_dim == 1024 and m.benchmark["split"] == "dev"
    spec = m.synthetic_spec("syn")
    assert (spec.num_images, spec.domain, spec.feature_dim) == (200, "f30k", 1024)
    # a bad override value is validated like the file
    msg = _error(tmp_path, GOOD, overrides=["syn.images.num_images=lots"])
    assert msg.startswith("bad.yaml: collections.syn.images:") and "num_images" in msg


def test_shipped_env_var_name_for_dashed_collection():
    assert env_path_var("coco_5k", "captions") == "RR_COCO_5K_CAPTIONS_PATH"
    assert env_path_var("cc-dev", "images") == "RR_CC_DEV_IMAGES_PATH"
    m = load_manifest("coco_5k", env={"RR_COCO_5K_CAPTIONS_PATH": "/d/dataset_coco.json", "COCO_FEATURES": "/f.tsv"})
    assert m.collections["coco_5k"].captions.path == "/d/dataset_coco.json"
    assert m.collections["coco_5k"].images.path == "/f.tsv"


def test_missing_paths_and_globs(tmp_path):
    (tmp_path / "feats.tsv").write_text("")
    for i in (1, 2):
        (tmp_path / f"caps.{i}.de.gz").write_text("")
    text = GOOD.replace("{format: karpathy_json, path: caps.json, split: test}",
                        "{format: multi30k, path: 'caps.*.de.gz', image_list: images.txt}")
    m = load_manifest(_write(tmp_path, text, "ok.yaml"), env={"RR_DATA_ROOT": str(tmp_path)})
    assert m.missing_paths() == [str(tmp_path / "images.txt")]
    with pytest.raises(ManifestError, match=r"collections\.coco\.captions\.image_list: .*images\.txt"):
        m.check_paths()
    (tmp_path / "images.txt").write_text("")
    assert m.missing_paths() == []
    m.check_paths()
    m = load_manifest(_write(tmp_path, text, "ok.yaml"), ["coco.captions.path=nothing.*.gz"],
                      env={"RR_DATA_ROOT": str(tmp_path)})
    assert m.missing_paths() == [str(tmp_path / "nothing.*.gz")]



def test_url_paths_are_kept_as_written_and_not_checked_locally(tmp_path):
    """gs:// inputs (Dataflow) are not local paths: no expanduser / normpath / join with RR_DATA_ROOT (that
    made gs://bucket/x.tsv into <root>/gs:/bucket/x.tsv), and no os.path existence check."""
    from retrieval_core.data.manifest import _resolve

    assert _resolve("gs://b/x.tsv", "/root") == "gs://b/x.tsv"
    assert _resolve(["gs://b/feats/*.tsv", "rel.tsv", "~/h.tsv"], "/root") == \
        ["gs://b/feats/*.tsv", "/root/rel.tsv", os.path.expanduser("~/h.tsv")]
    text = GOOD.replace("{format: karpathy_json, path: caps.json, split: test}",
                        "{format: multi30k, path: 'gs://b/caps/test_2016.*.de.gz', image_list: 'gs://b/images.txt'}")
    (tmp_path / "feats.tsv").write_text("")
    env = {"RR_DATA_ROOT": str(tmp_path)}
    m = load_manifest(_write(tmp_path, text, "ok.yaml"), env=env)
    caps = m.collections["coco"].captions
    assert (caps.path, caps.options["image_list"]) == ("gs://b/caps/test_2016.*.de.gz", "gs://b/images.txt")
    assert m.collections["coco"].images.path == str(tmp_path / "feats.tsv")  # local paths: as before
    # the README's override, and the env-var one
    m = load_manifest(_write(tmp_path, text, "ok.yaml"), ["coco.images.path=gs://bucket/feats/*.tsv"], env=env)
    assert m.collections["coco"].images.path == "gs://bucket/feats/*.tsv"
    m = load_manifest(_write(tmp_path, text, "ok.yaml"), env=dict(env, RR_COCO_IMAGES_PATH="gs://bucket/f.tsv"))
    assert m.collections["coco"].images.path == "gs://bucket/f.tsv"
    # a URL data root: relative paths join it with "/" (shipped manifests on Dataflow: RR_DATA_ROOT=gs://...)
    assert _resolve("coco/./x.json", "gs://b/data/") == "gs://b/data/coco/x.json"
    m2 = load_manifest("coco_5k", env={"RR_DATA_ROOT": "gs://b/data"})
    assert m2.collections["coco_5k"].captions.path == "gs://b/data/coco/dataset_coco.json"
    # without a file access that reaches URLs they are left unchecked (the stage pipeline passes Beam's)
    assert m.missing_paths() == []
    m.check_paths()
    m = load_manifest(_write(tmp_path, text, "ok.yaml"), ["coco.images.path=gone.tsv"], env=env)
    assert m.missing_paths() == [str(tmp_path / "gone.tsv")]


# -------------------------------------------------------------------------------- real files
def test_real_caption_files_resolve_via_data_root():
    root = require_realdata()
    env = {"RR_DATA_ROOT": str(root)}
    f30k = load_manifest("flickr30k_1k", env=env)
    caps = f30k.collections["flickr30k_1k"].captions
    assert os.path.isfile(caps.path) and os.path.isfile(caps.options["ids_path"])
    assert f30k.missing_paths() == [f30k.collections["flickr30k_1k"].images.path]  # features are user-supplied
    m30k = load_manifest("multi30k", env=env)
    assert m30k.missing_paths() == [m30k.collections["multi30k"].images.path]
    cc = load_manifest("cc_dev", env=env)
    with open(cc.collections["cc_dev"].captions.path, "rb") as f:
        assert sum(1 for _ in f) == cc.collections["cc_dev"].expected_captions
    # COCO: point the captions at the LAPS caption lines with CLI overrides
    laps = root / "laps_karpathy_ids" / "data" / "coco"
    coco = load_manifest("coco_5k", [
        "coco_5k.captions.format=caption_lines", f"coco_5k.captions.path={laps / 'testall_caps.txt'}",
        f"coco_5k.captions.ids_path={laps / 'testall_ids.txt'}"], env=env)
    assert coco.missing_paths() == [coco.collections["coco_5k"].images.path]
    with open(coco.collections["coco_5k"].captions.path, "rb") as f:
        assert sum(1 for _ in f) == coco.collections["coco_5k"].expected_captions


def test_size_overrides_move_the_expected_counts_unless_set_explicitly():
    # the README's own example: the generator's new size, no need to edit the checks too
    m = load_manifest("demo", ["demo.images.num_images=200"])
    demo = m.collections["demo"]
    cpi = int(demo.images.options.get("captions_per_image", 5))
    assert (demo.expected_images, demo.expected_captions) == (200, 200 * cpi)
    m = load_manifest("demo", ["demo.captions.captions_per_image=2", "demo.images.num_images=10"])
    assert (m.collections["demo"].expected_images, m.collections["demo"].expected_captions) == (10, 20)
    # expected counts given by the user are checked, and the error says what to set
    with pytest.raises(ManifestError, match="demo.expected_images=200"):
        load_manifest("demo", ["demo.images.num_images=200", "demo.expected_images=300"])
    m = load_manifest("demo", ["demo.images.num_images=200", f"demo.expected_captions={200 * cpi}"])
    assert m.collections["demo"].expected_captions == 200 * cpi
    # without a size override the YAML's own numbers are still checked
    with pytest.raises(ManifestError, match="expected_images"):
        load_manifest("demo", ["demo.expected_images=7"])

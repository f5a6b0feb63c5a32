"""The synthetic benchmark: determinism, family structure, captions, region layout and the pooled-feature
property the benchmark rests on (binding-swapped siblings are nearly indistinguishable after mean pooling)."""
from __future__ import annotations

import re
import time
from collections import Counter

import numpy as np
import pytest

from retrieval_core.data.schema import RawCaption, RawImage
from retrieval_core.data.synthetic.captions import generate_captions, generate_captions_for
from retrieval_core.data.synthetic.regions import decode_regions, generate_image, generate_images
from retrieval_core.data.synthetic.scenes import describe_scene, focus_pairs, image_source_id, split_of
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.data.synthetic.vocabulary import COLOURS, COUNT_WORDS, DOMAINS, RELATION_WORDS


def _same(a: RawImage, b: RawImage) -> bool:
    return (a.source_id == b.source_id and a.split == b.split and (a.image_w, a.image_h) == (b.image_w, b.image_h)
            and np.array_equal(a.features, b.features) and np.array_equal(a.boxes, b.boxes)
            and np.array_equal(a.confidences, b.confidences))


SPEC = SyntheticSpec("unit", 64, seed=3, feature_dim=128)


def test_deterministic_any_order_any_range():
    forward = list(generate_images(SPEC, 0, 24))
    backward = [generate_image(SPEC, i) for i in reversed(range(24))][::-1]
    split_ranges = list(generate_images(SPEC, 0, 9)) + list(generate_images(SPEC, 9, 24))
    assert all(_same(a, b) and _same(a, c) for a, b, c in zip(forward, backward, split_ranges))
    assert [c.text for c in generate_captions(SPEC, 0, 24)] == \
        [c.text for i in range(24) for c in generate_captions_for(SPEC, i)]
    # A fresh spec object with equal fields gives the same data (nothing hidden in caches).
    again = SyntheticSpec("unit", 64, seed=3, feature_dim=128)
    assert _same(generate_image(again, 5), forward[5])


def test_seed_and_collection_change_the_data():
    base = generate_image(SPEC, 0)
    others = (SyntheticSpec("unit", 64, seed=4, feature_dim=128), SyntheticSpec("other", 64, seed=3, feature_dim=128))
    for other in others:
        img = generate_image(other, 0)
        assert img.features.shape != base.features.shape or not np.array_equal(img.features, base.features)


def test_image_record_fields():
    for i in range(12):
        img = generate_image(SPEC, i)
        n = img.num_boxes
        assert img.source_id == image_source_id(SPEC, i) == f"{i:07d}"
        assert img.features.shape == (n, 128) and img.features.dtype == np.float32
        assert img.boxes.shape == (n, 4) and img.box_format == "xyxy"
        assert img.confidences.shape == (n,)
        assert (img.features >= 0).all() and 0.2 < (img.features == 0).mean() < 0.8  # post-ReLU, sparse-ish
        b = img.boxes
        assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all() and (b[:, 2] <= img.image_w).all() \
            and (b[:, 3] <= img.image_h).all() and (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()
    with pytest.raises(IndexError):
        generate_image(SPEC, 64)


@pytest.mark.parametrize("dim", [16, 1024])
def test_feature_dim_configurable(dim):
    spec = SyntheticSpec("dims", 4, feature_dim=dim)
    assert generate_image(spec, 1).features.shape[1] == dim


@pytest.mark.parametrize("lo,hi", [(10, 50), (3, 5), (36, 36)])
def test_region_counts_within_bounds(lo, hi):
    spec = SyntheticSpec("regions", 80, min_regions=lo, max_regions=hi, feature_dim=8)
    counts = [generate_image(spec, i).num_boxes for i in range(80)]
    assert lo <= min(counts) and max(counts) <= hi
    if hi - lo > 20:
        assert len(set(counts)) > 10  # really varies


def test_shuffled_order_and_confident_objects():
    not_sorted = 0
    for i in range(40):
        img = generate_image(SPEC, i)
        scene = describe_scene(SPEC, i)
        conf = img.confidences
        not_sorted += not np.all(np.diff(conf) <= 0)
        k = scene["num_object_detections"]
        assert 0 < k <= img.num_boxes
        top = np.sort(conf)[::-1]
        # Object detections (high confidence) all rank above the clutter (low confidence).
        if k < img.num_boxes:
            assert top[k - 1] > top[k]
    assert not_sorted >= 38  # stored order is not confidence order


def test_tiny_region_cap_keeps_most_confident_objects():
    spec = SyntheticSpec("cap", 40, min_regions=2, max_regions=2, feature_dim=8)
    for i in range(40):
        img = generate_image(spec, i)
        assert img.num_boxes == 2 and (img.confidences > 0.5).all()


@pytest.mark.parametrize("changes", [None, ("attribute", "binding", "count", "relation", "attribute", "count")])
def test_families_differ_only_in_the_intended_way(changes):
    size = 4 if changes is None else 1 + len(changes)
    kwargs = {} if changes is None else {"family_size": size, "sibling_changes": changes}
    spec = SyntheticSpec("fam", 100 * size, seed=9, feature_dim=8, **kwargs)
    expected = spec.sibling_changes[:size - 1]
    seen = Counter()
    for base_idx in range(0, 100 * size, size):
        base = describe_scene(spec, base_idx)
        assert base["member"] == 0 and base["change"] is None
        siblings = [describe_scene(spec, base_idx + m) for m in range(1, size)]
        assert tuple(s["change"] for s in siblings) == expected
        for sib in siblings:
            assert sib["family"] == base["family"] and sib["split"] == base["split"]
            assert (sib["image_w"], sib["image_h"]) == (base["image_w"], base["image_h"])
            if sib["change"] != "count":  # more objects may push clutter out under max_regions
                assert sib["num_clutter"] == base["num_clutter"]
                assert sib["num_object_detections"] == base["num_object_detections"]
            g0, g1 = base["groups"], sib["groups"]
            assert len(g0) == len(g1) >= 2
            diff = {(i, k) for i in range(len(g0)) for k in g0[i] if g0[i][k] != g1[i][k]}
            change = sib["change"]
            seen[change] += 1
            if change == "attribute":
                g = sib["changed_group"]
                assert diff == {(g, "colour")} and g in (0, 1)
                assert g1[g]["colour"] not in {grp["colour"] for grp in g0}  # a colour absent from the base scene
            elif change == "binding":
                assert diff == {(0, "colour"), (1, "colour")}
                assert (g1[0]["colour"], g1[1]["colour"]) == (g0[1]["colour"], g0[0]["colour"])
            elif change == "count":
                g = sib["changed_group"]
                assert diff == {(g, "count")} and g in (0, 1)
            elif change == "relation":
                assert diff == {(0, "cell"), (1, "cell")}
                assert sib["relation"] == {"left of": "right of", "right of": "left of",
                                           "above": "below", "below": "above"}[base["relation"]]
            else:
                pytest.fail(f"unexpected change {change!r}")
        # every member is a distinct scene
        scenes = [base] + siblings
        keys = {tuple((g["colour"], g["count"], g["cell"]) for g in sc["groups"]) for sc in scenes}
        assert len(keys) == size
    assert seen == Counter(expected * 100)


def test_splits_whole_families_and_exact_counts():
    spec = SyntheticSpec("s", 5000, splits=(("train", 0.7), ("dev", 0.1), ("test", 0.2)), feature_dim=8)
    splits = [split_of(spec, i) for i in range(5000)]
    assert Counter(splits) == {"train": 3500, "dev": 500, "test": 1000}
    assert all(len({splits[i] for i in range(f, f + 4)}) == 1 for f in range(0, 5000, 4))
    # Mapping order does not matter (manifests are mappings).
    same = SyntheticSpec("s", 5000, splits={"test": 0.2, "train": 0.7, "dev": 0.1}, feature_dim=8)
    assert [split_of(same, i) for i in range(0, 5000, 97)] == splits[::97]


def _mentions(text: str, group: dict, noun) -> bool:
    lowered = text.lower()
    colour_ok = any(re.search(rf"\b{c}\b", lowered) for c in COLOURS[group["colour"]])
    forms = [f for pair in noun.forms for f in pair]
    noun_ok = any(re.search(rf"\b{re.escape(f)}\b", lowered) for f in forms)
    return colour_ok and noun_ok


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_captions_describe_their_scene(domain):
    spec = SyntheticSpec("cap", 60, domain=domain, feature_dim=8)
    nouns = {n.name: n for n in DOMAINS[domain]}
    for i in range(60):
        scene = describe_scene(spec, i)
        caps = generate_captions_for(spec, i)
        assert len(caps) == (1 if domain == "cc" else 5)
        assert [c.caption_key for c in caps] == [str(k) for k in range(len(caps))]
        assert len({c.text for c in caps}) == len(caps)  # paraphrases, not copies
        g0, g1 = scene["groups"][:2]
        for c in caps:
            assert isinstance(c, RawCaption) and c.image_source_id == scene["source_id"] and c.split == scene["split"]
            text = c.text.lower()
            assert _mentions(text, g0, nouns[g0["class"]]) and _mentions(text, g1, nouns[g1["class"]]), c.text
            rel = scene["relation"]
            inv = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}[rel]
            assert any(p in text for p in RELATION_WORDS[rel] + RELATION_WORDS[inv]), c.text
            for g in (g0, g1):
                if g["count"] > 1:  # "two"/"a pair of"/"2"...: the count is stated
                    assert any(re.search(rf"\b{w}\b", text) for w in COUNT_WORDS[g["count"]]), c.text


def test_binding_swap_is_invisible_to_mean_pooling():
    """The property the benchmark rests on: mean-pooled features of binding-swapped (and relation-swapped)
    siblings are far closer than unrelated images, so a pooled embedding confuses them."""
    spec = SyntheticSpec("pool", 240, seed=5, feature_dim=256, sibling_changes=("binding", "relation", "attribute"))
    means = np.stack([generate_image(spec, i).features.mean(0) for i in range(240)])
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    dist = 1.0 - means @ means.T
    by_change = {"binding": [], "relation": [], "attribute": []}
    for i in range(240):
        scene = describe_scene(spec, i)
        if scene["change"] in by_change:
            by_change[scene["change"]].append(dist[i, i - scene["member"]])
    family = np.arange(240) // 4
    unrelated = dist[family[:, None] != family[None, :]]
    for change in ("binding", "relation"):
        d = by_change[change]
        assert np.mean(d) < 0.25 * np.mean(unrelated), (change, np.mean(d), np.mean(unrelated))
        assert np.median(d) < np.percentile(unrelated, 5), change
    # An attribute sibling is as close as a binding one: one object's colour is a small share of the mean.
    assert np.median(by_change["attribute"]) < np.percentile(unrelated, 5)


def test_binding_is_recoverable_from_single_regions():
    """What a binding swap hides from the mean is in every region: decoding each of the 12 most confident
    regions to its nearest (class, colour) codes finds both focus pairs of the caption in the gold image and
    neither in its binding sibling: a CE that misses binding fails to learn it, it is not starved of it."""
    spec = SyntheticSpec("bind", 200, seed=5, feature_dim=256, sibling_changes=("attribute", "binding", "attribute"))
    gold_found, sibling_found = [], []
    for base in range(0, 200, 4):
        want = focus_pairs(describe_scene(spec, base))
        for i, found in ((base, gold_found), (base + 2, sibling_found)):
            assert describe_scene(spec, i)["change"] == (None if i == base else "binding")
            img = generate_image(spec, i)
            top = np.argsort(-img.confidences, kind="stable")[:12]
            found.append(len(want & set(decode_regions(spec, img.features[top]))))
    assert np.mean(np.array(gold_found) == 2) >= 0.95, gold_found
    assert np.mean(np.array(sibling_found) == 0) >= 0.95, sibling_found


def test_from_options():
    spec = SyntheticSpec.from_options("c", {"num_images": 8, "domain": "cc", "splits": {"dev": 0.5, "test": 0.5}}, 32)
    assert spec.captions_per_image == 1 and spec.feature_dim == 32 and dict(spec.splits) == {"dev": 0.5, "test": 0.5}
    with pytest.raises(ValueError, match="num_imgs"):
        SyntheticSpec.from_options("c", {"num_images": 8, "num_imgs": 3}, 32)
    with pytest.raises(ValueError, match="num_images"):
        SyntheticSpec.from_options("c", {}, 32)
    with pytest.raises(ValueError, match="domain"):
        SyntheticSpec("c", 8, domain="imagenet")
    with pytest.raises(ValueError, match="splits"):
        SyntheticSpec("c", 8, splits=(("a", 0.5), ("b", 0.2)))
    with pytest.raises(ValueError, match="min_regions"):
        SyntheticSpec("c", 8, min_regions=20, max_regions=10)
    spec = SyntheticSpec.from_options("c", {"num_images": 8, "family_size": 3, "sibling_changes": ["count",
                                                                                                   "binding"]}, 8)
    assert spec.sibling_changes == ("count", "binding") and describe_scene(spec, 2)["change"] == "binding"
    with pytest.raises(ValueError, match="unknown sibling change"):
        SyntheticSpec("c", 8, sibling_changes=("colour", "binding", "count"))
    with pytest.raises(ValueError, match="needs 4 sibling_changes"):
        SyntheticSpec("c", 8, family_size=5, sibling_changes=("attribute", "binding"))
    with pytest.raises(ValueError, match="at most 1 'binding'"):
        SyntheticSpec("c", 8, family_size=3, sibling_changes=("binding", "binding"))


def test_generation_speed_at_2048():
    """Not a benchmark: a generous bound that catches accidental per-element Python loops."""
    spec = SyntheticSpec("speed", 2000, feature_dim=2048)
    generate_image(spec, 0)  # build the codebooks once
    t0 = time.perf_counter()
    n = sum(img.num_boxes for img in generate_images(spec, 0, 2000))
    assert n > 0 and time.perf_counter() - t0 < 15.0

"""benchmarks.probes.binding_probe: the caption parsing finds each colour's noun, the probe separates what is separable
and stays at chance where the labels carry no signal, and the CLI runs on a staged tiny synthetic collection."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from benchmarks.probes import binding_probe
from tests.helpers_model import staged_demo_and_tiny_model

F = 16
OVERRIDES = (f"feature_dim={F}", "demo.images.num_images=64", "demo.images.min_regions=4", "demo.images.max_regions=8",
             "demo.images.splits={train: 0.5, dev: 0.5}", "demo.expected_images=64", "demo.expected_captions=320")


def test_colour_nouns_pairs_each_colour_with_the_word_after_it():
    text = "Two little violet bottles to the left of a gray car; the violet bottles are small."
    found = binding_probe.colour_nouns(text)
    assert [(c, text[a:b]) for c, (a, b) in found] == [("purple", "bottles"), ("grey", "car")]
    assert binding_probe.colour_nouns("The ball is red.") == []  # a colour with no word after it: no noun
    # the last word piece inside the noun's span; special tokens ((0, 0)) never match
    assert binding_probe.last_piece([(0, 0), (0, 3), (4, 8), (8, 10), (0, 0)], (4, 10)) == 3
    assert binding_probe.last_piece([(0, 0), (0, 3)], (4, 10)) is None


def test_the_probe_finds_a_separable_colour_and_not_a_random_one():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 400)
    other = (y + 1 + rng.integers(0, 3, 400)) % 4
    centres = rng.normal(0, 3, (4, 8))
    x = centres[y] + rng.normal(0, 1, (400, 8))
    top1, own = binding_probe.fit_and_score(x[:300], y[:300], x[300:], y[300:], other[300:], 4)
    assert top1 > 90 and own > 95
    noise = rng.normal(0, 1, (400, 8))  # features that do not depend on the label
    top1, own = binding_probe.fit_and_score(noise[:300], y[:300], noise[300:], y[300:], other[300:], 4)
    assert top1 < 45 and 30 < own < 70


@pytest.fixture(scope="module")
def staged_and_model(tmp_path_factory):
    return staged_demo_and_tiny_model(str(tmp_path_factory.mktemp("binding")), OVERRIDES, F)


def test_cli_probes_both_sides_at_every_layer(staged_and_model, tmp_path):
    staged, model_dir = staged_and_model
    out = CliRunner().invoke(binding_probe.main, ["--staged", staged, "--manifest", "demo", "--model", model_dir,
                                                  "--output", str(tmp_path), "--threads", "1"])
    assert out.exit_code == 0, out.output
    import pandas as pd

    rows = pd.read_csv(tmp_path / "binding_probe.csv")
    from retrieval_core.model.network import VLRetrievalModel

    layers = VLRetrievalModel.load(model_dir).bert.config.num_hidden_layers + 1
    assert sorted(rows["side"].unique()) == ["caption", "cross", "image", "text"]
    # caption is scored only where the image is the binding sibling: every other cross pair
    scored = rows.groupby("side")["scored_on"].first()
    assert 0 < scored["caption"] < scored["cross"]
    assert (rows.groupby("side")["layer"].nunique() == layers).all()
    assert rows[["top1", "own_over_other"]].stack().between(0, 100).all() and (rows["scored_on"] > 0).all()
    # layer 0 of the text side is the noun's own word and position embedding: it cannot know its adjective
    # better than chance beyond what the noun word itself predicts; the image side's layer 0 is the region's
    # own features, which carry its colour (the codebook oracle decodes them)
    text0 = rows[(rows["side"] == "text") & (rows["layer"] == 0)].iloc[0]
    image0 = rows[(rows["side"] == "image") & (rows["layer"] == 0)].iloc[0]
    assert image0["own_over_other"] > text0["own_over_other"]
    bad = CliRunner().invoke(binding_probe.main, ["--staged", staged, "--manifest", "coco_5k", "--model", model_dir])
    assert bad.exit_code != 0 and "Traceback" not in bad.output


def test_cross_pairs_alternate_gold_and_binding_sibling_with_the_image_colour_as_label(staged_and_model):
    from benchmarks.probes.family_probe import sampled_captions
    from retrieval_core.data.manifest import load_manifest
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.data.synthetic.scenes import describe_scene, focus_pairs

    staged, _ = staged_and_model
    spec = load_manifest("demo", OVERRIDES).synthetic_spec("demo")
    caps, index_of = sampled_captions(StagedDataset(staged), spec, "train", None)
    pairs = binding_probe.cross_pairs(spec, caps, index_of)
    assert len(pairs) >= 4
    gold_of = dict(zip(caps["text"], caps["image_item_id"].astype(int)))
    for n, (text, item, nouns) in enumerate(pairs):
        gold = index_of[gold_of[text]]
        assert gold % spec.family_size == 0  # captions of base scenes only
        scene = describe_scene(spec, index_of[item])
        if n % 2 == 0:
            assert index_of[item] == gold
        else:  # the binding sibling of the same family: the two focus objects swapped colours
            assert scene["change"] == "binding" and index_of[item] // spec.family_size == gold // spec.family_size
        caption_colours = [c for c, _ in binding_probe.colour_nouns(text)]
        assert [(y, o) for _, y, o in nouns] == (
            [(caption_colours[0], caption_colours[1]), (caption_colours[1], caption_colours[0])] if n % 2 == 0
            else [(caption_colours[1], caption_colours[0]), (caption_colours[0], caption_colours[1])])
        # why the sibling's label is the caption's other colour: there the two focus objects trade colours
        base_pairs = focus_pairs(describe_scene(spec, gold))
        (ca, cola), (cb, colb) = sorted(base_pairs)
        sibling = next(i for i in range(gold + 1, gold + spec.family_size)
                       if describe_scene(spec, i)["change"] == "binding")
        assert focus_pairs(describe_scene(spec, sibling)) == {(ca, colb), (cb, cola)}

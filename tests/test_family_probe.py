"""benchmarks.probes.family_probe on a staged tiny synthetic collection: its counts follow from the family layout, and
its accuracies are recomputed here from the two heads' own scores."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from benchmarks.probes import family_probe
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.scenes import describe_scene
from tests.helpers_model import staged_demo_and_tiny_model

F = 16
OVERRIDES = (f"feature_dim={F}", "demo.images.num_images=48", "demo.images.min_regions=4", "demo.images.max_regions=8",
             "demo.images.splits={test: 1.0}", "demo.expected_images=48", "demo.expected_captions=240")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    staged, model_dir = staged_demo_and_tiny_model(str(tmp_path_factory.mktemp("probe")), OVERRIDES, F)
    return staged, model_dir, load_manifest("demo", OVERRIDES).synthetic_spec("demo")


def test_probe_counts_and_accuracies_match_the_heads_scores(setup):
    staged, model_dir, spec = setup
    from retrieval_core.model.network import VLRetrievalModel

    model = VLRetrievalModel.load(model_dir)
    rows = family_probe.probe(StagedDataset(staged), spec, model, model, split="test")
    top1 = rows[(rows["table"] == "top1") & (rows["head"] == "CE")].set_index("change")
    # 48 images = 12 families of 4 (base, attribute, binding, attribute), 5 captions each
    assert top1.loc["all", "total"] == 240
    assert dict(top1["total"].drop("all")) == {"attribute": 120, "base": 60, "binding": 60}
    pair = rows[(rows["table"] == "pairwise") & (rows["head"] == "BE")].set_index("change")
    assert pair.loc["all", "total"] == 240 * 3
    # base vs a sibling: that sibling's change; two siblings: both changes
    assert set(pair.index) == {"attribute", "binding", "attribute+attribute", "attribute+binding", "all"}
    # per family of 4 with 5 captions each: base-attribute pairs 2 x 2 x 5, base-binding 2 x 5, ...
    assert dict(pair["total"].drop("all")) == {"attribute": 240, "binding": 120, "attribute+attribute": 120,
                                               "attribute+binding": 240}
    # the codebook oracle is scored on the same (caption, member) grid
    oracle = rows[(rows["table"] == "pairwise") & (rows["head"] == "oracle")].set_index("change")
    assert oracle["total"].to_dict() == pair["total"].to_dict()

    # recompute the CE top-1 accuracy of base captions from the model's own scores
    ds = StagedDataset(staged)
    meta, caps = ds.images_meta(split="test"), ds.captions(split="test")
    index_of = dict(zip(meta["item_id"], meta["source_id"].astype(int)))
    item_of = {v: k for k, v in index_of.items()}
    table = ds.load_images(item_ids=meta["item_id"].to_numpy(np.int64))
    pos = table.position_of()
    hits = []
    for text, img in zip(caps["text"], caps["image_item_id"]):
        gold = index_of[img]
        if describe_scene(spec, gold)["member"] != 0:
            continue
        fam = [gold + j for j in range(4)]
        s = model.score([text] * 4, [table.regions(pos[item_of[i]]) for i in fam])
        hits.append(int(np.argmax(s) == 0))
    assert top1.loc["base", "correct"] == sum(hits)
    assert top1.loc["base", "accuracy"] == pytest.approx(100.0 * np.mean(hits))


def test_cli_writes_csv_and_reports_non_synthetic_input_clearly(setup, tmp_path):
    staged, model_dir, _ = setup
    out = CliRunner().invoke(family_probe.main, ["--staged", staged, "--manifest", "demo", "--model", model_dir,
                                                 "--model", model_dir, "--output", str(tmp_path / "probe"),
                                                 "--max-captions", "40"])
    # the CLI reads the manifest as shipped (5,000 images), the staged set has 48: same families, same scenes
    assert out.exit_code == 0, out.output
    assert out.output.count("within-family accuracy") == 2
    # one CSV for the models probed, each accuracy with its caption-bootstrap interval and where it was measured
    from benchmarks.report import published, read_csv

    rows = read_csv(str(tmp_path / "probe" / "family_probe.csv"))
    half = len(rows) // 2  # the same model twice: the same rows twice (one seeded caption sample and resample)
    assert len(rows) == 2 * half and all(r["be_model"] == model_dir for r in rows)
    assert [r["accuracy_lo"] for r in rows[:half]] == [r["accuracy_lo"] for r in rows[half:]]
    assert all(float(r["accuracy_lo"]) <= float(r["accuracy"]) <= float(r["accuracy_hi"]) for r in rows)
    assert all(r[c] for r in rows for c in published.PROVENANCE)
    block = published.probe_block(rows)
    assert "| CE |" in block and published.block_numbers_problems(block, rows, "probe") == []
    # a published copy names the model folders below the machine's own folder
    (tmp_path / "repo").mkdir()
    rows_clean = [{**r, "commit": "abc"} for r in rows]
    import csv
    with open(tmp_path / "clean.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows_clean[0]))
        w.writeheader()
        w.writerows(rows_clean)
    copied = (tmp_path / "repo" / published.publish(str(tmp_path / "clean.csv"), str(tmp_path / "repo"))).read_text()
    assert model_dir not in copied and f"{published.RUNS_MARK}/" in copied
    two = CliRunner().invoke(family_probe.main, ["--staged", staged, "--manifest", "demo", "--model", model_dir,
                                                 "--model", model_dir, "--ce-model", model_dir])
    assert two.exit_code == 1 and "one per --model" in two.output and "Traceback" not in two.output
    bad = CliRunner().invoke(family_probe.main, ["--staged", staged, "--manifest", "coco_5k", "--model", model_dir])
    assert bad.exit_code != 0 and "Traceback" not in bad.output and "synthetic" in bad.output.lower()
    missing = CliRunner().invoke(family_probe.main, ["--staged", str(tmp_path / "nowhere"), "--manifest", "demo",
                                                     "--model", model_dir])
    assert missing.exit_code == 1 and "is not a staged directory" in missing.output


def test_cli_spells_device_and_threads_like_every_other_cli(setup, tmp_path):
    import torch

    staged, model_dir, _ = setup
    args = ["--staged", staged, "--manifest", "demo", "--model", model_dir, "--max-captions", "10"]
    before = torch.get_num_threads()
    try:
        out = CliRunner().invoke(family_probe.main, args + ["--device", "CPU", "--threads", "1"])
        assert out.exit_code == 0, out.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    bad = CliRunner().invoke(family_probe.main, args + ["--device", "gpu"])
    assert bad.exit_code == 2 and "device must be one of auto|cpu|cuda|cuda:N, got 'gpu'" in bad.output
    assert "--device [auto|cpu|cuda|cuda:N]" in CliRunner().invoke(family_probe.main, ["-h"]).output
    if not torch.cuda.is_available():
        no_gpu = CliRunner().invoke(family_probe.main, args + ["--device", "cuda"])
        assert no_gpu.exit_code == 1 and "CUDA is not available" in no_gpu.output and "Traceback" not in no_gpu.output

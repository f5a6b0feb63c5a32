"""The tutorial "Your own photos, end to end" (docs/OWN_PHOTOS.md), run as written: a folder of photos and a Karpathy
JSON -> stage (Lite0 grid regions) -> train -> encode -> index -> rerank -> evaluate.

The photos are the real JPEGs of the AllenNLP fixtures (Flickr30k, GQA, VQA, SNLI-VE; their Flickr30k sentences
where they have them) when ``../shared/realdata`` is present, else pictures drawn here; the other captions are
written from each photo's name. The commands are parsed from the doc's section (tests/test_walkthrough.py)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import REPO_ROOT, realdata_dir
from tests.helpers_model import write_tiny_bert
from tests.test_walkthrough import expand, run_command, walkthrough

DOC = REPO_ROOT / "docs" / "OWN_PHOTOS.md"  # the tutorial the README links to
SECTION = "# Your own photos, end to end"
SPLITS = ("train",) * 14 + ("val",) * 4 + ("test",) * 6  # 24 photos


def write_photos(root) -> dict:
    """24 photos and their Karpathy JSON; the settings the doc names."""
    from PIL import Image, ImageDraw

    photos = root / "photos"
    photos.mkdir(parents=True)
    real = realdata_dir()
    fixtures = real / "allennlp_vision_fixtures" if real else None
    sentences = {}
    if fixtures and (fixtures / "images").is_dir():
        seen = set()
        for path in sorted((fixtures / "images").glob("*/*.jpg")):
            if path.stem not in seen and len(seen) < len(SPLITS):
                seen.add(path.stem)
                shutil.copy(path, photos / path.name)
        for path in (fixtures / "flickr30k" / "sentences").glob("*.txt"):
            from retrieval_core.data.readers import strip_entities_markup

            sentences[path.stem] = [strip_entities_markup(s) for s in path.read_text().splitlines() if s.strip()]
    for i in range(len(SPLITS) - len(list(photos.iterdir()))):
        im = Image.new("RGB", (200 + 10 * i, 150), (30 * i % 255, 100, 200))
        ImageDraw.Draw(im).ellipse([20, 20, 60 + 5 * i, 90], fill=(250, 250, 20))
        im.save(photos / f"drawn{i:02d}.png")
    images = []
    for k, (path, split) in enumerate(zip(sorted(photos.iterdir()), SPLITS)):
        texts = sentences.get(path.stem) or [f"a photo named {path.stem.replace('_', ' ')}", f"picture {k}"]
        images.append({"filename": path.name, "split": split,
                       "sentences": [{"raw": t, "sentid": 100 * k + j} for j, t in enumerate(texts)]})
    captions = root / "dataset.json"
    captions.write_text(json.dumps({"images": images}))
    return {"PHOTOS_DIR": str(photos), "PHOTOS_KARPATHY_JSON": str(captions)}


def test_photos_walkthrough_runs_as_written(tmp_path):
    files = write_photos(tmp_path / "data")
    work = tmp_path / "runs" / "photos"
    base = write_tiny_bert(str(tmp_path / "bert"))
    values = {**files, "W": str(work), "BASE_MODEL": base, "DEVICE": "cpu", "STEPS": "3", "EVAL_EVERY": "3",
              "CE_START": "1"}
    doc_settings, commands = walkthrough(DOC.read_text(encoding="utf-8"), SECTION)
    assert sorted(doc_settings) == sorted(values), "the walkthrough's settings are not the ones this test sets"
    assert [argv[0] for argv in commands] == ["pipelines.stage", "retrieval_core.training.train", "pipelines.encode",
                                              "pipelines.build_index", "pipelines.rerank", "benchmarks.evaluate",
                                              "benchmarks.evaluate"]
    saved = {k: os.environ.get(k) for k in (*files, "RR_DATA_ROOT")}
    os.environ.pop("RR_DATA_ROOT", None)
    os.environ.update(files)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from more; idle OpenMP threads spin on a busy machine
    try:
        outputs = [run_command(argv[0], [expand(a, values) for a in argv[1:]]) for argv in commands]
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    summary = json.loads((work / "staged" / "summary.json").read_text())
    images = summary["collections"]["photos"]["images"]
    assert images["staged_by_split"] == {s: SPLITS.count(s) for s in set(SPLITS)} and images["rejected"] == 0
    assert summary["image_backbone"]["name"] == "efficientnet-lite0"
    assert json.loads((work / "join" / "best" / "rr_model.json").read_text())["image_backbone"] == \
        summary["image_backbone"]["fingerprint"]
    import pandas as pd

    rows = pd.read_csv(work / "results" / "metrics.csv")
    assert sorted(rows["direction"]) == ["i2t", "i2t", "t2i", "t2i"] and rows["mode"].nunique() == 2
    assert (rows["queries"] > 0).all() and "staged" in outputs[0]
    if not realdata_dir():
        pytest.skip("ran on drawn pictures: real photos need ../shared/realdata")

"""The pages people look at (retrieval_core.pages), as headless Chromium shows them: the query job's hits.html and
the inspection page (benchmarks.inspect) draw a collection staged from pictures with thumbnails the browser
decodes, found where the staged folder says it was staged from, and a synthetic collection with its scene
descriptions; queries (user input) are text, never markup; headers name no machine's absolute paths."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from PIL import Image

from benchmarks import inspect as insp
from pipelines.query import plan as query_plan
from pipelines.query import run as query_run
from retrieval_core import pages
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.scenes import describe_scene
from retrieval_core.search.query import QueryEngine
from tests.helpers_chromium import Dom, rendered_dom
from tests.test_inspect import _co_run, _staged

K = 3
HOSTILE = "<script>document.title='x'</script> a red dog & <b>a blue car</b>"


def as_staged_from_pictures(staged, pictures) -> list[str]:
    """Record in ``staged``'s summary that its one collection came from picture files in ``pictures`` (what
    pipelines.stage records for an image_files source), and draw a picture per staged image, named by its
    source id; returns the source ids."""
    pictures.mkdir()
    meta = StagedDataset(str(staged)).images_meta()
    for n, sid in enumerate(meta["source_id"]):
        Image.new("RGB", (120 + n, 90), (20 * (n % 12), 100, 200)).save(pictures / f"{sid}.png")
    summary = json.loads((staged / "summary.json").read_text())
    (collection,) = summary["collections"]
    summary["collections"][collection]["images"].update(format="image_files", path=str(pictures))
    summary.pop("manifest", None)  # a folder staged elsewhere: the pictures are found from the summary alone
    (staged / "summary.json").write_text(json.dumps(summary))
    return list(meta["source_id"])


@pytest.fixture(scope="module")
def pictured(tmp_path_factory, tiny_encoded):
    """(root, staged, embeddings): a copy of the tiny staged folder as if staged from pictures, and its embeddings."""
    staged, _, emb = tiny_encoded
    root = tmp_path_factory.mktemp("pages")
    shutil.copytree(staged, root / "staged")
    as_staged_from_pictures(root / "staged", root / "pictures")
    return root, str(root / "staged"), emb


def test_query_job_page_shows_each_hit_as_a_thumbnail_in_chromium(pictured, tmp_path):
    root, staged, emb = pictured
    (tmp_path / "q.txt").write_text(f"{HOSTILE}\na green tree\n")
    out = str(tmp_path / "t2i")
    manifest = query_run.run(query_plan.QueryPlan(staged, emb, out, queries=str(tmp_path / "q.txt"), k=K))
    assert manifest["page"] == {"path": "hits.html", "queries": 2}
    page = os.path.join(out, "hits.html")
    source = open(page, encoding="utf-8").read()
    assert str(tmp_path) not in source and str(root) not in source  # no machine's absolute paths
    dom = Dom(rendered_dom(page, str(tmp_path)))
    thumbs = [i for i in dom.images if i["class"] == "thumb"]
    assert len(thumbs) == 2 * K and all(0 < i["width"] <= pages.THUMBNAIL_PX for i in thumbs), dom.images
    assert HOSTILE in dom.text  # shown as the text it is: no element, no script run
    assert "2 of 2 answered queries shown" in dom.text

    ids = tmp_path / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in StagedDataset(staged).images_meta()["item_id"][:2]))
    out = str(tmp_path / "i2t")
    query_run.run(query_plan.QueryPlan(staged, emb, out, image_ids=str(ids), k=K, page_queries=1))
    dom = Dom(rendered_dom(os.path.join(out, "hits.html"), str(tmp_path)))
    hits = [json.loads(line) for line in open(os.path.join(out, "hits.jsonl"))]
    assert [i["width"] > 0 for i in dom.images] == [True]  # the one query shown, as its picture
    assert all(h["text"] in dom.text for h in hits[:K]) and "1 of 2 answered queries shown" in dom.text


def test_inspection_page_shows_pictures_and_scene_descriptions_in_chromium(tmp_path):
    """The pixel demo's case (a collection staged from pictures: thumbnails, without --images) and the synthetic
    demo's (region scenes: their descriptions)."""
    staged, images, caps = _staged(tmp_path / "staged")
    run, _ = _co_run(tmp_path / "run", images, caps)
    m = json.loads((run / "rankings_manifest.json").read_text())
    (run / "rankings_manifest.json").write_text(json.dumps({**m, "collection": "toy"}))
    insp.inspect(str(run), str(staged), str(tmp_path / "scenes.html"), per_group=2, show=3)
    dom = Dom(rendered_dom(str(tmp_path / "scenes.html"), str(tmp_path)))
    spec = load_manifest(str(staged / "toy.yaml")).synthetic_spec("toy")
    shown = [i for i in range(len(images)) if pages.scene_text(describe_scene(spec, i)) in dom.text]
    assert len(shown) >= 2 and not dom.images

    as_staged_from_pictures(staged, tmp_path / "pictures")
    insp.inspect(str(run), str(staged), str(tmp_path / "pictures.html"), per_group=2, show=3)
    source = (tmp_path / "pictures.html").read_text()
    assert str(tmp_path) not in source
    dom = Dom(rendered_dom(str(tmp_path / "pictures.html"), str(tmp_path)))
    assert len(dom.images) >= 4 and all(i["width"] > 0 for i in dom.images), dom.images
    assert "A: run; B: run" in dom.text


def test_what_a_page_cannot_show_is_said_on_it(pictured, tiny_encoded, tmp_path):
    """A picture gone from where the collection was staged from, and a collection of extracted region features
    (no pictures, no scene generator): each said on the page, nothing dropped."""
    root, staged, emb = pictured
    copy = tmp_path / "staged"
    shutil.copytree(staged, copy)
    engine = QueryEngine(staged=str(copy), embeddings=emb, device="cpu", directions=("t2i",), needs_ce=False)
    hits = engine.search_text(["a red dog"], k=K, rerank="emb")
    gone = hits["source_id"].iloc[0]
    summary = json.loads((copy / "summary.json").read_text())
    pics = tmp_path / "pics"
    shutil.copytree(summary["collections"]["tiny"]["images"]["path"], pics)
    os.remove(pics / f"{gone}.png")
    summary["collections"]["tiny"]["images"]["path"] = str(pics)
    (copy / "summary.json").write_text(json.dumps(summary))
    text = pages.write_hits_page(str(tmp_path / "hits.html"), hits, str(copy), title="mine")
    assert text.count('<img class="thumb"') == K - 1 and f"no picture file for {gone}" in text

    plain = pages.write_hits_page(str(tmp_path / "plain.html"), hits, tiny_encoded[0])
    assert "collection tiny: images shown by id only" in plain and "<img" not in plain

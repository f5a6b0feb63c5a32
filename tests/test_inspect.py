"""benchmarks.inspect: the HTML page is parsed back (stdlib html.parser) and checked against the tables."""
import json
from html.parser import HTMLParser

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from benchmarks import inspect as insp
from retrieval_core import pages
from retrieval_core.data import schema, staging
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.shards import caption_shard_parquet, image_shard_parquet
from retrieval_core.data.synthetic.captions import generate_captions
from retrieval_core.data.synthetic.regions import generate_images
from retrieval_core.data.synthetic.scenes import describe_scene
from retrieval_core.search.rerank import derive_rankings, rank_query, rankings_table
from tests.test_evaluate import write_run

MANIFEST = """name: toy
feature_dim: 8
max_regions: 6
collections:
  toy:
    role: query
    images: {format: synthetic, num_images: 8, seed: 1, domain: coco, min_regions: 2, max_regions: 6,
             family_size: 4, splits: {test: 1.0}}
    captions: {format: synthetic, captions_per_image: 2}
benchmark: {query_collection: toy, split: test}
"""


def _staged(root):
    """A staged synthetic collection (8 images, 16 captions) written with the staging library, its summary
    naming the manifest it came from (as pipelines.stage records it)."""
    path = root / "toy.yaml"
    root.mkdir(parents=True)
    path.write_text(MANIFEST)
    spec = load_manifest(str(path)).synthetic_spec("toy")
    images = [staging.stage_image(r, collection="toy", feature_dim=8, max_regions=6, source="synthetic")
              for r in generate_images(spec)]
    caps = [staging.stage_caption(c, collection="toy", source="synthetic")
            for c in generate_captions(spec)]
    (root / "images").mkdir()
    (root / "captions").mkdir()
    (root / "images" / "toy-00000-of-00001.parquet").write_bytes(image_shard_parquet(images, 8))
    (root / "captions" / "toy-00000-of-00001.parquet").write_bytes(caption_shard_parquet(caps))
    block = lambda kind, n: {"format": "synthetic", "shards": [  # noqa: E731
        {"name": f"{kind}/toy-00000-of-00001.parquet", "rows": n}]}
    summary = {"complete": True, "feature_dim": 8, "manifest": {"name": "toy", "path": str(path)},
               "collections": {"toy": {"images": block("images", len(images)),
                                       "captions": block("captions", len(caps))}}}
    (root / "summary.json").write_text(json.dumps(summary))
    return root, images, caps


def _co_run(run_dir, images, caps, k=4):
    """A CO run with seeded random BE and CE scores over every item (both directions)."""
    rng = np.random.default_rng(0)
    img_ids = np.array([r["item_id"] for r in images])
    cap_ids = np.array([c["caption_id"] for c in caps])
    parts = []
    for direction, queries, items in ((schema.DIRECTION_T2I, cap_ids, img_ids),
                                      (schema.DIRECTION_I2T, img_ids, cap_ids)):
        results = []
        for _ in queries:
            order = rng.permutation(items)[:10]
            be = np.sort(rng.random(len(order)))[::-1]
            results.append(rank_query(order, be, rng.normal(size=min(k, len(order))), k, "ce", keep=len(order)))
        parts.append(rankings_table(direction, queries, results))
    manifest = write_run(run_dir, parts, mode="co", k=k)
    # write_run records the evaluate test's toy collection; this run is of the staged "toy" too
    return manifest, parts


class Page(HTMLParser):
    """Summary cells by (direction, class), and per query section its data attributes, its lists' gold-rank
    text and the rank of each gold-marked row."""

    def __init__(self):
        super().__init__()
        self.summary, self.queries, self.stack = {}, [], []
        self._dir = self._cell = self._side = None
        self._row = None
        self.text = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-direction" in a:
            self._dir = a["data-direction"]
        if tag == "td" and self._dir and a.get("class"):
            self._cell = a["class"]
        if tag == "section" and a.get("class") == "query":
            self.queries.append({**a, "lists": {}})
        if tag == "div" and "data-side" in a:
            self._side = a["data-side"]
            self.queries[-1]["lists"][self._side] = {"gold_rows": [], "gold_text": ""}
        if tag == "span" and a.get("class") == "gold-rank":
            self._cell = "gold-rank"
        if tag == "tr" and self._side:
            self._row = {"gold": a.get("class") == "gold", "cells": []}
        if tag == "td" and self._row is not None:
            self._cell = "list-cell"
        self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag == "tr" and self._row is not None:
            if self._row["gold"]:
                self.queries[-1]["lists"][self._side]["gold_rows"].append(int(self._row["cells"][0]))
            self._row = None
        if tag == "tr":
            self._dir = None
        if tag == "div" and self._side and self.stack[-1] == "div":
            pass
        if tag == "section":
            self._side = None
        self._cell = None if tag in ("td", "span") else self._cell
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)
        if self._cell == "gold-rank":
            self.queries[-1]["lists"][self._side]["gold_text"] += data
        elif self._cell == "list-cell" and self._row is not None:
            self._row["cells"].append(data.strip())
            self._cell = "done"
        elif self._cell and self._dir:
            self.summary[(self._dir, self._cell)] = data


def _expected(tables, staged_caps, images):
    """Per direction: {query: gold rank or None} of A (CO as stored) and B (EMB derived), by hand."""
    cap_to_img = {c["caption_id"]: c["image_item_id"] for c in staged_caps}
    img_to_caps = {}
    for c, i in cap_to_img.items():
        img_to_caps.setdefault(i, set()).add(c)
    out = {}
    for t in tables:
        d = t.column("direction")[0].as_py()
        emb = derive_rankings(t, 4, "emb").to_pandas()
        for side, df in (("a", t.to_pandas()), ("b", emb)):
            for q, g in df.groupby("query_id"):
                gold = {cap_to_img[q]} if d == "t2i" else img_to_caps[q]
                hits = g.sort_values("rank")
                hits = hits[hits["item_id"].isin(gold)]
                out.setdefault(d, {}).setdefault(int(q), {})[side] = int(hits["rank"].iloc[0]) if len(hits) else None
    return out


def test_page_summary_and_listed_queries_match_the_tables(tmp_path):
    staged, images, caps = _staged(tmp_path / "staged")
    run, tables = _co_run(tmp_path / "run", images, caps)
    m = json.loads((run / "rankings_manifest.json").read_text())
    (run / "rankings_manifest.json").write_text(json.dumps({**m, "collection": "toy"}))
    out = tmp_path / "page.html"
    res = CliRunner().invoke(insp.main, ["--rankings", str(run), "--staged", str(staged), "--output", str(out),
                                         "--per-group", "3", "--show", "2"])
    assert res.exit_code == 0, res.output
    page = Page()
    page.feed(out.read_text())
    expected = _expected(tables, caps, images)
    for d, per_q in expected.items():
        improved = sum(v["a"] == 1 and v["b"] != 1 for v in per_q.values())
        hurt = sum(v["b"] == 1 and v["a"] != 1 for v in per_q.values())
        assert int(page.summary[(d, "queries")]) == len(per_q)
        assert int(page.summary[(d, "improved")]) == improved
        assert int(page.summary[(d, "hurt")]) == hurt
        assert int(page.summary[(d, "unchanged")]) == len(per_q) - improved - hurt
        r1 = 100 * sum(v["a"] == 1 for v in per_q.values()) / len(per_q)
        assert float(page.summary[(d, "r1-a")]) == pytest.approx(r1, abs=0.01)
        assert f"{d}: {len(per_q)} queries" in res.output
        moved = sum(v["a"] != v["b"] for v in per_q.values()) - improved - hurt
        shown = [q["data-group"] for q in page.queries if q["data-direction"] == d]
        assert [shown.count(g) for g in insp.GROUPS] == [min(3, n) for n in (improved, hurt, moved)]
    assert page.queries, "no query listed"
    for q in page.queries:
        want = expected[q["data-direction"]][int(q["data-query-id"])]
        for side in ("a", "b"):
            rank = want[side]
            assert q[f"data-gold-rank-{side}"] == (str(rank) if rank is not None else "none")
            lst = q["lists"][side]
            assert lst["gold_text"] == (f"gold at rank {rank}" if rank is not None else "gold not in the top 10")
            # the gold row is shown (even below --show) with its rank; t2i has one gold image per query
            if rank is not None:
                assert min(lst["gold_rows"]) == rank
        assert want["a"] != want["b"]  # only queries whose gold moved are listed
        if q["data-group"] == "improved":
            assert want["a"] == 1 and want["b"] != 1
        elif q["data-group"] == "hurt":
            assert want["b"] == 1 and want["a"] != 1
        else:
            assert 1 not in (want["a"], want["b"]) or want["a"] == want["b"] == 1
    text = "".join(page.text)
    spec = load_manifest(str(staged / "toy.yaml")).synthetic_spec("toy")
    assert pages.scene_text(describe_scene(spec, 0)) in text or \
        any(pages.scene_text(describe_scene(spec, i)) in text for i in range(8))
    assert caps[0]["text"] in text or any(c["text"] in text for c in caps)
    assert "http" not in out.read_text()  # self-contained
    assert str(tmp_path) not in out.read_text() and "A: run; B: run" in text  # no machine's absolute paths


def test_thumbnails_are_embedded_and_mismatched_runs_refused(tmp_path):
    from PIL import Image

    staged, images, caps = _staged(tmp_path / "staged")
    run, _ = _co_run(tmp_path / "run", images, caps)
    m = json.loads((run / "rankings_manifest.json").read_text())
    (run / "rankings_manifest.json").write_text(json.dumps({**m, "collection": "toy"}))
    pics = tmp_path / "pics"
    pics.mkdir()
    for r in images:
        Image.new("RGB", (400, 300), (200, 10, 10)).save(pics / f"{r['source_id']}.png")
    out = tmp_path / "page.html"
    insp.inspect(str(run), str(staged), str(out), images=str(pics), per_group=2)
    html_text = out.read_text()
    assert html_text.count('src="data:image/jpeg;base64,') >= 1
    # a B run of other queries is refused in one line
    other, _ = _co_run(tmp_path / "other", images, caps[:-2])
    m = json.loads((other / "rankings_manifest.json").read_text())
    (other / "rankings_manifest.json").write_text(json.dumps({**m, "collection": "toy"}))
    res = CliRunner().invoke(insp.main, ["--rankings", str(run), "--against", str(other), "--staged", str(staged),
                                         "--output", str(tmp_path / "x.html")])
    assert res.exit_code == 1 and "rank different queries" in res.output
    res = CliRunner().invoke(insp.main, ["--rankings", str(run), "--staged", str(staged), "--output",
                                         str(tmp_path / "x.html"), "--images", str(tmp_path / "nowhere")])
    assert res.exit_code == 1 and "not a directory" in res.output


def test_text_is_escaped(tmp_path):
    views = insp.ItemViews.__new__(insp.ItemViews)
    views._captions = pa.table({"caption_id": [1], "text": ["<script>x</script>"]}).to_pandas().set_index("caption_id")
    assert "<script>" not in insp._item_html(views, schema.DIRECTION_I2T, 1)

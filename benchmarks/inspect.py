"""Rankings people can look at: one self-contained HTML page comparing two rankings of the same queries.

    python -m benchmarks.inspect --rankings RUN_A [--mode co] [--against RUN_B] [--against-mode emb] \\
        --staged STAGED --output report.html [--images DIR] [--manifest NAME|PATH]

``--rankings`` / ``--against`` are pipelines.rerank runs (read and checksum-verified by retrieval_core.evaluation.runs);
each side is re-derived for its ``--mode``/``--k``/``--lam`` from the stored scores
(``retrieval_core.search.rerank.derive_rankings``), so "EMB vs JOIN+CO" needs the one CO run: ``--against``
defaults to the same run, ``--mode`` to A's own mode and ``--against-mode`` to emb.

The page holds, per direction: a summary (R@1 of both sides; queries improved = A has the gold at rank 1 and
B does not, hurt = the other way round, unchanged = the rest), then the queries whose gold moved most, in three
groups (improved, hurt, gold rank changed otherwise): the query (caption text, or the query image), its gold
item(s) and both top lists with BE rank, BE score, CE score and the gold marked. Images are shown by their
scene description where the collection is synthetic (``retrieval_core.data.synthetic.scenes.describe_scene`` from the
manifest recorded in the staged summary, or ``--manifest``) and by a thumbnail where ``--images DIR`` holds a
file named after the image's source id (``DIR/<source_id>.<ext>``, subfolders allowed: ``DIR/a/b.jpg`` is
source id ``a/b``). Everything is inline (CSS, base64 thumbnails): the page opens anywhere, offline.

Both sides must rank the same collection, split, directions and queries: anything else is a one-line error.
"""
from __future__ import annotations

import base64
import html
import io
import logging
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

import click
import numpy as np
import pandas as pd

from pipelines.files import BEAM_FILES, write_atomic
from retrieval_core.cli import CheckedPlan, cli_errors, k_option, lam_option, option, plan_command, plan_from_cli
from retrieval_core.data import schema
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.synthetic.scenes import describe_scene
from retrieval_core.evaluation.metrics import DIRECTIONS, check_queries
from retrieval_core.evaluation.runs import LoadedRun, RunError
from retrieval_core.search.rerank import RUN_MODES

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp")
THUMBNAIL_PX = 160
GROUPS = ("improved", "hurt", "moved")
GROUP_TITLES = {"improved": "improved at R@1 (A has the gold first, B does not)",
                "hurt": "hurt at R@1 (B has the gold first, A does not)",
                "moved": "gold rank changed, R@1 unchanged"}


class InspectError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------ rankings
@dataclass(frozen=True)
class Side:
    """One ranking of a run: the run's rows re-derived for (mode, k, lam)."""
    loaded: LoadedRun
    run: str
    mode: str
    k: int
    lam: Optional[float]
    manifest: dict
    rows: pd.DataFrame  # schema.RANKING_COLUMNS, sorted by direction, query_id, rank

    @property
    def label(self) -> str:
        lam = f" lam={self.lam:g}" if self.lam is not None else ""
        return f"{self.mode.upper()} k={self.k}{lam} ({os.path.basename(os.path.normpath(self.run))})"


def load_side(run: str, staged: str, mode: Optional[str] = None, k: Optional[int] = None,
              lam: Optional[float] = None) -> Side:
    """A run's rankings as ranked by ``mode``/``k``/``lam`` (each default: the run's own), verified and
    re-derived from its stored scores (retrieval_core.evaluation.runs)."""
    loaded = LoadedRun.read(run, staged, files=BEAM_FILES)
    k, mode, lam = loaded.resolve(k, mode, lam)
    rows = loaded.ranked(k, mode, lam).to_pandas()
    rows = rows.sort_values(["direction", "query_id", "rank"], kind="stable").reset_index(drop=True)
    return Side(loaded=loaded, run=run, mode=mode, k=k, lam=lam, manifest=loaded.manifest, rows=rows)


def _lists(side: Side, direction: str) -> dict[int, pd.DataFrame]:
    sub = side.rows[side.rows["direction"] == direction]
    return {int(q): g.reset_index(drop=True) for q, g in sub.groupby("query_id", sort=True)}


def gold_rank(ranked: pd.DataFrame, gold: frozenset) -> Optional[int]:
    """1-based rank of the first gold item in a ranked list, None when no gold item is in it."""
    hit = ranked["item_id"].isin(gold).to_numpy()
    return int(ranked["rank"].to_numpy()[np.argmax(hit)]) if hit.any() else None


@dataclass
class QueryDiff:
    direction: str
    query_id: int
    gold: frozenset
    rank_a: Optional[int]
    rank_b: Optional[int]
    list_a: pd.DataFrame
    list_b: pd.DataFrame

    @property
    def group(self) -> Optional[str]:
        hit_a, hit_b = self.rank_a == 1, self.rank_b == 1
        if hit_a and not hit_b:
            return "improved"
        if hit_b and not hit_a:
            return "hurt"
        return "moved" if self.rank_a != self.rank_b else None

    def distance(self, depth: int) -> int:
        """How far the gold moved; 'not in the list' counts as one past the list's end."""
        a = self.rank_a if self.rank_a is not None else depth + 1
        b = self.rank_b if self.rank_b is not None else depth + 1
        return abs(a - b)


@dataclass
class Comparison:
    a: Side
    b: Side
    collection: str
    split: Optional[str]
    directions: tuple[str, ...]
    queries: dict[str, list[QueryDiff]] = field(default_factory=dict)

    def summary(self, direction: str) -> dict:
        qs = self.queries[direction]
        groups = [q.group for q in qs]
        n = len(qs)
        return {"queries": n, "R@1 A": 100.0 * sum(q.rank_a == 1 for q in qs) / n,
                "R@1 B": 100.0 * sum(q.rank_b == 1 for q in qs) / n,
                "improved": groups.count("improved"), "hurt": groups.count("hurt"),
                "unchanged": n - groups.count("improved") - groups.count("hurt")}


def compare(a: Side, b: Side, gold: tuple[Mapping[int, int], Mapping[int, frozenset]], collection: str,
            split: Optional[str]) -> Comparison:
    """Per query of every direction both sides rank: the gold item(s) and their rank on each side."""
    for key in ("collection", "split"):
        if a.manifest.get(key) != b.manifest.get(key):
            raise InspectError(f"the two runs rank different {key}s: {a.manifest.get(key)!r} ({a.run}) vs "
                               f"{b.manifest.get(key)!r} ({b.run})")
    dirs_a = [d for d in DIRECTIONS if d in a.manifest.get("directions", DIRECTIONS)]
    dirs_b = [d for d in DIRECTIONS if d in b.manifest.get("directions", DIRECTIONS)]
    if dirs_a != dirs_b:
        raise InspectError(f"the two runs rank different directions: {dirs_a} ({a.run}) vs {dirs_b} ({b.run})")
    caption_to_image, image_to_captions = gold
    out = Comparison(a, b, collection, split, tuple(dirs_a))
    for d in dirs_a:
        la, lb = _lists(a, d), _lists(b, d)
        if la.keys() != lb.keys():
            only = sorted(set(la) ^ set(lb))
            raise InspectError(f"{d}: the two runs rank different queries ({len(only)} in one only, first: "
                               f"{only[:5]}); compare runs of the same --queries")
        golds = {q: frozenset({i}) for q, i in caption_to_image.items()} if d == schema.DIRECTION_T2I \
            else dict(image_to_captions)
        if not (a.manifest.get("queries_file") or b.manifest.get("queries_file")):
            check_queries(d, np.array(sorted(la), dtype=np.int64), golds.keys())  # a full run: every gold query
        else:
            check_queries(d, np.array(sorted(la), dtype=np.int64), [q for q in golds if q in la])
        out.queries[d] = [QueryDiff(d, q, golds[q], gold_rank(la[q], golds[q]), gold_rank(lb[q], golds[q]),
                                    la[q], lb[q]) for q in sorted(la)]
    return out


def listed(cmp: Comparison, direction: str, per_group: int) -> dict[str, list[QueryDiff]]:
    """Per group, the ``per_group`` queries whose gold moved most (ties: lower query id first)."""
    depth = int(max(len(q.list_a) for q in cmp.queries[direction])) if cmp.queries[direction] else 0
    out = {}
    for g in GROUPS:
        qs = [q for q in cmp.queries[direction] if q.group == g]
        qs.sort(key=lambda q: (-q.distance(depth), q.query_id))
        out[g] = qs[:per_group]
    return out


# ------------------------------------------------------------------------------------------------ items
def shown_path(path: str) -> str:
    """A run folder as the page names it: relative to the working folder when inside it, else its own name (a
    page is shared: it names no machine's absolute paths); a URL as given."""
    if "://" in str(path):
        return str(path)
    rel = os.path.relpath(os.path.abspath(path))
    return rel if not rel.startswith("..") else os.path.basename(os.path.abspath(path).rstrip(os.sep))


def scene_text(scene: Mapping) -> str:
    """One line of a synthetic scene graph: its groups, the focus relation and the family change."""
    def group(g):
        noun = g["class"] + ("s" if g["count"] > 1 else "")
        return f"{g['count']} {g['size']} {g['colour']} {noun}"
    groups = scene["groups"]
    parts = [f"{group(groups[0])} {scene['relation']} {group(groups[1])}"] + [group(g) for g in groups[2:]]
    change = scene["change"] or "base"
    return "; ".join(parts) + f" [family {scene['family']}, member {scene['member']}: {change}]"


class ItemViews:
    """What an item looks like on the page: caption text, image scene description and thumbnail."""
    def __init__(self, dataset, manifest_ref: Optional[str] = None, images_dir: Optional[str] = None):
        self.dataset = dataset
        self.notes: list[str] = []
        self._specs = self._synthetic_specs(manifest_ref)
        self._files = self._image_files(images_dir) if images_dir else None
        self._captions: Optional[pd.DataFrame] = None
        self._images: Optional[pd.DataFrame] = None

    def _synthetic_specs(self, manifest_ref: Optional[str]) -> dict:
        synthetic = [c for c, block in self.dataset.summary["collections"].items()
                     if (block.get("images") or {}).get("format") == "synthetic"]
        if not synthetic:
            return {}

        recorded = self.dataset.summary.get("manifest") or {}
        refs = [manifest_ref] if manifest_ref else [r for r in (recorded.get("path"), recorded.get("name")) if r]
        for ref in refs:
            try:
                m = load_manifest(ref)
                return {c: m.synthetic_spec(c) for c in synthetic}
            except (OSError, ValueError, KeyError) as exc:
                if manifest_ref:
                    raise InspectError(f"--manifest {manifest_ref}: {exc}") from None
                last = exc
        self.notes.append(f"scene descriptions unavailable: the staged summary's manifest {refs} did not load "
                          f"({last if refs else 'none recorded'}); pass --manifest")
        return {}

    @staticmethod
    def _image_files(images_dir: str) -> dict[str, str]:
        if not os.path.isdir(images_dir):
            raise InspectError(f"--images {images_dir}: not a directory")
        files = {}
        for root, _, names in os.walk(images_dir):
            for name in names:
                stem, ext = os.path.splitext(name)
                if ext.lower() in IMAGE_EXTENSIONS:
                    rel = os.path.relpath(os.path.join(root, stem), images_dir).replace(os.sep, "/")
                    files.setdefault(rel, os.path.join(root, name))
        return files

    def load(self, caption_ids: set, image_ids: set) -> None:
        caps = self.dataset.captions()
        self._captions = caps[caps["caption_id"].isin(caption_ids)].set_index("caption_id")
        meta = self.dataset.images_meta()
        self._images = meta[meta["item_id"].isin(image_ids)].set_index("item_id")

    def caption(self, caption_id: int) -> str:
        if caption_id not in self._captions.index:
            return f"caption {caption_id} (not in the staged data)"
        return str(self._captions.at[caption_id, "text"])

    def image_source(self, item_id: int) -> tuple[str, str]:
        if item_id not in self._images.index:
            return "", ""
        row = self._images.loc[item_id]
        return str(row["collection"]), str(row["source_id"])

    def scene(self, collection: str, source_id: str) -> Optional[str]:
        """The one-line scene description of a synthetic image (None for a collection that is not synthetic);
        ValueError / IndexError for a source id the generator does not have."""
        spec = self._specs.get(collection)
        return None if spec is None else scene_text(describe_scene(spec, int(source_id)))

    def image_html(self, item_id: int) -> str:
        collection, source_id = self.image_source(item_id)
        if not source_id:
            return f'<span class="missing">image {item_id} (not in the staged data)</span>'
        parts = [f'<span class="src">{html.escape(collection)}/{html.escape(source_id)}</span>']
        try:
            scene = self.scene(collection, source_id)
            if scene is not None:
                parts.append(f'<span class="scene">{html.escape(scene)}</span>')
        except (ValueError, IndexError) as exc:
            parts.append(f'<span class="missing">no scene: {html.escape(str(exc))}</span>')
        if self._files is not None:
            path = self._files.get(source_id)
            if path is None:
                parts.append(f'<span class="missing">no file for {html.escape(source_id)} under --images</span>')
            else:
                parts.append(f'<img alt="{html.escape(source_id)}" src="{thumbnail_data_uri(path)}">')
        return " ".join(parts)


def thumbnail_data_uri(path: str, px: int = THUMBNAIL_PX) -> str:
    """A JPEG thumbnail (longest side ``px``) as a data: URI."""
    try:
        from PIL import Image
    except ImportError:
        raise InspectError("--images needs Pillow (pip install pillow)") from None
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            im.thumbnail((px, px))
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=80)
    except OSError as exc:
        raise InspectError(f"{path}: not a readable image ({exc})") from None
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# ------------------------------------------------------------------------------------------------ HTML
CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.4em 0}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}
th{background:#f2f2f2}
tr.gold td{background:#dff5df;font-weight:600}
.query{border:1px solid #bbb;border-radius:4px;padding:.5em 1em;margin:1em 0}
.lists{display:flex;gap:1.5em;flex-wrap:wrap}
.list{flex:1 1 30em}
.src{color:#666;font-size:12px}
.scene{display:block}
.missing{color:#a33}
.note{color:#a33}
img{display:block;max-width:160px}
"""


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{float(v):.3f}"


def _rank_text(rank: Optional[int], depth: int) -> str:
    return f"gold at rank {rank}" if rank is not None else f"gold not in the top {depth}"


def _item_html(views: ItemViews, direction: str, item_id: int) -> str:
    if direction == schema.DIRECTION_T2I:
        return views.image_html(item_id)
    return f'{html.escape(views.caption(item_id))} <span class="src">caption {item_id}</span>'


def _list_html(views: ItemViews, q: QueryDiff, side: str, label: str, ranked: pd.DataFrame, rank: Optional[int],
               show: int) -> str:
    rows = []
    for r in ranked.head(show).itertuples(index=False):
        cls = ' class="gold"' if r.item_id in q.gold else ""
        rows.append(f"<tr{cls}><td>{r.rank}</td><td>{r.be_rank}</td><td>{_fmt(r.be_score)}</td>"
                    f"<td>{_fmt(r.ce_score)}</td><td>{_item_html(views, q.direction, int(r.item_id))}</td></tr>")
    if rank is not None and rank > show:  # the gold below the shown rows: show where it sits
        r = next(x for x in ranked.itertuples(index=False) if x.rank == rank)
        rows.append(f'<tr class="gold"><td>{r.rank}</td><td>{r.be_rank}</td><td>{_fmt(r.be_score)}</td>'
                    f"<td>{_fmt(r.ce_score)}</td><td>{_item_html(views, q.direction, int(r.item_id))}</td></tr>")
    return (f'<div class="list" data-side="{side}"><h4>{html.escape(label)}: '
            f'<span class="gold-rank">{_rank_text(rank, len(ranked))}</span></h4>'
            f"<table><tr><th>rank</th><th>BE rank</th><th>BE score</th><th>CE score</th><th>item</th></tr>"
            + "".join(rows) + "</table></div>")


def _query_html(views: ItemViews, cmp: Comparison, q: QueryDiff, group: str, show: int) -> str:
    if q.direction == schema.DIRECTION_T2I:
        what = f'caption {q.query_id}: <q>{html.escape(views.caption(q.query_id))}</q>'
        gold = views.image_html(next(iter(q.gold)))
    else:
        what = f"image {q.query_id}: {views.image_html(q.query_id)}"
        gold = "<br>".join(_item_html(views, q.direction, c) for c in sorted(q.gold))
    none = "none"
    return (f'<section class="query" data-direction="{q.direction}" data-query-id="{q.query_id}" '
            f'data-group="{group}" data-gold-rank-a="{q.rank_a if q.rank_a is not None else none}" '
            f'data-gold-rank-b="{q.rank_b if q.rank_b is not None else none}">'
            f'<h3>{q.direction} {what}</h3><div class="gold-items"><b>gold:</b> {gold}</div>'
            f'<div class="lists">'
            + _list_html(views, q, "a", "A " + cmp.a.label, q.list_a, q.rank_a, show)
            + _list_html(views, q, "b", "B " + cmp.b.label, q.list_b, q.rank_b, show)
            + "</div></section>")


def render(cmp: Comparison, views: ItemViews, per_group: int = 10, show: int = 10) -> str:
    """The whole page as one string (everything escaped, nothing external)."""
    chosen = {d: listed(cmp, d, per_group) for d in cmp.directions}
    caption_ids, image_ids = set(), set()
    for d, groups in chosen.items():
        for q in (q for qs in groups.values() for q in qs):
            ids = set(q.list_a["item_id"].tolist()) | set(q.list_b["item_id"].tolist()) | set(q.gold)
            (image_ids if d == schema.DIRECTION_T2I else caption_ids).update(ids)
            (caption_ids if d == schema.DIRECTION_T2I else image_ids).add(q.query_id)
    views.load(caption_ids, image_ids)

    title = f"{cmp.a.label} vs {cmp.b.label}"
    out = ["<!DOCTYPE html><html><head><meta charset=\"utf-8\">", f"<title>{html.escape(title)}</title>",
           f"<style>{CSS}</style></head><body>", f"<h1>A: {html.escape(cmp.a.label)}<br>B: {html.escape(cmp.b.label)}"
           f"</h1>", f"<p>collection {html.escape(str(cmp.collection))}, split {html.escape(str(cmp.split))}; "
           f"A: {html.escape(shown_path(cmp.a.run))}; B: {html.escape(shown_path(cmp.b.run))}</p>"]
    out += [f'<p class="note">{html.escape(n)}</p>' for n in views.notes]
    out.append('<table id="summary"><tr><th>direction</th><th>queries</th><th>R@1 A (%)</th><th>R@1 B (%)</th>'
               "<th>improved</th><th>hurt</th><th>unchanged</th></tr>")
    for d in cmp.directions:
        s = cmp.summary(d)
        out.append(f'<tr data-direction="{d}"><td>{d}</td><td class="queries">{s["queries"]}</td>'
                   f'<td class="r1-a">{s["R@1 A"]:.2f}</td><td class="r1-b">{s["R@1 B"]:.2f}</td>'
                   f'<td class="improved">{s["improved"]}</td><td class="hurt">{s["hurt"]}</td>'
                   f'<td class="unchanged">{s["unchanged"]}</td></tr>')
    out.append("</table><p>improved: A has a gold item at rank 1 and B does not; hurt: the other way round; "
               "unchanged: the rest. Below, per group, the queries whose gold moved most.</p>")
    for d in cmp.directions:
        for g in GROUPS:
            qs = chosen[d][g]
            out.append(f"<h2>{d}: {html.escape(GROUP_TITLES[g])} ({len(qs)} shown)</h2>")
            out += [_query_html(views, cmp, q, g, show) for q in qs]
    out.append("</body></html>")
    return "\n".join(out)


def inspect(rankings: str, staged: str, output: str, *, against: Optional[str] = None, mode: Optional[str] = None,
            against_mode: str = "emb", k: Optional[int] = None, against_k: Optional[int] = None,
            lam: Optional[float] = None, against_lam: Optional[float] = None, images: Optional[str] = None,
            manifest: Optional[str] = None, per_group: int = 10, show: int = 10) -> tuple[str, Comparison]:
    """Write the page comparing A (``rankings`` as ``mode``) with B (``against``, default the same run, as
    ``against_mode``); returns (its path, the comparison)."""
    a = load_side(rankings, staged, mode, k, lam)
    b = load_side(against or rankings, staged, against_mode, against_k if against_k is not None else k, against_lam)
    dataset, collection, split = a.loaded.dataset, a.loaded.collection, a.loaded.split
    cmp = compare(a, b, dataset.gold(collection, split), collection, split)
    page = render(cmp, ItemViews(dataset, manifest, images), per_group, show)
    write_atomic(output, page.encode("utf-8"))
    return output, cmp


@dataclass(frozen=True, kw_only=True)  # kw_only: required options may follow optional ones
class InspectPlan(CheckedPlan):
    """One inspection page, every option a typed field (checked when built); what the demo launches."""
    rankings: str = option(help="Run A: a pipelines.rerank run (its dir or its rankings/ dir).")
    against: Optional[str] = option(None, help="Run B [the same run as --rankings].")
    staged: str = option(help="Staged dataset directory (gold labels, captions, images).")
    output: str = option(help="The HTML page to write.")
    mode: Optional[str] = option(None, type=click.Choice(RUN_MODES, case_sensitive=False),
                                 help="Rank A with this mode [A's own].")
    against_mode: str = option("emb", type=click.Choice(RUN_MODES, case_sensitive=False),
                               help="Rank B with this mode.")
    k: Optional[int] = k_option(None, help="A's rerank depth [A's own].")
    against_k: Optional[int] = option(None, type=click.IntRange(min=1), help="B's rerank depth [--k, else B's own].")
    lam: Optional[float] = lam_option(None, help="A's add / norm_add weight [A's own, else 0.5].")
    against_lam: Optional[float] = lam_option(None, help="B's add / norm_add weight [B's own, else 0.5].")
    images: Optional[str] = option(None, help="Folder of image files named <source_id>.<ext>: thumbnails.")
    manifest: Optional[str] = option(None, help="Manifest of a synthetic collection (scene descriptions) [the one "
                                                "recorded in the staged summary].")
    per_group: int = option(10, type=click.IntRange(min=0),
                            help="Queries shown per direction and group (improved / hurt / moved).")
    show: int = option(10, type=click.IntRange(min=1), help="Rows shown per list.")


@plan_command(InspectPlan)
def main(**values):
    """One HTML page: where two rankings of the same queries differ, and where the gold item went."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with cli_errors(RunError, InspectError):
        p = plan_from_cli(InspectPlan, values)
        path, cmp = inspect(p.rankings, p.staged, p.output, against=p.against, mode=p.mode,
                            against_mode=p.against_mode, k=p.k, against_k=p.against_k, lam=p.lam,
                            against_lam=p.against_lam, images=p.images, manifest=p.manifest, per_group=p.per_group,
                            show=p.show)
    for d in cmp.directions:
        s = cmp.summary(d)
        click.echo(f"{d}: {s['queries']} queries, R@1 A {s['R@1 A']:.2f} / B {s['R@1 B']:.2f}: improved "
                   f"{s['improved']}, hurt {s['hurt']}, unchanged {s['unchanged']}")
    click.echo(f"wrote {os.path.abspath(path)}")


if __name__ == "__main__":
    main()

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
item(s) and both top lists with BE rank, BE score, CE score and the gold marked. Items are drawn by
``retrieval_core.pages.ItemViews`` (the query job's hits page draws them alike): an image by its scene description
where the collection is synthetic (the manifest recorded in the staged summary, or ``--manifest``) and by a
thumbnail of its picture where it was staged from picture files (found where the staged folder says; or
``--images DIR``, a folder of files named after the images' source ids: ``DIR/<source_id>.<ext>``, subfolders
allowed, ``DIR/a/b.jpg`` is source id ``a/b``). Everything is inline (CSS, base64 thumbnails): the page opens
anywhere, offline, and names no machine's absolute paths.

Both sides must rank the same collection, split, directions and queries: anything else is a one-line error.
"""
from __future__ import annotations

import html
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
from retrieval_core.evaluation.metrics import DIRECTIONS, check_queries
from retrieval_core.evaluation.runs import LoadedRun, RunError
from retrieval_core.pages import ItemViews, PageError, page, shown_path
from retrieval_core.search.rerank import RUN_MODES

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------------------------------ HTML
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
    out = [f"<h1>A: {html.escape(cmp.a.label)}<br>B: {html.escape(cmp.b.label)}</h1>",
           f"<p>collection {html.escape(str(cmp.collection))}, split {html.escape(str(cmp.split))}; "
           f"A: {html.escape(shown_path(cmp.a.run))}; B: {html.escape(shown_path(cmp.b.run))}</p>"]
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
    return page(title, out, views.notes)  # the notes last known: drawing the items adds to them


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
    try:
        views = ItemViews(dataset, manifest, images)
    except PageError as exc:
        raise InspectError(f"--images or --manifest: {exc}") from None
    write_atomic(output, render(cmp, views, per_group, show).encode("utf-8"))
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
    images: Optional[str] = option(None, help="Folder of image files named <source_id>.<ext>: thumbnails [the "
                                              "pictures a collection was staged from, where the staged folder "
                                              "says].")
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

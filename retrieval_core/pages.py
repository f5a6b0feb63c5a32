"""Pages people look at: staged items as they look (a picture's thumbnail, a synthetic scene's description, a
caption's text) and the one self-contained HTML page they sit on (inline CSS, thumbnails as data: URIs: it opens
anywhere, offline). ``benchmarks.inspect`` (two rankings compared) and ``pipelines.query`` (``hits.html``, the top
hits of each query) draw their items with :class:`ItemViews` and their pages with :func:`page`; from Python,
:func:`write_hits_page` draws a ``QueryEngine`` result.

Pictures are found where the staged folder came from: a collection staged from picture files (``image_files``)
records its source (the staged summary, and the manifest it names), whose files are listed once and matched to
the staged source ids as the stager matched them (file stem, ``source_id_pattern``). Items without a picture
show their synthetic scene description when the collection is generated, else their id; what a page cannot
show is said on it (a note), never left out silently. Every text is escaped: queries are user input. Paths on a
page are relative to the working folder, else a folder's own name: a page is shared and names no machine's
absolute paths.
"""
from __future__ import annotations

import base64
import html
import io
import os
from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from retrieval_core.data import schema
from retrieval_core.data.paths import FileAccess, is_url, read_file

#: Longest side of a thumbnail: a hits page of 50 queries x 10 hits stays a few MB.
THUMBNAIL_PX = 96
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp")
IMAGE_FILES = "image_files"  # the stager's format of collections staged from picture files
#: Queries a hits page shows by default (the first ones, in query order): every hit is in hits.jsonl.
PAGE_QUERIES = 50

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
img.thumb{display:block;max-width:%(px)dpx;max-height:%(px)dpx}
""" % {"px": THUMBNAIL_PX}


class PageError(ValueError):
    """A page that cannot be drawn as asked (a folder of pictures that is not one, a manifest that does not load)."""


def shown_path(path: str) -> str:
    """A path as a page names it: relative to the working folder when inside it, else its own name (a page is
    shared: it names no machine's absolute paths); a URL as given."""
    if is_url(str(path)):
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


def thumbnail_data_uri(path: str, px: int = THUMBNAIL_PX, files: Optional[FileAccess] = None) -> str:
    """A JPEG thumbnail (longest side ``px``) of a picture file as a data: URI; PageError naming the file when it
    cannot be read or decoded."""
    from PIL import Image

    try:
        data = read_file(path, files)
        with Image.open(io.BytesIO(data)) as im:
            im = im.convert("RGB")
            im.thumbnail((px, px))
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=80)
    except (OSError, ValueError) as exc:  # missing, unreadable, not an image (PIL's errors are OSErrors)
        raise PageError(f"{shown_path(path)}: not a readable picture ({exc})") from None
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _picture_files(folder: str) -> dict[str, str]:
    """{source id: file} of a folder of pictures named ``<source_id>.<ext>`` (subfolders: ``a/b.jpg`` is ``a/b``)."""
    if not os.path.isdir(folder):
        raise PageError(f"{folder}: not a directory of pictures")
    found = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            stem, ext = os.path.splitext(name)
            if ext.lower() in IMAGE_EXTENSIONS:
                rel = os.path.relpath(os.path.join(root, stem), folder).replace(os.sep, "/")
                found.setdefault(rel, os.path.join(root, name))
    return found


class ItemViews:
    """What a staged item looks like on a page: a caption's text; an image's collection/source id, with its
    thumbnail when its picture file is found (``pictures``, a folder of ``<source_id>.<ext>``, else where the
    staged folder says its collection was staged from) and its scene description when the collection is
    synthetic (the manifest recorded in the staged summary, or ``manifest``). ``notes``: what the page cannot
    show and why (shown on it)."""

    def __init__(self, dataset, manifest: Optional[str] = None, pictures: Optional[str] = None,
                 px: int = THUMBNAIL_PX):
        self.dataset = dataset
        self.files = getattr(dataset, "files", None)
        self.px = px
        self.notes: list[str] = []
        self._manifest = self._load_manifest(manifest)
        self._specs = self._synthetic_specs()
        self._given = _picture_files(pictures) if pictures else None
        self._pictures: dict[str, Optional[dict[str, str]]] = {}  # collection -> {source id: file}, found lazily
        self._by_id_only: set[str] = set()
        self._captions: Optional[pd.DataFrame] = None
        self._images: Optional[pd.DataFrame] = None

    # ------------------------------------------------------------------------------------- sources
    def _collections(self) -> dict:
        return self.dataset.summary.get("collections") or {}

    def _load_manifest(self, ref: Optional[str]):
        """The manifest the staged folder came from (its scene generator, its picture folders), or ``ref``; None
        with a note when the recorded one does not load (a folder staged elsewhere), PageError when ``ref``
        does not."""
        from retrieval_core.data.manifest import load_manifest

        recorded = self.dataset.summary.get("manifest") or {}
        refs = [ref] if ref else [r for r in (recorded.get("path"), recorded.get("name")) if r]
        wanted = any((c.get("images") or {}).get("format") in ("synthetic", IMAGE_FILES)
                     for c in self._collections().values())
        last: Optional[Exception] = None
        for r in refs:
            try:
                return load_manifest(r)
            except (OSError, ValueError, KeyError) as exc:
                if ref:
                    raise PageError(f"manifest {ref}: {exc}") from None
                last = exc
        if wanted:
            self.notes.append(f"the staged summary's manifest {refs} did not load "
                              f"({last if refs else 'none recorded'}): scene descriptions unavailable and picture "
                              f"folders taken from the staged summary")
        return None

    def _synthetic_specs(self) -> dict:
        names = [c for c, block in self._collections().items()
                 if (block.get("images") or {}).get("format") == "synthetic"]
        if not names or self._manifest is None:
            return {}
        try:
            return {c: self._manifest.synthetic_spec(c) for c in names}
        except (ValueError, KeyError) as exc:
            self.notes.append(f"scene descriptions unavailable: {exc}")
            return {}

    def _collection_pictures(self, collection: str) -> Optional[dict[str, str]]:
        """{source id: picture file} of a collection staged from picture files, listed once; None (with a note)
        for a collection of extracted region features, or one whose pictures are not where it was staged from."""
        if collection in self._pictures:
            return self._pictures[collection]
        from retrieval_core.data.readers._common import apply_source_id_pattern, file_stem
        from retrieval_core.data.readers.images import image_file_entries

        block = (self._collections().get(collection) or {}).get("images") or {}
        found = None
        if block.get("format") == IMAGE_FILES:
            source = self._manifest.collections.get(collection) if self._manifest is not None else None
            images = getattr(source, "images", None)
            path = images.path if images is not None and images.format == IMAGE_FILES else block.get("path")
            pattern = (images.options or {}).get("source_id_pattern") if images is not None else None
            try:
                entries = image_file_entries(path, self.files)
            except (FileNotFoundError, OSError, ValueError) as exc:
                self.notes.append(f"no thumbnails for collection {collection}: its pictures are not where it was "
                                  f"staged from ({exc})")
            else:
                found = {}
                for p, refused in entries:
                    sid = apply_source_id_pattern(file_stem(p), pattern)
                    if sid is not None and refused is None:
                        found.setdefault(sid, p)
        self._pictures[collection] = found
        return found

    # --------------------------------------------------------------------------------------- lookups
    def load(self, caption_ids: set, image_ids: set, image_names: set = frozenset()) -> None:
        """Read the staged rows of the captions and images a page shows (once, before drawing it); images by
        item id, or as a query names them (``image_names``: item ids or source ids as written)."""
        caps = self.dataset.captions()
        self._captions = caps[caps["caption_id"].isin(caption_ids)].set_index("caption_id")
        meta = self.dataset.images_meta()
        named = meta["item_id"].astype(str).isin(image_names) | meta["source_id"].isin(image_names)
        self._images = meta[meta["item_id"].isin(image_ids) | named].set_index("item_id")

    def named_image(self, name: str) -> Optional[int]:
        """The item id of a loaded staged image named by its item id or (unambiguous) source id, else None."""
        if name.lstrip("-").isdigit() and int(name) in self._images.index:
            return int(name)
        hit = self._images.index[self._images["source_id"] == name]
        return int(hit[0]) if len(hit) == 1 else None

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
        from retrieval_core.data.synthetic.scenes import describe_scene

        spec = self._specs.get(collection)
        return None if spec is None else scene_text(describe_scene(spec, int(source_id)))

    def picture_path(self, collection: str, source_id: str) -> Optional[str]:
        """The picture file of a staged image: from ``pictures`` when given, else its collection's source."""
        if self._given is not None:
            return self._given.get(source_id)
        found = self._collection_pictures(collection)
        return None if found is None else found.get(source_id)

    # ------------------------------------------------------------------------------------------ HTML
    def picture_html(self, path: str, alt: str) -> str:
        """A picture file's thumbnail, or why there is none."""
        try:
            uri = thumbnail_data_uri(path, self.px, self.files)
        except PageError as exc:
            return f'<span class="missing">{html.escape(str(exc))}</span>'
        return f'<img class="thumb" alt="{html.escape(alt)}" src="{uri}">'

    def image_html(self, item_id: int) -> str:
        """A staged image: its collection/source id, scene description and thumbnail (those it has)."""
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
        path = self.picture_path(collection, source_id)
        if path is not None:
            parts.append(self.picture_html(path, source_id))
        elif self._given is not None or self._pictures.get(collection) is not None:
            parts.append(f'<span class="missing">no picture file for {html.escape(source_id)}</span>')
        elif collection not in self._specs and collection not in self._by_id_only:
            self._by_id_only.add(collection)  # said once per collection, on the page
            fmt = ((self._collections().get(collection) or {}).get("images") or {}).get("format")
            self.notes.append(f"collection {collection}: images shown by id only (staged from "
                              f"{fmt or 'a format its summary does not record'}: no picture files found and no "
                              f"scene generator)")
        return " ".join(parts)


def page(title: str, body: Sequence[str], notes: Sequence[str] = ()) -> str:
    """The page around a body: title, inline CSS, the notes (what it cannot show), nothing external."""
    return "\n".join([
        '<!DOCTYPE html><html><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
        f"<style>{CSS}</style></head><body>", *[f'<p class="note">{html.escape(n)}</p>' for n in notes], *body,
        "</body></html>"])


# ---------------------------------------------------------------------------------------- the hits page
def _score(v) -> str:
    return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{float(v):.3f}"


def hits_page(hits: pd.DataFrame, views: ItemViews, title: str, facts: Sequence[str] = (),
              queries_total: Optional[int] = None, pictures: Mapping[str, str] = {}) -> str:
    """The top hits of each query (rows of ``retrieval_core.search.query.HIT_COLUMNS``, in their order) as a page:
    per query its text (t2i) or image (i2t: a staged image, or a picture file: ``pictures``, query id -> file),
    then its hits with rank, BE and CE scores and what each hit looks like (an image's thumbnail or scene
    description; a caption's text). ``facts``: lines of the header (what was asked of what);
    ``queries_total``: the queries answered, when the page shows only the first ones."""
    shown = list(dict.fromkeys(hits["query_id"].tolist()))
    t2i = hits[hits["direction"] == schema.DIRECTION_T2I]
    i2t = hits[hits["direction"] == schema.DIRECTION_I2T]
    views.load(set(i2t["item_id"].tolist()), set(t2i["item_id"].tolist()),
               {str(q) for q in i2t["query"].unique()})
    total = queries_total if queries_total is not None else len(shown)
    head = [f"<h1>{html.escape(title)}</h1>", "<ul class=\"facts\">"]
    head += [f"<li>{html.escape(f)}</li>" for f in facts]
    head.append(f'<li class="shown">{len(shown)} of {total} answered queries shown'
                + (" (the first ones; every hit is in hits.jsonl)" if len(shown) < total else "") + "</li></ul>")
    body = []
    for qid, g in hits.groupby("query_id", sort=False):
        first = g.iloc[0]
        direction = str(first["direction"])
        if direction == schema.DIRECTION_T2I:
            asked = f'<q class="text">{html.escape(str(first["query"]))}</q>'
        elif str(qid) in pictures:
            asked = (f'<span class="src">{html.escape(shown_path(pictures[str(qid)]))}</span> '
                     + views.picture_html(pictures[str(qid)], str(qid)))
        elif views.named_image(str(first["query"])) is not None:
            asked = views.image_html(views.named_image(str(first["query"])))
        else:  # regions given directly (QueryEngine.search_images): nothing to draw but their name
            asked = f'<span class="src">{html.escape(str(first["query"]))}</span>'
        rows = []
        for r in g.itertuples(index=False):
            item = views.image_html(int(r.item_id)) if direction == schema.DIRECTION_T2I else \
                f'{html.escape(str(r.text))} <span class="src">{html.escape(str(r.source_id))}</span>'
            rows.append(f'<tr class="hit"><td>{int(r.rank)}</td><td>{int(r.be_rank)}</td><td>{_score(r.be_score)}'
                        f'</td><td>{_score(r.ce_score)}</td><td>{_score(r.final_score)}</td><td>{item}</td></tr>')
        body.append(f'<section class="query" data-direction="{html.escape(direction)}" '
                    f'data-query-id="{html.escape(str(qid))}"><h3>{html.escape(direction)} query '
                    f'{html.escape(str(qid))}: {asked}</h3><table><tr><th>rank</th><th>BE rank</th><th>BE score</th>'
                    f"<th>CE score</th><th>final score</th><th>hit</th></tr>" + "".join(rows) + "</table></section>")
    if not shown:
        body.append("<p>No query was answered.</p>")
    return page(title, head + body, views.notes)


def first_queries(hits: pd.DataFrame, n: int) -> pd.DataFrame:
    """The hits of the first ``n`` queries (in their order)."""
    keep = list(dict.fromkeys(hits["query_id"].tolist()))[:n]
    return hits[hits["query_id"].isin(keep)]


def write_hits_page(path: str, hits: pd.DataFrame, staged, *, title: Optional[str] = None,
                    facts: Sequence[str] = (), queries: int = PAGE_QUERIES, pictures: Mapping[str, str] = {},
                    manifest: Optional[str] = None) -> str:
    """Write the hits page of a ``QueryEngine`` result (its first ``queries`` queries) to the local file ``path``;
    ``staged``: a ``StagedDataset`` or its folder. Returns the HTML."""
    from retrieval_core.data.paths import write_local_atomic
    from retrieval_core.data.store import StagedDataset

    dataset = staged if hasattr(staged, "summary") else StagedDataset(staged)
    total = hits["query_id"].nunique()
    text = hits_page(first_queries(hits, queries), ItemViews(dataset, manifest), title or "Query hits", facts,
                     total, pictures)
    write_local_atomic(path, text.encode("utf-8"))
    return text


__all__ = ["CSS", "IMAGE_EXTENSIONS", "PAGE_QUERIES", "THUMBNAIL_PX", "ItemViews", "PageError", "first_queries",
           "hits_page", "page", "scene_text", "shown_path", "thumbnail_data_uri", "write_hits_page"]

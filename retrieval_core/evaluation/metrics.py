"""Recall@K in both retrieval directions (docs/CONVENTIONS.md#the-recall-convention).

Convention (OSCAR, UNITER, MMT, CLIP_benchmark): text->image: every caption is a query, a hit when its
image is in the top-k; image->text: every image is a query, a hit when ANY of its captions is in the top-k.
mR is the mean of the six recalls. Recalls are percentages.

Nothing here mutates its inputs: gold mappings may be read-only (MappingProxyType, frozensets).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence, Union

import numpy as np
import pandas as pd
import pyarrow as pa

from retrieval_core.data import schema

DEFAULT_KS = (1, 5, 10)

RankedIds = Union[np.ndarray, Sequence[Sequence[int]]]
DIRECTIONS = (schema.DIRECTION_T2I, schema.DIRECTION_I2T)

log = logging.getLogger(__name__)


class RankingsError(ValueError):
    """A rankings table that cannot be scored against its gold (a missing or extra query, a repeated rank)."""


# --------------------------------------------------------------------------------------------- recall
def recall_at_k(ranked_ids: RankedIds, gold: Sequence[Collection[int]],
                ks: Sequence[int] = DEFAULT_KS) -> dict[int, float]:
    """Percentage of queries with at least one gold id among their first k ranked ids, for each k.

    ``ranked_ids`` is (Q, K) or a list of Q best-first id lists (lists may differ in length; a list shorter
    than k simply has fewer chances). ``gold[i]`` is the non-empty collection of correct ids of query i.
    """
    n_q = len(ranked_ids)
    if n_q == 0:
        raise ValueError("recall_at_k needs at least one query, got 0")
    if len(gold) != n_q:
        raise ValueError(f"{n_q} ranked queries but {len(gold)} gold entries")
    ks = _check_ks(ks)
    first_hit = first_hit_ranks(ranked_ids, gold)
    return {k: float(100.0 * np.mean(first_hit < k)) for k in ks}


def first_hit_ranks(ranked_ids: RankedIds, gold: Sequence[Collection[int]]) -> np.ndarray:
    """0-based position of the first gold id in each query's ranking; a large sentinel when absent."""
    miss = np.iinfo(np.int64).max
    out = np.full(len(ranked_ids), miss, dtype=np.int64)
    for i, (row, g) in enumerate(zip(ranked_ids, gold)):
        if len(g) == 0:
            raise ValueError(f"query #{i} has no gold ids")
        g = g if isinstance(g, (set, frozenset)) else frozenset(int(x) for x in g)
        for pos, item in enumerate(np.asarray(row).tolist()):
            if item in g:
                out[i] = pos
                break
    return out


def direction_first_hits(direction: str, ranked_ids: RankedIds, query_ids: Sequence[int],
                         caption_to_image: Mapping[int, int], image_to_captions: Mapping[int, Collection[int]]
                         ) -> np.ndarray:
    """:func:`first_hit_ranks` of one direction's queries ("t2i": caption queries, gold = its image; "i2t": image
    queries, gold = any of its captions). A query without gold (unknown id, or an image with no captions) raises
    ValueError naming it; so does a duplicate query id."""
    if direction not in ("t2i", "i2t"):
        raise ValueError(f"direction must be 't2i' or 'i2t', got {direction!r}")
    gold = []
    for q in _query_list(query_ids, ranked_ids, direction):
        if direction == "t2i":
            if q not in caption_to_image:
                raise ValueError(f"t2i query (caption) {q} has no gold image")
            gold.append((int(caption_to_image[q]),))
        else:
            caps = image_to_captions.get(q)
            if not caps:
                raise ValueError(f"i2t query (image) {q} has no gold captions")
            gold.append(caps)
    if not gold:
        raise ValueError(f"{direction}: no queries")
    return first_hit_ranks(ranked_ids, gold)


def direction_recall(direction: str, ranked_ids: RankedIds, query_ids: Sequence[int],
                     caption_to_image: Mapping[int, int], image_to_captions: Mapping[int, Collection[int]],
                     ks: Sequence[int] = DEFAULT_KS) -> dict:
    """R@k of one direction (:func:`direction_first_hits`). Keys ``<direction>_R@<k>`` and
    ``<direction>_queries``."""
    ks = _check_ks(ks)
    first = direction_first_hits(direction, ranked_ids, query_ids, caption_to_image, image_to_captions)
    result: dict = {f"{direction}_R@{k}": float(100.0 * np.mean(first < k)) for k in ks}
    result[f"{direction}_queries"] = len(first)
    return result


def bidirectional_recall(t2i_ranked_ids: RankedIds, t2i_query_ids: Sequence[int],
                         i2t_ranked_ids: RankedIds, i2t_query_ids: Sequence[int],
                         caption_to_image: Mapping[int, int],
                         image_to_captions: Mapping[int, Collection[int]],
                         ks: Sequence[int] = DEFAULT_KS) -> dict:
    """R@k for text->image and image->text plus mR (mean of all of them) and the query counts.

    Keys: ``t2i_R@<k>``, ``i2t_R@<k>`` for each k, ``mR``, ``t2i_queries``, ``i2t_queries``.
    A query without gold (unknown id, or an image with no captions) raises ValueError naming it;
    duplicate query ids raise too (they would be counted twice).
    """
    ks = _check_ks(ks)
    t2i = direction_recall("t2i", t2i_ranked_ids, t2i_query_ids, caption_to_image, image_to_captions, ks)
    i2t = direction_recall("i2t", i2t_ranked_ids, i2t_query_ids, caption_to_image, image_to_captions, ks)
    result: dict = {f"t2i_R@{k}": t2i[f"t2i_R@{k}"] for k in ks}
    result.update({f"i2t_R@{k}": i2t[f"i2t_R@{k}"] for k in ks})
    result["mR"] = float(np.mean([result[f"{d}_R@{k}"] for d in ("t2i", "i2t") for k in ks]))
    result["t2i_queries"] = t2i["t2i_queries"]
    result["i2t_queries"] = i2t["i2t_queries"]
    return result


def _query_list(query_ids: Sequence[int], ranked: RankedIds, direction: str) -> list[int]:
    ids = [int(q) for q in np.asarray(query_ids).tolist()]
    if len(ids) != len(ranked):
        raise ValueError(f"{direction}: {len(ids)} query ids but {len(ranked)} ranked lists")
    if len(set(ids)) != len(ids):
        seen, dup = set(), None
        for q in ids:
            if q in seen:
                dup = q
                break
            seen.add(q)
        raise ValueError(f"{direction}: query id {dup} appears more than once")
    return ids


def _check_ks(ks: Sequence[int]) -> tuple[int, ...]:
    ks = tuple(int(k) for k in ks)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks}")
    return ks


# ------------------------------------------------------------------------------------- rankings tables
def ranked_lists(df: pd.DataFrame, direction: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """(query ids, best-first item id arrays) of one direction, ordered by query id."""
    sub = df[df["direction"] == direction]
    q = sub["query_id"].to_numpy(np.int64)
    r = sub["rank"].to_numpy(np.int64)
    items = sub["item_id"].to_numpy(np.int64)
    order = np.lexsort((r, q))
    q, r, items = q[order], r[order], items[order]
    if len(q) and np.any((q[1:] == q[:-1]) & (r[1:] == r[:-1])):
        bad = int(q[1:][(q[1:] == q[:-1]) & (r[1:] == r[:-1])][0])
        raise RankingsError(f"{direction} query {bad} has the same rank twice")
    queries, starts = np.unique(q, return_index=True)
    return queries, np.split(items, starts[1:]) if len(q) else []


def check_queries(direction: str, ranked: np.ndarray, gold_keys: Collection[int]) -> None:
    ranked_set = set(ranked.tolist())
    gold_set = set(int(g) for g in gold_keys)
    extra = sorted(ranked_set - gold_set)
    missing = sorted(gold_set - ranked_set)
    what = "caption" if direction == schema.DIRECTION_T2I else "image"
    if extra:
        raise RankingsError(f"{direction}: ranked {what} query {extra[0]} is not in the gold "
                              f"({len(extra)} such queries; first: {extra[:5]})")
    if missing:
        raise RankingsError(f"{direction}: gold {what} query {missing[0]} is missing from the rankings "
                              f"({len(missing)} missing; first: {missing[:5]})")


@dataclass(frozen=True)
class DirectionHits:
    """One direction of a ranking, query by query: the query ids (ascending), the 0-based rank of each query's
    first gold item (:func:`first_hit_ranks`; a large sentinel when absent, so a hit at K is ``first_hit < K``)
    and the length of its shortest ranked list. What recall and its confidence intervals are computed from."""
    direction: str
    query_ids: np.ndarray
    first_hit: np.ndarray
    depth: int

    def recall(self, k: int) -> float:
        return float(100.0 * np.mean(self.first_hit < k))


def rankings_hits(rankings: Union[pd.DataFrame, pa.Table], caption_to_image: Mapping[int, int],
                  image_to_captions: Mapping[int, Collection[int]],
                  directions: Sequence[str] = DIRECTIONS) -> dict[str, DirectionHits]:
    """:class:`DirectionHits` of each given direction of a rankings table (schema.RANKING_SCHEMA columns).

    Every gold query of an evaluated direction must be ranked and vice versa (RankingsError otherwise). Gold
    mappings are only read."""
    df = rankings.to_pandas() if isinstance(rankings, pa.Table) else rankings
    missing_cols = [c for c in ("direction", "query_id", "rank", "item_id") if c not in df.columns]
    if missing_cols:
        raise RankingsError(f"rankings lack column(s) {missing_cols}")
    unknown = set(df["direction"].unique()) - set(DIRECTIONS)
    if unknown:
        raise RankingsError(f"rankings have unknown direction(s) {sorted(unknown)}")
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise RankingsError(f"directions must be a non-empty subset of {DIRECTIONS}, got {directions}")
    extra = set(df["direction"].unique()) - set(directions)
    if extra:
        raise RankingsError(f"rankings hold direction(s) {sorted(extra)} that are not evaluated")
    out = {}
    for d in DIRECTIONS:
        if d not in directions:
            continue
        queries, lists = ranked_lists(df, d)
        check_queries(d, queries, (caption_to_image if d == schema.DIRECTION_T2I else image_to_captions).keys())
        first = direction_first_hits(d, lists, queries, caption_to_image, image_to_captions)
        out[d] = DirectionHits(d, queries, first, int(min(len(x) for x in lists)))
    return out


def recall_summary(hits: Mapping[str, DirectionHits], collection_size: int,
                   ks: Sequence[int] = DEFAULT_KS) -> dict:
    """``<d>_R@<k>`` and ``<d>_queries`` for both directions (NaN and 0 for a direction not in ``hits``), ``mR``
    (mean of the evaluated recalls), ``collection_size`` and ``ranked_depth`` (shortest ranked list)."""
    ks = _check_ks(ks)
    result: dict = {}
    for d in DIRECTIONS:
        h = hits.get(d)
        result.update({f"{d}_R@{kk}": h.recall(kk) if h else float("nan") for kk in ks})
        result[f"{d}_queries"] = len(h.query_ids) if h else 0
    result["mR"] = float(np.mean([result[f"{d}_R@{kk}"] for d in hits for kk in ks]))
    result["collection_size"] = int(collection_size)
    result["ranked_depth"] = int(min(h.depth for h in hits.values()))
    if result["ranked_depth"] < max(ks):
        log.warning("some ranked lists hold only %d items (< %d): R@%d counts them as misses beyond",
                    result["ranked_depth"], max(ks), max(ks))
    return result


def evaluate_rankings(rankings: Union[pd.DataFrame, pa.Table], caption_to_image: Mapping[int, int],
                      image_to_captions: Mapping[int, Collection[int]], ks: Sequence[int] = DEFAULT_KS,
                      directions: Sequence[str] = DIRECTIONS) -> dict:
    """Recall of the given directions of a rankings table: :func:`recall_summary` of :func:`rankings_hits`, the
    collection size being the gold images."""
    return recall_summary(rankings_hits(rankings, caption_to_image, image_to_captions, directions),
                          len(image_to_captions), ks)

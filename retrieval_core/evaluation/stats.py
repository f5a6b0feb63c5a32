"""Paired bootstrap confidence intervals of recall@K, mR and of differences between rankings (numpy only).

Recall@K is the mean of per-query hit indicators (a query's hit@K: its first gold item within the first K,
``metrics.DirectionHits``). The queries of each direction are resampled with replacement, independently per
direction (t2i: captions, i2t: images); a difference A - B applies the same resample to both rankings, which
must rank the same queries; mR is recomputed per resample from its six recalls. The interval is the percentile
interval of the resampled statistic.

A resampled mean only depends on how often each distinct row of per-query values was drawn, so a resample
draws those counts from a multinomial (the same distribution as drawing query indices, at a cost independent
of the query count). Folds (the COCO 1k protocol, a mean over folds) are resampled within each fold; replicate
rankings of the same queries (model seeds) share each resample, and their mean is the statistic.
docs/STATISTICS.md says how to read the intervals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from retrieval_core.evaluation.metrics import DEFAULT_KS, DIRECTIONS, DirectionHits

DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95
MIN_RESAMPLES = 100  # a 2.5 % percentile of fewer resamples rests on two or three of them
LIFTS, LOWERS, NO_DIFFERENCE = "lifts", "lowers", "no significant difference"

#: One ranking's hits: per direction, one DirectionHits, or one per fold (the statistic is the mean over folds).
Hits = Mapping[str, Union[DirectionHits, Sequence[DirectionHits]]]


class PairingError(ValueError):
    """Rankings whose statistics cannot be resampled together: other queries, directions or folds."""


@dataclass(frozen=True)
class Bootstrap:
    """How intervals are computed: ``resamples`` bootstrap resamples of the queries from
    ``numpy.random.default_rng(seed)``, ``level`` the coverage of the percentile interval."""
    resamples: int = DEFAULT_RESAMPLES
    seed: int = DEFAULT_SEED
    level: float = DEFAULT_LEVEL

    def __post_init__(self) -> None:
        if isinstance(self.resamples, bool) or not isinstance(self.resamples, (int, np.integer)) \
                or self.resamples < MIN_RESAMPLES:
            raise ValueError(f"bootstrap resamples must be an integer >= {MIN_RESAMPLES}, got {self.resamples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"bootstrap seed must be an integer >= 0, got {self.seed!r}")
        if not 0.0 < float(self.level) < 1.0:
            raise ValueError(f"interval level must be in (0, 1), got {self.level!r}")

    @property
    def label(self) -> str:
        """What the intervals are, in one line (CSV notes, tables)."""
        return f"{100 * self.level:g} % percentile interval, {self.resamples} bootstrap resamples of the queries, " \
               f"seed {self.seed}"

    def as_dict(self) -> dict:
        return {"method": "percentile", "resampled": "queries", "resamples": int(self.resamples),
                "seed": int(self.seed), "level": float(self.level)}


@dataclass(frozen=True)
class Interval:
    """A point estimate (from the data, not the resamples) and its percentile interval, in percent points."""
    estimate: float
    lo: float
    hi: float

    @property
    def verdict(self) -> str:
        return verdict(self.lo, self.hi)

    def format(self, digits: int = 2, signed: bool = False) -> str:
        """``45.20 [41.00, 49.40]``; ``signed``: ``+3.10 [+1.20, +5.00]`` (a difference)."""
        f = f"{{:{'+' if signed else ''}.{digits}f}}".format
        return f"{f(self.estimate)} [{f(self.lo)}, {f(self.hi)}]"


def verdict(lo: float, hi: float) -> str:
    """What the interval of a difference A - B says: "lifts" when it lies entirely above 0, "lowers" when
    entirely below, else "no significant difference" (never decided from the point estimate)."""
    if lo > 0:
        return LIFTS
    if hi < 0:
        return LOWERS
    return NO_DIFFERENCE


def seed_mean_interval(values: Sequence[float], level: float = DEFAULT_LEVEL) -> Interval:
    """The Student t interval of the mean of one statistic over independent replicates (training seeds): their
    spread, not the queries', is the uncertainty of "this recipe" rather than of "this model". Needs >= 2 values;
    with 3 seeds the interval is wide (t = 4.30), which is the honest width of three training runs."""
    from scipy.stats import t  # the t quantile only; everything else here is numpy

    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or len(x) < 2 or not np.isfinite(x).all():
        raise ValueError(f"a seed-mean interval needs >= 2 finite values, got {list(values)!r}")
    mean, half = float(x.mean()), float(t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
    return Interval(mean, mean - half, mean + half)


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = DEFAULT_LEVEL) -> Interval:
    """The Welch t interval of mean(a) - mean(b): two recipes, each trained on its own seeds, whose spreads need not
    be equal (Welch-Satterthwaite degrees of freedom). Needs >= 2 finite values on each side; with no spread on
    either side the interval is the difference itself."""
    from scipy.stats import t

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or y.ndim != 1 or len(x) < 2 or len(y) < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError(f"a Welch interval needs >= 2 finite values per side, got {list(a)!r} and {list(b)!r}")
    va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    diff = float(x.mean() - y.mean())
    if va + vb == 0:
        return Interval(diff, diff, diff)
    df = (va + vb) ** 2 / (va * va / (len(x) - 1) + vb * vb / (len(y) - 1))
    half = float(t.ppf(0.5 + level / 2, df) * np.sqrt(va + vb))
    return Interval(diff, diff - half, diff + half)


def hit_matrix(first_hit: np.ndarray, ks: Sequence[int] = DEFAULT_KS) -> np.ndarray:
    """(queries, len(ks)) 0/1 matrix: hit@K of each query (its first gold item at 0-based rank < K)."""
    return (np.asarray(first_hit)[:, None] < np.asarray(ks, dtype=np.int64)[None, :]).astype(np.int64)


def resample_sums(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, columns): the column sums of ``values`` (queries x columns) over bootstrap resamples of its
    rows (n rows drawn with replacement). The counts of each distinct row are drawn from a multinomial."""
    n = len(values)
    patterns, inverse = np.unique(values, axis=0, return_inverse=True)
    p = np.bincount(inverse.reshape(-1), minlength=len(patterns)) / n
    counts = rng.multinomial(n, p, size=resamples)
    return counts @ patterns


def percentile_interval(estimate: float, samples: np.ndarray, level: float = DEFAULT_LEVEL) -> Interval:
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(samples, [tail, 100.0 - tail])
    return Interval(float(estimate), float(lo), float(hi))


def recall_intervals(rankings: Union[Hits, Sequence[Hits]], boot: Bootstrap = Bootstrap(),
                     ks: Sequence[int] = DEFAULT_KS) -> dict[str, Interval]:
    """Intervals of ``<d>_R@<k>`` and ``mR`` of one ranking, or of the mean of several rankings of the same
    queries (model seeds: each resample is applied to every one of them)."""
    reps = _replicates(rankings)
    return _intervals([(1, r) for r in reps], len(reps), boot, ks)


def difference_intervals(a: Union[Hits, Sequence[Hits]], b: Union[Hits, Sequence[Hits]],
                         boot: Bootstrap = Bootstrap(), ks: Sequence[int] = DEFAULT_KS) -> dict[str, Interval]:
    """Paired intervals of A - B for ``<d>_R@<k>`` and ``mR``: the same resampled queries for both. Several
    rankings on each side (model seeds, paired in order): the interval of the mean over them of A - B.
    PairingError when the two sides do not rank the same queries."""
    ra, rb = _replicates(a), _replicates(b)
    if len(ra) != len(rb):
        raise PairingError(f"a paired difference needs as many rankings on each side, got {len(ra)} and {len(rb)}")
    return _intervals([(1, r) for r in ra] + [(-1, r) for r in rb], len(ra), boot, ks)


def _replicates(rankings) -> list[dict[str, tuple[DirectionHits, ...]]]:
    reps = [rankings] if isinstance(rankings, Mapping) else list(rankings)
    if not reps:
        raise PairingError("no rankings to compute intervals of")
    return [{d: (h,) if isinstance(h, DirectionHits) else tuple(h) for d, h in r.items()} for r in reps]


def _intervals(signed: list[tuple[int, dict]], replicates: int, boot: Bootstrap,
               ks: Sequence[int]) -> dict[str, Interval]:
    """The statistic is (sum over ``signed`` of sign x recall) / replicates: integer sums per query until the
    end, so that identical rankings differ by exactly 0 in every resample."""
    directions = [d for d in DIRECTIONS if d in signed[0][1]]
    for _, r in signed[1:]:
        if set(r) != set(directions):
            raise PairingError(f"the rankings cover other directions: {sorted(directions)} and {sorted(r)}")
    if not directions:
        raise PairingError("rankings with no direction")
    rng = np.random.default_rng(boot.seed)
    est, samples = {}, {}
    for d in directions:
        folds = [r[d] for _, r in signed]
        if len({len(f) for f in folds}) != 1:
            raise PairingError(f"{d}: the rankings have different numbers of folds ({[len(f) for f in folds]})")
        e, s = np.zeros(len(ks)), np.zeros((boot.resamples, len(ks)))
        for i in range(len(folds[0])):
            parts = [f[i] for f in folds]
            _check_same_queries(d, i, [p.query_ids for p in parts])
            values = sum(sign * hit_matrix(p.first_hit, ks) for (sign, _), p in zip(signed, parts))
            n = len(parts[0].query_ids)
            e += values.sum(axis=0) / n
            s += resample_sums(values, boot.resamples, rng) / n
        scale = 100.0 / (len(folds[0]) * replicates)
        est[d], samples[d] = e * scale, s * scale
    out = {}
    for d in directions:
        for j, k in enumerate(ks):
            out[f"{d}_R@{k}"] = percentile_interval(est[d][j], samples[d][:, j], boot.level)
    m_est = float(np.mean(np.concatenate([est[d] for d in directions])))
    m_samples = np.mean(np.concatenate([samples[d] for d in directions], axis=1), axis=1)
    out["mR"] = percentile_interval(m_est, m_samples, boot.level)
    return out


def _check_same_queries(direction: str, fold: int, query_ids: Sequence[np.ndarray]) -> None:
    first = np.asarray(query_ids[0])
    if len(first) == 0:
        raise PairingError(f"{direction}: no queries" + (f" in fold {fold}" if fold else ""))
    for other in query_ids[1:]:
        other = np.asarray(other)
        if not np.array_equal(first, other):
            only_a, only_b = np.setdiff1d(first, other), np.setdiff1d(other, first)
            where = f"{direction}" + (f" fold {fold}" if fold else "")
            raise PairingError(
                f"{where}: the rankings rank different queries ({len(first)} and {len(other)}; "
                f"{len(only_a)} only in the first, e.g. {only_a[:3].tolist()}; {len(only_b)} only in the other, "
                f"e.g. {only_b[:3].tolist()}): intervals over both need the same queries")


def fold_hits(runs: Sequence[Mapping[str, DirectionHits]]) -> dict[str, tuple[DirectionHits, ...]]:
    """The :data:`Hits` of a fold row: per direction, the hits of each fold's run (the statistic is the mean
    over folds, each fold resampled on its own)."""
    if not runs:
        raise PairingError("no fold runs")
    directions = [d for d in DIRECTIONS if d in runs[0]]
    if any(set(r) != set(directions) for r in runs):
        raise PairingError("the fold runs cover other directions")
    return {d: tuple(r[d] for r in runs) for d in directions}


def interval_columns(intervals: Mapping[str, Interval], direction: Optional[str], prefix: str = "",
                     ks: Sequence[int] = DEFAULT_KS, digits: int = 4) -> dict:
    """CSV columns of one direction's row: ``<prefix>R@<k>_lo`` / ``_hi`` and ``<prefix>mR_lo`` / ``_hi`` (with a
    prefix, e.g. ``delta_``, also the estimates ``<prefix>R@<k>`` and ``<prefix>mR``)."""
    out = {}
    keys = [(f"R@{k}", f"{direction}_R@{k}") for k in ks] if direction else []
    for name, key in keys + [("mR", "mR")]:
        iv = intervals[key]
        if prefix:
            out[f"{prefix}{name}"] = round(iv.estimate, digits)
        out[f"{prefix}{name}_lo"] = round(iv.lo, digits)
        out[f"{prefix}{name}_hi"] = round(iv.hi, digits)
    return out

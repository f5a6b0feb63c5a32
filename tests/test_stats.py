"""retrieval_core.evaluation.stats: the paired bootstrap against the exact bootstrap distribution of tiny cases (every
resample enumerated), pairing, folds, seeds, determinism and the verdict."""
import itertools
import time

import numpy as np
import pytest

from retrieval_core.evaluation.metrics import DirectionHits
from retrieval_core.evaluation.stats import (
    LIFTS,
    LOWERS,
    NO_DIFFERENCE,
    Bootstrap,
    PairingError,
    difference_intervals,
    hit_matrix,
    recall_intervals,
    verdict,
)

MISS = np.iinfo(np.int64).max
BIG = Bootstrap(resamples=20_000, seed=3)  # the percentiles of 20k resamples sit on the exact ones (checked below)


def _hits(direction, first_hit, ids=None):
    first_hit = np.asarray(first_hit, dtype=np.int64)
    ids = np.arange(len(first_hit), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    return DirectionHits(direction, ids, first_hit, 10)


def _exact_interval(values_per_resample, level=0.95):
    """The exact percentile interval of an equally likely list of resampled statistics: the smallest value whose
    CDF reaches each tail, with a guard that neither tail sits on a jump of the CDF (where the bootstrap's
    estimate of the quantile would be ambiguous)."""
    v = np.sort(np.asarray(values_per_resample, dtype=float))
    values, counts = np.unique(v, return_counts=True)
    cdf = np.cumsum(counts) / len(v)
    out = []
    for q in ((1 - level) / 2, (1 + level) / 2):
        assert np.min(np.abs(cdf - q)) > 0.005, "ill-posed: a tail sits on a jump of the exact CDF"
        out.append(values[np.searchsorted(cdf, q)])
    return tuple(out)


def test_hit_matrix_is_first_gold_rank_below_k():
    assert hit_matrix(np.array([0, 4, 5, MISS]), (1, 5, 10)).tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0]]


def test_one_direction_and_a_paired_difference_match_the_enumerated_bootstrap():
    # 4 queries: A's first gold ranks, B's. R@1: A hits 1,1,1,0; B hits 0,1,1,0 -> A - B per query 1,0,0,0
    a = {"t2i": _hits("t2i", [0, 0, 0, 7])}
    b = {"t2i": _hits("t2i", [3, 0, 0, MISS])}
    ra, rb = hit_matrix(a["t2i"].first_hit, (1, 5, 10)), hit_matrix(b["t2i"].first_hit, (1, 5, 10))
    resamples = list(itertools.product(range(4), repeat=4))  # all 256 equally likely resamples of 4 queries
    iv_a = recall_intervals(a, BIG)
    iv_d = difference_intervals(a, b, BIG)
    for j, k in enumerate((1, 5, 10)):
        exact_a = _exact_interval([100 * ra[list(idx), j].mean() for idx in resamples]) if ra[:, j].std() else \
            (100 * ra[0, j], 100 * ra[0, j])
        diff = ra[:, j] - rb[:, j]
        exact_d = _exact_interval([100 * diff[list(idx)].mean() for idx in resamples]) if diff.std() else \
            (100 * diff[0], 100 * diff[0])
        assert (iv_a[f"t2i_R@{k}"].lo, iv_a[f"t2i_R@{k}"].hi) == pytest.approx(exact_a), k
        assert (iv_d[f"t2i_R@{k}"].lo, iv_d[f"t2i_R@{k}"].hi) == pytest.approx(exact_d), k
    # by hand: R@1 of A is 75 with [25, 100]; A - B is +25 with [0, 75] (P(drawn query 0 three times or more) < 2.5 %)
    assert (iv_a["t2i_R@1"].estimate, iv_a["t2i_R@1"].lo, iv_a["t2i_R@1"].hi) == pytest.approx((75, 25, 100))
    assert (iv_d["t2i_R@1"].estimate, iv_d["t2i_R@1"].lo, iv_d["t2i_R@1"].hi) == pytest.approx((25, 0, 75))
    assert iv_d["t2i_R@1"].verdict == NO_DIFFERENCE


def test_mr_resamples_each_direction_on_its_own_and_averages_the_six_recalls():
    t2i = [0, 2, MISS]  # three caption queries
    i2t = [0, 7]  # two image queries
    h = {"t2i": _hits("t2i", t2i), "i2t": _hits("i2t", i2t, ids=[100, 200])}
    ht, hi_ = hit_matrix(np.array(t2i)), hit_matrix(np.array(i2t))
    exact = []
    for it in itertools.product(range(3), repeat=3):  # t2i and i2t resampled independently: 27 x 4 outcomes
        for ii in itertools.product(range(2), repeat=2):
            exact.append(100 * np.mean(np.concatenate([ht[list(it)].mean(0), hi_[list(ii)].mean(0)])))
    iv = recall_intervals(h, BIG)
    assert iv["mR"].estimate == pytest.approx(100 * np.mean([1 / 3, 2 / 3, 2 / 3, 1 / 2, 1 / 2, 1]))
    assert (iv["mR"].lo, iv["mR"].hi) == pytest.approx(_exact_interval(exact))


def test_identical_rankings_differ_by_exactly_zero_and_other_queries_are_refused():
    rng = np.random.default_rng(0)
    h = {"t2i": _hits("t2i", rng.integers(0, 20, 500)), "i2t": _hits("i2t", rng.integers(0, 20, 100))}
    same = difference_intervals(h, h)
    assert all((iv.estimate, iv.lo, iv.hi) == (0.0, 0.0, 0.0) for iv in same.values())
    assert same["mR"].verdict == NO_DIFFERENCE
    # three seeds of identical rankings: the seed mean's interval is that of one (one resample applied to all)
    one, three = recall_intervals(h), recall_intervals([h, h, h])
    assert all((three[key].lo, three[key].hi) == pytest.approx((iv.lo, iv.hi), abs=1e-9) for key, iv in one.items())
    other = {"t2i": _hits("t2i", h["t2i"].first_hit, ids=np.arange(500) + 1), "i2t": h["i2t"]}
    with pytest.raises(PairingError, match=r"t2i: the rankings rank different queries .*1 only in the first, e.g. "
                                           r"\[0\]; 1 only in the other, e.g. \[500\]"):
        difference_intervals(h, other)
    with pytest.raises(PairingError, match="other directions"):
        difference_intervals(h, {"t2i": h["t2i"]})
    with pytest.raises(PairingError, match="as many rankings"):
        difference_intervals([h, h], [h])


def test_folds_are_resampled_within_each_fold():
    # fold 0: every query hits at 1, fold 1: none does. Resampled within folds the mean over folds is always 50;
    # resampled across the pooled queries it would not be
    folds = {"t2i": (_hits("t2i", [0] * 20, ids=range(20)), _hits("t2i", [MISS] * 20, ids=range(20, 40)))}
    iv = recall_intervals(folds)["t2i_R@1"]
    assert (iv.estimate, iv.lo, iv.hi) == (50.0, 50.0, 50.0)
    pooled = recall_intervals({"t2i": _hits("t2i", [0] * 20 + [MISS] * 20)})["t2i_R@1"]
    assert pooled.lo < 50 < pooled.hi


def test_a_real_difference_is_found_and_the_seed_decides_the_resamples():
    rng = np.random.default_rng(1)
    b_first = rng.integers(0, 3, 2000)
    a_first = np.where(rng.random(2000) < 0.15, 0, b_first)  # A moves 15 % of the queries' gold to rank 1
    a, b = {"t2i": _hits("t2i", a_first)}, {"t2i": _hits("t2i", b_first)}
    lift = difference_intervals(a, b)["t2i_R@1"]
    assert lift.lo > 0 and lift.verdict == LIFTS
    assert difference_intervals(b, a)["t2i_R@1"].verdict == LOWERS
    assert difference_intervals(a, b, Bootstrap(seed=7)) == difference_intervals(a, b, Bootstrap(seed=7))
    assert difference_intervals(a, b, Bootstrap(seed=7))["t2i_R@1"] != lift
    # the point estimate is the data's, whatever the resamples
    assert difference_intervals(a, b, Bootstrap(seed=7))["t2i_R@1"].estimate == lift.estimate


def test_verdict_is_read_from_the_interval_only():
    assert verdict(0.1, 3.0) == LIFTS
    assert verdict(-3.0, -0.1) == LOWERS
    for lo, hi in ((0.0, 3.0), (-3.0, 0.0), (0.0, 0.0), (-1.0, 2.0)):
        assert verdict(lo, hi) == NO_DIFFERENCE


def test_bootstrap_settings_are_checked():
    for bad in (dict(resamples=10), dict(resamples=True), dict(seed=-1), dict(level=1.0), dict(level=0)):
        with pytest.raises(ValueError):
            Bootstrap(**bad)
    assert Bootstrap().label == "95 % percentile interval, 1000 bootstrap resamples of the queries, seed 0"


def test_25k_queries_and_1000_resamples_take_well_under_a_second_or_two():
    rng = np.random.default_rng(2)
    a = {"t2i": _hits("t2i", rng.geometric(0.3, 25_000) - 1), "i2t": _hits("i2t", rng.geometric(0.5, 5000) - 1)}
    b = {"t2i": _hits("t2i", rng.geometric(0.3, 25_000) - 1), "i2t": _hits("i2t", rng.geometric(0.5, 5000) - 1)}
    t0 = time.perf_counter()
    recall_intervals(a)
    difference_intervals(a, b)
    assert time.perf_counter() - t0 < 2.0  # ~0.1 s on the shared 2-core dev box

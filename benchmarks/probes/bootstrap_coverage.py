"""How often the bootstrap intervals of retrieval_core.evaluation.stats cover the true value: a simulation.

    python -m benchmarks.probes.bootstrap_coverage [--trials 1000] [--queries 20,100,500,2500]

Queries are drawn from a population where ranking B has the gold at rank 1 with probability ``p_b`` and ranking
A has it with probability ``a_if_b_hit`` / ``a_if_b_miss`` given B's outcome (paired, correlated rankings, as a
reranker of the same BE list is). Each trial draws ``n`` queries, computes the 95 % interval of A's R@1 and of
A - B (paired) and checks whether it holds the population's value. Prints one Markdown row per setting and
query count (docs/STATISTICS.md quotes them).
"""
from __future__ import annotations

from dataclasses import dataclass

import click
import numpy as np

from retrieval_core.cli import CheckedPlan, option, plan_command, plan_from_cli
from retrieval_core.evaluation.metrics import DirectionHits
from retrieval_core.evaluation.stats import Bootstrap, difference_intervals, recall_intervals

MISS = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Population:
    name: str
    p_b: float
    a_if_b_hit: float
    a_if_b_miss: float

    @property
    def p_a(self) -> float:
        return self.p_b * self.a_if_b_hit + (1 - self.p_b) * self.a_if_b_miss


#: A's R@1 equals B's in the last one (0.3 x 0.8 + 0.7 x 0.06 / 0.7 = 0.3): its coverage of A - B is 1 minus the
#: share of trials that would report a lift or a loss where there is none.
POPULATIONS = (Population("mid recall", 0.50, 0.90, 0.20), Population("high recall", 0.90, 0.98, 0.50),
               Population("no difference", 0.30, 0.80, 0.06 / 0.70))


def coverage(pop: Population, n: int, trials: int, resamples: int, seed: int) -> tuple[float, float, float]:
    """(coverage of A's R@1 interval, coverage of the A - B interval, mean width of A - B's) over ``trials``."""
    rng = np.random.default_rng(seed)
    hit_a = hit_d = 0
    widths = []
    ids = np.arange(n, dtype=np.int64)
    for t in range(trials):
        b = rng.random(n) < pop.p_b
        a = np.where(b, rng.random(n) < pop.a_if_b_hit, rng.random(n) < pop.a_if_b_miss)
        ha = {"t2i": DirectionHits("t2i", ids, np.where(a, 0, MISS), 10)}
        hb = {"t2i": DirectionHits("t2i", ids, np.where(b, 0, MISS), 10)}
        boot = Bootstrap(resamples, seed=t)
        ra = recall_intervals(ha, boot)["t2i_R@1"]
        rd = difference_intervals(ha, hb, boot)["t2i_R@1"]
        hit_a += ra.lo <= 100 * pop.p_a <= ra.hi
        hit_d += rd.lo <= 100 * (pop.p_a - pop.p_b) <= rd.hi
        widths.append(rd.hi - rd.lo)
    return hit_a / trials, hit_d / trials, float(np.mean(widths))


@dataclass(frozen=True)
class CoveragePlan(CheckedPlan):
    """The simulation's options, each a typed field (checked when built)."""
    trials: int = option(1000, type=click.IntRange(min=10))
    queries: tuple[int, ...] = option((20, 100, 500, 2500), sep=",", help="Query counts, comma-separated.")
    resamples: int = option(1000, type=click.IntRange(min=100))
    seed: int = option(0, type=click.IntRange(min=0))

    def __post_init__(self):
        super().__post_init__()
        text = ",".join(map(str, self.queries))
        try:
            sizes = tuple(int(x) for x in self.queries)
        except ValueError:
            raise ValueError(f"--queries: comma-separated integers, got {text!r}") from None
        if not sizes or min(sizes) < 2:
            raise ValueError("--queries: query counts must be >= 2")
        object.__setattr__(self, "queries", sizes)


@plan_command(CoveragePlan)
def main(**values) -> None:
    """Coverage of the 95 % bootstrap intervals of R@1 and of a paired difference, by simulation."""
    try:
        plan = plan_from_cli(CoveragePlan, values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    trials, resamples, seed, sizes = plan.trials, plan.resamples, plan.seed, plan.queries
    se = 100 * (0.95 * 0.05 / trials) ** 0.5
    click.echo(f"{trials} trials per row, {resamples} resamples, seed {seed}; Monte Carlo standard error of a "
               f"coverage near 95 %: {se:.1f} points")
    click.echo("| population | R@1 of A | A - B | queries | coverage of R@1 (A) | coverage of A - B | "
               "mean width of A - B |")
    click.echo("|---|---:|---:|---:|---:|---:|---:|")
    for pop in POPULATIONS:
        for n in sizes:
            ca, cd, w = coverage(pop, n, trials, resamples, seed)
            click.echo(f"| {pop.name} | {100 * pop.p_a:.1f} | {100 * (pop.p_a - pop.p_b):+.1f} | {n} | "
                       f"{100 * ca:.1f} % | {100 * cd:.1f} % | {w:.1f} |")


if __name__ == "__main__":
    main()

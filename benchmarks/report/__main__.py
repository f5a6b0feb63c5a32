"""``python -m benchmarks.report``: tables from benchmark CSVs already written (memory-table, recall-table), and the
docs' generated tables from the committed CSVs (docs: :mod:`.published`)."""
from __future__ import annotations

from dataclasses import dataclass

import click

from benchmarks.report import cli_reference, published
from benchmarks.report.schema import SEED_COLUMNS, SEED_KEY, read_csv, write_csv
from benchmarks.report.tables import memory_table_from, recall_table, seed_summary_from, seed_summary_table
from retrieval_core.cli import CONTEXT_SETTINGS, CheckedPlan, cli_errors, option, plan_from_cli, plan_options

_DIR = click.Path(exists=True, file_okay=False)


@dataclass(frozen=True)
class MemoryTablePlan(CheckedPlan):
    """memory-table's arguments (checked when built)."""
    output_dir: str = option(type=_DIR, argument=True)
    remeasured_dirs: tuple[str, ...] = option((), type=_DIR, argument=True, multiple=True)


@dataclass(frozen=True)
class RecallTablePlan(CheckedPlan):
    """recall-table's argument (checked when built)."""
    csv_path: str = option(type=click.Path(exists=True, dir_okay=False), argument=True)


@dataclass(frozen=True)
class SeedsPlan(CheckedPlan):
    """seeds' arguments (checked when built)."""
    run_dir: str = option(type=_DIR, argument=True)
    suite: str = option(help="the suite whose seed<N>/<suite>.csv files to summarise")


@click.group(context_settings=CONTEXT_SETTINGS)
def main():
    """Tables from benchmark CSVs already written."""


@main.command("memory-table", context_settings=CONTEXT_SETTINGS)
@plan_options(MemoryTablePlan)
def memory_table_cmd(**values):
    """Print the memory suite's peak-RSS table (Markdown) from OUTPUT_DIR/memory.csv and memory_jobs.csv;
    the memory_jobs.csv in each REMEASURED_DIR (later runs of some of the same jobs) replaces their cells."""
    plan = plan_from_cli(MemoryTablePlan, values)
    click.echo(memory_table_from(plan.output_dir, *plan.remeasured_dirs))


@main.command("recall-table", context_settings=CONTEXT_SETTINGS)
@plan_options(RecallTablePlan)
def recall_table_cmd(**values):
    """Print the recall rows of a suite CSV (benchmarks.run's <suite>.csv) as a Markdown table with intervals."""
    click.echo(recall_table(read_csv(plan_from_cli(RecallTablePlan, values).csv_path)))


@main.command("seeds", context_settings=CONTEXT_SETTINGS)
@plan_options(SeedsPlan)
def seeds_cmd(**values):
    """Rewrite RUN_DIR/<suite>_seeds.csv (benchmarks.run --model-seed 0,1,2's summary) from RUN_DIR/seed<N>/<suite>.csv
    with today's columns (the t interval over seeds), keeping the query-bootstrap columns of each row the one there
    summarises with the same means (the per-query hits are not in the CSVs: a rerun row has them blank)."""
    with cli_errors():
        plan = plan_from_cli(SeedsPlan, values)
        summary, blank = seed_summary_from(plan.run_dir, plan.suite)
    path = write_csv(f"{plan.run_dir.rstrip('/')}/{plan.suite}_seeds.csv", summary, SEED_COLUMNS)
    click.echo(seed_summary_table(summary, f"{plan.suite}: mean ± std over model seeds {summary[0]['seeds']}"))
    for row in blank:
        click.echo(f"no query-bootstrap columns for {' '.join(str(row[c]) for c in SEED_KEY if str(row[c]))}: "
                   "the summary there has other means for it (a rerun row; its per-query hits are not in the CSVs)")
    click.echo(f"wrote {path}")


@main.command("docs", context_settings=CONTEXT_SETTINGS)
@plan_options(published.DocsPlan)
def docs_cmd(**values):
    """Regenerate the result tables of the docs from the CSVs in docs/results/ (with --publish, after copying a
    run's CSV there) and docs/CLI.md from the CLIs; --check changes nothing and exits 1 on any problem."""
    with cli_errors():
        plan = plan_from_cli(published.DocsPlan, values)
        lines = published.run(plan)
    for line in lines:
        click.echo(line)
    if plan.check and lines:
        raise SystemExit(1)
    if plan.check:
        click.echo(f"every generated block matches its CSV; no result outside them in "
                   f"{', '.join(published.docs_pages(plan.root))}; {cli_reference.REFERENCE} is current")


if __name__ == "__main__":
    main()

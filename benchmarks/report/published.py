"""The numbers README.md and docs/RESULTS.md print, generated from the committed result CSVs in docs/results/.

    python -m benchmarks.report docs                                       # rewrite every generated block
    python -m benchmarks.report docs --publish runs/demo/results/demo.csv  # copy a run's CSV in, then rewrite
    python -m benchmarks.report docs --check                               # change nothing; exit 1 on a problem

A generated block names its table kind and its CSV (a path from the repository root)::

    <!-- generated: recall-table docs/results/demo.csv -->
    (the table: rewritten from the CSV, never edited by hand)
    <!-- /generated -->

A block whose CSV is not published yet is written as a pending marker, ``<!-- pending: recall-table
docs/results/demo.csv -->``, alone on its line: it prints nothing, and the first run after its CSV is published turns
it into a generated block.

``--check`` reports each block that differs from what its CSV generates, each number inside a block that no
cell of its CSV holds (a decimal must equal a cell rounded to the decimals shown), and, on every documentation
page (the README, docs/ and the other READMEs; ``docs_pages``), each result-like number outside the blocks:

- a decimal, unless it is a version (3.10, 2.13.0 after ``==``) or an option's value (``--lam 0.7``);
- a signed number (+3.4, -2);
- a percentage, other than the intervals' 95 %;
- a time or a rate: a number followed by a unit of time (s, ms, min, h, seconds, minutes, hours) or ``/s``.

Text in backticks (code: an option's default, a file name) is not read. Other integers (counts, sizes, dates,
settings) may stand anywhere. A measured figure belongs in a generated block, or in the dated log
(``docs/log/``, not checked: each entry names its source); docs/CLI.md is generated whole (cli_reference).
``--publish`` refuses a CSV without its environment columns or whose commit is unknown or dirty: a number in the
docs names the code that measured it.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import click

from benchmarks.report.cost_tables import (
    feeding_table,
    gpu_run_table,
    jobs_table,
    latency_table,
    per_query_table,
    precision_table,
    query_job_table,
    query_latency_table,
    search_batch_table,
    train_scale_table,
    train_source_table,
)
from benchmarks.report.schema import read_csv, schema_path
from benchmarks.report.tables import (
    comparison_table,
    fusion_rule_table,
    joint_screen_table,
    model_gap_table,
    probe_table,
    recall_table,
    seed_table,
)
from retrieval_core.cli import CheckedPlan, option

#: The tracked folder of the result CSVs the docs cite (results/ at the root is the runs' scratch, ignored).
RESULTS_DIR = "docs/results"
#: The dated log: how numbers were reached, each with its source; the one docs folder the prose check skips.
LOG_DIR = "docs/log"
#: Pages generated whole from the code (benchmarks.report.cli_reference), so not prose.
GENERATED_PAGES = ("docs/CLI.md",)
#: The other documentation pages besides README.md and docs/.
OTHER_PAGES = ("data_manifests/README.md", "docker/README.md")
#: Log entries with generated blocks: their blocks are checked against their CSVs, their prose is not.
BLOCKS_ONLY = ("docs/log/PERFORMANCE-2026-11.md",)
#: The columns a published CSV must fill: where, when and from which code its rows were measured.
PROVENANCE = ("device", "cpu_model", "threads", "torch", "faiss", "commit", "date")

BLOCK = re.compile(r"<!-- generated: (?P<kind>[\w-]+) (?P<csv>\S+) -->\n(?P<body>.*?)<!-- /generated -->", re.S)
PENDING = re.compile(r"<!-- pending: (?P<kind>[\w-]+) (?P<csv>\S+) -->\n")
#: A number standing on its own (not inside a word, an id or a file name, nor the end of a hyphenated word: top-1).
NUMBER = re.compile(r"(?<![\w.@])(?<!\w-)[+-]?\d+(?:\.\d+)?(?![\w.])")
#: Decimals that are no result: versions (3.10, 2.13.0 after == or >=, or after a library's name: Beam 2.77) and
#: option values (--lam 0.7, lam=0.2).
NOT_A_RESULT = re.compile(r"(?:(?:==|>=|<=) ?|--[\w-]+[ =]|\b[a-z_]+=|(?:Beam|Python|python|torch|faiss|CUDA|numpy|"
                          r"transformers|pyarrow) )\d+(?:\.\d+)+|\d+\.\d+\.\d+")
#: A figure with a unit of time or a rate (320 s, 4.75 h, 20 ms, 382 pairs/s): a measurement or an estimate of one.
TIMED = re.compile(r"(?<![\w.@])(\d[\d,]*(?:\.\d+)?) ?(?:s|ms|min|h|seconds?|minutes?|hours?|[a-z]*/s)(?![\w/])")
#: Inline code: an option, its default, a path; not prose.
CODE_SPAN = re.compile(r"`[^`\n]*`")
SIGNED = re.compile(r"(?<![\w.@])[+-]\d+(?:\.\d+)?(?![\w.])")
PERCENT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?) ?%")
#: The one percentage that is a setting, not a result: the level of every interval.
INTERVAL_LEVEL = "95"


def _one(rows: Sequence[Mapping], column: str) -> str:
    """The column's value over the rows: one value, or the distinct ones joined (a CSV from several runs)."""
    values = list(dict.fromkeys(str(r.get(column, "")) for r in rows if str(r.get(column, "")) != ""))
    return ", ".join(values) if values else "-"


def _measured(rows: Sequence[Mapping], faiss: bool = True) -> str:
    """``Measured <date> at commit <c> on <cpu> (<device>, <n> threads; torch <v>[, faiss <v>])``: the opening of
    every generated table's line."""
    dates = sorted({d for r in rows for d in str(r.get("date", "")).split(", ") if d})  # a seed row joins its seeds'
    return (f"Measured {', '.join(dates) or '-'} at commit {_commits(rows)} on {_one(rows, 'cpu_model')} "
            f"({_one(rows, 'device')}, {_one(rows, 'threads')} threads; torch {_one(rows, 'torch')}"
            + (f", faiss {_one(rows, 'faiss')})" if faiss else ")"))


def _commits(rows: Sequence[Mapping]) -> str:
    """The rows' commit; where each model's rows share one but the models differ (one model rerun from a later
    pinned commit), each commit with the models it ran."""
    by_model: dict[str, set] = {}
    for r in rows:
        by_model.setdefault(str(r.get("model", "")), set()).add(str(r.get("commit", "")))
    if len(set().union(*by_model.values())) < 2 or any(len(c) != 1 for c in by_model.values()):
        return f"`{_one(rows, 'commit')}`"
    models: dict[str, list] = {}
    for model, (commit,) in by_model.items():
        models.setdefault(commit, []).append(model)
    return ", ".join(f"`{c}` ({' and '.join(m)} rows)" for c, m in models.items())


def provenance_line(rows: Sequence[Mapping]) -> str:
    """Where, when, from which commit and on what the rows were measured (their environment columns)."""
    return (_measured(rows) + f"; recipe {_one(rows, 'recipe')}, model seed {_one(rows, 'model_seed')}; "
            f"encode and rerank in {_precision(rows)}; "
            f"{_one(rows, 'split')} split, {_one(rows, 'queries')} queries per direction, pool of "
            f"{_one(rows, 'collection_size')} images; intervals: {_one(rows, 'bootstrap')}; " + _run_note(rows))


def _precision(rows: Sequence[Mapping]) -> str:
    """The serving precision of the rows' encode and rerank jobs (``quantize``; empty or none = float32)."""
    return ", ".join(dict.fromkeys("float32" if str(r.get("quantize", "")) in ("", "none") else str(r["quantize"])
                                   for r in rows)) or "float32"


def _run_note(rows: Sequence[Mapping]) -> str:
    """The run's own note and wall time where every row shares them (the demo: one run); a suite's rows each
    carry their own (query sampling, folds, the fusion chosen on dev, skips): those stay in the CSV, named here."""
    notes = {str(r.get("notes", "")) for r in rows}
    walls = {str(r.get("wall_s", "")) for r in rows}
    if len(notes) == 1 and len(walls) == 1:
        return f"{_one(rows, 'notes')}, {_one(rows, 'wall_s')} s in all."
    return "each row's notes (query sampling, folds, the fusion chosen on dev, skipped rows) and timings: the CSV."


def recall_block(rows: Sequence[Mapping]) -> str:
    """A recall table (report.recall_table) under the line saying how it was measured."""
    return provenance_line(rows) + "\n\n" + recall_table(rows) + "\n"


def environment_line(rows: Sequence[Mapping]) -> str:
    """Where, when and from which commit rows that are no recall table were measured."""
    return (_measured(rows, faiss=False) + "; model "
            f"{_one(rows, 'model')} ({_one(rows, 'recipe')}), {_one(rows, 'collection_size')} items per task.")


def precision_block(rows: Sequence[Mapping]) -> str:
    """Rankings in a reduced precision against float32's (report.precision_table), under how they were measured."""
    return provenance_line(rows) + "\n\n" + precision_table(rows) + "\n"


def feeding_block(rows: Sequence[Mapping]) -> str:
    """benchmarks.meters.feeding's rates (report.feeding_table) under where they were measured."""
    return (environment_line(rows) + " Each rate is the median of repetitions interleaved with the other ways in "
            "one process (the CSV's notes: how many, and each way's seconds).\n\n" + feeding_table(rows) + "\n")


def seed_block(rows: Sequence[Mapping]) -> str:
    """A <suite>_seeds.csv's table (report.seed_table) under how it was measured."""
    return (_measured(rows) + f"; recipe {_one(rows, 'recipe')}, model seeds {_one(rows, 'seeds')}; "
            f"encode and rerank in {_precision(rows)}; {_one(rows, 'split')} split, {_one(rows, 'queries')} "
            f"queries per direction (the same queries for every seed), pools of {_one(rows, 'collection_size')} "
            f"images; mean ± std over the seeds [intervals: "
            f"{_one(rows, 'seed_interval')}]. The query-bootstrap intervals of the seed means: the CSV (of the "
            "rows whose run kept its per-query hits).\n\n"
            + seed_table(rows) + "\n")


def model_gap_block(rows: Sequence[Mapping]) -> str:
    """A <suite>_seeds.csv's model comparison (report.model_gap_table) under how it was measured."""
    return (_measured(rows) + f"; recipe {_one(rows, 'recipe')}, model seeds {_one(rows, 'seeds')} of each; "
            f"{_one(rows, 'split')} split, {_one(rows, 'queries')} queries per direction (the same for both models "
            f"and every seed); R@1 seed means, the difference with its 95 % Welch t interval over the seeds (each "
            f"model trained on its own seeds: not paired).\n\n" + model_gap_table(rows) + "\n")


def probe_block(rows: Sequence[Mapping]) -> str:
    """benchmarks.probes.family_probe's accuracies (report.probe_table) under where they were measured."""
    return (_measured(rows, faiss=False) + "; "
            f"{_one(rows, 'collection')} {_one(rows, 'split')} split; intervals: {_one(rows, 'bootstrap')}.\n\n"
            + probe_table(rows) + "\n")


def joint_screen_block(rows: Sequence[Mapping]) -> str:
    """benchmarks.probes.joint_screen's rows (report.joint_screen_table) under where they were measured."""
    return (_measured(rows, faiss=False) + f"; {_one(rows, 'split')} split, {_one(rows, 'queries')} queries per "
            f"direction, the CE reranking the BE's top {_one(rows, 'k')}; intervals: {_one(rows, 'bootstrap')}.\n\n"
            + joint_screen_table(rows) + "\n")


def fusion_rule_block(rows: Sequence[Mapping]) -> str:
    """benchmarks.probes.fusion_rule's re-chosen defaults (report.fusion_rule_table) under where they were computed."""
    return (_measured(rows) + f"; from the stored scores of the suites' runs, {_one(rows, 'queries')} queries per "
            "direction; intervals: the seed mean's t interval over seeds, a seed's "
            "own difference by a paired query bootstrap (the CSV).\n\n" + fusion_rule_table(rows) + "\n")


def jobs_block(rows: Sequence[Mapping]) -> str:
    """A suite run's jobs (report.jobs_table) under where they ran; each job's own thread count is in its row."""
    return (_measured(rows) + f"; encode and rerank in {_precision(rows)}; the threads above are the run's, "
            "each job's own are in its row; a job reused by the run that wrote the CSV shows its cost as measured "
            "when it ran.\n\n" + jobs_table(rows) + "\n")


def comparison_block(rows: Sequence[Mapping]) -> str:
    """Paired comparisons of two rankings of the same queries (report.comparison_table) under how they were
    measured."""
    return provenance_line(rows) + "\n\n" + comparison_table(rows) + "\n"


def per_query_block(rows: Sequence[Mapping]) -> str:
    """A scale suite's cost per query (report.per_query_table) under where it was measured."""
    return (_measured(rows) + f"; encode and rerank in {_precision(rows)}; each ranking's rerank job's wall over "
            "the queries it ranked (both directions, start-up and index loading included), the exhaustive CE's "
            "from the CO job's CE seconds (its wall minus the search-only job's) per pair; the formula in each "
            "row's notes.\n\n" + per_query_table(rows) + "\n")


def measured_per_query_block(rows: Sequence[Mapping]) -> str:
    """A scale suite's measured cost per query only: the exhaustive CE's extrapolated rows left out, where the CO
    job's wall held search time the search-only job does not account for (the 1M run: its waves searched again)."""
    measured = [r for r in rows if str(r.get("measured", "")).lower() == "true"]
    return (_measured(rows) + f"; encode and rerank in {_precision(rows)}; each ranking's rerank job's wall over "
            "the queries it ranked (both directions, start-up and index loading included); measured rows only.\n\n"
            + per_query_table(measured) + "\n")


def search_batch_block(rows: Sequence[Mapping]) -> str:
    """benchmarks.meters.search_batch's timings (report.search_batch_table) under where they were measured."""
    return (_measured(rows) + f"; one Flat inner-product index shard of {_one(rows, 'shard_size')} vectors of "
            f"{_one(rows, 'dim')} dimensions, {_one(rows, 'candidates')} candidates per query; "
            f"{_one(rows, 'notes')}.\n\n" + search_batch_table(rows) + "\n")


def latency_block(rows: Sequence[Mapping]) -> str:
    """The latency suite's per-query rows (report.latency_table) under where and how they were measured."""
    per_query = [r for r in rows if str(r.get("collection", "")).startswith("per_query")]
    return (_measured(rows) + f"; batch size {_one(per_query, 'batch_size')}; one text query per call, encoded by the "
            f"model (included), median of each method's timed queries; {_one(per_query[:1], 'notes')}; "
            "paper-code: torch.mm + topk over all items and one CE call per (query, candidate) pair.\n\n"
            + latency_table(rows) + "\n")


def query_latency_block(rows: Sequence[Mapping]) -> str:
    """benchmarks/meters/query_latency.py's rows (report.query_latency_table) under where and how they were measured."""
    loads = [float(r[c]) for r in rows for c in ("loadavg_1m_before", "loadavg_1m_after") if str(r.get(c, ""))]
    load = f"; machine load average {min(loads):g}-{max(loads):g}" if loads else ""
    return (_measured(rows) + f", OMP_WAIT_POLICY={_one(rows, 'omp_wait_policy')}; pool of "
            f"{_one(rows, 'pool_images')} images and {_one(rows, 'pool_captions')} captions; "
            f"{_one(rows, 'queries')} queries per row, one per call; the engine opened in {_one(rows, 'load_s')} s"
            + (f" (then reopened in {_one(rows, 'reopen_s')} s: the first open builds what a large pool reads)"
               if _one(rows, 'reopen_s') != "-" else "")
            + f"{load}.\n\n" + query_latency_table(rows) + "\n")


def query_job_block(rows: Sequence[Mapping]) -> str:
    """benchmarks/meters/query_latency.py's job rows (report.query_job_table) under where they were measured."""
    loads = [float(r[c]) for r in rows for c in ("loadavg_1m_before", "loadavg_1m_after") if str(r.get(c, ""))]
    load = f"; machine load average {min(loads):g}-{max(loads):g}" if loads else ""
    return (_measured(rows) + f", OMP_WAIT_POLICY={_one(rows, 'omp_wait_policy')}; pool of "
            f"{_one(rows, 'pool_images')} images searched by {_one(rows, 'search')}; mode {_one(rows, 'mode')}, "
            f"each job a child process timed from start to exit{load}.\n\n" + query_job_table(rows) + "\n")


def train_source_block(rows: Sequence[Mapping]) -> str:
    """benchmarks.meters.train_source's training rows (report.train_source_table) under where they were measured."""
    loads = [float(r["load_avg"]) for r in rows if str(r.get("load_avg", ""))]
    load = f"; machine load average {min(loads):g}-{max(loads):g}" if loads else ""
    return (_measured(rows) + f"; CPU flags {_one(rows, 'cpu_flags')}; a child process per measurement, the "
            f"sources interleaved; the medians of each group's repetitions{load}.\n\n" + train_source_table(rows)
            + "\n")


def train_scale_block(rows: Sequence[Mapping]) -> str:
    """benchmarks.meters.train_scale's rows (report.train_scale_table) under where they were measured."""
    torch = f"; torch {_one(rows, 'torch')}" if _one(rows, "torch") != "-" else ""  # rows before the column
    return (f"Measured {_one(rows, 'date')} at commit `{_one(rows, 'commit')}` on {_one(rows, 'cpu_model')} (cpu, "
            f"{_one(rows, 'threads')} threads{torch}); CPU flags {_one(rows, 'cpu_flags')}, a float32 GEMM at "
            f"{_one(rows, 'gemm_gflops')} GFLOP/s before the run (other jobs shared the machine); manifest "
            f"{_one(rows, 'manifest')}, train source {_one(rows, 'train_source')}; the run: "
            f"`{_one(rows, 'command')}`.\n\n" + train_scale_table(rows) + "\n")


def gpu_run_block(rows: Sequence[Mapping]) -> str:
    """The GPU run's (or its rehearsal's) rows (report.gpu_run_table) under where they were measured."""
    return (_measured(rows, faiss=False) + "; benchmarks.meters.gpu_pipelines, each step's estimate in its row's notes."
            "\n\n" + gpu_run_table(rows) + "\n")


#: The table kinds a generated block may name.
GENERATORS: dict[str, Callable[[Sequence[Mapping]], str]] = {
    "recall-table": recall_block, "precision-table": precision_block, "feeding-table": feeding_block,
    "seed-table": seed_block, "model-gap-table": model_gap_block, "probe-table": probe_block,
    "joint-screen-table": joint_screen_block,
    "fusion-rule-table": fusion_rule_block, "jobs-table": jobs_block,
    "comparison-table": comparison_block, "per-query-table": per_query_block,
    "measured-per-query-table": measured_per_query_block,
    "search-batch-table": search_batch_block, "gpu-run-table": gpu_run_block,
    "latency-table": latency_block, "query-latency-table": query_latency_block, "query-job-table": query_job_block,
    "train-source-table": train_source_block, "train-scale-table": train_scale_block}


def generate(kind: str, csv_path: str, root: str) -> str:
    if kind not in GENERATORS:
        raise ValueError(f"unknown generated block kind {kind!r} (known: {', '.join(GENERATORS)})")
    path = os.path.join(root, csv_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"generated block {kind} names {csv_path}, which does not exist")
    return GENERATORS[kind](read_csv(path))


def _block(kind: str, csv_path: str, root: str) -> str:
    return f"<!-- generated: {kind} {csv_path} -->\n{generate(kind, csv_path, root)}<!-- /generated -->"


def regenerate(text: str, root: str) -> str:
    """``text`` with every generated block rewritten from its CSV, and every pending marker whose CSV now exists
    turned into a generated block."""
    text = BLOCK.sub(lambda m: _block(m.group("kind"), m.group("csv"), root), text)
    return PENDING.sub(lambda m: _block(m.group("kind"), m.group("csv"), root) + "\n"
                       if os.path.isfile(os.path.join(root, m.group("csv"))) else m.group(0), text)


def _matches(token: str, cells: Sequence[str]) -> bool:
    """A block's number is in its CSV: a decimal equals a numeric cell rounded to the decimals shown; an integer
    is a number of some cell (a count, k, a date's year, the interval level in the bootstrap label)."""
    if "." in token:
        decimals = len(token.split(".")[1])
        want = float(token)
        for c in cells:
            try:
                if float(f"{float(c):.{decimals}f}") == want:
                    return True
            except ValueError:
                continue
        return False
    return any(token.lstrip("+") == n.lstrip("+") for c in cells for n in NUMBER.findall(c))


def block_numbers_problems(body: str, rows: Sequence[Mapping], where: str) -> list[str]:
    cells = [str(v) for r in rows for v in r.values() if str(v) != ""]
    return [f"{where}: {token} is in no cell of its CSV" for token in NUMBER.findall(body.replace("`", " "))
            if not _matches(token, cells)]


def docs_pages(root: str) -> list[str]:
    """Every documentation page whose prose the check reads: README.md, docs/ (its log and generated pages
    aside) and OTHER_PAGES; paths from the root, sorted."""
    pages = ["README.md", *OTHER_PAGES]
    for folder, dirs, files in os.walk(os.path.join(root, "docs")):
        rel = os.path.relpath(folder, root)
        if rel == LOG_DIR or rel.startswith(LOG_DIR + os.sep):
            dirs[:] = []
            continue
        pages += [os.path.join(rel, f) for f in files if f.endswith(".md")]
    return sorted(p for p in pages if p not in GENERATED_PAGES and os.path.isfile(os.path.join(root, p)))


def prose_problems(text: str, where: str) -> list[str]:
    """Result-like numbers outside the generated blocks (see the module docstring)."""
    problems = []
    for n, line in enumerate(BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text).splitlines(), 1):
        clean = NOT_A_RESULT.sub(" ", CODE_SPAN.sub(" ", line))
        problems += [f"{where} (outside the generated blocks, line {n}): time or rate {t.group(0)}"
                     for t in TIMED.finditer(clean)]
        problems += [f"{where} (outside the generated blocks, line {n}): decimal {d}"
                     for d in NUMBER.findall(clean) if "." in d]
        problems += [f"{where} (outside the generated blocks, line {n}): signed {s}" for s in SIGNED.findall(clean)
                     if "." not in s]
        problems += [f"{where} (outside the generated blocks, line {n}): {p} %" for p in PERCENT.findall(clean)
                     if p != INTERVAL_LEVEL]
    return problems


def check_text(text: str, root: str, where: str, prose: bool = True) -> list[str]:
    """Every problem of one Markdown file: stale blocks, block numbers not in their CSVs, result-like prose (with
    ``prose``)."""
    problems: list[str] = []
    problems += [f"{where}: pending block {m.group('kind')} {m.group('csv')}: its CSV is published "
                 f"(python -m benchmarks.report docs generates it)" for m in PENDING.finditer(text)
                 if os.path.isfile(os.path.join(root, m.group("csv")))]
    for m in BLOCK.finditer(text):
        label = f"{where}: block {m.group('kind')} {m.group('csv')}"
        expected = generate(m.group("kind"), m.group("csv"), root)
        if m.group("body") != expected:
            problems.append(f"{label} differs from its CSV (python -m benchmarks.report docs rewrites it)")
        problems += block_numbers_problems(m.group("body"), read_csv(os.path.join(root, m.group("csv"))),
                                           label)
    return problems + (prose_problems(text, where) if prose else [])


def check(root: str, docs: Sequence[str] = (), blocks_only: Sequence[str] = BLOCKS_ONLY) -> list[str]:
    """Every problem of the documentation (``docs``: default, docs_pages)."""
    problems = []
    for doc in (*(docs or docs_pages(root)), *blocks_only):
        with open(os.path.join(root, doc), encoding="utf-8") as f:
            problems += check_text(f.read(), root, doc, prose=doc not in blocks_only)
    return problems


def publish(csv_path: str, root: str) -> str:
    """Copy a run's result CSV (and its .schema.json) into RESULTS_DIR; returns its path there."""
    rows = read_csv(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no rows")
    missing = [c for c in PROVENANCE if any(str(r.get(c, "")) == "" for r in rows)]
    if missing:
        raise ValueError(f"{csv_path}: column(s) {missing} empty or absent: the docs cite only rows that say where "
                         f"and from which code they were measured")
    bad = sorted({r["commit"] for r in rows if r["commit"] == "unknown" or r["commit"].endswith("+dirty")})
    if bad:
        raise ValueError(f"{csv_path}: commit {bad[0]!r} names no committed code; run it from a clean checkout")
    dest = os.path.join(root, RESULTS_DIR)
    os.makedirs(dest, exist_ok=True)
    prefix = machine_folder(rows)
    with open(csv_path, encoding="utf-8", newline="") as f:
        text = f.read()
    with open(os.path.join(dest, os.path.basename(csv_path)), "w", encoding="utf-8", newline="") as f:
        f.write(text.replace(prefix + "/", RUNS_MARK + "/") if prefix else text)
    if os.path.isfile(schema_path(csv_path)):
        shutil.copyfile(schema_path(csv_path), os.path.join(dest, os.path.basename(schema_path(csv_path))))
    return os.path.join(RESULTS_DIR, os.path.basename(csv_path))


#: What a published copy writes for the folder of the machine that ran it (PATH_COLUMNS).
RUNS_MARK = "<runs>"
#: Columns naming folders of that machine: run folders (suites), model folders (probes), a job's output folder
#: and the paths in its command (jobs CSVs).
PATH_COLUMNS = ("rankings", "be_model", "ce_model", "output", "command")


def machine_folder(rows: Sequence[Mapping]) -> str:
    """The folder common to every absolute folder in the PATH_COLUMNS ('' when there is none): a path of the machine
    that ran the suite or probe, meaningless elsewhere, so a published copy names the folders below it."""
    dirs = [os.path.dirname(p) for r in rows for c in PATH_COLUMNS
            for p in re.split(r"[;\s]+", str(r.get(c, ""))) if p.startswith("/")]
    return os.path.commonpath(dirs) if dirs else ""


@dataclass(frozen=True)
class DocsPlan(CheckedPlan):
    """``docs``' options (checked when built)."""
    publish: tuple[str, ...] = option((), multiple=True, type=click.Path(exists=True, dir_okay=False),
                                      help=f"a run's result CSV to copy into {RESULTS_DIR} first (repeatable)")
    check: bool = option(False, help="change nothing: report stale blocks and numbers not in their CSVs, exit 1")
    root: str = option(".", type=click.Path(exists=True, file_okay=False), help="the repository root")

    def __post_init__(self):
        super().__post_init__()
        if self.check and self.publish:
            raise ValueError("--check changes nothing: it takes no --publish")


def run(plan: DocsPlan) -> list[str]:
    """What ``docs`` does; returns the lines it reports. With ``check``, the problems (none: all is well)."""
    from benchmarks.report import cli_reference  # imports every CLI: only when the docs are written or checked

    if plan.check:
        return check(plan.root) + cli_reference.check(plan.root)
    lines = [f"published {publish(csv_path, plan.root)}" for csv_path in plan.publish]
    for doc in (*docs_pages(plan.root), *BLOCKS_ONLY):
        path = os.path.join(plan.root, doc)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = regenerate(text, plan.root)
        if new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        state = "rewritten" if new != text else "unchanged"
        lines.append(f"{doc}: {len(BLOCK.findall(new))} generated block(s), {state}")
    return lines + [cli_reference.write(plan.root)]

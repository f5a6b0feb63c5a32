"""Every result the README and docs/RESULTS.md print comes from a committed CSV (benchmarks.report docs), and no
tracked file points readers to a file outside the repository."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.report import published

ROOT = Path(__file__).resolve().parents[1]

ENV = {"device": "cpu", "cpu_model": "AMD EPYC", "threads": 2, "torch": "2.13.0+cpu", "faiss": "1.15.1",
       "transformers": "5.24.0", "commit": "b51d2036f1c0ffee", "date": "2026-11-27", "recipe": "demo",
       "model_seed": 0, "split": "test", "queries": 500, "collection_size": 500, "suite": "demo", "wall_s": 390,
       "bootstrap": "95 % percentile bootstrap, 1000 resamples, seed 0", "notes": "wall time per step (s): stage 18"}


def _rows() -> list[dict]:
    emb = [{"collection": "demo", "model": "JOIN", "mode": "EMB", "k": 10, "direction": d, "R@1": r1, "R@5": 88.6,
            "R@10": 92.6, "mR": 82.4, "R@1_lo": r1 - 4.6, "R@1_hi": r1 + 4.4, "mR_lo": 80.67, "mR_hi": 84.23, **ENV}
           for d, r1 in (("t2i", 60.6), ("i2t", 70.2))]
    co = [{**r, "model": "JOIN/JOIN", "mode": "JOIN+CO", "R@1": r["R@1"] + 4.6, "against": "emb", "delta_R@1": 4.6,
           "delta_R@1_lo": -0.01, "delta_R@1_hi": 9.4} for r in emb]
    return emb + co


def _repo(tmp_path: Path) -> str:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    report.write_csv(str(tmp_path / "docs" / "results" / "x.csv"), _rows(),
                     write_atomic=lambda p, b: Path(p).write_bytes(b))
    return str(tmp_path)


def _generated(tmp_path: Path, kind: str, rows: list) -> str:
    """``rows`` written as a CSV of a scratch repository and the ``kind`` block its pending marker turns into."""
    (tmp_path / "docs" / "results").mkdir(parents=True, exist_ok=True)
    report.write_csv(str(tmp_path / "docs" / "results" / "t.csv"), rows,
                     write_atomic=lambda p, b: Path(p).write_bytes(b))
    return published.regenerate(f"<!-- pending: {kind} docs/results/t.csv -->\n", str(tmp_path))


def test_every_docs_page_prints_only_numbers_of_its_committed_csvs():
    assert published.check(str(ROOT)) == []


def test_the_check_reports_a_stale_table_a_number_not_in_the_csv_and_a_result_in_prose(tmp_path):
    root = _repo(tmp_path)
    text = published.regenerate("intro\n<!-- generated: recall-table docs/results/x.csv -->\n<!-- /generated -->\n",
                                root)
    assert "| demo | JOIN/JOIN | JOIN+CO k=10 | 65.2 [56.0, 65.0]" in text
    assert published.check_text(text, root, "doc") == []

    tampered = published.check_text(text.replace("65.2 [", "66.2 ["), root, "doc")
    assert any("differs from its CSV" in p for p in tampered)
    assert any("66.2 is in no cell of its CSV" in p for p in tampered)

    prose = published.check_text(text + "The CE lifts R@1 from 60.6 (+5 at R@5); 75 % binding, 95 % intervals, "
                                        "torch==2.13.0, Python >= 3.10, --lam 0.7, 1,000 resamples.\n", root, "doc")
    assert [p.split(": ", 1)[1] for p in prose] == ["decimal 60.6", "signed +5", "75 %"]
    timed = published.check_text("The job took 1,190 s (about 20 min, ~3 h); 382 pairs/s; `--timeout 600` s; "
                                 "5,000 images in 12 shards, 2026-11-28.\n", root, "doc")
    assert [p.split(": ", 1)[1] for p in timed] == ["time or rate 1,190 s", "time or rate 20 min",
                                                    "time or rate 3 h", "time or rate 382 pairs/s"]


def test_every_docs_page_but_the_log_and_the_generated_reference_is_checked():
    pages = published.docs_pages(str(ROOT))
    assert {"README.md", "docs/RESULTS.md", "docs/TRAINING.md", "docs/OWN_PHOTOS.md", "docs/QUERY.md",
            "data_manifests/README.md", "docs/results/README.md"} <= set(pages)
    assert not [p for p in pages if p.startswith("docs/log/")] and "docs/CLI.md" not in pages


def test_a_pending_block_is_generated_once_its_csv_is_published(tmp_path):
    root = _repo(tmp_path)
    waiting = "<!-- pending: recall-table docs/results/y.csv -->\nafter\n"
    assert published.regenerate(waiting, root) == waiting and published.check_text(waiting, root, "doc") == []
    ready = waiting.replace("y.csv", "x.csv")
    assert published.check_text(ready, root, "doc") == [
        "doc: pending block recall-table docs/results/x.csv: its CSV is published (python -m benchmarks.report docs "
        "generates it)"]
    done = published.regenerate(ready, root)
    assert done.startswith("<!-- generated: recall-table docs/results/x.csv -->\nMeasured 2026-11-27")
    assert done.endswith("<!-- /generated -->\nafter\n") and published.check_text(done, root, "doc") == []


def test_a_block_naming_a_missing_csv_or_an_unknown_table_is_an_error(tmp_path):
    root = _repo(tmp_path)
    with pytest.raises(FileNotFoundError, match="docs/results/gone.csv"):
        published.regenerate("<!-- generated: recall-table docs/results/gone.csv -->\n<!-- /generated -->", root)
    with pytest.raises(ValueError, match="unknown generated block kind 'pie'"):
        published.regenerate("<!-- generated: pie docs/results/x.csv -->\n<!-- /generated -->", root)


def test_publish_copies_a_csv_with_its_schema_and_refuses_one_without_provenance(tmp_path):
    root = _repo(tmp_path / "repo")
    src = tmp_path / "run"
    src.mkdir()
    write = lambda p, b: Path(p).write_bytes(b)  # noqa: E731
    report.write_csv(str(src / "good.csv"), _rows(), write_atomic=write)
    assert published.publish(str(src / "good.csv"), root) == "docs/results/good.csv"
    assert (Path(root) / "docs" / "results" / "good.schema.json").is_file()
    # a suite's run folders are paths of the machine that ran it: the copy names them below <runs>
    runs = [{**r, "rankings": f"/tmp/x/work/bench/runs/c/{r['mode']} (k=20 mode=co)"} for r in _rows()]
    report.write_csv(str(src / "suite.csv"), runs, write_atomic=write)
    published.publish(str(src / "suite.csv"), root)
    copied = (Path(root) / "docs" / "results" / "suite.csv").read_text()
    assert "/tmp/x" not in copied and "<runs>/" in copied
    assert [r["rankings"] for r in published.read_csv(str(Path(root) / "docs" / "results" / "suite.csv"))] == [
        f"<runs>/{r['mode']} (k=20 mode=co)" for r in _rows()]

    report.write_csv(str(src / "dirty.csv"), [{**r, "commit": r["commit"] + "+dirty"} for r in _rows()],
                     write_atomic=write)
    with pytest.raises(ValueError, match="names no committed code"):
        published.publish(str(src / "dirty.csv"), root)
    report.write_csv(str(src / "bare.csv"), [{**r, "cpu_model": ""} for r in _rows()], write_atomic=write)
    with pytest.raises(ValueError, match=r"\['cpu_model'\] empty or absent"):
        published.publish(str(src / "bare.csv"), root)


def test_a_result_row_names_the_commit_it_ran():
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", report.source_commit())


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_tracked_file_points_to_a_file_outside_the_repository():
    """The conventions live in docs/CONVENTIONS.md; the test-data folder beside the repository is named only by the
    tests that read it (and skip with that reason where it is absent)."""
    bad = []
    for path in _tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary, or deleted in the work tree
        rel = path.relative_to(ROOT).as_posix()
        if "NOTES" + ".md" in text:
            bad.append(f"{rel}: NOTES" + ".md")
        if re.search(r"(?<![\w}$)])/wo" + "rk/", text):  # an absolute path of this machine ($OUT/work/ is relative)
            bad.append(f"{rel}: an absolute /wo" + "rk/ path")
        if "../" + "shared" in text and not rel.startswith("tests/"):
            bad.append(f"{rel}: ../shared")
    assert bad == []


def test_the_docs_command_generates_the_pending_tables_and_its_check_then_passes(tmp_path):
    from click.testing import CliRunner

    from benchmarks.report import cli_reference
    from benchmarks.report.__main__ import main

    root = _repo(tmp_path)
    (tmp_path / "docs" / "log").mkdir()
    (tmp_path / cli_reference.REFERENCE).write_text(cli_reference.reference())
    for doc in ("README.md", "docs/RESULTS.md", *published.BLOCKS_ONLY):
        (tmp_path / doc).write_text("Results:\n\n<!-- pending: recall-table docs/results/x.csv -->\n")
    runner = CliRunner()
    stale = runner.invoke(main, ["docs", "--root", root, "--check"])
    assert stale.exit_code == 1 and "its CSV is published" in stale.output
    assert runner.invoke(main, ["docs", "--root", root, "--check", "--publish", str(tmp_path / "README.md")]
                         ).exit_code == 1  # --check writes nothing, so it takes no --publish
    done = runner.invoke(main, ["docs", "--root", root])
    assert done.exit_code == 0 and "README.md: 1 generated block(s), rewritten" in done.output
    assert "| demo | JOIN | EMB | 60.6 [56.0, 65.0]" in (tmp_path / "README.md").read_text()
    assert runner.invoke(main, ["docs", "--root", root, "--check"]).exit_code == 0


def test_the_precision_and_feeding_tables_print_only_their_csvs_numbers(tmp_path):
    write = lambda p, b: Path(p).write_bytes(b)  # noqa: E731
    (tmp_path / "docs" / "results").mkdir(parents=True)
    bf16 = [{**r, "quantize": "bf16", "against": f"{r['mode']} in float32", "delta_mR": -0.2, "delta_mR_lo": -0.9,
             "delta_mR_hi": 0.5, "delta_R@1": 0.4, "delta_R@1_lo": -0.6, "delta_R@1_hi": 1.4,
             "ce_score_max_abs_diff": 0.0625, "ce_score_mean_abs_diff": 0.0071234, "ce_pairs_compared": 4950,
             "be_score_max_abs_diff": 0.0039, "be_score_mean_abs_diff": 0.0008, "be_pairs_compared": 4990}
            for r in _rows()]
    report.write_csv(str(tmp_path / "docs" / "results" / "p.csv"), bf16, write_atomic=write)
    feeding = [{**ENV, "suite": "latency", "collection": "feeding_pairs", "mode": f"pairs: {way}", "quantize": q,
                "batch_size": 128, "rate_per_s": rate, "roofline_fraction": rate / model, "collection_size": 5000,
                "model": "random-init", "recipe": "demo"}
               for q, model in (("fp32", 477.25), ("bf16", 1023.5))
               for way, rate in (("job path (handler)", model * 0.97), ("library loop", model * 1.1),
                                 ("model alone (batches collated ahead)", model))]
    report.write_csv(str(tmp_path / "docs" / "results" / "f.csv"), feeding, write_atomic=write)
    text = published.regenerate("<!-- pending: precision-table docs/results/p.csv -->\n"
                                "<!-- pending: feeding-table docs/results/f.csv -->\n", str(tmp_path))
    assert "| JOIN+CO k=10 | bf16 | t2i | 65.2 [56.0, 65.0] | JOIN+CO in float32 | +0.4 [-0.6, +1.4] no significant " \
           "difference | " \
           "-0.2 [-0.9, +0.5] no significant difference | 0.0625 / 0.0071 (4950) | 0.0039 / 0.0008 (4990) |" in text
    assert "| pairs | bf16 | 128 | 992.8 | 1125.8 | 1023.5 | 0.97 | 1.10 |" in text
    assert published.check_text(text, str(tmp_path), "doc", prose=False) == []
    assert any("differs from its CSV" in p for p in
               published.check_text(text.replace("992.8", "999.8"), str(tmp_path), "doc", prose=False))


def test_the_fusion_rule_table_counts_each_seeds_measured_losses(tmp_path):
    """benchmarks.probes.fusion_rule's table: the seed mean and its t interval per direction, the choice of every seed,
    and the seeds whose own paired interval lies below zero."""
    from benchmarks.probes.fusion_rule import COLUMNS

    write = lambda p, b: Path(p).write_bytes(b)  # noqa: E731
    (tmp_path / "docs" / "results").mkdir(parents=True)
    one = {"collection": "f30k1k (out of domain)", "model": "JOIN", "against": "emb", "interval": "x", "queries": 500,
           "co_lead": "", "rankings": "", **{c: v for c, v in ENV.items() if c in COLUMNS}}
    per_seed = {(0, "t2i"): (1.0, -2.0, 4.0, "norm_add_0.2"), (0, "i2t"): (2.0, 0.4, 3.6, "norm_add_0.2"),
                (2, "t2i"): (-6.4, -11.0, -2.0, "co"), (2, "i2t"): (-2.4, -7.2, 2.2, "co")}
    rows = [{**one, "model_seed": s, "rule": "previous", "fusion": f, "direction": d, "R@1": 30.0, "delta_R@1": e,
             "delta_R@1_lo": lo, "delta_R@1_hi": hi} for (s, d), (e, lo, hi, f) in per_seed.items()]
    rows += [{**one, "model_seed": "0,2", "rule": "previous", "fusion": "norm_add_0.2;co", "direction": d,
              "R@1": 30.0, "delta_R@1": e, "delta_R@1_lo": e - 40, "delta_R@1_hi": e + 40}
             for d, e in (("t2i", -2.7), ("i2t", -0.2))]
    report.write_csv(str(tmp_path / "docs" / "results" / "r.csv"), rows, COLUMNS, write_atomic=write)
    text = published.regenerate("<!-- pending: fusion-rule-table docs/results/r.csv -->\n", str(tmp_path))
    assert "| f30k1k (out of domain) | JOIN | previous | 0: norm_add_0.2, 2: co | -2.7 [-42.7, +37.3] | " \
           "-0.2 [-40.2, +39.8] | 2 |" in text
    assert published.check_text(text, str(tmp_path), "doc", prose=False) == []


def test_a_jobs_table_shows_each_job_as_it_ran(tmp_path):
    """A suite's jobs CSV says where the run was, and a reused job keeps the command, threads and finishing time
    of the run that measured it; the jobs-table block prints them and passes the numbers check."""
    from benchmarks.run import job_rows
    from benchmarks.suites import jobs

    (tmp_path / "docs" / "results").mkdir(parents=True)
    enc = jobs.Job("encode m c", "pipelines.encode", ("--threads", "1"), str(tmp_path / "e"), "manifest.json")
    ran = jobs.JobResult(enc, 1095.9, 2878771, finished="2026-11-27T16:58:20",
                         command="python -m pipelines.encode --threads 1")
    old = jobs.JobResult(jobs.Job("stage c", "pipelines.stage", (), str(tmp_path / "s"), "summary.json"), 272.175,
                         1167180, reused=True, finished="2026-11-27T16:40:12",
                         command="python -m pipelines.stage --threads 2 --output s")
    (tmp_path / "e").mkdir()  # an encode resumed after an interruption: its manifest has the earlier runs' seconds
    (tmp_path / "e" / "manifest.json").write_text('{"resumed_from_spill": {"items": 9, "earlier_runs_s": 4004.1}}')
    rows = job_rows([old, ran], (), {**ENV, "quantize": "none"})
    assert [(r["job_threads"], r["finished"], r["reused"]) for r in rows] == \
        [("2", "2026-11-27T16:40:12", True), ("1", "2026-11-27T16:58:20", False)]
    assert [r["earlier_runs_s"] for r in rows] == ["", 4004.1]
    report.write_jobs_csv(str(tmp_path / "docs" / "results" / "j.csv"), rows)
    text = published.regenerate("<!-- pending: jobs-table docs/results/j.csv -->\n", str(tmp_path))
    assert "| stage c | pipelines.stage | 2 | 272.2 | 1139.8 | 2026-11-27T16:40:12 |" in text
    assert "| encode m c | pipelines.encode | 1 | 1095.9 + 4004.1 earlier | 2811.3 | 2026-11-27T16:58:20 |" \
        in text
    assert published.check_text(text, str(tmp_path), "doc", prose=False) == []


def test_a_comparison_table_pairs_two_models_on_the_same_queries(tmp_path):
    """One model's EMB against another's (benchmarks.evaluate --against): R@1 and mR with their intervals, and the
    paired differences with their verdicts, all of them cells of the CSV."""
    one = {**ENV, "collection": "synthetic_multi30k", "model": "JOIN-e5-all", "mode": "EMB", "k": "",
           "against": "emb of JOIN-e5-en", "mR": 60.0, "mR_lo": 58.0, "mR_hi": 62.0, "delta_mR": -1.5,
           "delta_mR_lo": -3.25, "delta_mR_hi": 0.5}
    rows = [{**one, "direction": d, "R@1": r1, "R@1_lo": r1 - 4, "R@1_hi": r1 + 4, "delta_R@1": dr,
             "delta_R@1_lo": dr - 2, "delta_R@1_hi": dr + 2} for d, r1, dr in (("t2i", 40.0, 3.0), ("i2t", 50.0, -1.0))]
    text = _generated(tmp_path, "comparison-table", rows)
    assert "| synthetic_multi30k | JOIN-e5-all | EMB | emb of JOIN-e5-en | 40.0 [36.0, 44.0] | 50.0 [46.0, 54.0] | " \
           "60.0 [58.0, 62.0] | +3.0 [+1.0, +5.0] lifts | -1.0 [-3.0, +1.0] no significant difference | " \
           "-1.5 [-3.2, +0.5] no significant difference |" in text
    assert published.check_text(text, str(tmp_path), "doc", prose=False) == []


def test_a_recall_table_keeps_one_line_per_fusion_weight():
    """The combination suite's fused rows differ only in lam: each weight keeps its own line (they once collapsed
    into the last one); AUTO's chosen fusion already names its weight."""
    base = {"collection": "f30k", "model": "SEP", "k": 20, "fusion": "", "R@5": 1.0, "R@10": 1.0, "mR": 1.0}
    rows = [{**base, "mode": "CO-NORM_ADD", "lam": lam, "direction": d, "R@1": r1}
            for lam, r1 in ((0.1, 39.6), (0.9, 28.6)) for d in ("t2i", "i2t")]
    rows += [{**base, "mode": "AUTO", "lam": 0.2, "fusion": "norm_add_0.2", "direction": d, "R@1": 40.0}
             for d in ("t2i", "i2t")]
    table = report.recall_table(rows)
    assert "| f30k | SEP | CO-NORM_ADD k=20 lam=0.1 | 39.6 |" in table
    assert "| f30k | SEP | CO-NORM_ADD k=20 lam=0.9 | 28.6 |" in table
    assert "| f30k | SEP | AUTO k=20 (norm_add_0.2) | 40.0 |" in table


def test_a_hyphenated_word_ending_in_a_digit_is_no_number():
    """'top-1' in a table header names a statistic, not a result; a signed number after a space stays one."""
    assert published.NUMBER.findall("| top-1 binding | +1.5 [-2.0, +3.1] | R@1 -1 |") == ["+1.5", "-2.0", "+3.1", "-1"]


def test_a_per_query_table_prints_each_rankings_cost_per_query(tmp_path):
    """The paper's Table 3 from a measured run: EMB (the search-only job) and CO per query, and the exhaustive
    CE's extrapolation; rows without a per-query cost (the AUTO row: two jobs) are left out."""
    one = {**ENV, "suite": "scale_1m", "collection": "synthetic_1m", "model": "JOIN", "queries": 5000}
    rows = [{**one, "mode": "EMB", "k": "", "direction": d, "per_query_ms": 3.017, "measured": True}
            for d in ("t2i", "i2t")]
    rows += [{**one, "mode": "CO", "k": 20, "direction": d, "per_query_ms": 43.5, "ce_pairs": 200000,
              "measured": True} for d in ("t2i", "i2t")]
    rows += [{**one, "mode": "AUTO", "k": 20, "direction": "t2i", "per_query_ms": "", "measured": True}]
    rows += [{**one, "mode": "CE", "k": "all", "direction": d, "queries": "", "per_query_ms": ms, "ce_pairs": n,
              "rate_per_s": 500.0, "measured": False}
             for d, ms, n in (("t2i", 2e6, 1_000_000), ("i2t", 1e7, 5_000_000))]
    text = _generated(tmp_path, "per-query-table", rows)
    assert "| JOIN | EMB | t2i | 5000 | 3.02 | - | measured |" in text
    assert "| JOIN | CO k=20 | i2t | 5000 | 43.50 | 20 | measured |" in text
    assert "| JOIN | CE over the whole pool | i2t | - | 10000000.00 | 5000000 | extrapolated |" in text
    assert "AUTO" not in text
    assert published.check_text(text, str(tmp_path), "doc", prose=False) == []


def test_a_latency_table_pivots_each_method_by_size_and_marks_the_extrapolated(tmp_path):
    """The latency suite's Table 3: one line per method with its median per collection size, an extrapolated cell in
    italics, a method not run at a size as -, and the entry point's rows with their percentiles; the suite's other
    rows (roofline, Table 4 totals) stay out."""
    one = {**ENV, "suite": "latency", "collection": "per_query(jittered)", "direction": "t2i", "batch_size": 128,
           "notes": "items: jittered"}
    rows = [{**one, "model": "JOIN", "mode": "EMB-Flat", "k": 10, "collection_size": n, "latency_p50_ms": ms,
             "measured": True} for n, ms in ((1000, 15.77), (1_000_000, 162.66))]
    rows += [{**one, "model": "JOIN", "mode": "EMB-bound", "k": 10, "collection_size": 1000,
              "latency_p50_ms": 0.018, "measured": True}]
    rows += [{**one, "model": "JOIN", "mode": "EMB-HNSW32", "k": 10, "collection_size": 1_000_000,
              "latency_p50_ms": "", "measured": False}]
    rows += [{**one, "model": "paper-code", "mode": "CE", "k": "all", "collection_size": n, "latency_p50_ms": ms,
              "measured": False} for n, ms in ((1000, 9790.43), (1_000_000, 9778904.2))]
    rows += [{**one, "collection": "entry_point", "model": "JOIN", "mode": "entry point CO", "k": 20,
              "collection_size": 5000, "latency_p50_ms": 65.09, "latency_p95_ms": 85.28, "latency_p99_ms": 88.7,
              "measured": True},
             {**one, "collection": "eval_total(synthetic_coco)", "model": "JOIN", "mode": "CO", "k": 20,
              "collection_size": 100000, "wall_s": 25920.0, "measured": False}]
    text = _generated(tmp_path, "latency-table", rows)
    assert "| model | method | k | 1k items | 1M items |" in text
    assert "| JOIN | EMB-Flat | - | 15.8 | 162.7 |" in text
    assert "| JOIN | EMB-bound | - | 0.02 | - |" in text
    assert "| paper-code | CE | all | *9790.4* | *9778904.2* |" in text
    assert "EMB-HNSW32" not in text and "25920" not in text
    assert "| CO | 5000 | 20 | 65.1 | 85.3 | 88.7 |" in text
    assert published.check_text(text, str(tmp_path), "doc", prose=False) == []


#: Each seed summary's committed per-seed files: the JOIN rows of <suite>.csv (seed 0) and <suite>_seed<N>.csv, the
#: SEP rows of <suite>_sep.csv (seed 0) and <suite>_sep_seed<N>.csv (docs/results/README.md).
SEED_FILES = {suite: {seed: (f"{suite}{'' if seed == 0 else f'_seed{seed}'}.csv",
                             f"{suite}_sep{'' if seed == 0 else f'_seed{seed}'}.csv") for seed in (0, 1, 2)}
              for suite in ("standard", "distractor_20k")}


@pytest.mark.parametrize("suite", sorted(SEED_FILES))
def test_every_seed_summary_recomputes_from_its_committed_per_seed_files(suite):
    """A reader recomputes <suite>_seeds.csv from the committed per-seed CSVs: means, spreads and t intervals of
    both models' rows and JOIN's gap to SEP (the query-bootstrap columns need the per-query hits, which are not
    committed)."""
    results = ROOT / "docs" / "results"
    rows_by_seed = {}
    for seed, (join_csv, sep_csv) in SEED_FILES[suite].items():
        join = [r for r in report.read_csv(str(results / join_csv)) if r["model"] == "JOIN"]
        sep = [r for r in report.read_csv(str(results / sep_csv)) if r["model"] == "SEP"]
        assert join and sep, f"{suite} seed {seed}: {join_csv} holds no JOIN row or {sep_csv} no SEP row"
        rows_by_seed[seed] = join + sep
    summary = {tuple(str(r[c]) for c in report.SEED_KEY): r for r in report.seed_summary(rows_by_seed)}
    committed = {tuple(str(r[c]) for c in report.SEED_KEY): r
                 for r in report.read_csv(str(results / f"{suite}_seeds.csv"))}
    assert summary.keys() == committed.keys()
    compared = [c for c in report.SEED_COLUMNS
                if re.fullmatch(r"(delta_)?(R@\d+|mR)_(mean|std|min|max|mean_t_lo|mean_t_hi)|"
                                r"gap_(R@\d+|mR)_(mean|welch_lo|welch_hi)", c)]
    for key, row in committed.items():
        for c in compared:
            assert (str(row[c]) == "") == (str(summary[key].get(c, "")) == ""), (key, c)
            if str(row[c]) != "":
                assert float(summary[key][c]) == pytest.approx(float(row[c]), abs=1.5e-3), (key, c)
        assert str(row["gap_against"]) == str(summary[key].get("gap_against", "")), key
        assert summary[key]["fusion"] == row["fusion"] and summary[key]["commit"] == row["commit"], key

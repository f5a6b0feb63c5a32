import numpy as np
import pandas as pd

from benchmarks.demo import compact_table, r1_changes


def _table(t2i, i2t, sep=(2.5, 0.5, 4.5)):
    """Demo table rows: EMB rows, then each reranked row with its paired difference to EMB, (estimate, lo, hi)."""
    rows = [{"model": "JOIN", "mode": "EMB", "direction": d, "R@1": r1} for d, r1 in (("t2i", 20.0), ("i2t", 30.0))]
    for d, (est, lo, hi) in (("t2i", t2i), ("i2t", i2t)):
        rows.append({"model": "JOIN/JOIN", "mode": "JOIN+CO", "direction": d, "R@1": 20.0 + est, "against": "emb",
                     "delta_R@1": est, "delta_R@1_lo": lo, "delta_R@1_hi": hi})
    rows.append({"model": "SEP-BE", "mode": "EMB", "direction": "t2i", "R@1": 10.0})
    rows.append({"model": "SEP-BE/SEP-CE", "mode": "SEP+CO", "direction": "t2i", "R@1": 10.0 + sep[0],
                 "against": "emb", "delta_R@1": sep[0], "delta_R@1_lo": sep[1], "delta_R@1_hi": sep[2]})
    return pd.DataFrame(rows)


def test_r1_changes_says_per_direction_what_the_interval_of_the_difference_says():
    lines = r1_changes(_table((3.1, 1.2, 5.0), (0.4, -1.6, 2.4)))
    assert lines[0] == ("R@1 of JOIN+CO minus EMB (JOIN): t2i R@1 +3.10 [+1.20, +5.00] -> lifts; "
                        "i2t R@1 +0.40 [-1.60, +2.40] -> no significant difference")
    # each reranked row names the bi-encoder its own difference was paired with
    assert lines[1] == "R@1 of SEP+CO minus EMB (SEP-BE): t2i R@1 +2.50 [+0.50, +4.50] -> lifts"


def test_r1_changes_never_decides_from_the_point_estimate():
    # +5 points that the interval does not separate from 0 is no lift; -0.5 with an interval below 0 lowers
    line = r1_changes(_table((5.0, -0.2, 10.2), (-0.5, -0.9, -0.1)))[0]
    assert line.endswith("t2i R@1 +5.00 [-0.20, +10.20] -> no significant difference; "
                         "i2t R@1 -0.50 [-0.90, -0.10] -> lowers")
    # an interval touching 0 is not "entirely above 0"
    assert "-> no significant difference" in r1_changes(_table((2.0, 0.0, 4.0), (1.0, 0.5, 1.5)))[0]
    # a row without an interval of its difference says so instead of guessing
    bare = _table((3.1, 1.2, 5.0), (0.4, -1.6, 2.4)).drop(columns=["delta_R@1_lo"])
    assert "has no interval of its difference to EMB" in r1_changes(bare)[0]


def _metrics_csv(tmp_path, runs):
    """metrics.csv as benchmarks.evaluate accumulates it over several demo runs: [(model, mode, k, t2i R@1,
    i2t R@1)] (a reranked row with its paired difference to EMB, an interval of +-2 points around it), written
    and merged in order, then read back from disk."""
    from benchmarks.evaluate import csv_rows, merge_csv
    from retrieval_core.evaluation.stats import Interval

    table, emb = None, {}
    for model, mode, k, t2i, i2t in runs:
        result = {"mR": 0.0, "t2i_queries": 10, "i2t_queries": 5, "collection_size": 5}
        for d, r1 in (("t2i", t2i), ("i2t", i2t)):
            result.update({f"{d}_R@1": r1, f"{d}_R@5": r1, f"{d}_R@10": r1})
        if mode == "EMB":
            emb[(model, k)] = result
        else:
            base = emb[(model.split("/")[0], k)]
            result["against"] = {"label": "emb"}
            result["delta"] = {key: Interval(result[key] - base[key], result[key] - base[key] - 2,
                                             result[key] - base[key] + 2)
                               for key in [f"{d}_R@{kk}" for d in ("t2i", "i2t") for kk in (1, 5, 10)] + ["mR"]}
        table = merge_csv(table, csv_rows(result, collection="demo", split="test", model=model, mode=mode, k=k,
                                          tags={}), [])
    path = tmp_path / "metrics.csv"
    table.to_csv(path, index=False)
    return pd.read_csv(path)


def test_r1_changes_compares_within_k_across_accumulated_runs(tmp_path):
    table = _metrics_csv(tmp_path, [
        ("JOIN", "EMB", 20, 20.0, 30.0), ("JOIN/JOIN", "JOIN+CO", 20, 25.0, 35.0),  # first run, k=20
        ("SEP-BE", "EMB", 20, 10.0, 12.0),  # an earlier --with-sep run
        ("JOIN", "EMB", 10, 20.0, 30.0), ("JOIN/JOIN", "JOIN+CO", 10, 19.0, 31.0),  # rerun with --k 10
    ])
    # the whole file used to crash r1_changes (EMB of JOIN twice, once per k)
    assert r1_changes(table) == [
        "R@1 of JOIN+CO minus EMB (JOIN, k=20): t2i R@1 +5.00 [+3.00, +7.00] -> lifts; "
        "i2t R@1 +5.00 [+3.00, +7.00] -> lifts",
        "R@1 of JOIN+CO minus EMB (JOIN, k=10): t2i R@1 -1.00 [-3.00, +1.00] -> no significant difference; "
        "i2t R@1 +1.00 [-1.00, +3.00] -> no significant difference"]


def test_r1_changes_counts_a_repeated_configuration_once_using_its_last_row():
    table = pd.concat([_table((3.1, 1.2, 5.0), (0.4, -1.6, 2.4)), _table((1.0, 0.5, 1.5), (1.0, 0.5, 1.5))],
                      ignore_index=True)
    assert r1_changes(table)[0] == "R@1 of JOIN+CO minus EMB (JOIN): t2i R@1 +1.00 [+0.50, +1.50] -> lifts; " \
                                   "i2t R@1 +1.00 [+0.50, +1.50] -> lifts"


def test_the_demo_table_shows_each_recall_with_its_interval():
    table = pd.DataFrame([{"model": "JOIN", "mode": "EMB", "k": 10, "direction": "t2i", "R@1": 45.2, "R@1_lo": 41.0,
                           "R@1_hi": 49.4, "R@5": 80.0, "R@5_lo": 76.5, "R@5_hi": 83.25, "R@10": 90.0,
                           "R@10_lo": np.nan, "R@10_hi": np.nan, "mR": 70.0, "mR_lo": 68.0, "mR_hi": 72.0,
                           "queries": 500, "collection_size": 500}])
    text = compact_table(table)
    assert "45.20 [41.00, 49.40]" in text and "80.00 [76.50, 83.25]" in text and "70.00 [68.00, 72.00]" in text
    assert "90.00" in text and "90.00 [" not in text  # no interval: the recall alone


# ------------------------------------------------------------------------------ benchmarks.report
def test_every_csv_column_is_documented_and_written_beside_the_csv(tmp_path):
    import json

    import pytest

    from benchmarks import report

    for columns in (report.CSV_COLUMNS, report.JOB_COLUMNS):
        assert all(report.COLUMN_DOCS.get(c, "").strip() for c in columns)
    path = report.write_csv(str(tmp_path / "standard.csv"), [{"suite": "standard", "R@1": 12.5}])
    doc = json.loads((tmp_path / "standard.schema.json").read_text())
    assert doc["csv"] == "standard.csv"
    assert [c["name"] for c in doc["columns"]] == list(report.CSV_COLUMNS) == list(report.read_csv(path)[0])
    with pytest.raises(KeyError, match="no description"):
        report.write_csv(str(tmp_path / "x.csv"), [{"undocumented": 1}], columns=("undocumented",))
    assert not (tmp_path / "x.csv").exists()


def _recall_rows():
    rows = []
    for size, coll in ((1000, "synthetic_f30k1k"), (1000, "synthetic_coco5k_1k"), (5000, "synthetic_coco5k"),
                       (20000, "distractor_20k"), (100000, "synthetic_100k")):
        for model in ("JOIN", "SEP"):
            for mode, base in (("EMB", 40.0), ("CO", 55.0)):
                for d in ("t2i", "i2t"):
                    r1 = base - 5 * (len(str(size)) - 4) + (3 if model == "JOIN" else 0) + (5 if d == "i2t" else 0)
                    rows.append({"suite": "x", "collection": coll, "model": model, "mode": mode,
                                 "k": 20 if mode == "CO" else "", "direction": d, "R@1": r1, "R@5": r1 + 10,
                                 "R@10": r1 + 15, "collection_size": size, "measured": True})
    return rows


def test_recall_vs_size_plot_reads_the_suite_csvs(tmp_path):
    import matplotlib.image as mpimg

    from benchmarks import report

    assert report.plot_recall_vs_size_from(str(tmp_path)) is None  # no suite CSV yet: no plot
    rows = _recall_rows()
    report.write_csv(str(tmp_path / "standard.csv"), [r for r in rows if r["collection_size"] <= 5000])
    report.write_csv(str(tmp_path / "scale_100k.csv"), [r for r in rows if r["collection_size"] == 100000])
    png = report.plot_recall_vs_size_from(str(tmp_path))
    assert png == str(tmp_path / "recall_vs_size.png")
    img = mpimg.imread(png)
    assert img.shape[0] > 300 and img.shape[1] > 600 and img.std() > 0.01  # two panels, drawn


def test_k_ablation_plot_ticks_the_measured_k(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import plots

    rows = [{"collection": "synthetic_f30k1k", "model": m, "mode": "CO", "k": k, "direction": d, "R@1": 50 + k / 10,
             "R@5": 70.0, "R@10": 80.0} for m in ("JOIN", "SEP") for k in (10, 20, 50) for d in ("t2i", "i2t")]
    seen = {}
    orig = plots._finish

    def spy(fig, axes, path):
        out = orig(fig, axes, path)
        seen.update({d: ([t.get_text() for t in ax.get_xticklabels()], ax.get_legend()) for d, ax in axes.items()})
        seen["figlegends"] = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
        return out

    plots._finish = spy
    try:
        assert plots.plot_recall_vs_k(rows, str(tmp_path / "k.png")) == str(tmp_path / "k.png")
    finally:
        plots._finish = orig
    for d in ("t2i", "i2t"):
        ticks, legend = seen[d]
        assert ticks == ["10", "20", "50"] and legend is None  # no legend inside a panel
    labels = seen["figlegends"]
    assert len(labels) == len(set(labels)) == 6  # 2 models x 3 metrics, each once (not once per panel)
    assert not any("synthetic_f30k1k" in lab or "t2i" in lab for lab in labels)  # said once, in the titles
    plt.close("all")

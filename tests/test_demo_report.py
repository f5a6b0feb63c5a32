import pandas as pd

from benchmarks.demo import r1_changes


def _table(co_r1_t2i, co_r1_i2t):
    return pd.DataFrame({
        "model": ["JOIN", "JOIN", "JOIN/JOIN", "JOIN/JOIN", "SEP-BE", "SEP-BE/SEP-CE"],
        "mode": ["EMB", "EMB", "JOIN+CO", "JOIN+CO", "EMB", "SEP+CO"],
        "direction": ["t2i", "i2t", "t2i", "i2t", "t2i", "t2i"],
        "R@1": [20.0, 30.0, co_r1_t2i, co_r1_i2t, 10.0, 12.5],
    })


def test_r1_changes_compares_each_rerank_mode_with_emb_of_its_own_bi_encoder():
    lines = r1_changes(_table(25.0, 29.0))
    assert lines[0] == ("R@1 of JOIN+CO minus EMB (JOIN): t2i +5.00, i2t -1.00 points -> "
                        "reranking does NOT lift R@1 in this run")
    # SEP+CO is compared with the SEP bi-encoder's EMB row (10.0), not with the JOIN one (20.0)
    assert lines[1] == "R@1 of SEP+CO minus EMB (SEP-BE): t2i +2.50 points -> reranking lifts R@1"


def test_r1_changes_says_lift_only_when_every_direction_improves():
    assert r1_changes(_table(21.0, 31.0))[0].endswith("-> reranking lifts R@1")


def _metrics_csv(tmp_path, runs):
    """metrics.csv as benchmarks.evaluate accumulates it over several demo runs: [(model, mode, k, t2i R@1,
    i2t R@1)], written and merged in order, then read back from disk."""
    from benchmarks.evaluate import csv_rows, merge_csv

    table = None
    for model, mode, k, t2i, i2t in runs:
        result = {"mR": 0.0, "t2i_queries": 10, "i2t_queries": 5, "collection_size": 5}
        for d, r1 in (("t2i", t2i), ("i2t", i2t)):
            result.update({f"{d}_R@1": r1, f"{d}_R@5": r1, f"{d}_R@10": r1})
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
        "R@1 of JOIN+CO minus EMB (JOIN, k=20): t2i +5.00, i2t +5.00 points -> reranking lifts R@1",
        "R@1 of JOIN+CO minus EMB (JOIN, k=10): t2i -1.00, i2t +1.00 points -> "
        "reranking does NOT lift R@1 in this run"]


def test_r1_changes_counts_a_repeated_configuration_once_using_its_last_row():
    table = pd.concat([_table(25.0, 29.0), _table(21.0, 31.0)], ignore_index=True)
    assert r1_changes(table)[0] == "R@1 of JOIN+CO minus EMB (JOIN): t2i +1.00, i2t +1.00 points -> " \
                                   "reranking lifts R@1"


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

    from benchmarks import report

    rows = [{"collection": "synthetic_f30k1k", "model": m, "mode": "CO", "k": k, "direction": d, "R@1": 50 + k / 10,
             "R@5": 70.0, "R@10": 80.0} for m in ("JOIN", "SEP") for k in (10, 20, 50) for d in ("t2i", "i2t")]
    seen = {}
    orig = report._finish

    def spy(fig, axes, path):
        out = orig(fig, axes, path)
        seen.update({d: ([t.get_text() for t in ax.get_xticklabels()], ax.get_legend()) for d, ax in axes.items()})
        seen["figlegends"] = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
        return out

    report._finish = spy
    try:
        assert report.plot_recall_vs_k(rows, str(tmp_path / "k.png")) == str(tmp_path / "k.png")
    finally:
        report._finish = orig
    for d in ("t2i", "i2t"):
        ticks, legend = seen[d]
        assert ticks == ["10", "20", "50"] and legend is None  # no legend inside a panel
    labels = seen["figlegends"]
    assert len(labels) == len(set(labels)) == 6  # 2 models x 3 metrics, each once (not once per panel)
    assert not any("synthetic_f30k1k" in lab or "t2i" in lab for lab in labels)  # said once, in the titles
    plt.close("all")

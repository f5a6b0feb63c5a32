import pandas as pd

from pipelines.demo import r1_changes


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

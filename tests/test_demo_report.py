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

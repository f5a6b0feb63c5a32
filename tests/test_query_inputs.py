"""Query files in (retrieval_core.search.query): text lines, JSON lines and CSV; empty, duplicate and unreadable
queries rejected with their reason, never dropped (queries in = kept + rejected); the query job's plan refusing a
wrong command line; the staged backbone rebuilt from its description. No model, no Beam: the fast subset."""
from __future__ import annotations

import json

import pytest

from retrieval_core.search.query import (
    R_BAD_LINE,
    R_DUPLICATE,
    R_EMPTY,
    R_UNREADABLE,
    Query,
    QueryError,
    as_queries,
    check_queries,
    read_image_queries,
    read_text_queries,
)


def reasons(rejected):
    return [r.reason.split(":")[0] for r in rejected]


def test_text_file_one_query_per_line_ids_are_line_numbers(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("a red dog\n\n  \na blue car\na red  dog\n", encoding="utf-8")
    kept, rejected = read_text_queries(str(path))
    assert [(q.id, q.text) for q in kept] == [("1", "a red dog"), ("4", "a blue car")]
    assert reasons(rejected) == [R_EMPTY, R_EMPTY, R_DUPLICATE]
    assert rejected[-1].id == "5" and "'1'" in rejected[-1].reason  # names the query it repeats
    assert len(kept) + len(rejected) == 5


def test_jsonl_and_csv_take_id_text_and_lang(tmp_path):
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text("\n".join([json.dumps({"id": "a", "text": "ein roter Hund", "lang": "de"}),
                                json.dumps({"id": "b", "text": "a red dog"}),
                                "{not json",
                                json.dumps({"id": "a", "text": "another text"}),
                                json.dumps({"text": "no id: the line number"}),
                                json.dumps(["a", "list"])]) + "\n", encoding="utf-8")
    kept, rejected = read_text_queries(str(jsonl))
    assert [(q.id, q.text, q.lang) for q in kept] == [("a", "ein roter Hund", "de"), ("b", "a red dog", None),
                                                      ("5", "no id: the line number", None)]
    assert sorted(reasons(rejected)) == sorted([R_BAD_LINE, R_BAD_LINE, R_DUPLICATE])
    assert len(kept) + len(rejected) == 6

    csv = tmp_path / "q.csv"
    csv.write_text('id,text,lang\nx,"a dog, red",en\ny,,\nz,a cat,\n', encoding="utf-8")
    kept, rejected = read_text_queries(str(csv))
    assert [(q.id, q.text, q.lang) for q in kept] == [("x", "a dog, red", "en"), ("z", "a cat", None)]
    assert reasons(rejected) == [R_EMPTY]
    (tmp_path / "bad.csv").write_text("query\nx\n")
    with pytest.raises(QueryError, match="needs a header with a text column"):
        read_text_queries(str(tmp_path / "bad.csv"))
    with pytest.raises(QueryError, match="not found"):
        read_text_queries(str(tmp_path / "missing.txt"))


def test_image_queries_ids_and_pictures(tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("123\n\n123\nphoto_7\n")
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "dog.png").write_bytes(b"not really a png")
    kept, rejected = read_image_queries(str(ids), str(tmp_path / "pics"))
    assert [(q.id, q.image, q.picture) for q in kept] == [("123", "123", False), ("photo_7", "photo_7", False),
                                                          ("dog", str(tmp_path / "pics" / "dog.png"), True)]
    assert reasons(rejected) == [R_EMPTY, R_DUPLICATE]
    assert R_UNREADABLE  # an undecodable picture is rejected where it is decoded (the engine)


def test_queries_given_in_python_get_their_position_as_id():
    qs = as_queries(["a", "b"], "t2i")
    assert [(q.id, q.text, q.direction) for q in qs] == [("0", "a", "t2i"), ("1", "b", "t2i")]
    qs = as_queries([5, "7", Query("mine", image="9")], "i2t")
    assert [(q.id, q.image, q.direction) for q in qs] == [("0", "5", "i2t"), ("1", "7", "i2t"), ("mine", "9", "i2t")]
    with pytest.raises(QueryError, match="not a str"):
        as_queries([3], "t2i")
    kept, rejected = check_queries([Query("1", "x"), Query("1", "y"), Query("2", "x", lang="de")])
    assert [q.id for q in kept] == ["1", "2"] and reasons(rejected) == [R_DUPLICATE]  # same text, other lang: kept


def test_the_job_plan_refuses_a_wrong_command_line(tmp_path):
    from pipelines.query.plan import QueryPlan
    from retrieval_core.errors import UsageFault

    base = dict(staged="s", embeddings="e", output="o")
    with pytest.raises(UsageFault, match="pass one of --queries"):
        QueryPlan(**base)
    with pytest.raises(UsageFault, match="pass one of --queries"):
        QueryPlan(**base, queries="q.txt", images="pics/")
    with pytest.raises(UsageFault, match="--mode auto takes --tune-on"):
        QueryPlan(**base, queries="q.txt", mode="auto")
    with pytest.raises(ValueError, match="--k"):
        QueryPlan(**base, queries="q.txt", k=0)
    plan = QueryPlan(**base, image_ids="ids.txt", mode="NORM_ADD", lam=0.2)
    assert plan.direction == "i2t" and plan.mode == "norm_add"


def test_the_staged_backbone_is_rebuilt_from_its_description():
    from retrieval_core.data.pixels import backbone

    for spec in (backbone.GridSpec(), backbone.GridSpec((3, 7)),
                 backbone.GridSpec((3,), layers=("stage4", "head"), cell_norm="unit", input_size=288)):
        desc = backbone.fingerprint(spec)
        assert backbone.spec_of(desc) == spec and backbone.fingerprint(backbone.spec_of(desc)) == desc
    other = dict(backbone.fingerprint(backbone.GridSpec()), weights_sha256="0" * 64)
    other["fingerprint"] = "f" * 64  # features of other weights: refused, never silently mixed
    with pytest.raises(backbone.FeatureSourceError, match="makes other features"):
        backbone.backbone_for(other)

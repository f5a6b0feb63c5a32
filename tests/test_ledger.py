"""pipelines.ledger: the one resume decision (which shards an earlier run finished) and its records."""
from __future__ import annotations

import ast
import json
import os

import pytest

from pipelines import ledger as ledger_mod
from pipelines.ledger import Ledger, fingerprint, write_or_keep


def _shard(folder, name: str, data: bytes) -> dict:
    os.makedirs(folder, exist_ok=True)
    (folder / name).write_bytes(data)
    import hashlib

    return {"name": name, "rows": 3, "sha256": hashlib.sha256(data).hexdigest()}


def test_the_ledger_module_uses_no_beam_api_itself():
    tree = ast.parse(open(ledger_mod.__file__).read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n and n.startswith("apache_beam")]


def test_fingerprint_is_sha256_of_sorted_json():
    import hashlib

    assert fingerprint({"b": 1, "a": [1, 2]}) == fingerprint({"a": [1, 2], "b": 1})
    assert fingerprint({"a": 1}) == hashlib.sha256(json.dumps({"a": 1}, sort_keys=True).encode()).hexdigest()
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_a_recorded_shard_is_finished_until_anything_it_depends_on_changes(tmp_path):
    shards, records = tmp_path / "rankings", tmp_path / "_progress"
    info = {**_shard(shards, "t2i-00000-of-00001.parquet", b"bytes"), "kind": "shard", "queries": 7}
    ledger = Ledger(str(shards), "fp", records=str(records))
    assert ledger.finished(info["name"]) is None  # no record yet
    ledger.record(info)
    on_disk = json.loads((records / f"{info['name']}.json").read_text())
    assert on_disk == {**info, "plan": "fp"}  # the record as the pipelines always wrote it
    rec = ledger.finished(info["name"], rows=3, queries=7)
    assert rec is not None and rec.info() == info and rec.fingerprint == "fp"
    assert rec.fields("name", "queries") == {"name": info["name"], "queries": 7}
    assert Ledger(str(shards), "other", records=str(records)).finished(info["name"]) is None
    assert ledger.finished(info["name"], rows=4) is None
    assert ledger.finished(info["name"], queries=8) is None
    (shards / info["name"]).write_bytes(b"changed")
    assert ledger.finished(info["name"]) is None
    (shards / info["name"]).write_bytes(b"bytes")
    (records / f"{info['name']}.json").write_text("{not json")
    assert ledger.finished(info["name"]) is None  # a damaged record: redone


def test_a_key_may_be_a_dict_under_another_name_or_a_function_of_the_recorded_one(tmp_path):
    shards, records = tmp_path / "embeddings" / "image", tmp_path / "_completed" / "image"
    info = _shard(shards, "c-00000-of-00001.parquet", b"vectors")
    key = {"model_sha256": "m", "collection": "c"}
    Ledger(str(shards), key, records=str(records), key="key").record(info)
    assert json.loads((records / f"{info['name']}.json").read_text())["key"] == key
    assert Ledger(str(shards), dict(key), records=str(records), key="key").finished(info["name"], rows=3)
    seen = []

    def now(recorded):
        seen.append(recorded)
        return dict(recorded)

    assert Ledger(str(shards), now, records=str(records), key="key").finished(info["name"]) is not None
    assert seen == [key]
    assert Ledger(str(shards), lambda recorded: None, records=str(records), key="key").finished(info["name"]) is None


def test_a_listing_is_kept_only_under_the_fingerprint_it_was_written_under(tmp_path):
    entry = {**_shard(tmp_path / "shards", "c-00000-of-00001.faiss", b"index"), "source": "c.parquet",
             "source_sha256": "s"}
    listing = {"c.parquet": entry}
    same = Ledger.from_listing(str(tmp_path / "shards"), listing, {"factory": "Flat"}, {"factory": "Flat"})
    assert same.finished("c.parquet", source_sha256="s").info() == entry  # the whole entry, kept
    assert same.finished("c.parquet", source_sha256="t") is None
    assert Ledger.from_listing(str(tmp_path / "shards"), listing, {"factory": "Flat"},
                               {"factory": "IVF"}).finished("c.parquet") is None
    assert Ledger.from_listing(str(tmp_path / "shards"), listing, {"factory": "Flat"}, None).finished("c.parquet") \
        is None


@pytest.mark.parametrize("before", [None, b"old bytes", b"new bytes"])
def test_write_or_keep_keeps_a_file_holding_the_bytes_it_would_write(tmp_path, before):
    path = tmp_path / "images" / "c-00000-of-00001.parquet"
    if before is not None:
        path.parent.mkdir()
        path.write_bytes(before)
    sha, kept = write_or_keep(str(path), b"new bytes")
    assert kept == (before == b"new bytes") and path.read_bytes() == b"new bytes"
    assert sha == fingerprint.__globals__["hashlib"].sha256(b"new bytes").hexdigest()

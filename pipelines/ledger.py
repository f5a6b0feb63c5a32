"""The one resume decision of every pipeline: which output shards an earlier run already finished, so a rerun
skips them, and the records that say so.

A shard is finished when its record is present, was written under the same fingerprint (what the shard's bytes
depend on: rerank's plan fingerprint, encode's key), holds the expected row count and other expected values,
and the shard file still matches the record's sha256. The records stay where and as each pipeline has always
written them (a finished run of an earlier version resumes), one JSON file per shard:

- rerank: ``_progress/<shard>.json`` (ranking shards) and ``_candidates/<file>.json`` (search groups), the
  fingerprint under ``"plan"``;
- encode: ``_completed/<modality>/<shard>.json``, the key (a dict) under ``"key"``;

or entries of the previous manifest, all written under one fingerprint (build_index: its shards, keyed by their
source embedding shard, and the trained index). stage keeps no record: a staged shard is a function of its
data, so it is finished when the file already holds the bytes it would be written with (:func:`write_or_keep`).
Below the shards, encode also keeps the pieces a killed run spilled (one per encoded batch) when the rerun's
key is the same (:func:`keep_pieces`).

No Beam transform here: the launchers and the DoFns call it alike. Files are reached through
:mod:`pipelines.files` (Beam FileSystems), so outputs at URLs (gs://) resume like local ones.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from pipelines import files

#: The record key a ledger's fingerprint is stored under unless told otherwise (rerank's records).
PLAN_KEY = "plan"


def fingerprint(obj) -> str:
    """The one fingerprint of a plan: sha256 over its sorted JSON (stable across runs and machines)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard as its record says: its name, rows (None where the record holds none), sha256,
    the fingerprint it was written under, and whatever else the pipeline records (``extra``)."""
    name: str
    rows: Optional[int]
    sha256: str
    fingerprint: Any
    extra: Mapping[str, Any] = field(default_factory=dict)

    def info(self) -> dict:
        """The record as the pipeline wrote it, less the fingerprint: a manifest / run-report entry."""
        rows = {} if self.rows is None else {"rows": self.rows}
        return {"name": self.name, "sha256": self.sha256, **rows, **self.extra}

    def fields(self, *keys: str) -> dict:
        info = self.info()
        return {k: info[k] for k in keys}


#: A ledger's fingerprint: the value a record must hold, or a function of the recorded value giving the value
#: it must hold now (encode's other modalities: the key a record would have today); None never matches.
Expected = Union[Any, Callable[[Any], Any]]


@dataclass(frozen=True)
class Ledger:
    """The finished shards of one folder of shards (``shards``: their folder) and where their records are:
    one JSON file per shard under ``records`` (``<name>.json``), or ``listing`` ({key: record}, the previous
    manifest's entries, all written under ``recorded`` - compared with ``fingerprint`` once, not per record).
    Plain data: pickled into the DoFns that write the records."""
    shards: str
    fingerprint: Expected
    records: Optional[str] = None
    key: str = PLAN_KEY
    listing: Optional[Mapping[str, dict]] = None
    recorded: Any = None

    @classmethod
    def from_listing(cls, shards: str, listing: Mapping[str, dict], fingerprint, recorded) -> "Ledger":
        """Entries of a previous manifest, kept only when it was written under ``fingerprint``."""
        same = recorded is not None and fingerprint is not None and recorded == fingerprint
        return cls(shards, fingerprint, listing=dict(listing) if same else {}, recorded=recorded)

    def record_path(self, name: str) -> str:
        return files.join(self.records, f"{name}.json")

    def shard_path(self, name: str) -> str:
        return files.join(self.shards, name)

    def _read(self, name: str) -> Optional[dict]:
        if self.listing is not None:
            return self.listing.get(name)
        path = self.record_path(name)
        if not files.exists(path):
            return None
        try:
            return files.read_json(path)
        except (OSError, ValueError):
            return None  # a damaged record: the shard is redone

    def _same_fingerprint(self, rec: dict) -> bool:
        if self.listing is not None:
            return True  # checked once, for the whole listing (from_listing)
        have = rec.get(self.key)
        want = self.fingerprint(have) if callable(self.fingerprint) else self.fingerprint
        return have is not None and want is not None and have == want

    def finished(self, name: str, rows: Optional[int] = None, **expect) -> Optional[ShardRecord]:
        """The record of shard ``name`` when an earlier run finished it: written under this fingerprint, with
        ``rows`` rows and the ``expect``ed values (where given), and its file still matching its sha256;
        else None. A listed shard's file is the one its entry names."""
        rec = self._read(name)
        if not isinstance(rec, dict) or not self._same_fingerprint(rec):
            return None
        try:
            if rows is not None and int(rec.get("rows", -1)) != rows:
                return None
        except (TypeError, ValueError):
            return None
        if any(rec.get(k) != v for k, v in expect.items()):
            return None
        if not files.shard_is_valid(self.shard_path(self._file_name(name, rec)), rec.get("sha256")):
            return None
        if self.listing is not None:  # a manifest entry: kept whole
            return ShardRecord(rec.get("name", name), rec.get("rows"), rec["sha256"], self.recorded,
                               {k: v for k, v in rec.items() if k not in ("name", "rows", "sha256")})
        extra = {k: v for k, v in rec.items() if k not in ("name", "rows", "sha256", self.key)}
        return ShardRecord(rec.get("name", name), rec.get("rows"), rec["sha256"], rec.get(self.key), extra)

    def _file_name(self, name: str, rec: dict) -> str:
        """A record file's shard is the one it is named after; a listed entry's the one it names (build_index
        lists its shards by their source embedding shard)."""
        return rec.get("name", name) if self.listing is not None else name

    def record(self, info: Mapping[str, Any]) -> None:
        """After the shard ``info["name"]`` is written: its record, ``info`` with this ledger's fingerprint
        (what a resumed run trusts; a kill between the two only costs a redo)."""
        files.write_json_atomic(self.record_path(info["name"]), {**info, self.key: self.fingerprint})


def write_or_keep(path: str, data: bytes) -> tuple[str, bool]:
    """(sha256, kept): a shard that is a function of its data (stage) is finished when the file already holds
    ``data`` (an earlier run wrote it): kept; else written atomically (missing, corrupt or changed)."""
    sha = files.sha256_bytes(data)
    if files.shard_is_valid(path, sha):
        return sha, True
    files.write_atomic(path, data)
    return sha, False


#: Under a spill folder: the key its pieces were written under and the start times of the runs that wrote them.
PIECES_KEY_FILE = "key.json"


@dataclass(frozen=True)
class KeptPieces:
    """The pieces a killed run of the same key left in a spill folder: per sub-folder, {piece name: mtime}; and
    the seconds the earlier runs spent making them (from each run's start to its last piece)."""
    found: Mapping[str, Mapping[str, float]]
    earlier_s: float


def keep_pieces(spill: str, key: Any, now: float, subdirs: Sequence[str], piece: re.Pattern) -> KeptPieces:
    """Open the spill folder ``spill`` for a run under ``key``: keep the pieces (names matching ``piece`` in
    ``subdirs``) that an interrupted run of the same key left, or delete them all when the key differs or its
    record is damaged. Records this run's start (``now``) beside the key."""
    key_path = files.join(spill, PIECES_KEY_FILE)
    record = None
    if files.exists(key_path):
        try:
            record = files.read_json(key_path)
        except (OSError, ValueError):
            record = None  # a damaged key: nothing under it can be trusted
    if not record or record.get("key") != key:
        files.remove_tree(spill)
        record = {"key": key, "runs": []}
    found = {d: {n: t for n, t in files.list_files(files.join(spill, d)).items() if piece.fullmatch(n)}
             for d in subdirs}  # {name: mtime}; a temp file of a write cut short is no piece
    mtimes = sorted(t for f in found.values() for t in f.values())
    starts = sorted(float(s) for s in record["runs"]) + [now]
    earlier = 0.0
    for start, nxt in zip(starts, starts[1:]):
        inside = [t for t in mtimes if start <= t < nxt]
        earlier += (max(inside) - start) if inside else 0.0
    files.makedirs(spill)
    files.write_json_atomic(key_path, {"key": key, "runs": [*record["runs"], now]})
    return KeptPieces(found, earlier)

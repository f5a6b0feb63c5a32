"""The encode job's plan: the typed options, the output shards of each (modality, collection) and which of them
an earlier run already finished (completion records: a rerun encodes only the others)."""
from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from typing import Optional

import click
import numpy as np

from pipelines import files
from pipelines.ledger import Ledger, keep_pieces
from retrieval_core.cli import (
    CheckedPlan,
    batch_size_option,
    collate_workers_option,
    count_option,
    device_option,
    option,
    quantize_option,
    threads_option,
)
from retrieval_core.data import schema
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.checkpoints import KIND_BASELINE, CheckpointError, ModelFolder, inspect_model_folder
from retrieval_core.precision import QUANTIZE_AUTO, check_quantize, resolve_quantize
from retrieval_core.search import embeddings

MODALITY_CHOICES = (*schema.MODALITIES, "both")
STAGED_ID = {schema.MODALITY_IMAGE: schema.ITEM_ID, schema.MODALITY_TEXT: "caption_id"}
COMPLETED_DIR = "_completed"  # per-shard completion records: what a rerun keeps


class EncodeError(ValueError):
    pass


@dataclass(frozen=True)
class EncodePlan(CheckedPlan):
    """Everything one encode run needs, checked when built."""
    staged: str = option(help="staged directory (pipelines.stage output)")
    model: str = option(help="model folder with a BE head: ours (rr_model.json), MMT-Retrieval (modules.json), "
                             "OSCAR, or a training-free baseline")
    output: str = option(help="embeddings directory")
    modality: str = option("both", type=click.Choice(MODALITY_CHOICES), help="what to encode")
    batch_size: int = batch_size_option(64)
    device: str = device_option()
    collection: Optional[str] = option(None, help="encode only this staged collection")
    split: Optional[str] = option(None, help="encode only this split (e.g. test)")
    images_per_shard: int = count_option(10_000)
    texts_per_shard: int = count_option(50_000)
    model_copies: Optional[int] = count_option(None, help="model copies per worker machine (Dataflow GPU: 1)")
    threads: Optional[int] = threads_option()
    collate_workers: Optional[int] = collate_workers_option()
    quantize: str = quantize_option()  # of the BE; recorded in the embeddings manifest

    def __post_init__(self):
        for name in ("staged", "model", "output"):
            if not getattr(self, name):
                raise EncodeError(f"{name} must be a path, got {getattr(self, name)!r}")
        try:
            super().__post_init__()  # every option's type; --device auto resolved on the launching host
            check_quantize(self.precision, self.device)
        except ValueError as exc:
            raise EncodeError(str(exc)) from None

    @functools.cached_property
    def precision(self) -> str:
        """The serving precision: --quantize with auto resolved (precision.resolve_quantize); the training-free
        baseline (numpy) stays float32."""
        if self.quantize == QUANTIZE_AUTO and self.device.startswith("cuda") \
                and inspect_model_folder(self.model, files=files.BEAM_FILES).kind == KIND_BASELINE:
            return "none"
        return resolve_quantize(self.quantize, self.device)

    @property
    def modalities(self) -> tuple[str, ...]:
        return schema.MODALITIES if self.modality == "both" else (self.modality,)

    def per_shard(self, modality: str) -> int:
        return self.images_per_shard if modality == schema.MODALITY_IMAGE else self.texts_per_shard


def be_model_folder(model_dir: str) -> ModelFolder:
    """The folder's kind, files and fingerprint (retrieval_core.model.checkpoints), refused unless it has a BE head; a
    gs:// folder is read from its local copy."""
    try:
        return inspect_model_folder(model_dir, files=files.BEAM_FILES).require(("be",))
    except CheckpointError as exc:
        raise EncodeError(str(exc)) from None


@dataclass
class ShardPlan:
    """The output shards of one (modality, collection), laid over the staged shards so that the items of one
    staged shard go to one output shard: the encoder reads a staged shard and batches its items per output
    shard, so this keeps batches at --batch-size (with ``item_id % N`` over 2,000 staged shards and 100 output
    shards a caption batch held ~24 captions). Consecutive staged shards are packed into an output shard up to
    ``per_shard`` items; a staged shard larger than that is split k ways by a hash of the id."""
    modality: str
    collection: str
    num_shards: int
    expected_rows: list[int]  # per shard
    key: dict  # what the shards are encoded under: a completion record must match it to be kept
    redo: set[int] = field(default_factory=set)  # shard indices this run (re)writes
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # staged shard -> the output shards of its items

    def name(self, index: int) -> str:
        return files.shard_name(self.collection, index, self.num_shards, ".parquet")

    def shard_of(self, staged: str, item_id: int) -> int:
        out = self.outputs[staged]
        return out[int(split_bins(np.array([item_id]), len(out))[0])] if len(out) > 1 else out[0]


def split_bins(ids: np.ndarray, k: int) -> np.ndarray:
    """Which of k parts each id of a split staged shard goes to: a multiplicative hash, not ``id % k`` (a staged
    shard holds ids of one residue modulo the staged shard count, which ``% k`` would put in one part)."""
    mixed = np.asarray(ids, dtype=np.int64).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # wraps mod 2**64
    return ((mixed >> np.uint64(32)) % np.uint64(k)).astype(np.int64)


def plan_shards(modality: str, collection: str, ids: dict[str, np.ndarray], per_shard: int,
                key: dict) -> Optional[ShardPlan]:
    """``ids``: the item ids of each staged shard, in the staged shards' order."""
    rows: list[int] = []
    outputs: dict[str, tuple[int, ...]] = {}
    open_shard = None  # the output shard consecutive small staged shards are packed into
    for staged, shard_ids in ids.items():
        n = len(shard_ids)
        k = math.ceil(n / per_shard)
        if k > 1:
            outputs[staged] = tuple(range(len(rows), len(rows) + k))
            rows += np.bincount(split_bins(shard_ids, k), minlength=k).tolist()
            open_shard = None
        elif n:
            if open_shard is None or rows[open_shard] + n > per_shard:
                open_shard = len(rows)
                rows.append(0)
            rows[open_shard] += n
            outputs[staged] = (open_shard,)
    if not rows:
        return None
    return ShardPlan(modality, collection, len(rows), [int(c) for c in rows],
                     dict(key, num_shards=len(rows), per_shard=per_shard),
                     {i for i, c in enumerate(rows) if c}, outputs)


def staged_ids(ds: StagedDataset, modality: str, collection: str, split: Optional[str]) -> dict[str, np.ndarray]:
    """Ids of one modality of a collection per staged shard, read one id column per shard (no features, no
    text)."""
    col = STAGED_ID[modality]
    return {rel: ds.read_shard_columns(rel, (col,), split).column(col).to_numpy().astype(np.int64)
            for rel in ds.shard_names(schema.STAGED_KIND[modality], collection)}


def completion_ledger(output: str, modality: str, key) -> Ledger:
    """One modality's embedding shards and their completion records, <output>/_completed/<modality>/<shard>.json,
    each holding the shard's name, rows, sha256 and the ``key`` it was encoded under."""
    return Ledger(files.join(output, embeddings.EMBEDDINGS_SUBDIR, modality), key,
                  records=files.join(output, COMPLETED_DIR, modality), key="key")


def keep_finished(output: str, plans: dict[tuple[str, str], ShardPlan]) -> tuple[dict, dict[str, list[dict]]]:
    """The plans less every shard an earlier run finished (the ledger: a completion record with this plan's key
    and row count, a file matching its checksum), and the finished shards' manifest entries per modality."""
    keep: dict[str, list[dict]] = {}
    todo = {}
    for mc, plan in plans.items():
        ledger = completion_ledger(output, plan.modality, plan.key)
        done = set()
        for i in sorted(plan.redo):
            rec = ledger.finished(plan.name(i), rows=plan.expected_rows[i])
            if rec is not None:
                done.add(i)
                keep.setdefault(plan.modality, []).append(rec.fields("name", "rows", "sha256"))
        todo[mc] = replace(plan, redo=plan.redo - done)
    return todo, keep


def keep_other_modalities(output: str, old: Optional[dict], planned: tuple[str, ...], model_sha: str, dim: int,
                          current_key) -> dict[str, list[dict]]:
    """Shards of modalities this run does not encode (e.g. --modality image now, text from an earlier run):
    kept in the manifest when each is finished in the ledger under the key its record would have today (the
    current model and staged inputs) with the manifest's sha256; the whole modality is dropped otherwise
    (never a partial one)."""
    keep: dict[str, list[dict]] = {}
    if not old or old.get("model", {}).get("sha256") != model_sha or int(old.get("dim", -1)) != dim:
        return keep
    for modality, entry in old.get("modalities", {}).items():
        if modality in planned:
            continue
        ledger = completion_ledger(output, modality, functools.partial(_key_now, current_key, modality))
        ok = []
        for s in entry.get("shards", []):
            if ledger.finished(s["name"], sha256=s["sha256"]) is None:
                ok = None
                break
            ok.append({k: s[k] for k in ("name", "rows", "sha256")})
        if ok:
            keep[modality] = ok
    return keep


def _key_now(current_key, modality: str, recorded) -> Optional[dict]:
    return current_key(modality, recorded) if isinstance(recorded, dict) else None


# ------------------------------------------------------------------------------- resuming spill pieces
PIECE_NAME = re.compile(r"[0-9a-f]{20}-[0-9]+\.parquet")


def spill_key(plans: dict[tuple[str, str], ShardPlan], batch_size: int) -> dict:
    """What a spill piece's bytes depend on: the shards' keys (model, staged bytes, split, precision, shard
    count) and the batch size (a piece is one batch, cut after sorting by length)."""
    return {"batch_size": batch_size, "shards": {f"{m}/{c}": p.key for (m, c), p in sorted(plans.items())}}


def piece_name(collection: str, tag: str, rows: int) -> str:
    """One encoded batch's spill file name: the batch's identity and the rows it holds (a batch with
    dead-lettered items holds fewer, so a rerun encodes it again: the failed items are retried)."""
    digest = hashlib.sha1(f"{collection}\0{tag}".encode("utf-8")).hexdigest()[:20]
    return f"{digest}-{rows}.parquet"


def piece_rows(name: str) -> int:
    return int(name.rsplit("-", 1)[1].split(".", 1)[0])


@dataclass
class SpillResume:
    """The spill pieces an interrupted run of the same key left: per modality, the piece names (what
    :func:`piece_name` gives a whole batch); their rows; the encoding seconds the earlier runs spent."""
    pieces: dict[str, frozenset] = field(default_factory=dict)
    rows: int = 0
    earlier_s: float = 0.0

    def to_json(self) -> dict:
        return {"items": self.rows, "pieces": sum(len(v) for v in self.pieces.values()),
                "earlier_runs_s": round(self.earlier_s, 1)}


def keep_spilled(output: str, key: dict, now: float) -> SpillResume:
    """Open this run's spill folder (ledger.keep_pieces): keep the pieces a killed run of the same ``key`` left
    (a rerun skips their batches), or delete them when the key differs (another model, staged set, split,
    precision or batch size)."""
    kept = keep_pieces(files.join(output, files.SPILL_DIR), key, now, schema.MODALITIES, PIECE_NAME)
    rows = sum(piece_rows(n) for f in kept.found.values() for n in f)
    return SpillResume({m: frozenset(f) for m, f in kept.found.items() if f}, rows, kept.earlier_s)

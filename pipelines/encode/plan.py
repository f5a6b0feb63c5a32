"""The encode job's plan: the typed options, the output shards of each (modality, collection) and which of them
an earlier run already finished (completion records: a rerun encodes only the others)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import click
import numpy as np

from pipelines import files
from retrieval_core.cli import (
    batch_size_option,
    check_choice,
    check_device,
    check_positive,
    device_option,
    option,
    threads_option,
)
from retrieval_core.data import schema
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.checkpoints import CheckpointError, ModelFolder, inspect_model_folder
from retrieval_core.search import embeddings

MODALITY_CHOICES = (*schema.MODALITIES, "both")
STAGED_ID = {schema.MODALITY_IMAGE: schema.ITEM_ID, schema.MODALITY_TEXT: "caption_id"}
COMPLETED_DIR = "_completed"  # per-shard completion records: what a rerun keeps


class EncodeError(ValueError):
    pass


@dataclass(frozen=True)
class EncodePlan:
    """Everything one encode run needs, validated when built."""
    staged: str = option(help="staged directory (pipelines.stage output)")
    model: str = option(help="model folder with a BE head: ours (rr_model.json), MMT-Retrieval (modules.json), "
                             "OSCAR, or a training-free baseline")
    output: str = option(help="embeddings directory")
    modality: str = option("both", type=click.Choice(MODALITY_CHOICES), help="what to encode")
    batch_size: int = batch_size_option(64)
    device: str = device_option()
    collection: Optional[str] = option(None, help="encode only this staged collection")
    split: Optional[str] = option(None, help="encode only this split (e.g. test)")
    images_per_shard: int = option(10_000, type=click.IntRange(min=1))
    texts_per_shard: int = option(50_000, type=click.IntRange(min=1))
    model_copies: Optional[int] = option(None, type=click.IntRange(min=1),
                                         help="model copies per worker machine (Dataflow GPU: 1)")
    threads: Optional[int] = threads_option()
    quantize: str = option(schema.QUANTIZE_AUTO, type=click.Choice((schema.QUANTIZE_AUTO,) + schema.QUANTIZE_CHOICES),
                           help="auto: bf16 on a CUDA device with native bf16, none elsewhere; int8: dynamic int8 "
                                "Linear layers of the BE (CPU only); bf16: a bfloat16 copy of the weights (CUDA, or a "
                                "CPU with native bf16). Recorded in the embeddings manifest.")

    def __post_init__(self):
        for name in ("staged", "model", "output"):
            if not getattr(self, name):
                raise EncodeError(f"{name} must be a path, got {getattr(self, name)!r}")
        try:
            check_choice("modality", self.modality, MODALITY_CHOICES)
            object.__setattr__(self, "device", check_device(self.device))
            for name in ("batch_size", "images_per_shard", "texts_per_shard"):
                check_positive(name, getattr(self, name))
            for name in ("model_copies", "threads"):
                check_positive(name, getattr(self, name), allow_none=True)
            schema.check_quantize(self.precision, self.device)
        except ValueError as exc:
            raise EncodeError(str(exc)) from None

    @functools.cached_property
    def precision(self) -> str:
        """The serving precision: --quantize with auto resolved (schema.resolve_quantize); the training-free
        baseline (numpy) stays float32."""
        if self.quantize != schema.QUANTIZE_AUTO or not self.device.startswith("cuda"):
            return schema.resolve_quantize(self.quantize, self.device, cuda_bf16=False)
        from retrieval_core.model.checkpoints import KIND_BASELINE
        from retrieval_core.model.quantize import cuda_bf16_supported
        if inspect_model_folder(self.model, files=files.BEAM_FILES).kind == KIND_BASELINE:
            return "none"
        return schema.resolve_quantize(self.quantize, self.device, cuda_bf16_supported())

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
    """The output shards of one (modality, collection): N shards, item i goes to shard item_id % N."""
    modality: str
    collection: str
    num_shards: int
    expected_rows: list[int]  # per shard
    key: dict  # what the shards are encoded under: a completion record must match it to be kept
    redo: set[int] = field(default_factory=set)  # shard indices this run (re)writes

    def name(self, index: int) -> str:
        return files.shard_name(self.collection, index, self.num_shards, ".parquet")

    def shard_of(self, item_id: int) -> int:
        return int(item_id) % self.num_shards


def plan_shards(modality: str, collection: str, ids: np.ndarray, per_shard: int, key: dict) -> Optional[ShardPlan]:
    if len(ids) == 0:
        return None
    n = max(1, math.ceil(len(ids) / per_shard))
    counts = np.bincount(np.asarray(ids, dtype=np.int64) % n, minlength=n)
    return ShardPlan(modality, collection, n, [int(c) for c in counts], dict(key, num_shards=n),
                     {i for i in range(n) if counts[i]})


def staged_ids(ds: StagedDataset, modality: str, collection: str, split: Optional[str]) -> np.ndarray:
    """Ids of one modality of a collection, read one id column per staged shard (no features, no text)."""
    col = STAGED_ID[modality]
    parts = [ds.read_shard_columns(rel, (col,), split).column(col).to_numpy().astype(np.int64)
             for rel in ds.shard_names(schema.STAGED_KIND[modality], collection)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def record_path(output: str, modality: str, name: str) -> str:
    return files.join(output, COMPLETED_DIR, modality, f"{name}.json")


def _read_record(output: str, modality: str, name: str) -> Optional[dict]:
    path = record_path(output, modality, name)
    if not files.exists(path):
        return None
    try:
        return files.read_json(path)
    except (OSError, ValueError):
        return None  # a damaged record: the shard is redone


def keep_finished(output: str, plans: list[ShardPlan]) -> dict[str, list[dict]]:
    """Drops from ``redo`` every shard an earlier run finished (completion record with this plan's key and
    row count, file matching its checksum); returns their manifest entries per modality."""
    keep: dict[str, list[dict]] = {}
    for plan in plans:
        for i in sorted(plan.redo):
            rec = _read_record(output, plan.modality, plan.name(i))
            path = files.join(output, embeddings.shard_relpath(plan.modality, plan.name(i)))
            if rec and rec.get("key") == plan.key and int(rec.get("rows", -1)) == plan.expected_rows[i] \
                    and files.shard_is_valid(path, rec.get("sha256")):
                plan.redo.discard(i)
                keep.setdefault(plan.modality, []).append({k: rec[k] for k in ("name", "rows", "sha256")})
    return keep


def keep_other_modalities(output: str, old: Optional[dict], planned: tuple[str, ...], model_sha: str, dim: int,
                          current_key) -> dict[str, list[dict]]:
    """Shards of modalities this run does not encode (e.g. --modality image now, text from an earlier run):
    kept in the manifest when each still has a completion record matching the current model and staged
    inputs, and its file matches; the whole modality is dropped otherwise (never a partial one)."""
    keep: dict[str, list[dict]] = {}
    if not old or old.get("model", {}).get("sha256") != model_sha or int(old.get("dim", -1)) != dim:
        return keep
    for modality, entry in old.get("modalities", {}).items():
        if modality in planned:
            continue
        ok = []
        for s in entry.get("shards", []):
            rec = _read_record(output, modality, s["name"])
            path = files.join(output, embeddings.shard_relpath(modality, s["name"]))
            if not rec or not isinstance(rec.get("key"), dict) or rec.get("sha256") != s["sha256"] \
                    or rec["key"] != current_key(modality, rec["key"]) or not files.shard_is_valid(path, s["sha256"]):
                ok = None
                break
            ok.append({k: s[k] for k in ("name", "rows", "sha256")})
        if ok:
            keep[modality] = ok
    return keep



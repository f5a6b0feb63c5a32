"""Stage a data manifest into checksummed shards: ``python -m pipelines.stage --manifest demo --output DIR``.

Graph (all collections in one pipeline)::

    Create(read tasks) -> Reshuffle -> ParDo(read + stage_image/stage_caption; features -> task spill file)
        images   -> key (collection, item_id % num_shards) -> GroupByKey -> dedupe + read back the features
                    of the kept rows from the spill files + write shard -> staged ids
        captions -> CoGroupByKey(image_item_id, staged ids) -> key by shard -> GroupByKey -> write shard
        rejects  -> GroupByKey(collection, kind) -> rejects/<collection>-{images,captions}.jsonl
        ids      -> GroupByKey(item_id) -> hash collisions across collections and kinds
        counts + shard infos + reject infos -> one run-info JSON that the launcher turns into summary.json

Duplicates of an image land in the same shard (the shard is a function of item_id), so the shard writer
decides them (the copy with the smallest locator wins).

Features never travel through a shuffle: each read task writes its regions once to a spill file
(``<output>/_spill/<run>/``, HDF5, the output dtype) and the image rows that are grouped carry only metadata
and a pointer into it (``staging.FeatureSpill``). Beam's local runners keep a GroupByKey in memory, so
shuffling the features put the whole collection in RAM (100k synthetic images: killed at 24 GB); now a
worker holds one task's write buffer and one shard. The spill directory is removed when the run ends.
num_shards = ceil(count / --images-per-shard), count = expected_images (or a synthetic num_images), else the number of
images that passed validation.

Runner note: with ``--direct_running_mode=multi_processing`` and 500-image read tasks, Beam 2.77 was seen to
drop a contiguous run of one task's outputs (89 of 5,000 demo images); 100-image tasks avoided it, so that mode
defaults to ``--chunk-size 100``. The launcher also checks ``records_in == staged + rejected`` per source and
exits non-zero when it does not hold, so a lossy run can never pass silently. The default in-memory
DirectRunner lost nothing.

Resume: the shard contents are only known after reading every input, so a rerun recomputes all shards but
rewrites only those whose bytes differ from the file on disk (missing, corrupt or changed); every write is
temp-name + rename, so a killed run never leaves a partial file under a final name.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional

import apache_beam as beam
import click
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from pipelines import common
from retrieval_core import schema, staging
from retrieval_core.paths import is_url

log = logging.getLogger("pipelines.stage")

IMAGES_DIR, FEATURES_DIR, CAPTIONS_DIR, REJECTS_DIR = "images", "features", "captions", "rejects"
RUN_INFO = "_stage_run_info.json"
SPILL_DIR = "_spill"


@dataclass(frozen=True)
class Settings:
    """Everything the DoFns need (picklable, no manifest object)."""
    output: str
    feature_dim: int
    max_regions: int
    feature_format: str
    feature_dtype: str
    images_per_shard: int
    expected_images: dict = field(default_factory=dict)  # collection -> count known up front (or absent)
    spill_dir: str = ""  # where read tasks spill features (run_stage sets <output>/_spill/<run id>)

    def num_shards(self, collection: str, counts: dict) -> int:
        count = self.expected_images.get(collection) or counts.get(collection, 0)
        return staging.num_shards_for(count, self.images_per_shard)


def shard_rel(kind_dir: str, collection: str, index: int, total: int, suffix: str) -> str:
    return f"{kind_dir}/{common.shard_name(collection, index, total, suffix)}"


def write_or_keep(path: str, data: bytes) -> tuple[str, bool]:
    """(sha256, kept): keep the file when its bytes already equal ``data`` (a finished earlier run), else
    write it atomically (missing, corrupt or changed)."""
    sha = common.sha256_bytes(data)
    if common.shard_is_valid(path, sha):
        return sha, True
    common.write_atomic(path, data)
    return sha, False


def _task_source(task) -> str:
    path = getattr(task, "path", None)
    return str(path) if path else f"{task.collection}:{task.format}"


def _reject_out(collection: str, rej: schema.Reject) -> tuple[str, dict]:
    return collection, rej.to_dict()


class _TaskSpill:
    """A read task's spill file: written locally (in place for a local output, else in a temp folder and
    uploaded on close), published under its final name only when complete, so a retried task overwrites."""

    def __init__(self, spill_dir: str, task, feature_dim: int, feature_dtype: str):
        import hashlib
        import tempfile

        key = hashlib.sha1(repr((task.collection, task.kind, _task_source(task), task.start, task.stop))
                           .encode("utf-8")).hexdigest()[:16]
        self.final = common.join(spill_dir, f"{task.collection}-{key}.h5")
        if not is_url(self.final):
            common.makedirs(spill_dir)
            self.local = f"{self.final}.tmp-{uuid.uuid4().hex[:12]}"
        else:
            self.local = tempfile.mkstemp(suffix=".h5")[1]
        self.spill = staging.FeatureSpill(self.local, self.final, feature_dim, feature_dtype)

    def close(self) -> None:
        import os
        import shutil

        self.spill.close()
        if not is_url(self.final):
            os.replace(self.local, self.final)
            return
        tmp = f"{self.final}.tmp-{uuid.uuid4().hex[:12]}"
        with open(self.local, "rb") as src, FileSystems.create(tmp) as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if FileSystems.exists(self.final):
            FileSystems.delete([self.final])
        FileSystems.rename([tmp], [self.final])
        os.remove(self.local)


@contextlib.contextmanager
def _open_spill(name: str):
    import h5py

    if not is_url(name):
        with h5py.File(name, "r") as f:
            yield f
    else:  # h5py reads the few chunks it needs through the seekable FileSystems stream (not yet run on GCS)
        with FileSystems.open(name, compression_type=CompressionTypes.UNCOMPRESSED) as raw, h5py.File(raw, "r") as f:
            yield f


def _remove_spill(output: str) -> None:
    """Delete <output>/_spill (this run's spill files, or those a killed run left behind)."""
    root = common.join(output, SPILL_DIR)
    if not is_url(root):
        import shutil
        shutil.rmtree(root, ignore_errors=True)
        return
    found = [m.path for m in FileSystems.match([common.join(root, "**")])[0].metadata_list]
    if found:
        FileSystems.delete(found)


# ------------------------------------------------------------------------------------- read + stage
class ReadAndStage(beam.DoFn):
    """One read task -> staged rows (main: images; tagged: captions, rejects, counts)."""

    def __init__(self, settings: Settings):
        self.s = settings

    def setup(self):
        from retrieval_core import readers  # noqa: F401 (imported once per worker)
        self._records = {k: Metrics.counter("stage", f"{k}_records_in") for k in ("image", "caption")}
        self._staged = {k: Metrics.counter("stage", f"{k}_staged_valid") for k in ("image", "caption")}
        self._rejected = {k: Metrics.counter("stage", f"{k}_rejected") for k in ("image", "caption")}

    def process(self, task):
        from retrieval_core.readers import read_task

        coll, source = task.collection, _task_source(task)
        kind = schema.KIND_CAPTION if task.kind in ("caption", "captions") else schema.KIND_IMAGE
        n_in = 0
        spill = None
        for rec in read_task(task, files=common.BEAM_FILES):  # inputs may be gs:// on any worker
            n_in += 1
            if isinstance(rec, schema.RawImage):
                out = staging.stage_image(rec, collection=coll, feature_dim=self.s.feature_dim,
                                          max_regions=self.s.max_regions, source=source)
            elif isinstance(rec, schema.RawCaption):
                out = staging.stage_caption(rec, collection=coll, source=source)
            elif isinstance(rec, schema.Reject):
                out = rec
                out.kind = kind  # the reader's kind default may not match the task
            else:
                out = schema.Reject(source, "?", f"reader yielded {type(rec).__name__}", kind)
            if isinstance(out, schema.Reject):
                self._rejected[kind].inc()
                yield beam.pvalue.TaggedOutput("rejects", _reject_out(coll, out))
            elif kind == schema.KIND_IMAGE:
                self._staged[kind].inc()
                if self.s.spill_dir:
                    if spill is None:
                        spill = _TaskSpill(self.s.spill_dir, task, self.s.feature_dim, self.s.feature_dtype)
                    out = spill.spill.append(out)
                yield out
            else:
                self._staged[kind].inc()
                yield beam.pvalue.TaggedOutput("captions", out)
        if spill is not None:
            spill.close()  # before this bundle commits, i.e. before any shard writer can read it
        self._records[kind].inc(n_in)
        log.info("read %s %s task %s: %d records", coll, kind, getattr(task, "start", None) or source, n_in)
        yield beam.pvalue.TaggedOutput("info", {"type": "in", "collection": coll, "kind": kind, "n": n_in})


# ----------------------------------------------------------------------------------------- shards
def _key_image(row, s: Settings, counts: dict):
    n = s.num_shards(row["collection"], counts)
    return (row["collection"], int(row["item_id"]) % n), row


def _shard_markers(collection: str, s: Settings, counts: dict):
    """One empty element per shard, so that every shard file exists even if no row hashes to it."""
    for i in range(s.num_shards(collection, counts)):
        yield (collection, i), None


class WriteImageShard(beam.DoFn):
    """(collection, shard index), rows -> dedupe, encode, write (or keep) the shard; emits shard info,
    staged ids (item_id, (collection, split)) and rejects."""

    def __init__(self, settings: Settings):
        self.s = settings

    def process(self, element, counts):
        (coll, idx), values = element
        total = self.s.num_shards(coll, counts)
        rows, rejects = staging.resolve_duplicates(v for v in values if v is not None)
        for rej in rejects:
            yield beam.pvalue.TaggedOutput("rejects", _reject_out(coll, rej))
        rows = staging.load_spilled(rows, _open_spill)  # features of the kept rows only
        info = {"type": "shard", "collection": coll, "kind": "images", "index": idx, "total": total,
                "rows": len(rows), "cap": dict(Counter(r[staging.K_CAP_POLICY] for r in rows
                                                    if r[staging.K_CAP_POLICY]))}
        name = shard_rel(IMAGES_DIR, coll, idx, total, ".parquet")
        if self.s.feature_format == "hdf5":
            h5_name = shard_rel(FEATURES_DIR, coll, idx, total, ".h5")
            h5, meta = staging.image_shard_hdf5(rows, self.s.feature_dtype, feature_dim=self.s.feature_dim,
                                                feature_shard=h5_name)
            sha, kept = write_or_keep(common.join(self.s.output, h5_name), h5)
            info["feature_shard"] = {"name": h5_name, "rows": len(rows), "sha256": sha, "kept": kept,
                                     "bytes": len(h5)}
            data = meta
        else:
            data = staging.image_shard_parquet(rows, self.s.feature_dim, self.s.feature_dtype)
        sha, kept = write_or_keep(common.join(self.s.output, name), data)
        info.update(name=name, sha256=sha, kept=kept, bytes=len(data))
        log.info("%s %s: %d images (%s)", "kept" if kept else "wrote", name, len(rows),
                 "unchanged" if kept else f"{len(data) / 1e6:.1f} MB")
        Metrics.counter("stage", "image_shards_written" if not kept else "image_shards_kept").inc()
        for r in rows:
            yield beam.pvalue.TaggedOutput("staged_ids", (int(r["item_id"]), (coll, r["split"])))
        yield info


def _join_captions(element, s: Settings, counts: dict):
    """image_item_id, {captions, image} -> keyed caption rows, or rejects for captions of unknown images."""
    image_item_id, grouped = element
    images = list(grouped["image"])
    for row in grouped["captions"]:
        coll = row["collection"]
        if not images:
            image_src = row["source_id"].rsplit("#", 1)[0]
            yield beam.pvalue.TaggedOutput("rejects", _reject_out(coll, staging.unknown_image_reject(row, image_src)))
            continue
        if row["split"] is None:
            row = dict(row, split=images[0][1])  # a caption inherits its image's split
        yield (coll, image_item_id % s.num_shards(coll, counts)), row


class WriteCaptionShard(beam.DoFn):
    def __init__(self, settings: Settings):
        self.s = settings

    def process(self, element, counts):
        (coll, idx), values = element
        total = self.s.num_shards(coll, counts)
        rows, rejects = staging.resolve_duplicates((v for v in values if v is not None), id_key="caption_id")
        for rej in rejects:
            yield beam.pvalue.TaggedOutput("rejects", _reject_out(coll, rej))
        name = shard_rel(CAPTIONS_DIR, coll, idx, total, ".parquet")
        data = staging.caption_shard_parquet(rows)
        sha, kept = write_or_keep(common.join(self.s.output, name), data)
        log.info("%s %s: %d captions", "kept" if kept else "wrote", name, len(rows))
        Metrics.counter("stage", "caption_shards_written" if not kept else "caption_shards_kept").inc()
        yield {"type": "shard", "collection": coll, "kind": "captions", "index": idx, "total": total,
               "rows": len(rows), "name": name, "sha256": sha, "kept": kept, "bytes": len(data)}


def _write_rejects(element, output: str):
    (coll, kind), rejects = element
    rejects = sorted(rejects, key=lambda r: (staging._natural_key(str(r["source"])),
                                             staging._natural_key(str(r["locator"])), r["reason"]))
    name = f"{REJECTS_DIR}/{coll}-{'captions' if kind == schema.KIND_CAPTION else 'images'}.jsonl"
    common.write_jsonl_atomic(common.join(output, name), rejects)
    yield {"type": "rejects", "collection": coll, "kind": kind, "name": name,
           "reasons": dict(Counter(staging.reason_category(r["reason"]) for r in rejects))}


def _collisions(element):
    item_id, owners = element
    found = staging.find_id_collisions((item_id, tuple(o)) for o in owners)
    for c in found:
        yield {"type": "collision", **c}


def _write_run_info(infos: list, path: str):
    common.write_json_atomic(path, infos)


# --------------------------------------------------------------------------------------- the graph
def build_graph(p: beam.Pipeline, tasks: list, settings: Settings, collections: list[str], run_info_path: str):
    staged = (p
              | "ReadTasks" >> beam.Create(tasks, reshuffle=False)
              | "Spread" >> beam.Reshuffle()
              | "ReadAndStage" >> beam.ParDo(ReadAndStage(settings)).with_outputs(
                  "captions", "rejects", "info", main="images"))
    images, captions = staged.images, staged.captions

    if all(c in settings.expected_images for c in collections):
        counts = {}  # shard counts known up front: keying fuses with staging (no buffering of the features)
    else:  # count the images that passed validation (Beam then buffers them until the count is known)
        counts = beam.pvalue.AsDict(
            images
            | "ImageCollection" >> beam.Map(lambda r: (r["collection"], 1))
            | "CountImages" >> beam.CombinePerKey(sum))
    names = p | "Collections" >> beam.Create(collections)

    image_markers = names | "ImageShardKeys" >> beam.FlatMap(_shard_markers, settings, counts)
    keyed_images = images | "KeyImages" >> beam.Map(_key_image, settings, counts)
    image_shards = ((keyed_images, image_markers)
                    | "FlattenImages" >> beam.Flatten()
                    | "GroupImageShards" >> beam.GroupByKey()
                    | "WriteImageShards" >> beam.ParDo(WriteImageShard(settings), counts).with_outputs(
                        "staged_ids", "rejects", main="info"))

    joined = ({"captions": captions | "ByImage" >> beam.Map(lambda r: (int(r["image_item_id"]), r)),
               "image": image_shards.staged_ids}
              | "JoinCaptions" >> beam.CoGroupByKey()
              | "CaptionsOfStagedImages" >> beam.FlatMap(_join_captions, settings, counts).with_outputs(
                  "rejects", main="keyed"))
    caption_markers = names | "CaptionShardKeys" >> beam.FlatMap(_shard_markers, settings, counts)
    caption_info = ((joined.keyed, caption_markers)
                    | "FlattenCaptions" >> beam.Flatten()
                    | "GroupCaptionShards" >> beam.GroupByKey()
                    | "WriteCaptionShards" >> beam.ParDo(WriteCaptionShard(settings), counts).with_outputs(
                        "rejects", main="info"))

    reject_info = ((staged.rejects, image_shards.rejects, joined.rejects, caption_info.rejects)
                   | "FlattenRejects" >> beam.Flatten()
                   | "KeyRejects" >> beam.Map(lambda cr: ((cr[0], cr[1]["kind"]), cr[1]))
                   | "GroupRejects" >> beam.GroupByKey()
                   | "WriteRejects" >> beam.FlatMap(_write_rejects, settings.output))

    image_owners = images | "ImageOwners" >> beam.Map(
        lambda r: (int(r["item_id"]), (r["collection"], schema.KIND_IMAGE, r["source_id"])))
    caption_owners = captions | "CaptionOwners" >> beam.Map(
        lambda r: (int(r["caption_id"]), (r["collection"], schema.KIND_CAPTION, r["source_id"])))
    collision_info = ((image_owners, caption_owners)
                      | "FlattenOwners" >> beam.Flatten()
                      | "DistinctOwners" >> beam.Distinct()
                      | "GroupOwners" >> beam.GroupByKey()
                      | "Collisions" >> beam.FlatMap(_collisions))

    _ = ((staged.info, image_shards.info, caption_info.info, reject_info, collision_info)
         | "FlattenInfo" >> beam.Flatten()
         | "AllInfo" >> beam.combiners.ToList()
         | "WriteRunInfo" >> beam.Map(_write_run_info, run_info_path))


# ------------------------------------------------------------------------------------------ summary
def build_summary(manifest, settings: Settings, infos: list, options: dict, elapsed_s: float) -> dict:
    colls = {}
    for name, spec in manifest.collections.items():
        c = {"role": getattr(spec, "role", None)}
        for kind, key, src, expected in (
                (schema.KIND_IMAGE, "images", spec.images, getattr(spec, "expected_images", None)),
                (schema.KIND_CAPTION, "captions", spec.captions, getattr(spec, "expected_captions", None))):
            mine = [i for i in infos if i.get("collection") == name]
            shards = [i for i in mine if i["type"] == "shard" and i["kind"] == key]
            rej = [i for i in mine if i["type"] == "rejects" and i["kind"] == kind]
            reasons = Counter()
            for r in rej:
                reasons.update(r["reasons"])
            cap = None
            feature_shards = None
            if kind == schema.KIND_IMAGE:
                by_policy = Counter()
                for s in shards:
                    by_policy.update(s.get("cap", {}))
                cap = staging.cap_summary(settings.max_regions, by_policy)
                if settings.feature_format == "hdf5":
                    feature_shards = [dict(s["feature_shard"]) for s in shards if "feature_shard" in s]
            c[key] = staging.source_summary(
                fmt=getattr(src, "format", None) if src else None, path=str(getattr(src, "path", "")) if src else "",
                records_in=sum(i["n"] for i in mine if i["type"] == "in" and i["kind"] == kind),
                staged=sum(s["rows"] for s in shards), rejects=reasons,
                shards=[{k: s[k] for k in ("name", "rows", "sha256", "kept", "bytes")} for s in shards],
                expected=expected, rejects_file=f"{REJECTS_DIR}/{name}-{key}.jsonl",
                region_cap=cap, feature_shards=feature_shards)
        c["num_shards"] = len(c["images"]["shards"])
        colls[name] = c
    all_shards = [s for c in colls.values() for k in ("images", "captions") for s in
                  c[k]["shards"] + c[k].get("feature_shards", [])]
    return {
        "complete": True,
        "schema_version": schema.SCHEMA_VERSION,
        "manifest": {"name": manifest.name, "path": str(getattr(manifest, "path", ""))},
        "benchmark": getattr(manifest, "benchmark", None),
        "feature_dim": settings.feature_dim,
        "feature_format": settings.feature_format,
        "feature_dtype": settings.feature_dtype,
        "max_regions": settings.max_regions,
        "options": options,
        "collections": colls,
        "id_collisions": [i for i in infos if i["type"] == "collision"],
        "resume": {"kept": sum(1 for s in all_shards if s["kept"]),
                   "written": sum(1 for s in all_shards if not s["kept"])},
        "elapsed_s": round(elapsed_s, 2),
    }


def _remove_stale(output: str, collections: Iterable[str], keep: set[str]) -> int:
    """Delete shard files of these collections that this run did not produce (an earlier run with another
    shard count) and temp files left by killed runs."""
    stale = []
    for coll in collections:
        ours = re.compile(rf"^{re.escape(coll)}-\d{{5}}-of-\d{{5}}\.(parquet|h5)(\.tmp-[0-9a-f]+)?$")
        for d in (IMAGES_DIR, FEATURES_DIR, CAPTIONS_DIR):
            for m in FileSystems.match([common.join(output, d, f"{coll}-*")])[0].metadata_list:
                base = m.path.replace("\\", "/").rsplit("/", 1)[-1]
                if ours.match(base) and f"{d}/{base}" not in keep:
                    stale.append(m.path)
    if stale:
        FileSystems.delete(stale)
    return len(stale)


def _ensure_reject_files(output: str, summary: dict) -> None:
    for c in summary["collections"].values():
        for key in ("images", "captions"):
            path = common.join(output, c[key]["rejects_file"])
            if not common.exists(path):
                common.write_jsonl_atomic(path, [])


# ----------------------------------------------------------------------------------------- launcher
class StageError(Exception):
    """A user-facing error: printed as one message, exit status 2."""


def planned_images(manifest) -> dict[str, int]:
    """Image counts known before reading: expected_images, or num_images of a synthetic collection."""
    out = {}
    for name, c in manifest.collections.items():
        if getattr(c, "expected_images", None):
            out[name] = int(c.expected_images)
        elif c.images.format == "synthetic" and c.images.options.get("num_images"):
            out[name] = int(c.images.options["num_images"])
    return out


def default_chunk_size(beam_args) -> int:
    """Records per read task: 100 under the multi-processing DirectRunner (which dropped outputs of 500-record
    tasks, module doc), else 500."""
    words = [w for a in beam_args for w in a.split("=", 1)]
    multi = any(a == "--direct_running_mode" and b == "multi_processing" for a, b in zip(words, words[1:]))
    return 100 if multi else 500


def plan_tasks(manifest, chunk_size: int = 500) -> list:
    from retrieval_core.readers import plan_read_tasks

    tasks = []
    for name, spec in manifest.collections.items():
        for kind, src in (("image", spec.images), ("caption", spec.captions)):
            if src is None:
                continue
            tasks += plan_read_tasks(name, kind, src.format, src.path, dict(src.options or {}),
                                     manifest.feature_dim, chunk_size=chunk_size, files=common.BEAM_FILES)
    return tasks


def run_stage(manifest_ref: str, output: str, *, overrides=(), feature_format=None, feature_dtype=None,
              max_regions=None, images_per_shard=500, max_reject_fraction=0.01, beam_args=(),
              chunk_size: int = 500) -> tuple[dict, list[str]]:
    """Run the staging pipeline; returns (summary, problems). Raises StageError for bad input."""
    from retrieval_core.manifest import ManifestError, load_manifest

    t0 = time.time()
    try:
        manifest = load_manifest(manifest_ref, overrides=tuple(overrides))
    except ManifestError as exc:
        raise StageError(f"invalid manifest {manifest_ref!r}: {exc}") from None
    except FileNotFoundError as exc:
        raise StageError(f"manifest {manifest_ref!r} not found: {exc}") from None
    options = common.pipeline_options(beam_args)
    # Planning lists gs:// inputs before the Pipeline exists: give FileSystems the options (project,
    # credentials) now; beam.Pipeline(options=...) sets the same ones again.
    FileSystems.set_options(options)
    try:
        missing = manifest.missing_paths(files=common.BEAM_FILES)
    except (OSError, ValueError) as exc:  # e.g. gs:// without apache-beam[gcp]: Beam's message says what to install
        raise StageError(f"cannot check the input paths: {exc}") from None
    if missing:
        raise StageError("input file(s) missing: " + ", ".join(map(str, missing))
                         + " (fix the manifest or override the path with --set / environment variables)")
    settings = Settings(
        output=output,
        feature_dim=int(manifest.feature_dim),
        max_regions=int(max_regions or getattr(manifest, "max_regions", None) or schema.DEFAULT_MAX_REGIONS),
        feature_format=feature_format or getattr(manifest, "feature_format", None) or "parquet",
        feature_dtype=feature_dtype or getattr(manifest, "feature_dtype", None) or "float32",
        images_per_shard=int(images_per_shard),
        expected_images=planned_images(manifest),
        spill_dir=common.join(output, SPILL_DIR, uuid.uuid4().hex[:12]),
    )
    if settings.feature_format not in ("parquet", "hdf5"):
        raise StageError(f"feature format must be parquet or hdf5, got {settings.feature_format!r}")
    if settings.feature_dtype not in ("float32", "float16"):
        raise StageError(f"feature dtype must be float32 or float16, got {settings.feature_dtype!r}")
    try:
        tasks = plan_tasks(manifest, chunk_size)
    except (OSError, ValueError) as exc:  # OSError: also Beam's BeamIOError listing a bucket
        raise StageError(f"cannot plan the reads: {exc}") from None
    collections = sorted(manifest.collections)
    common.makedirs(output)
    run_info = common.join(output, f"{RUN_INFO}.{uuid.uuid4().hex[:8]}")
    log.info("staging %s: %d collections, %d read tasks -> %s (%s, %s)", manifest.name, len(collections),
             len(tasks), output, settings.feature_format, settings.feature_dtype)

    p = beam.Pipeline(options=options)
    build_graph(p, tasks, settings, collections, run_info)
    _remove_spill(output)  # spill files of a killed earlier run
    try:
        result = p.run()
        result.wait_until_finish()
        infos = common.read_json(run_info)
    finally:
        _remove_spill(output)
        if common.exists(run_info):
            FileSystems.delete([run_info])

    summary = build_summary(manifest, settings, infos, {
        "images_per_shard": settings.images_per_shard, "max_reject_fraction": max_reject_fraction,
        "overrides": list(overrides), "beam_args": list(beam_args), "read_tasks": len(tasks),
    }, time.time() - t0)
    keep = {s["name"] for c in summary["collections"].values() for k in ("images", "captions")
            for s in c[k]["shards"] + c[k].get("feature_shards", [])}
    summary["resume"]["stale_removed"] = _remove_stale(output, collections, keep)
    _ensure_reject_files(output, summary)

    problems = []
    for name, c in summary["collections"].items():
        for key in ("images", "captions"):
            src = c[key]
            if src["records_in"] != src["staged"] + src["rejected"]:
                problems.append(f"{name} {key}: {src['records_in']} records in but {src['staged']} staged + "
                                f"{src['rejected']} rejected: records were lost by the runner")
            frac = src["rejected"] / max(src["records_in"], 1)
            if frac > max_reject_fraction:
                problems.append(f"{name} {key}: {src['rejected']} of {src['records_in']} records rejected "
                                f"({frac:.1%} > --max-reject-fraction {max_reject_fraction:.1%}); "
                                f"see {common.join(output, src['rejects_file'])}")
    if summary["id_collisions"]:
        problems.append(f"{len(summary['id_collisions'])} item_id hash collision(s); see summary.json")
    summary["problems"] = problems
    summary["elapsed_s"] = round(time.time() - t0, 2)
    common.write_json_atomic(common.join(output, staging.SUMMARY_FILE), summary)
    return summary, problems


def report_lines(summary: dict) -> list[str]:
    lines = []
    for name, c in summary["collections"].items():
        for key in ("images", "captions"):
            src = c[key]
            lines.append(staging.in_equals_line(f"{name} {key}", src)
                         + (f"  [{', '.join(f'{k}: {v}' for k, v in src['reject_reasons'].items())}]"
                            if src["reject_reasons"] else ""))
            for w in src["warnings"]:
                lines.append(f"  warning: {w}")
        cap = c["images"]["region_cap"]
        how = {"confidence": "kept the most confident", "stored_order": "kept the first in stored order",
               "mixed": "most confident where confidences exist, else stored order"}.get(cap["policy"], "")
        lines.append(f"{name} region cap {cap['max_regions']}: {cap['capped_images']} images capped"
                     + (f" ({how}: {cap['by_policy']})" if cap["capped_images"] else ""))
    r = summary["resume"]
    lines.append(f"shards: {r['written']} written, {r['kept']} kept unchanged"
                 + (f", {r['stale_removed']} stale removed" if r.get("stale_removed") else ""))
    lines.append(f"staged in {summary['elapsed_s']:.1f} s")
    return lines


@click.command(context_settings=common.BEAM_CLI_CONTEXT)
@click.option("--manifest", "manifest_ref", default="demo", show_default=True,
              help="Manifest name (data_manifests/<name>.yaml) or path to a YAML file.")
@click.option("--output", required=True, help="Staged directory to write (local path or gs://).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Manifest override, e.g. --set collections.coco.images.path=/data/coco.tsv (repeatable).")
@click.option("--feature-format", type=click.Choice(["parquet", "hdf5"]), default=None,
              help="Where features go: inline in Parquet, or HDF5 shards beside Parquet meta [manifest's].")
@click.option("--feature-dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="On-disk feature dtype [manifest's].")
@click.option("--max-regions", type=click.IntRange(min=1), default=None, help="Region cap per image [manifest's, 50].")
@click.option("--images-per-shard", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--max-reject-fraction", type=click.FloatRange(0, 1), default=0.01, show_default=True,
              help="Exit non-zero (after writing summary + rejects) if more of any source is rejected.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Records per read task for index-addressable sources (synthetic) "
                   "[500; 100 with --direct_running_mode=multi_processing, see the module doc].")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging and full tracebacks.")
@click.pass_context
def main(ctx, manifest_ref, output, overrides, feature_format, feature_dtype, max_regions, images_per_shard,
         max_reject_fraction, chunk_size, verbose):
    """Validate, normalise and shard a data manifest's images and captions.

    Unknown options go to Beam, e.g. --direct_running_mode=multi_processing --direct_num_workers=2, or
    --runner=DataflowRunner --project=... --temp_location=gs://...
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Beam resets the root level to WARNING while it runs: give our logger its own level (shard progress)
    logging.getLogger("pipelines").setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("apache_beam", "h5py"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        summary, problems = run_stage(
            manifest_ref, output, overrides=overrides, feature_format=feature_format, feature_dtype=feature_dtype,
            max_regions=max_regions, images_per_shard=images_per_shard, max_reject_fraction=max_reject_fraction,
            beam_args=ctx.args, chunk_size=chunk_size or default_chunk_size(ctx.args))
    except StageError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 -- one clear line instead of a Beam traceback
        if verbose:
            raise
        msg = str(exc).strip().splitlines()
        click.echo(f"error: staging failed: {type(exc).__name__}: {msg[-1] if msg else ''} "
                   f"(rerun with -v for the traceback)", err=True)
        sys.exit(1)
    for line in report_lines(summary):
        click.echo(line)
    click.echo(f"summary: {common.join(output, staging.SUMMARY_FILE)}")
    if problems:
        for p in problems:
            click.echo(f"error: {p}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()

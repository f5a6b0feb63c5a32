"""Stage a data manifest into checksummed shards: ``python -m pipelines.stage --manifest demo --output DIR``.

Graph (all collections in one pipeline; every step has one output, elements tagged (tag, payload))::

    Create(read tasks) -> Reshuffle -> ReadAndStage: read + stage_image/stage_caption; every staged row (and an
        image's regions) goes to the task's spill file; emits refs (spill key, id, row number) per id bucket
    image refs   -> join the collection's shard count on (collection, item_id % 64) -> key (collection,
                 item_id % num_shards) -> GroupByKey -> read the rows back, dedupe, read the kept rows' regions
                 -> write shard -> its staged (item_id, split) list
    caption refs -> (bucketed by their image's id) the same join -> key (collection, image_item_id %
                 num_shards) -> CoGroupByKey with the image shard of that index -> read the rows back, reject
                 those whose image was not staged, dedupe -> write shard
    rejects      -> GroupByKey(collection, kind) -> rejects/<collection>-{images,captions}.jsonl
    owners       -> (item_id, collection, kind, source_id) per id bucket -> GroupByKey -> hash collisions
    counts + shard infos + reject infos -> common.WriteRunReport, which the launcher turns into summary.json

No side inputs and no tagged outputs: the same graph runs on DirectRunner, DaskRunner (byte-identical shards,
rejects and summary but for timings and the runner: shard contents are sorted and keyed by id, never by
bundle) and Dataflow. On DaskRunner the read tasks form DASK_READ_PARTITIONS (4) dask partitions unless
--dask_npartitions/--dask_partition_size are given. On a Dask cluster of several machines the output (and its
spill folder) must be on a file system every worker sees.

Duplicates of an image land in the same shard (the shard is a function of item_id), so the shard writer
decides them (the copy with the smallest locator wins); a caption's shard is its image's.

Memory: rows never travel through a shuffle. Beam's local runners keep a GroupByKey's whole input in
memory: shuffling the features put the whole collection in RAM (100k synthetic images: killed at 24 GB), and
shuffling the staged rows without them still grew the stager by ~7 KB per image and caption (0.7 GB at 20k
images). Each read task writes its rows (JSON, one HDF5 vlen string each) and regions once to a spill file
(``<output>/_spill/<run>/``, ``staging.FeatureSpill``); the shuffles carry ~20-byte refs and the owner tuples
of the collision check. A worker holds one task's write buffer and one shard. The spill directory is removed
when the run ends.

num_shards = ceil(count / --images-per-shard), count = a synthetic collection's num_images, else the number of
images that passed validation (a file source's expected_images is only checked).

Runner note: with ``--direct_running_mode=multi_processing`` and 500-image read tasks, Beam 2.77 was seen to
drop a contiguous run of one task's outputs (89 of 5,000 demo images); 100-image tasks avoided it, so that mode
defaults to ``--chunk-size 100``. The launcher also checks ``records_in == staged + rejected`` per source and
exits non-zero when it does not hold, so a lossy run can never pass silently. The default in-memory
DirectRunner lost nothing.

Resume: the shard contents are only known after reading every input, so a rerun recomputes all shards but
rewrites only those whose bytes differ from the file on disk (missing, corrupt or changed); every write is
temp-name + rename, so a killed run never leaves a partial file under a final name. ``<output>/_INCOMPLETE``
(run id, start time) is written before the first shard can be replaced and removed only after summary.json:
a folder holding it is mid-run or from a killed run, and readers refuse it.

Empty sources: a collection's images or captions source that yields no records fails the run (after
writing), naming the source, unless --allow-empty.

``uncaptioned_images: skip``: a read task of such a collection's images first reads the collection's caption
source (once per worker process, ``readers.caption_image_splits``) and stages only the images a caption names,
each in its captions' split, before any feature is spilled; the others are counted as skipped
(``records_in = staged + rejected + skipped``). No side input: the captions are small beside the features.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
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
#: Present while a run may be replacing shards (run id, start time); removed after summary.json is written.
INCOMPLETE_FILE = "_INCOMPLETE"
SPILL_DIR = common.SPILL_DIR
#: Dask partitions the read tasks are cut into, unless --dask_npartitions/--dask_partition_size say otherwise.
DASK_READ_PARTITIONS = 4


@dataclass(frozen=True)
class Settings:
    """Everything the DoFns need (picklable, no manifest object)."""
    output: str
    feature_dim: int
    max_regions: int
    feature_format: str
    feature_dtype: str
    images_per_shard: int
    expected_images: dict = field(default_factory=dict)  # collection -> count known up front (synthetic only)
    spill_dir: str = ""  # where read tasks spill features (run_stage sets <output>/_spill/<run id>)
    #: collection -> its caption source (format, path, options) for ``uncaptioned_images: skip``: only the images
    #: those captions name are staged, each in its captions' split
    caption_filters: dict = field(default_factory=dict)

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


def spill_path(spill_dir: str, collection: str, key: int) -> str:
    """The spill file of one read task (``key``: from the task's identity, so a retried task overwrites)."""
    return common.join(spill_dir, f"{collection}-{key:016x}.h5")


class _TaskSpill:
    """A read task's spill file: written locally (in place for a local output, else in a temp folder and
    uploaded on close), published under its final name only when complete, so a retried task overwrites."""

    def __init__(self, spill_dir: str, task, feature_dim: int, feature_dtype: str):
        import hashlib
        import tempfile

        digest = hashlib.sha1(repr((task.collection, task.kind, _task_source(task), task.start, task.stop))
                              .encode("utf-8")).hexdigest()[:16]
        self.key = int(digest, 16)  # what a ref carries instead of the path (spill_path rebuilds it)
        self.final = spill_path(spill_dir, task.collection, self.key)
        if not is_url(self.final):
            common.makedirs(spill_dir)
            self.local = f"{self.final}.tmp-{uuid.uuid4().hex[:12]}"
        else:
            self.local = tempfile.mkstemp(suffix=".h5")[1]
        self.spill = staging.FeatureSpill(self.local, self.final, feature_dim, feature_dtype)

    def close(self) -> None:
        import os

        self.spill.close()
        if not is_url(self.final):
            # h5py writes the file in place (it seeks back), which Beam FileSystems' write-only streams cannot
            # do: a local spill keeps its own temp name + os.replace.
            os.replace(self.local, self.final)
            return
        with open(self.local, "rb") as src:
            common.write_atomic_stream(self.final, src)
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


# ------------------------------------------------------------------------------------- read + stage
# Every step has ONE output: an element is (tag, payload) and the next steps pick their tag (DaskRunner does
# not separate tagged outputs). Rows never travel through a shuffle (Beam's local runners keep a shuffle's
# whole input in memory): a read task spills them, and the shuffles carry refs (spill key, id, row number),
# ~20 bytes each. Tags:
T_IMAGE_REFS, T_CAPTION_REFS, T_COUNT, T_OWNERS = "image_refs", "caption_refs", "count", "owners"
T_REJECT, T_INFO, T_STAGED = "reject", "info", "staged"
#: Refs are grouped by (collection, id % ID_BUCKETS) on their way to their shard, where they meet the
#: collection's shard count (a join, never a side input); ids are checked for collisions per bucket.
ID_BUCKETS = 64


def pick(element, tag: str):
    """The payloads of one tag from a (tag, payload) PCollection."""
    if element[0] == tag:
        yield element[1]


def pick_all(elements, tag: str) -> list:
    """:func:`pick` over a list of (tag, payload) elements (a DoFn's outputs, in tests and tools)."""
    return [payload for t, payload in elements if t == tag]


class ReadAndStage(beam.DoFn):
    """One read task -> (tag, payload). Its staged rows (and an image's regions) go to the task's spill file;
    it emits per id bucket T_IMAGE_REFS / T_CAPTION_REFS ((collection, bucket), [(spill key, id, row)]) --
    captions bucketed by their image's id, the shard they will join --, T_OWNERS (bucket, [(id, collection,
    kind, source_id)]) for the collision check, T_REJECT (collection, reject dict), and T_INFO (records in)
    and T_COUNT (collection, images staged) once each."""

    def __init__(self, settings: Settings):
        if not settings.spill_dir:
            raise ValueError("ReadAndStage needs Settings.spill_dir: staged rows are spilled, never shuffled")
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
        n_in = n_staged = skipped = 0
        spill = None
        refs: dict[int, list] = {}
        owners: dict[int, list] = {}
        # uncaptioned_images: skip -- the images the collection's captions name, and their split, known before
        # any feature is spilled (a 123k-image trainval TSV staged for the 5k test split spills 5k images)
        splits = _caption_splits(coll, self.s.caption_filters[coll]) \
            if kind == schema.KIND_IMAGE and coll in self.s.caption_filters else None
        # allow_empty: an empty source is judged by the launcher from records_in (find_problems, one line,
        # --allow-empty), not by a reader exception inside a worker (a Beam traceback).
        for rec in read_task(task, files=common.BEAM_FILES, allow_empty=True):  # inputs may be gs:// anywhere
            n_in += 1
            if splits is not None and isinstance(rec, schema.RawImage):
                rec = staging.with_caption_split(rec, splits.get(rec.source_id), source)
                if rec is None:
                    skipped += 1
                    continue
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
                yield T_REJECT, _reject_out(coll, out)
                continue
            self._staged[kind].inc()
            n_staged += 1
            if spill is None:
                spill = _TaskSpill(self.s.spill_dir, task, self.s.feature_dim, self.s.feature_dtype)
            if kind == schema.KIND_IMAGE:
                own_id = shard_id = int(out["item_id"])
                row = spill.spill.add_row(spill.spill.append(out))  # regions, then the row pointing to them
            else:
                own_id, shard_id = int(out["caption_id"]), int(out["image_item_id"])
                row = spill.spill.add_row(out)
            refs.setdefault(shard_id % ID_BUCKETS, []).append((spill.key, shard_id, row))
            owners.setdefault(own_id % ID_BUCKETS, []).append((own_id, coll, kind, str(out["source_id"])))
        if spill is not None:
            spill.close()  # before this bundle commits, i.e. before any shard writer can read it
        tag = T_IMAGE_REFS if kind == schema.KIND_IMAGE else T_CAPTION_REFS
        for bucket in sorted(refs):
            yield tag, ((coll, bucket), refs[bucket])
        for bucket in sorted(owners):
            yield T_OWNERS, (bucket, owners[bucket])
        self._records[kind].inc(n_in)
        common.Progress.advance(1)  # read tasks done (the launcher's bar, when this runs in its process)
        log.info("read %s %s task %s: %d records", coll, kind, getattr(task, "start", None) or source, n_in)
        info = {"type": "in", "collection": coll, "kind": kind, "n": n_in}
        if splits is not None:
            info["skipped"] = skipped
        yield T_INFO, info
        if kind == schema.KIND_IMAGE:
            yield T_COUNT, (coll, n_staged)


@functools.lru_cache(maxsize=8)
def _caption_splits(collection: str, source: tuple) -> dict:
    """{image source id: its captions' splits} of a caption source (format, path, frozen options), read once per
    worker process (a collection's image files are read by several tasks)."""
    from retrieval_core.readers import caption_image_splits

    fmt, path, options = source
    # allow_empty: an empty caption source fails the run from its own read task (find_problems), in one line
    return caption_image_splits(collection, fmt, list(path) if isinstance(path, tuple) else path, dict(options),
                                files=common.BEAM_FILES, allow_empty=True)


# ----------------------------------------------------------------------------------------- shards
def shard_counts(counts, collections: list[str], settings: Settings):
    """(collection, number of image shards) for every collection: from a synthetic collection's planned
    count, else from the images that passed validation (T_COUNT per read task; at least one shard each)."""
    zeros = counts.pipeline | "NoImages" >> beam.Create([(c, 0) for c in collections])
    counted = counts | "UnplannedCounts" >> beam.Filter(lambda cn, planned: cn[0] not in planned,
                                                        dict(settings.expected_images))
    return ((zeros, counted) | "FlattenCounts" >> beam.Flatten() | "CountImages" >> beam.CombinePerKey(sum)
            | "NumShards" >> beam.MapTuple(lambda c, n: (c, settings.num_shards(c, {c: n}))))


def _count_buckets(element):
    coll, total = element
    for b in range(ID_BUCKETS):
        yield (coll, b), total


def _image_shard_markers(element):
    """One marker per shard, so that every shard file exists even if no row hashes to it."""
    coll, total = element
    for i in range(total):
        yield (coll, i), (total, None)


def _route_refs(element):
    """((collection, bucket), {refs: [[(spill key, id, row)]], total: [shard count]}) -> one
    ((collection, shard), (total, refs)) per shard the bucket's refs go to (shard = id % total)."""
    (coll, _bucket), grouped = element
    total = list(grouped["total"])[0]
    by_shard: dict[int, list] = {}
    for block in grouped["refs"]:
        for ref in block:
            by_shard.setdefault(ref[1] % total, []).append(tuple(ref))
    for shard in sorted(by_shard):
        yield (coll, shard), (total, by_shard[shard])


def _load_rows(settings: Settings, coll: str, refs) -> list[dict]:
    """The spilled rows the refs [(spill key, id, row)] name (each task's file opened once)."""
    return staging.load_spilled_rows(((spill_path(settings.spill_dir, coll, key), row) for key, _, row in refs),
                                     _open_spill)


class WriteImageShard(beam.DoFn):
    """((collection, shard index), [(total, refs or None)]) -> read the rows, dedupe, read back the regions of
    the kept ones, encode, write (or keep) the shard; emits (tag, payload): T_INFO shard info, T_REJECT, and
    T_STAGED ((collection, shard index), (total, [(item_id, split)])) for the caption shard of the same
    index (every shard emits it, empty or not)."""

    def __init__(self, settings: Settings):
        self.s = settings

    def process(self, element):
        (coll, idx), values = element
        values = list(values)
        total = values[0][0]
        refs = sorted(ref for _, block in values if block for ref in block)
        rows, rejects = staging.resolve_duplicates(_load_rows(self.s, coll, refs))
        for rej in rejects:
            yield T_REJECT, _reject_out(coll, rej)
        rows = staging.load_spilled(rows, _open_spill)  # features of the kept rows only
        info = {"type": "shard", "collection": coll, "kind": "images", "index": idx, "total": total,
                "rows": len(rows), "cap": dict(Counter(r[staging.K_CAP_POLICY] for r in rows
                                                    if r[staging.K_CAP_POLICY])),
                "splits": staging.split_counts(rows)}
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
        yield T_STAGED, ((coll, idx), (total, sorted((int(r["item_id"]), r["split"]) for r in rows)))
        yield T_INFO, info


class WriteCaptionShard(beam.DoFn):
    """((collection, shard index), {captions: [(total, refs)], staged: [(total, [(item_id, split)])]}) ->
    (tag, payload): T_INFO, T_REJECT. A caption whose image is not in the image shard of the same index (the
    shard its image would be in) is rejected; one without a split inherits its image's."""

    def __init__(self, settings: Settings):
        self.s = settings

    def process(self, element):
        (coll, idx), grouped = element
        staged = list(grouped["staged"])
        if len(staged) != 1:
            raise RuntimeError(f"caption shard {coll}/{idx}: {len(staged)} image shards of that index")
        total, image_split = staged[0][0], dict(staged[0][1])
        refs = sorted(ref for _, block in grouped["captions"] for ref in block)
        joined = []
        for row in _load_rows(self.s, coll, refs):
            image_id = int(row["image_item_id"])
            if image_id not in image_split:
                image_src = row["source_id"].rsplit("#", 1)[0]
                yield T_REJECT, _reject_out(coll, staging.unknown_image_reject(row, image_src))
                continue
            if row["split"] is None:
                row = dict(row, split=image_split[image_id])  # a caption inherits its image's split
            joined.append(row)
        rows, rejects = staging.resolve_duplicates(joined, id_key="caption_id")
        for rej in rejects:
            yield T_REJECT, _reject_out(coll, rej)
        name = shard_rel(CAPTIONS_DIR, coll, idx, total, ".parquet")
        data = staging.caption_shard_parquet(rows)
        sha, kept = write_or_keep(common.join(self.s.output, name), data)
        log.info("%s %s: %d captions", "kept" if kept else "wrote", name, len(rows))
        Metrics.counter("stage", "caption_shards_written" if not kept else "caption_shards_kept").inc()
        yield T_INFO, {"type": "shard", "collection": coll, "kind": "captions", "index": idx, "total": total,
                       "rows": len(rows), "name": name, "sha256": sha, "kept": kept, "bytes": len(data),
                       "splits": staging.split_counts(rows)}


def _write_rejects(element, output: str):
    (coll, kind), rejects = element
    rejects = sorted(rejects, key=lambda r: (staging._natural_key(str(r["source"])),
                                             staging._natural_key(str(r["locator"])), r["reason"]))
    name = f"{REJECTS_DIR}/{coll}-{'captions' if kind == schema.KIND_CAPTION else 'images'}.jsonl"
    common.write_jsonl_atomic(common.join(output, name), rejects)
    yield {"type": "rejects", "collection": coll, "kind": kind, "name": name,
           "reasons": dict(Counter(staging.reason_category(r["reason"]) for r in rejects))}


def _collisions(element):
    """(bucket, [[(id, collection, kind, source_id)]]) -> a collision record per id claimed by more than one
    (collection, kind, source_id); duplicates of one record are not collisions (the writers dedupe them)."""
    _bucket, blocks = element
    owners: dict[int, set] = {}
    for block in blocks:
        for item_id, coll, kind, source_id in block:
            owners.setdefault(int(item_id), set()).add((coll, kind, source_id))
    claimed = ((i, tuple(o)) for i in sorted(owners) if len(owners[i]) > 1 for o in sorted(owners[i]))
    for c in staging.find_id_collisions(claimed):
        yield {"type": "collision", **c}


# --------------------------------------------------------------------------------------- the graph
def build_graph(p: beam.Pipeline, tasks: list, settings: Settings, collections: list[str]) -> None:
    """The staging graph; it ends in common.WriteRunReport (<output>/_run/report.json), which every write feeds."""
    staged = (p
              | "ReadTasks" >> beam.Create(tasks, reshuffle=False)
              | "Spread" >> beam.Reshuffle()
              | "ReadAndStage" >> beam.ParDo(ReadAndStage(settings)))
    counts = shard_counts(staged | "ImageCounts" >> beam.FlatMap(pick, T_COUNT), collections, settings)
    bucket_totals = counts | "CountPerBucket" >> beam.FlatMap(_count_buckets)

    image_shards = (({"refs": staged | "ImageRefs" >> beam.FlatMap(pick, T_IMAGE_REFS), "total": bucket_totals}
                     | "JoinShardCounts" >> beam.CoGroupByKey()
                     | "KeyImages" >> beam.FlatMap(_route_refs),
                     counts | "ImageShardKeys" >> beam.FlatMap(_image_shard_markers))
                    | "FlattenImages" >> beam.Flatten()
                    | "GroupImageShards" >> beam.GroupByKey()
                    | "WriteImageShards" >> beam.ParDo(WriteImageShard(settings)))

    keyed_captions = ({"refs": staged | "CaptionRefs" >> beam.FlatMap(pick, T_CAPTION_REFS),
                       "total": bucket_totals}
                      | "JoinCaptionCounts" >> beam.CoGroupByKey()
                      | "KeyCaptions" >> beam.FlatMap(_route_refs))
    caption_shards = ({"captions": keyed_captions,
                       "staged": image_shards | "StagedIds" >> beam.FlatMap(pick, T_STAGED)}
                      | "JoinCaptionShards" >> beam.CoGroupByKey()
                      | "WriteCaptionShards" >> beam.ParDo(WriteCaptionShard(settings)))

    reject_info = ((staged | "ReadRejects" >> beam.FlatMap(pick, T_REJECT),
                    image_shards | "ImageRejects" >> beam.FlatMap(pick, T_REJECT),
                    caption_shards | "CaptionRejects" >> beam.FlatMap(pick, T_REJECT))
                   | "FlattenRejects" >> beam.Flatten()
                   | "KeyRejects" >> beam.Map(lambda cr: ((cr[0], cr[1]["kind"]), cr[1]))
                   | "GroupRejects" >> beam.GroupByKey()
                   | "WriteRejects" >> beam.FlatMap(_write_rejects, settings.output))

    collision_info = (staged | "Owners" >> beam.FlatMap(pick, T_OWNERS)
                      | "GroupOwners" >> beam.GroupByKey()
                      | "Collisions" >> beam.FlatMap(_collisions))

    common.WriteRunReport.apply([staged | "ReadInfo" >> beam.FlatMap(pick, T_INFO),
                                 image_shards | "ImageShardInfo" >> beam.FlatMap(pick, T_INFO),
                                 caption_shards | "CaptionShardInfo" >> beam.FlatMap(pick, T_INFO),
                                 reject_info, collision_info], settings.output)


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
            reasons, by_split = Counter(), Counter()
            for r in rej:
                reasons.update(r["reasons"])
            for sh in shards:
                by_split.update(sh.get("splits", {}))
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
                region_cap=cap, feature_shards=feature_shards,
                skipped=sum(i.get("skipped", 0) for i in mine if i["type"] == "in" and i["kind"] == kind),
                staged_by_split=dict(by_split), expected_key=f"{name}.expected_{key}")
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


FEATURE_FORMATS = ("parquet", "hdf5")
FEATURE_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class StagePlan:
    """Everything one staging run needs, validated when built. None = the manifest's value."""
    output: str
    manifest: str = "demo"  # a data_manifests/<name>.yaml name or a YAML path
    overrides: tuple[str, ...] = ()  # KEY=VALUE manifest overrides
    feature_format: Optional[str] = None  # parquet | hdf5
    feature_dtype: Optional[str] = None  # float32 | float16
    max_regions: Optional[int] = None
    images_per_shard: int = 500
    max_reject_fraction: float = 0.01
    chunk_size: Optional[int] = None  # records per read task; None: default_chunk_size(beam_args)
    allow_empty: bool = False  # a source that yields no records is an error unless set

    def __post_init__(self):
        if not self.output:
            raise StageError(f"output must be a path, got {self.output!r}")
        if not self.manifest:
            raise StageError("manifest must be a name or a path")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        for o in self.overrides:
            if "=" not in o:
                raise StageError(f"manifest override {o!r} is not KEY=VALUE")
        try:
            if self.feature_format is not None:
                common.check_choice("feature format", self.feature_format, FEATURE_FORMATS)
            if self.feature_dtype is not None:
                common.check_choice("feature dtype", self.feature_dtype, FEATURE_DTYPES)
            common.check_positive("max_regions", self.max_regions, allow_none=True)
            common.check_positive("images_per_shard", self.images_per_shard)
            common.check_positive("chunk_size", self.chunk_size, allow_none=True)
        except ValueError as exc:
            raise StageError(str(exc)) from None
        if not 0.0 <= float(self.max_reject_fraction) <= 1.0:
            raise StageError(f"max_reject_fraction must be in [0, 1], got {self.max_reject_fraction!r}")


def planned_images(manifest) -> dict[str, int]:
    """Image counts known before reading: num_images of a synthetic collection. A file source's
    expected_images is a check, not a fact (a subset, an override, skipped uncaptioned images): its shards
    are sized by the images that passed validation (a 40-image file checked against 123,287 got 247 shards)."""
    return {name: int(c.images.options["num_images"]) for name, c in manifest.collections.items()
            if c.images.format == "synthetic" and c.images.options.get("num_images")}


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


def _settings(plan: StagePlan, manifest) -> Settings:
    return Settings(
        output=plan.output,
        feature_dim=int(manifest.feature_dim),
        max_regions=int(plan.max_regions or getattr(manifest, "max_regions", None) or schema.DEFAULT_MAX_REGIONS),
        feature_format=plan.feature_format or getattr(manifest, "feature_format", None) or "parquet",
        feature_dtype=plan.feature_dtype or getattr(manifest, "feature_dtype", None) or "float32",
        images_per_shard=int(plan.images_per_shard),
        expected_images=planned_images(manifest),
        caption_filters={name: _caption_source(c) for name, c in manifest.collections.items()
                         if c.uncaptioned_images == "skip"},
        spill_dir=common.join(plan.output, SPILL_DIR, uuid.uuid4().hex[:12]),
    )


def _frozen(value):
    """A YAML option value made hashable (lists -> tuples), for the cached caption-split lookup."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _caption_source(coll) -> tuple:
    """(format, path, options) of a collection's captions, hashable: the key of ``_caption_splits``."""
    src = coll.captions
    return (src.format, _frozen(src.path), tuple(sorted((k, _frozen(v)) for k, v in src.options.items())))


def _mark_incomplete(output: str, run_id: str) -> str:
    """Write <output>/_INCOMPLETE before any shard is touched: readers (StagedDataset) refuse the folder
    until the run has written summary.json and removed the mark."""
    path = common.join(output, INCOMPLETE_FILE)
    common.write_json_atomic(path, {"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                    "created_by": "pipelines.stage"})
    return path


def run(plan: StagePlan, beam_args=()) -> Optional[dict]:
    """Stage ``plan.manifest`` into ``plan.output``; returns summary.json's dict (its ``problems`` list says
    what fails the run), or None on a dry run. Raises StageError for bad input, before anything is written."""
    from retrieval_core.manifest import ManifestError, load_manifest

    t0 = time.time()
    try:
        manifest = load_manifest(plan.manifest, overrides=plan.overrides)
    except ManifestError as exc:
        raise StageError(f"invalid manifest {plan.manifest!r}: {exc}") from None
    except FileNotFoundError as exc:
        raise StageError(f"manifest {plan.manifest!r} not found: {exc}") from None
    options = common.task_pipeline_options(beam_args)
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
    settings = _settings(plan, manifest)
    if settings.feature_format not in FEATURE_FORMATS:
        raise StageError(f"feature format must be parquet or hdf5, got {settings.feature_format!r}")
    if settings.feature_dtype not in FEATURE_DTYPES:
        raise StageError(f"feature dtype must be float32 or float16, got {settings.feature_dtype!r}")
    chunk_size = plan.chunk_size or default_chunk_size(beam_args)
    try:
        tasks = plan_tasks(manifest, chunk_size)
    except (OSError, ValueError) as exc:  # OSError: also Beam's BeamIOError listing a bucket
        raise StageError(f"cannot plan the reads: {exc}") from None
    collections = sorted(manifest.collections)
    # DaskRunner: the read tasks in DASK_READ_PARTITIONS partitions. Read outputs are metadata rows (features
    # are spilled), so a partition of many tasks stays small, and few partitions keep the shuffles cheap.
    options = common.task_pipeline_options(beam_args, math.ceil(len(tasks) / DASK_READ_PARTITIONS))
    log.info("staging %s: %d collections, %d read tasks -> %s (%s, %s)", manifest.name, len(collections),
             len(tasks), plan.output, settings.feature_format, settings.feature_dtype)

    p = beam.Pipeline(options=options)
    build_graph(p, tasks, settings, collections)
    if common.translated_only(p, "stage"):
        return None
    common.makedirs(plan.output)
    incomplete = _mark_incomplete(plan.output, settings.spill_dir.rsplit("/", 1)[-1])
    common.clear_run_dir(plan.output)
    common.remove_spill(plan.output)  # spill files of a killed earlier run
    try:
        with common.Progress.running(len(tasks), "read tasks", "stage", options):
            result = common.run_pipeline(p)
        print(common.counter_line("stage", common.counter_values(result, "stage"), common.runner_name(options)))
        infos = common.read_run_report(plan.output)
    finally:
        common.remove_spill(plan.output)
        common.clear_run_dir(plan.output)

    summary = build_summary(manifest, settings, infos, {
        "images_per_shard": settings.images_per_shard, "max_reject_fraction": plan.max_reject_fraction,
        "overrides": list(plan.overrides), "beam_args": list(beam_args), "read_tasks": len(tasks),
        "allow_empty": plan.allow_empty,
    }, time.time() - t0)
    summary["runner"] = common.runner_name(options)
    keep = {s["name"] for c in summary["collections"].values() for k in ("images", "captions")
            for s in c[k]["shards"] + c[k].get("feature_shards", [])}
    summary["resume"]["stale_removed"] = _remove_stale(plan.output, collections, keep)
    _ensure_reject_files(plan.output, summary)
    summary["problems"] = find_problems(summary, manifest, plan, plan.output)
    summary["elapsed_s"] = round(time.time() - t0, 2)
    common.write_json_atomic(common.join(plan.output, staging.SUMMARY_FILE), summary)
    FileSystems.delete([incomplete])  # only now: the last shard and summary.json are in place
    return summary


def find_problems(summary: dict, manifest, plan: StagePlan, output: str) -> list[str]:
    """What makes the run fail (exit 1) after everything is written: lost records, too many rejects, a source
    that yielded nothing (unless --allow-empty), id collisions."""
    problems = []
    for name, c in summary["collections"].items():
        spec = manifest.collections[name]
        for key, src_spec in (("images", spec.images), ("captions", spec.captions)):
            src = c[key]
            if src_spec is not None and src["records_in"] == 0 and not plan.allow_empty:
                problems.append(f"{name} {key}: the source {src['format']}:{src['path'] or '(generated)'} yielded "
                                f"no records (wrong path or format? --allow-empty accepts it)")
            if src["records_in"] != src["staged"] + src["rejected"] + src.get("skipped", 0):
                problems.append(f"{name} {key}: {src['records_in']} records in but {src['staged']} staged + "
                                f"{src['rejected']} rejected" + (f" + {src['skipped']} skipped" if src.get("skipped")
                                                                 else "") + ": records were lost by the runner")
            considered = src["records_in"] - src.get("skipped", 0)  # skipped images were never candidates
            frac = src["rejected"] / max(considered, 1)
            if frac > plan.max_reject_fraction:
                problems.append(f"{name} {key}: {src['rejected']} of {considered} records rejected "
                                f"({frac:.1%} > --max-reject-fraction {plan.max_reject_fraction:.1%}); "
                                f"see {common.join(output, src['rejects_file'])}")
    if summary["id_collisions"]:
        problems.append(f"{len(summary['id_collisions'])} item_id hash collision(s); see summary.json")
    return problems


def run_stage(manifest_ref: str, output: str, *, beam_args=(), **options) -> tuple[dict, list[str]]:
    """Keyword form kept for existing callers (tests, benchmarks): ``run(StagePlan(...))`` -> (summary,
    problems)."""
    summary = run(StagePlan(output, manifest_ref, **options), beam_args)
    if summary is None:
        raise StageError("a dry run stages nothing")
    return summary, summary["problems"]


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
@click.option("--feature-format", type=click.Choice(FEATURE_FORMATS), default=None,
              help="Where features go: inline in Parquet, or HDF5 shards beside Parquet meta [manifest's].")
@click.option("--feature-dtype", type=click.Choice(FEATURE_DTYPES), default=None,
              help="On-disk feature dtype [manifest's].")
@click.option("--max-regions", type=click.IntRange(min=1), default=None, help="Region cap per image [manifest's, 50].")
@click.option("--images-per-shard", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--max-reject-fraction", type=click.FloatRange(0, 1), default=0.01, show_default=True,
              help="Exit non-zero (after writing summary + rejects) if more of any source is rejected.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Records per read task for index-addressable sources (synthetic) "
                   "[500; 100 with --direct_running_mode=multi_processing, see the module doc].")
@click.option("--allow-empty", is_flag=True, help="Accept a source (images or captions) that yields no records.")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging and full tracebacks.")
@click.pass_context
def main(ctx, manifest_ref, output, overrides, feature_format, feature_dtype, max_regions, images_per_shard,
         max_reject_fraction, chunk_size, allow_empty, verbose):
    """Validate, normalise and shard a data manifest's images and captions.

    Unknown options go to Beam, e.g. --direct_running_mode=multi_processing --direct_num_workers=2, or
    --runner=DataflowRunner --project=... --temp_location=gs://...

    Counters namespace: stage ({image,caption}_records_in, _staged_valid, _rejected; *_shards_written/kept).
    """
    common.configure_logging(verbose, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    common.check_beam_flags(ctx.args)
    try:
        plan = StagePlan(output, manifest_ref, tuple(overrides), feature_format, feature_dtype, max_regions,
                         images_per_shard, max_reject_fraction, chunk_size, allow_empty)
        summary = run(plan, tuple(ctx.args))
    except StageError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except click.ClickException:
        raise  # usage errors (an unknown flag): click prints them
    except Exception as exc:  # noqa: BLE001 -- one clear line instead of a Beam traceback
        if verbose:
            raise
        msg = str(exc).strip().splitlines()
        click.echo(f"error: staging failed: {type(exc).__name__}: {msg[-1] if msg else ''} "
                   f"(rerun with -v for the traceback)", err=True)
        sys.exit(1)
    if summary is None:
        return
    for line in report_lines(summary):
        click.echo(line)
    click.echo(f"summary: {common.join(output, staging.SUMMARY_FILE)}")
    if summary["problems"]:
        for p in summary["problems"]:
            click.echo(f"error: {p}", err=True)
        sys.exit(1)


common.add_progress_help(main)

if __name__ == "__main__":
    common.main_as_module("pipelines.stage")  # workers import pipelines.stage, not __main__

"""The stage job's Beam graph: read tasks -> validated, normalised rows spilled per task -> shards keyed by id
(image shards, caption shards with their image's index), rejects and the id-collision check -> one run report.
docs/ARCHITECTURE.md describes the graph, memory and resume."""
from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections import Counter

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from pipelines import beam_kit, files
from pipelines.ledger import write_or_keep
from pipelines.stage.plan import CAPTIONS_DIR, FEATURES_DIR, IMAGES_DIR, REJECTS_DIR, Settings, shard_rel
from retrieval_core.data import schema, staging
from retrieval_core.data.paths import is_url
from retrieval_core.data.readers import caption_image_splits, read_task
from retrieval_core.data.shards import caption_shard_parquet, image_shard_hdf5, image_shard_parquet
from retrieval_core.data.spill import FeatureSpill, load_spilled, load_spilled_rows

log = logging.getLogger(__name__)


def _task_source(task) -> str:
    path = getattr(task, "path", None)
    if isinstance(path, tuple):  # a chunk of image files (each reject names its own file)
        return f"{task.collection}:{task.format}[{task.start}:{task.stop}]"
    return str(path) if path else f"{task.collection}:{task.format}"


def _reject_out(collection: str, rej: schema.Reject) -> tuple[str, dict]:
    return collection, rej.to_dict()


def spill_path(spill_dir: str, collection: str, key: int) -> str:
    """The spill file of one read task (``key``: from the task's identity, so a retried task overwrites)."""
    return files.join(spill_dir, f"{collection}-{key:016x}.h5")


class _TaskSpill:
    """A read task's spill file: written locally (in place for a local output, else in a temp folder and
    uploaded on close), published under its final name only when complete, so a retried task overwrites."""
    def __init__(self, spill_dir: str, task, feature_dim: int, feature_dtype: str, compression=None):
        import hashlib
        import tempfile

        digest = hashlib.sha1(repr((task.collection, task.kind, _task_source(task), task.start, task.stop))
                              .encode("utf-8")).hexdigest()[:16]
        self.key = int(digest, 16)  # what a ref carries instead of the path (spill_path rebuilds it)
        self.final = spill_path(spill_dir, task.collection, self.key)
        if not is_url(self.final):
            files.makedirs(spill_dir)
            self.local = f"{self.final}.tmp-{uuid.uuid4().hex[:12]}"
        else:
            self.local = tempfile.mkstemp(suffix=".h5")[1]
        self.spill = FeatureSpill(self.local, self.final, feature_dim, feature_dtype, compression=compression)

    def close(self) -> None:
        import os

        self.spill.close()
        if not is_url(self.final):
            # h5py writes the file in place (it seeks back), which Beam FileSystems' write-only streams cannot
            # do: a local spill keeps its own temp name + os.replace.
            os.replace(self.local, self.final)
            return
        with open(self.local, "rb") as src:
            files.write_atomic_stream(self.final, src)
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
        self._records = {k: Metrics.counter("stage", f"{k}_records_in") for k in ("image", "caption")}
        self._staged = {k: Metrics.counter("stage", f"{k}_staged_valid") for k in ("image", "caption")}
        self._rejected = {k: Metrics.counter("stage", f"{k}_rejected") for k in ("image", "caption")}
        self._converted = Metrics.counter("stage", "image_converted")
        if self.s.threads:
            import torch

            torch.set_num_threads(self.s.threads)

    def process(self, task):

        coll, source = task.collection, _task_source(task)
        kind = schema.KIND_CAPTION if task.kind in ("caption", "captions") else schema.KIND_IMAGE
        n_in = n_staged = skipped = 0
        converted: Counter = Counter()
        staged: list[dict] = []  # one task's staged rows (a task is ~500 records), spilled in shard order
        owners: dict[int, list] = {}
        # uncaptioned_images: skip -- the images the collection's captions name, and their split, known before
        # any feature is spilled (a 123k-image trainval TSV staged for the 5k test split spills 5k images)
        splits = _caption_splits(coll, self.s.caption_filters[coll]) \
            if kind == schema.KIND_IMAGE and coll in self.s.caption_filters else None
        # allow_empty: an empty source is judged by the launcher from records_in (find_problems, one line,
        # --allow-empty), not by a reader exception inside a worker (a Beam traceback).
        # image files no caption names are not decoded nor run through the backbone (other formats' features
        # are already extracted: their records are filtered below)
        wanted = (lambda sid: bool(splits.get(sid))) if splits is not None else None
        for rec in read_task(task, files=files.BEAM_FILES, allow_empty=True, device=self.s.device,
                             wanted=wanted):  # gs:// too
            n_in += 1
            if isinstance(rec, schema.Skipped):
                skipped += 1
                continue
            if splits is not None and isinstance(rec, schema.RawImage):
                rec = staging.with_caption_split(rec, splits.get(rec.source_id), source)
                if rec is None:
                    skipped += 1
                    continue
            out = self._stage_record(rec, coll, kind, source)
            if isinstance(out, schema.Reject):
                self._rejected[kind].inc()
                yield T_REJECT, _reject_out(coll, out)
                continue
            self._staged[kind].inc()
            n_staged += 1
            if kind == schema.KIND_IMAGE and rec.conversions:  # counted for staged images only (in = staged + rej)
                self._converted.inc()
                converted.update(rec.conversions)
            own_id = int(out["item_id"] if kind == schema.KIND_IMAGE else out["caption_id"])
            owners.setdefault(own_id % ID_BUCKETS, []).append((own_id, coll, kind, str(out["source_id"])))
            staged.append(out)
        refs = self._spill(task, coll, kind, staged) if staged else {}
        tag = T_IMAGE_REFS if kind == schema.KIND_IMAGE else T_CAPTION_REFS
        for bucket in sorted(refs):
            yield tag, ((coll, bucket), refs[bucket])
        for bucket in sorted(owners):
            yield T_OWNERS, (bucket, owners[bucket])
        self._records[kind].inc(n_in)
        beam_kit.Progress.advance(1)  # read tasks done (the launcher's bar, when this runs in its process)
        log.info("read %s %s task %s: %d records", coll, kind, getattr(task, "start", None) or source, n_in)
        info = {"type": "in", "collection": coll, "kind": kind, "n": n_in}
        if converted:
            info["converted"] = dict(converted)
        if splits is not None:
            info["skipped"] = skipped
        yield T_INFO, info
        if kind == schema.KIND_IMAGE:
            yield T_COUNT, (coll, n_staged)

    def _stage_record(self, rec, coll: str, kind: str, source: str):
        """A reader's record -> its staged row (dict), or the Reject saying why it is not staged."""
        if isinstance(rec, schema.RawImage):
            return staging.stage_image(rec, collection=coll, feature_dim=self.s.feature_dim,
                                       max_regions=self.s.max_regions, source=source)
        if isinstance(rec, schema.RawCaption):
            return staging.stage_caption(rec, collection=coll, source=source)
        if isinstance(rec, schema.Reject):
            rec.kind = kind  # the reader's kind default may not match the task
            return rec
        return schema.Reject(source, "?", f"reader yielded {type(rec).__name__}", kind)

    def _spill(self, task, coll: str, kind: str, staged: list[dict]) -> dict[int, list]:
        """Spill a task's staged rows (an image's regions too) in shard order: {id bucket: [(spill key, the
        shard's id, row)]}, the refs the shuffles carry instead of the rows."""
        refs: dict[int, list] = {}
        spill = _TaskSpill(self.s.spill_dir, task, self.s.feature_dim, self.s.feature_dtype,
                           self.s.spill_compression)
        for out in self._in_shard_order(coll, kind, staged):
            if kind == schema.KIND_IMAGE:
                shard_id = int(out["item_id"])
                row = spill.spill.add_row(spill.spill.append(out))  # regions, then the row pointing to them
            else:
                shard_id = int(out["image_item_id"])
                row = spill.spill.add_row(out)
            refs.setdefault(shard_id % ID_BUCKETS, []).append((spill.key, shard_id, row))
        spill.close()  # before this bundle commits, i.e. before any shard writer can read it
        return refs

    def _in_shard_order(self, coll: str, kind: str, staged: list[dict]) -> list[dict]:
        """A task's rows ordered by the shard they go to, where the shard count is known before reading (a
        synthetic collection's planned count): a shard then reads one run of rows from each task's file, the
        next shard the run after it, instead of single rows at random (ids are hashes): random reads made the
        1M write phase IO-bound once the spill outgrew the page cache (docs/ARCHITECTURE.md, pipelines.stage)."""
        if coll not in self.s.expected_images:
            return staged
        n = self.s.num_shards(coll, {})
        key = "item_id" if kind == schema.KIND_IMAGE else "image_item_id"
        return sorted(staged, key=lambda r: (int(r[key]) % n, int(r[key])))


@functools.lru_cache(maxsize=8)
def _caption_splits(collection: str, source: tuple) -> dict:
    """{image source id: its captions' splits} of a caption source (format, path, frozen options), read once per
    worker process (a collection's image files are read by several tasks)."""
    fmt, path, options = source
    # allow_empty: an empty caption source fails the run from its own read task (find_problems), in one line
    return caption_image_splits(collection, fmt, list(path) if isinstance(path, tuple) else path, dict(options),
                                files=files.BEAM_FILES, allow_empty=True)


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
    return load_spilled_rows(((spill_path(settings.spill_dir, coll, key), row) for key, _, row in refs),
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
        rows = load_spilled(rows, _open_spill)  # features of the kept rows only
        info = {"type": "shard", "collection": coll, "kind": "images", "index": idx, "total": total,
                "rows": len(rows), "cap": dict(Counter(r[staging.K_CAP_POLICY] for r in rows
                                                    if r[staging.K_CAP_POLICY])),
                "splits": staging.split_counts(rows)}
        name = shard_rel(IMAGES_DIR, coll, idx, total, ".parquet")
        if self.s.feature_format == "hdf5":
            h5_name = shard_rel(FEATURES_DIR, coll, idx, total, ".h5")
            h5, meta = image_shard_hdf5(rows, self.s.feature_dtype, feature_dim=self.s.feature_dim,
                                        feature_shard=h5_name)
            sha, kept = write_or_keep(files.join(self.s.output, h5_name), h5)
            info["feature_shard"] = {"name": h5_name, "rows": len(rows), "sha256": sha, "kept": kept,
                                     "bytes": len(h5)}
            data = meta
        else:
            data = image_shard_parquet(rows, self.s.feature_dim, self.s.feature_dtype)
        sha, kept = write_or_keep(files.join(self.s.output, name), data)
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
        data = caption_shard_parquet(rows)
        sha, kept = write_or_keep(files.join(self.s.output, name), data)
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
    files.write_jsonl_atomic(files.join(output, name), rejects)
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
    """The staging graph; it ends in beam_kit.WriteRunReport (<output>/_run/report.json), which every write feeds."""
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

    beam_kit.WriteRunReport.apply([staged | "ReadInfo" >> beam.FlatMap(pick, T_INFO),
                                 image_shards | "ImageShardInfo" >> beam.FlatMap(pick, T_INFO),
                                 caption_shards | "CaptionShardInfo" >> beam.FlatMap(pick, T_INFO),
                                 reject_info, collision_info], settings.output)



"""``python -m pipelines.stage --manifest demo --output DIR``: stage a data manifest into checksummed shards
(Parquet, features inline or in HDF5), per-collection rejects with their reasons and summary.json. A rerun
rewrites only the shards whose bytes changed; ``_INCOMPLETE`` marks a folder mid-run, which readers refuse.
docs/ARCHITECTURE.md describes the graph, memory and resume.
"""
from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

import apache_beam as beam
import click
from apache_beam.io.filesystems import FileSystems

from pipelines import beam_kit, files
from pipelines.stage.graph import build_graph
from pipelines.stage.plan import (
    CAPTIONS_DIR,
    FEATURE_DTYPES,
    FEATURE_FORMATS,
    FEATURES_DIR,
    IMAGES_DIR,
    REJECTS_DIR,
    Settings,
    StageError,
    StagePlan,
    _settings,
    default_chunk_size,
    image_backbone,
    plan_tasks,
)
from retrieval_core.cli import cli_errors, describe_device, plan_from_cli, plan_options
from retrieval_core.data import schema, staging
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.manifest_spec import ManifestError
from retrieval_core.data.outputs import holds_output
from retrieval_core.data.store import INCOMPLETE_FILE
from retrieval_core.memory import require_headroom

log = logging.getLogger(__name__)

#: Dask partitions the read tasks are cut into, unless --dask_npartitions/--dask_partition_size say otherwise.
DASK_READ_PARTITIONS = 4


def build_summary(manifest, settings: Settings, infos: list, options: dict, elapsed_s: float,
                  backbone: Optional[dict] = None) -> dict:
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
        converted = Counter()
        for i in infos:
            if i.get("collection") == name and i["type"] == "in" and i["kind"] == schema.KIND_IMAGE:
                converted.update(i.get("converted", {}))
        c["images"]["converted"] = dict(sorted(converted.items()))
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
        "image_backbone": backbone,
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
            for m in FileSystems.match([files.join(output, d, f"{coll}-*")])[0].metadata_list:
                base = m.path.replace("\\", "/").rsplit("/", 1)[-1]
                if ours.match(base) and f"{d}/{base}" not in keep:
                    stale.append(m.path)
    if stale:
        FileSystems.delete(stale)
    return len(stale)


def _ensure_reject_files(output: str, summary: dict) -> None:
    for c in summary["collections"].values():
        for key in ("images", "captions"):
            path = files.join(output, c[key]["rejects_file"])
            if not files.exists(path):
                files.write_jsonl_atomic(path, [])


def _mark_incomplete(output: str, run_id: str) -> str:
    """Write <output>/_INCOMPLETE before any shard is touched: readers (StagedDataset) refuse the folder
    until the run has written summary.json and removed the mark."""
    path = files.join(output, INCOMPLETE_FILE)
    files.write_json_atomic(path, {"run_id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                    "created_by": "pipelines.stage"})
    return path


@holds_output("stage")
def run(plan: StagePlan, beam_args=()) -> Optional[dict]:
    """Stage ``plan.manifest`` into ``plan.output``; returns summary.json's dict (its ``problems`` list says
    what fails the run), or None on a dry run. Raises StageError for bad input, before anything is written."""
    t0 = time.time()
    inp = resolve(plan, beam_args)
    p = beam.Pipeline(options=inp.options)
    build_graph(p, inp.tasks, inp.settings, inp.collections)
    if beam_kit.translated_only(p, "stage"):
        return None
    files.makedirs(plan.output)
    incomplete = _mark_incomplete(plan.output, inp.settings.spill_dir.rsplit("/", 1)[-1])
    infos = _run_job(p, plan, inp)
    summary = _summary(plan, inp, infos, beam_args, t0)
    files.write_json_atomic(files.join(plan.output, schema.SUMMARY_FILE), summary)
    FileSystems.delete([incomplete])  # only now: the last shard and summary.json are in place
    return summary


@dataclass(frozen=True)
class Inputs:
    """What resolve checked and the graph needs: the manifest, the staging settings, the image backbone (image
    files only), the read tasks, the collections and the Beam options."""
    manifest: object
    settings: Settings
    backbone: Optional[dict]
    tasks: list
    collections: list
    options: object


def resolve(plan: StagePlan, beam_args=()) -> Inputs:
    """Load and check the manifest (its input paths, formats, device) and plan the read tasks."""
    try:
        manifest = load_manifest(plan.manifest, overrides=plan.overrides)
    except ManifestError as exc:
        raise StageError(f"invalid manifest {plan.manifest!r}: {exc}") from None
    except FileNotFoundError as exc:
        raise StageError(f"manifest {plan.manifest!r} not found: {exc}") from None
    # Planning lists gs:// inputs before the Pipeline exists: give FileSystems the options (project,
    # credentials) now; beam.Pipeline(options=...) sets the same ones again.
    FileSystems.set_options(beam_kit.task_pipeline_options(beam_args))
    try:
        missing = manifest.missing_paths(files=files.BEAM_FILES)
    except (OSError, ValueError) as exc:  # e.g. gs:// without apache-beam[gcp]: Beam's message says what to install
        raise StageError(f"cannot check the input paths: {exc}") from None
    if missing:
        raise StageError("input file(s) missing: " + ", ".join(map(str, missing))
                         + " (fix the manifest or override the path with --set / environment variables)")
    settings = _settings(plan, manifest)
    require_headroom("stage", plan.threads, ("--threads", "--chunk-size", "--images-per-shard"))
    backbone = image_backbone(manifest)
    _check_device_and_format(plan, settings, backbone)
    try:
        tasks = plan_tasks(manifest, plan.chunk_size or default_chunk_size(beam_args))
    except (OSError, ValueError) as exc:  # OSError: also Beam's BeamIOError listing a bucket
        raise StageError(f"cannot plan the reads: {exc}") from None
    collections = sorted(manifest.collections)
    # DaskRunner: the read tasks in DASK_READ_PARTITIONS partitions. Read outputs are metadata rows (features
    # are spilled), so a partition of many tasks stays small, and few partitions keep the shuffles cheap.
    options = beam_kit.task_pipeline_options(beam_args, math.ceil(len(tasks) / DASK_READ_PARTITIONS))
    log.info("staging %s: %d collections, %d read tasks -> %s (%s, %s)", manifest.name, len(collections),
             len(tasks), plan.output, settings.feature_format, settings.feature_dtype)
    return Inputs(manifest, settings, backbone, tasks, collections, options)


def _check_device_and_format(plan: StagePlan, settings: Settings, backbone: Optional[dict]) -> None:
    if backbone and plan.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise StageError("--device cuda was requested but CUDA is not available on this machine")
    if settings.feature_format not in FEATURE_FORMATS:
        raise StageError(f"feature format must be parquet or hdf5, got {settings.feature_format!r}")
    if settings.feature_dtype not in FEATURE_DTYPES:
        raise StageError(f"feature dtype must be float32 or float16, got {settings.feature_dtype!r}")


def _run_job(p, plan: StagePlan, inp: Inputs) -> list[dict]:
    """Run the staging job (no spill files or run report left, whatever happens): its run report."""
    beam_kit.clear_run_dir(plan.output)
    files.remove_spill(plan.output)  # spill files of a killed earlier run
    try:
        with beam_kit.Progress.running(len(inp.tasks), "read tasks", "stage", inp.options):
            result = beam_kit.run_pipeline(p)
        print(beam_kit.counter_line("stage", beam_kit.counter_values(result, "stage"),
                                    beam_kit.runner_name(inp.options)))
        return beam_kit.read_run_report(plan.output)
    finally:
        files.remove_spill(plan.output)
        beam_kit.clear_run_dir(plan.output)


def _summary(plan: StagePlan, inp: Inputs, infos: list[dict], beam_args, t0: float) -> dict:
    """summary.json's dict, once stale shards are removed and every reject file exists."""
    summary = build_summary(inp.manifest, inp.settings, infos, {
        "images_per_shard": inp.settings.images_per_shard, "max_reject_fraction": plan.max_reject_fraction,
        "overrides": list(plan.overrides), "beam_args": list(beam_args), "read_tasks": len(inp.tasks),
        "allow_empty": plan.allow_empty,
    }, time.time() - t0, inp.backbone)
    summary["runner"] = beam_kit.runner_name(inp.options)
    if inp.backbone:  # image files: where their backbone computed the region features
        summary["device"] = plan.device
    keep = {s["name"] for c in summary["collections"].values() for k in ("images", "captions")
            for s in c[k]["shards"] + c[k].get("feature_shards", [])}
    summary["resume"]["stale_removed"] = _remove_stale(plan.output, inp.collections, keep)
    _ensure_reject_files(plan.output, summary)
    summary["problems"] = find_problems(summary, inp.manifest, plan, plan.output)
    summary["elapsed_s"] = round(time.time() - t0, 2)
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
                                f"see {files.join(output, src['rejects_file'])}")
    if summary["id_collisions"]:
        problems.append(f"{len(summary['id_collisions'])} item_id hash collision(s); see summary.json")
    return problems


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
            if src.get("converted"):
                done = ", ".join(f"{k}: {v}" for k, v in src["converted"].items())
                lines.append(f"  converted (then staged): {done}")
        cap = c["images"]["region_cap"]
        how = {"confidence": "kept the most confident", "stored_order": "kept the first in stored order",
               "mixed": "most confident where confidences exist, else stored order"}.get(cap["policy"], "")
        lines.append(f"{name} region cap {cap['max_regions']}: {cap['capped_images']} images capped"
                     + (f" ({how}: {cap['by_policy']})" if cap["capped_images"] else ""))
    r = summary["resume"]
    lines.append(f"shards: {r['written']} written, {r['kept']} kept unchanged"
                 + (f", {r['stale_removed']} stale removed" if r.get("stale_removed") else ""))
    if summary.get("device"):
        lines.append(f"image backbone device: {describe_device(summary['device'])}")
    lines.append(f"staged in {summary['elapsed_s']:.1f} s")
    return lines


@click.command(context_settings=beam_kit.BEAM_CLI_CONTEXT)
@plan_options(StagePlan)
@click.pass_context
def main(ctx, **values):
    """Validate, normalise and shard a data manifest's images and captions.

    Unknown options go to Beam, e.g. --direct_running_mode=multi_processing --direct_num_workers=2, or
    --runner=DataflowRunner --project=... --temp_location=gs://...

    Counters namespace: stage ({image,caption}_records_in, _staged_valid, _rejected; *_shards_written/kept).
    """
    beam_kit.configure_logging("%(asctime)s %(levelname)s %(name)s: %(message)s")
    with cli_errors(memory_options=("--chunk-size", "--images-per-shard"), job="staging"):
        beam_kit.check_beam_flags(ctx.args)
        plan = plan_from_cli(StagePlan, values)
        summary = run(plan, tuple(ctx.args))
    if summary is None:
        return
    for line in report_lines(summary):
        click.echo(line)
    click.echo(f"summary: {files.join(plan.output, schema.SUMMARY_FILE)}")
    if summary["problems"]:
        for p in summary["problems"]:
            click.echo(f"Error: {p}", err=True)
        ctx.exit(1)


beam_kit.add_progress_help(main)

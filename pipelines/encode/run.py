"""``python -m pipelines.encode``: bulk-encode a staged collection with the bi-encoder (BE) into checksummed
embedding shards and embeddings_manifest.json; a rerun encodes only the shards an earlier run did not finish, and
in them only the batches a killed run did not spill.
docs/ARCHITECTURE.md describes the graph, resume and memory.

    python -m pipelines.encode                       # the embedded demo collection and model
    python -m pipelines.encode --staged runs/staged/coco --model runs/models/join/best --output runs/emb/coco
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

import apache_beam as beam
import click
import torch
from apache_beam.metrics.metric import MetricsFilter

from pipelines import beam_kit, files
from pipelines.encode.graph import METRICS_NAMESPACE, MODALITY_TASK, build_graph
from pipelines.encode.plan import (
    EncodeError,
    EncodePlan,
    ShardPlan,
    SpillResume,
    be_model_folder,
    keep_finished,
    keep_other_modalities,
    keep_spilled,
    plan_shards,
    spill_key,
    staged_ids,
)
from pipelines.handlers import COMPUTED_TOKENS, USEFUL_TOKENS, VLModelHandler, prepare_token_ids
from retrieval_core.cli import cli_errors, describe_device, plan_from_cli, plan_options
from retrieval_core.data import schema
from retrieval_core.data.outputs import holds_output
from retrieval_core.data.pixels.backbone import FeatureSourceError
from retrieval_core.data.store import StagedDataset
from retrieval_core.memory import require_headroom, weights_bytes
from retrieval_core.search import embeddings
from retrieval_core.training import cache, recipes

log = logging.getLogger(__name__)

DEAD_LETTER_FILE = "dead_letter.jsonl"
CREATED_BY = "pipelines.encode"


def inference_metrics(result, namespace: str) -> dict:
    """Sum RunInference's counters/distributions of one handler namespace (DirectRunner, Dataflow)."""
    try:
        res = result.metrics().query(MetricsFilter().with_namespace(namespace))
    except (NotImplementedError, AttributeError) as exc:
        log.info("runner reports no metrics (%s)", exc)
        return {}
    out: dict = {}
    for c in res.get("counters", []):
        value = c.committed if c.committed is not None else c.attempted
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + (value or 0)
    for d in res.get("distributions", []):
        v = d.committed if d.committed is not None else d.attempted
        if v is None:
            continue
        s, n = out.get(d.key.metric.name, (0, 0))
        out[d.key.metric.name] = (s + v.sum, n + v.count)
    return out


def throughput_line(modality: str, metrics: dict, device: str) -> str:
    n = metrics.get("num_inferences", 0)
    lat_sum, batches = metrics.get("inference_batch_latency_micro_secs", (0, 0))
    bs_sum, bs_n = metrics.get("inference_request_batch_size", (0, 0))
    rate = n / (lat_sum / 1e6) if lat_sum else float("nan")
    mean_bs = bs_sum / bs_n if bs_n else float("nan")
    computed = metrics.get(COMPUTED_TOKENS, 0)
    useful = f", useful tokens {metrics.get(USEFUL_TOKENS, 0) / computed:.3f} of computed" if computed else ""
    return (f"{modality}: {n} encoded in {batches} batches, mean batch {mean_bs:.1f}{useful}, "
            f"{rate:.1f} items/s of model time, device {device}, torch threads {torch.get_num_threads()}")


# ------------------------------------------------------------------------------------- launcher
@dataclass(frozen=True)
class Inputs:
    """What resolve checked and the graph needs: the staged folder, its collections to encode, the model's
    fingerprint and embedding width, and the output shards of each (modality, collection)."""
    ds: StagedDataset
    collections: list
    model_sha: str
    dim: int
    precision: str
    plans: dict

    def key_of(self, modality: str, collection: str, split: Optional[str]) -> dict:
        """What a shard of (modality, collection, split) is encoded under (ShardPlan.key, less its layout)."""
        return {"model_sha256": self.model_sha, "dim": self.dim, "modality": modality, "collection": collection,
                "split": split, "staged_sha256": self.ds.content_sha256(schema.STAGED_KIND[modality], collection),
                # int8 vectors differ from fp32 ones: never kept across a change (fp32 keys stay as they were)
                **({"quantize": self.precision} if self.precision != "none" else {})}

    def recorded_key_now(self, modality: str, recorded: dict) -> Optional[dict]:
        """The key a record of an earlier run would have today (None: its collection is no longer staged)."""
        if recorded.get("collection") not in self.ds.collections:
            return None
        return dict(self.key_of(modality, recorded["collection"], recorded.get("split")),
                    num_shards=recorded.get("num_shards"), per_shard=recorded.get("per_shard"))


@holds_output("encode")
def run(plan: EncodePlan, beam_args=()) -> Optional[dict]:
    """Encode, write shards + completion records + manifest + dead letters; returns a report dict (counts,
    shards, metrics), or None on a dry run."""
    t0 = time.time()
    options = beam_kit.task_pipeline_options(beam_args)
    inp = resolve(plan)
    plans, keep = _finished(plan, inp)
    planned_in = {m: sum(sum(p.expected_rows[i] for i in p.redo) for p in plans.values() if p.modality == m)
                  for m in plan.modalities}
    skipped = {m: sum(int(s["rows"]) for s in keep.get(m, [])) for m in plan.modalities}
    for m in plan.modalities:
        if keep.get(m):
            print(f"{m}: {len(keep[m])} shard(s) with {skipped[m]} items already valid, skipped")
    tasks = _tasks(plan, inp, plans)
    job = _encode(plan, options, inp.ds, plans, tasks, planned_in, t0)
    if job is None:
        return None
    result, report, resume = job
    written = [r for r in report if r["kind"] == "shard"]
    dead = sorted((r for r in report if r["kind"] == "dead"), key=lambda r: (r["modality"], r["item_id"]))
    _write_manifest(plan, inp, plans, keep, written, dead, resume)
    summary = {"output": plan.output, "modalities": {}, "wall_s": None, "device": plan.device,
               "runner": beam_kit.runner_name(options), "resumed_from_spill": resume.to_json()}
    for m in plan.modalities:
        summary["modalities"][m] = _modality_summary(plan, m, written, dead, planned_in[m], skipped[m],
                                                     result if m in tasks else None)
    summary["wall_s"] = time.time() - t0
    print(f"device: {describe_device(plan.device)}")
    print(f"embeddings: {plan.output} (manifest {embeddings.EMBEDDINGS_MANIFEST}); wall time {summary['wall_s']:.1f} s")
    if dead:
        print(f"{len(dead)} item(s) dead-lettered, reasons in {files.join(plan.output, DEAD_LETTER_FILE)}; "
              f"a rerun retries their shards")
    return summary


def resolve(plan: EncodePlan) -> Inputs:
    """Check the staged folder, the collection and the model (a BE head, the staged features) and lay out the
    output shards of every (modality, collection) that has items."""
    ds = StagedDataset(plan.staged, files=files.BEAM_FILES)
    collections = [plan.collection] if plan.collection else list(ds.collections)
    if plan.collection and plan.collection not in ds.collections:
        raise EncodeError(f"collection {plan.collection!r} is not staged in {plan.staged} (have {ds.collections})")
    folder = be_model_folder(plan.model)
    try:
        folder.require_features(ds)
    except FeatureSourceError as exc:
        raise EncodeError(str(exc)) from None
    require_headroom("encode", plan.threads, ("--threads", "--model-copies", "--batch-size"),
                     weights_bytes(plan.model) * (plan.model_copies or 1))
    inp = Inputs(ds, collections, folder.fingerprint, folder.embedding_dim, plan.precision, {})
    for m in plan.modalities:
        for c in collections:
            shard_plan = plan_shards(m, c, staged_ids(ds, m, c, plan.split), plan.per_shard(m),
                                     inp.key_of(m, c, plan.split))
            if shard_plan is not None:
                inp.plans[(m, c)] = shard_plan
    if not inp.plans:
        raise EncodeError(f"nothing to encode: no {'/'.join(plan.modalities)} items in {plan.staged} "
                          f"(collection={plan.collection}, split={plan.split})")
    return inp


def _finished(plan: EncodePlan, inp: Inputs) -> tuple[dict[tuple[str, str], ShardPlan], dict[str, list[dict]]]:
    """The plans less the shards an earlier run finished, and the manifest entries kept: those finished shards
    and the other modalities' shards of the manifest on disk that are still valid (the ledger decides both)."""
    manifest_file = files.join(plan.output, embeddings.EMBEDDINGS_MANIFEST)
    old = files.read_json(manifest_file) if files.exists(manifest_file) else None
    plans, keep = keep_finished(plan.output, inp.plans)
    keep.update(keep_other_modalities(plan.output, old, plan.modalities, inp.model_sha, inp.dim,
                                      inp.recorded_key_now))
    return plans, keep


def _tasks(plan: EncodePlan, inp: Inputs, plans: dict) -> dict[str, list[tuple[str, str, str]]]:
    """Per modality, the staged shards holding items of an output shard still to encode (a staged shard feeds
    one or a few)."""
    tasks = {m: [(m, c, rel) for c in inp.collections if plans.get((m, c))
                 for rel in inp.ds.shard_names(schema.STAGED_KIND[m], c)
                 if set(plans[(m, c)].outputs.get(rel, ())) & plans[(m, c)].redo] for m in plan.modalities}
    return {m: t for m, t in tasks.items() if t}


def _encode(plan: EncodePlan, options, ds: StagedDataset, plans: dict, tasks: dict, planned_in: dict,
            t0: float) -> Optional[tuple]:
    """The Beam job over ``tasks``: (its result, run report, the spill pieces resumed); None for a dry run."""
    if not tasks:
        if beam_kit.is_dry_run(options):
            print(beam_kit.dry_run_message("encode", options))
            return None
        return None, [], SpillResume()
    p = beam.Pipeline(options=options)
    tokenise = schema.MODALITY_TEXT in tasks and not beam_kit.is_dry_run(options)  # each caption once, here
    fingerprint = prepare_token_ids(ds, plan.model) if tokenise else None
    resume = SpillResume()
    if not beam_kit.is_dry_run(options):
        files.makedirs(plan.output)
        resume = keep_spilled(plan.output, spill_key(plans, plan.batch_size), t0)
    build_graph(p, plan, plans, tasks, fingerprint, resume)
    if beam_kit.translated_only(p, "encode"):
        return None
    beam_kit.clear_run_dir(plan.output)
    if resume.rows:
        print(f"resuming: {resume.rows} items in {resume.to_json()['pieces']} batch(es) an interrupted run "
              f"encoded ({resume.earlier_s:.0f} s of encoding) are kept, not encoded again")
    # a run that fails or is killed keeps its spill pieces: the next run of the same key skips their batches
    with beam_kit.Progress.running(max(0, sum(planned_in[m] for m in tasks) - resume.rows), "items", "encode",
                                   options):
        result = beam_kit.run_pipeline(p)
    files.remove_spill(plan.output)
    print(beam_kit.counter_line(METRICS_NAMESPACE, beam_kit.counter_values(result, METRICS_NAMESPACE),
                                beam_kit.runner_name(options)))
    report = beam_kit.read_run_report(plan.output)
    beam_kit.clear_run_dir(plan.output)
    return result, report, resume


def _write_manifest(plan: EncodePlan, inp: Inputs, plans: dict, keep: dict, written: list, dead: list,
                    resume: SpillResume) -> None:
    """embeddings_manifest.json (the kept and the written shards) and dead_letter.jsonl."""
    by_modality: dict[str, list[dict]] = {m: list(keep.get(m, [])) for m in set(keep) | set(plan.modalities)}
    for r in written:
        by_modality[r["modality"]].append({k: r[k] for k in ("name", "rows", "sha256")})
    manifest = embeddings.make_embeddings_manifest(plan.model, inp.model_sha, inp.dim,
                                                   {m: s for m, s in by_modality.items() if s}, CREATED_BY)
    manifest["quantize"] = plan.precision  # the serving precision the vectors come from (schema.QUANTIZE_CHOICES)
    if resume.rows:  # this run's wall time covers only what the interrupted run(s) left
        manifest["resumed_from_spill"] = resume.to_json()
    manifest["inputs"] = {"collections": inp.collections, "split": plan.split,
                          "staged_sha256": {f"{m}/{c}": p.key["staged_sha256"] for (m, c), p in sorted(plans.items())}}
    files.makedirs(plan.output)
    files.write_json_atomic(files.join(plan.output, embeddings.EMBEDDINGS_MANIFEST), manifest)
    files.write_jsonl_atomic(files.join(plan.output, DEAD_LETTER_FILE), dead)


def _modality_summary(plan: EncodePlan, m: str, written: list, dead: list, planned: int, skipped: int,
                      result) -> dict:
    """One modality's counts (printed, and checked to reconcile) and its RunInference metrics."""
    encoded = sum(r["rows"] for r in written if r["modality"] == m)
    n_dead = sum(1 for r in dead if r["modality"] == m)
    line = (f"{m}: {planned} inputs = {encoded} encoded + {n_dead} dead-lettered"
            + (f" (+ {skipped} reused from valid shards)" if skipped else ""))
    print(line)
    if planned != encoded + n_dead:
        raise EncodeError(f"{m}: counts do not reconcile: {line}")
    metrics = inference_metrics(result, VLModelHandler(plan.model, MODALITY_TASK[m]).get_metrics_namespace()) \
        if result is not None else {}
    if metrics:
        print(throughput_line(m, metrics, plan.device))
    return {"inputs": planned, "encoded": encoded, "dead_lettered": n_dead, "reused": skipped, "metrics": metrics}


@click.command(context_settings=beam_kit.BEAM_CLI_CONTEXT)
@plan_options(EncodePlan)
@click.pass_context
def main(ctx, **values):
    """Encode staged images and captions with the bi-encoder into checksummed embedding shards. With no
    --staged/--model/--output: the embedded demo collection and model (built on first use).
    Unknown --flags go to Beam (--runner, --direct_num_workers, Dataflow options...).

    Counters namespace: encode (images_encoded, captions_encoded, *_dead_lettered)."""
    beam_kit.configure_logging()
    beam_args = tuple(ctx.args)
    if (values["staged"] is None) != (values["model"] is None):
        raise click.UsageError("pass both --staged and --model, or neither (the embedded demo)")
    if values["staged"] is not None and values["output"] is None:
        raise click.UsageError("--output is required with --staged/--model")
    with cli_errors(EncodeError, memory_options=("--batch-size",), job="encode"):
        beam_kit.check_beam_flags(beam_args)  # an unknown flag is an error before the demo assets are built
        if values["staged"] is None:
            values["staged"], values["model"] = cache.ensure_demo_assets(beam_args)
            values["output"] = values["output"] or os.path.join(recipes.demo_dir(), "embeddings")
        summary = run(plan_from_cli(EncodePlan, values), beam_args)
    if summary is not None and any(v["dead_lettered"] for v in summary["modalities"].values()):
        ctx.exit(1)


beam_kit.add_progress_help(main)

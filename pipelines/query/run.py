"""``python -m pipelines.query``: your own text or image queries against a built index, ranked hits out.

    python -m pipelines.query --staged S --embeddings E --index I --queries my_queries.txt --output OUT

The launcher reads and checks the queries (empty and duplicate ones rejected with their reason) and the inputs,
runs one Beam job over the batches of the shards an earlier run of the same plan did not finish (a killed run
keeps every finished shard), then writes hits.jsonl from the shards, hits.html (the first --page-queries queries'
hits, drawn: retrieval_core.pages), rejects.jsonl and query_manifest.json, and prints queries in = answered +
rejected. docs/QUERY.md is the how-to.
"""
from __future__ import annotations

import io
import json
import logging
import tempfile
import time

import apache_beam as beam
import click
import pandas as pd
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from pipelines import beam_kit, files
from pipelines.query.graph import METRICS_NAMESPACE, build_graph
from pipelines.query.plan import (
    HITS_DIR,
    HITS_HTML,
    HITS_JSONL,
    PROGRESS_DIR,
    QUERY_MANIFEST,
    REJECTS_JSONL,
    QueryError,
    QueryJobError,
    QueryPlan,
    Resolved,
    progress_ledger,
    resolve,
)
from retrieval_core.cli import cli_errors, describe_device, plan_from_cli, plan_options
from retrieval_core.data.outputs import holds_output
from retrieval_core.data.store import StagedDataset
from retrieval_core.pages import ItemViews, first_queries, hits_page, shown_path
from retrieval_core.search.query import HIT_COLUMNS, REASONS

log = logging.getLogger(__name__)

CREATED_BY = "pipelines.query"


def _finished(res: Resolved) -> dict[str, dict]:
    """The shards an earlier run of this plan finished (the ledger: record, fingerprint, file checksum)."""
    ledger = progress_ledger(res.plan.output, res.fingerprint)
    done = {}
    for name in res.shards:
        rec = ledger.finished(name)
        if rec is not None:
            done[name] = rec.info()
    return done


@holds_output("query")
def run(plan: QueryPlan, beam_args: tuple[str, ...] = ()) -> dict:
    """Answer the plan's queries (the shards not finished by an earlier run of the same plan, in one Beam job)
    and write the outputs; returns the manifest."""
    t0 = time.time()
    options = beam_kit.pipeline_options(beam_args)
    beam_kit.refuse_local_dry_run(options)
    res = resolve(plan)
    files.makedirs(plan.output)
    manifest_path = files.join(plan.output, QUERY_MANIFEST)
    if files.exists(manifest_path):  # until this run finishes, the directory holds no complete run
        FileSystems.delete([manifest_path])
    finished = _finished(res)
    todo = [name for name in res.shards if name not in finished]
    shards, counters = dict(finished), None
    if todo:
        total = sum(len(b.queries) for name in todo for b in res.shards[name])
        p = beam.Pipeline(options=options)
        build_graph(p, res, todo)
        beam_kit.clear_run_dir(plan.output)
        with beam_kit.Progress.running(total, "queries", "query", options):
            result = beam_kit.run_pipeline(p)
        shards.update((item["name"], item) for item in beam_kit.read_run_report(plan.output))
        beam_kit.clear_run_dir(plan.output)
        counters = beam_kit.counter_values(result, METRICS_NAMESPACE)
        print(beam_kit.counter_line(METRICS_NAMESPACE, counters, beam_kit.runner_name(options)))
    missing = [name for name in res.shards if name not in shards]
    if missing:
        raise QueryJobError(f"shards {missing[:3]} were not written")
    manifest = _manifest(res, [shards[n] for n in res.shards], len(finished), beam_kit.runner_name(options),
                         time.time() - t0)
    _write_outputs(res, manifest, [shards[n] for n in res.shards])
    _report(res, manifest)
    return manifest


def _rejects(res: Resolved, shards: list[dict]) -> list[dict]:
    return [r.to_dict() for r in res.rejected] + [r for s in shards for r in s.get("rejected", [])]


def _manifest(res: Resolved, shards: list[dict], reused: int, runner: str, wall_s: float) -> dict:
    plan, inp = res.plan, res.inputs
    rejects = _rejects(res, shards)
    by_reason = {reason: sum(r["reason"].startswith(reason) for r in rejects) for reason in REASONS}
    answered = sum(int(s["answered"]) for s in shards)
    return {
        "created_by": CREATED_BY, "direction": plan.direction, "mode": res.mode, "k": plan.k,
        "lam": res.lam if res.mode in ("add", "norm_add") else None, "fusion_choice": res.fusion_choice,
        "tune_on": plan.tune_on, "staged": plan.staged, "embeddings": plan.embeddings,
        "be_model": {"path": inp.be.path, "sha256": inp.be.fingerprint, "quantize": inp.be_precision},
        "ce_model": {"path": inp.ce.path, "sha256": inp.ce.fingerprint, "quantize": inp.ce_precision}
        if inp.ce is not None and res.mode != "emb" else None,
        "device": inp.device, "search": {d: s["described"] for d, s in inp.searchers.items()},
        "search_params": {d: dict(s["params"]) for d, s in inp.searchers.items()},
        "pool_size": {d: s["pool"] for d, s in inp.searchers.items()},
        "queries_file": res.queries_file,
        "queries": {"in": res.queries_in, "answered": answered, "rejected": len(rejects),
                    "rejected_by_reason": {k: v for k, v in by_reason.items() if v},
                    "truncated": sum(len(s.get("truncated", [])) for s in shards)},
        "plan_fingerprint": res.fingerprint,
        "shards": [{k: s[k] for k in ("name", "rows", "sha256", "answered")} for s in shards],
        "page": {"path": HITS_HTML, "queries": min(plan.page_queries, answered)} if plan.page_queries else None,
        "shards_reused": reused, "runner": runner, "wall_s": round(wall_s, 3),
    }


def _write_outputs(res: Resolved, manifest: dict, shards: list[dict]) -> None:
    """hits.jsonl (every shard's hits in order, one shard in memory at a time), rejects.jsonl, the manifest; then
    no hit shard or record the manifest does not list."""
    output = res.plan.output
    names = [s["name"] for s in manifest["shards"]]
    drawn: list[pd.DataFrame] = []  # the hits of the page's queries (the first ones: the first shards')
    with tempfile.TemporaryFile() as tmp:  # one shard in memory at a time, whatever the number of queries
        for name in names:
            table = pq.read_table(io.BytesIO(files.read_bytes(files.join(output, HITS_DIR, name))))
            tmp.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in table.to_pylist()).encode())
            if sum(d["query_id"].nunique() for d in drawn) < res.plan.page_queries:
                drawn.append(table.to_pandas())
        tmp.seek(0)
        files.write_atomic_stream(files.join(output, HITS_JSONL), tmp)
    if res.plan.page_queries:
        _write_page(res, manifest, pd.concat(drawn) if drawn else None)
    elif files.exists(files.join(output, HITS_HTML)):  # an earlier run's page would show other hits as this run's
        FileSystems.delete([files.join(output, HITS_HTML)])
    rejects = _rejects(res, shards)
    files.write_atomic(files.join(output, REJECTS_JSONL),
                       "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects).encode("utf-8"))
    files.write_json_atomic(files.join(output, QUERY_MANIFEST), manifest)
    for sub, suffix in ((HITS_DIR, ""), (PROGRESS_DIR, ".json")):
        found = files.list_files(files.join(output, sub))
        stale = sorted(files.join(output, sub, n) for n in found if n not in {x + suffix for x in names})
        if stale:
            FileSystems.delete(stale)


def _write_page(res: Resolved, manifest: dict, hits) -> None:
    """hits.html: the first --page-queries queries and their hits as retrieval_core.pages draws them (a staged
    image's thumbnail or scene description, a caption's text); the header names what was asked of what by
    relative paths or folder names only."""
    plan, q = res.plan, manifest["queries"]
    what = {"t2i": "text queries -> images", "i2t": "image queries -> captions"}[plan.direction]
    mode = res.mode + (f" (lam {res.lam:g})" if manifest["lam"] is not None else "") \
        + (f", chosen by {shown_path(plan.tune_on)}" if res.fusion_choice else "")
    searched = {d: (f"{s['name']} index {shown_path(s['path'])}" if s["kind"] == "index" else "exact search")
                for d, s in res.inputs.searchers.items()}
    facts = [f"{what} of {shown_path(res.queries_file['path'])}: {q['in']} in = {q['answered']} answered + "
             f"{q['rejected']} rejected (rejects.jsonl)",
             f"top {plan.k} by {mode}; {searched[plan.direction]}",
             f"staged folder {shown_path(plan.staged)}; embeddings {shown_path(plan.embeddings)}; BE model "
             f"{shown_path(manifest['be_model']['path'])}"
             + (f"; CE model {shown_path(manifest['ce_model']['path'])}" if manifest["ce_model"] else "")]
    pictures = {query.id: query.image for batches in res.shards.values() for b in batches for query in b.queries
                if query.picture}
    if hits is None:
        hits = pd.DataFrame(columns=list(HIT_COLUMNS))
    views = ItemViews(StagedDataset(plan.staged, files=files.BEAM_FILES))
    text = hits_page(first_queries(hits, plan.page_queries), views, f"Hits: {shown_path(plan.output)}", facts,
                     q["answered"], pictures)
    files.write_atomic(files.join(plan.output, HITS_HTML), text.encode("utf-8"))


def _report(res: Resolved, manifest: dict) -> None:
    q, inp = manifest["queries"], res.inputs
    reasons = ", ".join(f"{n} {r}" for r, n in q["rejected_by_reason"].items())
    print(f"queries in: {q['in']} = {q['answered']} answered + {q['rejected']} rejected"
          + (f" ({reasons})" if reasons else "") + f"; {q['truncated']} cut to the model's length")
    mode = res.mode + (f" (lam {res.lam})" if manifest["lam"] is not None else "")
    if res.fusion_choice:
        mode += f", chosen by {res.plan.tune_on}"
    search = "; ".join(f"{d}: {s}" for d, s in manifest["search"].items())
    print(f"{res.plan.direction}: top {res.plan.k} by {mode}; {search}; device: {describe_device(inp.device)}")
    print(f"hits: {files.join(res.plan.output, HITS_JSONL)} and {files.join(res.plan.output, HITS_DIR)}/ "
          f"({len(manifest['shards'])} shard(s), {manifest['shards_reused']} kept from an earlier run of this plan); "
          f"rejects: {files.join(res.plan.output, REJECTS_JSONL)}; wall time {manifest['wall_s']:.1f} s")
    if res.plan.page_queries:
        shown = min(res.plan.page_queries, manifest["queries"]["answered"])
        print(f"page: {files.join(res.plan.output, HITS_HTML)} (the hits of {shown} queries, drawn)")


@click.command(context_settings=beam_kit.BEAM_CLI_CONTEXT)
@plan_options(QueryPlan)
@click.pass_context
def main(ctx, **values):
    """Your own text queries (--queries) or image queries (--image-ids, --images) against a built index: the BE's
    top k per query, reranked by the CE, as hits (query id, rank, item id, BE, CE and final score) in Parquet
    and JSON lines. Unknown --flags go to Beam (--runner, --dask_client_address, ...).

    Counters namespace: query (queries_answered, queries_rejected, hits_written)."""
    beam_kit.configure_logging()
    with cli_errors(QueryJobError, QueryError, memory_options=("--batch-size", "--queries-per-batch"), job="query"):
        beam_kit.check_beam_flags(ctx.args)
        run(plan_from_cli(QueryPlan, values), tuple(ctx.args))


beam_kit.add_progress_help(main)


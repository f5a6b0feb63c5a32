"""``python -m pipelines.rerank``: BE retrieval (+ CE reranking) of every query of a split, in both directions.

The launcher runs a search job (each group of queries one pass over the pool, its candidates written to a
file), then the CE graph in waves of output shards (one Beam job each; a killed run keeps every finished
shard and candidates file whose record matches the plan), then writes rankings_manifest.json (the run contract that
``retrieval_core.evaluation.runs`` reads). docs/ARCHITECTURE.md describes the graph, resume and determinism.

    python -m pipelines.rerank --staged S --embeddings E --index I --ce-model M --mode co --k 20 --output OUT
"""
from __future__ import annotations

import io
import logging
import time
from dataclasses import replace
from typing import Callable, Mapping, Optional, Sequence

import apache_beam as beam
import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from pipelines import beam_kit, files
from pipelines.handlers import prepare_token_ids
from pipelines.rerank.auto import dev_pass_plan, resolve_auto, sampled_queries
from pipelines.rerank.graph import (
    METRICS_NAMESPACE,
    build_graph,
    build_search_graph,
    candidates_name,
    group_of,
    pool_shard_count,
    write_shard,
)
from pipelines.rerank.plan import (
    AUTO,
    CANDIDATES_DIR,
    PROGRESS_DIR,
    TUNE_DIR,
    RerankError,
    RerankPlan,
    Resolved,
    SearcherSpec,
    candidates_ledger,
    progress_ledger,
    resolve,
    shard_pairs,
)
from retrieval_core.cli import cli_errors, describe_device, plan_from_cli, plan_options
from retrieval_core.data import schema
from retrieval_core.data.outputs import holds_output
from retrieval_core.data.store import StagedDataset
from retrieval_core.memory import require_headroom, weights_bytes
from retrieval_core.search import rerank

log = logging.getLogger(__name__)

CREATED_BY = "pipelines.rerank"


def _expected_shards(res: Resolved) -> dict[str, tuple[str, np.ndarray]]:
    """{shard name: (direction, its query ids)} of every ranking shard of the run, in name order."""
    out = {}
    for d, ids in res.query_ids.items():
        n = res.out_shards[d]
        shard = ids % n
        order = np.argsort(shard, kind="stable")  # ids stay sorted within a shard
        parts = np.split(ids[order], np.cumsum(np.bincount(shard, minlength=n))[:-1])
        for i, part in enumerate(parts):
            out[files.shard_name(d, i, n, ".parquet")] = (d, part)
    return dict(sorted(out.items()))


def plan_waves(names: Sequence[str], pairs_of: Callable[[str], int], shards_per_wave: int,
               pairs_per_wave: int) -> list[list[str]]:
    """The shards, in order, cut into waves (one Beam job each) of at most ``shards_per_wave`` shards and
    ``pairs_per_wave`` CE pairs (a wave of one shard may hold more). A local runner holds a wave's CE pairs,
    with their texts, candidates and scores, in memory: capping pairs, not just shards, keeps a rerank
    process's memory flat in the number of queries (what one uncapped wave held: docs/ARCHITECTURE.md)."""
    waves: list[list[str]] = []
    pairs = 0
    for name in names:
        n = pairs_of(name)
        if not waves or len(waves[-1]) >= shards_per_wave or pairs + n > pairs_per_wave:
            waves.append([])
            pairs = 0
        waves[-1].append(name)
        pairs += n
    return waves


def _finished_shards(res: Resolved, expected: Mapping[str, tuple[str, np.ndarray]]) -> dict[str, dict]:
    """The shards an earlier run of the same plan finished (the ledger: a progress record with this plan's
    fingerprint and the shard's query count, and a shard file that still matches its sha256)."""
    ledger = progress_ledger(res.plan.output, res.fingerprint)
    done = {}
    for name, (_d, ids) in expected.items():
        rec = ledger.finished(name, queries=len(ids))
        if rec is not None:
            done[name] = rec.fields("kind", "direction", "name", "queries", "rows", "sha256")
    return done


def search(options, res: Resolved, expected: Mapping[str, tuple[str, np.ndarray]],
           finished: Mapping[str, dict]) -> tuple[dict[str, dict], int, Optional[dict]]:
    """The search job: every search group holding a query of an unfinished shard, unless an earlier run of
    this plan left its candidates file. Returns ({file name: record} of the groups the waves read, groups
    searched now, Beam counters)."""
    output = res.plan.output
    needed: dict[str, set] = {}
    for name, (d, ids) in expected.items():
        if name not in finished and len(ids):
            needed.setdefault(d, set()).update(group_of(q, 0, res.search_groups[d]) for q in ids.tolist())
    have, todo = {}, {}
    ledger = candidates_ledger(output, res.fingerprint)
    for d, groups in needed.items():
        for g in sorted(groups):
            name = candidates_name(d, g, res.search_groups[d])
            rec = ledger.finished(name)
            if rec is None:
                todo.setdefault(d, set()).add(g)
            else:
                have[name] = rec.fields("kind", "direction", "name", "queries", "sha256")
    if not todo:
        return have, 0, None
    total = sum(len(g) * pool_shard_count(res.searchers[d]) for d, g in todo.items())
    with beam_kit.Progress.running(total, "pool shards", "search", options):
        report, counters = _run_job(options, output, lambda p: build_search_graph(
            p, res, {d: frozenset(g) for d, g in todo.items()}))
    have.update((item["name"], item) for item in report)
    return have, sum(len(g) for g in todo.values()), counters


@holds_output("rerank")
def run(plan: RerankPlan, beam_args: tuple[str, ...] = ()) -> Optional[dict]:
    """Run the plan's Beam jobs, the search and one per wave of unfinished shards, and write
    rankings_manifest.json; returns the manifest, or None for a dry run (--dry_run: DataflowRunner translated
    the search job's graph and a wave's, and nothing ran; no output is read or written)."""
    t0 = time.time()
    options = beam_kit.pipeline_options(beam_args)
    ce = plan.ce_model or plan.be_model
    require_headroom("rerank", plan.threads, ("--threads", "--model-copies", "--batch-size", "--pairs-per-wave"),
                     weights_bytes(ce) * (plan.model_copies or 1) if ce else 0)
    res, fusion_choice = _resolve(plan, beam_args, options)
    if beam_kit.is_dry_run(options):
        return _dry_run(options, res)
    expected = _expected_shards(res)
    finished = _finished_shards(res, expected)
    files.makedirs(res.plan.output)
    manifest_path = files.join(res.plan.output, rerank.RANKINGS_MANIFEST)
    if files.exists(manifest_path):  # until this run finishes, the directory holds no complete run
        FileSystems.delete([manifest_path])
    # the pool is read once per search group, before the waves: they read the candidates files
    candidates, passes, beam_counters = search(options, res, expected, finished)
    if passes:
        groups = ", ".join(f"{d}: {n}" for d, n in res.search_groups.items())
        print(f"search: {passes} pass(es) over the pools (search groups {groups}; --queries-per-pass "
              f"{res.plan.queries_per_pass})", flush=True)
    shards, counts, waves_run, beam_counters = _run_waves(options, res, expected, finished, candidates,
                                                          beam_counters)
    if waves_run or passes:
        print(beam_kit.counter_line(METRICS_NAMESPACE, beam_counters, beam_kit.runner_name(options)))
    manifest = _manifest(res, [shards[name] for name in expected], len(finished), waves_run, counts,
                         beam_kit.runner_name(options), time.time() - t0)
    manifest["search_passes"] = passes
    manifest["fusion_choice"] = fusion_choice
    _write_run(res, manifest, set(expected))
    _report(res, manifest, counts, len(expected), len(finished), waves_run)
    return manifest


def _resolve(plan: RerankPlan, beam_args: tuple[str, ...], options) -> tuple[Resolved, Optional[dict]]:
    """The plan resolved against its inputs (--mode auto: the fusion chosen on the dev run, made first when
    --tune-embeddings asks for it) and the choice; the captions' token ids prepared once for the CE."""
    if plan.mode == AUTO and plan.tune_embeddings and not beam_kit.is_dry_run(options):
        plan = replace(plan, tune_on=dev_pass(plan, beam_args), tune_embeddings=None, tune_index=None)
    plan, fusion_choice = resolve_auto(plan)
    res = resolve(plan)
    if res.ce_k and not beam_kit.is_dry_run(options):  # each caption tokenised once, not per batch and wave
        res = replace(res, token_fingerprint=prepare_token_ids(StagedDataset(plan.staged, files=files.BEAM_FILES),
                                                               plan.cross_encoder))
    if fusion_choice is not None:
        fusion_choice["pool_size"] = dict(res.pools)
        dev_pools = fusion_choice.get("dev_pool_size") or {}
        for d, n in res.pools.items():
            if d in dev_pools and not 0.8 <= dev_pools[d] / max(n, 1) <= 1.25:
                log.warning("--mode auto: the %s dev pool (%d) is not the size of this run's pool (%d): the choice "
                            "was made at another pool size", d, dev_pools[d], n)
    return res, fusion_choice


def _run_waves(options, res: Resolved, expected: Mapping[str, tuple[str, np.ndarray]], finished: Mapping[str, dict],
               candidates: Mapping[str, dict], beam_counters: Optional[dict]) -> tuple[dict, dict, int, Optional[dict]]:
    """One Beam job per wave of unfinished shards: ({shard name: info} of every shard, finished ones included,
    the CE pair counts, the waves run, the Beam counters so far)."""
    plan = res.plan
    waves = plan_waves(list(expected), lambda name: shard_pairs(res, *expected[name]), plan.shards_per_wave,
                       plan.pairs_per_wave)
    shards, counts, waves_run = dict(finished), {"ce_pairs_requested": 0, "ce_pairs_scored": 0}, 0
    with beam_kit.Progress.running(*_progress_total(res, expected, finished), options):
        for wave_names in waves:
            todo = [name for name in wave_names if name not in finished]
            for name in [n for n in todo if len(expected[n][1]) == 0]:  # no query hashed here (tiny runs)
                shards[name] = write_shard(plan.output, name, expected[name][0], [], [], res.fingerprint)
            todo = [name for name in todo if len(expected[name][1])]
            if not todo:
                continue
            wave_counters = _run_wave(options, res, expected, todo, candidates, shards, counts)
            beam_counters = beam_kit.add_counters(beam_counters, wave_counters)
            waves_run += 1
    return shards, counts, waves_run, beam_counters


def _run_wave(options, res: Resolved, expected: Mapping[str, tuple[str, np.ndarray]], todo: list[str],
              candidates: Mapping[str, dict], shards: dict, counts: dict) -> Optional[dict]:
    """One wave's job: its shards' infos into ``shards``, its CE pair counts into ``counts``; its Beam counters."""
    wave: dict[str, set] = {}
    for name in todo:
        d, ids = expected[name]
        wave.setdefault(d, set()).update(ids.tolist())
    report, wave_counters = _run_job(options, res.plan.output, lambda p: build_graph(
        p, res, {d: frozenset(ids) for d, ids in wave.items()}, candidates))
    for item in report:
        if item["kind"] == "count":
            counts[item["name"]] += int(item["value"])
        elif item["kind"] == "shard":
            shards[item["name"]] = item
    for name in todo:
        got = shards.get(name, {}).get("queries")
        if got != len(expected[name][1]):
            raise RerankError(f"{name}: {got} queries ranked, {len(expected[name][1])} expected")
    return wave_counters


def _write_run(res: Resolved, manifest: dict, names: set[str]) -> None:
    """The run contract: rankings_manifest.json, then no ranking file it does not list and no candidates."""
    output = res.plan.output
    files.write_json_atomic(files.join(output, rerank.RANKINGS_MANIFEST), manifest)
    _delete_unlisted(output, names)
    files.remove_tree(files.join(output, CANDIDATES_DIR))  # the rankings hold every candidate now


def _report(res: Resolved, manifest: dict, counts: dict, n_shards: int, n_kept: int, waves_run: int) -> None:
    plan = res.plan
    for d in plan.directions:
        print(f"{d}: {manifest['queries'][d]} queries ranked ({res.described[d]}, pool {res.pools[d]})")
    if plan.cross_encoder:
        overlap = " (t2i/i2t overlap scored once)" if len(plan.directions) == 2 else ""
        print(f"CE: {counts['ce_pairs_scored']} unique pairs scored for {counts['ce_pairs_requested']} "
              f"requested{overlap}; device: {describe_device(plan.device)}")
    print(f"rankings: {files.join(plan.output, rerank.RANKINGS_SUBDIR)} ({n_shards} shard(s): {n_kept} "
          f"kept from an earlier run of this plan, {n_shards - n_kept} computed in {waves_run} wave(s)); "
          f"wall time {manifest['wall_s']:.1f} s")


def dev_pass(plan: RerankPlan, beam_args: tuple[str, ...]) -> str:
    """--mode auto with --tune-embeddings: rank a seeded sample of the dev split's queries with CO into
    <output>/_tune (a run of its own, resumable like any) and return it: the run the ranking is chosen on."""
    out = files.join(plan.output, TUNE_DIR)
    sample = sampled_queries(plan, plan.tune_split, plan.tune_queries)
    table = pa.table({"direction": pa.array([d for d, ids in sample.items() for _ in ids], pa.string()),
                      "query_id": pa.array(np.concatenate(list(sample.values())), pa.int64())})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    queries = files.join(out, "queries.parquet")
    files.makedirs(out)
    files.write_atomic(queries, buf.getvalue())
    print(f"--mode auto: ranking {', '.join(f'{len(q)} {d}' for d, q in sample.items())} sampled {plan.tune_split} "
          f"queries with co to choose on ({out})", flush=True)
    run(dev_pass_plan(plan, queries, out), beam_args)
    return out


def _progress_total(res: Resolved, expected: Mapping[str, tuple[str, np.ndarray]],
                    finished: Mapping[str, dict]) -> tuple[int, str, str]:
    """(total, unit, label) of the terminal bar over every wave: queries for EMB, else the (query, pair) CE
    requests of the unfinished shards (an upper bound when an index returns fewer than k candidates)."""
    todo = [expected[name] for name in expected if name not in finished]
    if not res.ce_k:
        return sum(len(ids) for _, ids in todo), "queries", "rerank"
    return sum(shard_pairs(res, d, ids) for d, ids in todo), "pairs", "rerank CE"


def _dry_run(options, res: Resolved) -> None:
    """--dry_run: translate the search job and one wave of every query (what Dataflow would be sent); nothing
    is read or written."""
    p = beam.Pipeline(options=options)
    build_search_graph(p, res, {d: frozenset(range(n)) for d, n in res.search_groups.items()})
    beam_kit.run_pipeline(p)
    p = beam.Pipeline(options=options)
    candidates = {candidates_name(d, g, n): {"direction": d, "sha256": ""}
                  for d, n in res.search_groups.items() for g in range(n)}
    build_graph(p, res, {d: frozenset(q.tolist()) for d, q in res.query_ids.items()}, candidates)
    beam_kit.run_pipeline(p)
    print(f"dry run: the search job and the rerank graph of {sum(len(q) for q in res.query_ids.values())} "
          f"queries are translated for {beam_kit.runner_name(options)}; nothing runs")


def _run_job(options, output: str, build: Callable[[beam.Pipeline], None]) -> tuple[list[dict], Optional[dict]]:
    """One Beam job (the search, or a wave) whose graph ``build`` adds: its run report and Beam counters."""
    p = beam.Pipeline(options=options)
    build(p)
    beam_kit.clear_run_dir(output)  # a killed run's report must not be read as this one's
    result = beam_kit.run_pipeline(p)
    report = beam_kit.read_run_report(output)
    beam_kit.clear_run_dir(output)
    counters = beam_kit.counter_values(result, METRICS_NAMESPACE)
    del p, result
    # a local runner ran the job in this process: hand what it freed back before the next one (it lowers the
    # RSS between waves, not the job's peak: docs/log/PERFORMANCE-2026-11.md)
    beam_kit.release_memory()
    return report, counters


def _params_used(plan: RerankPlan, spec: SearcherSpec) -> dict:
    if spec.kind != "index":
        source = "exact search"
    elif plan.nprobe is not None or plan.ef_search is not None:
        source = "command line"
    else:
        source = "index manifest" if spec.params else "faiss defaults"
    return {"params": dict(spec.params), "source": source}


def _manifest(res: Resolved, shards: list[dict], reused: int, waves_run: int, counts: dict, runner: str,
              wall_s: float) -> dict:
    plan = res.plan
    return {
        "schema_version": schema.RANKINGS_SCHEMA_VERSION, "created_by": CREATED_BY,
        "mode": plan.mode, "k": plan.k, "lam": plan.applied_lam, "directions": list(plan.directions),
        "candidates": {d: min(res.candidates[d], res.pools[d]) for d in plan.directions},
        "ce_depth": {d: min(res.ce_k, res.pools[d]) for d in plan.directions},
        "collection": plan.collection, "split": plan.split, "staged": plan.staged,
        "staged_sha256": dict(res.staged_sha256 or {}), "embeddings": plan.embeddings,
        "be_model": dict(res.be_model), "ce_model": plan.cross_encoder,
        # the CE score key the ce_score column holds (model.CE_SCORES: logit_diff = log-odds, logit1 = MMT's)
        "ce_score_key": res.ce_score_key,
        "quantize": plan.precision,  # the serving precision of the CE scores (schema.QUANTIZE_CHOICES)
        "device": plan.device if plan.cross_encoder else None,  # where the CE scored (--device, auto resolved)
        "search": dict(res.described),
        "search_params": {"nprobe": plan.nprobe, "efSearch": plan.ef_search},
        # what each direction's search ran with, and where it came from
        "search_params_used": {d: _params_used(plan, res.searchers[d]) for d in plan.directions},
        "pool_size": dict(res.pools),
        "queries": {d: len(q) for d, q in res.query_ids.items()}, "queries_file": res.queries_file,
        "plan_fingerprint": res.fingerprint,
        "shards": [{key: s[key] for key in ("direction", "name", "queries", "rows", "sha256")} for s in shards],
        "shards_reused": reused, "waves_run": waves_run,
        "queries_per_shard": plan.queries_per_shard, "shards_per_wave": plan.shards_per_wave,
        "pairs_per_wave": plan.pairs_per_wave, "queries_per_pass": plan.queries_per_pass,
        # CE work of this invocation (a resumed run scores only the pairs of the shards it computed)
        "ce_pairs_requested": counts["ce_pairs_requested"], "ce_pairs_scored": counts["ce_pairs_scored"],
        "runner": runner, "wall_s": round(wall_s, 3),
    }


def _delete_unlisted(output: str, keep: set[str]) -> None:
    """Delete ranking files and progress records the new manifest does not list: shards of an earlier run
    with another shard count or other directions, and temp files of a killed run. Called only after the new
    shards and manifest are written, so the directory never lacks a shard the manifest on disk lists."""
    from apache_beam.io.filesystems import FileSystems

    for sub, suffix in ((rerank.RANKINGS_SUBDIR, ""), (PROGRESS_DIR, ".json")):
        pattern = files.join(output, sub, "*")
        found = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]
        stale = sorted(path for path in found if path.rsplit("/", 1)[-1] not in {n + suffix for n in keep})
        if stale:
            FileSystems.delete(stale)
            log.info("deleted %d file(s) of an earlier run: %s", len(stale), stale[:5])


@click.command(context_settings=beam_kit.BEAM_CLI_CONTEXT)
@plan_options(RerankPlan)
@click.pass_context
def main(ctx, **values):
    """BE retrieval (+ CE reranking) of every query of a split, in both directions, as Beam jobs.
    Unknown --flags go to Beam (--runner, --dask_client_address, ...).

    Counters namespace: rerank (queries_searched, ce_pairs_scored, ce_pair_requests, queries_ranked,
    ranking_shards_written)."""
    beam_kit.configure_logging()
    with cli_errors(RerankError, memory_options=("--batch-size", "--pairs-per-wave"), job="rerank"):
        beam_kit.check_beam_flags(ctx.args)
        run(plan_from_cli(RerankPlan, values), tuple(ctx.args))


beam_kit.add_progress_help(main)

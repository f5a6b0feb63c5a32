"""Latency and total evaluation time (paper Tables 3 and 4), ours against the paper's code path.

Per-query latency (Table 3): one text query (encoded by the real model, included in the time) against
N pre-encoded items, N in 1k..1M. The item vectors are synthetic: real image embeddings of ``base_images``
synthetic images, each replicated with Gaussian jitter and renormalised, so the collection has realistic
cluster structure (pure random unit vectors would make every ANN index look useless) and every item maps
to a real image whose regions the CE scores. Methods:
  EMB-Flat   query encode + exact FAISS inner-product top-10
  EMB-Exact  query encode + retrieval_core.search.exact.exact_topk (the project's exact search, kernel by batch)
  EMB-bound  the memory-bandwidth bound of one exact scan: collection bytes / read bandwidth measured in the
             same run over the same array (read_bandwidth)
  EMB-<ANN>  query encode + IVF-Flat / IVF-SQ8 / HNSW32 top-10, nprobe / efSearch the smallest of
             index_choice's sweep reaching recall@10 >= recall_target against exact search, measured with
             other-modality (caption) queries via faiss.contrib.evaluation.knn_intersection_measure; HNSW only
             up to hnsw_max_n items (its build at 1M takes many minutes on 2 cores)
Every EMB row also records ``search_p50_ms``: the search alone on pre-encoded queries.
  CO k       EMB-Flat top-k + one batched CE call over the k pairs + final ranking
  CE         CE over the whole collection: measured when it fits ``ce_measure_budget_s``, else extrapolated
             from the measured batched per-pair cost (measured=false)
  entry point EMB / CO  the Python query entry point (retrieval_core.search.query, docs/QUERY.md) over a Flat index
             of ``entry_point_images`` staged images, one text query per call, BE only and BE top-k + CE at
             ``entry_point_k``: what a user of ``QueryEngine.search_text`` waits for
p50/p95/p99 over ``reps`` queries after ``warmup`` queries, with torch and faiss threads fixed.

The paper's code path, measured in the same run (model "paper-code"): brute-force cosine with torch.mm +
topk over all items, and a Python loop of one CE call per (query, candidate) pair. Our rows carry the
ratio paper-code / ours in ``speedup_vs_paper_code``.

Total evaluation time (Table 4): a COCO-style collection of N images with 5 captions each, every caption a
t2i query and every image an i2t query, encoding included. Settings whose estimate (from measured unit
costs) fits the remaining ``eval_budget_s`` are run as the pipeline jobs a user would run (pipelines.encode,
build_index, rerank with --mode emb / co / ce, then benchmarks.evaluate.evaluate_run); their row's wall_s
is the sum of those jobs' wall times (staging excluded: it is data preparation, not evaluation),
measured=true. The others are extrapolated from the unit costs and marked measured=false with the formula
in the notes.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from benchmarks.meters.roofline import UnitBench, measure_unit_costs, roofline_rows, training_rows
from benchmarks.report import PAPER_CODE_MODEL, environment, set_threads
from benchmarks.suites import jobs
from benchmarks.suites.jobs import JOB_START_S
from benchmarks.suites.per_query import per_query_latency
from benchmarks.suites.planner import Planner
from benchmarks.suites.rows import evaluate_row
from benchmarks.suites.suites import MODE_LABELS
from pipelines.beam_kit import pipeline_options, runner_name
from pipelines.encode.plan import EncodePlan
from pipelines.encode.run import run as run_encode
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.collection import synthetic_collection
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.model.quantize import quantize_model
from retrieval_core.training.recipes import BENCH_RECIPE, DEMO_RECIPE

EVAL_CAPTIONS_PER_IMAGE = 5


@dataclass
class LatencyConfig:
    sizes: Sequence[int] = (1_000, 10_000, 100_000, 1_000_000)
    eval_sizes: Sequence[int] = (1_000, 5_000, 100_000)
    ks: Sequence[int] = (10, 20, 50)
    reps: int = 20
    warmup: int = 3
    paper_reps: int = 3  # the paper-code path is slow; fewer repetitions
    threads: Optional[int] = None  # None = keep torch's current setting
    anns: Sequence[str] = ("IVF-Flat", "IVF-SQ8", "HNSW32")  # ANN rows (ann_factory); IVF nlist from N
    recall_target: float = 0.99  # nprobe / efSearch: the smallest of index_choice's sweep reaching it
    hnsw_max_n: int = 100_000  # HNSW build is ~O(N log N) graph inserts: 1M on 2 cores is many minutes
    roofline: bool = True  # CE/BE rates against the GEMM roofline, fp32 and int8
    train_steps: int = 5  # training rows: timed steps per recipe and precision (0: no training rows)
    pipeline_overhead_images: int = 5_000  # pipelines.encode vs the raw model on this many images (0: skip)
    entry_point_images: int = 5_000  # the query entry point's per-query time over this many indexed images (0: skip)
    entry_point_k: int = 20  # its depth: BE top k, CE-scored in the BE+CE row
    # job path vs model alone (benchmarks.meters.feeding) on this many pairs / images (0: skip)
    feeding_items: int = 5_000
    base_images: int = 2000
    jitter: float = 0.5  # noise norm relative to the unit base vector: larger = harder for ANN
    recall_queries: int = 200
    ce_measure_budget_s: float = 20.0  # measure whole-collection CE per query when it takes less than this
    eval_budget_s: float = 600.0  # end-to-end Table 4 runs allowed within this many seconds in total
    batch_size: int = 128
    seed: int = 0


def quick_config() -> LatencyConfig:
    return LatencyConfig(sizes=(200, 2_000), eval_sizes=(20, 60), ks=(5, 10), reps=5, warmup=1, paper_reps=2,
                         base_images=40, recall_queries=20, ce_measure_budget_s=5.0, eval_budget_s=60.0,
                         pipeline_overhead_images=60, train_steps=2, feeding_items=40, entry_point_images=60,
                         entry_point_k=5)


@dataclass
class _Bench(UnitBench):
    """The JOIN model, the real base images/captions and the unit costs measured once per run (UnitBench), the
    base images' embeddings the per-query collections are jittered from, and the suite's config."""
    base_vecs: Optional[np.ndarray] = None
    cfg: Optional[LatencyConfig] = None


def pipeline_overhead_rows(b: _Bench, cfg, beam_args, log, n: int = 5_000) -> list[dict]:
    """pipelines.encode (images, Beam, in-process: what the job runs after its start-up) against the raw
    model's encode_image on the same staged images, batch size and threads, back to back in one run.

    Two rows: the whole job (reading and decoding staged shards, batching, writing shards + manifest) and its
    model time alone (RunInference's batch latencies), each as a fraction of the raw rate; the notes split
    the job's wall time into model time, the staged-shard reads (timed by reading every shard once more, as
    the job does) and the rest."""
    p = Planner(replace(cfg, suite="latency"))
    manifest, images = eval_manifest(n)
    st = p.stage(manifest, images=images)
    jobs.JobRunner(tuple(beam_args), log, preload=False).run(st.job)
    ds = StagedDataset(st.path)
    table = ds.load_images()
    m, bs = b.model, b.cfg.batch_size
    m.encode_image(table.take(range(min(len(table), bs))), batch_size=bs)  # warm-up, as the pipeline's load
    m.reset_token_counts()
    t0 = time.perf_counter()
    m.encode_image(table, batch_size=bs)
    raw_s = time.perf_counter() - t0
    raw_useful = m.token_counts["be"].fraction
    t0 = time.perf_counter()
    for rel in ds.shard_names("images"):  # what encode's read step does per shard (checksum, decode, to float32)
        ds.read_image_shard(rel)
    read_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="encode-overhead-", dir=cfg.root) as out:
        t0 = time.perf_counter()
        summary = run_encode(EncodePlan(st.path, cfg.models.join, out, modality="image", batch_size=bs,
                                        threads=b.env.get("threads")), tuple(beam_args))
        beam_s = time.perf_counter() - t0
    n_img = len(table)
    image = summary["modalities"]["image"]
    if image["encoded"] != n_img:
        raise RuntimeError(f"pipeline overhead: encode wrote {image['encoded']} of {n_img} images")
    model_s = image["metrics"].get("inference_batch_latency_micro_secs", (0, 0))[0] / 1e6
    beam_useful = image["metrics"].get("useful_tokens", 0) / max(1, image["metrics"].get("computed_tokens", 0))
    raw, beam_rate, model_rate = n_img / raw_s, n_img / beam_s, n_img / model_s
    rest_s = beam_s - model_s - read_s
    log(f"pipeline overhead: encode through Beam {beam_rate:,.0f} images/s vs raw model {raw:,.0f} images/s "
        f"= {beam_rate / raw:.2f}x; its model time alone {model_rate:,.0f} images/s = {model_rate / raw:.2f}x; "
        f"wall {beam_s:.1f} s = model {model_s:.1f} + staged reads {read_s:.1f} + rest {rest_s:.1f}")
    split = (f"wall {beam_s:.1f} s = model time {model_s:.1f} s + reading and decoding the staged shards "
             f"{read_s:.1f} s (timed apart: every shard read once as the job does) + the rest {rest_s:.1f} s "
             f"(graph start, batching, writing embedding shards and the manifest)")
    common_cols = dict(collection="pipeline_overhead", collection_size=n_img, model="JOIN", measured=True)
    raw_note = (f"VLRetrievalModel.encode_image on the same {n_img:,} staged images already in memory "
                f"({raw:,.0f} images/s, {raw_s:.1f} s, useful tokens {raw_useful:.3f}), batch {bs}, back to back")
    common_cols["useful_token_fraction"] = beam_useful  # Beam's batches, counted by the handler
    return [b.row(mode="encode images (Beam)", rate_per_s=beam_rate, roofline_fraction=beam_rate / raw,
                 wall_s=beam_s, **common_cols,
                 notes=(f"pipelines.encode.run (modality image, {common_runner(beam_args)}, in-process: no job "
                        f"start-up; reads staged shards, writes embedding shards + manifest) vs {raw_note}; "
                        f"roofline_fraction = Beam / raw; {split}")),
            b.row(mode="encode images (Beam, model time)", rate_per_s=model_rate,
                 roofline_fraction=model_rate / raw, wall_s=model_s, **common_cols,
                 notes=(f"the same job's RunInference batch latencies summed ({image['metrics'].get('num_inferences')}"
                        f" images) vs {raw_note}: what Beam's batching costs the model itself"))]


def entry_point_rows(b: _Bench, cfg, beam_args, log, n: int) -> list[dict]:
    """The Python query entry point (retrieval_core.search.query.QueryEngine, docs/QUERY.md) as a user runs it: the
    Table 4 collection of ``n`` images staged, its images encoded (pipelines.encode) and indexed (Flat), the engine
    opened once and warmed, then one text query per call (the staged captions, one per image), BE only and BE + CE
    at ``entry_point_k``: query encoding, search, CE, fusion and the hits' DataFrame included."""
    from benchmarks.suites.per_query import _percentiles, _timed
    from pipelines.build_index.plan import IndexPlan
    from pipelines.build_index.run import run as run_index
    from retrieval_core.search.query import Query, QueryEngine

    lcfg, k = b.cfg, b.cfg.entry_point_k
    p = Planner(replace(cfg, suite="latency"))
    manifest, images = eval_manifest(n)
    st = p.stage(manifest, images=images)
    jobs.JobRunner(tuple(beam_args), log, preload=False).run(st.job)
    with tempfile.TemporaryDirectory(prefix="entry-point-", dir=cfg.root) as out:
        emb, index = f"{out}/emb", f"{out}/index"
        run_encode(EncodePlan(st.path, cfg.models.join, emb, modality="image", batch_size=lcfg.batch_size,
                              threads=b.env.get("threads")), tuple(beam_args))
        run_index(IndexPlan(embeddings=emb, output=index, modality="image", factory="Flat"), tuple(beam_args))
        t0 = time.perf_counter()
        engine = QueryEngine(staged=st.path, embeddings=emb, index=index, device=cfg.device,
                             threads=b.env.get("threads"), directions=("t2i",)).load(("t2i",), warm=True)
        load_s = time.perf_counter() - t0
        caps = StagedDataset(st.path).captions().drop_duplicates("image_item_id")
        queries = [Query(str(c), t) for c, t in zip(caps["caption_id"], caps["text"])]
        need = lcfg.reps + lcfg.warmup
        queries = (queries * (need // max(1, len(queries)) + 1))[:need]
        rows = []
        for mode, label in (("emb", "entry point EMB"), ("co", "entry point CO")):
            t = _timed(lambda i, mode=mode: engine.search_text([queries[i]], k=k, rerank=mode), lcfg.reps,
                       lcfg.warmup)
            log(f"entry point: {label} k={k} over {engine.inputs.searchers['t2i']['pool']:,} images: "
                f"p50 {np.median(t) * 1000:.1f} ms")
            rows.append(b.row(mode=label, k=k, collection="entry_point", collection_size=n, model="JOIN",
                              measured=True, **_percentiles(t), index_s=load_s,
                              notes=(f"retrieval_core.search.query.QueryEngine.search_text, one text query per call "
                                     f"(the staged captions, one per image), "
                                     f"{'BE only' if mode == 'emb' else f'BE top {k} + one CE call over its {k} pairs'}"
                                     f", over a Flat index of the {n:,} staged images; query encoding, search, "
                                     f"CE, fusion and the hits' DataFrame included; index_s: the engine's load "
                                     f"(models, index, staged regions), {load_s:.1f} s")))
    return rows


def job_vs_model_rows(b: _Bench, cfg, log, n: int) -> list[dict]:
    """benchmarks.meters.feeding's rows for the suite's JOIN model on this machine: the jobs' handler path and the
    library loop against the model alone on the same batches (CE pairs and BE images, ``n`` each), in fp32 and,
    where the device computes it natively, bf16; interleaved in one process so the ratio holds on a shared machine."""
    from benchmarks.meters.feeding import feeding_rows
    from retrieval_core.precision import cpu_has_native_bf16, cuda_bf16_supported

    rows = []
    texts = b.captions["text"].tolist()
    native = cuda_bf16_supported() if b.model.device.type == "cuda" else cpu_has_native_bf16()
    for precision in ("fp32", "bf16") if native else ("fp32",):
        model = VLRetrievalModel.load(cfg.models.join, device=str(b.model.device))
        model = quantize_model(model, "bf16" if precision == "bf16" else None, str(b.model.device))
        rows += feeding_rows(model, cfg.models.join, texts, b.images, n, b.batch_size, precision, reps=3,
                             tasks=("pairs", "images"), log=log,
                             common={**b.env, "suite": b.suite, "model": "JOIN"})
    return rows


def common_runner(beam_args) -> str:
    return runner_name(pipeline_options(list(beam_args)))


def eval_manifest(n: int) -> tuple[str, Optional[int]]:
    """(manifest, images override) of the Table 4 collection of n images: the COCO 5k and 100k analogs as
    staged for the recall suites (shared staging), any other n as synthetic_coco5k cut to n images."""
    if n == 5_000:
        return "synthetic_coco5k", None
    if n == 100_000:
        return "synthetic_100k", None
    return "synthetic_coco5k", n


def _eval_estimates(n: int, k: int, u: dict) -> dict:
    """Seconds and CE pairs of a whole evaluation of n images + 5n captions per method, from unit costs."""
    n_cap = EVAL_CAPTIONS_PER_IMAGE * n
    enc = n * u["image_encode_s"] + n_cap * u["caption_encode_s"]
    co_pairs = (n_cap + n) * min(k, n)  # upper bound: t2i and i2t top-k pairs may overlap
    ce_pairs = n * n_cap  # every (caption, image) pair once serves both directions
    start = 3 * JOB_START_S  # encode, build_index, rerank
    return {"EMB": (enc + start, 0), "CO": (enc + start + co_pairs * u["ce_pair_batched_s"], co_pairs),
            "CE": (enc + start + ce_pairs * u["ce_pair_batched_s"], ce_pairs),
            "paper": {"EMB": enc, "CO": enc + co_pairs * u["ce_pair_single_s"],
                      "CE": enc + ce_pairs * u["ce_pair_single_s"]}, "encode": enc}


def plan_eval_setting(p, n: int, method: str, k: int, pairs: int):
    """Plan the jobs of one whole evaluation (stage, all queries, encode, build_index, rerank) -> (Row, jobs)."""
    manifest, images = eval_manifest(n)
    st = p.stage(manifest, images=images)
    coll = next(iter(st.manifest.collections))
    join = p.cfg.models.join
    q = p.select(st, coll, max_queries=0)
    enc = p.encode(st, join)
    idx = p.index(st, join, enc, "image")
    mode = {"EMB": "emb", "CO": "co", "CE": "ce"}[method]
    # --mode ce requests every (query, item) pair of both directions; t2i and i2t share each pair once
    run = p.rerank(st, "JOIN", join, join, enc, q, mode=mode, k=k, index=idx, pairs=pairs, exhaustive_limit=2 * pairs)
    timing = (("encode_s", enc.name), ("index_s", idx.name), ("rerank_s", run.name))
    row = p.row(collection="eval_total(synthetic_coco)", model="JOIN", mode=MODE_LABELS[mode],
                k=None if method == "EMB" else (k if method == "CO" else "all"), runs=(run.output,), staged=st.path,
                eval_collection=coll, pool_images=st.images[coll], timing=timing,
                notes=(f"pipeline jobs (encode + build_index + rerank --mode {mode} + evaluate; staging excluded), "
                       f"every caption and image a query",))
    return row, [st.job, q, enc, idx, run]


def measured_units(model_dir: str, lcfg: LatencyConfig) -> dict:
    """Seconds per image / caption encoded and per CE pair (batched, single), measured in-process now."""

    set_threads(lcfg.threads)
    return _bench(VLRetrievalModel.load(model_dir), lcfg, {}, lambda m: None).unit


def plan_eval_time(cfg, lcfg: LatencyConfig, unit: dict):
    """--plan: the Table 4 jobs the eval budget allows at the given unit costs (measured_units)."""
    u = unit
    p = Planner(replace(cfg, suite="latency"))
    budget = lcfg.eval_budget_s
    k = 20 if 20 in lcfg.ks else max(lcfg.ks)
    for n in lcfg.eval_sizes:
        est = _eval_estimates(n, k, u)
        for method in ("EMB", "CO", "CE"):
            if est[method][0] <= budget:
                plan_eval_setting(p, n, method, k, est[method][1])
                budget -= est[method][0]
    return p.plan


def eval_time(b: _Bench, cfg, beam_args, log) -> tuple[list[dict], list]:
    """Table 4: total evaluation time of a COCO-style N-image collection, both directions, through the
    pipeline jobs where the budget allows; extrapolated from the unit costs otherwise."""
    lcfg, u = b.cfg, b.unit
    rows = []
    runner = jobs.JobRunner(tuple(beam_args), log, preload=False)  # Table 4 times the commands as typed, with start-up
    budget = lcfg.eval_budget_s
    k = 20 if 20 in lcfg.ks else max(lcfg.ks)
    p = Planner(replace(cfg, suite="latency"))
    for n in lcfg.eval_sizes:
        n_cap = EVAL_CAPTIONS_PER_IMAGE * n
        est = _eval_estimates(n, k, u)
        paper = est["paper"]
        for method in ("EMB", "CO", "CE"):
            base = dict(suite="latency", collection="eval_total(synthetic_coco)", collection_size=n, direction="both",
                        k="" if method == "EMB" else (k if method == "CO" else "all"), queries=n_cap + n)
            wall, pairs = est[method]
            if wall <= budget:
                log(f"eval_time: N={n:,} {method}: estimated {wall:.0f}s, running the pipeline jobs")
                row, needed = plan_eval_setting(p, n, method, k, pairs)
                spent = 0.0
                for job in needed:
                    res = runner.run(job)
                    spent += 0.0 if res.reused else res.wall_s
                budget -= spent
                (r_t2i, r_i2t), _ = evaluate_row(row, runner.results, b.env)
                job_wall = sum(runner.results[name].wall_s for _, name in row.timing)
                rows.append(b.row(**base, model="JOIN", mode=method, measured=True,
                                 **{c: r_t2i[c] for c in ("wall_s", "encode_s", "index_s", "rerank_s", "ce_pairs",
                                                          "peak_rss_mb")},
                                 speedup_vs_paper_code=paper[method] / job_wall if method != "EMB" else "",
                                 notes=f"{row.notes[0]}; mR={r_t2i['mR']:.1f}"))
                log(f"  N={n:,} {method}: {r_t2i['wall_s']:.1f}s measured (jobs + evaluate)")
            else:
                rows.append(b.row(**base, model="JOIN", mode=method, wall_s=wall, measured=False,
                                 ce_pairs=pairs or "",
                                 speedup_vs_paper_code=paper[method] / wall if method != "EMB" else "",
                                 notes=f"extrapolated: encode {n:,} images + {n_cap:,} captions at the measured "
                                       f"per-item cost + {3 * JOB_START_S:.0f}s job start-up" + (
                                           f" + {pairs:,} CE pairs x {u['ce_pair_batched_s'] * 1000:.2f} ms "
                                           f"(batched)" if pairs else "")))
            rows.append(b.row(**base, model=PAPER_CODE_MODEL, mode=method, wall_s=paper[method], measured=False,
                             ce_pairs=est[method][1] or "",
                             notes="extrapolated: same batched encoding" + (
                                 f" + {est[method][1]:,} single-pair CE calls x {u['ce_pair_single_s'] * 1000:.2f} ms"
                                 if est[method][1] else " (search time not included)")))
    return rows, list(runner.results.values())


def _bench(model, lcfg: LatencyConfig, env: dict, log) -> _Bench:
    spec = SyntheticSpec("latency_base", lcfg.base_images, seed=lcfg.seed + 3, domain="coco",
                         feature_dim=model.feature_dim, captions_per_image=1)
    images, caps = synthetic_collection(spec)
    base = model.encode_image(images, batch_size=lcfg.batch_size, device=str(model.device))
    b = _Bench(model, images, caps, lcfg.batch_size, env, suite="latency", base_vecs=np.asarray(base, np.float32),
               cfg=lcfg)
    measure_unit_costs(b, log)
    return b


def sample_rates(model_dir: str, batch_size: int = 128, threads: Optional[int] = None, base_images: int = 200,
                 quantize: str = "none") -> dict:
    """Units per second measured in-process on a small synthetic sample: images and captions encoded, CE
    pairs scored (batched) by the model served as ``quantize`` - for estimates when no earlier run recorded
    them."""

    set_threads(threads)
    model = quantize_model(VLRetrievalModel.load(model_dir), quantize)
    spec = SyntheticSpec("stage_sample", base_images, seed=11, domain="coco", feature_dim=model.feature_dim)
    t0 = time.perf_counter()  # generating + validating records: what a stage worker does besides writing
    images, caps = synthetic_collection(spec)
    stage_rate = (len(images) + len(caps)) / (time.perf_counter() - t0)
    b = _bench(model, LatencyConfig(base_images=base_images, batch_size=batch_size), {}, lambda m: None)
    return {"images_encoded": 1 / b.unit["image_encode_s"], "captions_encoded": 1 / b.unit["caption_encode_s"],
            "ce_pairs": 1 / b.unit["ce_pair_batched_s"], "stage_records": stage_rate}


def run_latency(cfg, lcfg: LatencyConfig, beam_args: Sequence[str] = (), log=print) -> tuple[list[dict], list]:
    """All latency rows (per-query in-process; Table 4 through the pipeline jobs) for the JOIN model."""

    threads = set_threads(lcfg.threads)
    env = {**environment(cfg.device, lcfg.batch_size), "threads": threads}
    log(f"latency: {threads} threads; generating {lcfg.base_images} base images")
    model = VLRetrievalModel.load(cfg.models.join, device=cfg.device)
    b = _bench(model, lcfg, env, log)
    rows = roofline_rows(b, log) if lcfg.roofline else []
    if lcfg.train_steps:
        rows += training_rows(b, log, {r.name: r.join for r in (DEMO_RECIPE, BENCH_RECIPE)}, lcfg.train_steps)
    if lcfg.pipeline_overhead_images:
        rows += pipeline_overhead_rows(b, cfg, beam_args, log, lcfg.pipeline_overhead_images)
    if lcfg.entry_point_images:
        rows += entry_point_rows(b, cfg, beam_args, log, lcfg.entry_point_images)
    if lcfg.feeding_items:
        rows += job_vs_model_rows(b, cfg, log, lcfg.feeding_items)
    rows += per_query_latency(b, log)
    more, results = eval_time(b, cfg, beam_args, log)
    return rows + more, results

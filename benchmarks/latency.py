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

import math
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from benchmarks import jobs
from benchmarks.jobs import JOB_START_S
from benchmarks.planner import Planner
from benchmarks.report import PAPER_CODE_MODEL, environment, set_threads
from benchmarks.roofline import UnitBench, measure_unit_costs, roofline_rows, training_rows
from benchmarks.rows import evaluate_row
from benchmarks.suites import MODE_LABELS
from pipelines.beam_kit import pipeline_options, runner_name
from pipelines.encode.plan import EncodePlan
from pipelines.encode.run import run as run_encode
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.collection import synthetic_collection
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.model.quantize import quantize_model
from retrieval_core.search import exact, index_choice, rerank
from retrieval_core.search import index as rindex
from retrieval_core.search.index_choice import ivf_nlist
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
    feeding_items: int = 5_000  # job path vs model alone (benchmarks.feeding) on this many pairs / images (0: skip)
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
                         pipeline_overhead_images=60, train_steps=2, feeding_items=40)


def _percentiles(samples: Sequence[float]) -> dict:
    ms = np.asarray(samples, dtype=np.float64) * 1000.0
    return {"latency_p50_ms": float(np.percentile(ms, 50)), "latency_p95_ms": float(np.percentile(ms, 95)),
            "latency_p99_ms": float(np.percentile(ms, 99))}


def _timed(fn, n: int, warmup: int) -> list[float]:
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(warmup + i)
        out.append(time.perf_counter() - t0)
    return out


ANN_KINDS = ("IVF-Flat", "IVF-SQ8", "IVF-PQ", "HNSW<M>")


def ann_factory(kind: str, n: int, d: int = 384) -> str:
    """faiss factory of an ANN row: IVF-Flat / IVF-SQ8 / IVF-PQ (nlist from N, PQ with d/4 bytes per
    vector) or HNSW<M> (e.g. HNSW32)."""
    up = kind.upper()
    if up.startswith("HNSW") and up[4:].isdigit():
        return f"HNSW{int(up[4:])}"
    codes = {"IVF-FLAT": "Flat", "IVF-SQ8": "SQ8", "IVF-PQ": f"PQ{max(1, d // 4)}x8"}
    if up not in codes:
        raise ValueError(f"ANN kind must be one of {ANN_KINDS}, got {kind!r}")

    return f"IVF{ivf_nlist(n)},{codes[up]}"


def read_bandwidth(arr: np.ndarray, reps: int = 5) -> float:
    """Bytes/s of one full read of ``arr``: the fastest of a torch and a numpy sum over it (torch uses its
    thread setting), best of ``reps``. The memory-bandwidth bound of an exact scan is arr.nbytes / this."""
    import torch

    view = torch.from_numpy(arr)
    best = math.inf
    for fn in (lambda: view.sum(), lambda: arr.sum(dtype=np.float32)):
        fn()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return arr.nbytes / best


def jittered_collection(base: np.ndarray, n: int, sigma: float, seed: int, chunk: int = 100_000
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(n, d) unit vectors = base[j] + N(0, sigma^2/d) renormalised, and j for each (which real image)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, len(base), size=n)
    d = base.shape[1]
    out = np.empty((n, d), dtype=np.float32)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        x = base[src[a:b]] + rng.normal(scale=sigma / math.sqrt(d), size=(b - a, d)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out[a:b] = x
    return out, src


@dataclass
class _Bench(UnitBench):
    """The JOIN model, the real base images/captions and the unit costs measured once per run (UnitBench), the
    base images' embeddings the per-query collections are jittered from, and the suite's config."""
    base_vecs: Optional[np.ndarray] = None
    cfg: Optional[LatencyConfig] = None


def per_query_latency(b: _Bench, log) -> list[dict]:
    import torch


    cfg, m = b.cfg, b.model
    rows: list[dict] = []
    rng_q = np.random.default_rng(cfg.seed + 1)
    caption_texts = b.captions["text"].tolist()
    rq = min(cfg.recall_queries, len(caption_texts))
    recall_q = m.encode_text([caption_texts[i] for i in rng_q.choice(len(caption_texts), rq, replace=False)],
                             batch_size=cfg.batch_size)
    enc = lambda i: m.encode_text(b.texts(i), batch_size=1)  # noqa: E731
    loop_cost: dict[int, float] = {}  # k -> seconds of the paper code's k single-pair CE calls
    q_pre = [enc(i) for i in range(cfg.warmup + max(cfg.reps, cfg.paper_reps, 3))]  # search-only timings
    for n in cfg.sizes:
        log(f"latency: N={n:,}: building the collection and indexes")
        items, src = jittered_collection(b.base_vecs, n, cfg.jitter, cfg.seed + n)
        ids = np.arange(n, dtype=np.int64)
        note = (f"items: {cfg.base_images} real image embeddings + jitter sigma={cfg.jitter}, renormalised; "
                f"query = one real caption encoded per query (included)")
        common = dict(collection="per_query(jittered)", collection_size=n, model="JOIN", measured=True)
        bw = read_bandwidth(items)
        bound_ms = items.nbytes / bw * 1000
        bw_note = (f"bound = {items.nbytes / 1e6:.0f} MB of float32 items / {bw / 1e9:.1f} GB/s read bandwidth "
                   f"(fastest torch/numpy sum over the same array, best of 5, this run)")
        t0 = time.perf_counter()
        flat = flat_or_ann_index("Flat", ids, items)
        flat_build = time.perf_counter() - t0
        _, exact_i = exact.exact_topk(recall_q, items, ids, 10)
        items_t = torch.from_numpy(items)

        def emb_flat(i, k=10):
            q = enc(i)
            return q, flat.search(q, k)

        def paper_emb(i, k=10):
            q = torch.from_numpy(enc(i))
            s = torch.mm(q, items_t.T)  # cosine: both sides unit-normalised
            return torch.topk(s, k, dim=1)

        def searched(fn):  # the search alone, on pre-encoded queries
            return float(np.median(_timed(lambda i: fn(q_pre[i % len(q_pre)]), cfg.reps, cfg.warmup))) * 1000

        s_torch = searched(lambda q: torch.topk(torch.mm(torch.from_numpy(q), items_t.T), 10, dim=1))
        s_flat = searched(lambda q: flat.search(q, 10))
        s_exact = searched(lambda q: exact.exact_topk(q, items, ids, 10))
        search_cols = dict(bound_ms=bound_ms)
        paper_emb_t = _timed(paper_emb, max(cfg.paper_reps, 3), 1)
        t_flat = _timed(emb_flat, cfg.reps, cfg.warmup)
        rows.append(b.row(mode="EMB-Flat", k=10, **_percentiles(t_flat), index_s=flat_build, search_p50_ms=s_flat,
                         speedup_vs_paper_code=np.median(paper_emb_t) / np.median(t_flat), notes=note,
                         **search_cols, **common))
        t_ex = _timed(lambda i: exact.exact_topk(enc(i), items, ids, 10), cfg.reps, cfg.warmup)
        rows.append(b.row(mode="EMB-Exact", k=10, **_percentiles(t_ex), search_p50_ms=s_exact, **search_cols,
                         speedup_vs_paper_code=np.median(paper_emb_t) / np.median(t_ex), **common,
                         notes=f"{note}; retrieval_core.search.exact.exact_topk (one query: the chunked scan kernel, "
                               f"torch.mm + top-k per cache-sized chunk); "
                               f"search alone {s_exact / bound_ms:.2f}x the bound; {bw_note}"))
        rows.append(b.row(mode="EMB-bound", k=10, latency_p50_ms=bound_ms, latency_p95_ms=bound_ms,
                         latency_p99_ms=bound_ms, search_p50_ms=bound_ms, **search_cols, **common,
                         notes=f"memory-bandwidth bound of one exact scan (no query encoding): {bw_note}"))
        for kind in cfg.anns:
            fac = ann_factory(kind, n, items.shape[1])
            if fac.startswith("HNSW") and n > cfg.hnsw_max_n:
                log(f"  N={n:,} {fac}: skipped (N > hnsw_max_n={cfg.hnsw_max_n:,}: build too slow on this machine)")
                rows.append(b.row(mode=f"EMB-{kind}", k=10, **{**common, "measured": False},
                                 notes=f"{fac} not built: N > --hnsw-max-n {cfg.hnsw_max_n:,}"))
                continue
            t0 = time.perf_counter()
            ann = flat_or_ann_index(fac, ids, items, seed=cfg.seed)
            ann_build = time.perf_counter() - t0
            params, ann_recall, sweep = index_choice.tune_search(ann, fac, recall_q, exact_i, cfg.recall_target)
            s_ann = searched(lambda q: ann.search(q, 10))
            t_ann = _timed(lambda i: ann.search(enc(i), 10), cfg.reps, cfg.warmup)
            par = ", ".join(f"{k}={v}" for k, v in params.items())
            met = "meets" if ann_recall >= cfg.recall_target else "MISSES"
            rows.append(b.row(mode=f"EMB-{kind}", k=10, **_percentiles(t_ann), index_s=ann_build,
                             **{"ann_recall@10": ann_recall}, search_p50_ms=s_ann,
                             index_bytes=sum(len(rindex.index_bytes(x)) for x in ann.shards),
                             speedup_vs_paper_code=np.median(paper_emb_t) / np.median(t_ann),
                             notes=f"{note}; {fac}, {par} (smallest of the sweep "
                                   f"{' '.join(f'{v}:{r:.3f}' for v, r in sweep)} that {met} recall@10 >= "
                                   f"{cfg.recall_target}; tuned and measured on the same {rq} caption queries); "
                                   f"search alone 1/{s_torch / s_ann:.0f} of torch brute force "
                                   f"({s_torch:.1f} ms); ann_recall@10 = knn_intersection_measure vs exact",
                             **common))
            ann = None  # frees the index before the next one (not del: closures above read the name)
        rows.append(b.row(mode="EMB", k=10, **_percentiles(paper_emb_t), search_p50_ms=s_torch, **search_cols,
                         **{**common, "model": PAPER_CODE_MODEL}, notes=f"{note}; torch.mm + topk over all items"))
        log(f"  N={n:,} search alone p50: torch {s_torch:.2f} ms, faiss Flat {s_flat:.2f} ms, exact_topk "
            f"{s_exact:.2f} ms, bound {bound_ms:.2f} ms ({bw / 1e9:.1f} GB/s)")
        for k in cfg.ks:
            kk = min(k, n)

            def co(i, kk=kk):
                q, (s, hit) = emb_flat(i, rerank.stored_depth(kk))
                ce = m.score(b.texts(i) * kk, b.regions(src[hit[0, :kk]]), batch_size=cfg.batch_size)
                rerank.rank_query(hit[0], s[0], ce, k=kk, mode="ce")

            def paper_co(i, kk=kk):
                top = paper_emb(i, kk)
                for j in top.indices[0].tolist():  # one CE call per (query, candidate) pair
                    m.score(b.texts(i), b.regions([src[j]]), batch_size=1)

            t_co = _timed(co, cfg.reps, cfg.warmup)
            pnote = f"{note}; torch.mm + topk, then one CE call per candidate"
            if kk not in loop_cost:  # the per-pair loop does not depend on N: measure it end to end once per k
                t_pco = _timed(paper_co, cfg.paper_reps, 1)
                loop_cost[kk] = float(np.median(t_pco)) - float(np.median(paper_emb_t))
                paper = dict(_percentiles(t_pco), measured=True)
            else:  # larger N: this N's measured torch.mm search + the measured loop of k CE calls
                p = (float(np.median(paper_emb_t)) + loop_cost[kk]) * 1000
                paper = dict(latency_p50_ms=p, latency_p95_ms=p, latency_p99_ms=p, measured=False)
                pnote += "; composed: this N's measured torch.mm+topk p50 + the k-call CE loop measured at the " \
                         "smallest N"
            rows.append(b.row(mode="CO", k=kk, **_percentiles(t_co), **common, notes=note,
                             speedup_vs_paper_code=paper["latency_p50_ms"] / 1000 / np.median(t_co)))
            rows.append(b.row(mode="CO", k=kk, **{**common, "model": PAPER_CODE_MODEL, **paper}, notes=pnote))
        # CE over the whole collection for one query.
        est = n * b.unit["ce_pair_batched_s"]
        paper_est = n * b.unit["ce_pair_single_s"] + float(np.median(paper_emb_t))
        if est <= cfg.ce_measure_budget_s:
            def ce_all(i):
                q = b.texts(i)
                m.score(q * n, b.regions(src), batch_size=cfg.batch_size)
            t_ce = _timed(ce_all, 1, 0)
            rows.append(b.row(mode="CE", k="all", **_percentiles(t_ce), **common, notes=f"{note}; one query, "
                             f"measured once", speedup_vs_paper_code=paper_est / t_ce[0]))
        else:
            p = est * 1000
            rows.append(b.row(mode="CE", k="all", latency_p50_ms=p, latency_p95_ms=p, latency_p99_ms=p,
                             **{**common, "measured": False}, speedup_vs_paper_code=paper_est / est,
                             notes=f"extrapolated: {n:,} pairs x {b.unit['ce_pair_batched_s'] * 1000:.2f} ms per "
                                   f"pair (batched, measured)"))
        p = paper_est * 1000
        rows.append(b.row(mode="CE", k="all", latency_p50_ms=p, latency_p95_ms=p, latency_p99_ms=p,
                         **{**common, "model": PAPER_CODE_MODEL, "measured": False},
                         notes=f"extrapolated: {n:,} x {b.unit['ce_pair_single_s'] * 1000:.2f} ms per single-pair "
                               f"CE call (measured) + torch.mm search"))
        for r in rows[-(6 + len(cfg.anns) + 2 * len(cfg.ks)):]:
            if r.get("latency_p50_ms", "") != "":
                log(f"  N={n:,} {r['model']} {r['mode']} k={r.get('k', '')}: p50 {r['latency_p50_ms']:.1f} ms"
                    + (" (extrapolated)" if not r["measured"] else ""))
        flat = items = items_t = None  # frees this size before the next (closures read these names)
    return rows


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


def job_vs_model_rows(b: _Bench, cfg, log, n: int) -> list[dict]:
    """benchmarks.feeding's rows for the suite's JOIN model on this machine: the jobs' handler path and the library
    loop against the model alone on the same batches (CE pairs and BE images, ``n`` each), in fp32 and, where the
    device computes it natively, bf16; interleaved in one process so the ratio holds on a shared machine."""
    from benchmarks.feeding import feeding_rows
    from retrieval_core.model.quantize import cpu_has_native_bf16, cuda_bf16_supported

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


# ------------------------------------------------------------------------------------------ helpers
def flat_or_ann_index(factory: str, ids: np.ndarray, vectors: np.ndarray, seed: int = 0):
    """A one-shard inner-product index over ``vectors`` (the library calls pipelines.build_index makes)."""

    d = int(vectors.shape[1])
    sample = rindex.training_sample(ids, vectors, min(len(ids), 100_000), seed=seed) \
        if rindex.needs_training(factory, d, "ip") else None
    trained = rindex.train_index(factory, d, "ip", sample, seed=seed)
    return rindex.ShardedIndex([rindex.build_shard(trained, ids, vectors)])


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
    if lcfg.feeding_items:
        rows += job_vs_model_rows(b, cfg, log, lcfg.feeding_items)
    rows += per_query_latency(b, log)
    more, results = eval_time(b, cfg, beam_args, log)
    return rows + more, results

"""The recall benchmark suites (paper Tables 1, 5, 8, 11, the 100k and 1M settings) as plans of pipeline jobs.

A suite is planned first: a list of jobs (:mod:`benchmarks.suites.jobs`: stage, benchmarks.queries, encode,
build_index, rerank, each the CLI a user would run) and a list of :class:`Row` s, each naming the rerank
run(s) it is read from and how (``benchmarks.evaluate.evaluate_run``: k, mode, lam). Score once, evaluate
many: per (model family, pool) ONE rerank job at the suite's k_max stores the BE top-k_max with be_score and
ce_score; the EMB row, the CO rows at every k <= k_max and every fusion (mode, lam) are derived from it, so
k_ablation and combination cost no extra CE pairs.

Planning rules: per staged manifest, stage once; per (BE model, staged collection), encode once; per pool,
build_index (1k folds and sub-pools with ``--ids``; a fold's caption pool with ``--modality text --ids`` and
``--text-index``; a pool of every caption of the embeddings dir uses rerank's exact search); per (family,
pool), one rerank with a ``--queries`` file from ``benchmarks.queries``. Everything lands under
``<workdir>/bench/``; a job whose output is finished and unchanged is reused (``jobs.finished``).
"""
from __future__ import annotations

from typing import Optional, Sequence

from benchmarks.suites.jobs import Job
from benchmarks.suites.planner import (
    QUICK_IMAGES,
    TUNE_MANIFEST,
    TUNE_SPLIT,
    Plan,
    Planner,
    Staged,
    SuiteConfig,
    split_share,
)
from retrieval_core.data.manifest import load_manifest

STANDARD_K = 20  # the paper's default rerank depth
ABLATION_KS = (10, 20, 50, 100)  # paper Table 8, and 100: does a deeper list still pay?
COMBINATION_LAMS = (0.1, 0.5, 0.9)  # paper Table 11
COCO_1K_FOLDS = 5
COCO_1K_SIZE = 1000
SCALE_QUERIES = 5000
#: multilingual: the collection (en/de/fr/cs captions of the same Flickr30k-like scenes) and its languages
ML_MANIFEST = "synthetic_multi30k"
ML_LANGUAGES = ("en", "de", "fr", "cs")
#: memory: collection sizes (images) whose per-job peak RSS is compared; --quick uses QUICK_MEMORY_SIZES.
MEMORY_SIZES = (20_000, 100_000, 200_000)
QUICK_MEMORY_SIZES = (200, 400)
MEMORY_QUERIES = 500
QUICK_SCALE_QUERIES = 50
#: scale_1m's AUTO rows choose their fusion on a dev pool of scale_100k's size (100k images and their captions),
#: not a 1M one: a second 1M collection would double the suite's disk and encode time (docs/BENCHMARKS.md).
SCALE_1M_DEV_POOL = 100_000
MODE_LABELS = {"emb": "EMB", "co": "CO", "add": "CO-ADD", "norm_add": "CO-NORM_ADD", "ce": "CE"}


def _query_counts(n_caps: int, n_imgs: int, max_queries: int) -> tuple[int, int]:
    cap = lambda n: min(n, max_queries) if max_queries else n  # noqa: E731
    return cap(n_caps), cap(n_imgs)


# ------------------------------------------------------------------------------------- the setting
def one_pool(p: Planner, st: Staged, collection: str, label: str, *, k: int, queries: Job, q_t2i: int, q_i2t: int,
             pool_images: int, pool_captions: int, notes: tuple = (), rows=("EMB", "CO"), ks: tuple = (),
             lams: tuple = (), exhaustive: bool = False, fold_jobs: Optional[list] = None,
             text_index: bool = False, auto: bool = False, search_run: bool = False) -> None:
    """Plan every family on one pool (or on each fold of ``fold_jobs``: [(queries job, q_t2i, q_i2t)]) and the
    rows read from its one rerank run per family; ``auto``: plus the AUTO row (the dev-chosen fusion);
    ``search_run`` (one pool): the EMB row from a search-only rerank job of the same queries, so that its
    rerank_s is the search alone, and an exhaustive CE row over the pair budget is extrapolated from the CO job's
    CE share (its wall minus the search job's) instead of skipped: the paper's Table 3 from a measured run."""
    cfg = p.cfg
    folds = fold_jobs or [(queries, q_t2i, q_i2t)]
    exh_pairs = max(qt * pool_images + qi * pool_captions for _, qt, qi in folds)
    run_exhaustive = exhaustive and exh_pairs <= cfg.ce_pair_budget
    for family, be, ce in cfg.models.families():
        enc = p.encode(st, be)
        runs, ce_runs, search = [], [], None
        index_t, co_t, ce_t = [], [], []
        for f, (qjob, qt, qi) in enumerate(folds):
            pool = f"fold{f}" if fold_jobs else "all"
            if fold_jobs:  # the fold's images and captions only
                img_idx = p.index(st, be, enc, "image", ids=qjob, pool=pool)
                txt_idx = p.index(st, be, enc, "text", ids=qjob, pool=pool)
                index_t += [("index_s", img_idx.name), ("index_s", txt_idx.name)]
            else:  # every image; i2t: a caption index, or rerank's exact search over every caption embedding
                img_idx = p.index(st, be, enc, "image")
                txt_idx = p.index(st, be, enc, "text") if text_index else None
                index_t += [("index_s", j.name) for j in (img_idx, txt_idx) if j is not None]
            run = p.rerank(st, family, be, ce, enc, qjob, mode="co", k=k, index=img_idx, text_index=txt_idx,
                           pool=pool, pairs=(qt + qi) * min(k, pool_images))
            runs.append(run.output)
            co_t.append(("rerank_s", run.name))
            search = p.rerank(st, family, be, ce, enc, qjob, mode="emb", k=k, index=img_idx, text_index=txt_idx,
                              pool=pool) if search_run and not fold_jobs else None
            if run_exhaustive:
                ce_run = p.rerank(st, family, be, ce, enc, qjob, mode="ce", k=k, index=img_idx, text_index=txt_idx,
                                  pool=pool, pairs=qt * pool_images + qi * pool_captions)
                ce_runs.append(ce_run.output)
                ce_t.append(("rerank_s", ce_run.name))
        enc_t = [("encode_s", enc.name)]
        timing = tuple(enc_t + index_t + co_t)
        base = dict(collection=label, model=family, runs=tuple(runs), staged=st.path, eval_collection=collection,
                    per_fold=bool(fold_jobs), pool_images=pool_images, notes=tuple(notes))
        if "EMB" in rows and search is not None:
            p.row(mode="EMB", eval_mode="emb", timing=tuple(enc_t + index_t + [("rerank_s", search.name)]),
                  **{**base, "runs": (search.output,), **_note(
                      base, f"BE ranking of a search-only rerank job (--mode emb, k={k}): rerank_s is the search "
                            f"alone")})
        elif "EMB" in rows:
            p.row(mode="EMB", eval_mode="emb", timing=tuple(enc_t + index_t), **{**base, **_note(
                base, f"BE ranking derived from the stored BE scores of the CO k={k} run (search time inside its "
                      f"rerank job)")})
        if "CO" in rows:
            for kk in (ks or (k,)):
                extra = f"derived from the stored CE scores of the k={k} run (ce_pairs and rerank_s are that run's)" \
                    if kk != k else ""
                p.row(mode="CO", k=kk, eval_mode="co", eval_k=kk, timing=timing, emb_runs=tuple(runs),
                      **{**base, **_note(base, extra)})
        if auto and "CO" in rows and not ks and not lams:  # the dev-chosen fusion beside CO, same stored scores
            dev, dev_st = p.dev_run(family, be, ce, k, pool_images, pool_captions, text_index)
            p.row(mode="AUTO", k=k, eval_mode="auto", eval_k=k, tune_on=dev.output, tune_staged=dev_st.path,
                  timing=timing + (("rerank_s", dev.name),), emb_runs=tuple(runs), **{**base, **_note(
                      base, f"fusion chosen on the {TUNE_MANIFEST}/{TUNE_SPLIT} queries against the dev pool "
                            f"{dev_st.name} (its images: {sum(dev_st.images.values()):,} staged, those of the "
                            f"{TUNE_SPLIT} split ranked; rerank --mode auto's choose_fusion), applied to the "
                            f"stored scores of the CO k={k} run")})
        for mode in ("add", "norm_add"):
            for lam in lams:
                p.row(mode=MODE_LABELS[mode], k=k, lam=lam, eval_mode=mode, eval_k=k, eval_lam=lam, timing=timing,
                      emb_runs=tuple(runs), **{**base, **_note(base, f"fused from the stored scores of the CO k={k} "
                                                                     f"run")})
        if exhaustive and run_exhaustive:
            p.row(mode="CE", k="all", timing=tuple(enc_t + index_t + ce_t), emb_runs=tuple(runs),
                  **{**base, "runs": tuple(ce_runs)})
        elif exhaustive and search is not None:
            p.row(mode="CE", k="all", extrapolated=(co_t[0][1], search.name), pool_captions=pool_captions,
                  **{**base, "runs": tuple(runs), **_note(
                      base, f"not run: exhaustive CE needs {exh_pairs:,} pairs, over the pair budget "
                            f"{cfg.ce_pair_budget:,}; per_query_ms = the direction's pool x the CE's seconds per "
                            f"pair, that = (the CO k={k} job's wall - the search-only job's) / the CO job's CE pairs")})
        elif exhaustive:
            p.row(mode="CE", k="all", skip=f"skipped: exhaustive CE needs {exh_pairs:,} pairs"
                  f"{' per fold' if fold_jobs else ''}, over the pair budget {cfg.ce_pair_budget:,} "
                  f"(--ce-pair-budget)", **{**base, "runs": ()})


def _note(base: dict, extra: str) -> dict:
    return {"notes": base["notes"] + ((extra,) if extra else ())}


def _sampled_notes(n_caps: int, n_imgs: int, q_t2i: int, q_i2t: int) -> tuple:
    notes = []
    if q_t2i < n_caps:
        notes.append(f"t2i queries: seeded sample of {q_t2i} of {n_caps} (--max-queries)")
    if q_i2t < n_imgs:
        notes.append(f"i2t queries: seeded sample of {q_i2t} of {n_imgs} (--max-queries)")
    return tuple(notes)


def single_task(p: Planner, manifest: str, *, k: int = STANDARD_K, folds: int = 0, **kw) -> None:
    """Queries and pool from one collection (the manifest's query collection), and its 1k folds if asked."""
    cfg = p.cfg
    st = p.stage(manifest)
    coll = st.manifest.benchmark.get("query_collection") or next(iter(st.manifest.collections))
    split = st.manifest.benchmark.get("split", "test")
    n_img, n_cap = st.images[coll], st.captions[coll]
    q_t, q_i = _query_counts(n_cap, n_img, cfg.max_queries)
    qjob = p.select(st, coll, max_queries=cfg.max_queries, split=split)
    one_pool(p, st, coll, st.manifest.name, k=k, queries=qjob, q_t2i=q_t, q_i2t=q_i, pool_images=n_img,
             pool_captions=n_cap, notes=_sampled_notes(n_cap, n_img, q_t, q_i), auto=True, **kw)
    if folds:
        size = (QUICK_IMAGES.get(coll, 50) // folds) if cfg.quick else COCO_1K_SIZE
        n_folds = min(folds, n_img // size)
        per_fold = -(-cfg.max_queries // n_folds) if cfg.max_queries else 0  # the folds share the query cap
        cpi = n_cap / max(n_img, 1)
        fq = [(p.select(st, coll, max_queries=per_fold, fold=f, folds=n_folds, fold_size=size, split=split),
               *_query_counts(int(size * cpi), size, per_fold)) for f in range(n_folds)]
        label = f"{st.manifest.name}/1k" if size == COCO_1K_SIZE else f"{st.manifest.name}/{size}"
        notes = (f"mean over {n_folds} folds of {size} images (the standard COCO 1k protocol; folds = consecutive "
                 f"blocks in item_id order); index_s and rerank_s are per fold, encode_s is shared",
                 *_sampled_notes(int(size * cpi), size, fq[0][1], fq[0][2]))
        one_pool(p, st, coll, label, k=k, queries=qjob, q_t2i=q_t, q_i2t=q_i, pool_images=size,
                 pool_captions=int(size * cpi), notes=notes, fold_jobs=fq, auto=True, **kw)


def distractor_tasks(p: Planner, manifest: str, k: int = STANDARD_K) -> None:
    """Table 5: each COCO/Flickr-like collection in turn gives queries and gold; the pools hold every collection's
    images and captions (the paper rotates COCO and Flickr30k; CC dev only ever serves as distractors)."""
    cfg = p.cfg
    st = p.stage(manifest)
    split = st.manifest.benchmark.get("split", "test")
    first = st.manifest.benchmark.get("query_collection") or next(iter(st.manifest.collections))
    names = list(st.manifest.collections)
    order = [first] + [n for n in names if n != first and "cc" not in n.lower()]
    pool_images, pool_captions = sum(st.images.values()), sum(st.captions.values())
    for q in order:
        q_t, q_i = _query_counts(st.captions[q], st.images[q], cfg.max_queries)
        others = [n for n in names if n != q]
        notes = (f"queries+gold of {q}; pool adds {pool_images - st.images[q]} images and their captions from "
                 f"{', '.join(others)} as distractors", *_sampled_notes(st.captions[q], st.images[q], q_t, q_i))
        one_pool(p, st, q, f"{q}+distractors", k=k, queries=p.select(st, q, max_queries=cfg.max_queries, split=split),
                 q_t2i=q_t, q_i2t=q_i, pool_images=pool_images, pool_captions=pool_captions, notes=notes, auto=True)


def scale_task(p: Planner, manifest: str, k: int = STANDARD_K, text_index: bool = False) -> None:
    """Both directions against the full pools: N caption queries (one caption each of a seeded N-image subset)
    against every image, and those N images as queries against every caption (``text_index``: through a
    build_index caption index instead of rerank's exact search, which reads every caption embedding shard once
    per query group: no worker holds them, but at 5M captions that is 7.7 GB read per group). Per query (the
    paper's Table 3 from the measured run): EMB from a search-only job, CO from its job, exhaustive CE
    extrapolated from the CO job's CE share (one_pool's ``search_run``)."""
    cfg = p.cfg
    st = p.stage(manifest)
    coll = next(iter(st.manifest.collections))
    n = QUICK_SCALE_QUERIES if cfg.quick else SCALE_QUERIES
    n_img, n_cap = st.images[coll], st.captions[coll]
    q = min(n, n_img)
    notes = (f"{q} queries per direction (a seeded {q}-image subset and one caption of each) against all "
             f"{n_img:,} images / {n_cap:,} captions; encoding of the whole collection included in encode_s",)
    one_pool(p, st, coll, st.manifest.name, k=k, queries=p.select(st, coll, scale=n), q_t2i=q, q_i2t=q,
             pool_images=n_img, pool_captions=n_cap, notes=notes, text_index=text_index, auto=True, exhaustive=True,
             search_run=True)


def scale_1m(p: Planner) -> None:
    """The 100k protocol at 1M images / 5M captions (data_manifests/synthetic_1m.yaml).

    Work per model family (k = 20): stage 6M records once; encode 1M images + 5M captions; a 1M-image and a
    5M-caption index; CE-score <= 200k pairs (5,000 queries per direction x 20); the AUTO row's dev run on a
    SCALE_1M_DEV_POOL-image dev pool. Every collection is staged compact (planner.stage_job: the regions the
    models read, float16); ``--plan`` prints the estimate from measured unit costs, and docs/BENCHMARKS.md ("The
    1M suite") gives its disk, memory and time budget and the command for one 2-core machine with native bf16.
    On a Dask cluster (scheduler at HOST:8786, every worker with this repository installed and the workdir on a
    shared filesystem)::

        python -m benchmarks.run --suite scale_1m --workdir /shared/rr --index-factory IVF4096,Flat \
            --runner=apache_beam.runners.dask.dask_runner.DaskRunner --dask_client_address=HOST:8786

    On Dataflow (GPU workers for encode/rerank: see docker/README.md; the workdir in a bucket)::

        python -m benchmarks.run --suite scale_1m --workdir gs://BUCKET/rr --device cuda \
            --index-factory IVF4096,Flat --runner=DataflowRunner --project=P --region=R \
            --temp_location=gs://BUCKET/tmp --sdk_container_image=IMAGE \
            --dataflow_service_options="worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver"

    Every flag after the suite's own goes to every pipeline job unchanged (benchmarks.suites.jobs)."""
    scale_task(p, "synthetic_1m", text_index=True)


def memory_task(p: Planner, sizes: Sequence[int]) -> None:
    """Peak RSS per pipeline job as the collection grows: synthetic_memory (1 caption and 12 regions per image)
    staged at each size, encoded, indexed and reranked (EMB and CO, k = 20) with MEMORY_QUERIES queries per
    direction against the whole pool. The jobs CSV holds each job's peak RSS; the recall rows come free."""
    n_q = QUICK_SCALE_QUERIES if p.cfg.quick else MEMORY_QUERIES
    for n in sizes:
        st = p.stage("synthetic_memory", images=int(n))
        coll = next(iter(st.manifest.collections))
        n_img, n_cap = st.images[coll], st.captions[coll]
        q = min(n_q, n_img)
        notes = (f"memory scaling: {q} queries per direction against all {n_img:,} images / {n_cap:,} captions",)
        one_pool(p, st, coll, st.name, k=STANDARD_K, queries=p.select(st, coll, scale=n_q), q_t2i=q, q_i2t=q,
                 pool_images=n_img, pool_captions=n_cap, notes=notes)


def plan_suite(cfg: SuiteConfig, baseline_model: Optional[str] = None) -> Plan:
    """The jobs and rows of one recall suite (latency plans its own Table 4 jobs, benchmarks.suites.latency)."""
    s = cfg.suite
    p = Planner(cfg, compact=True, dev_pool_max=SCALE_1M_DEV_POOL) if s == "scale_1m" else Planner(cfg)
    if cfg.manifest:  # one user-chosen manifest, its own benchmark block

        m = load_manifest(cfg.manifest)
        if s == "distractor_20k" or m.benchmark.get("distractor_collections"):
            distractor_tasks(p, cfg.manifest)
        elif s in ("scale_100k", "scale_1m"):
            scale_task(p, cfg.manifest)
        else:
            _task_rows(p, s, cfg.manifest, baseline_model)
        return p.plan
    if s == "standard":
        single_task(p, "synthetic_coco5k", folds=COCO_1K_FOLDS, exhaustive=True)
        single_task(p, "synthetic_f30k1k", exhaustive=True)
    elif s == "distractor_20k":
        distractor_tasks(p, "synthetic_distractor20k")
    elif s == "scale_100k":
        scale_task(p, "synthetic_100k")
    elif s == "scale_1m":
        scale_1m(p)
    elif s == "memory":
        memory_task(p, cfg.memory_sizes or (QUICK_MEMORY_SIZES if cfg.quick else MEMORY_SIZES))
    elif s in ("k_ablation", "combination"):
        _task_rows(p, s, "synthetic_f30k1k", baseline_model)
    elif s == "baseline":
        for m in ("synthetic_coco5k", "synthetic_f30k1k"):
            _task_rows(p, s, m, baseline_model)
    elif s == "multilingual":
        multilingual_task(p)
    else:
        raise ValueError(f"suite {s!r} has no recall plan")
    return p.plan


def multilingual_task(p: Planner, k: int = STANDARD_K) -> None:
    """The paper's multilingual and zero-shot settings on ML_MANIFEST: per model family and language, t2i with
    that language's test captions and i2t against that language's test captions (a caption index of them), one
    CO run each, with EMB derived and AUTO chosen on the dev split of the same language and pool size."""
    cfg = p.cfg
    st = p.stage(ML_MANIFEST)
    coll = next(iter(st.manifest.collections))
    n_img = round(st.images[coll] * split_share(st.manifest.collections[coll], "test"))
    for family, be, ce in cfg.models.families():
        enc = p.encode(st, be)
        img_idx = p.index(st, be, enc, "image")
        dev_enc = p.encode(st, be, split="dev")
        dev_img = p.index(st, be, dev_enc, "image", pool="dev-all")
        for lang in ML_LANGUAGES:
            q = p.select(st, coll, max_queries=cfg.max_queries, lang=lang)
            txt_idx = p.index(st, be, enc, "text", ids=q, pool=f"all-{lang}")
            n_q = min(cfg.max_queries or n_img, n_img)
            run = p.rerank(st, family, be, ce, enc, q, mode="co", k=k, index=img_idx, text_index=txt_idx,
                           pool=f"all-{lang}", pairs=2 * n_q * k)
            dev_q = p.select(st, coll, max_queries=cfg.max_queries, split="dev", lang=lang)
            dev_txt = p.index(st, be, dev_enc, "text", ids=dev_q, pool=f"dev-{lang}")
            dev = p.rerank(st, family, be, ce, dev_enc, dev_q, mode="co", k=k, index=dev_img, text_index=dev_txt,
                           split="dev", pool=f"dev-{lang}", pairs=2 * n_q * k)
            timing = (("encode_s", enc.name), ("index_s", img_idx.name), ("index_s", txt_idx.name),
                      ("rerank_s", run.name))
            base = dict(collection=f"{coll}/{lang}", model=family, runs=(run.output,), staged=st.path,
                        eval_collection=coll, pool_images=n_img, lang=lang,
                        notes=(f"{lang} captions only: t2i queries and the i2t pool (a caption index of them)",))
            p.row(mode="EMB", eval_mode="emb", timing=timing[:3], **base)
            p.row(mode="CO", k=k, eval_mode="co", eval_k=k, timing=timing, emb_runs=(run.output,), **base)
            p.row(mode="AUTO", k=k, eval_mode="auto", eval_k=k, tune_on=dev.output, tune_staged=st.path,
                  timing=timing + (("rerank_s", dev.name),), emb_runs=(run.output,), **base)


def _task_rows(p: Planner, suite: str, manifest: str, baseline_model: Optional[str]) -> None:
    if suite == "k_ablation":  # one run at the largest k; the smaller ones derived from it
        single_task(p, manifest, k=max(ABLATION_KS), rows=("CO",), ks=ABLATION_KS)
    elif suite == "combination":
        single_task(p, manifest, rows=("CO",), lams=COMBINATION_LAMS)
    elif suite == "baseline":
        baseline_rows(p, manifest, baseline_model)
    else:
        single_task(p, manifest, exhaustive=True)


def baseline_rows(p: Planner, manifest: str, baseline_model: Optional[str]) -> None:
    """EMB rows of the training-free mapped baseline and of every family's BE: one rerank --mode emb each."""
    cfg = p.cfg
    st = p.stage(manifest)
    coll = st.manifest.benchmark.get("query_collection") or next(iter(st.manifest.collections))
    n_img, n_cap = st.images[coll], st.captions[coll]
    q_t, q_i = _query_counts(n_cap, n_img, cfg.max_queries)
    qjob = p.select(st, coll, max_queries=cfg.max_queries)
    bes = ([("MappedBaseline", baseline_model)] if baseline_model else []) + \
        [(fam, be) for fam, be, _ in cfg.models.families()]
    for label, be in bes:
        enc = p.encode(st, be)
        idx = p.index(st, be, enc, "image")
        run = p.rerank(st, label, be, be, enc, qjob, mode="emb", k=10, index=idx)
        notes = _sampled_notes(n_cap, n_img, q_t, q_i)
        if label == "MappedBaseline":
            notes += ("training-free; fit on the demo train split",)
        p.row(collection=st.manifest.name, model=label, mode="EMB", runs=(run.output,), staged=st.path,
              eval_collection=coll, eval_mode="emb", pool_images=n_img, notes=notes,
              timing=(("encode_s", enc.name), ("index_s", idx.name), ("rerank_s", run.name)))

"""The rerank job's ``--mode auto``: the fusion chosen on a dev run's stored scores (``resolve_auto``), and the
queries and plan of the job's own dev run when it makes one (``sampled_queries``, ``dev_pass_plan``)."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

import numpy as np

from pipelines import files
from pipelines.rerank.plan import AUTO, DIRECTIONS, T2I, RerankError, RerankPlan, ce_model_folder, split_query_ids
from retrieval_core.data.paths import is_url
from retrieval_core.data.store import StagedDataset
from retrieval_core.evaluation.runs import RunError, choose_fusion, read_run_manifest
from retrieval_core.search import embeddings


def resolve_auto(plan: RerankPlan) -> tuple[RerankPlan, Optional[dict]]:
    """--mode auto: the plan with the mode and lam that give the best mR on the --tune-on dev run
    (retrieval_core.evaluation.runs.choose_fusion, derived from the dev run's stored BE and CE scores at this run's k),
    and the record of that choice for the manifest. Other plans pass through unchanged (record None).

    The dev run must rank another split (or collection) than this run - a fusion tuned on the evaluated
    queries would report an optimistic recall - with the same bi-encoder (embeddings model sha256) and
    cross-encoder (folder fingerprint), at a depth >= k."""
    if plan.mode != AUTO:
        return plan, None
    try:
        _, dev = read_run_manifest(plan.tune_on, files.BEAM_FILES)
    except RunError as exc:
        raise RerankError(f"--tune-on: {exc}") from None
    if (dev.get("split"), dev.get("collection")) == (plan.split, plan.collection) and \
            _same_path(str(dev.get("staged")), plan.staged):
        raise RerankError(f"--tune-on {plan.tune_on} ranked the same queries (split {plan.split!r}) this run "
                          f"evaluates: choose the fusion on a held-out split (e.g. a --split dev run)")
    check_same_models(plan.tune_on, dev, plan.embeddings, plan.cross_encoder, plan.precision)
    try:
        choice = choose_fusion(plan.tune_on, dev["staged"], plan.k, files=files.BEAM_FILES)
    except RunError as exc:
        raise RerankError(f"--tune-on: {exc}") from None
    choice["dev_pool_size"] = dev.get("pool_size")
    got, emb_ = choice["dev"][choice["label"]], choice["dev"]["emb"]
    print(f"--mode auto: {choice['label']} on {plan.tune_on} (split {choice['dev_split']}, pool "
          f"{dev.get('pool_size')}): R@1 " + ", ".join(f"{d} {emb_[f'{d}_R@1']:.2f} -> {got[f'{d}_R@1']:.2f}"
                                                     for d in plan.directions) + " (emb -> chosen)", flush=True)
    # the run stores the CE scores of its top-k whatever is chosen (emb too): every mode stays derivable from it
    chosen = replace(plan, mode=choice["mode"], lam=choice["lam"] if choice["lam"] is not None else plan.lam,
                     tune_on=None, score_ce=choice["mode"] == "emb")
    return chosen, choice


def check_same_models(run_dir: str, run: dict, emb_dir: str, cross_encoder: str, precision: str) -> None:
    """Refuse a run (``run``: its manifest) made with another bi-encoder than the one that encoded ``emb_dir``,
    another cross-encoder than ``cross_encoder`` or CE scores of another precision: a fusion chosen on it would be
    chosen on other scores."""
    emb_model = embeddings.load_embeddings_manifest(emb_dir, files.BEAM_FILES)["model"]
    if run.get("be_model", {}).get("sha256") != emb_model.get("sha256"):
        raise RerankError(f"--tune-on {run_dir} was retrieved by another bi-encoder "
                          f"({run.get('be_model', {}).get('path')}) than --embeddings ({emb_model.get('path')})")
    if not run.get("ce_model") or \
            ce_model_folder(run["ce_model"]).fingerprint != ce_model_folder(cross_encoder).fingerprint:
        raise RerankError(f"--tune-on {run_dir} was reranked by another cross-encoder ({run.get('ce_model')}) "
                          f"than {cross_encoder}")
    if run.get("quantize", "none") != precision:
        raise RerankError(f"--tune-on {run_dir} scored with --quantize {run.get('quantize', 'none')}, this run "
                          f"with {precision}: the fusion would be chosen on other CE scores")


def recorded_choice(run_dir: str, emb_dir: str, cross_encoder: str, precision: str, k: int) -> dict:
    """The fusion a finished ``--mode auto`` rerank run chose on its dev split (its manifest's ``fusion_choice``:
    mode, lam, label, every candidate's dev recall), to rank other queries the same way: refused when the run is
    no auto run, was made with other models or precision (``check_same_models``) or at another depth k (the
    choice is made at the run's k)."""
    try:
        _, run = read_run_manifest(run_dir, files.BEAM_FILES)
    except RunError as exc:
        raise RerankError(f"--tune-on: {exc}") from None
    choice = run.get("fusion_choice")
    if not choice or choice.get("mode") is None:
        raise RerankError(f"--tune-on {run_dir} is a --mode {run.get('mode')} run that chose nothing: name a "
                          f"finished --mode auto rerank run (its fusion_choice), or pass --mode")
    check_same_models(run_dir, run, emb_dir, cross_encoder, precision)
    if int(run.get("k", -1)) != int(k):
        raise RerankError(f"--tune-on {run_dir} chose {choice.get('label')} at k = {run.get('k')}, not at --k {k}: "
                          f"pass --k {run.get('k')}, or --mode and --lam yourself")
    return dict(choice)


def sampled_queries(plan: RerankPlan, split: str, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A seeded sample of at most ``n`` queries per direction of ``split`` (ids sorted): what --mode auto's own
    dev run ranks."""
    ds = StagedDataset(plan.staged, files=files.BEAM_FILES)
    out = {}
    for d in plan.directions:
        ids = split_query_ids(ds, d, plan.collection, split)
        if len(ids) == 0:
            raise RerankError(f"--mode auto: no {split!r} queries ({'captions' if d == T2I else 'images'}) in "
                              f"{plan.staged} to choose on (collection={plan.collection}); stage a {split} split, "
                              f"or pass --tune-on or another --mode")
        rng = np.random.default_rng([seed, DIRECTIONS.index(d)])
        out[d] = np.sort(rng.choice(ids, min(n, len(ids)), replace=False))
    return out


def dev_pass_plan(plan: RerankPlan, queries: str, output: str) -> RerankPlan:
    """--mode auto's own dev run: the same models and depth, CO, on the dev split's embeddings (its pool: the
    dev items, as the evaluated pool holds the evaluated split's) and the sampled ``queries``."""
    indexed = plan.tune_index is not None
    return replace(plan, mode="co", embeddings=plan.tune_embeddings, index=plan.tune_index, text_index=None,
                   split=plan.tune_split, queries=queries, output=output, tune_embeddings=None, tune_index=None,
                   nprobe=plan.nprobe if indexed else None, ef_search=plan.ef_search if indexed else None)


def _same_path(a: str, b: str) -> bool:
    """The same folder: local paths compared absolute, URLs as written (abspath would mangle them)."""
    norm = lambda p: p.rstrip("/") if is_url(p) else os.path.abspath(p)  # noqa: E731
    return norm(a) == norm(b)

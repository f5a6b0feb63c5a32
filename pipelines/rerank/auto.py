"""The rerank job's ``--mode auto``: the fusion chosen on a dev run's stored scores (``resolve_auto``), and the
queries and plan of the job's own dev run when it makes one (``sampled_queries``, ``dev_pass_plan``). Reading a
finished auto run's choice back (``retrieval_core.evaluation.runs.recorded_choice``) lives below, where the query
job and the Python entry point share it."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

import numpy as np

from pipelines import files
from pipelines.rerank.plan import AUTO, DIRECTIONS, T2I, RerankError, RerankPlan, split_query_ids
from retrieval_core.data.paths import is_url
from retrieval_core.data.store import StagedDataset
from retrieval_core.evaluation.runs import RunError, check_same_models, choose_fusion, read_run_manifest


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
    try:
        check_same_models(plan.tune_on, dev, plan.embeddings, plan.cross_encoder, plan.precision, files.BEAM_FILES)
    except RunError as exc:
        raise RerankError(str(exc)) from None
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

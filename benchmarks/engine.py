"""In-process evaluation of one retrieval setting: encode -> index -> BE top-n -> CE rerank -> recall.

This makes the same library calls as the Beam pipelines (``retrieval_core.model`` encode/score,
``retrieval_core.index`` train/build/search, ``retrieval_core.rerank`` ranking, ``benchmarks.evaluate``), but
without a runner, so the timings measure model + index work, not Beam scheduling and IO overhead.

Within one suite run an :class:`EvalCache` keeps embeddings per (model, item) and CE scores per (model,
caption, image): EMB / CO / k / λ variants and overlapping collections (1k folds of a 5k set, distractor
pools) never re-encode or re-score. Every cached value also remembers what it cost to compute, so a row's
``encode_s`` / ``rerank_s`` / ``wall_s`` are the time a cold run of that row alone would take (the notes say
when parts came from the cache).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from retrieval_core import index as rindex
from retrieval_core import rerank
from retrieval_core.schema import DIRECTION_I2T, DIRECTION_T2I, ImageTable

#: CE scoring of every (query, item) pair is only attempted below this many pairs (else the row is skipped).
DEFAULT_CE_PAIR_BUDGET = 200_000
DIRECTIONS = (DIRECTION_T2I, DIRECTION_I2T)


class SkipRow(Exception):
    """A setting that is deliberately not run (e.g. exhaustive CE over the pair budget); str() is the reason."""


def call_with_supported(fn: Callable, *args, **kwargs):
    """Call ``fn`` with only the keyword arguments it accepts (VLRetrievalModel takes device/progress, the
    training-free baseline may not)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


# ------------------------------------------------------------------------------------------ caching
class _VectorStore:
    """Vectors of one (model, modality) by item id, each with the seconds it cost to encode."""

    def __init__(self) -> None:
        self.pos: dict[int, int] = {}
        self._chunks: list[np.ndarray] = []
        self._costs: list[np.ndarray] = []
        self._mat: Optional[np.ndarray] = None
        self._cost: Optional[np.ndarray] = None

    def missing(self, ids: np.ndarray) -> np.ndarray:
        return np.array([i for i in ids.tolist() if i not in self.pos], dtype=np.int64)

    def add(self, ids: np.ndarray, vectors: np.ndarray, seconds: float) -> None:
        start = len(self.pos)
        for j, i in enumerate(ids.tolist()):
            self.pos[i] = start + j
        self._chunks.append(np.asarray(vectors, dtype=np.float32))
        self._costs.append(np.full(len(ids), seconds / max(len(ids), 1), dtype=np.float64))
        self._mat = self._cost = None

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, float]:
        if self._mat is None:
            self._mat = np.concatenate(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
            self._cost = np.concatenate(self._costs) if len(self._costs) > 1 else self._costs[0]
            self._chunks, self._costs = [self._mat], [self._cost]
        rows = np.fromiter((self.pos[i] for i in ids.tolist()), dtype=np.int64, count=len(ids))
        return self._mat[rows], float(self._cost[rows].sum())


@dataclass
class EvalCache:
    """Embeddings and CE scores computed so far in one suite run, keyed by a model key (its folder)."""
    vectors: dict = field(default_factory=dict)  # (model_key, "text"|"image") -> _VectorStore
    ce: dict = field(default_factory=dict)  # model_key -> {(caption_id, image_id): (score, seconds)}

    def embed(self, model, model_key: str, kind: str, ids: np.ndarray, encode_missing: Callable,
              batch_size: int, device: str, progress: bool) -> tuple[np.ndarray, float, float]:
        """(vectors in ``ids`` order, their encoding cost in s, of which measured now in s)."""
        store = self.vectors.setdefault((model_key, kind), _VectorStore())
        ids = np.asarray(ids, dtype=np.int64)
        todo = store.missing(ids)
        fresh = 0.0
        if len(todo):
            t0 = time.perf_counter()
            vecs = encode_missing(todo)
            fresh = time.perf_counter() - t0
            store.add(todo, vecs, fresh)
        if len(ids) == 0:
            return np.zeros((0, 0), dtype=np.float32), 0.0, 0.0
        vecs, cost = store.get(ids)
        return vecs, cost, fresh

    def ce_scores(self, model, model_key: str, pairs: np.ndarray, texts_of: Callable, regions_of: Callable,
                  batch_size: int, device: str, progress: bool) -> tuple[np.ndarray, float, float]:
        """CE scores of (caption_id, image_id) ``pairs`` (P, 2): (scores, their cost in s, measured now in s)."""
        memo = self.ce.setdefault(model_key, {})
        keys = [(int(c), int(i)) for c, i in pairs.tolist()]
        todo = [kv for kv in keys if kv not in memo]
        fresh = 0.0
        if todo:
            texts = texts_of([c for c, _ in todo])
            regions = regions_of([i for _, i in todo])
            t0 = time.perf_counter()
            scores = call_with_supported(model.score, texts, regions, batch_size=batch_size, device=device,
                                         progress=progress)
            fresh = time.perf_counter() - t0
            per = fresh / len(todo)
            for kv, s in zip(todo, np.asarray(scores, dtype=np.float32).tolist()):
                memo[kv] = (s, per)
        got = [memo[kv] for kv in keys]
        return (np.array([g[0] for g in got], dtype=np.float32), float(sum(g[1] for g in got)), fresh)


# ------------------------------------------------------------------------------------------- inputs
@dataclass
class Pool:
    """The candidate items of one evaluation: images to rank for t2i, captions to rank for i2t."""
    images: ImageTable
    captions: pd.DataFrame  # needs caption_id and text

    def __post_init__(self) -> None:
        self.image_pos = self.images.position_of()
        self.caption_text = dict(zip(self.captions["caption_id"].astype(np.int64).tolist(),
                                     self.captions["text"].tolist()))

    def texts(self, caption_ids: Sequence[int]) -> list[str]:
        try:
            return [self.caption_text[int(c)] for c in caption_ids]
        except KeyError as exc:
            raise KeyError(f"caption {exc.args[0]} is not in the evaluation pool") from None

    def regions(self, image_ids: Sequence[int]) -> list:
        try:
            return [self.images.regions(self.image_pos[int(i)]) for i in image_ids]
        except KeyError as exc:
            raise KeyError(f"image {exc.args[0]} is not in the evaluation pool") from None

    def image_table(self, image_ids: np.ndarray) -> ImageTable:
        return self.images.take([self.image_pos[int(i)] for i in image_ids.tolist()])


@dataclass
class ModelRef:
    """A model plus the key its cached embeddings / CE scores are stored under (normally its folder)."""
    model: object
    key: str
    label: str = ""


@dataclass
class EvalResult:
    rankings: object  # rerank.rankings_table output (both directions concatenated)
    metrics: dict
    timings: dict
    notes: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------- evaluation
def _encode_side(cache: EvalCache, ref: ModelRef, kind: str, ids: np.ndarray, pool: Pool, batch_size: int,
                 device: str, progress: bool) -> tuple[np.ndarray, float, float]:
    if kind == "text":
        enc = lambda todo: call_with_supported(ref.model.encode_text, pool.texts(todo), batch_size=batch_size,
                                               device=device, progress=progress)
    else:
        enc = lambda todo: call_with_supported(ref.model.encode_image, pool.image_table(todo),
                                               batch_size=batch_size, device=device, progress=progress)
    return cache.embed(ref.model, ref.key, kind, ids, enc, batch_size, device, progress)


def build_index(factory: str, ids: np.ndarray, vectors: np.ndarray, seed: int = 0,
                max_train: int = 100_000) -> rindex.ShardedIndex:
    """A one-shard inner-product index over ``vectors`` (the library path pipelines.build_index takes)."""
    d = int(vectors.shape[1])
    sample = None
    if rindex.needs_training(factory, d, "ip"):
        sample = rindex.training_sample(ids, vectors, min(len(ids), max_train), seed=seed)
    trained = rindex.train_index(factory, d, "ip", sample, seed=seed)
    return rindex.ShardedIndex([rindex.build_shard(trained, ids, vectors)])


def evaluate_collection(be: ModelRef, ce: Optional[ModelRef], pool: Pool, gold: tuple[Mapping, Mapping], *,
                        mode: str = "emb", k: int = 20, lam: float = 0.0,
                        directions: Sequence[str] = DIRECTIONS, index_factory: str = "Flat",
                        batch_size: int = 128, cache: Optional[EvalCache] = None,
                        t2i_queries: Optional[np.ndarray] = None, i2t_queries: Optional[np.ndarray] = None,
                        exhaustive: bool = False, ce_pair_budget: int = DEFAULT_CE_PAIR_BUDGET,
                        index_params: Optional[dict] = None, device: str = "cpu", progress: bool = True
                        ) -> EvalResult:
    """Rank ``pool`` for the queries of one task and score the rankings.

    ``gold`` = (caption_id -> image_id, image_id -> caption ids) of the task; queries default to every pool
    caption with a gold image (t2i) and every pool image with gold captions (i2t). ``mode`` is one of
    rerank.MODES: "emb" ranks by BE cosine; "ce"/"add"/"norm_add" rerank the BE top-``k`` with ``ce``'s
    scores. ``exhaustive=True`` cross-encodes every (query, pool item) pair instead (the CE baseline); it
    raises :class:`SkipRow` when that exceeds ``ce_pair_budget`` pairs.
    """
    if mode not in rerank.MODES:
        raise ValueError(f"mode must be one of {rerank.MODES}, got {mode!r}")
    if mode != "emb" and ce is None:
        raise ValueError(f"mode {mode!r} needs a cross-encoder model")
    if exhaustive and mode == "emb":
        raise ValueError("exhaustive evaluation needs a CE mode")
    directions = tuple(directions)
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(f"directions must be a non-empty subset of {DIRECTIONS}, got {directions}")
    cache = cache if cache is not None else EvalCache()
    cap2img, img2caps = gold
    pool_caps = pool.captions["caption_id"].to_numpy(np.int64)
    pool_imgs = np.asarray(pool.images.item_ids, dtype=np.int64)
    if t2i_queries is None:
        t2i_queries = np.array([c for c in pool_caps.tolist() if c in cap2img], dtype=np.int64)
    if i2t_queries is None:
        i2t_queries = np.array([i for i in pool_imgs.tolist() if i in img2caps], dtype=np.int64)
    queries = {DIRECTION_T2I: np.asarray(t2i_queries, np.int64), DIRECTION_I2T: np.asarray(i2t_queries, np.int64)}
    targets = {DIRECTION_T2I: pool_imgs, DIRECTION_I2T: pool_caps}
    for d in directions:
        if len(queries[d]) == 0:
            raise ValueError(f"{d}: no queries with gold in this pool")

    n_pairs_exh = sum(len(queries[d]) * len(targets[d]) for d in directions)
    if exhaustive and n_pairs_exh > ce_pair_budget:
        raise SkipRow(f"skipped: exhaustive CE needs {n_pairs_exh:,} pairs, over the pair budget "
                      f"{ce_pair_budget:,} (--ce-pair-budget)")

    t = {"encode_s": 0.0, "encode_fresh_s": 0.0, "index_s": 0.0, "search_s": 0.0, "rerank_s": 0.0,
         "rerank_fresh_s": 0.0, "rank_s": 0.0, "ce_pairs": 0}
    notes: list[str] = []
    # Encode what each direction needs: t2i = caption queries + image pool; i2t = image queries + caption pool.
    none = np.zeros(0, dtype=np.int64)  # (a plain [] would turn the concatenation into float64 and round ids)
    need_text = np.unique(np.concatenate([queries[DIRECTION_T2I] if DIRECTION_T2I in directions else none,
                                          pool_caps if DIRECTION_I2T in directions else none]))
    need_img = np.unique(np.concatenate([pool_imgs if DIRECTION_T2I in directions else none,
                                         queries[DIRECTION_I2T] if DIRECTION_I2T in directions else none]))
    for kind, ids in (("text", need_text), ("image", need_img)):
        _, cost, fresh = _encode_side(cache, be, kind, ids, pool, batch_size, device, progress)
        t["encode_s"] += cost
        t["encode_fresh_s"] += fresh

    n = len(pool_imgs) if exhaustive else max(k, 10)
    be_hits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for d in directions:
        q_kind, t_kind = ("text", "image") if d == DIRECTION_T2I else ("image", "text")
        q_vecs, _, _ = _encode_side(cache, be, q_kind, queries[d], pool, batch_size, device, progress)
        t_vecs, _, _ = _encode_side(cache, be, t_kind, targets[d], pool, batch_size, device, progress)
        t0 = time.perf_counter()
        index = build_index(index_factory, targets[d], t_vecs)
        if index_params:
            index.set_params(**index_params)
        t["index_s"] += time.perf_counter() - t0
        n_d = len(targets[d]) if exhaustive else min(n, len(targets[d]))
        t0 = time.perf_counter()
        be_hits[d] = index.search(q_vecs, n_d)
        t["search_s"] += time.perf_counter() - t0

    # Cross-encode the unique (caption, image) pairs of every direction's top-k, once.
    k_eff = {d: (be_hits[d][1].shape[1] if exhaustive else min(k, be_hits[d][1].shape[1])) for d in directions}
    ce_of: dict[str, Optional[np.ndarray]] = {d: None for d in directions}
    if mode != "emb":
        blocks = []
        for d in directions:
            cand = be_hits[d][1][:, :k_eff[d]]
            qcol = np.repeat(queries[d], cand.shape[1])
            pairs = np.stack([qcol, cand.ravel()], 1) if d == DIRECTION_T2I else np.stack([cand.ravel(), qcol], 1)
            blocks.append(pairs[(pairs >= 0).all(1)])
        uniq = np.unique(np.concatenate(blocks), axis=0)
        scores, cost, fresh = cache.ce_scores(ce.model, ce.key, uniq, pool.texts, pool.regions, batch_size,
                                              device, progress)
        t["rerank_s"], t["rerank_fresh_s"], t["ce_pairs"] = cost, fresh, int(len(uniq))
        lookup = {(int(c), int(i)): s for (c, i), s in zip(uniq.tolist(), scores.tolist())}
        for d in directions:
            cand = be_hits[d][1][:, :k_eff[d]]
            out = np.full(cand.shape, np.nan, dtype=np.float32)
            for r, (q, row) in enumerate(zip(queries[d].tolist(), cand.tolist())):
                for j, item in enumerate(row):
                    if item >= 0:
                        out[r, j] = lookup[(q, item) if d == DIRECTION_T2I else (item, q)]
            ce_of[d] = out

    t0 = time.perf_counter()
    tables = []
    keep = max(10, k_eff[directions[0]]) if not exhaustive else 10
    for d in directions:
        scores, ids = be_hits[d]
        results = []
        for r in range(len(queries[d])):
            valid = ids[r] >= 0
            ce_row = None if ce_of[d] is None else ce_of[d][r][valid[:k_eff[d]]]
            results.append(rerank.rank_query(ids[r][valid], scores[r][valid], ce_row, k=k_eff[d], mode=mode,
                                             lam=lam, keep=keep))
        tables.append(rerank.rankings_table(d, queries[d], results))
    rankings = _concat_tables(tables)
    t["rank_s"] = time.perf_counter() - t0
    metrics = score_rankings(rankings, cap2img, img2caps, directions, queries)
    t["wall_s"] = t["encode_s"] + t["index_s"] + t["search_s"] + t["rerank_s"] + t["rank_s"]
    if t["encode_fresh_s"] < t["encode_s"] * 0.999:
        notes.append(f"encode_s includes {t['encode_s'] - t['encode_fresh_s']:.1f}s of cached embeddings "
                     f"at their measured cost")
    if mode != "emb" and t["rerank_fresh_s"] < t["rerank_s"] * 0.999:
        notes.append(f"rerank_s includes {t['rerank_s'] - t['rerank_fresh_s']:.1f}s of cached CE scores "
                     f"at their measured cost")
    return EvalResult(rankings, metrics, t, notes)


def score_rankings(rankings, cap2img: Mapping, img2caps: Mapping, directions: Sequence[str],
                   queries: Mapping[str, np.ndarray]) -> dict:
    """Recall of the ranked queries: benchmarks.evaluate for both directions (gold restricted to the queries
    actually run, since a query subset is deliberate here), metrics.recall_at_k for a single direction."""
    from benchmarks.evaluate import evaluate_rankings, ranked_lists
    from retrieval_core.metrics import recall_at_k

    t2i_set = set(queries[DIRECTION_T2I].tolist()) if DIRECTION_T2I in directions else set()
    i2t_set = set(queries[DIRECTION_I2T].tolist()) if DIRECTION_I2T in directions else set()
    c2i = {c: cap2img[c] for c in t2i_set}
    i2c = {i: img2caps[i] for i in i2t_set}
    if len(directions) == 2:
        return evaluate_rankings(rankings, c2i, i2c, ks=(1, 5, 10))
    (d,) = directions
    df = rankings.to_pandas() if not isinstance(rankings, pd.DataFrame) else rankings
    q, lists = ranked_lists(df, d)
    gold = [(c2i[int(x)],) for x in q] if d == DIRECTION_T2I else [i2c[int(x)] for x in q]
    rec = recall_at_k(lists, gold, (1, 5, 10))
    out = {f"{d}_R@{k}": v for k, v in rec.items()}
    out[f"{d}_queries"] = len(q)
    out["mR"] = float(np.mean(list(rec.values())))
    return out


def _concat_tables(tables: list):
    import pyarrow as pa

    if all(isinstance(x, pa.Table) for x in tables):
        return pa.concat_tables(tables)
    return pd.concat([x if isinstance(x, pd.DataFrame) else x.to_pandas() for x in tables], ignore_index=True)


def direction_metrics(metrics: Mapping, direction: str) -> dict:
    """R@1/5/10 + queries of one direction out of evaluate_rankings' dict."""
    return {f"R@{k}": metrics[f"{direction}_R@{k}"] for k in (1, 5, 10)} | \
        {"queries": metrics[f"{direction}_queries"]}

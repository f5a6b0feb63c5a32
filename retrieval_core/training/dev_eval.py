"""The trainer's dev evaluation: the BE's recall in both directions and the CE head's pair accuracies."""
from __future__ import annotations

from typing import Optional

import numpy as np

from retrieval_core.data.schema import ImageTable
from retrieval_core.evaluation import metrics
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.search import exact
from retrieval_core.training.train_data import TrainData, feature_neighbours


def evaluate(model: VLRetrievalModel, dev: TrainData, device: str = "cpu", batch_size: int = 128,
             amp_dtype: Optional[str] = None, k: int = 10, ce_pairs: int = 256, seed: int = 0,
             progress: bool = False, desc: str = "dev eval") -> dict:
    """BE retrieval on ``dev`` (exact dot-product top-k, recall both directions as in
    docs/CONVENTIONS.md#the-recall-convention) and the CE head's pair accuracies: the share of up to ``ce_pairs``
    dev captions whose gold image scores above a random other image (``ce_pair_acc``) and above the gold image's
    nearest dev image by pooled region features
    (``ce_hard_pair_acc``: the near-duplicates a reranker must tell apart).

    ``progress``: one bar over every item encoded or scored (captions, images, CE pairs) with rate and ETA;
    on the demo an evaluation takes as long as ~40 training steps, so a silent one looks like a hang."""
    from tqdm.auto import tqdm

    # only the images that have captions are retrieval targets/queries
    img_pos = np.unique(dev.image_pos)
    images = dev.images.take(img_pos)
    n_pairs = min(ce_pairs, len(dev)) if len(img_pos) >= 2 and ce_pairs > 0 else 0
    # the CE scores the sampled captions three times: with the gold, a random and the nearest image
    with tqdm(total=len(dev) + len(img_pos) + 3 * n_pairs, desc=desc, unit="item", disable=not progress,
              leave=False) as bar:
        # models without progress reporting (baseline.MappedBaseline) are evaluated quietly
        report = {"progress": bar.update} if progress else {}
        return _evaluate(model, dev, img_pos, images, device, batch_size, amp_dtype, k, n_pairs, seed, report)


def _evaluate(model: VLRetrievalModel, dev: TrainData, img_pos: np.ndarray, images: ImageTable, device: str,
              batch_size: int, amp_dtype: Optional[str], k: int, n_pairs: int, seed: int, report: dict) -> dict:
    text_emb = model.encode_text(dev.texts, batch_size, device, amp_dtype, **report)
    img_emb = model.encode_image(images, batch_size, device, amp_dtype, **report)
    _, t2i = exact.exact_topk(text_emb, img_emb, images.item_ids, k)
    _, i2t = exact.exact_topk(img_emb, text_emb, dev.caption_ids, k)
    cap2img, img2caps = dev.gold()
    out = metrics.bidirectional_recall(t2i, dev.caption_ids, i2t, images.item_ids, cap2img, img2caps)
    if n_pairs:
        rng = np.random.default_rng([seed, 99])
        caps = rng.choice(len(dev), size=n_pairs, replace=False)
        gold = dev.image_pos[caps]
        neg = img_pos[rng.integers(0, len(img_pos), size=len(caps))]
        clash = neg == gold
        while clash.any():
            neg[clash] = img_pos[rng.integers(0, len(img_pos), size=int(clash.sum()))]
            clash = neg == gold
        nearest = img_pos[feature_neighbours(dev.images, 1, positions=img_pos)[:, 0]]
        hard = nearest[np.searchsorted(img_pos, gold)]
        texts = [dev.texts[i] for i in caps]
        score = lambda pos: model.score(texts, [dev.images.regions(int(p)) for p in pos], batch_size,  # noqa: E731
                                        device, amp_dtype, **report)
        pos_s = score(gold)
        out["ce_pair_acc"] = float(np.mean(pos_s > score(neg)) * 100.0)
        out["ce_hard_pair_acc"] = float(np.mean(pos_s > score(hard)) * 100.0)
    return out


def reranked_recall(be: VLRetrievalModel, ce: VLRetrievalModel, dev: TrainData, queries: int, k: int = 20,
                    device: str = "cpu", batch_size: int = 128, amp_dtype: Optional[str] = None,
                    seed: int = 0) -> dict:
    """R@1 of the BE alone (``emb``) and of the CE reranking the BE's top ``k`` (``co``: the CE's order of those
    k, the gold a miss when the BE left it out), on a seeded sample of ``queries`` dev captions (t2i) and
    ``queries`` dev images (i2t), as the suites rank them: what the joint model's CE is for. Keys
    ``<emb|co>_<t2i|i2t>_R@1`` (percent) and, for paired intervals, ``<mode>_<direction>_hits`` (0/1 per query,
    in sample order)."""
    rng = np.random.default_rng([seed, 7])
    img_pos = np.unique(dev.image_pos)
    images = dev.images.take(img_pos)
    caps = np.sort(rng.choice(len(dev), size=min(queries, len(dev)), replace=False))
    imgs = np.sort(rng.choice(len(img_pos), size=min(queries, len(img_pos)), replace=False))
    text_emb = be.encode_text(dev.texts, batch_size, device, amp_dtype)
    img_emb = be.encode_image(images, batch_size, device, amp_dtype)
    _, t2i = exact.exact_topk(text_emb[caps], img_emb, np.arange(len(img_pos)), k)  # positions in img_pos
    _, i2t = exact.exact_topk(img_emb[imgs], text_emb, np.arange(len(dev)), k)  # caption positions
    gold_img = np.searchsorted(img_pos, dev.image_pos)  # caption position -> its image's position in img_pos
    # the CE scores every (query, candidate) pair: caption text with the candidate's (or the query's) regions
    t2i_scores = ce.score([dev.texts[c] for c in caps for _ in range(k)],
                          [images.regions(int(i)) for row in t2i for i in row], batch_size, device,
                          amp_dtype).reshape(len(caps), k)
    i2t_scores = ce.score([dev.texts[int(c)] for row in i2t for c in row],
                          [images.regions(int(i)) for i in imgs for _ in range(k)], batch_size, device,
                          amp_dtype).reshape(len(imgs), k)
    t2i_gold = t2i == gold_img[caps][:, None]
    i2t_gold = gold_img[i2t] == imgs[:, None]
    out: dict = {}
    for direction, gold, scores in (("t2i", t2i_gold, t2i_scores), ("i2t", i2t_gold, i2t_scores)):
        top_ce = np.argmax(scores, axis=1)  # ties: the BE's order
        hits = {"emb": gold[:, 0], "co": gold[np.arange(len(gold)), top_ce]}
        for mode, h in hits.items():
            out[f"{mode}_{direction}_R@1"] = float(h.mean() * 100.0)
            out[f"{mode}_{direction}_hits"] = h.astype(np.int8)
    return out

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

"""Training losses: BE batch-hard triplet (VSE++ max violation) and InfoNCE; CE negative sampling, the pair loss
and the listwise (LCE) loss.

A BE batch has one row per caption: ``text_emb[i]`` is caption i, ``image_emb[i]`` its image (an image may
repeat), ``image_ids[i]`` that image's id. Entries sharing an image id are never negatives of each other.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F


def _same_image(image_ids: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(image_ids).to(torch.long).reshape(-1)
    return ids[:, None] == ids[None, :]


def batch_hard_triplet_loss(text_emb: torch.Tensor, image_emb: torch.Tensor, image_ids: torch.Tensor,
                            margin: float = 0.1) -> torch.Tensor:
    """VSE++ max-violation triplet loss on cosine similarities (inputs L2-normalised).

    S[i, j] = <text_i, image_j>. For caption i: max(0, margin + max_{j neg} S[i, j] - S[i, i]);
    for image i (column i): max(0, margin + max_{j neg} S[j, i] - S[i, i]); j is a negative when
    image_ids[j] != image_ids[i]. Both terms are averaged over the batch and summed. A row with no negative
    in the batch contributes 0.
    """
    sim = text_emb @ image_emb.T
    pos = sim.diagonal()
    neg_mask = ~_same_image(image_ids).to(sim.device)
    very_negative = torch.finfo(sim.dtype).min
    masked = sim.masked_fill(~neg_mask, very_negative)
    hardest_image = masked.max(dim=1).values  # per caption
    hardest_caption = masked.max(dim=0).values  # per image column
    has_neg = neg_mask.any(dim=1)
    zero = torch.zeros_like(pos)
    loss_t2i = torch.where(has_neg, (margin + hardest_image - pos).clamp(min=0), zero)
    loss_i2t = torch.where(has_neg, (margin + hardest_caption - pos).clamp(min=0), zero)
    return loss_t2i.mean() + loss_i2t.mean()


def infonce_loss(text_emb: torch.Tensor, image_emb: torch.Tensor, image_ids: torch.Tensor,
                 temperature: float = 0.05) -> torch.Tensor:
    """In-batch softmax in both directions (LightningDOT CMR); other entries of the same image are removed
    from the denominators (they are not negatives), the diagonal is the positive. Mean of both directions."""
    logits = (text_emb @ image_emb.T) / temperature
    same = _same_image(image_ids).to(logits.device)
    off_diag_same = same & ~torch.eye(len(logits), dtype=torch.bool, device=logits.device)
    logits = logits.masked_fill(off_diag_same, float("-inf"))
    target = torch.arange(len(logits), device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


class HardNegatives:
    """Per image, the positions of its ``k`` most similar other images, plus a caption index by image, so a
    hard negative is drawn in O(1): an image from the gold image's neighbours, or a caption of one of them.

    Built by :func:`training.train_data.feature_neighbours` (nearest images by pooled region features), which
    needs no trained model: in the synthetic benchmark those are the near-duplicate siblings, in real data
    visually similar scenes - the candidates a CE must learn to reject when it reranks a BE's top-k.
    """

    def __init__(self, neighbours: np.ndarray, image_pos_of_caption: np.ndarray):
        self.neighbours = np.asarray(neighbours, dtype=np.int64)
        if self.neighbours.ndim != 2 or self.neighbours.shape[1] < 1:
            raise ValueError(f"neighbours must be (num_images, k>=1), got {self.neighbours.shape}")
        img = np.asarray(image_pos_of_caption, dtype=np.int64)
        self.caption_order = np.argsort(img, kind="stable")  # caption positions grouped by image
        self.caption_offsets = np.searchsorted(img[self.caption_order], np.arange(len(self.neighbours) + 1))

    def images(self, rng: np.random.Generator, gold: np.ndarray) -> np.ndarray:
        return self.neighbours[gold, rng.integers(0, self.neighbours.shape[1], size=len(gold))]

    def captions(self, rng: np.random.Generator, gold: np.ndarray) -> np.ndarray:
        """A random caption of a random neighbour of each gold image (-1 where that neighbour has none)."""
        img = self.images(rng, gold)
        lo, hi = self.caption_offsets[img], self.caption_offsets[img + 1]
        pick = lo + (rng.random(len(img)) * (hi - lo)).astype(np.int64)
        return np.where(hi > lo, self.caption_order[np.minimum(pick, len(self.caption_order) - 1)], -1)


class MinedNegatives:
    """CE negatives from the bi-encoder's own top-k (what the CE will rerank): per caption, the images the BE
    ranks highest that are not its gold image (t2i); per image, the captions the BE ranks highest that are not
    its own (i2t). Built by :func:`training.train_data.mine_be_negatives` for the captions of the coming steps.

    ``caption_keys`` (sorted caption positions) with ``caption_images`` (n, k) image positions, ``image_keys``
    (sorted image positions) with ``image_captions`` (m, k) caption positions; -1 pads a short row."""

    def __init__(self, caption_keys: np.ndarray, caption_images: np.ndarray, image_keys: np.ndarray,
                 image_captions: np.ndarray):
        self.caption_keys = np.asarray(caption_keys, dtype=np.int64)
        self.caption_images = np.asarray(caption_images, dtype=np.int64)
        self.image_keys = np.asarray(image_keys, dtype=np.int64)
        self.image_captions = np.asarray(image_captions, dtype=np.int64)
        for keys, rows in ((self.caption_keys, self.caption_images), (self.image_keys, self.image_captions)):
            if rows.ndim != 2 or len(rows) != len(keys) or np.any(np.diff(keys) <= 0):
                raise ValueError("mined negatives need sorted unique keys and one (k,) row per key")

    @staticmethod
    def _draw(rng: np.random.Generator, keys: np.ndarray, rows: np.ndarray, query: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(keys, query)
        pos = np.minimum(pos, max(len(keys) - 1, 0))
        known = (len(keys) > 0) & (keys[pos] == query) if len(keys) else np.zeros(len(query), dtype=bool)
        out = np.full(len(query), -1, dtype=np.int64)
        if rows.shape[1] == 0 or not known.any():
            return out
        picked = rows[pos[known], rng.integers(0, rows.shape[1], size=int(known.sum()))]
        out[known] = picked
        return out

    def images(self, rng: np.random.Generator, caption_pos: np.ndarray) -> np.ndarray:
        """A BE-confusable wrong image per caption (-1 for a caption that was not mined)."""
        return self._draw(rng, self.caption_keys, self.caption_images, np.asarray(caption_pos, dtype=np.int64))

    def captions(self, rng: np.random.Generator, image_pos: np.ndarray) -> np.ndarray:
        """A BE-confusable wrong caption per image (-1 for an image that was not mined)."""
        return self._draw(rng, self.image_keys, self.image_captions, np.asarray(image_pos, dtype=np.int64))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"caption_keys": self.caption_keys, "caption_images": self.caption_images,
                "image_keys": self.image_keys, "image_captions": self.image_captions}


def sample_ce_groups(rng: np.random.Generator, caption_idx: np.ndarray, image_pos_of_caption: np.ndarray,
                     num_images: int, num_captions: int, num_negatives: int = 1, p_replace_image: float = 0.5,
                     hard: Optional[HardNegatives] = None, p_hard: float = 0.0,
                     mined: Optional[MinedNegatives] = None, p_mined: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per caption of the batch, one group: the positive (caption, its gold image) and ``num_negatives`` negatives.

    ``caption_idx`` (B,) are caption positions; ``image_pos_of_caption`` (num_captions,) maps every caption
    position to its image position. A group's negatives replace the image (probability ``p_replace_image``, per
    group) with other images, or the caption with captions of other images; a draw that hits the gold image is
    redrawn (O(1) expected per item). With ``hard`` and probability ``p_hard`` per negative, the replacement comes
    from the gold image's nearest images (or their captions) instead of the whole set. With ``mined`` and
    probability ``p_mined`` per negative (drawn after the hard ones, so it takes precedence), it comes from the
    BE's top-k instead: a wrong image the BE ranks high for the caption, or a wrong caption the BE ranks high for
    the gold image. Returns (caption positions, image positions), each (B, 1 + num_negatives), column 0 the
    positive.
    """
    caption_idx = np.asarray(caption_idx, dtype=np.int64)
    image_pos_of_caption = np.asarray(image_pos_of_caption, dtype=np.int64)
    if num_images < 2:
        raise ValueError("CE negatives need at least 2 images")
    if num_negatives < 1:
        raise ValueError(f"num_negatives must be >= 1, got {num_negatives}")
    gold = image_pos_of_caption[caption_idx]
    b, width = len(caption_idx), 1 + num_negatives
    caps = np.repeat(caption_idx[:, None], width, axis=1)
    imgs = np.repeat(gold[:, None], width, axis=1)  # caption-replaced negatives keep the gold image
    replace_image = rng.random(b) < p_replace_image
    rows, cols = np.repeat(np.arange(b), num_negatives), np.tile(np.arange(1, width), b)
    todo = np.arange(len(rows))  # negatives still to (re)draw
    for _ in range(1000):
        r, c = rows[todo], cols[todo]
        ri, rc = replace_image[r], ~replace_image[r]
        imgs[r[ri], c[ri]] = rng.integers(0, num_images, size=int(ri.sum()))
        caps[r[rc], c[rc]] = rng.integers(0, num_captions, size=int(rc.sum()))
        if hard is not None and p_hard > 0:
            use_hard = rng.random(len(r)) < p_hard
            hi, hc = ri & use_hard, rc & use_hard
            imgs[r[hi], c[hi]] = hard.images(rng, gold[r[hi]])
            drawn = hard.captions(rng, gold[r[hc]])
            caps[r[hc], c[hc]] = np.where(drawn >= 0, drawn, caps[r[hc], c[hc]])
        if mined is not None and p_mined > 0:
            use_mined = rng.random(len(r)) < p_mined
            mi, mc = ri & use_mined, rc & use_mined
            drawn = mined.images(rng, caption_idx[r[mi]])
            imgs[r[mi], c[mi]] = np.where(drawn >= 0, drawn, imgs[r[mi], c[mi]])
            drawn = mined.captions(rng, gold[r[mc]])
            caps[r[mc], c[mc]] = np.where(drawn >= 0, drawn, caps[r[mc], c[mc]])
        # a negative is a real mismatch: the pair's image is not the gold image of the pair's caption
        todo = todo[image_pos_of_caption[caps[r, c]] == imgs[r, c]]
        if len(todo) == 0:
            break
    else:
        raise ValueError("could not draw CE negatives: do all captions belong to one image?")
    return caps, imgs


def sample_ce_pairs(rng: np.random.Generator, caption_idx: np.ndarray, image_pos_of_caption: np.ndarray,
                    num_images: int, num_captions: int, p_replace_image: float = 0.5,
                    hard: Optional[HardNegatives] = None, p_hard: float = 0.0
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One positive and one negative (caption, image) pair per caption (the paper's CE data): groups of
    :func:`sample_ce_groups` with one negative, flattened. Returns (caption positions, image positions,
    labels), each (2B,): the B positives first, then the B negatives; labels 1 = match."""
    caps, imgs = sample_ce_groups(rng, caption_idx, image_pos_of_caption, num_images, num_captions, 1,
                                  p_replace_image, hard, p_hard)
    b = len(caps)
    labels = np.concatenate([np.ones(b, dtype=np.int64), np.zeros(b, dtype=np.int64)])
    return caps.T.reshape(-1), imgs.T.reshape(-1), labels


def ce_pair_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """2-class cross-entropy on the CE head's (B, 2) logits, or BCE on (B,) match log-odds — the same
    quantity, since softmax over 2 logits = sigmoid of their difference."""
    labels = torch.as_tensor(labels, device=logits.device)
    if logits.ndim == 2:
        return F.cross_entropy(logits.float(), labels.long())
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


def ce_listwise_loss(scores: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy over each group's CE scores (B, 1 + n), the positive in column 0: the localised
    contrastive estimation (LCE) loss of reranker training (Gao et al., 2021), where the negatives are the
    near misses a retriever returns. Unlike the pair loss it compares the positive with its own negatives
    directly, so the gradient concentrates on what tells them apart."""
    target = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    return F.cross_entropy(scores.float(), target)

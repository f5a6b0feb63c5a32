import math

import numpy as np
import pytest
import torch

from retrieval_core.training.losses import batch_hard_triplet_loss, ce_pair_loss, infonce_loss, sample_ce_pairs


def _unit(angle_deg):
    a = math.radians(angle_deg)
    return [math.cos(a), math.sin(a)]


def test_triplet_hand_computed_3x3():
    # 2-d unit vectors so S = cos(angle difference) is easy to write out.
    text = torch.tensor([_unit(0), _unit(90), _unit(45)])
    image = torch.tensor([_unit(10), _unit(80), _unit(60)])
    ids = torch.tensor([1, 2, 3])
    c = lambda d: math.cos(math.radians(d))  # noqa: E731
    # S[i,j] = cos(text_i - image_j):
    # row0: cos10 cos80 cos60 ; row1: cos80 cos10 cos30 ; row2: cos35 cos35 cos15
    t2i = [max(0, 0.1 + max(c(80), c(60)) - c(10)),   # caption 0: hardest neg image 2
           max(0, 0.1 + max(c(80), c(30)) - c(10)),   # caption 1: hardest neg image 2
           max(0, 0.1 + max(c(35), c(35)) - c(15))]   # caption 2
    i2t = [max(0, 0.1 + max(c(80), c(35)) - c(10)),   # image 0 column: captions 1, 2
           max(0, 0.1 + max(c(80), c(35)) - c(10)),   # image 1 column: captions 0, 2
           max(0, 0.1 + max(c(60), c(30)) - c(15))]   # image 2 column: captions 0, 1
    expected = np.mean(t2i) + np.mean(i2t)
    got = batch_hard_triplet_loss(text, image, ids, margin=0.1).item()
    assert got == pytest.approx(expected, abs=1e-6)
    assert expected > 0  # the case is not trivially zero


def test_triplet_masks_captions_of_the_same_image():
    # captions 0 and 1 describe image 7 (image rows duplicated); caption 2 -> image 8.
    text = torch.tensor([_unit(0), _unit(5), _unit(90)])
    image = torch.tensor([_unit(0), _unit(0), _unit(90)])
    ids = torch.tensor([7, 7, 8])
    c = lambda d: math.cos(math.radians(d))  # noqa: E731
    # S = [[1, 1, c90], [c5, c5, c85], [c90, c90, 1]]; same-image entries (0,1),(1,0) are not negatives.
    t2i = [max(0, 0.1 + c(90) - 1), max(0, 0.1 + c(85) - c(5)), max(0, 0.1 + c(90) - 1)]
    i2t = [max(0, 0.1 + c(90) - 1), max(0, 0.1 + c(90) - c(5)), max(0, 0.1 + c(85) - 1)]
    expected = np.mean(t2i) + np.mean(i2t)
    got = batch_hard_triplet_loss(text, image, ids, margin=0.1).item()
    assert got == pytest.approx(expected, abs=1e-6)
    # Without masking, caption 1's "negative" image 0 (S=c5) would make the loss much larger:
    unmasked = batch_hard_triplet_loss(text, image, torch.tensor([1, 2, 3]), margin=0.1).item()
    assert unmasked > got + 0.05


def test_infonce_hand_computed_with_masking():
    text = torch.tensor([_unit(0), _unit(5), _unit(90)])
    image = torch.tensor([_unit(0), _unit(0), _unit(90)])
    ids = torch.tensor([7, 7, 8])
    t = 0.5
    s = (text @ image.T).numpy() / t
    mask = np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=bool)
    s_m = np.where(mask, -np.inf, s)

    def xent(rows):
        return np.mean([-(r[i] - np.log(np.exp(r).sum())) for i, r in enumerate(rows)])

    expected = 0.5 * (xent(s_m) + xent(s_m.T))
    got = infonce_loss(text, image, ids, temperature=t).item()
    assert got == pytest.approx(expected, rel=1e-5)


def test_sample_ce_pairs_positives_and_true_negatives():
    rng = np.random.default_rng(0)
    image_pos_of_caption = np.repeat(np.arange(10), 3)  # 10 images x 3 captions
    batch = np.arange(0, 30, 2)
    caps, imgs, labels = sample_ce_pairs(rng, batch, image_pos_of_caption, 10, 30, p_replace_image=0.5)
    b = len(batch)
    assert caps.shape == imgs.shape == labels.shape == (2 * b,)
    assert labels[:b].all() and not labels[b:].any()
    assert (imgs[:b] == image_pos_of_caption[batch]).all()
    gold = image_pos_of_caption[batch]
    # every negative is a real mismatch: its image is not the gold image of its caption
    assert (image_pos_of_caption[caps[b:]] != imgs[b:]).all()
    # caption-replaced negatives keep the gold image; image-replaced negatives keep the caption
    for c, i, orig, g in zip(caps[b:], imgs[b:], batch, gold):
        assert (c == orig and i != g) or (c != orig and i == g)
    # both kinds occur with p=0.5
    assert (caps[b:] == batch).any() and (caps[b:] != batch).any()


def test_sample_ce_pairs_needs_two_images():
    with pytest.raises(ValueError):
        sample_ce_pairs(np.random.default_rng(0), np.array([0]), np.array([0, 0]), 1, 2)


def test_ce_pair_loss_two_class_equals_bce_on_log_odds():
    logits = torch.tensor([[0.2, 1.5], [1.0, -0.5], [0.0, 0.0]])
    labels = torch.tensor([1, 0, 1])
    two_class = ce_pair_loss(logits, labels).item()
    log_odds = logits[:, 1] - logits[:, 0]
    bce = ce_pair_loss(log_odds, labels).item()
    hand = np.mean([-math.log(1 / (1 + math.exp(-1.3))), -math.log(1 - 1 / (1 + math.exp(1.5))), math.log(2)])
    assert two_class == pytest.approx(hand, rel=1e-5)
    assert bce == pytest.approx(hand, rel=1e-5)


def test_hard_negatives_come_from_the_neighbour_pool_and_are_mismatches():
    from retrieval_core.training.losses import HardNegatives

    rng = np.random.default_rng(1)
    image_pos_of_caption = np.repeat(np.arange(12), 2)  # 12 images x 2 captions
    neighbours = (np.arange(12)[:, None] + np.array([1, 2])) % 12  # image i's pool: i+1, i+2
    hard = HardNegatives(neighbours, image_pos_of_caption)
    batch = np.arange(24)
    caps, imgs, labels = sample_ce_pairs(rng, batch, image_pos_of_caption, 12, 24, 0.5, hard, p_hard=1.0)
    b = len(batch)
    gold = image_pos_of_caption[batch]
    assert (image_pos_of_caption[caps[b:]] != imgs[b:]).all()
    for c, i, orig, g in zip(caps[b:], imgs[b:], batch, gold):
        other = i if c == orig else image_pos_of_caption[c]  # the image the negative brings in
        assert other in neighbours[g], (c, i, g)
    # p_hard=0 never uses the pool preferentially: with 12 images some negatives fall outside it
    caps, imgs, _ = sample_ce_pairs(np.random.default_rng(2), batch, image_pos_of_caption, 12, 24, 1.0, hard, 0.0)
    assert any(i not in neighbours[g] for i, g in zip(imgs[b:], gold))


def test_sample_ce_groups_positive_first_and_negatives_replace_one_side_per_group():
    from retrieval_core.training.losses import sample_ce_groups

    image_pos_of_caption = np.repeat(np.arange(10), 3)  # 10 images x 3 captions
    batch = np.arange(0, 30, 2)
    caps, imgs = sample_ce_groups(np.random.default_rng(0), batch, image_pos_of_caption, 10, 30, num_negatives=3)
    gold = image_pos_of_caption[batch]
    assert caps.shape == imgs.shape == (len(batch), 4)
    assert (caps[:, 0] == batch).all() and (imgs[:, 0] == gold).all()
    assert (image_pos_of_caption[caps[:, 1:]] != imgs[:, 1:]).all()  # every negative is a real mismatch
    image_groups = (caps[:, 1:] == batch[:, None]).all(1)  # the caption kept, the images replaced
    caption_groups = (imgs[:, 1:] == gold[:, None]).all(1)  # the image kept, the captions replaced
    assert (image_groups ^ caption_groups).all() and image_groups.any() and caption_groups.any()
    with pytest.raises(ValueError, match="num_negatives"):
        sample_ce_groups(np.random.default_rng(0), batch, image_pos_of_caption, 10, 30, num_negatives=0)


def test_ce_listwise_loss_is_softmax_cross_entropy_with_the_positive_first():
    from retrieval_core.training.losses import ce_listwise_loss

    scores = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 1.0]])
    hand = np.mean([-(2.0 - np.log(np.exp([2.0, 0.0, -1.0]).sum())), -(0.0 - np.log(np.exp([0.0, 1.0, 1.0]).sum()))])
    assert ce_listwise_loss(scores).item() == pytest.approx(hand, rel=1e-6)
    # only differences within a group matter: a shared offset (the pair loss's bias) changes nothing
    assert ce_listwise_loss(scores + 5.0).item() == pytest.approx(hand, rel=1e-6)

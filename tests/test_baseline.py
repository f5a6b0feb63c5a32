import numpy as np
import pytest
import torch

from retrieval_core.model.baseline import MappedBaseline
from retrieval_core.training.dev_eval import evaluate
from retrieval_core.training.train_data import TrainData
from tests.helpers_model import make_tiny_dataset, split_dataset, write_tiny_bert
from tests.test_train import chance_mr


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("baseline")
    bert = write_tiny_bert(str(root / "bert"))
    caps, imgs = make_tiny_dataset(num_images=120, feature_dim=48, seed=2)  # F + 6 > 32: PCA path
    return root, bert, split_dataset(caps, imgs, "train"), split_dataset(caps, imgs, "dev")


@pytest.mark.parametrize("method", ["lstsq", "procrustes"])
def test_mapping_beats_chance_on_held_out_pairs(setup, method):
    root, bert, (tr_caps, tr_imgs), (dev_caps, dev_imgs) = setup
    base = MappedBaseline.fit(tr_caps, tr_imgs, text_model=bert, method=method)
    assert base.embedding_dim == 32 and base.feature_dim == 48
    assert ("pca" in base.arrays) and base.arrays["pca"].shape == (54, 32)
    dev = TrainData(dev_caps, dev_imgs)
    result = evaluate(base, dev, ce_pairs=0)
    chance = chance_mr(n_images=len(dev_imgs), captions_per_image=2)
    assert result["mR"] > chance + 10, (method, result, chance)
    if method == "procrustes":  # orthogonal map: W has orthonormal columns
        w = base.arrays["W"]
        np.testing.assert_allclose(w.T @ w, np.eye(w.shape[1]), atol=1e-8)


def test_save_load_identical_outputs(setup):
    root, bert, (tr_caps, tr_imgs), (dev_caps, dev_imgs) = setup
    base = MappedBaseline.fit(tr_caps, tr_imgs, text_model=bert, method="lstsq", ridge=1e-2)
    base.save(str(root / "saved"))
    again = MappedBaseline.load(str(root / "saved"))
    texts = dev_caps["text"].tolist()
    np.testing.assert_array_equal(base.encode_text(texts), again.encode_text(texts))
    np.testing.assert_array_equal(base.encode_image(dev_imgs), again.encode_image(dev_imgs))
    emb = again.encode_image(dev_imgs)
    assert emb.dtype == np.float32 and np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)
    assert MappedBaseline.is_baseline_dir(str(root / "saved"))


def test_bad_inputs_are_clear_errors(setup):
    root, bert, (tr_caps, tr_imgs), _ = setup
    with pytest.raises(ValueError, match="method"):
        MappedBaseline.fit(tr_caps, tr_imgs, text_model=bert, method="magic")
    bad = tr_caps.assign(image_item_id=tr_caps["image_item_id"] + 1)
    with pytest.raises(ValueError, match="no image"):
        MappedBaseline.fit(bad, tr_imgs, text_model=bert)

"""The model a training run starts from: a backbone or model folder (:func:`build_model`) and the least-squares
start of its image embedding (:func:`lstsq_image_embedding`)."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from retrieval_core.data.pixels.backbone import check_same_features
from retrieval_core.model.backbones import BACKBONES, backbone_path, is_backbone_name
from retrieval_core.model.baseline import pooled_image_vectors
from retrieval_core.model.checkpoints import (
    KIND_BASELINE,
    CheckpointError,
    from_text_backbone,
    inspect_model_folder,
    load_model_folder,
)
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.training.train_data import TrainData


def build_model(base_model: str, feature_dim: int, halve_layers: bool, seed: int,
                ce_agreement: Optional[str] = None, image_backbone: str = "") -> VLRetrievalModel:
    """A named backbone (``backbones``: minilm, multilingual-e5-small / e5), a plain HF BERT folder, or any
    retrieval model folder ``checkpoints.load_model_folder`` knows (ours, MMT-Retrieval, OSCAR: continue
    fine-tuning; a head it lacks starts fresh and is trained here). ``ce_agreement``: the CE head's agreement term
    of a model built from a backbone (None: ce_agreement_default's for a new model); a model folder keeps its own."""
    if not is_backbone_name(base_model):
        if not os.path.isdir(base_model):
            raise FileNotFoundError(f"base model {base_model!r}: no such folder (give a backbone name "
                                    f"({', '.join(BACKBONES)}), a plain HF BERT folder or a retrieval model "
                                    f"folder: ours, MMT-Retrieval or OSCAR)")
        try:
            info = inspect_model_folder(base_model)
        except CheckpointError:
            info = None  # not a retrieval model: a plain BERT folder, or an error below
        if info is not None:
            if info.kind == KIND_BASELINE:
                raise ValueError(f"base model {base_model!r} is a training-free baseline; it cannot be fine-tuned")
            if halve_layers:
                raise ValueError("--halve-layers applies to a text backbone, not to an existing retrieval model")
            model = load_model_folder(base_model)
            if model.feature_dim != feature_dim:
                raise ValueError(f"{base_model} expects {model.feature_dim}-d features, the staged data has "
                                 f"{feature_dim}")
            check_same_features(image_backbone, model.cfg.image_backbone, "the staged data", base_model)
            return model
        if not os.path.isfile(os.path.join(base_model, "config.json")):
            raise ValueError(f"base model {base_model!r} is neither a retrieval model folder (rr_model.json, "
                             f"modules.json, OSCAR config.json) nor a HF BERT folder (config.json)")
    path = backbone_path(base_model)
    try:
        model = from_text_backbone(path, feature_dim, keep_every_other_layer=halve_layers, seed=seed,
                                   ce_agreement=ce_agreement)
        model.cfg.image_backbone = image_backbone  # a new image projection: it learns these features
        return model
    except (OSError, KeyError) as exc:  # transformers' "not a valid model identifier", missing weights...
        raise ValueError(f"base model {path!r} cannot be loaded as a BERT folder: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


_TOKENIZE_SLICE = 8192


def lstsq_image_embedding(model: VLRetrievalModel, data: TrainData, ridge: float = 1e-2) -> float:
    """Training-free start for the image embedding (the least-squares map of seed paper 004, one layer down).

    Fits ``img_embedding`` (Linear(F + 6 -> hidden)) so that the mean of an image's region tokens before
    LayerNorm approximates the mean input word embedding of its captions (special tokens excluded). The
    layer is linear, so a map fitted on image means applies to each region: regions enter the encoder
    looking like the words that describe them. Ridge ``ridge * mean eigenvalue`` (the feature dimension
    exceeds the number of images in small sets). Returns the fit's R² on the training images.
    """
    img_pos = np.unique(data.image_pos)
    x = pooled_image_vectors(data.images.take(img_pos), model.cfg.max_regions)
    # float32, widened per caption: a float64 copy of multilingual-e5's 250k-row matrix would take 768 MB
    words = model.bert.embeddings.word_embeddings.weight.detach().cpu().numpy()
    tok = model.tokenizer
    special = set(tok.all_special_ids)
    target = np.zeros((len(img_pos), words.shape[1]))
    count = np.zeros(len(img_pos))
    row_of = np.searchsorted(img_pos, data.image_pos)
    # tokenized in slices: one call over COCO train's 566k captions held ~2 GB of encodings at once
    for start in range(0, len(data.texts), _TOKENIZE_SLICE):
        texts = list(data.texts[start:start + _TOKENIZE_SLICE])
        for ids, row in zip(tok(texts, truncation=True, max_length=model.cfg.max_text_len)["input_ids"],
                            row_of[start:start + _TOKENIZE_SLICE]):
            ids = [i for i in ids if i not in special]
            if ids:
                target[row] += words[ids].astype(np.float64).mean(0)
                count[row] += 1
    keep = count > 0
    if not keep.all():  # a copy only when some image has no caption tokens
        x, target, count = x[keep], target[keep], count[keep]
    target /= count[:, None]
    # centred in place: at COCO train (113k x 2,054 float64, 1.9 GB) a centred copy would double the peak
    x_mean, t_mean = x.mean(0), target.mean(0)
    x -= x_mean
    target -= t_mean
    xc, tc = x, target
    gram = xc.T @ xc
    w = np.linalg.solve(gram + ridge * np.trace(gram) / len(gram) * np.eye(len(gram)), xc.T @ tc)
    r2 = 1.0 - float(((xc @ w - tc) ** 2).sum() / max((tc ** 2).sum(), 1e-12))
    with torch.no_grad():
        layer = model.img_embedding
        layer.weight.copy_(torch.from_numpy(w.T).to(layer.weight.dtype))
        layer.bias.copy_(torch.from_numpy(t_mean - x_mean @ w).to(layer.bias.dtype))
    return r2

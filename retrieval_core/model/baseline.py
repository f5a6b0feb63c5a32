"""Training-free BE baseline (seed paper 004): map image vectors into a frozen text encoder's space.

* text: mean pooling of a pretrained BERT-family encoder's outputs (all-MiniLM-L6-v2 by default), centred.
* image: mean of the region features plus the mean box, centred (and reduced to the text dimension with PCA
  fitted on the training images when it is larger, as the orthogonal map needs).
* map, fitted on training (caption, image) pairs, one row per caption:
  ``lstsq``:      W = (XᵀX + ridge·I)⁻¹ XᵀT   (normal equations with a small ridge)
  ``procrustes``: W = U Vᵀ with U Σ Vᵀ = SVD(XᵀT), rows of X and T L2-normalised first (rotation only).
Both sides are L2-normalised at the end, so the dot product is the cosine, as for the trained model.

It exposes the model's BE interface (``encode_text``, ``encode_image``, ``embedding_dim``, ``save``/``load``),
so benchmarks list it as one more row. It has no CE head. Like a trained model it keeps the backbone fingerprint
of the image features it was fitted on (``image_backbone``, "" for extracted region features), so encode and
rerank refuse features of another source.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoTokenizer, BertModel

from retrieval_core.data.schema import (
    DEFAULT_MAX_REGIONS,
    DEFAULT_MAX_TEXT_TOKENS,
    SCHEMA_VERSION,
    ImageReader,
    ImageTable,
)
from retrieval_core.model.backbones import backbone_path, is_backbone_name
from retrieval_core.model.collate import Regions, TextCollator

METHODS = ("lstsq", "procrustes")
BASELINE_JSON = "rr_baseline.json"
BASELINE_TENSORS = "baseline.safetensors"


def _normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def pooled_image_vectors(images: ImageReader | Sequence[Regions], max_regions: int = DEFAULT_MAX_REGIONS
                         ) -> np.ndarray:
    """(n, F + 6): mean region feature and mean normalised box of each image (first ``max_regions`` regions)."""
    if isinstance(images, ImageReader):
        get, n = images.regions, len(images)
    else:
        images = list(images)
        get, n = (lambda i: images[i]), len(images)
    out = None  # filled in place: a list of rows and its stacked copy held COCO train's 1.9 GB twice
    for i in range(n):
        feats, boxes = get(i)
        if len(feats) == 0:
            raise ValueError(f"image {i} has no regions")
        feats, boxes = np.asarray(feats[:max_regions], np.float64), np.asarray(boxes[:max_regions], np.float64)
        if out is None:
            out = np.empty((n, feats.shape[1] + boxes.shape[1]), dtype=np.float64)
        out[i, :feats.shape[1]] = feats.mean(0)
        out[i, feats.shape[1]:] = boxes.mean(0)
    return out if out is not None else np.zeros((0, 0), dtype=np.float64)


class MappedBaseline:
    def __init__(self, text_model: str, method: str, arrays: dict[str, np.ndarray], max_text_len: int,
                 provenance: Optional[dict] = None, image_backbone: str = ""):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.text_model = text_model
        self.method = method
        self.arrays = arrays  # text_mean (d,), image_mean (p,), pca (p, r) or absent, W (r, d)
        self.max_text_len = max_text_len
        self.provenance = provenance or {}
        self.image_backbone = image_backbone
        self._encoder: Optional[BertModel] = None
        self._collate: Optional[TextCollator] = None

    # ------------------------------------------------------------------------------- text side
    def _load_encoder(self) -> None:
        if self._encoder is None:
            path = backbone_path(self.text_model)
            if not os.path.isdir(path):
                raise FileNotFoundError(f"text encoder folder {path!r} of this baseline is missing")
            self._encoder = BertModel.from_pretrained(path, add_pooling_layer=False).eval()
            self._collate = TextCollator(AutoTokenizer.from_pretrained(path), self.max_text_len)

    def _raw_text(self, texts: Sequence[str], batch_size: int, device: str, progress: bool) -> np.ndarray:
        from tqdm.auto import tqdm

        self._load_encoder()
        enc = self._encoder.to(device)
        texts = list(texts)
        order = np.argsort([len(t) for t in texts], kind="stable")
        out = np.zeros((len(texts), enc.config.hidden_size), dtype=np.float64)
        with torch.inference_mode():
            for s in tqdm(range(0, len(texts), batch_size), desc="baseline text", disable=not progress):
                idx = order[s:s + batch_size]
                batch = {k: v.to(device) for k, v in self._collate([texts[i] for i in idx]).items()}
                hidden = enc(**batch).last_hidden_state
                m = batch["attention_mask"].unsqueeze(-1).float()
                out[idx] = ((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)).cpu().numpy()
        return out

    # ------------------------------------------------------------------------------- the BE API
    @property
    def embedding_dim(self) -> int:
        return int(self.arrays["W"].shape[1])

    @property
    def feature_dim(self) -> int:
        return int(self.arrays["image_mean"].shape[0]) - 6

    def encode_text(self, texts: Sequence[str], batch_size: int = 128, device: str = "cpu",
                    progress: bool = False, **_) -> np.ndarray:
        return _normalise(self._raw_text(texts, batch_size, device, progress) - self.arrays["text_mean"])

    def encode_image(self, images: ImageTable | Sequence[Regions], batch_size: int = 128, device: str = "cpu",
                     progress: bool = False, **_) -> np.ndarray:
        x = pooled_image_vectors(images)
        if x.shape[1] != self.arrays["image_mean"].shape[0]:
            raise ValueError(f"images have {x.shape[1] - 6}-d features, baseline expects {self.feature_dim}")
        x = x - self.arrays["image_mean"]
        if "pca" in self.arrays:
            x = x @ self.arrays["pca"]
        if self.method == "procrustes":
            x = _normalise(x)
        return _normalise(x @ self.arrays["W"])

    # ---------------------------------------------------------------------------------- fitting
    @classmethod
    def fit(cls, captions: pd.DataFrame, images: ImageTable, text_model: str = "minilm", method: str = "procrustes",
            ridge: float = 1e-3, max_text_len: int = DEFAULT_MAX_TEXT_TOKENS, batch_size: int = 128,
            device: str = "cpu", progress: bool = False, image_backbone: str = "") -> "MappedBaseline":
        """Fits the map on every (caption, its image) pair of ``captions`` (schema columns text, image_item_id).
        ``image_backbone``: the staged folder's backbone fingerprint (``StagedDataset.image_backbone``)."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        pos = images.position_of()
        missing = [int(i) for i in captions["image_item_id"] if int(i) not in pos]
        if missing:
            raise ValueError(f"{len(missing)} captions have no image in the table, e.g. {missing[:5]}")
        img_rows = np.array([pos[int(i)] for i in captions["image_item_id"]], dtype=np.int64)
        if not is_backbone_name(text_model):
            text_model = os.path.abspath(text_model)
        base = cls(text_model, method, {}, max_text_len,
                   {"fitted_on_pairs": int(len(captions)), "ridge": ridge, "schema_version": SCHEMA_VERSION},
                   image_backbone)
        t = base._raw_text(captions["text"].astype(str).tolist(), batch_size, device, progress)
        text_mean = t.mean(0)
        t = t - text_mean
        img = pooled_image_vectors(images)
        image_mean = img[np.unique(img_rows)].mean(0)
        arrays = {"text_mean": text_mean, "image_mean": image_mean}
        x_img = img - image_mean
        d = t.shape[1]
        if x_img.shape[1] > d:  # PCA on the training images, down to the text dimension
            _, _, vt = np.linalg.svd(x_img[np.unique(img_rows)], full_matrices=False)
            arrays["pca"] = vt[:d].T
            x_img = x_img @ arrays["pca"]
        x = x_img[img_rows]
        if method == "lstsq":
            arrays["W"] = np.linalg.solve(x.T @ x + ridge * len(x) * np.eye(x.shape[1]), x.T @ t)
        else:
            u, _, vt = np.linalg.svd(_normalise(x).T.astype(np.float64) @ _normalise(t), full_matrices=False)
            arrays["W"] = u @ vt
        base.arrays = {k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()}
        return base

    # ------------------------------------------------------------------------------- save/load
    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        save_file({k: np.ascontiguousarray(v) for k, v in self.arrays.items()},
                  os.path.join(directory, BASELINE_TENSORS))
        with open(os.path.join(directory, BASELINE_JSON), "w") as f:
            json.dump({"kind": "mapped_baseline", "method": self.method, "text_model": self.text_model,
                       "max_text_len": self.max_text_len, "feature_dim": self.feature_dim,
                       "embedding_dim": self.embedding_dim, "image_backbone": self.image_backbone,
                       "provenance": self.provenance}, f, indent=2)

    @classmethod
    def load(cls, directory: str, device: str = "cpu") -> "MappedBaseline":
        path = os.path.join(directory, BASELINE_JSON)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory} is not a MappedBaseline folder (no {BASELINE_JSON})")
        with open(path) as f:
            meta = json.load(f)
        arrays = load_file(os.path.join(directory, BASELINE_TENSORS))
        return cls(meta["text_model"], meta["method"], arrays, int(meta["max_text_len"]), meta.get("provenance"),
                   str(meta.get("image_backbone", "")))

    @staticmethod
    def is_baseline_dir(directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, BASELINE_JSON))

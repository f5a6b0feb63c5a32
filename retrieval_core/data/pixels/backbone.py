"""Grid "regions" from a pretrained ImageNet backbone: a batch of decoded pictures -> per picture, the cells of
the last feature map (at one or more grid sizes) as region features, with their boxes in the staged 6-value
layout. Grid features stand in for a detector's region features ("In Defense of Grid Features", CVPR 2020).

The backbone's fingerprint (weights sha256 + preprocessing + grids) goes into the staged summary and into every
model trained on those features; :func:`check_same_features` refuses a consumer fed features of another
backbone (the shapes may agree while the features mean something else).
"""
from __future__ import annotations

import functools
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..paths import local_sha256
from ..schema import BOX_DIM, NATIVE_BF16_FLAGS, cpu_has_native_bf16
from .lite0 import HEAD, FusedLite0, fold_batchnorm, load_lite0, weights_path

NAME = "efficientnet-lite0"
INPUT_SIZE = 224
#: Lite0's input scaling, as its TF training used it: (pixel - 127) / 128
MEAN, STD = 127.0, 128.0
#: The final map is 7 x 7 at 224 pixels; grids are average-pooled from it, coarse first, so a region cap
#: (``max_regions``, stored order) keeps the coarse cells.
FINAL_GRID = INPUT_SIZE // 32
DEFAULT_GRIDS = (FINAL_GRID,)
#: The backbone's arithmetic: float32 (the reference), or bfloat16 convolutions (oneDNN on a CPU with native bf16,
#: or CUDA): about twice the CPU rate, and features that differ beyond float rounding, so another fingerprint.
PRECISIONS = ("float32", "bfloat16")
DEFAULT_PRECISION = "float32"
#: Pictures per backbone call on CPU: a chunk's activations then stay in the caches (docs/PERFORMANCE.md)
CPU_CHUNK = 8


class FeatureSourceError(ValueError):
    """Features from another backbone than the consumer was made for."""


@dataclass(frozen=True)
class GridSpec:
    """What decides the features: grid sizes (each <= 7), coarse first, and the backbone's precision."""
    grids: tuple[int, ...] = DEFAULT_GRIDS
    precision: str = DEFAULT_PRECISION

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {'|'.join(PRECISIONS)}, got {self.precision!r}")
        grids = tuple(int(g) for g in self.grids)
        if not grids or any(not 1 <= g <= FINAL_GRID for g in grids):
            raise ValueError(f"grids must be sizes in 1..{FINAL_GRID}, got {self.grids!r}")
        if len(set(grids)) != len(grids):
            raise ValueError(f"grids must not repeat a size, got {self.grids!r}")
        object.__setattr__(self, "grids", tuple(sorted(grids)))

    @property
    def num_regions(self) -> int:
        return sum(g * g for g in self.grids)


def _cell_edges(grid: int, n: int = FINAL_GRID) -> list[tuple[int, int]]:
    """The rows (or columns) of the n-cell map that adaptive average pooling to ``grid`` cells averages."""
    return [((i * n) // grid, -((-(i + 1) * n) // grid)) for i in range(grid)]


def grid_boxes(spec: GridSpec) -> np.ndarray:
    """(num_regions, 6) normalised [x1, y1, x2, y2, w, h] of every cell, in the features' order (grid by grid,
    row-major): the part of the picture the pooled cell averages."""
    boxes = []
    for g in spec.grids:
        edges = [(a / FINAL_GRID, b / FINAL_GRID) for a, b in _cell_edges(g)]
        for y1, y2 in edges:
            for x1, x2 in edges:
                boxes.append([x1, y1, x2, y2, x2 - x1, y2 - y1])
    out = np.asarray(boxes, dtype=np.float32)
    assert out.shape[1] == BOX_DIM
    return out


@functools.lru_cache(maxsize=4)
def _weights_sha256(path: str) -> str:
    return local_sha256(path)


def fingerprint(spec: GridSpec, weights_sha256: Optional[str] = None) -> dict:
    """The features' identity: what the staged summary records under ``image_backbone`` (``fingerprint``: the
    sha256 of the rest) and models trained on them keep."""
    desc = {"name": NAME, "weights_sha256": weights_sha256 or _weights_sha256(weights_path()),
            "preprocessing": {"input": INPUT_SIZE, "resize": "bilinear, whole picture (no crop)",
                              "jpeg_draft": True, "exif_transpose": True, "alpha": "over white",
                              "scale": f"(x - {MEAN:g}) / {STD:g}"},
            "grids": list(spec.grids), "feature_dim": HEAD}
    if spec.precision != DEFAULT_PRECISION:
        # named only when not float32, so features staged before the precision option keep their fingerprint
        desc["precision"] = spec.precision
    desc["fingerprint"] = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()
    return desc


class GridBackbone:
    """EfficientNet-Lite0 turning (N, 224, 224, 3) uint8 pictures into (N, R, 1280) float32 grid features.
    ``model`` is the reference (BatchNorm folded, float32); the features come from its fused form."""
    feature_dim = HEAD
    input_size = INPUT_SIZE

    def __init__(self, spec: GridSpec = GridSpec(), device: str = "cpu"):
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but CUDA is not available on this machine")
        self.spec = spec
        self.device = torch.device(device)
        if spec.precision == "bfloat16" and self.device.type == "cpu" and not cpu_has_native_bf16():
            raise ValueError(f"image_files precision bfloat16 needs a CPU with native bf16 "
                             f"({' or '.join(NATIVE_BF16_FLAGS)} in /proc/cpuinfo); this one emulates it, slower "
                             f"than float32: use precision float32")
        model, sha = load_lite0()
        # channels-last: the layout oneDNN's depthwise and 1x1 convolutions run fastest in on CPU (and cuDNN's)
        self.model = fold_batchnorm(model).to(self.device, memory_format=torch.channels_last)
        self.fused = FusedLite0(self.model, getattr(torch, spec.precision), self.device)
        self._streams: Optional[tuple[int, ThreadPoolExecutor]] = None  # (threads, pool), made on first use
        self.description = fingerprint(spec, sha)
        self.boxes = grid_boxes(spec)

    @property
    def fingerprint(self) -> str:
        return self.description["fingerprint"]

    @torch.inference_mode()
    def regions(self, pixels: np.ndarray) -> np.ndarray:
        """(N, num_regions, 1280) features of a uint8 batch (N, 224, 224, 3)."""
        if pixels.ndim != 4 or pixels.shape[1:] != (INPUT_SIZE, INPUT_SIZE, 3):
            raise ValueError(f"expected (N, {INPUT_SIZE}, {INPUT_SIZE}, 3) pixels, got {pixels.shape}")
        # NHWC uint8 is channels-last already: permuting gives the layout without a copy
        x = torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device).permute(0, 3, 1, 2).float()
        fmap = self._feature_map((x - MEAN) / STD)
        cells = [F.adaptive_avg_pool2d(fmap, g).flatten(2) for g in self.spec.grids]  # (N, C, g*g) each
        return torch.cat(cells, dim=2).transpose(1, 2).cpu().numpy()

    def _feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """The fused model's float32 map of a normalised batch. On CPU, chunks of CPU_CHUNK pictures run
        side by side, one per torch thread, each chunk on a single thread: the layers of a small network are too
        short for its threads to share them (each waits for the slowest at every layer, and much longer when
        another process holds a core), so the cores work on different pictures instead."""
        cpu = self.device.type == "cpu"
        chunks = [x[a:a + CPU_CHUNK] for a in range(0, len(x), CPU_CHUNK)] if cpu else [x]
        threads = torch.get_num_threads() if cpu else 1
        if len(chunks) == 1 or threads == 1:
            return torch.cat([self.fused(c).float() for c in chunks])
        if self._streams is None or self._streams[0] != threads:
            self._streams = (threads, ThreadPoolExecutor(threads, thread_name_prefix="lite0"))

        def one(chunk: torch.Tensor) -> torch.Tensor:
            # torch's thread count is per thread once set (OpenMP); it is set back to the caller's count after,
            # so threads started later inherit the caller's setting, not 1
            torch.set_num_threads(1)
            try:
                with torch.inference_mode():  # grad mode is per thread too
                    return self.fused(chunk).float()
            finally:
                torch.set_num_threads(threads)

        return torch.cat(list(self._streams[1].map(one, chunks)))


@functools.lru_cache(maxsize=2)
def cached_backbone(grids: tuple[int, ...], device: str, precision: str = DEFAULT_PRECISION) -> GridBackbone:
    """One backbone per worker process and setting (the weights load once, not once per read task)."""
    return GridBackbone(GridSpec(grids, precision), device)


def describe(staged_fp: str) -> str:
    return f"the {NAME} backbone {staged_fp[:12]}..." if staged_fp else "extracted region features (no backbone)"


def check_same_features(staged_fp: str, model_fp: str, staged_what: str, model_what: str) -> None:
    """Refuse a model fed features of another source: each side's backbone fingerprint ("" = region features
    extracted elsewhere, e.g. a detector's)."""
    if (staged_fp or "") != (model_fp or ""):
        raise FeatureSourceError(f"{staged_what} holds image features of {describe(staged_fp)} but {model_what} was "
                                 f"trained on {describe(model_fp)}: stage the images with the model's backbone, or "
                                 f"train a model on these features")


def parse_grids(value: Sequence[int] | str | int) -> tuple[int, ...]:
    """A grid option: 7, "3,7" or [3, 7]."""
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        return tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    return tuple(int(v) for v in value)


__all__ = ["DEFAULT_GRIDS", "DEFAULT_PRECISION", "PRECISIONS", "FeatureSourceError", "GridBackbone", "GridSpec",
           "cached_backbone", "check_same_features", "fingerprint", "grid_boxes", "parse_grids"]

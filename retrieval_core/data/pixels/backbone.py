"""Grid "regions" from a pretrained ImageNet backbone: a batch of decoded pictures -> per picture, the cells of
the last feature map (at one or more grid sizes) as region features, with their boxes in the staged 6-value
layout. Grid features stand in for a detector's region features ("In Defense of Grid Features", CVPR 2020).

The regions are the head's map (1280-d) by default; ``layers`` takes the outputs of earlier stages instead
(or besides), concatenated per cell: on the rendered scenes the head keeps an object's colour and class much less
linearly readable than the stride-8 to stride-32 stages do (docs/log/PIXELS-2026-11-27.md).

The backbone's fingerprint (weights sha256 + preprocessing + grids + layers) goes into the staged summary and into every
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

from ...precision import NATIVE_BF16_FLAGS, cpu_has_native_bf16
from ..paths import local_sha256
from ..schema import BOX_DIM
from .lite0 import HEAD, STAGE_ENDS, STAGE_STRIDES, STAGES, FusedLite0, fold_batchnorm, load_lite0, weights_path

NAME = "efficientnet-lite0"
INPUT_SIZE = 224
#: Input sizes a GridSpec takes: multiples of the network's stride (32), so every map's side is a whole number of
#: final-map cells; a larger input gives a finer final map (288 pixels: 9 x 9, three cells per third of the picture).
INPUT_STRIDE, INPUT_SIZES = 32, range(96, 641, 32)
#: Lite0's input scaling, as its TF training used it: (pixel - 127) / 128
MEAN, STD = 127.0, 128.0
#: The final map is 7 x 7 at 224 pixels (input / 32); grids are average-pooled from it, coarse first, so a region
#: cap (``max_regions``, stored order) keeps the coarse cells.
FINAL_GRID = INPUT_SIZE // INPUT_STRIDE
DEFAULT_GRIDS = (FINAL_GRID,)
#: The backbone's arithmetic: float32 (the reference), or bfloat16 convolutions (oneDNN on a CPU with native bf16,
#: or CUDA): about twice the CPU rate, and features that differ beyond float rounding, so another fingerprint.
PRECISIONS = ("float32", "bfloat16")
DEFAULT_PRECISION = "float32"
#: The maps a region's features can come from: each of Lite0's seven stages (its last block's output, before
#: any ReLU) and the head (after its ReLU6); name -> (channels, stride).
LAYERS = {**{f"stage{i + 1}": (STAGES[i][3], STAGE_STRIDES[i]) for i in range(len(STAGES))},
          "head": (HEAD, INPUT_STRIDE)}
DEFAULT_LAYERS = ("head",)
#: What each map's cell vector goes through before the maps are concatenated: nothing, or "unit": centred over its
#: channels and scaled to unit length (LayerNorm without weights, / sqrt(channels)). The stages' outputs (no ReLU)
#: share a large component across pictures; at their own scale (or at unit variance per channel) the first AdamW
#: step of the image embedding swamped every image token with it and the demo recipe's bi-encoder stayed at
#: chance (docs/log/PIXELS-2026-11-27.md).
CELL_NORMS = ("none", "unit")
DEFAULT_CELL_NORM = "none"
#: Pictures per backbone call on CPU: a chunk's activations then stay in the caches (docs/log/PERFORMANCE-2026-11.md)
CPU_CHUNK = 8


class FeatureSourceError(ValueError):
    """Features from another backbone than the consumer was made for."""


@dataclass(frozen=True)
class GridSpec:
    """What decides the features: grid sizes (each <= the final map's side: 7 at 224 pixels), coarse first, the
    backbone's precision, the maps (``LAYERS``, in the network's order) whose cells are concatenated, how each
    map's cell is normalised, and the square input every picture is resized to."""
    grids: tuple[int, ...] = DEFAULT_GRIDS
    precision: str = DEFAULT_PRECISION
    layers: tuple[str, ...] = DEFAULT_LAYERS
    cell_norm: str = DEFAULT_CELL_NORM
    input_size: int = INPUT_SIZE

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {'|'.join(PRECISIONS)}, got {self.precision!r}")
        try:
            size = None if isinstance(self.input_size, bool) else int(self.input_size)
        except (TypeError, ValueError):
            size = None
        if size not in INPUT_SIZES or (isinstance(self.input_size, float) and size != self.input_size):
            raise ValueError(f"input_size must be a multiple of {INPUT_STRIDE} in {INPUT_SIZES.start}.."
                             f"{INPUT_SIZES.stop - 1}, got {self.input_size!r}")
        object.__setattr__(self, "input_size", int(self.input_size))
        grids = tuple(int(g) for g in self.grids)
        if not grids or any(not 1 <= g <= self.final_grid for g in grids):
            raise ValueError(f"grids must be sizes in 1..{self.final_grid} (the final map's side at a "
                             f"{self.input_size}-pixel input), got {self.grids!r}")
        if len(set(grids)) != len(grids):
            raise ValueError(f"grids must not repeat a size, got {self.grids!r}")
        object.__setattr__(self, "grids", tuple(sorted(grids)))
        layers = tuple(str(n) for n in self.layers)
        if not layers or any(n not in LAYERS for n in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"layers must be distinct names among {'|'.join(LAYERS)}, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(sorted(layers, key=list(LAYERS).index)))
        if self.cell_norm not in CELL_NORMS:
            raise ValueError(f"cell_norm must be one of {'|'.join(CELL_NORMS)}, got {self.cell_norm!r}")

    @property
    def final_grid(self) -> int:
        return self.input_size // INPUT_STRIDE

    @property
    def feature_dim(self) -> int:
        return sum(LAYERS[n][0] for n in self.layers)

    @property
    def num_regions(self) -> int:
        return sum(g * g for g in self.grids)


def _cell_edges(grid: int, n: int) -> list[tuple[int, int]]:
    """The rows (or columns) of the n-cell map that adaptive average pooling to ``grid`` cells averages."""
    return [((i * n) // grid, -((-(i + 1) * n) // grid)) for i in range(grid)]


def grid_boxes(spec: GridSpec) -> np.ndarray:
    """(num_regions, 6) normalised [x1, y1, x2, y2, w, h] of every cell, in the features' order (grid by grid,
    row-major): the part of the picture the pooled cell averages."""
    boxes = []
    n = spec.final_grid
    for g in spec.grids:
        edges = [(a / n, b / n) for a, b in _cell_edges(g, n)]
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
            "preprocessing": {"input": spec.input_size, "resize": "bilinear, whole picture (no crop)",
                              "jpeg_draft": True, "exif_transpose": True, "alpha": "over white",
                              "scale": f"(x - {MEAN:g}) / {STD:g}"},
            "grids": list(spec.grids), "feature_dim": spec.feature_dim}
    if spec.precision != DEFAULT_PRECISION:
        # named only when not float32, so features staged before the precision option keep their fingerprint
        desc["precision"] = spec.precision
    if spec.layers != DEFAULT_LAYERS:  # likewise: the head's features keep the fingerprint they had
        n = spec.final_grid
        desc["layers"] = {"maps": list(spec.layers), "pooling": f"each map averaged to {n} x {n} cells first, then "
                                                                "to each grid; concatenated"}
    if spec.cell_norm != DEFAULT_CELL_NORM:
        desc["cell_norm"] = {"unit": "each map's cell vector centred over its channels, scaled to unit length "
                                     "(layer norm, eps 1e-5, / sqrt(channels))"}[spec.cell_norm]
    desc["fingerprint"] = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()
    return desc


class GridBackbone:
    """EfficientNet-Lite0 turning (N, S, S, 3) uint8 pictures (S: ``spec.input_size``, 224 by default) into
    (N, R, F) float32 grid features (F: the chosen layers' channels, 1280 for the head). ``model`` is the reference
    (BatchNorm folded, float32); the features come from its fused form."""

    def __init__(self, spec: GridSpec = GridSpec(), device: str = "cpu"):
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but CUDA is not available on this machine")
        self.spec = spec
        self.input_size = spec.input_size
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
        self.feature_dim = spec.feature_dim
        self._stage_ends = tuple(STAGE_ENDS[int(n[5:]) - 1] for n in spec.layers if n != "head")
        self._head = "head" in spec.layers

    @property
    def fingerprint(self) -> str:
        return self.description["fingerprint"]

    @torch.inference_mode()
    def regions(self, pixels: np.ndarray) -> np.ndarray:
        """(N, num_regions, feature_dim) features of a uint8 batch (N, S, S, 3), S the spec's input size."""
        size = self.input_size
        if pixels.ndim != 4 or pixels.shape[1:] != (size, size, 3):
            raise ValueError(f"expected (N, {size}, {size}, 3) pixels, got {pixels.shape}")
        # NHWC uint8 is channels-last already: permuting gives the layout without a copy
        x = torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device).permute(0, 3, 1, 2).float()
        maps = self._feature_maps((x - MEAN) / STD)
        # a finer map is first averaged to the final map's cells (exact: its side is a multiple of the final one's),
        # so every layer's cell covers the same pixels and the boxes hold for all of them
        n = self.spec.final_grid
        maps = [m if m.shape[-1] == n else F.avg_pool2d(m, m.shape[-1] // n) for m in maps]
        fmap = maps[0] if len(maps) == 1 else torch.cat(maps, dim=1)
        cells = torch.cat([F.adaptive_avg_pool2d(fmap, g).flatten(2) for g in self.spec.grids], dim=2)  # (N, C, R)
        cells = cells.transpose(1, 2)
        if self.spec.cell_norm == "unit":
            cells = torch.cat([F.layer_norm(part, part.shape[-1:], eps=1e-5) / part.shape[-1] ** 0.5
                               for part in cells.split([LAYERS[n][0] for n in self.spec.layers], dim=-1)], dim=-1)
        return cells.cpu().numpy()

    def _run(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [m.float() for m in self.fused.taps(x, self._stage_ends, self._head)]

    def _feature_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The fused model's float32 maps (``spec.layers``) of a normalised batch. On CPU, chunks of CPU_CHUNK
        pictures run side by side, one per torch thread, each chunk on a single thread: the layers of a small
        network are too short for its threads to share them (each waits for the slowest at every layer, and much
        longer when another process holds a core), so the cores work on different pictures instead."""
        cpu = self.device.type == "cpu"
        chunks = [x[a:a + CPU_CHUNK] for a in range(0, len(x), CPU_CHUNK)] if cpu else [x]
        threads = torch.get_num_threads() if cpu else 1
        if len(chunks) == 1 or threads == 1:
            return [torch.cat(ms) for ms in zip(*(self._run(c) for c in chunks))]
        if self._streams is None or self._streams[0] != threads:
            self._streams = (threads, ThreadPoolExecutor(threads, thread_name_prefix="lite0"))

        def one(chunk: torch.Tensor) -> list[torch.Tensor]:
            # torch's thread count is per thread once set (OpenMP); it is set back to the caller's count after,
            # so threads started later inherit the caller's setting, not 1
            torch.set_num_threads(1)
            try:
                with torch.inference_mode():  # grad mode is per thread too
                    return self._run(chunk)
            finally:
                torch.set_num_threads(threads)

        return [torch.cat(ms) for ms in zip(*self._streams[1].map(one, chunks))]


@functools.lru_cache(maxsize=2)
def cached_backbone(grids: tuple[int, ...], device: str, precision: str = DEFAULT_PRECISION,
                    layers: tuple[str, ...] = DEFAULT_LAYERS, cell_norm: str = DEFAULT_CELL_NORM,
                    input_size: int = INPUT_SIZE) -> GridBackbone:
    """One backbone per worker process and setting (the weights load once, not once per read task)."""
    return GridBackbone(GridSpec(grids, precision, layers, cell_norm, input_size), device)


def spec_of(description: dict) -> GridSpec:
    """The GridSpec a backbone description (:func:`fingerprint`'s dict, as a staged summary records it under
    ``image_backbone``) was made with: what turns new pictures into the same features (``backbone_for``)."""
    try:
        layers = tuple((description.get("layers") or {}).get("maps") or DEFAULT_LAYERS)
        cell_norm = "unit" if description.get("cell_norm") else DEFAULT_CELL_NORM
        return GridSpec(tuple(int(g) for g in description["grids"]),
                        str(description.get("precision", DEFAULT_PRECISION)), layers, cell_norm,
                        int(description["preprocessing"]["input"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise FeatureSourceError(f"not a backbone description this code can rebuild ({exc}): "
                                 f"{describe(str(description.get('fingerprint', '')))}") from None


def backbone_for(description: dict, device: str = "cpu") -> GridBackbone:
    """The backbone that made the features of ``description`` (a staged summary's ``image_backbone``), loaded
    (cached per process); refused (FeatureSourceError) when this code and its weights would make other features:
    the rebuilt backbone's fingerprint must be the recorded one."""
    spec = spec_of(description)
    recorded = str(description.get("fingerprint", ""))
    if fingerprint(spec)["fingerprint"] != recorded:
        raise FeatureSourceError(f"the image backbone here ({NAME}, weights {_weights_sha256(weights_path())[:12]}...) "
                                 f"makes other features than {describe(recorded)} recorded by the staged folder "
                                 f"(weights {str(description.get('weights_sha256'))[:12]}...): pictures would not "
                                 f"be comparable with the staged images")
    return cached_backbone(spec.grids, device, spec.precision, spec.layers, spec.cell_norm, spec.input_size)


def describe(staged_fp: str) -> str:
    return f"the {NAME} backbone {staged_fp[:12]}..." if staged_fp else "extracted region features (no backbone)"


def check_same_features(staged_fp: str, model_fp: str, staged_what: str, model_what: str) -> None:
    """Refuse a model fed features of another source: each side's backbone fingerprint ("" = region features
    extracted elsewhere, e.g. a detector's)."""
    if (staged_fp or "") != (model_fp or ""):
        raise FeatureSourceError(f"{staged_what} holds image features of {describe(staged_fp)} but {model_what} was "
                                 f"trained on {describe(model_fp)}: stage the images with the model's backbone, or "
                                 f"train a model on these features")


def parse_layers(value: Sequence[str] | str) -> tuple[str, ...]:
    """A layers option: "head", "stage3,stage4" or ["stage6", "head"]."""
    if isinstance(value, str):
        return tuple(v for v in value.replace(" ", "").split(",") if v)
    return tuple(str(v) for v in value)


def parse_grids(value: Sequence[int] | str | int) -> tuple[int, ...]:
    """A grid option: 7, "3,7" or [3, 7]."""
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        return tuple(int(v) for v in value.replace(" ", "").split(",") if v)
    return tuple(int(v) for v in value)


__all__ = ["CELL_NORMS", "DEFAULT_CELL_NORM", "DEFAULT_GRIDS", "DEFAULT_LAYERS", "DEFAULT_PRECISION", "INPUT_SIZE",
           "LAYERS",
           "PRECISIONS", "FeatureSourceError", "GridBackbone", "GridSpec", "backbone_for",
           "cached_backbone", "check_same_features", "fingerprint", "grid_boxes", "parse_grids",
           "parse_layers", "spec_of"]

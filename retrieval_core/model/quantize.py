"""The model as it is served: float32, dynamic int8 Linear layers (CPU) or bf16 weights, and whether this CPU
computes bf16 natively."""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.precision import NATIVE_BF16_FLAGS, QUANTIZE_CHOICES, cpu_has_native_bf16, cuda_bf16_supported


def quantize_model(model: nn.Module, quantize: Optional[str], device: str = "cpu") -> nn.Module:
    """The model as it will be served (QUANTIZE_CHOICES):

    - ``none``: the model itself, float32;
    - ``int8``: a copy with its nn.Linear layers dynamically quantised (weights int8, activations quantised per
      batch: torch.ao.quantization.quantize_dynamic); int8 dynamic kernels exist on CPU only;
    - ``bf16``: the model itself with its weights cast to bfloat16, so every layer runs in bf16 (oneDNN's bf16
      matmuls on CPU; LayerNorm, softmax and GEMMs accumulate in float32 inside their kernels) and no cast is
      paid per call, as autocast did (docs/log/PERFORMANCE-2026-11.md); the embeddings are pooled and the CE scores
      returned in float32. On CPU the attention runs the eager path; only where the CPU has native bf16
      (NATIVE_BF16_FLAGS): elsewhere it is emulated, slower than float32, and refused.
    Anything else, or a mode the device cannot run, raises ValueError."""
    if quantize in (None, "none"):
        return model
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {'|'.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    dev = torch.device(device)
    if quantize == "bf16":
        if not isinstance(model, VLRetrievalModel):
            raise ValueError(f"--quantize bf16 applies to VLRetrievalModel, not {type(model).__name__}")
        if dev.type == "cpu" and not cpu_has_native_bf16():
            raise ValueError(f"--quantize bf16 needs a CPU with native bf16 ({' or '.join(NATIVE_BF16_FLAGS)} in "
                             f"/proc/cpuinfo); this one emulates it, slower than float32: use --quantize none")
        if dev.type == "cuda" and not cuda_bf16_supported():
            raise ValueError(f"--quantize bf16: {torch.cuda.get_device_name(dev)} has no native bf16; use "
                             f"--quantize none")
        if dev.type == "cpu":  # the fused CPU attention kernel is the slower one in bf16 at these short lengths
            model.set_attention("eager")  # (docs/log/PERFORMANCE-2026-11.md)
        return model.to(torch.bfloat16)
    if dev.type != "cpu":
        raise ValueError(f"--quantize {quantize} (dynamic int8 Linear layers) runs on CPU only; refused on "
                         f"{device}")
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao, not installed
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model.to("cpu"), {nn.Linear}, dtype=torch.qint8).eval()

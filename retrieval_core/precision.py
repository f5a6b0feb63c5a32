"""The serving precisions of the models (``--quantize``) and what each machine computes natively: one
vocabulary for every job, suite and CLI. A bottom floor like errors.py: it imports nothing of the project, and
torch only to ask a CUDA card."""
from __future__ import annotations

import functools
from typing import Optional

#: The precisions a model is served in: none (float32), int8 dynamic quantisation of the Linear layers (CPU
#: only), or bf16 weights (CUDA, or a CPU with native bf16); model.quantize.quantize_model applies them.
QUANTIZE_CHOICES = ("none", "int8", "bf16")
#: bf16 on a CUDA device that computes it natively, float32 elsewhere (:func:`resolve_quantize`): the jobs' default.
QUANTIZE_AUTO = "auto"
#: What ``--quantize`` accepts, everywhere.
QUANTIZE_OPTIONS = (QUANTIZE_AUTO, *QUANTIZE_CHOICES)
#: The modes a device kind can run ("cpu" / "cuda"); bf16 on CPU also needs native bf16 (checked at load).
QUANTIZE_DEVICES = {"none": ("cpu", "cuda"), "int8": ("cpu",), "bf16": ("cpu", "cuda")}

#: CPU flags (/proc/cpuinfo) of native bfloat16 matrix instructions: AVX-512 BF16 (AMD Zen 4+, Intel Cooper
#: Lake+) and AMX (Intel Sapphire Rapids+). Without them bf16 is emulated and slower than float32.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU computes bf16 matrix products natively (Linux /proc/cpuinfo flags): the served
    models' --quantize bf16 and the image backbone's bfloat16 precision need it."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def cuda_bf16_supported() -> bool:
    """Whether the CUDA device computes bf16 natively (Ampere or later). A launching host without a GPU answers
    True: the job's GPU workers are taken to be of the class the project targets, and a card without bf16 is
    refused where the model loads (model.quantize.quantize_model), never run emulated."""
    import torch

    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported(including_emulation=False)


def _kind(device: str) -> str:
    return str(device).lower().partition(":")[0]  # cuda:1 is a cuda


def resolve_quantize(quantize: str, device: str, cuda_bf16: Optional[bool] = None) -> str:
    """``quantize`` with QUANTIZE_AUTO made a mode: "bf16" on CUDA where the card has native bf16 (``cuda_bf16``;
    None: ask torch), else "none"; any other value unchanged."""
    if quantize != QUANTIZE_AUTO:
        return quantize
    if _kind(device) != "cuda":
        return "none"
    return "bf16" if (cuda_bf16_supported() if cuda_bf16 is None else cuda_bf16) else "none"


def check_quantize(quantize: str, device: str) -> None:
    """ValueError unless ``quantize`` is a QUANTIZE_CHOICES mode that ``device`` ("cpu"/"cuda") can run. Checked
    when a plan is built; whether a CPU has native bf16 is checked where the model loads (the worker's CPU)."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {'|'.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if _kind(device) not in QUANTIZE_DEVICES[quantize]:
        raise ValueError(f"--quantize {quantize} runs on {' or '.join(d.upper() for d in QUANTIZE_DEVICES[quantize])} "
                         f"only; refused with --device {device}")

"""FLOP accounting of `VLRetrievalModel`: the dense GEMM shapes of a BERT layer and the multiply-add FLOPs of an
encoder pass, per sequence and per unit of work (a caption, an image, a CE pair; forward or training). The
roofline benchmark and the trainer's FLOP/s read these (docs/log/PERFORMANCE-2026-11.md)."""
from __future__ import annotations

from retrieval_core.model.network import VLRetrievalModel


def layer_gemm_shapes(config, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of one BERT layer's dense GEMMs over ``tokens`` rows: Q, K, V, attention output,
    intermediate, output."""
    h, i = int(config.hidden_size), int(config.intermediate_size)
    return [(tokens, h, h)] * 4 + [(tokens, h, i), (tokens, i, h)]


def sequence_flops(config, length: float, cls_only: bool = False) -> float:
    """Multiply-add FLOPs (2 per MAC) of the encoder layers over one sequence of ``length`` tokens: the dense
    GEMMs (layer_gemm_shapes) and attention's QK^T and AV; softmax, LayerNorm and GELU are left out.
    ``cls_only``: the last layer as the CE runs it (attention.packed_layer with queries: keys and values of every
    token, the rest for [CLS] alone)."""
    h, i, n = int(config.hidden_size), int(config.intermediate_size), int(config.num_hidden_layers)
    dense = 2 * length * (4 * h * h + 2 * h * i)
    attention = 2 * 2 * length * length * h
    if not cls_only:
        return n * (dense + attention)
    last = 2 * length * 2 * h * h + 2 * (2 * h * h + 2 * h * i) + 2 * 2 * length * h
    return (n - 1) * (dense + attention) + last


def model_flops(model: VLRetrievalModel, task: str, text_tokens: float = 0.0, regions: float = 0.0,
                training: bool = False) -> float:
    """FLOPs of one unit of ``task`` from the model's config and the given average lengths:
    "pair" (CE: text tokens + regions in one sequence, its last layer for [CLS] alone, region projection, pooler
    and classifier), "image" (BE: [CLS] + regions) or "text" (BE: the caption's tokens). ``training``: forward
    and backward - 3x the forward (input and weight gradients) except the region projection, whose input is
    data (2x: weight gradients only)."""
    cfg, h = model.bert.config, int(model.bert.config.hidden_size)
    region_proj = 2 * regions * (model.cfg.feature_dim + model.cfg.box_dim) * h
    grads, proj_grads = (3, 2) if training else (1, 1)
    if task == "pair":
        head = (2 * h * h if model.ce_pooler is not None else 0) + 2 * h * 2
        return grads * (sequence_flops(cfg, text_tokens + regions, cls_only=True) + head) + proj_grads * region_proj
    if task == "image":
        return grads * sequence_flops(cfg, 1 + regions) + proj_grads * region_proj
    if task == "text":
        return grads * sequence_flops(cfg, text_tokens)
    raise ValueError(f"task must be pair, image or text, got {task!r}")

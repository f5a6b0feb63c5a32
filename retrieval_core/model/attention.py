"""The encoder's layers as VLRetrievalModel runs them: one BertLayer over a batch's real tokens only
(``packed_layer``), and the fused attention kernels it may use on a device and dtype (``attention_backends``)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import eager_attention_forward


def packed_layer(layer: nn.Module, x: torch.Tensor, keep: Optional[torch.Tensor], shape: tuple[int, int],
                 additive: torch.Tensor, queries: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One BertLayer over a batch's real tokens only: ``x`` (N, H) are the tokens of a (B, L) batch at the flat
    positions ``keep`` (None: every position, no padding). Q, K, V, the attention output and the feed-forward -
    the dense layers, ~95 % of the FLOPs - run on the N real tokens; attention runs on the padded (B, heads, L, d)
    layout, padded keys masked by ``additive``. ``queries``: rows of ``x`` whose outputs are wanted, one per
    batch row (the CE head reads [CLS] alone: its last layer then computes keys and values of every token and
    the rest for [CLS], ~28 % of a pair's FLOPs for the halved MiniLM), default all. Equal to BertLayer on the
    padded batch at those positions up to float rounding; the same submodules and attention kernel
    (transformers' attention interface)."""
    attn = layer.attention.self
    b, length = shape
    heads = (attn.num_attention_heads, attn.attention_head_size)

    def padded(t: torch.Tensor) -> torch.Tensor:  # (N, H) -> (B, heads, L, d), zeros at padded positions
        if keep is not None:
            t = t.new_zeros(b * length, t.shape[1]).index_copy(0, keep, t)
        return t.view(b, length, *heads).transpose(1, 2)

    key, value = padded(attn.key(x)), padded(attn.value(x))
    rows = x if queries is None else x[queries]
    query = padded(attn.query(x)) if queries is None else attn.query(rows).view(b, 1, *heads).transpose(1, 2)
    kernel = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    context, _ = kernel(attn, query, key, value, additive, dropout=attn.dropout.p if attn.training else 0.0,
                        scaling=attn.scaling)
    context = context.reshape(-1, attn.all_head_size)  # (B * L or B, H): the kernels return (B, Lq, heads, d)
    if queries is None and keep is not None:
        context = context[keep]
    return layer.feed_forward_chunk(layer.attention.output(context, rows))


def sdpa_backends(device: torch.device, dtype: torch.dtype) -> Optional[list]:
    """The fused attention kernels the encoder may use on ``device`` in ``dtype`` (None: PyTorch's own choice).
    On CUDA in 16-bit, cuDNN's attention is left out: it builds an execution plan per new (batch, length) shape,
    and length-sorted batches bring a new shape nearly every batch (the suspected cause of bf16 sdpa running far
    slower on varied batches than on one batch repeated; the GPU script's attention rows time both, see
    docs/log/PERFORMANCE-2026-11.md); the memory-efficient kernel takes the padding mask at any shape, math is the
    fallback."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    from torch.nn.attention import SDPBackend
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device, dtype: torch.dtype):
    """A context that holds sdpa to ``sdpa_backends(device, dtype)`` (no-op where that is None)."""
    backends = sdpa_backends(device, dtype)
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(backends)

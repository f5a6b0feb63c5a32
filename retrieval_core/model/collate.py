"""Tokenisation and per-batch padding of texts, image regions and (text, image) pairs.

These are pure functions of (tokenizer, list of items): a Beam ModelHandler calls them on whatever batch
RunInference hands it, and the model's batched loops call the same ones (``BatchMaker``). Padding is always to
the longest item of the batch, never to a fixed 512. A text is a str, or its word-piece ids already made
(``TextCollator.ids``, a token store beside the staged shards): tokenising each caption once per tokenizer and
padding ids per batch gives the same tensors as tokenising every batch.
"""
from __future__ import annotations

import functools
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from retrieval_core.data.schema import BOX_DIM, DEFAULT_MAX_REGIONS, DEFAULT_MAX_TEXT_TOKENS

#: One image as the model consumes it: features (n, F) and normalised boxes (n, 6).
Regions = tuple[np.ndarray, np.ndarray]
#: One caption as a batch takes it: its text, or its word-piece ids ([CLS] .. [SEP], truncated) as int32.
Text = Union[str, np.ndarray]
#: The dtype token ids are kept in (vocabularies fit in int32; half the bytes of int64 in shuffles and stores).
TOKEN_ID_DTYPE = np.int32


class TextCollator:
    """Tokenises a list of texts into ``input_ids`` / ``attention_mask`` (B, T), T = longest in the batch.

    ``max_len`` counts word pieces including [CLS] and [SEP] (OSCAR / MMT use 70).
    """

    def __init__(self, tokenizer, max_len: int = DEFAULT_MAX_TEXT_TOKENS):
        if max_len < 2:
            raise ValueError(f"max_len must leave room for [CLS] and [SEP], got {max_len}")
        self.tokenizer = tokenizer
        self.max_len = int(max_len)

    def __call__(self, texts: Sequence[Text]) -> dict[str, torch.Tensor]:
        if len(texts) == 0:
            raise ValueError("TextCollator got an empty batch")
        return self.pad(self.ids(texts))

    def ids(self, texts: Sequence[Text]) -> list[np.ndarray]:
        """Word-piece ids of each text ([CLS] and [SEP] included, truncated at max_len), int32, in one tokenizer
        call for the str items; items already ids pass through (checked, never re-tokenised)."""
        out: list[Optional[np.ndarray]] = [None] * len(texts)
        todo = []
        for i, t in enumerate(texts):
            if isinstance(t, str):
                todo.append(i)
            elif isinstance(t, np.ndarray) and t.ndim == 1 and t.dtype.kind in "iu":
                if not 2 <= len(t) <= self.max_len:
                    raise ValueError(f"item {i}: {len(t)} token ids, need 2..{self.max_len} ([CLS] .. [SEP])")
                out[i] = t
            else:
                raise TypeError(f"texts must be str or 1-d integer token-id arrays; item {i} is "
                                f"{type(t).__name__}")
        if todo:
            enc = self.tokenizer([texts[i] for i in todo], truncation=True, max_length=self.max_len,
                                 return_attention_mask=False, return_token_type_ids=False)
            for i, ids in zip(todo, enc["input_ids"]):
                out[i] = np.asarray(ids, dtype=TOKEN_ID_DTYPE)
        return out

    def pad(self, ids: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        """``input_ids`` / ``attention_mask`` (B, T) int64 of token-id arrays, right-padded with the tokenizer's
        pad id to the longest: what the tokenizer's own padding="longest" makes of the same texts."""
        if len(ids) == 0:
            raise ValueError("TextCollator got an empty batch")
        lengths = np.fromiter((len(t) for t in ids), dtype=np.int64, count=len(ids))
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError(f"tokenizer {type(self.tokenizer).__name__} has no pad token")
        out = np.full((len(ids), int(lengths.max())), int(pad_id), dtype=np.int64)
        mask = np.arange(out.shape[1])[None, :] < lengths[:, None]
        out[mask] = np.concatenate(ids)
        return {"input_ids": torch.from_numpy(out), "attention_mask": torch.from_numpy(mask.astype(np.int64))}

    def token_lengths(self, texts: Sequence[Text]) -> np.ndarray:
        """Word pieces of each text as a batch holds them ([CLS] and [SEP] included, truncated at max_len): the
        key that sorts texts into batches with little padding. Characters or words are poor stand-ins: sorted by
        either, batches of 128 demo captions were 0.87 useful tokens, by word pieces 0.98."""
        return np.fromiter((len(t) for t in self.ids(texts)), dtype=np.int64, count=len(texts))


@dataclass
class TokenCounts:
    """Token positions the encoder ran: ``useful`` (mask 1) and ``computed`` (the padded batch's B x L), summed over
    every batch added. ``fraction`` = useful / computed: 1.0 means no padding."""
    useful: int = 0
    computed: int = 0

    def add(self, mask: torch.Tensor) -> None:
        self.useful += int(mask.sum())
        self.computed += int(mask.numel())

    @property
    def fraction(self) -> float:
        return self.useful / self.computed if self.computed else float("nan")


def length_chunks(lengths: np.ndarray, rows: int) -> list[np.ndarray]:
    """Positions of items of the given ``lengths`` (TextCollator.token_lengths) cut into chunks of at most
    ``rows``, shortest first, so that each chunk is padded to its own longest item instead of the whole batch's,
    as inference orders them (VLRetrievalModel.encode_text). ``rows`` < 1: one chunk in input order."""
    if rows < 1:
        return [np.arange(len(lengths))]
    order = np.argsort(lengths, kind="stable")
    return [order[i:i + rows] for i in range(0, len(order), rows)]


def collate_images(images: Sequence[Regions], max_regions: int = DEFAULT_MAX_REGIONS,
                   dtype: torch.dtype = torch.float32, pin: bool = False, workers: int = 1,
                   reuse: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """Pads a batch of images to the largest region count in the batch (capped at ``max_regions``).

    Returns ``img_feats`` (B, R, F) and ``img_boxes`` (B, R, 6) in ``dtype`` where numpy has it (HOST_DTYPES; a
    bf16 model's regions travel as float32 and the model narrows them on its device) and ``img_mask`` (B, R)
    int64; ``pin``: made in pinned memory (a CUDA model's asynchronous copies), not copied there afterwards.
    Regions past ``max_regions`` are dropped from the end: the stager stores them most-confident first.
    An image without regions is an error (its embedding would be [CLS] alone, silently meaningless).

    Each image's regions are copied into the batch once (float16 staged features widen exactly in that copy).
    ``workers`` > 1 fills contiguous slices of the batch in that many threads (numpy's copies run outside the
    GIL): one thread's copies cannot keep a GPU fed with BERT-base-size pairs; the tensors are the same whatever
    the count.
    ``reuse``: a dict whose host memory the tensors are made in (kept there for the next call; BatchMaker's
    ring): a fresh batch-sized block costs a page fault per 4 KiB, more than the copies themselves.
    """
    if len(images) == 0:
        raise ValueError("collate_images got an empty batch")
    _check_image(0, *images[0], None)
    feature_dim = images[0][0].shape[1]
    counts = [min(len(feats), max_regions) for feats, _ in images]
    width = max(counts)
    # the copies run in numpy (outside the GIL, one thread each); bf16, which numpy lacks, travels as float32
    # and the model narrows it on its device (VLRetrievalModel._image_tokens: the same rounding)
    host = dtype if dtype in HOST_DTYPES else torch.float32
    out_f = _empty(reuse, "img_feats", (len(images), width, feature_dim), host, pin)
    out_b = _empty(reuse, "img_boxes", (len(images), width, BOX_DIM), host, pin)
    fill_f, fill_b = out_f.numpy(), out_b.numpy()
    mask = (np.arange(width)[None, :] < np.asarray(counts)[:, None]).astype(np.int64)

    def fill(rows: range) -> None:
        for i in rows:
            (feats, boxes), n = images[i], counts[i]
            _check_image(i, feats, boxes, feature_dim)
            fill_f[i, :n] = feats[:n]
            fill_b[i, :n] = boxes[:n]
            if n < width:  # the block may hold an earlier batch's values
                fill_f[i, n:] = 0
                fill_b[i, n:] = 0

    slices = _slices(len(images), workers)
    if len(slices) == 1:
        fill(slices[0])
    else:
        list(_collate_pool(len(slices)).map(fill, slices))  # list(): an error in a slice is raised here
    return {"img_feats": out_f, "img_boxes": out_b, **_pinned({"img_mask": torch.from_numpy(mask)}, pin)}


def _check_image(i: int, feats: np.ndarray, boxes: np.ndarray, feature_dim: Optional[int]) -> None:
    if feats.ndim != 2 or boxes.ndim != 2 or boxes.shape[1] != BOX_DIM or len(feats) != len(boxes):
        raise ValueError(f"image {i}: expected features (n,F) and boxes (n,{BOX_DIM}), "
                         f"got {feats.shape} and {boxes.shape}")
    if len(feats) == 0:
        raise ValueError(f"image {i} has no regions")
    if feature_dim is not None and feats.shape[1] != feature_dim:
        raise ValueError(f"image {i} has feature dim {feats.shape[1]}, batch has {feature_dim}")


#: The dtypes region tensors are made in (numpy's): a model of another dtype narrows them itself.
HOST_DTYPES = (torch.float32, torch.float16)
#: Rows below which a slice is not worth a thread's hand-off (a few microseconds per image copied).
MIN_ROWS_PER_WORKER = 8


def _slices(n: int, workers: int) -> list[range]:
    """``n`` rows as at most ``workers`` contiguous slices of at least MIN_ROWS_PER_WORKER rows (one slice for
    a small batch)."""
    if workers < 1:
        raise ValueError(f"collate workers must be >= 1, got {workers}")
    parts = max(1, min(workers, n // MIN_ROWS_PER_WORKER))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


def _empty(reuse: Optional[dict], key: str, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised tensor of ``shape``: new, or a view of the block ``reuse[key]`` (grown when too small)."""
    if reuse is None:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    n = int(np.prod(shape))
    block = reuse.get(key)
    if block is None or block.numel() < n or block.dtype != dtype or block.is_pinned() != pin:
        block = reuse[key] = torch.empty(n, dtype=dtype, pin_memory=pin)
    return block[:n].view(shape)


def _pinned(batch: dict[str, torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
    """The small tensors of a batch (token ids, masks) copied to pinned memory where ``pin``."""
    return {k: v.pin_memory() for k, v in batch.items()} if pin else batch


@functools.lru_cache(maxsize=None)
def _collate_pool(workers: int) -> ThreadPoolExecutor:
    """One pool of collating threads per count, for the process's life (a batch is too short to start threads)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="collate-fill")


def collate_pairs(text_collator: TextCollator, texts: Sequence[Text], images: Sequence[Regions],
                  max_regions: int = DEFAULT_MAX_REGIONS, dtype: torch.dtype = torch.float32, pin: bool = False,
                  workers: int = 1, reuse: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """A batch of (text, image) pairs for the cross-encoder: text and regions padded each on its own
    (``pin``, ``workers`` and ``reuse`` as in collate_images)."""
    if len(texts) != len(images):
        raise ValueError(f"collate_pairs: {len(texts)} texts but {len(images)} images")
    return {**_pinned(text_collator(texts), pin), **collate_images(images, max_regions, dtype, pin, workers, reuse)}


@dataclass
class BatchMaker:
    """The model inputs of one batch, made the same way by the library's batched loops
    (VLRetrievalModel.encode_text / encode_image / score) and the Beam jobs' handler: padded per batch, region
    features in the model's ``dtype``, and in pinned memory when ``pin`` (a CUDA model), so the copy to the device
    is asynchronous (``to_device``); regions copied in ``workers`` threads (collate_images).

    ``ring`` > 0: the region tensors of each batch are made in one of ``ring`` host blocks taken in turn, so the
    batch made ``ring`` calls ago must be done with (a caller that holds at most ``ring - 1`` batches: the handler,
    which returns after its batch ran, or a prefetching loop on the CPU). Pinned memory needs no ring: PyTorch's
    pinned allocator keeps freed blocks, and reuses one only after the copies that read it have run."""
    text_collator: Optional[TextCollator]
    max_regions: int = DEFAULT_MAX_REGIONS
    dtype: torch.dtype = torch.float32
    pin: bool = False
    workers: int = 1
    ring: int = 0
    _blocks: list = field(default_factory=list, init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)

    def text(self, texts: Sequence[Text]) -> dict[str, torch.Tensor]:
        return _pinned(self._texts()(texts), self.pin)

    def images(self, images: Sequence[Regions]) -> dict[str, torch.Tensor]:
        return collate_images(images, self.max_regions, self.dtype, self.pin, self.workers, self._block())

    def pairs(self, texts: Sequence[Text], images: Sequence[Regions]) -> dict[str, torch.Tensor]:
        return collate_pairs(self._texts(), texts, images, self.max_regions, self.dtype, self.pin, self.workers,
                             self._block())

    def _block(self) -> Optional[dict]:
        if self.ring < 1 or self.pin:
            return None
        if not self._blocks:
            self._blocks = [{} for _ in range(self.ring)]
        self._turn = (self._turn + 1) % self.ring
        return self._blocks[self._turn]

    def _texts(self) -> TextCollator:
        if self.text_collator is None:
            raise RuntimeError("this model has no tokenizer attached")
        return self.text_collator


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on ``device``; from pinned memory the copies run asynchronously with the host."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


#: Batches a batched loop makes ahead of the one the model runs (one worker thread): enough to hide a batch's
#: collation behind the model, few enough to keep memory small.
PREFETCH_BATCHES = 2


def prefetched(make_batch: Callable, chunks: Iterable, depth: int = PREFETCH_BATCHES):
    """(chunk, make_batch(chunk)) for each chunk in order, the next ``depth`` made in a worker thread while the
    caller uses the current one (collation is numpy and tokenizer work outside the model's threads). An error
    in ``make_batch`` is raised here, at its batch. ``chunks`` may be a generator: it is advanced in the caller's
    thread, the next chunk when the caller asks for the current one (the trainer plans a step's reads that way)."""
    if not chunks:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="collate") as pool:
        pending: deque = deque()
        it = iter(chunks)
        try:
            for chunk in it:
                pending.append((chunk, pool.submit(make_batch, chunk)))
                if len(pending) > depth:
                    chunk0, fut = pending.popleft()
                    yield chunk0, fut.result()
            while pending:
                chunk0, fut = pending.popleft()
                yield chunk0, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()

"""`VLRetrievalModel`: one single-stream BERT-family encoder with a bi-encoder (BE) and a cross-encoder (CE) head.

Inputs (OSCAR / MMT-Retrieval layout, docs/CONVENTIONS.md#model-inputs):
  text only   [CLS] tokens [SEP]
  image only  [CLS] region_1 .. region_R
  pair        [CLS] tokens [SEP] region_1 .. region_R   (text and regions padded each on its own)
Image tokens = Linear(feature_dim + 6 -> hidden) of each region's features and normalised box, then
(native models) + token-type-1 embedding and LayerNorm, then dropout. They get no position embedding.

BE: attention-masked mean over all output tokens, L2-normalised (cosine = dot product).
CE: BertPooler-style dense+tanh on the [CLS] output -> dropout -> Linear(hidden, 2). ``score_pairs`` returns
the model's CE score key (``VLModelConfig.ce_score``): by default (``logit_diff``) the match log-odds
``logit[:,1] - logit[:,0]``, so ``sigmoid(score) = softmax(logits)[1] = P(match)``; that makes the paper's ADD_λ
fusion (λ·e + (1-λ)·sigmoid(c)) meaningful on our scores. ``logit1`` is MMT-Retrieval's own ranking key (its
released folders load with it), so CE-only rankings reproduce MMT's; it is not a log-odds.

One object carries both heads: SEP = two models trained separately, JOIN = one trained on both objectives.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, BertConfig, BertModel
from transformers.utils import SAFE_WEIGHTS_NAME

from retrieval_core.data.schema import (
    BOX_DIM,
    DEFAULT_MAX_REGIONS,
    DEFAULT_MAX_TEXT_TOKENS,
    SCHEMA_VERSION,
    ImageReader,
)
from retrieval_core.model.attention import attention_backends, packed_layer
from retrieval_core.model.collate import (
    PREFETCH_BATCHES,
    BatchMaker,
    Regions,
    Text,
    TextCollator,
    TokenCounts,
    prefetched,
    to_device,
)

MODEL_JSON = "rr_model.json"
#: Start of the CE agreement term's learned scale (VLModelConfig.ce_agreement): cosines of matching and random
#: pairs differ by ~0.1 at the first CE step, a logit gap of ~1 at this scale.
AGREEMENT_SCALE_INIT = 10.0

#: The CE head's agreement terms (VLModelConfig.ce_agreement).
CE_AGREEMENTS = ("none", "mean", "maxsim")
#: Where a model comes from, as ce_agreement_default reads it.
MODEL_ORIGINS = ("new", "converted", "folder")

#: CE score keys: ``logit_diff`` = logit1 - logit0 (log-odds of a match), ``logit1`` = MMT-Retrieval's key.
CE_SCORES = ("logit_diff", "logit1")
#: The weights of a model folder: Hugging Face's own file name, so the folder is also a plain HF BERT folder.
WEIGHTS_FILE = SAFE_WEIGHTS_NAME

#: The encoder's attention kernels (transformers' attn_implementation): PyTorch's fused scaled_dot_product_attention
#: (the default) or the eager matmul-softmax-matmul path (the reference the tests compare it with).
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

#: A batched inference call's progress: its own tqdm bar (True), none (False), or a callback given the number of
#: items in each finished batch (one bar over several calls, e.g. train's dev evaluation).
Progress = bool | Callable[[int], None]


@dataclass
class VLModelConfig:
    """What ``rr_model.json`` records next to the HF ``config.json``."""
    feature_dim: int
    box_dim: int = BOX_DIM
    max_text_len: int = DEFAULT_MAX_TEXT_TOKENS
    max_regions: int = DEFAULT_MAX_REGIONS
    # Native models add the token-type-1 embedding to image tokens (UNITER); OSCAR checkpoints do not.
    image_token_type: bool = True
    # LayerNorm after the image projection; OSCAR only with config.use_img_layernorm.
    image_layer_norm: bool = True
    image_layer_norm_eps: float = 1e-12
    # CE head on pooler(dense+tanh)([CLS]) (MMT input_key "pooled_cls_token_embeddings") or on raw [CLS].
    ce_pooler: bool = True
    ce_score: str = "logit_diff"  # one of CE_SCORES: what score_pairs returns
    # The CE's match logit also adds s * agreement(caption states, region states) of the pair's single stream as it
    # enters the last layer (s learned, log-parametrised): "maxsim" = the mean over caption tokens of their best
    # cosine with a region (late interaction, FILIP / ColBERT style), "mean" = the cosine of the two mean states.
    # A [CLS] head alone on a text-only backbone sat at chance for a seed-dependent number of CE steps; with the
    # term it learns from the first CE step, and maxsim's token-to-region matching is the only head here that tells
    # binding siblings apart above chance (docs/TRAINING.md). Every config names its term: the default of each kind
    # of model is ce_agreement_default's.
    ce_agreement: str = field(kw_only=True)
    # The fingerprint of the image backbone whose grid features the model was trained on ("" = region features
    # extracted elsewhere): pipelines refuse staged features of another source (data.pixels.backbone).
    image_backbone: str = ""
    schema_version: str = SCHEMA_VERSION
    provenance: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.ce_score not in CE_SCORES:
            raise ValueError(f"ce_score must be one of {CE_SCORES}, got {self.ce_score!r}")
        if self.ce_agreement not in CE_AGREEMENTS:
            raise ValueError(f"ce_agreement must be one of {CE_AGREEMENTS}, got {self.ce_agreement!r}")

    @staticmethod
    def from_json(d: dict) -> "VLModelConfig":
        known = {k: d[k] for k in VLModelConfig.__dataclass_fields__ if k in d}
        known["ce_agreement"] = ce_agreement_default("folder", d.get("ce_agreement"))
        return VLModelConfig(**known)


def ce_agreement_default(origin: str, saved: Optional[str] = None) -> str:
    """The CE head's agreement term (CE_AGREEMENTS) where nobody asks for one: the one place that decides it, by
    where the model comes from (MODEL_ORIGINS).

    - "new": a model built from a text backbone, as the demo and benchmark recipes build theirs -> maxsim (the
      [CLS] head alone learns late and seed-dependently; docs/TRAINING.md);
    - "converted": an OSCAR / MMT-Retrieval checkpoint, trained without the term -> none;
    - "folder": one of our model folders keeps the term it was saved with (``saved``; none for a folder saved
      before the term existed)."""
    if origin == "folder":
        return "none" if saved is None else saved
    defaults = {"new": "maxsim", "converted": "none"}
    if origin not in defaults:
        raise ValueError(f"origin must be one of {MODEL_ORIGINS}, got {origin!r}")
    return defaults[origin]


class VLRetrievalModel(nn.Module):
    def __init__(self, bert_config: BertConfig, cfg: VLModelConfig, tokenizer=None):
        super().__init__()
        if cfg.box_dim != BOX_DIM:
            raise ValueError(f"box_dim must be {BOX_DIM} (normalised x1,y1,x2,y2,w,h), got {cfg.box_dim}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.bert = BertModel(bert_config, add_pooling_layer=False)
        self.set_attention("sdpa")
        hidden = bert_config.hidden_size
        self.img_embedding = nn.Linear(cfg.feature_dim + cfg.box_dim, hidden)
        self.img_layer_norm = (nn.LayerNorm(hidden, eps=cfg.image_layer_norm_eps) if cfg.image_layer_norm
                               else nn.Identity())
        self.img_dropout = nn.Dropout(bert_config.hidden_dropout_prob)
        self.ce_pooler = nn.Linear(hidden, hidden) if cfg.ce_pooler else None
        self.ce_dropout = nn.Dropout(bert_config.hidden_dropout_prob)
        self.ce_classifier = nn.Linear(hidden, 2)
        self.ce_agreement_log_scale = _agreement_scale() if cfg.ce_agreement != "none" else None
        self._init_new_weights(bert_config.initializer_range)
        self.reset_token_counts()

    def _init_new_weights(self, std: float) -> None:
        """BERT's init for the layers the text backbone does not provide."""
        for lin in (self.img_embedding, self.ce_pooler, self.ce_classifier):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
                nn.init.zeros_(lin.bias)

    # ---------------------------------------------------------------------------------- properties
    @property
    def embedding_dim(self) -> int:
        return int(self.bert.config.hidden_size)

    @property
    def feature_dim(self) -> int:
        return int(self.cfg.feature_dim)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def attention(self) -> str:
        """The attention kernel the encoder runs (ATTENTION_IMPLEMENTATIONS)."""
        return str(self.bert.config._attn_implementation)

    def set_attention(self, implementation: str) -> None:
        if implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {implementation!r}")
        self.bert.set_attn_implementation(implementation)

    def reset_token_counts(self) -> None:
        """Useful and computed token positions of every sequence the encoder runs from now on, per head
        (``token_counts``; benchmarks read the padding): "be" (embed_text, embed_image) and "ce" (ce_logits,
        ce_layer_states)."""
        self.token_counts = {"be": TokenCounts(), "ce": TokenCounts()}

    def text_collator(self) -> TextCollator:
        if self.tokenizer is None:
            raise RuntimeError("this model has no tokenizer attached")
        return TextCollator(self.tokenizer, self.cfg.max_text_len)

    def batch_maker(self, device: Optional[torch.device] = None, workers: int = 1, ring: int = 0) -> BatchMaker:
        """How this model's batches are made (collate.BatchMaker) for ``device`` (default: where the model is):
        region features in the weights' dtype (float32 for bf16 weights: the model narrows them), pinned host
        memory for a CUDA device; ``workers`` collating threads, ``ring`` reused host blocks."""
        dev = torch.device(device) if device is not None else self.device
        return BatchMaker(self.text_collator() if self.tokenizer is not None else None, self.cfg.max_regions,
                          self.bert.embeddings.word_embeddings.weight.dtype, pin=dev.type == "cuda",
                          workers=workers, ring=ring)

    def _loop_batch_maker(self, device: torch.device) -> BatchMaker:
        """The batch maker of the batched loops below: on the CPU one collating thread beside the model's (the
        prefetch overlaps it with the model) and a ring the prefetch cannot outrun; on a GPU every torch thread
        collates (the host must keep the device fed) into pinned memory."""
        if device.type == "cpu":
            return self.batch_maker(device, workers=1, ring=PREFETCH_BATCHES + 2)
        return self.batch_maker(device, workers=torch.get_num_threads())

    # ------------------------------------------------------------------------------------ embeddings
    def _text_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        # token type 0 for text, absolute positions from 0: exactly what BertModel would do.
        return self.bert.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))

    def _image_tokens(self, img_feats: torch.Tensor, img_boxes: torch.Tensor) -> torch.Tensor:
        dtype = self.bert.embeddings.word_embeddings.weight.dtype  # float32, or bf16 as quantize_model serves it
        x = torch.cat([img_feats, img_boxes.to(img_feats.dtype)], dim=-1).to(dtype)
        if x.shape[-1] != self.img_embedding.in_features:
            raise ValueError(f"image input has {x.shape[-1] - self.cfg.box_dim} feature dims, "
                             f"model expects {self.cfg.feature_dim}")
        h = self.img_embedding(x)
        if self.cfg.image_token_type:
            h = h + self.bert.embeddings.token_type_embeddings.weight[1]
        return self.img_dropout(self.img_layer_norm(h))

    def _cls_tokens(self, batch_size: int, device: torch.device) -> torch.Tensor:
        cls_id = self.tokenizer.cls_token_id if self.tokenizer is not None else 101
        ids = torch.full((batch_size, 1), int(cls_id), dtype=torch.long, device=device)
        return self._text_tokens(ids)

    @staticmethod
    def _additive_mask(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (B,1,1,L) additive attention mask of a 0/1 (B, L) mask, in the attention's dtype."""
        dtype = tokens.dtype
        if tokens.is_cuda and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")  # SDPA wants the mask in the query's dtype
        return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min

    def _encode(self, tokens: torch.Tensor, mask: torch.Tensor, head: str, cls_only: bool = False,
                entering_last: Optional[list] = None) -> torch.Tensor:
        """Runs the BERT layers over already-embedded (B, L, H) tokens and their 0/1 mask: the dense layers on the
        real tokens only (attention.packed_layer), counted under ``head`` (token_counts). Returns (B, L, H), padded
        positions zero; ``cls_only``: the last layer computes the [CLS] output alone, (B, 1, H).
        ``entering_last``: a list that receives the (B, L, H) states entering the last layer, padded positions
        zero."""
        b, length, hidden = tokens.shape
        flat = mask.reshape(-1).bool()
        keep = None if bool(flat.all()) else flat.nonzero().squeeze(1)  # None: no padding to skip
        self.token_counts[head].add(mask)
        additive = self._additive_mask(tokens, mask)
        x = tokens.reshape(-1, hidden) if keep is None else tokens.reshape(-1, hidden)[keep]
        layers = self.bert.encoder.layer
        attention_dtype = additive.dtype  # under autocast q, k and v are 16-bit while x stays float32
        with attention_backends(x.device, attention_dtype):
            for layer in layers[:-1] if cls_only else layers:
                x = packed_layer(layer, x, keep, (b, length), additive)
        if entering_last is not None:
            if not cls_only:
                raise ValueError("entering_last is read on the CE's path (cls_only)")
            entering_last.append(x.view(b, length, hidden) if keep is None else
                                 x.new_zeros(b * length, hidden).index_copy(0, keep, x).view(b, length, hidden))
        if cls_only:  # [CLS] is every row's first position, a real token
            cls = torch.arange(b, device=x.device) * length
            cls = cls if keep is None else torch.searchsorted(keep, cls)
            with attention_backends(x.device, attention_dtype):
                return packed_layer(layers[-1], x, keep, (b, length), additive, queries=cls).view(b, 1, hidden)
        if keep is None:
            return x.view(b, length, hidden)
        return x.new_zeros(b * length, hidden).index_copy(0, keep, x).view(b, length, hidden)

    @staticmethod
    def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.to(torch.float32).unsqueeze(-1)
        pooled = (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, dim=-1)

    def _image_sequence(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        feats = batch["img_feats"]
        img = self._image_tokens(feats, batch["img_boxes"])
        img_mask = batch["img_mask"]
        cls = self._cls_tokens(feats.shape[0], feats.device)
        ones = torch.ones(feats.shape[0], 1, dtype=img_mask.dtype, device=feats.device)
        return torch.cat([cls, img.to(cls.dtype)], 1), torch.cat([ones, img_mask], 1)

    def embed_text(self, batch: dict) -> torch.Tensor:
        """(B, hidden) L2-normalised BE embeddings of a TextCollator batch."""
        hidden = self._encode(self._text_tokens(batch["input_ids"]), batch["attention_mask"], "be")
        return self._mean_pool(hidden, batch["attention_mask"])

    def embed_image(self, batch: dict) -> torch.Tensor:
        """(B, hidden) L2-normalised BE embeddings of a collate_images batch ([CLS] + regions)."""
        tokens, mask = self._image_sequence(batch)
        return self._mean_pool(self._encode(tokens, mask, "be"), mask)

    def _ce_input(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The CE's single stream of a collate_pairs batch: caption tokens (padded to the batch's longest), then
        regions; and its 0/1 mask."""
        text = self._text_tokens(batch["input_ids"])
        img = self._image_tokens(batch["img_feats"], batch["img_boxes"]).to(text.dtype)
        mask = torch.cat([batch["attention_mask"], batch["img_mask"].to(batch["attention_mask"].dtype)], 1)
        return torch.cat([text, img], 1), mask

    def ce_layer_states(self, batch: dict) -> list[torch.Tensor]:
        """The CE's hidden states of a collate_pairs batch at every layer, its input tokens first: (layers + 1)
        tensors (B, L, H), positions as in the stream (``batch["input_ids"].shape[1]`` caption positions, then
        the regions). For probes (benchmarks.probes.binding_probe); no gradients."""
        states: list[torch.Tensor] = []
        hooks = [layer.register_forward_hook(lambda _m, _i, out: states.append(out[0] if isinstance(out, tuple)
                                                                              else out))
                 for layer in self.bert.encoder.layer]
        try:
            with torch.no_grad():
                tokens, mask = self._ce_input(batch)
                self.bert.encoder(tokens, attention_mask=self._additive_mask(tokens, mask))
        finally:
            for h in hooks:
                h.remove()
        return [tokens] + states

    def ce_logits(self, batch: dict) -> torch.Tensor:
        """(B, 2) CE logits (class 1 = match) of a collate_pairs batch: the classifier over the last layer's
        [CLS], plus, with ``cfg.ce_agreement``, the agreement term on the match logit."""
        tokens, mask = self._ce_input(batch)
        entering: Optional[list] = [] if self.ce_agreement_log_scale is not None else None
        cls = self._encode(tokens, mask, "ce", cls_only=True, entering_last=entering)[:, 0]
        if self.ce_pooler is not None:
            cls = torch.tanh(self.ce_pooler(cls))
        logits = self.ce_classifier(self.ce_dropout(cls))
        if entering is None:
            return logits
        agreement = self.agreement_logit(entering[0], batch["attention_mask"], batch["img_mask"])
        return logits + torch.stack([torch.zeros_like(agreement), agreement], 1).to(logits.dtype)

    def add_ce_agreement(self, kind: str) -> None:
        """Gives the CE head an agreement term (CE_AGREEMENTS) at its starting scale: a model folder built without
        one, e.g. a converted checkpoint, fine-tuned with it."""
        if kind not in CE_AGREEMENTS[1:] or self.ce_agreement_log_scale is not None:
            raise ValueError(f"cannot add a {kind!r} agreement term to a CE head with {self.cfg.ce_agreement!r}")
        self.cfg.ce_agreement = kind
        self.ce_agreement_log_scale = _agreement_scale(self.ce_classifier.weight.device)

    def agreement_logit(self, states: torch.Tensor, text_mask: torch.Tensor, img_mask: torch.Tensor) -> torch.Tensor:
        """(B,) s * agreement of (B, T + R, H) pair states (caption positions first, as _ce_input lays them out),
        in float32: "mean": cos(mean caption state, mean region state); "maxsim": the mean over caption tokens of
        their best cosine with a real region."""
        text_len = text_mask.shape[1]
        if self.cfg.ce_agreement == "mean":
            text = self._mean_pool(states[:, :text_len], text_mask)
            regions = self._mean_pool(states[:, text_len:], img_mask)
            agreement = (text * regions).sum(-1)
        else:
            text = nn.functional.normalize(states[:, :text_len].float(), dim=-1)
            regions = nn.functional.normalize(states[:, text_len:].float(), dim=-1)
            # below any cosine: a padded region is never a token's best match
            sim = torch.einsum("btd,brd->btr", text, regions).masked_fill(~img_mask.bool()[:, None, :], -2.0)
            m = text_mask.to(torch.float32)
            agreement = (sim.amax(-1) * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.ce_agreement_log_scale.float().exp() * agreement

    def score_pairs(self, batch: dict) -> torch.Tensor:
        """(B,) CE scores under ``cfg.ce_score``: match log-odds (sigmoid(score) = P(match)) or MMT's logit1."""
        logits = self.ce_logits(batch).float()
        if self.cfg.ce_score == "logit1":
            return logits[:, 1]
        return logits[:, 1] - logits[:, 0]

    # ------------------------------------------------------------------ numpy convenience (inference)
    def encode_text(self, texts: Sequence[Text], batch_size: int = 128, device: str = "cpu",
                    amp_dtype: Optional[str] = None, progress: Progress = False) -> np.ndarray:
        """(n, d) float32 L2-normalised text embeddings, in input order. Texts are str or token ids
        (TextCollator.ids); every str is tokenised once, before the first batch."""
        texts = list(texts)
        make = self._loop_batch_maker(torch.device(device))
        ids = make.text_collator.ids(texts) if texts else []
        order = np.argsort(_lengths(ids), kind="stable")
        return self._run_batched(order, batch_size, device, amp_dtype, progress, "encode text", self.embedding_dim,
                                 lambda idx: make.text([ids[i] for i in idx]), self.embed_text)

    def encode_image(self, images: ImageReader | Sequence[Regions], batch_size: int = 128, device: str = "cpu",
                     amp_dtype: Optional[str] = None, progress: Progress = False) -> np.ndarray:
        """(n, d) float32 L2-normalised image embeddings, in input order."""
        get, counts = _region_access(images)
        order = np.argsort(counts, kind="stable")
        make = self._loop_batch_maker(torch.device(device))
        return self._run_batched(order, batch_size, device, amp_dtype, progress, "encode images", self.embedding_dim,
                                 lambda idx: make.images([get(i) for i in idx]), self.embed_image)

    def score(self, texts: Sequence[Text], images: ImageReader | Sequence[Regions], batch_size: int = 128,
              device: str = "cpu", amp_dtype: Optional[str] = None, progress: Progress = False) -> np.ndarray:
        """(n,) CE match log-odds of the pairs (texts[i], images[i]); texts as in encode_text."""
        texts = list(texts)
        get, counts = _region_access(images)
        if len(texts) != len(counts):
            raise ValueError(f"score: {len(texts)} texts but {len(counts)} images")
        make = self._loop_batch_maker(torch.device(device))
        ids = make.text_collator.ids(texts) if texts else []
        order = np.lexsort((_lengths(ids), np.minimum(counts, self.cfg.max_regions)))
        out = self._run_batched(order, batch_size, device, amp_dtype, progress, "CE score", 1,
                                lambda idx: make.pairs([ids[i] for i in idx], [get(i) for i in idx]),
                                lambda b: self.score_pairs(b)[:, None])
        return out[:, 0]

    def _run_batched(self, order: np.ndarray, batch_size: int, device: str, amp_dtype: Optional[str],
                     progress: Progress, desc: str, width: int, make_batch: Callable,
                     fn: Callable) -> np.ndarray:
        """``fn`` over the batches of ``order``: a worker thread makes the next collate.PREFETCH_BATCHES batches
        while the model runs the current one, and on a GPU the results stay on the device until the end (one sync,
        not one per batch)."""
        from tqdm.auto import tqdm

        report = progress if callable(progress) else None
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        dev = torch.device(device)
        self.to(dev)
        was_training = self.training
        self.eval()
        out = np.zeros((len(order), width), dtype=np.float32)
        chunks = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
        on_device: list[tuple[np.ndarray, torch.Tensor]] = []
        try:
            with torch.inference_mode(), _autocast(dev, amp_dtype):
                own_bar = bool(progress) and report is None
                bar = tqdm(total=len(chunks), desc=desc, disable=not own_bar, unit="batch")
                for idx, batch in prefetched(make_batch, chunks):
                    result = fn(to_device(batch, dev)).float()
                    if dev.type == "cpu":
                        out[idx] = result.numpy()
                    else:
                        on_device.append((idx, result))
                    bar.update(1)
                    if report is not None:
                        report(len(idx))
                bar.close()
                if on_device:
                    out[np.concatenate([i for i, _ in on_device])] = torch.cat([r for _, r in on_device]).cpu().numpy()
        finally:
            self.train(was_training)
        return out

    # ----------------------------------------------------------------------------------- save/load
    def save(self, directory: str) -> None:
        """Writes rr_model.json, model.safetensors, the HF config.json and the tokenizer files."""
        os.makedirs(directory, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
        self.bert.config.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
        with open(os.path.join(directory, MODEL_JSON), "w") as f:
            json.dump(asdict(self.cfg), f, indent=2, sort_keys=True)

    @classmethod
    def load(cls, directory: str, device: str = "cpu") -> "VLRetrievalModel":
        path = os.path.join(directory, MODEL_JSON)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory} is not a VLRetrievalModel folder (no {MODEL_JSON})")
        with open(path) as f:
            cfg = VLModelConfig.from_json(json.load(f))
        bert_config = BertConfig.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = cls(bert_config, cfg, tokenizer)
        state = load_file(os.path.join(directory, WEIGHTS_FILE))
        model.load_state_dict(state, strict=True)
        return model.to(device).eval()


def _agreement_scale(device: Optional[torch.device] = None) -> nn.Parameter:
    """The agreement term's log scale at its start. Shape (1,), not a scalar: the optimizer keeps 1-d weights out
    of weight decay."""
    return nn.Parameter(torch.full((1,), math.log(AGREEMENT_SCALE_INIT), device=device))


def _lengths(ids: Sequence[np.ndarray]) -> np.ndarray:
    return np.fromiter((len(t) for t in ids), dtype=np.int64, count=len(ids))


def _region_access(images: ImageReader | Sequence[Regions]) -> tuple[Callable[[int], Regions], np.ndarray]:
    if isinstance(images, ImageReader):  # an ImageTable, or images read from disk on demand
        return images.regions, images.num_boxes()
    images = list(images)
    return (lambda i: images[i]), np.array([len(f) for f, _ in images], dtype=np.int64)


def _autocast(device: torch.device, amp_dtype: Optional[str]):
    """bf16/fp16 autocast on CUDA only; CPU stays exact float32."""
    if amp_dtype is None or device.type != "cuda":
        return torch.autocast(device_type="cpu", enabled=False)
    dtypes = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if amp_dtype not in dtypes:
        raise ValueError(f"amp_dtype must be one of {sorted(dtypes)}, got {amp_dtype!r}")
    return torch.autocast(device_type="cuda", dtype=dtypes[amp_dtype])

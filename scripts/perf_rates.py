"""The rates ``perf_ab.py rates`` prints and ``perf_ab.py versions`` compares across checkouts: CE pairs/s, BE
captions/s and images/s and JOIN steps of the demo recipe, in one process, with whatever retrieval_core is
importable (this checkout's, or PYTHONPATH's). It uses only library APIs both versions have and no CLI helper:
run under an older checkout's library, it takes its settings as one JSON argument.

    python scripts/perf_rates.py '{"backbone": "B", "data": "/tmp/ab", "threads": 2, "steps": 6}'
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

import numpy as np
import torch


def load(backbone: str, data: str):
    import pandas as pd

    from retrieval_core.data.schema import ImageTable
    from retrieval_core.model.checkpoints import from_text_backbone

    spec = json.load(open(os.path.join(backbone, "recipes.json")))
    arrays = np.load(os.path.join(data, "images.npz"))
    images = ImageTable(arrays["item_ids"], arrays["offsets"], arrays["features"], arrays["boxes"], {})
    captions = pd.read_json(os.path.join(data, "captions.json"), orient="records")
    # the [CLS]-only CE head the documented A/B ratios were measured with (docs/log/PERFORMANCE-2026-11.md)
    model = from_text_backbone(backbone, int(arrays["features"].shape[1]), max_regions=int(spec["max_regions"]),
                               ce_agreement="none")
    return model, images, captions, spec


def pairs(captions, images, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    texts = captions["text"].tolist()
    return ([texts[i] for i in rng.integers(0, len(texts), n)],
            [images.regions(int(p)) for p in rng.integers(0, len(images), n)])


def measure_rates(backbone: str, data: str, threads: int, steps: int) -> dict:
    """One process's rates (module docstring)."""
    from retrieval_core.training.config import TrainConfig
    from retrieval_core.training.train_data import TrainData
    from retrieval_core.training.trainer import Trainer

    torch.set_num_threads(threads)
    model, images, captions, spec = load(backbone, data)
    texts = captions["text"].tolist()[:2048]
    pair_texts, pair_regions = pairs(captions, images, 1024)
    model.encode_text(texts[:64], batch_size=128)  # warm-up: allocator, OpenMP pool, tokenizer
    model.score(pair_texts[:16], pair_regions[:16], batch_size=128)
    out = {}
    t0 = time.perf_counter()
    model.score(pair_texts, pair_regions, batch_size=128)
    out["ce_pairs_per_s"] = len(pair_texts) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    model.encode_text(texts, batch_size=128)
    out["captions_per_s"] = len(texts) / (time.perf_counter() - t0)
    some = images.take(range(min(512, len(images))))
    t0 = time.perf_counter()
    model.encode_image(some, batch_size=128)
    out["images_per_s"] = len(some) / (time.perf_counter() - t0)
    cfg = replace(TrainConfig(**spec["recipes"]["demo"]), progress=False, hard_negative_prob=0.0,
                  mined_negative_prob=0.0)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model, TrainData(captions, images), cfg, tmp)
        model.train()
        torch.use_deterministic_algorithms(True, warn_only=True)  # as Trainer.train sets it on CPU
        trainer.train_step(cfg.ce_start_step)
        secs = [[r["seconds"] for r in trainer.train_step(s)]
                for s in range(cfg.ce_start_step + 1, cfg.ce_start_step + 1 + steps)]
    out["be_step_s"], out["ce_step_s"] = (float(np.median([s[i] for s in secs])) for i in (0, 1))
    out["join_step_s"] = float(np.median([sum(s) for s in secs]))
    return out


if __name__ == "__main__":
    print(json.dumps(measure_rates(**json.loads(sys.argv[1]))))

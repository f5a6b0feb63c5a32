"""A whole synthetic collection in memory, staged with the stager's per-record functions."""
from __future__ import annotations

import pandas as pd

from retrieval_core.data import staging
from retrieval_core.data.schema import DEFAULT_MAX_REGIONS, ImageTable, Reject
from retrieval_core.data.synthetic.captions import generate_captions
from retrieval_core.data.synthetic.regions import generate_images
from retrieval_core.data.synthetic.spec import SyntheticSpec


def synthetic_collection(spec: SyntheticSpec) -> tuple[ImageTable, pd.DataFrame]:
    """(ImageTable, captions DataFrame) of one synthetic collection in memory, validated with the stager's
    per-record functions (no Beam): real images and captions for in-process benchmarks."""
    rows = []
    for raw in generate_images(spec):
        r = staging.stage_image(raw, collection=spec.collection, feature_dim=spec.feature_dim,
                                max_regions=DEFAULT_MAX_REGIONS, source="synthetic")
        if isinstance(r, Reject):
            raise ValueError(f"synthetic image rejected: {r.reason}")
        rows.append(r)
    caps = []
    for raw in generate_captions(spec):
        r = staging.stage_caption(raw, collection=spec.collection, source="synthetic")
        if isinstance(r, Reject):
            raise ValueError(f"synthetic caption rejected: {r.reason}")
        caps.append({"caption_id": r["caption_id"], "image_item_id": r["image_item_id"], "text": r["text"]})
    table = ImageTable.from_lists([r["item_id"] for r in rows], [r["features"] for r in rows],
                                  [r["boxes"] for r in rows])
    return table, pd.DataFrame(caps).sort_values("caption_id").reset_index(drop=True)

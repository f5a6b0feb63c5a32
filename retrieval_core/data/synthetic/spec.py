"""`SyntheticSpec`, what one synthetic collection is (validated when built), and the seeded random streams
every part of the generator draws from.

Determinism: image ``i`` depends only on (spec fields, i) - a family stream seeded by a hash of
(seed, collection, family) and an image stream seeded by a hash of (seed, collection, i) - so any index range can
be generated on any worker in any order with identical results. Captions use their own stream.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np

from retrieval_core.data.synthetic import translation
from retrieval_core.data.synthetic.vocabulary import DOMAINS

PERTURBATIONS = ("attribute", "binding", "count", "relation")
#: Caption languages: English (captions' writer) and those of ``translation``.
CAPTION_LANGUAGES = ("en",) + translation.LANGUAGES
DEFAULT_SIBLING_CHANGES = ("attribute", "binding", "attribute", "relation", "count", "count")
# A second binding or relation swap would recreate the base scene; count has 4 distinct variants (2 groups x 2
# other values); attribute alternates between the two focus groups, each time with a fresh unused colour.
_MAX_CHANGES = {"attribute": 6, "binding": 1, "count": 4, "relation": 1}


@dataclass(frozen=True)
class SyntheticSpec:
    collection: str
    num_images: int
    seed: int = 0
    domain: str = "coco"
    feature_dim: int = 2048
    captions_per_image: Optional[int] = None  # None -> 5 (1 for the cc domain); always an int after init
    min_regions: int = 10
    max_regions: int = 50
    splits: tuple = (("test", 1.0),)
    family_size: int = 4
    # what member j of a family changes from the base (member 0): sibling_changes[j - 1]
    sibling_changes: tuple = DEFAULT_SIBLING_CHANGES
    world_seed: int = 1234
    # every image gets captions_per_image captions in each language (in this order); English keys stay "0".."n-1",
    # the others' carry the language ("0.de"), so caption ids differ per language
    languages: tuple = ("en",)

    def __post_init__(self):
        if self.captions_per_image is None:
            object.__setattr__(self, "captions_per_image", 1 if self.domain == "cc" else 5)
        if isinstance(self.splits, dict):
            object.__setattr__(self, "splits", tuple(self.splits.items()))
        # Sorted by name: the assignment must not depend on mapping order (a Beam task freezes options sorted).
        object.__setattr__(self, "splits", tuple(sorted((str(n), float(f)) for n, f in self.splits)))
        if isinstance(self.sibling_changes, str):
            object.__setattr__(self, "sibling_changes", (self.sibling_changes,))
        object.__setattr__(self, "sibling_changes", tuple(str(c) for c in self.sibling_changes))
        if isinstance(self.languages, str):
            object.__setattr__(self, "languages", (self.languages,))
        object.__setattr__(self, "languages", tuple(str(x) for x in self.languages))
        problems = []
        if not self.collection:
            problems.append("collection must be a non-empty string")
        for name in ("num_images", "feature_dim", "captions_per_image", "min_regions", "max_regions", "family_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if self.domain not in DOMAINS:
            problems.append(f"unknown domain {self.domain!r} (expected one of: {', '.join(DOMAINS)})")
        if not problems and self.min_regions > self.max_regions:
            problems.append(f"min_regions ({self.min_regions}) > max_regions ({self.max_regions})")
        unknown = sorted(set(self.sibling_changes) - set(PERTURBATIONS))
        if unknown:
            problems.append(f"unknown sibling change(s) {unknown} (expected: {', '.join(PERTURBATIONS)})")
        elif not problems:
            used = self.sibling_changes[:self.family_size - 1]
            if len(used) < self.family_size - 1:
                problems.append(f"family_size {self.family_size} needs {self.family_size - 1} sibling_changes, "
                                f"got {len(self.sibling_changes)}")
            for kind, most in _MAX_CHANGES.items():
                if used.count(kind) > most:
                    problems.append(f"at most {most} {kind!r} sibling(s) per family (distinct scenes), "
                                    f"got {used.count(kind)}")
        unknown = [x for x in self.languages if x not in CAPTION_LANGUAGES]
        if unknown or not self.languages or len(set(self.languages)) != len(self.languages):
            problems.append(f"languages must be distinct caption languages of {', '.join(CAPTION_LANGUAGES)}, "
                            f"got {list(self.languages)}")
        fracs = [f for _, f in self.splits]
        if not self.splits or any(f <= 0 for f in fracs) or abs(sum(fracs) - 1.0) > 1e-6:
            problems.append(f"splits must be positive fractions summing to 1, got {dict(self.splits)}")
        if len({n for n, _ in self.splits}) != len(self.splits):
            problems.append(f"split names repeat: {[n for n, _ in self.splits]}")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_options(cls, collection: str, options: dict, feature_dim: int) -> "SyntheticSpec":
        """Build from a manifest's ``images:`` block options (``format``/``path`` already removed).
        ``splits`` may be a mapping ``{train: 0.7, ...}`` or a list of ``[name, fraction]`` pairs."""
        allowed = {f.name for f in fields(cls)} - {"collection", "feature_dim"}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(f"unknown synthetic option(s): {', '.join(unknown)} "
                             f"(expected: {', '.join(sorted(allowed))})")
        if "num_images" not in options:
            raise ValueError("synthetic images need num_images")
        kwargs = dict(options)
        splits = kwargs.get("splits")
        if splits is not None:
            if isinstance(splits, dict):
                kwargs["splits"] = tuple(splits.items())
            elif isinstance(splits, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2
                                                           for p in splits):
                kwargs["splits"] = tuple(tuple(p) for p in splits)
            else:
                raise ValueError(f"splits must be a mapping name -> fraction, got {splits!r}")
        return cls(collection=collection, feature_dim=feature_dim, **kwargs)

    @property
    def num_families(self) -> int:
        return -(-self.num_images // self.family_size)

    @property
    def num_captions(self) -> int:
        return self.num_images * self.captions_per_image * len(self.languages)


def _seed(*parts) -> int:
    key = "\x1f".join(str(p) for p in parts).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "big")


def seeded_rng(*parts) -> np.random.Generator:
    # SFC64: cheap to seed and fast; the stream is fully determined by the hashed parts.
    return np.random.Generator(np.random.SFC64(_seed(*parts)))

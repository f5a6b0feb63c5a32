"""What the caption writers of every language share: the groups and wordings a caption mentions, the
``Language`` a writer is made of (its lexicon, grammar tables and templates) and the lexicon tables' parser."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


def word_table(entries: dict, n_fields: int, what: str) -> dict:
    """{key: tuple of variants, each a tuple of n_fields forms} from "form/form/..." strings (first = canonical)."""
    out = {}
    for key, variants in entries.items():
        variants = (variants,) if isinstance(variants, str) else variants
        parsed = tuple(tuple(v.split("/")) for v in variants)
        bad = [v for v in parsed if len(v) != n_fields]
        if bad:
            raise ValueError(f"{what} {key!r}: expected {n_fields} forms separated by '/', got {bad}")
        out[key] = parsed
    return out


@dataclass(frozen=True)
class Group:
    """What a caption says about one object group (codebook keys, as in ``describe_scene``)."""
    cls: str
    colour: str
    size: str
    count: int
    wears: bool  # people: the colour is their clothing


@dataclass(frozen=True)
class Wording:
    """The choices one mention of a group makes, drawn once per caption: noun variant, "a single", size."""
    variant: int = 0
    single: bool = False
    size: bool = False


@dataclass(frozen=True)
class Language:
    nouns: dict
    np: Callable[[Group, Wording, Optional[str], bool], tuple[str, str]]
    join: Callable[[str, str, str], str]
    phrase: Callable[[str, str], str]
    subject_case: Optional[str]
    relations: dict
    preps: dict
    agree: dict
    settings: dict
    scenes: tuple
    extras: tuple
    templates: dict
    adjectives: dict
    wear: dict


def plain_phrase(det: str, rest: str) -> str:
    return f"{det} {rest}" if det else rest


def capitalised(text: str) -> str:
    """``text`` with its first letter upper case (a caption's first word)."""
    return text[0].upper() + text[1:]

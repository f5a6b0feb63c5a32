"""The captions of the synthetic scenes: English from templates here, the other languages through
``translation``; each names both focus groups with count, colour (sometimes size) and their relation."""
from __future__ import annotations

from typing import Iterator, Optional

from retrieval_core.data.schema import RawCaption
from retrieval_core.data.synthetic import translation
from retrieval_core.data.synthetic.grammar import capitalised
from retrieval_core.data.synthetic.scenes import describe_scene
from retrieval_core.data.synthetic.spec import SyntheticSpec, seeded_rng
from retrieval_core.data.synthetic.vocabulary import (
    COLOURS,
    COUNT_WORDS,
    DOMAINS,
    INVERSE,
    RELATION_WORDS,
    SETTINGS,
    SIZES,
    Noun,
)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _phrase(rng, noun: Noun, grp: dict, with_size: bool) -> str:
    """'two large red cubes', 'a man in blue', 'an orange mug'."""
    n = grp["count"]
    sing, plur = noun.forms[int(rng.integers(len(noun.forms)))]
    word = sing if n == 1 else plur
    colour = COLOURS[grp["colour"]][int(rng.integers(len(COLOURS[grp["colour"]])))]
    with_size = with_size and not noun.wears
    size = SIZES[grp["size"]][int(rng.integers(len(SIZES[grp["size"]])))] + " " if with_size else ""
    if noun.wears:
        core, head = f"{size}{word} in {colour}", size or word
    else:
        core, head = f"{size}{colour} {word}", size or colour
    count = COUNT_WORDS[n][int(rng.integers(len(COUNT_WORDS[n])))]
    if count in ("a",):
        count = _article(head)
    return f"{count} {core}"


def _be(grp) -> str:
    return "is" if grp["count"] == 1 else "are"


def _the(rng, noun: Noun, grp: dict) -> str:
    sing, plur = noun.forms[0]
    colour = grp["colour"]
    word = sing if grp["count"] == 1 else plur
    return f"the {word} in {colour}" if noun.wears else f"the {colour} {word}"


_TEMPLATES = {
    "coco": (
        "{A} {beA} {rel} {B}{set}.", "There {beA} {A} {rel} {B}{set}.", "{B} {beB} {inv} {A}{set}.",
        "A photo of {A} {rel} {B}{set}.", "{A} and {B}{set}, with {tA} {rel} {tB}.",
        "An image showing {B} and {A}; {tA} {beA} {rel} {tB}.", "{A} placed {rel} {B}{extra}.",
        "Close-up of {A} sitting {rel} {B}{extra}.",
    ),
    "f30k": (
        "{A} {beA} {rel} {B}{set}.", "{A} {beA} standing {rel} {B}{set}.", "{B} {beB} {inv} {A}{set}.",
        "{A} and {B}{set}; {tA} {beA} {rel} {tB}.", "There {beA} {A} {rel} {B}{extra}.",
        "{B}{set}, with {A} {rel} {tB}.", "Outdoors, {A} {rel} {B}{extra}.",
    ),
    "cc": (
        "stock photo : {A} {rel} {B}{set}{extra} .", "{A} {rel} {B}{set} -- a view of {tA} and {tB} .",
        "illustration of {B} {inv} {A}{set}{extra} .", "the {adj} scene with {A} {rel} {B}{set} .",
    ),
}
_CC_ADJ = ("beautiful", "vintage", "colorful", "minimalist", "cozy", "festive")


def _english_texts(spec: SyntheticSpec, scene: dict, index: int) -> list[str]:
    rng = seeded_rng("captions", spec.seed, spec.collection, index)
    nouns = {n.name: n for n in DOMAINS[spec.domain]}
    ga, gb = scene["groups"][0], scene["groups"][1]
    na, nb = nouns[ga["class"]], nouns[gb["class"]]
    others = scene["groups"][2:]
    templates = _TEMPLATES[spec.domain]
    picks = rng.permutation(len(templates))
    out = []
    for k in range(spec.captions_per_image):
        tpl = templates[int(picks[k % len(picks)])]
        rel = scene["relation"]
        extra = ""
        if others and rng.random() < 0.6:
            o = others[int(rng.integers(len(others)))]
            extra = f", next to {_phrase(rng, nouns[o['class']], o, False)}" if rng.random() < 0.5 else \
                f" and {_phrase(rng, nouns[o['class']], o, False)} nearby"
        text = tpl.format(
            A=_phrase(rng, na, ga, rng.random() < 0.35), B=_phrase(rng, nb, gb, rng.random() < 0.35),
            tA=_the(rng, na, ga), tB=_the(rng, nb, gb), beA=_be(ga), beB=_be(gb),
            rel=RELATION_WORDS[rel][int(rng.integers(3))], inv=RELATION_WORDS[INVERSE[rel]][int(rng.integers(3))],
            set=SETTINGS[spec.domain][int(rng.integers(len(SETTINGS[spec.domain])))], extra=extra,
            adj=_CC_ADJ[int(rng.integers(len(_CC_ADJ)))],
        )
        out.append(text if spec.domain == "cc" else capitalised(text))
    return out


def _translated_texts(spec: SyntheticSpec, scene: dict, index: int, lang: str) -> list[str]:
    """Captions in ``lang`` from a random stream of their own, so adding a language changes no other language's."""
    rng = seeded_rng("captions", spec.seed, spec.collection, index, lang)
    wears = {n.name: n.wears for n in DOMAINS[spec.domain]}
    groups = [translation.Group(g["class"], g["colour"], g["size"], g["count"], wears[g["class"]])
              for g in scene["groups"]]
    return translation.write_captions(lang, spec.domain, groups, scene["relation"],
                                              INVERSE[scene["relation"]], spec.captions_per_image, rng)


def caption_key(k: int, lang: str) -> str:
    """Key of caption ``k`` of an image in ``lang``: "3" in English (as before there were languages), "3.de"."""
    return str(k) if lang == "en" else f"{k}.{lang}"


def generate_captions_for(spec: SyntheticSpec, index: int) -> list[RawCaption]:
    """Captions of image ``index``, ``captions_per_image`` per language of ``spec.languages`` (in that order):
    paraphrases that name both focus groups with count, colour (sometimes size) and their relation, so every
    caption tells the image apart from its siblings."""
    scene = describe_scene(spec, index)
    out = []
    for lang in spec.languages:
        texts = _english_texts(spec, scene, index) if lang == "en" else _translated_texts(spec, scene, index, lang)
        for k, text in enumerate(texts):
            key = caption_key(k, lang)
            out.append(RawCaption(image_source_id=scene["source_id"], text=text, caption_key=key, lang=lang,
                                  split=scene["split"], locator=f"synthetic:{spec.collection}:{index}#{key}"))
    return out


def generate_captions(spec: SyntheticSpec, start: int = 0, stop: Optional[int] = None) -> Iterator[RawCaption]:
    """Captions of images ``start:stop`` (image order, then language, then caption key)."""
    stop = spec.num_images if stop is None else min(stop, spec.num_images)
    for i in range(max(start, 0), stop):
        yield from generate_captions_for(spec, i)

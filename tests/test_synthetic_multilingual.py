"""Synthetic captions in German, French and Czech: agreement (gender x number x case) against hand-written tables,
whole captions of chosen scenes, ids and image mapping per language, English output unchanged, determinism,
manifests (synthetic and the real Multi30k files) and staging of a mixed-language collection."""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipelines.stage.run import main as stage_main
from retrieval_core.data import readers
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.manifest_spec import ManifestError
from retrieval_core.data.schema import KIND_CAPTION, RawCaption
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic import translation
from retrieval_core.data.synthetic.captions import caption_key, generate_captions, generate_captions_for
from retrieval_core.data.synthetic.grammar import Group, Wording
from retrieval_core.data.synthetic.scenes import describe_scene
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.data.synthetic.vocabulary import COLOURS, DOMAINS, INVERSE, RELATION_WORDS, SIZES
from tests.conftest import require_realdata
from tests.test_stage_pipeline import tsv_row

G = Group
W = Wording
SINGLE, SIZE = W(single=True), W(size=True)


def _digest(captions) -> str:
    h = hashlib.sha256()
    for c in captions:
        h.update(json.dumps([c.image_source_id, c.caption_key, c.text, c.lang, c.split, c.locator]).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------ English stays as it was
# sha256 of every field of the captions, computed with the code before languages existed (commit 80519ab).
ENGLISH_BEFORE = {
    "coco": "408dc5f534ffd09e2ea8d86fce48bde5325c1c3570a8f2a9611e15d83d0f4c3a",
    "f30k": "7a72c40d8ca94872e9f17c1e6f4202209993f7756c7970424e091325b536584a",
    "cc": "c4e380a24f130f4293e2c497c63e4c538dbd44be1f5ff7a5b364753864a0ba74",
}
DEMO_400_BEFORE = "0595e6c626a9ba560ca0ddb8004dbf3d2cf860aada989e92f94a8bde85b59b46"


@pytest.mark.parametrize("domain", sorted(ENGLISH_BEFORE))
def test_english_captions_are_byte_identical_to_before_languages(domain):
    splits = {"train": 0.5, "test": 0.5}
    spec = SyntheticSpec("golden", 240, seed=7, domain=domain, feature_dim=8, splits=splits)
    assert spec.languages == ("en",)
    assert _digest(generate_captions(spec)) == ENGLISH_BEFORE[domain]
    # with other languages added, the English captions (ids, text, order among themselves) are the same
    multi = SyntheticSpec("golden", 240, seed=7, domain=domain, feature_dim=8, splits=splits,
                          languages=("de", "en", "cs", "fr"))
    assert _digest(c for c in generate_captions(multi) if c.lang == "en") == ENGLISH_BEFORE[domain]


def test_demo_manifest_captions_unchanged():
    spec = load_manifest("demo", env={}).synthetic_spec("demo")
    assert spec.languages == ("en",) and spec.num_captions == 25000
    assert _digest(generate_captions(spec, 0, 400)) == DEMO_400_BEFORE


# --------------------------------------------------------------------------------------- the lexicons
def test_every_language_has_words_for_every_class_colour_size_and_relation():
    classes = {d: [n.name for n in nouns] for d, nouns in DOMAINS.items()}
    assert translation.missing_words(classes, list(COLOURS), list(SIZES), list(RELATION_WORDS)) == []
    for lang, w in translation.WRITERS.items():
        for domain, templates in w.templates.items():
            assert len(templates) >= 3 and len(set(templates)) == len(templates), (lang, domain)
            for t in templates:  # every field of every template is one the writer knows
                groups = {"A": G("cube", "red", "small", 2, False), "B": G("cup", "blue", "large", 1, False),
                          "C": G("ball", "green", "small", 1, False)}
                fields = translation._Fields(lang, domain, np.random.default_rng(0), groups, "left of", "right of")
                t.format_map(fields)


# ------------------------------------------------------------------------- agreement: German
CUBE, CUP, BOOK = G("cube", "red", "small", 1, False), G("cup", "blue", "small", 1, False), \
    G("book", "green", "small", 1, False)
BOOKS, BALLS = G("book", "green", "small", 2, False), G("ball", "white", "large", 3, False)
BOY, TEDDY, PUPPY = G("boy", "yellow", "large", 1, True), G("teddy bear", "brown", "small", 1, False), \
    G("dog", "black", "small", 1, False)
PINK_CAR, ORANGE_CHAIRS = G("car", "pink", "large", 1, False), G("chair", "orange", "small", 2, False)
MEN = G("man", "red", "large", 2, True)

GERMAN = [  # (group, case, definite, wording, expected)
    (CUBE, "nom", False, W(), "ein roter Würfel"), (CUBE, "acc", False, W(), "einen roten Würfel"),
    (CUBE, "dat", False, W(), "einem roten Würfel"), (CUBE, "nom", True, W(), "der rote Würfel"),
    (CUBE, "acc", True, W(), "den roten Würfel"), (CUBE, "dat", True, W(), "dem roten Würfel"),
    (CUBE, "nom", False, SIZE, "ein kleiner roter Würfel"), (CUBE, "dat", False, SIZE, "einem kleinen roten Würfel"),
    (CUBE, "nom", False, SINGLE, "ein einzelner roter Würfel"),
    (CUBE, "nom", False, W(variant=1), "ein roter Klotz"),
    (CUP, "nom", False, W(), "eine blaue Tasse"), (CUP, "acc", False, W(), "eine blaue Tasse"),
    (CUP, "dat", False, W(), "einer blauen Tasse"), (CUP, "nom", True, W(), "die blaue Tasse"),
    (CUP, "dat", True, W(), "der blauen Tasse"), (CUP, "acc", False, W(variant=1), "einen blauen Becher"),
    (BOOK, "nom", False, W(), "ein grünes Buch"), (BOOK, "acc", False, W(), "ein grünes Buch"),
    (BOOK, "dat", False, W(), "einem grünen Buch"), (BOOK, "nom", True, W(), "das grüne Buch"),
    (BOOK, "dat", True, W(), "dem grünen Buch"), (BOOK, "acc", False, SINGLE, "ein einzelnes grünes Buch"),
    (BOOKS, "nom", False, W(), "zwei grüne Bücher"), (BOOKS, "acc", False, W(), "zwei grüne Bücher"),
    (BOOKS, "dat", False, W(), "zwei grünen Büchern"), (BOOKS, "nom", True, W(), "die grünen Bücher"),
    (BOOKS, "dat", True, W(), "den grünen Büchern"),
    (BALLS, "nom", False, SIZE, "drei große weiße Bälle"), (BALLS, "dat", False, SIZE, "drei großen weißen Bällen"),
    # weak nouns: -en outside the nominative singular
    (BOY, "nom", False, W(), "ein Junge in Gelb"), (BOY, "acc", False, W(), "einen Jungen in Gelb"),
    (BOY, "dat", True, W(), "dem Jungen in Gelb"), (TEDDY, "acc", False, W(), "einen braunen Teddybären"),
    (PUPPY, "dat", False, W(variant=1), "einem schwarzen Welpen"),
    # rosa does not decline, the size adjective before it does; orangefarben does
    (PINK_CAR, "nom", False, SIZE, "ein großes rosa Auto"), (PINK_CAR, "dat", False, W(), "einem rosa Auto"),
    (ORANGE_CHAIRS, "dat", False, W(), "zwei orangefarbenen Stühlen"),
    (MEN, "nom", False, W(), "zwei Männer in Rot"), (MEN, "dat", True, W(), "den Männern in Rot"),
]


@pytest.mark.parametrize("group,case,definite,wording,expected", GERMAN)
def test_german_agreement(group, case, definite, wording, expected):
    assert translation.noun_phrase("de", group, case, definite, wording) == expected


def test_german_prepositions_govern_the_dative_and_contract():
    assert translation.prepositional_phrase("de", "links von", "dat", CUBE, True) == "links vom roten Würfel"
    assert translation.prepositional_phrase("de", "links von", "dat", BOOK, True) == "links vom grünen Buch"
    assert translation.prepositional_phrase("de", "rechts von", "dat", CUP, True) == "rechts von der blauen Tasse"
    assert translation.prepositional_phrase("de", "links von", "dat", CUBE) == "links von einem roten Würfel"
    assert translation.prepositional_phrase("de", "neben", "dat", CUP) == "neben einer blauen Tasse"
    assert translation.prepositional_phrase("de", "über", "dat", BOOKS, True) == "über den grünen Büchern"
    assert translation.prepositional_phrase("de", "unter", "dat", MEN) == "unter zwei Männern in Rot"


# ------------------------------------------------------------------------- agreement: French
WHITE_CUP, WHITE_CUPS = G("cup", "white", "large", 1, False), G("cup", "white", "large", 2, False)
TREE, CUBES = G("tree", "green", "small", 1, False), G("cube", "red", "small", 2, False)
FRENCH = [  # (group, definite, wording, expected)
    (CUBE, False, W(), "un cube rouge"), (CUBE, True, W(), "le cube rouge"), (CUBE, False, SIZE, "un petit cube rouge"),
    (CUBE, False, SINGLE, "un seul cube rouge"), (CUBE, False, W(single=True, size=True), "un seul petit cube rouge"),
    (WHITE_CUP, False, SIZE, "une grande tasse blanche"), (WHITE_CUP, True, W(), "la tasse blanche"),
    (WHITE_CUP, False, SINGLE, "une seule tasse blanche"),
    (WHITE_CUPS, False, W(), "deux tasses blanches"), (WHITE_CUPS, False, SIZE, "deux grandes tasses blanches"),
    (WHITE_CUPS, True, W(), "les tasses blanches"), (CUBES, False, SIZE, "deux petits cubes rouges"),
    (TREE, True, W(), "l'arbre vert"), (TREE, False, W(), "un arbre vert"),
    (G("car", "orange", "small", 3, False), False, W(), "trois voitures orange"),  # orange, marron: invariable
    (G("dog", "brown", "small", 2, False), False, W(), "deux chiens marron"),
    (G("flower", "purple", "small", 1, False), False, W(), "une fleur violette"),
    (G("flower", "purple", "small", 2, False), False, W(), "deux fleurs violettes"),
    (G("cat", "grey", "small", 2, False), False, W(), "deux chats gris"),
    (G("chair", "grey", "small", 1, False), False, W(), "une chaise grise"),
    (G("horse", "black", "small", 2, False), False, W(), "deux chevaux noirs"),
    (G("teddy bear", "red", "small", 2, False), False, W(), "deux ours en peluche rouges"),
    (G("man", "blue", "small", 1, True), False, W(), "un homme en bleu"),
    (G("man", "blue", "small", 1, True), True, W(), "l'homme en bleu"),
    (G("woman", "purple", "small", 2, True), False, W(), "deux femmes en violet"),
]


@pytest.mark.parametrize("group,definite,wording,expected", FRENCH)
def test_french_agreement_and_placement(group, definite, wording, expected):
    assert translation.noun_phrase("fr", group, None, definite, wording) == expected


@pytest.mark.parametrize("prep,group,definite,expected", [
    ("à gauche de", CUBE, True, "à gauche du cube rouge"), ("à gauche de", CUBES, True, "à gauche des cubes rouges"),
    ("à droite de", WHITE_CUP, True, "à droite de la tasse blanche"),
    ("au-dessus de", TREE, True, "au-dessus de l'arbre vert"), ("à côté de", WHITE_CUP, False, "à côté d'une tasse "
                                                                                                 "blanche"),
    ("à côté de", CUBE, False, "à côté d'un cube rouge"), ("de", WHITE_CUPS, False, "de deux tasses blanches"),
    ("à", CUBE, True, "au cube rouge"), ("à", CUBES, True, "aux cubes rouges"), ("à", TREE, True, "à l'arbre vert"),
    ("à", WHITE_CUP, True, "à la tasse blanche"), ("sous", CUBE, False, "sous un cube rouge"),
    ("en dessous de", CUBES, True, "en dessous des cubes rouges"),
])
def test_french_contractions_and_elision(prep, group, definite, expected):
    assert translation.prepositional_phrase("fr", prep, None, group, definite) == expected


# -------------------------------------------------------------------------- agreement: Czech
DOG, DOGS = G("dog", "brown", "large", 1, False), G("dog", "brown", "large", 2, False)
BALL, BALLS2 = G("ball", "blue", "small", 1, False), G("ball", "blue", "small", 2, False)
CUBES3, CAR, CARS = G("cube", "red", "small", 3, False), G("car", "white", "small", 1, False), \
    G("car", "white", "small", 2, False)
CZECH = [  # (group, case, definite, wording, expected)
    # masculine animate: -í in the nominative plural (velcí, hnědí), genitive = accusative forms (psa)
    (DOG, "nom", False, W(), "hnědý pes"), (DOG, "gen", False, W(), "hnědého psa"), (DOG, "ins", False, W(),
                                                                                     "hnědým psem"),
    (DOG, "nom", False, SINGLE, "jeden hnědý pes"), (DOG, "gen", False, SINGLE, "jednoho hnědého psa"),
    (DOG, "ins", False, SINGLE, "jedním hnědým psem"),
    (DOGS, "nom", False, W(), "dva hnědí psi"), (DOGS, "gen", False, W(), "dvou hnědých psů"),
    (DOGS, "ins", False, W(), "dvěma hnědými psy"), (DOGS, "nom", False, SIZE, "dva velcí hnědí psi"),
    (DOGS, "nom", True, W(), "hnědí psi"),
    (G("kite", "white", "small", 2, False), "nom", False, W(), "dva bílí draci"),  # the toy kite is animate
    # masculine inanimate
    (BALL, "nom", False, W(), "modrý míč"), (BALL, "gen", False, W(), "modrého míče"),
    (BALL, "ins", False, W(), "modrým míčem"), (BALL, "nom", False, SINGLE, "jeden modrý míč"),
    (BALLS2, "nom", False, W(), "dva modré míče"), (BALLS2, "gen", False, W(), "dvou modrých míčů"),
    (BALLS2, "ins", False, W(), "dvěma modrými míči"),
    # feminine
    (CUBE, "nom", False, W(), "červená kostka"), (CUBE, "gen", False, W(), "červené kostky"),
    (CUBE, "ins", False, W(), "červenou kostkou"), (CUBE, "nom", False, SINGLE, "jedna červená kostka"),
    (CUBE, "gen", False, SINGLE, "jedné červené kostky"), (CUBE, "ins", False, SINGLE, "jednou červenou kostkou"),
    (CUBES3, "nom", False, W(), "tři červené kostky"), (CUBES3, "gen", False, W(), "tří červených kostek"),
    (CUBES3, "ins", False, W(), "třemi červenými kostkami"),
    (G("cube", "red", "small", 2, False), "nom", False, SIZE, "dvě malé červené kostky"),
    # neuter
    (CAR, "nom", False, W(), "bílé auto"), (CAR, "gen", False, W(), "bílého auta"), (CAR, "ins", False, W(),
                                                                                     "bílým autem"),
    (CAR, "nom", False, SINGLE, "jedno bílé auto"), (CARS, "nom", False, W(), "dvě bílá auta"),
    (CARS, "gen", False, W(), "dvou bílých aut"), (CARS, "ins", False, W(), "dvěma bílými auty"),
    # people: the colour is their clothing (v/ve + locative); dítě is neuter, děti agree as feminine
    (G("man", "yellow", "small", 2, True), "nom", False, W(), "dva muži ve žlutém"),
    (G("man", "yellow", "small", 2, True), "gen", False, W(), "dvou mužů ve žlutém"),
    (G("child", "purple", "small", 2, True), "nom", False, W(), "dvě děti ve fialovém"),
    (G("child", "purple", "small", 2, True), "ins", False, W(), "dvěma dětmi ve fialovém"),
    (G("child", "purple", "small", 1, True), "gen", False, SINGLE, "jednoho dítěte ve fialovém"),
    (G("woman", "grey", "small", 3, True), "gen", False, W(), "tří žen v šedém"),
]


@pytest.mark.parametrize("group,case,definite,wording,expected", CZECH)
def test_czech_agreement(group, case, definite, wording, expected):
    assert translation.noun_phrase("cs", group, case, definite, wording) == expected


def test_czech_prepositions_govern_their_case():
    assert translation.prepositional_phrase("cs", "vlevo od", "gen", CUBE, False, SINGLE) == \
        "vlevo od jedné červené kostky"
    assert translation.prepositional_phrase("cs", "nad", "ins", BALLS2) == "nad dvěma modrými míči"
    assert translation.prepositional_phrase("cs", "pod", "ins", DOG, True) == "pod hnědým psem"
    assert translation.prepositional_phrase("cs", "vedle", "gen", CARS) == "vedle dvou bílých aut"


# ---------------------------------------------------------------------- whole captions of chosen scenes
def _sentences(lang, domain, groups, relation, seed=0, n=None):
    w = translation.WRITERS[lang]
    n = n or len(w.templates[domain])
    return translation.write_captions(lang, domain, groups, relation, INVERSE[relation], n, np.random.default_rng(seed))


AGREEMENT = [  # (lang, group A, required in every caption, forbidden anywhere); B is one blue cup, A left of B
    ("de", G("dog", "brown", "large", 2, False), r"\b(Hunde|Hunden|Welpen)\b",
     r"\b(Hunde|Welpen) (ist|befindet)\b|\b(Becher|Tasse) (sind|befinden)\b|\bist zwei\b|\bHund\b"),
    ("fr", G("dog", "brown", "large", 2, False), r"(chiens|chiots) marron",
     r"marron (est|se trouve)\b|bleue (sont|se trouvent)\b|\bplacé\b|quant aux (chiens|chiots) marron, il\b"),
    ("fr", G("bottle", "green", "small", 3, False), r"bouteilles vertes",
     r"vertes (est|se trouve)\b|\bplacés?\b|\bplacée\b|quant aux bouteilles vertes, ils?\b"),
    ("fr", G("girl", "red", "small", 1, True), r"\b(une|la) (seule )?fille en rouge",
     r"rouge (sont|se trouvent)\b|\bplacé\b|quant à la fille en rouge, il\b"),
    ("cs", G("dog", "brown", "large", 2, False), r"\b(psi|psů)\b",
     r"psi (je|se nachází)\b|šálek (jsou|se nacházejí)\b|jsou jeden|\bpes\b"),
    ("cs", G("car", "white", "small", 3, False), r"\b(auta|aut)\b", r"auta (je|se nachází)\b|\bautem\b"),
]


@pytest.mark.parametrize("lang,group,required,forbidden", AGREEMENT)
def test_every_template_agrees_with_its_subject(lang, group, required, forbidden):
    """Verbs, pronouns and participles agree with their subject's number and gender in every template, whatever
    the draws (30 seeds), and the group is realised in a plural or singular form as its count says."""
    cup = G("cup", "blue", "small", 1, False)
    for domain in ("coco", "f30k", "cc"):
        for seed in range(30):
            for s in _sentences(lang, domain, [group, cup], "left of", seed):
                assert re.search(required, s, re.I) and not re.search(forbidden, s), (domain, s)


def test_french_pronoun_and_participle_agree_with_the_noun_they_refer_to():
    """ball is "une balle" or "un ballon": the participle agrees with the indefinite mention's noun, the pronoun
    after "quant à" with the definite mention's (the canonical balle)."""
    seen = Counter()
    for seed in range(60):
        for s in _sentences("fr", "coco", [G("ball", "red", "small", 1, False), CUP], "left of", seed):
            if "quant" in s:
                assert "quant à la balle rouge, elle est" in s, s
                seen["quant"] += 1
            m = re.search(r"^(Une|Un) (seule |seul )?(petite |petit )?(balle|ballon) rouge (placée|placé) ", s)
            if m:
                assert (m.group(4), m.group(5)) in (("balle", "placée"), ("ballon", "placé")), s
                seen[m.group(4)] += 1
    assert seen["quant"] and seen["balle"] and seen["ballon"], seen


CHOSEN = {  # (domain, groups, relation) -> {lang: expected captions (seed 0, one per template)}
    ("coco", (G("teddy bear", "brown", "large", 2, False), G("plate", "white", "small", 1, False),
              G("bottle", "green", "small", 1, False)), "left of"): {
        "de": [
            "Ein Foto von zwei braunen Teddybären links von einem weißen Teller auf einem Regal.",
            "Ein einzelner weißer Teller ist rechts neben zwei braunen Teddybären.",
            "Auf dem Bild sind zwei große braune Teddybären links neben einem kleinen weißen Teller.",
            "Zwei große braune Teddybären und ein einzelner weißer Teller; die braunen Teddybären sind links "
            "neben dem weißen Teller.",
            "Zwei große braune Teddybären sind links von einem kleinen weißen Teller.",
            "Es gibt zwei braune Teddybären links von einem weißen Teller auf dem Boden.",
        ],
        "fr": [
            "Une photo de deux ours en peluche marron à gauche d'une assiette blanche dans une cuisine.",
            "Une assiette blanche est à droite de deux ours en peluche marron dans une cuisine.",
            "Deux ours en peluche marron placés à gauche d'une seule petite assiette blanche.",
            "Deux grands ours en peluche marron et une seule petite assiette blanche dans un salon ; quant aux ours "
            "en peluche marron, ils sont à gauche de l'assiette blanche.",
            "Deux ours en peluche marron sont à gauche d'une petite assiette blanche dans une cuisine.",
            "Il y a deux ours en peluche marron à gauche d'une petite assiette blanche.",
        ],
        "cs": [
            "Dva hnědí medvídci a bílý talíř v kuchyni; hnědí medvídci jsou nalevo od bílého talíře.",
            "Jeden bílý talíř je napravo od dvou hnědých medvídků.",
            "Fotografie: dva velcí hnědí medvídci nalevo od malého bílého talíře.",
            "Nalevo od jednoho bílého talíře jsou dva hnědí medvídci, vedle zelené lahve.",
            "Dva velcí hnědí medvídci jsou vlevo od bílého talíře.",
            "Na fotografii jsou dva hnědí medvídci vlevo od bílého talíře v kuchyni.",
        ],
    },
}


@pytest.mark.parametrize("key", list(CHOSEN))
def test_chosen_scenes_whole_captions(key):
    domain, groups, relation = key
    for lang, expected in CHOSEN[key].items():
        assert _sentences(lang, domain, list(groups), relation) == expected, lang


# ------------------------------------------------------------------------------ ids, mapping, determinism
LANGS = ("en", "de", "fr", "cs")


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_ids_distinct_per_language_and_same_image_mapping(domain):
    spec = SyntheticSpec("multi", 40, seed=2, domain=domain, feature_dim=8, languages=LANGS, captions_per_image=3,
                         splits={"train": 0.5, "test": 0.5})
    caps = list(generate_captions(spec))
    assert len(caps) == spec.num_captions == 40 * 3 * 4
    keys = [(c.image_source_id, c.caption_key) for c in caps]
    assert len(set(keys)) == len(keys) and len({c.locator for c in caps}) == len(caps)
    for i in range(40):  # every language's captions point at the scene's image, in the scene's split
        scene = describe_scene(spec, i)
        per = generate_captions_for(spec, i)
        assert {(c.image_source_id, c.split) for c in per} == {(scene["source_id"], scene["split"])}
        assert [(c.lang, c.caption_key) for c in per] == [(lang, caption_key(k, lang)) for lang in LANGS
                                                          for k in range(3)]
        assert [c.caption_key for c in per][:4] == ["0", "1", "2", "0.de"]
        for lang in LANGS:  # paraphrases, not copies
            texts = [c.text for c in per if c.lang == lang]
            assert len(set(texts)) == len(texts)


def test_deterministic_and_independent_per_language():
    spec = SyntheticSpec("det", 24, seed=5, domain="f30k", feature_dim=8, languages=LANGS)
    forward = [c for i in range(24) for c in generate_captions_for(spec, i)]
    again = list(generate_captions(SyntheticSpec("det", 24, seed=5, domain="f30k", feature_dim=8, languages=LANGS)))
    split = list(generate_captions(spec, 0, 11)) + list(generate_captions(spec, 11, 24))
    assert forward == again == split
    # each language has its own random stream: dropping or reordering languages changes no language's captions
    alone = list(generate_captions(SyntheticSpec("det", 24, seed=5, domain="f30k", feature_dim=8,
                                                 languages=("cs", "de"))))
    assert [c for c in forward if c.lang in ("de", "cs")] == sorted(alone, key=lambda c: (
        int(c.image_source_id), c.lang != "de", c.caption_key))
    other_seed = list(generate_captions(SyntheticSpec("det", 24, seed=6, domain="f30k", feature_dim=8,
                                                      languages=LANGS)))
    assert [c.text for c in other_seed] != [c.text for c in forward]


def test_languages_option_is_validated():
    assert SyntheticSpec("c", 4, languages="de").languages == ("de",)
    assert SyntheticSpec.from_options("c", {"num_images": 4, "languages": ["en", "cs"]}, 8).languages == ("en", "cs")
    for bad in (("en", "xx"), ("de", "de"), ()):
        with pytest.raises(ValueError, match="languages must be distinct caption languages"):
            SyntheticSpec("c", 4, languages=bad)


# ------------------------------------------------------------------------------------------ manifests
def _manifest(tmp_path, captions: str, images_extra: str = "", name="m.yaml") -> str:
    images = f"{{format: synthetic, num_images: 12, seed: 1, domain: f30k, splits: {{train: 0.5, test: 0.5}}" \
             f"{images_extra}}}"
    text = f"""
feature_dim: 8
collections:
  syn:
    images: {images}
    captions: {captions}
"""
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_manifest_languages_option(tmp_path):
    m = load_manifest(_manifest(tmp_path, "{format: synthetic, captions_per_image: 2, languages: [en, de, fr, cs]}"),
                      env={})
    spec = m.synthetic_spec("syn")
    assert spec.languages == ("en", "de", "fr", "cs") and spec.num_captions == 12 * 2 * 4
    with pytest.raises(ManifestError, match=r"12 x 2 x 2 languages = 48"):
        load_manifest(_manifest(tmp_path, "{format: synthetic, captions_per_image: 2, languages: [en, de]}"),
                      ["syn.expected_captions=24"], env={})
    with pytest.raises(ManifestError, match="captions.languages: differs from images.languages"):
        load_manifest(_manifest(tmp_path, "{format: synthetic, languages: [de]}", ", languages: [fr]"), env={})
    with pytest.raises(ManifestError, match="languages must be distinct caption languages"):
        load_manifest(_manifest(tmp_path, "{format: synthetic, languages: [en, pt]}"), env={})
    with pytest.raises(ManifestError, match="take only captions_per_image and languages"):
        load_manifest(_manifest(tmp_path, "{format: synthetic, lang: de}"), env={})


def test_synthetic_multi30k_manifest():
    m = load_manifest("synthetic_multi30k", env={})
    spec = m.synthetic_spec("synthetic_multi30k")
    assert (spec.domain, spec.languages, spec.captions_per_image) == ("f30k", LANGS, 5)
    coll = m.collections["synthetic_multi30k"]
    assert (coll.expected_images, coll.expected_captions) == (6000, 120000) == (spec.num_images, spec.num_captions)
    first = {}
    for i in range(0, spec.num_images, spec.family_size):
        first.setdefault(describe_scene(spec, i)["split"], 0)
        first[describe_scene(spec, i)["split"]] += spec.family_size
    assert first == {"train": 4000, "dev": 1000, "test": 1000}
    seeds = {load_manifest(n, env={}).synthetic_spec(c).seed for n in ("demo", "synthetic_coco5k", "synthetic_f30k1k",
                                                                       "synthetic_cc14k", "synthetic_100k")
             for c in load_manifest(n, env={}).collections}
    assert spec.seed not in seeds  # unseen scenes


def test_real_multi30k_manifest_reads_german_french_and_czech_captions():
    """The shipped multi30k manifest over ../shared/realdata/multi30k (no region features there: the images'
    TSV is the user's; the caption side is read through the manifest's own caption source)."""
    root = require_realdata("multi30k", "data")
    m = load_manifest("multi30k", env={"RR_DATA_ROOT": str(root.parent.parent)})
    coll = m.collections["multi30k"]
    assert m.missing_paths() == [coll.images.path]  # the features are the user's
    got = [r for t in readers.plan_read_tasks("multi30k", KIND_CAPTION, coll.captions.format, coll.captions.path,
                                              coll.captions.options, m.feature_dim)
           for r in readers.read_task(t)]
    assert all(isinstance(r, RawCaption) and r.split == "test" for r in got)
    assert len(got) == coll.expected_captions == 7000
    assert Counter(r.lang for r in got) == {"de": 5000, "fr": 1000, "cs": 1000}
    per_image = defaultdict(Counter)
    for r in got:
        per_image[r.image_source_id][r.lang] += 1
    assert len(per_image) == coll.expected_images and all(v == {"de": 5, "fr": 1, "cs": 1} for v in per_image.values())
    keys = [(r.image_source_id, r.caption_key) for r in got]
    assert len(set(keys)) == 7000
    assert {r.caption_key for r in got} == {"1.de", "2.de", "3.de", "4.de", "5.de", "0.fr", "0.cs"}
    first = [r for r in got if r.image_source_id == "1007129816"]  # line 1 of the image list
    assert {r.lang: r.text for r in first if r.lang != "de"} == {
        "fr": "Un homme avec un chapeau orange regardant quelque chose.",
        "cs": "Muž v oranžovém klobouku na něco zírá."}


# -------------------------------------------------------------------------------------------- staging
def test_mixed_language_collection_stages_with_lang(tmp_path):
    manifest = _manifest(tmp_path, "{format: synthetic, captions_per_image: 2, languages: [en, de, fr, cs]}")
    out = tmp_path / "staged"
    result = CliRunner().invoke(stage_main, ["--manifest", manifest, "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "syn captions: 96 in = 96 staged + 0 rejected" in result.output
    table = pq.read_table(str(out / "captions")).to_pandas()
    assert len(table) == 96 and Counter(table["lang"]) == {"en": 24, "de": 24, "fr": 24, "cs": 24}
    assert table["caption_id"].is_unique and table["source_id"].is_unique
    spec = load_manifest(manifest, env={}).synthetic_spec("syn")
    want = {(f"{c.image_source_id}#{c.caption_key}", c.lang, c.text) for c in generate_captions(spec)}
    assert set(zip(table["source_id"], table["lang"], table["text"])) == want
    ds = StagedDataset(str(out))
    images = ds.images_meta("syn").set_index("source_id")["item_id"]
    for src, img in zip(table["source_id"], table["image_item_id"]):  # every language -> the same gold image
        assert img == images[src.split("#")[0]]
    per_image = table.groupby("image_item_id")["lang"].agg(lambda s: tuple(sorted(Counter(s).items())))
    assert set(per_image) == {(("cs", 2), ("de", 2), ("en", 2), ("fr", 2))}


def test_real_multi30k_stages_as_one_mixed_language_collection(tmp_path, monkeypatch):
    """pipelines.stage on the shipped multi30k manifest: the real caption files of ../shared/realdata, and (no
    features there) a bottom-up-attention TSV of random 8-d regions for the 1,000 images of the image list, as
    tests/test_walkthrough.py does for Flickr30k."""
    root = require_realdata("multi30k", "data")
    stems = [line.strip().rsplit(".", 1)[0] for line in
             (root / "task2" / "image_splits" / "test_2016_images.txt").read_text().splitlines() if line.strip()]
    (tmp_path / "f30k.tsv").write_text("\n".join(tsv_row(s, n=2, dim=8, seed=i) for i, s in enumerate(stems)) + "\n")
    monkeypatch.setenv("RR_DATA_ROOT", str(root.parent.parent))
    monkeypatch.setenv("F30K_FEATURES", str(tmp_path / "f30k.tsv"))
    out = tmp_path / "staged"
    result = CliRunner().invoke(stage_main, ["--manifest", "multi30k", "--output", str(out), "--set", "feature_dim=8"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "multi30k captions: 7000 in = 7000 staged + 0 rejected" in result.output
    table = pq.read_table(str(out / "captions")).to_pandas()
    assert Counter(table["lang"]) == {"de": 5000, "fr": 1000, "cs": 1000} and table["caption_id"].is_unique
    per_image = table.groupby("image_item_id")["lang"].agg(lambda s: tuple(sorted(Counter(s).items())))
    assert len(per_image) == 1000 and set(per_image) == {(("cs", 1), ("de", 5), ("fr", 1))}

"""French captions: the lexicon (every word form the templates need), the grammar tables and the
templates."""
from __future__ import annotations

from typing import Optional

from retrieval_core.data.synthetic.grammar import Group, Language, Wording, word_table

# Nouns: gender / singular / plural / "'" when le/la elide before it (l'arbre), else empty.
FR_NOUNS = word_table({
    "cup": "f/tasse/tasses/", "bottle": "f/bouteille/bouteilles/", "chair": "f/chaise/chaises/",
    "bowl": "m/bol/bols/", "book": "m/livre/livres/", "clock": "f/horloge/horloges/'", "vase": "m/vase/vases/",
    "laptop": "m/ordinateur portable/ordinateurs portables/'", "umbrella": "m/parapluie/parapluies/",
    "suitcase": ("f/valise/valises/", "m/sac/sacs/"), "teddy bear": "m/ours en peluche/ours en peluche/'",
    "ball": ("f/balle/balles/", "m/ballon/ballons/"), "bench": "m/banc/bancs/",
    "bicycle": ("m/vélo/vélos/", "f/bicyclette/bicyclettes/"), "car": "f/voiture/voitures/",
    "cat": ("m/chat/chats/", "m/chaton/chatons/"), "dog": ("m/chien/chiens/", "m/chiot/chiots/"),
    "kite": "m/cerf-volant/cerfs-volants/", "cube": ("m/cube/cubes/", "m/bloc/blocs/"),
    "plate": "f/assiette/assiettes/'", "lamp": "f/lampe/lampes/", "pillow": ("m/coussin/coussins/",
                                                                             "m/oreiller/oreillers/'"),
    "man": "m/homme/hommes/'", "woman": ("f/femme/femmes/", "f/dame/dames/"), "boy": "m/garçon/garçons/",
    "girl": "f/fille/filles/", "child": "m/enfant/enfants/'", "player": "m/joueur/joueurs/",
    "tent": "f/tente/tentes/", "boat": "m/bateau/bateaux/", "horse": "m/cheval/chevaux/",
    "guitar": "f/guitare/guitares/", "flag": "m/drapeau/drapeaux/", "sofa": "m/canapé/canapés/",
    "poster": ("f/affiche/affiches/'", "m/poster/posters/"), "sneaker": ("f/basket/baskets/",
                                                                          "f/chaussure/chaussures/"),
    "cake": "m/gâteau/gâteaux/", "building": ("m/bâtiment/bâtiments/", "m/immeuble/immeubles/'"),
    "dress": "f/robe/robes/", "mug": "m/mug/mugs/", "flower": "f/fleur/fleurs/", "balloon": "m/ballon/ballons/",
    "tree": "m/arbre/arbres/'", "bird": "m/oiseau/oiseaux/'", "model": "m/mannequin/mannequins/",
    "actor": "m/acteur/acteurs/'", "pumpkin": "f/citrouille/citrouilles/",
}, 4, "French noun")
# Adjectives: masculine singular / feminine singular / masculine plural / feminine plural.
FR_ADJ = word_table({
    "red": "rouge/rouge/rouges/rouges", "blue": "bleu/bleue/bleus/bleues", "green": "vert/verte/verts/vertes",
    "yellow": "jaune/jaune/jaunes/jaunes", "black": "noir/noire/noirs/noires",
    "white": "blanc/blanche/blancs/blanches", "orange": "orange/orange/orange/orange",
    "purple": "violet/violette/violets/violettes", "pink": "rose/rose/roses/roses",
    "brown": "marron/marron/marron/marron", "grey": "gris/grise/gris/grises",
    "small": "petit/petite/petits/petites", "large": "grand/grande/grands/grandes",  # before the noun
    "single": "seul/seule/seuls/seules",  # un seul, une seule
}, 4, "French adjective")
FR_WEAR = {c: FR_ADJ[c][0][0] for c in ("red", "blue", "green", "yellow", "black", "white", "orange", "purple",
                                         "pink", "brown", "grey")}  # "en rouge": the masculine singular
FR_DEFINITE = {"m": "le", "f": "la", "pl": "les", "elided": "l'"}
FR_ONE = {"m": "un", "f": "une"}
FR_NUMBERS = {2: "deux", 3: "trois"}
FR_CONTRACTIONS = {("de", "le"): "du", ("de", "les"): "des", ("à", "le"): "au", ("à", "les"): "aux"}
FR_ELIDING_PREPS = {"de": "d'"}  # before the vowel-initial determiners: d'un, d'une
FR_VOWEL_DETERMINERS = ("un", "une")
FR_RELATIONS = {
    "left of": (("à gauche de", None),), "right of": (("à droite de", None),),
    "above": (("au-dessus de", None),), "below": (("en dessous de", None), ("sous", None)),
}
FR_PREPS = {"de": None, "à": None, "à côté de": None}
FR_AGREE = {"be": ("est", "sont"), "trouve": ("se trouve", "se trouvent"),
            "pron": ("il", "elle", "ils", "elles"), "placed": ("placé", "placée", "placés", "placées")}
FR_SETTINGS = {
    "coco": ("", "", " sur une table", " dans une cuisine", " par terre", " dans un salon", " sur une étagère"),
    "f30k": ("", "", " dehors", " dans un parc", " dans la rue", " au bord de l'eau", " sur l'herbe"),
    "cc": (" par une journée ensoleillée", " dans un intérieur moderne", " sur fond blanc", " au festival",
           " en ville", " pendant les fêtes"),
}
FR_SCENES = ("la belle scène", "la scène rétro", "la scène colorée", "la scène minimaliste", "la scène chaleureuse",
             "la scène festive")
FR_EXTRAS = (", {à côté de+C}", ", avec {C} à proximité")
FR_TEMPLATES = {
    "coco": (
        "{A} {be_A} {rel+B}{set}.", "Il y a {A} {rel+B}{set}.", "{B} {be_B} {inv+A}{set}.",
        "Une photo {de+A} {rel+B}{set}.", "{A} et {B}{set} ; quant {à+tA}, {pron_tA} {be_A} {rel+tB}.",
        "{A} {placed_A} {rel+B}{extra}.",
    ),
    "f30k": (
        "{A} {be_A} {rel+B}{set}.", "{A} {trouve_A} {rel+B}{set}.", "{B} {be_B} {inv+A}{set}.",
        "{A} et {B}{set} ; {tA} {be_A} {rel+tB}.", "Il y a {A} {rel+B}{extra}.",
    ),
    "cc": (
        "photo libre de droits : {A} {rel+B}{set}{extra} .", "illustration {de+B} {inv+A}{set}{extra} .",
        "{scene} avec {A} {rel+B}{set} .",
    ),
}


def _french_np(g: Group, w: Wording, case: Optional[str], definite: bool) -> tuple[str, str]:
    gender, sing, plur, elides = FR_NOUNS[g.cls][w.variant]
    plural = g.count > 1
    form = 2 * plural + (gender == "f")
    pre = [FR_ADJ[g.size][0][form]] if w.size else []  # petit, grand: consonant-initial
    if definite:
        det = FR_DEFINITE["pl"] if plural else FR_DEFINITE["elided"] if elides and not pre else FR_DEFINITE[gender]
    elif not plural:
        det = FR_ONE[gender]
        pre = ([FR_ADJ["single"][0][form]] if w.single else []) + pre
    else:
        det = FR_NUMBERS[g.count]
    words = pre + [plur if plural else sing]
    words += ["en", FR_WEAR[g.colour]] if g.wears else [FR_ADJ[g.colour][0][form]]
    return det, " ".join(words)


def _french_phrase(det: str, rest: str) -> str:
    return f"{det}{rest}" if det.endswith("'") else f"{det} {rest}"


def _french_join(prep: str, det: str, rest: str) -> str:
    *head, last = prep.split()
    if (last, det) in FR_CONTRACTIONS:
        return " ".join(head + [FR_CONTRACTIONS[last, det], rest])
    if last in FR_ELIDING_PREPS and det in FR_VOWEL_DETERMINERS:
        return " ".join(head + [FR_ELIDING_PREPS[last] + det, rest])
    return " ".join(head + [last, _french_phrase(det, rest)])


WRITER = Language(nouns=FR_NOUNS, np=_french_np, join=_french_join, phrase=_french_phrase, subject_case=None,
                  relations=FR_RELATIONS, preps=FR_PREPS, agree=FR_AGREE, settings=FR_SETTINGS, scenes=FR_SCENES,
                  extras=FR_EXTRAS, templates=FR_TEMPLATES, adjectives=FR_ADJ, wear=FR_WEAR)

"""German, French and Czech captions of the synthetic scenes (``generator`` writes English).

Every caption states what the English ones state: both focus groups with count, colour (sometimes size), their
relation, sometimes a setting or a third group. Each language has a lexicon that writes out every word form its
templates need (no form is derived by a rule from another), and a grammar of small tables: which article, which
adjective form and which noun form a (case, number, gender) takes, and the contractions of a preposition with an
article. Templates are format strings whose fields name what they need: ``A_nom`` (focus group A, indefinite,
nominative), ``tB_dat`` (group B with a definite article, dative), ``rel+B`` / ``rel+tB`` / ``inv+A`` (the relation,
or its inverse, with the group in the case the preposition governs), ``de+A`` (a preposition of the language's
``PREPS``), ``be_A`` / ``pron_tA`` (a verb, participle or pronoun agreeing with that mention of A), ``set``,
``extra``, ``scene``. A field is realised only when the template uses it, and a group's wording (noun variant,
count word, size) is drawn once per caption.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

LANGUAGES = ("de", "fr", "cs")
_NP_FIELD = re.compile(r"^(t?)([ABC])(?:_([a-z]+))?$")
_PP_FIELD = re.compile(r"^(.+)\+(t?)([ABC])$")
_AGREE_FIELD = re.compile(r"^([a-z]+)_(t?)([ABC])$")


def _table(entries: dict, n_fields: int, what: str) -> dict:
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


# ============================================================================================== German
# Nouns: gender / singular nominative / accusative / dative / plural nominative (= accusative) / plural dative.
DE_NOUNS = _table({
    "cup": ("f/Tasse/Tasse/Tasse/Tassen/Tassen", "m/Becher/Becher/Becher/Becher/Bechern"),
    "bottle": "f/Flasche/Flasche/Flasche/Flaschen/Flaschen",
    "chair": "m/Stuhl/Stuhl/Stuhl/Stühle/Stühlen",
    "bowl": "f/Schüssel/Schüssel/Schüssel/Schüsseln/Schüsseln",
    "book": "n/Buch/Buch/Buch/Bücher/Büchern",
    "clock": "f/Uhr/Uhr/Uhr/Uhren/Uhren",
    "vase": "f/Vase/Vase/Vase/Vasen/Vasen",
    "laptop": ("m/Laptop/Laptop/Laptop/Laptops/Laptops", "m/Computer/Computer/Computer/Computer/Computern"),
    "umbrella": ("m/Regenschirm/Regenschirm/Regenschirm/Regenschirme/Regenschirmen",
                 "m/Schirm/Schirm/Schirm/Schirme/Schirmen"),
    "suitcase": ("m/Koffer/Koffer/Koffer/Koffer/Koffern", "f/Tasche/Tasche/Tasche/Taschen/Taschen"),
    "teddy bear": "m/Teddybär/Teddybären/Teddybären/Teddybären/Teddybären",  # weak noun: den/dem Teddybären
    "ball": "m/Ball/Ball/Ball/Bälle/Bällen",
    "bench": "f/Bank/Bank/Bank/Bänke/Bänken",
    "bicycle": ("n/Fahrrad/Fahrrad/Fahrrad/Fahrräder/Fahrrädern", "n/Rad/Rad/Rad/Räder/Rädern"),
    "car": ("n/Auto/Auto/Auto/Autos/Autos", "m/Wagen/Wagen/Wagen/Wagen/Wagen"),
    "cat": ("f/Katze/Katze/Katze/Katzen/Katzen", "n/Kätzchen/Kätzchen/Kätzchen/Kätzchen/Kätzchen"),
    "dog": ("m/Hund/Hund/Hund/Hunde/Hunden", "m/Welpe/Welpen/Welpen/Welpen/Welpen"),  # Welpe: weak noun
    "kite": "m/Drachen/Drachen/Drachen/Drachen/Drachen",
    "cube": ("m/Würfel/Würfel/Würfel/Würfel/Würfeln", "m/Klotz/Klotz/Klotz/Klötze/Klötzen"),
    "plate": "m/Teller/Teller/Teller/Teller/Tellern",
    "lamp": "f/Lampe/Lampe/Lampe/Lampen/Lampen",
    "pillow": "n/Kissen/Kissen/Kissen/Kissen/Kissen",
    "man": "m/Mann/Mann/Mann/Männer/Männern",
    "woman": ("f/Frau/Frau/Frau/Frauen/Frauen", "f/Dame/Dame/Dame/Damen/Damen"),
    "boy": "m/Junge/Jungen/Jungen/Jungen/Jungen",  # weak noun
    "girl": "n/Mädchen/Mädchen/Mädchen/Mädchen/Mädchen",
    "child": "n/Kind/Kind/Kind/Kinder/Kindern",
    "player": "m/Spieler/Spieler/Spieler/Spieler/Spielern",
    "tent": "n/Zelt/Zelt/Zelt/Zelte/Zelten",
    "boat": "n/Boot/Boot/Boot/Boote/Booten",
    "horse": "n/Pferd/Pferd/Pferd/Pferde/Pferden",
    "guitar": "f/Gitarre/Gitarre/Gitarre/Gitarren/Gitarren",
    "flag": ("f/Fahne/Fahne/Fahne/Fahnen/Fahnen", "f/Flagge/Flagge/Flagge/Flaggen/Flaggen"),
    "sofa": "n/Sofa/Sofa/Sofa/Sofas/Sofas",
    "poster": "n/Poster/Poster/Poster/Poster/Postern",
    "sneaker": ("m/Turnschuh/Turnschuh/Turnschuh/Turnschuhe/Turnschuhen", "m/Schuh/Schuh/Schuh/Schuhe/Schuhen"),
    "cake": ("m/Kuchen/Kuchen/Kuchen/Kuchen/Kuchen", "f/Torte/Torte/Torte/Torten/Torten"),
    "building": "n/Gebäude/Gebäude/Gebäude/Gebäude/Gebäuden",
    "dress": "n/Kleid/Kleid/Kleid/Kleider/Kleidern",
    "mug": "m/Becher/Becher/Becher/Becher/Bechern",
    "flower": "f/Blume/Blume/Blume/Blumen/Blumen",
    "balloon": "m/Luftballon/Luftballon/Luftballon/Luftballons/Luftballons",
    "tree": "m/Baum/Baum/Baum/Bäume/Bäumen",
    "bird": "m/Vogel/Vogel/Vogel/Vögel/Vögeln",
    "model": "n/Model/Model/Model/Models/Models",
    "actor": "m/Schauspieler/Schauspieler/Schauspieler/Schauspieler/Schauspielern",
    "pumpkin": "m/Kürbis/Kürbis/Kürbis/Kürbisse/Kürbissen",
}, 6, "German noun")
# Adjectives: the forms ending in -e / -er / -es / -en (rosa is indeclinable: four equal forms).
DE_ADJ = _table({
    "red": "rote/roter/rotes/roten", "blue": "blaue/blauer/blaues/blauen", "green": "grüne/grüner/grünes/grünen",
    "yellow": "gelbe/gelber/gelbes/gelben", "black": "schwarze/schwarzer/schwarzes/schwarzen",
    "white": "weiße/weißer/weißes/weißen",
    "orange": "orangefarbene/orangefarbener/orangefarbenes/orangefarbenen",
    "purple": "violette/violetter/violettes/violetten", "pink": "rosa/rosa/rosa/rosa",
    "brown": "braune/brauner/braunes/braunen", "grey": "graue/grauer/graues/grauen",
    "small": "kleine/kleiner/kleines/kleinen", "large": "große/großer/großes/großen",
    "single": "einzelne/einzelner/einzelnes/einzelnen",
}, 4, "German adjective")
DE_WEAR = {"red": "Rot", "blue": "Blau", "green": "Grün", "yellow": "Gelb", "black": "Schwarz", "white": "Weiß",
           "orange": "Orange", "purple": "Violett", "pink": "Rosa", "brown": "Braun", "grey": "Grau"}
_E, _ER, _ES, _EN = range(4)
DE_DEFINITE = {"nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
               "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
               "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"}}
DE_EIN = {"nom": {"m": "ein", "f": "eine", "n": "ein"}, "acc": {"m": "einen", "f": "eine", "n": "ein"},
          "dat": {"m": "einem", "f": "einer", "n": "einem"}}
DE_NUMBERS = {2: "zwei", 3: "drei"}
# Adjective ending after der/die/das (weak), after ein (mixed), and after a numeral with no article (strong plural).
DE_WEAK = {"nom": {"m": _E, "f": _E, "n": _E, "pl": _EN}, "acc": {"m": _EN, "f": _E, "n": _E, "pl": _EN},
           "dat": {"m": _EN, "f": _EN, "n": _EN, "pl": _EN}}
DE_MIXED = {"nom": {"m": _ER, "f": _E, "n": _ES}, "acc": {"m": _EN, "f": _E, "n": _ES},
            "dat": {"m": _EN, "f": _EN, "n": _EN}}
DE_STRONG_PLURAL = {"nom": _E, "acc": _E, "dat": _EN}
DE_NOUN_FORM = {("sg", "nom"): 1, ("sg", "acc"): 2, ("sg", "dat"): 3, ("pl", "nom"): 4, ("pl", "acc"): 4,
                ("pl", "dat"): 5}
DE_CONTRACTIONS = {("von", "dem"): "vom"}  # "links vom roten Würfel"
DE_RELATIONS = {
    "left of": (("links von", "dat"), ("links neben", "dat")),
    "right of": (("rechts von", "dat"), ("rechts neben", "dat")),
    "above": (("über", "dat"),),  # oberhalb/unterhalb take the genitive, which no template needs
    "below": (("unter", "dat"),),
}
DE_PREPS = {"von": "dat", "mit": "dat", "neben": "dat"}
DE_AGREE = {"be": ("ist", "sind"), "bef": ("befindet sich", "befinden sich")}
DE_SETTINGS = {
    "coco": ("", "", " auf einem Tisch", " in einer Küche", " auf dem Boden", " in einem Wohnzimmer",
             " auf einem Regal"),
    "f30k": ("", "", " im Freien", " in einem Park", " auf der Straße", " am Wasser", " auf dem Rasen"),
    "cc": (" an einem sonnigen Tag", " in einem modernen Interieur", " vor weißem Hintergrund", " auf dem Festival",
           " in der Stadt", " an den Feiertagen"),
}
DE_SCENES = ("die schöne Szene", "die nostalgische Szene", "die farbenfrohe Szene", "die minimalistische Szene",
             "die gemütliche Szene", "die festliche Szene")
DE_EXTRAS = (", {neben+C}", "; in der Nähe {be_C} {C_nom}")
DE_TEMPLATES = {
    "coco": (
        "{A_nom} {be_A} {rel+B}{set}.", "Es gibt {A_acc} {rel+B}{set}.", "{B_nom} {be_B} {inv+A}{set}.",
        "Ein Foto {von+A} {rel+B}{set}.", "{A_nom} und {B_nom}{set}; {tA_nom} {be_A} {rel+tB}.",
        "Auf dem Bild {be_A} {A_nom} {rel+B}{extra}.",
    ),
    "f30k": (
        "{A_nom} {be_A} {rel+B}{set}.", "{A_nom} {bef_A} {rel+B}{set}.", "{B_nom} {be_B} {inv+A}{set}.",
        "{A_nom} und {B_nom}{set}; {tA_nom} {be_A} {rel+tB}.", "Es gibt {A_acc} {rel+B}{extra}.",
    ),
    "cc": (
        "Stockfoto : {A_nom} {rel+B}{set}{extra} .", "Illustration {von+B} {inv+A}{set}{extra} .",
        "{scene} {mit+A} {rel+B}{set} .",
    ),
}


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


def _german_np(g: Group, w: Wording, case: str, definite: bool) -> tuple[str, str]:
    gender, *forms = DE_NOUNS[g.cls][w.variant]
    number = "pl" if g.count > 1 else "sg"
    adjs, key = [], gender if number == "sg" else "pl"
    if definite:
        det, ending = DE_DEFINITE[case][key], DE_WEAK[case][key]
    elif number == "sg":
        det, ending = DE_EIN[case][gender], DE_MIXED[case][gender]
        adjs += ["single"] if w.single else []
    else:
        det, ending = DE_NUMBERS[g.count], DE_STRONG_PLURAL[case]
    adjs += ([g.size] if w.size else []) + ([] if g.wears else [g.colour])
    words = [DE_ADJ[a][0][ending] for a in adjs] + [forms[DE_NOUN_FORM[number, case] - 1]]
    if g.wears:
        words += ["in", DE_WEAR[g.colour]]
    return det, " ".join(words)


def _german_join(prep: str, det: str, rest: str) -> str:
    *head, last = prep.split()
    if (last, det) in DE_CONTRACTIONS:
        return " ".join(head + [DE_CONTRACTIONS[last, det], rest])
    return " ".join(head + [last, det, rest])


# ============================================================================================== French
# Nouns: gender / singular / plural / "'" when le/la elide before it (l'arbre), else empty.
FR_NOUNS = _table({
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
FR_ADJ = _table({
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


# =============================================================================================== Czech
# Nouns: gender (ma = masculine animate, mi = inanimate, f, n; "n>f": neuter singular, feminine plural) /
# singular nominative / genitive / instrumental / plural nominative / genitive / instrumental.
CS_NOUNS = _table({
    "cup": "mi/šálek/šálku/šálkem/šálky/šálků/šálky", "bottle": "f/lahev/lahve/lahví/lahve/lahví/lahvemi",
    "chair": "f/židle/židle/židlí/židle/židlí/židlemi", "bowl": "f/miska/misky/miskou/misky/misek/miskami",
    "book": "f/kniha/knihy/knihou/knihy/knih/knihami",
    "clock": "mi/budík/budíku/budíkem/budíky/budíků/budíky",  # hodiny is plural-only: an alarm clock instead
    "vase": "f/váza/vázy/vázou/vázy/váz/vázami",
    "laptop": "mi/notebook/notebooku/notebookem/notebooky/notebooků/notebooky",
    "umbrella": "mi/deštník/deštníku/deštníkem/deštníky/deštníků/deštníky",
    "suitcase": "mi/kufr/kufru/kufrem/kufry/kufrů/kufry",
    "teddy bear": "ma/medvídek/medvídka/medvídkem/medvídci/medvídků/medvídky",
    "ball": "mi/míč/míče/míčem/míče/míčů/míči", "bench": "f/lavička/lavičky/lavičkou/lavičky/laviček/lavičkami",
    "bicycle": "n/kolo/kola/kolem/kola/kol/koly", "car": "n/auto/auta/autem/auta/aut/auty",
    "cat": "f/kočka/kočky/kočkou/kočky/koček/kočkami", "dog": "ma/pes/psa/psem/psi/psů/psy",
    "kite": "ma/drak/draka/drakem/draci/draků/draky",  # the toy kite declines as animate (papíroví draci)
    "cube": "f/kostka/kostky/kostkou/kostky/kostek/kostkami",
    "plate": "mi/talíř/talíře/talířem/talíře/talířů/talíři", "lamp": "f/lampa/lampy/lampou/lampy/lamp/lampami",
    "pillow": "mi/polštář/polštáře/polštářem/polštáře/polštářů/polštáři",
    "man": "ma/muž/muže/mužem/muži/mužů/muži", "woman": "f/žena/ženy/ženou/ženy/žen/ženami",
    "boy": "ma/chlapec/chlapce/chlapcem/chlapci/chlapců/chlapci",
    "girl": "f/dívka/dívky/dívkou/dívky/dívek/dívkami", "child": "n>f/dítě/dítěte/dítětem/děti/dětí/dětmi",
    "player": "ma/hráč/hráče/hráčem/hráči/hráčů/hráči", "tent": "mi/stan/stanu/stanem/stany/stanů/stany",
    "boat": "mi/člun/člunu/člunem/čluny/člunů/čluny", "horse": "ma/kůň/koně/koněm/koně/koní/koňmi",
    "guitar": "f/kytara/kytary/kytarou/kytary/kytar/kytarami",
    "flag": "f/vlajka/vlajky/vlajkou/vlajky/vlajek/vlajkami",
    "sofa": ("f/pohovka/pohovky/pohovkou/pohovky/pohovek/pohovkami", "mi/gauč/gauče/gaučem/gauče/gaučů/gauči"),
    "poster": "mi/plakát/plakátu/plakátem/plakáty/plakátů/plakáty",
    "sneaker": ("f/teniska/tenisky/teniskou/tenisky/tenisek/teniskami", "f/bota/boty/botou/boty/bot/botami"),
    "cake": "mi/dort/dortu/dortem/dorty/dortů/dorty", "building": "f/budova/budovy/budovou/budovy/budov/budovami",
    "dress": "f/róba/róby/róbou/róby/rób/róbami",  # šaty is plural-only
    "mug": "mi/hrnek/hrnku/hrnkem/hrnky/hrnků/hrnky",
    "flower": "f/květina/květiny/květinou/květiny/květin/květinami",
    "balloon": "mi/balónek/balónku/balónkem/balónky/balónků/balónky",
    "tree": "mi/strom/stromu/stromem/stromy/stromů/stromy", "bird": "ma/pták/ptáka/ptákem/ptáci/ptáků/ptáky",
    "model": "f/modelka/modelky/modelkou/modelky/modelek/modelkami",
    "actor": "ma/herec/herce/hercem/herci/herců/herci", "pumpkin": "f/dýně/dýně/dýní/dýně/dýní/dýněmi",
}, 7, "Czech noun")
# Adjectives (all hard -ý): -ý / -á / -é / -ého / -ou / -ým / nominative plural masculine animate / -ých / -ými.
CS_ADJ = _table({
    "red": "červený/červená/červené/červeného/červenou/červeným/červení/červených/červenými",
    "blue": "modrý/modrá/modré/modrého/modrou/modrým/modří/modrých/modrými",
    "green": "zelený/zelená/zelené/zeleného/zelenou/zeleným/zelení/zelených/zelenými",
    "yellow": "žlutý/žlutá/žluté/žlutého/žlutou/žlutým/žlutí/žlutých/žlutými",
    "black": "černý/černá/černé/černého/černou/černým/černí/černých/černými",
    "white": "bílý/bílá/bílé/bílého/bílou/bílým/bílí/bílých/bílými",
    "orange": "oranžový/oranžová/oranžové/oranžového/oranžovou/oranžovým/oranžoví/oranžových/oranžovými",
    "purple": "fialový/fialová/fialové/fialového/fialovou/fialovým/fialoví/fialových/fialovými",
    "pink": "růžový/růžová/růžové/růžového/růžovou/růžovým/růžoví/růžových/růžovými",
    "brown": "hnědý/hnědá/hnědé/hnědého/hnědou/hnědým/hnědí/hnědých/hnědými",
    "grey": "šedý/šedá/šedé/šedého/šedou/šedým/šedí/šedých/šedými",
    "small": "malý/malá/malé/malého/malou/malým/malí/malých/malými",
    "large": "velký/velká/velké/velkého/velkou/velkým/velcí/velkých/velkými",
}, 9, "Czech adjective")
# "v červeném" (in red clothes): v + locative; ve before ž and f (ve žlutém, ve fialovém).
CS_WEAR = {"red": "v červeném", "blue": "v modrém", "green": "v zeleném", "yellow": "ve žlutém",
           "black": "v černém", "white": "v bílém", "orange": "v oranžovém", "purple": "ve fialovém",
           "pink": "v růžovém", "brown": "v hnědém", "grey": "v šedém"}
_Y, _A, _EE, _EHO, _OU, _YM, _I_ANIM, _YCH, _YMI = range(9)
CS_ADJ_FORM = {  # (number, case) -> gender -> adjective form
    ("sg", "nom"): {"ma": _Y, "mi": _Y, "f": _A, "n": _EE},
    ("sg", "gen"): {"ma": _EHO, "mi": _EHO, "f": _EE, "n": _EHO},
    ("sg", "ins"): {"ma": _YM, "mi": _YM, "f": _OU, "n": _YM},
    ("pl", "nom"): {"ma": _I_ANIM, "mi": _EE, "f": _EE, "n": _A},
    ("pl", "gen"): {"ma": _YCH, "mi": _YCH, "f": _YCH, "n": _YCH},
    ("pl", "ins"): {"ma": _YMI, "mi": _YMI, "f": _YMI, "n": _YMI},
}
CS_NOUN_FORM = {("sg", "nom"): 1, ("sg", "gen"): 2, ("sg", "ins"): 3, ("pl", "nom"): 4, ("pl", "gen"): 5,
                ("pl", "ins"): 6}
CS_NUMERALS = {  # count -> case -> gender -> numeral
    1: {"nom": {"ma": "jeden", "mi": "jeden", "f": "jedna", "n": "jedno"},
        "gen": {"ma": "jednoho", "mi": "jednoho", "f": "jedné", "n": "jednoho"},
        "ins": {"ma": "jedním", "mi": "jedním", "f": "jednou", "n": "jedním"}},
    2: {"nom": {"ma": "dva", "mi": "dva", "f": "dvě", "n": "dvě"},
        "gen": dict.fromkeys(("ma", "mi", "f", "n"), "dvou"), "ins": dict.fromkeys(("ma", "mi", "f", "n"), "dvěma")},
    3: {"nom": dict.fromkeys(("ma", "mi", "f", "n"), "tři"), "gen": dict.fromkeys(("ma", "mi", "f", "n"), "tří"),
        "ins": dict.fromkeys(("ma", "mi", "f", "n"), "třemi")},
}
CS_RELATIONS = {
    "left of": (("vlevo od", "gen"), ("nalevo od", "gen")), "right of": (("vpravo od", "gen"), ("napravo od", "gen")),
    "above": (("nad", "ins"),), "below": (("pod", "ins"),),
}
CS_PREPS = {"vedle": "gen"}
CS_AGREE = {"be": ("je", "jsou"), "nach": ("se nachází", "se nacházejí")}
CS_SETTINGS = {
    "coco": ("", "", " na stole", " v kuchyni", " na podlaze", " v obývacím pokoji", " na polici"),
    "f30k": ("", "", " venku", " v parku", " na ulici", " u vody", " na trávě"),
    "cc": (" za slunečného dne", " v moderním interiéru", " na bílém pozadí", " na festivalu", " ve městě",
           " o svátcích"),
}
CS_SCENES = ("krásná scéna", "retro scéna", "barevná scéna", "minimalistická scéna", "útulná scéna",
             "sváteční scéna")
CS_EXTRAS = (", {vedle+C}", "; poblíž {be_C} {C_nom}")
CS_TEMPLATES = {
    "coco": (
        "{A_nom} {be_A} {rel+B}{set}.", "Na fotografii {be_A} {A_nom} {rel+B}{set}.", "{B_nom} {be_B} {inv+A}{set}.",
        "{A_nom} a {B_nom}{set}; {tA_nom} {be_A} {rel+tB}.", "{rel+B} {be_A} {A_nom}{extra}.",
        "Fotografie: {A_nom} {rel+B}{extra}.",
    ),
    "f30k": (
        "{A_nom} {be_A} {rel+B}{set}.", "{A_nom} {nach_A} {rel+B}{set}.", "{B_nom} {be_B} {inv+A}{set}.",
        "{A_nom} a {B_nom}{set}; {tA_nom} {be_A} {rel+tB}.", "Na fotografii {be_A} {A_nom} {rel+B}{extra}.",
    ),
    "cc": (
        "ilustrační foto : {A_nom} {rel+B}{set}{extra} .", "ilustrace : {B_nom} {inv+A}{set}{extra} .",
        "{scene} : {A_nom} {rel+B}{set} .",
    ),
}


def _czech_np(g: Group, w: Wording, case: str, definite: bool) -> tuple[str, str]:
    gender, *forms = CS_NOUNS[g.cls][w.variant]
    number = "pl" if g.count > 1 else "sg"
    agree = gender.split(">")[-1] if number == "pl" else gender.split(">")[0]  # dítě (n) -> děti (f)
    if definite or (g.count == 1 and not w.single):  # Czech has no articles: "a cube" is bare
        det = ""
    else:
        det = CS_NUMERALS[g.count][case][agree]
    slot = CS_ADJ_FORM[number, case][agree]
    adjs = ([g.size] if w.size else []) + ([] if g.wears else [g.colour])
    words = [CS_ADJ[a][0][slot] for a in adjs] + [forms[CS_NOUN_FORM[number, case] - 1]]
    if g.wears:
        words.append(CS_WEAR[g.colour])
    return det, " ".join(words)


def _czech_join(prep: str, det: str, rest: str) -> str:
    return " ".join(p for p in (prep, det, rest) if p)


# ============================================================================================ writers
@dataclass(frozen=True)
class _Language:
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


def _plain_phrase(det: str, rest: str) -> str:
    return f"{det} {rest}" if det else rest


WRITERS = {
    "de": _Language(DE_NOUNS, _german_np, _german_join, _plain_phrase, "nom", DE_RELATIONS, DE_PREPS, DE_AGREE,
                    DE_SETTINGS, DE_SCENES, DE_EXTRAS, DE_TEMPLATES, DE_ADJ, DE_WEAR),
    "fr": _Language(FR_NOUNS, _french_np, _french_join, _french_phrase, None, FR_RELATIONS, FR_PREPS, FR_AGREE,
                    FR_SETTINGS, FR_SCENES, FR_EXTRAS, FR_TEMPLATES, FR_ADJ, FR_WEAR),
    "cs": _Language(CS_NOUNS, _czech_np, _czech_join, _plain_phrase, "nom", CS_RELATIONS, CS_PREPS, CS_AGREE,
                    CS_SETTINGS, CS_SCENES, CS_EXTRAS, CS_TEMPLATES, CS_ADJ, CS_WEAR),
}


def noun_phrase(lang: str, group: Group, case: Optional[str] = None, definite: bool = False,
                wording: Wording = Wording()) -> str:
    """``group`` in ``lang``: "einem großen roten Würfel" (de, dat), "l'arbre vert" (fr, definite), "dva psi"."""
    w = WRITERS[lang]
    return w.phrase(*w.np(group, wording, case or w.subject_case, definite))


def prepositional_phrase(lang: str, prep: str, case: Optional[str], group: Group, definite: bool = False,
                         wording: Wording = Wording()) -> str:
    """``prep`` with ``group`` in ``case``, contracted where the language contracts: "links vom roten Würfel",
    "à gauche d'une balle bleue", "quant aux cubes rouges" (French: case None), "nad dvěma modrými míči"."""
    w = WRITERS[lang]
    return w.join(prep, *w.np(group, wording, case or w.subject_case, definite))


class _Fields(dict):
    """The values of one caption's template fields, realised on first use (str.format_map asks in template order)."""

    def __init__(self, lang: str, domain: str, rng, groups: dict, relation: str, inverse: str):
        super().__init__()
        self.lang, self.w, self.domain, self.rng = lang, WRITERS[lang], domain, rng
        self.groups, self.relation, self.inverse = groups, relation, inverse
        self.wordings: dict = {}

    def wording(self, letter: str, definite: bool) -> Wording:
        key = (letter, definite)
        if key not in self.wordings:
            g = self.groups[letter]
            if definite:  # "the red cube": the canonical noun, no size, no count word
                self.wordings[key] = Wording()
            else:
                variant = int(self.rng.integers(len(self.w.nouns[g.cls])))
                # count 1: "a" / "one" / "a single" as in English; the first two are one wording here
                single = g.count == 1 and int(self.rng.integers(3)) == 2
                # size as in English: sometimes for the focus pair, never for people (their colour is clothing)
                size = letter != "C" and bool(self.rng.random() < 0.35) and not g.wears
                self.wordings[key] = Wording(variant, single, size)
        return self.wordings[key]

    def __missing__(self, key: str) -> str:
        self[key] = value = self._realise(key)
        return value

    def _realise(self, key: str) -> str:
        w = self.w
        if key == "set":
            options = w.settings[self.domain]
            return options[int(self.rng.integers(len(options)))]
        if key == "scene":
            return w.scenes[int(self.rng.integers(len(w.scenes)))]
        if key == "extra":
            if "C" not in self.groups or self.rng.random() >= 0.6:
                return ""
            return w.extras[int(self.rng.integers(len(w.extras)))].format_map(self)
        m = _NP_FIELD.match(key)
        if m:
            definite, letter, case = bool(m.group(1)), m.group(2), m.group(3) or w.subject_case
            return noun_phrase(self.lang, self.groups[letter], case, definite, self.wording(letter, definite))
        m = _PP_FIELD.match(key)
        if m:
            prep, definite, letter = m.group(1), bool(m.group(2)), m.group(3)
            if prep in ("rel", "inv"):
                variants = w.relations[self.relation if prep == "rel" else self.inverse]
                prep, case = variants[int(self.rng.integers(len(variants)))]
            else:
                case = w.preps[prep]
            return prepositional_phrase(self.lang, prep, case, self.groups[letter], definite,
                                        self.wording(letter, definite))
        m = _AGREE_FIELD.match(key)
        if m:
            forms, g = w.agree[m.group(1)], self.groups[m.group(3)]
            plural = g.count > 1
            if len(forms) == 2:
                return forms[plural]
            # French gender: that of the noun the word refers to ("pron_tA": the definite mention's, which is the
            # canonical noun and may differ from the indefinite mention's variant: un ballon ... la balle, elle)
            gender = w.nouns[g.cls][self.wording(m.group(3), bool(m.group(2))).variant][0]
            return forms[2 * plural + (gender == "f")]
        raise KeyError(f"{self.lang} template field {key!r} is not known")


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def write_captions(lang: str, domain: str, groups: list[Group], relation: str, inverse: str, n: int, rng
                   ) -> list[str]:
    """``n`` captions in ``lang`` of a scene whose focus pair is ``groups[0:2]`` in ``relation`` (``inverse``: the
    relation seen from group 1); ``groups[2:]`` may be named as a third group. Templates are drawn without
    repetition while there are enough (a permutation, as in English)."""
    w = WRITERS[lang]
    templates = w.templates[domain]
    picks = rng.permutation(len(templates))
    out = []
    for k in range(n):
        named = {"A": groups[0], "B": groups[1]}
        if len(groups) > 2:
            named["C"] = groups[2 + int(rng.integers(len(groups) - 2))]
        fields = _Fields(lang, domain, rng, named, relation, inverse)
        text = templates[int(picks[k % len(picks)])].format_map(fields)
        out.append(text if domain == "cc" else _cap(text))
    return out


def missing_words(classes: dict, colours: list, sizes: list, relations: list) -> list[str]:
    """What some language has no words for, [] when complete: ``classes`` {domain: class names}, the colour, size
    and relation keys."""
    missing = []
    for lang, w in WRITERS.items():
        for domain, names in classes.items():
            missing += [f"{lang}: noun {c!r}" for c in names if c not in w.nouns]
            missing += [f"{lang}: {what} of domain {domain!r}" for what, table in
                        (("settings", w.settings), ("templates", w.templates)) if domain not in table]
        missing += [f"{lang}: adjective {a!r}" for a in list(colours) + list(sizes) if a not in w.adjectives]
        missing += [f"{lang}: clothing colour {c!r}" for c in colours if c not in w.wear]
        missing += [f"{lang}: relation {r!r}" for r in relations if r not in w.relations]
    return missing

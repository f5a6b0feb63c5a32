"""German captions: the lexicon (every word form the templates need), the grammar tables and the
templates."""
from __future__ import annotations

from retrieval_core.data.synthetic.grammar import Group, Language, Wording, plain_phrase, word_table

# Nouns: gender / singular nominative / accusative / dative / plural nominative (= accusative) / plural dative.
DE_NOUNS = word_table({
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
DE_ADJ = word_table({
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


WRITER = Language(nouns=DE_NOUNS, np=_german_np, join=_german_join, phrase=plain_phrase, subject_case="nom",
                  relations=DE_RELATIONS, preps=DE_PREPS, agree=DE_AGREE, settings=DE_SETTINGS, scenes=DE_SCENES,
                  extras=DE_EXTRAS, templates=DE_TEMPLATES, adjectives=DE_ADJ, wear=DE_WEAR)

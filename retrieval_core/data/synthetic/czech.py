"""Czech captions: the lexicon (every word form the templates need), the grammar tables and the
templates."""
from __future__ import annotations

from retrieval_core.data.synthetic.grammar import Group, Language, Wording, plain_phrase, word_table

# =============================================================================================== Czech
# Nouns: gender (ma = masculine animate, mi = inanimate, f, n; "n>f": neuter singular, feminine plural) /
# singular nominative / genitive / instrumental / plural nominative / genitive / instrumental.
CS_NOUNS = word_table({
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
CS_ADJ = word_table({
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


WRITER = Language(nouns=CS_NOUNS, np=_czech_np, join=_czech_join, phrase=plain_phrase, subject_case="nom",
                  relations=CS_RELATIONS, preps=CS_PREPS, agree=CS_AGREE, settings=CS_SETTINGS, scenes=CS_SCENES,
                  extras=CS_EXTRAS, templates=CS_TEMPLATES, adjectives=CS_ADJ, wear=CS_WEAR)

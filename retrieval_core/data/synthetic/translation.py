"""German, French and Czech captions of the synthetic scenes (``captions`` writes English).

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
from typing import Optional

from retrieval_core.data.synthetic import czech, french, german
from retrieval_core.data.synthetic.grammar import Group, Wording, capitalised

WRITERS = {"de": german.WRITER, "fr": french.WRITER, "cs": czech.WRITER}
LANGUAGES = tuple(WRITERS)
_NP_FIELD = re.compile(r"^(t?)([ABC])(?:_([a-z]+))?$")
_PP_FIELD = re.compile(r"^(.+)\+(t?)([ABC])$")
_AGREE_FIELD = re.compile(r"^([a-z]+)_(t?)([ABC])$")


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
        out.append(text if domain == "cc" else capitalised(text))
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

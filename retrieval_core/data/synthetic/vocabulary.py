"""The words of the synthetic world: colours and sizes (shared by every domain), each domain's nouns and
settings, the relations a caption states and the count words (English; translation holds the other languages)."""
from __future__ import annotations

from dataclasses import dataclass

# Colours are shared by every domain (one world). name -> caption variants (first = canonical).
COLOURS: dict[str, tuple[str, ...]] = {
    "red": ("red",), "blue": ("blue",), "green": ("green",), "yellow": ("yellow",), "black": ("black",),
    "white": ("white",), "orange": ("orange",), "purple": ("purple", "violet"), "pink": ("pink",),
    "brown": ("brown",), "grey": ("grey", "gray"),
}
SIZES: dict[str, tuple[str, ...]] = {"small": ("small", "little", "tiny"), "large": ("large", "big", "huge")}


@dataclass(frozen=True)
class Noun:
    name: str  # codebook key
    forms: tuple[tuple[str, str], ...]  # (singular, plural) wordings, first = canonical
    wears: bool = False  # people: the colour is their clothing ("a man in red")


def _nouns(*specs) -> tuple[Noun, ...]:
    out = []
    for spec in specs:
        wears = spec.startswith("@")
        words = [w.split("/") for w in spec.lstrip("@").split("|")]
        out.append(Noun(words[0][0], tuple((s, p) for s, p in words), wears))
    return tuple(out)


DOMAINS: dict[str, tuple[Noun, ...]] = {
    # everyday objects, MS-COCO like
    "coco": _nouns("cup/cups|mug/mugs", "bottle/bottles", "chair/chairs", "bowl/bowls", "book/books",
                   "clock/clocks", "vase/vases", "laptop/laptops|computer/computers", "umbrella/umbrellas",
                   "suitcase/suitcases|bag/bags", "teddy bear/teddy bears", "ball/balls", "bench/benches",
                   "bicycle/bicycles|bike/bikes", "car/cars", "cat/cats|kitten/kittens", "dog/dogs|puppy/puppies",
                   "kite/kites", "cube/cubes|block/blocks", "plate/plates", "lamp/lamps", "pillow/pillows"),
    # people and outdoor scenes, Flickr30k like
    "f30k": _nouns("@man/men|guy/guys", "@woman/women|lady/ladies", "@boy/boys", "@girl/girls",
                   "@child/children|kid/kids", "@player/players", "dog/dogs", "bicycle/bicycles|bike/bikes",
                   "car/cars", "ball/balls", "tent/tents", "boat/boats", "horse/horses", "guitar/guitars",
                   "umbrella/umbrellas", "kite/kites", "bench/benches", "flag/flags"),
    # web images, Conceptual Captions like
    "cc": _nouns("sofa/sofas|couch/couches", "lamp/lamps", "poster/posters", "sneaker/sneakers|shoe/shoes",
                 "cake/cakes", "building/buildings", "dress/dresses", "mug/mugs", "car/cars", "flower/flowers",
                 "balloon/balloons", "chair/chairs", "tree/trees", "bird/birds", "vase/vases", "@model/models",
                 "@actor/actors", "pumpkin/pumpkins"),
}
SETTINGS = {
    "coco": ("", "", " on a table", " in a kitchen", " on the floor", " in a living room", " on a shelf"),
    "f30k": ("", "", " outside", " in a park", " on the street", " near the water", " on the grass"),
    "cc": (" on a sunny day", " in a modern interior", " against a white background", " at the festival",
           " in the city", " during the holidays"),
}
# Directional relations a caption states; "next to" only appears in describe_scene's relation list.
RELATION_WORDS = {
    "left of": ("to the left of", "left of", "on the left side of"),
    "right of": ("to the right of", "right of", "on the right side of"),
    "above": ("above", "over", "higher up than"),
    "below": ("below", "under", "beneath"),
}
INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
COUNT_WORDS = {1: ("a", "one", "a single"), 2: ("two", "a pair of", "2"), 3: ("three", "3")}

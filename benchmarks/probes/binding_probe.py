"""Where a model loses attribute binding: linear probes on the hidden states of its cross-encoder, layer by layer.

    python -m benchmarks.probes.binding_probe --staged runs/demo/staged --manifest demo --model runs/demo/model/best \\
        [--fit-split train] [--split dev] [--max-captions 3000] --output results/ [--threads N]

``benchmarks.probes.family_probe`` shows that no head tells a binding sibling (two objects' colours swapped) from the
gold image, although the features hold it. This probe asks which part of the comparison is missing. Four
probes, each a multinomial logistic regression per layer (layer 0 = the input tokens), fitted on the tokens of
``--fit-split`` captions and scored on ``--split``:

* ``text``: from the hidden state of a noun (its last word piece) that follows a colour word, predict that
  colour. A caption names two focus objects of different colours, so a noun that only knows the caption's bag
  of words cannot tell its own colour from the other one;
* ``image``: inside the CE input (caption + its gold image), from a region token that the codebook oracle
  (``synthetic.regions.decode_regions``) decodes to one of the caption's two focus (class, colour) pairs, predict the
  colour. A region mixed into the image's average would lose it;
* ``cross``: does the noun fetch the colour the *image* gives its object? Captions of a family's base scene go
  into the CE with their gold image (every other caption) or with its binding sibling, where the two focus
  objects trade colours; from the noun's hidden state, predict the colour of its object in the paired image
  (its own caption colour with the gold image, the caption's other colour with the sibling). The caption alone
  says nothing about which image it is paired with, so a noun that reads no colour from the regions of its
  object stays at 50 % own_over_other; one that does is what a comparison needs;
* ``caption``: on the same pairs, predict the *caption's* colour for the noun, scored only where the image is
  the binding sibling (caption and image disagree). The ``text`` probe pairs the caption with its gold image,
  where the two agree, so it cannot tell a noun that knows its adjective from one that copied its region's
  colour; this one can. A comparison needs both colours: ``cross`` and ``caption`` high at the same layer.

Each row reports ``top1`` (the probe's colour is right) and ``own_over_other``: the share of tokens whose own
colour (for ``cross``: the colour the paired image gives the noun's object) scores above the caption's other
focus colour (chance 50 %). When both sides keep their own colour to the last layer and the CE still scores a
binding sibling like the gold image, what is missing is the comparison between them, not the information;
``cross`` says whether the image's colour reaches the noun at all (docs/log/RESULTS-2026-11.md).
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Sequence

import click
import numpy as np
import pandas as pd
import torch

from benchmarks.probes.family_probe import ProbeInputs, sampled_captions
from retrieval_core.cli import (
    apply_device_and_threads,
    batch_size_option,
    cli_errors,
    option,
    plan_command,
    plan_from_cli,
    threads_option,
)
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.data.synthetic.regions import decode_regions
from retrieval_core.data.synthetic.scenes import describe_scene, focus_pairs
from retrieval_core.data.synthetic.spec import SyntheticSpec
from retrieval_core.data.synthetic.vocabulary import COLOURS
from retrieval_core.model.collate import collate_pairs
from retrieval_core.model.network import VLRetrievalModel

#: caption spelling -> colour name (the generator's variants: "violet" is purple, "gray" grey)
_COLOUR_OF = {variant: name for name, variants in COLOURS.items() for variant in variants}
_COLOURS = sorted(COLOURS)
_WORD = re.compile(r"[A-Za-z]+")


def colour_nouns(text: str) -> list[tuple[str, tuple[int, int]]]:
    """(colour, character span of the word after it) for the first two distinct colour words of a caption."""
    words = list(_WORD.finditer(text))
    found: list[tuple[str, tuple[int, int]]] = []
    for w, nxt in zip(words, words[1:]):
        colour = _COLOUR_OF.get(w.group().lower())
        if colour and colour not in (c for c, _ in found):
            found.append((colour, nxt.span()))
        if len(found) == 2:
            break
    return found


def last_piece(offsets: Sequence[tuple[int, int]], span: tuple[int, int]) -> Optional[int]:
    """Index of the last token whose characters lie inside ``span`` (special tokens have empty offsets)."""
    inside = [i for i, (a, b) in enumerate(offsets) if b > a and a >= span[0] and b <= span[1]]
    return inside[-1] if inside else None


def caption_offsets(model: VLRetrievalModel, text: str) -> list[tuple[int, int]]:
    """Character spans of the caption's tokens as the CE's collator cuts them (same tokenizer, same length)."""
    return model.tokenizer(text, return_offsets_mapping=True, truncation=True,
                           max_length=model.cfg.max_text_len)["offset_mapping"]


def fit_and_score(x_fit: np.ndarray, y_fit: np.ndarray, x: np.ndarray, y: np.ndarray, other: np.ndarray,
                  n_classes: int, l2: float = 1e-3) -> tuple[float, float]:
    """A multinomial logistic regression (standardised inputs, L2, L-BFGS) fitted on (x_fit, y_fit): its top-1
    accuracy on (x, y) and the share of rows where class ``y`` scores above class ``other``, in %."""
    xf = torch.as_tensor(x_fit, dtype=torch.float64)
    mu, sd = xf.mean(0), xf.std(0) + 1e-6
    xf = (xf - mu) / sd
    w = torch.zeros(xf.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    target = torch.as_tensor(y_fit, dtype=torch.long)
    opt = torch.optim.LBFGS([w, b], max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xf @ w + b, target) + l2 * (w * w).sum()
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        logits = ((torch.as_tensor(x, dtype=torch.float64) - mu) / sd) @ w + b
    rows = torch.arange(len(y))
    y_t, o_t = torch.as_tensor(y, dtype=torch.long), torch.as_tensor(other, dtype=torch.long)
    top1 = float((logits.argmax(1) == y_t).double().mean()) * 100.0
    own = float((logits[rows, y_t] > logits[rows, o_t]).double().mean()) * 100.0
    return top1, own


def collect_tokens(staged: StagedDataset, spec: SyntheticSpec, model: VLRetrievalModel, split: str,
                   max_captions: Optional[int], batch_size: int = 64, seed: int = 0) -> dict[str, dict]:
    """Per side ("text", "image"): per-layer hidden states of the probed tokens (``x``: [(n, H)] per layer),
    their colour (``y``) and the caption's other focus colour (``other``), from the CE input caption + gold image."""
    caps, index_of = sampled_captions(staged, spec, split, max_captions, seed, stream=17)
    table = staged.load_images(item_ids=caps["image_item_id"].astype(np.int64).unique())
    pos = table.position_of()
    codebook = dataclasses.replace(spec, feature_dim=table.feature_dim)  # the width staged (see family_probe)
    collator = model.text_collator()
    max_regions = model.cfg.max_regions
    n_layers = model.bert.config.num_hidden_layers + 1
    out = {side: {"x": [[] for _ in range(n_layers)], "y": [], "other": []} for side in ("text", "image")}
    scenes: dict[int, dict] = {}
    for start in range(0, len(caps), batch_size):
        chunk = caps.iloc[start:start + batch_size]
        texts = list(chunk["text"])
        regions = [table.regions(pos[int(i)]) for i in chunk["image_item_id"].astype(np.int64)]
        batch = collate_pairs(collator, texts, regions, max_regions)
        states = model.ce_layer_states(batch)
        n_text = batch["input_ids"].shape[1]
        for j, (text, img) in enumerate(zip(texts, chunk["image_item_id"].astype(np.int64))):
            found = colour_nouns(text)
            if len(found) < 2:
                continue
            colours = [c for c, _ in found]
            offsets = caption_offsets(model, text)
            for colour, span in found:
                p = last_piece(offsets, span)
                if p is None:
                    continue  # truncated away
                other = colours[1 - colours.index(colour)]
                for layer, s in enumerate(states):
                    out["text"]["x"][layer].append(s[j, p].float().numpy())
                out["text"]["y"].append(_COLOURS.index(colour))
                out["text"]["other"].append(_COLOURS.index(other))
            index = index_of[int(img)]
            scene = scenes.setdefault(index, describe_scene(spec, index))
            focus = focus_pairs(scene)
            focus_colours = sorted({c for _, c in focus})
            if len(focus_colours) != 2:
                continue
            n_reg = int(batch["img_mask"][j].sum())
            decoded = decode_regions(codebook, batch["img_feats"][j, :n_reg].numpy())
            for r, pair in enumerate(decoded):
                if pair in focus:
                    for layer, s in enumerate(states):
                        out["image"]["x"][layer].append(s[j, n_text + r].float().numpy())
                    out["image"]["y"].append(_COLOURS.index(pair[1]))
                    out["image"]["other"].append(_COLOURS.index(next(c for c in focus_colours if c != pair[1])))
    return out


def cross_pairs(spec: SyntheticSpec, caps: pd.DataFrame, index_of: dict) -> list[tuple]:
    """(caption, paired image item_id, [(noun span, its object's colour in that image, the other focus colour)])
    for the captions of base scenes that name both focus colours: every other one paired with its gold image,
    the rest with the gold image's binding sibling (same split), where the two focus objects trade colours."""
    item_of = {index: item for item, index in index_of.items()}
    pairs = []
    for text, img in zip(caps["text"], caps["image_item_id"].astype(np.int64)):
        gold = index_of[int(img)]
        if gold % spec.family_size:
            continue  # only a base scene's captions differ from its binding sibling by the swap alone
        sibling = next((i for i in range(gold + 1, min(gold + spec.family_size, spec.num_images))
                        if describe_scene(spec, i)["change"] == "binding"), None)
        found = colour_nouns(text)
        focus_colours = {c for _, c in focus_pairs(describe_scene(spec, gold))}
        if sibling not in item_of or len(found) < 2 or {c for c, _ in found} != focus_colours:
            continue
        swapped = len(pairs) % 2 == 1
        (a, _), (b, _) = found[:2]
        nouns = []
        for colour, span in found:
            other = b if colour == a else a
            nouns.append((span, other, colour) if swapped else (span, colour, other))
        pairs.append((text, item_of[sibling] if swapped else int(img), nouns))
    return pairs


def collect_cross_tokens(staged: StagedDataset, spec: SyntheticSpec, model: VLRetrievalModel, split: str,
                         max_captions: Optional[int], batch_size: int = 64, seed: int = 0) -> dict[str, dict]:
    """Per-layer states of the colour nouns of base-scene captions inside the CE input with their gold image (even
    rows) or its binding sibling (odd rows), labelled two ways: ``cross``: ``y`` = the colour the paired image
    gives the noun's object; ``caption``: ``y`` = the caption's colour for the noun (``sibling`` marks the rows
    where the two disagree); ``other`` = the focus colour other than ``y``."""
    caps, index_of = sampled_captions(staged, spec, split, max_captions, seed, stream=17)
    pairs = cross_pairs(spec, caps, index_of)
    table = staged.load_images(item_ids=np.unique([p[1] for p in pairs]).astype(np.int64))
    pos = table.position_of()
    collator = model.text_collator()
    n_layers = model.bert.config.num_hidden_layers + 1
    x: list[list] = [[] for _ in range(n_layers)]
    cross: dict = {"x": x, "y": [], "other": []}
    caption: dict = {"x": x, "y": [], "other": [], "sibling": []}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        batch = collate_pairs(collator, [t for t, _, _ in chunk], [table.regions(pos[i]) for _, i, _ in chunk],
                              model.cfg.max_regions)
        states = model.ce_layer_states(batch)
        for j, (text, _, nouns) in enumerate(chunk):
            offsets = caption_offsets(model, text)
            said_of = {span: colour for colour, span in colour_nouns(text)}  # the caption's colour per noun
            for span, colour, other in nouns:
                p = last_piece(offsets, span)
                if p is None:
                    continue
                for layer, st in enumerate(states):
                    x[layer].append(st[j, p].float().numpy())
                cross["y"].append(_COLOURS.index(colour))
                cross["other"].append(_COLOURS.index(other))
                said = said_of[span]
                caption["y"].append(_COLOURS.index(said))
                caption["other"].append(_COLOURS.index(other if said == colour else colour))
                caption["sibling"].append(said != colour)  # the image disagrees: it is the binding sibling
    return {"cross": cross, "caption": caption}


def _rows_where(side: dict, keep: np.ndarray) -> dict:
    return {"x": [[v for v, k in zip(layer, keep) if k] for layer in side["x"]],
            "y": [v for v, k in zip(side["y"], keep) if k], "other": [v for v, k in zip(side["other"], keep) if k]}


def probe(staged: StagedDataset, spec: SyntheticSpec, model: VLRetrievalModel, fit_split: str = "train",
          split: str = "dev", max_captions: Optional[int] = 3000, batch_size: int = 64) -> pd.DataFrame:
    """Rows (side, layer, top1, own_over_other, fitted_on, scored_on) of the four probes: ``text``, ``image``,
    ``cross`` (the image's colour for the noun's object) and ``caption`` (the caption's colour for the noun,
    fitted on the cross pairs and scored where the paired image is the binding sibling, i.e. disagrees)."""
    fit = collect_tokens(staged, spec, model, fit_split, max_captions, batch_size)
    test = collect_tokens(staged, spec, model, split, max_captions, batch_size)
    fit.update(collect_cross_tokens(staged, spec, model, fit_split, max_captions, batch_size))
    test.update(collect_cross_tokens(staged, spec, model, split, max_captions, batch_size))
    test["caption"] = _rows_where(test["caption"], np.asarray(test["caption"]["sibling"], dtype=bool))
    rows = []
    for side in ("text", "image", "cross", "caption"):
        if not fit[side]["y"] or not test[side]["y"]:
            why = ("no base scene with its binding sibling in the split: the manifest's sibling_changes need "
                   "'binding'" if side in ("cross", "caption")
                   else "captions without two colour-noun phrases, or no focus regions")
            raise ValueError(f"no {side} tokens to probe in {fit_split!r} or {split!r} ({why})")
        for layer in range(len(fit[side]["x"])):
            top1, own = fit_and_score(np.stack(fit[side]["x"][layer]), np.asarray(fit[side]["y"]),
                                      np.stack(test[side]["x"][layer]), np.asarray(test[side]["y"]),
                                      np.asarray(test[side]["other"]), len(_COLOURS))
            rows.append({"side": side, "layer": layer, "top1": top1, "own_over_other": own,
                         "fitted_on": len(fit[side]["y"]), "scored_on": len(test[side]["y"])})
    return pd.DataFrame(rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BindingProbePlan(ProbeInputs):
    """The probe's options, each a typed field (checked when built)."""
    model: str = option(help="Model folder whose cross-encoder is probed.")
    fit_split: str = option("train", help="Split whose tokens fit the probes.")
    split: str = option("dev", help="Split whose tokens score them.")
    max_captions: int = option(3000, type=click.IntRange(min=0), help="Seeded sample of captions per split (0: all).")
    output: Optional[str] = option(None, help="Folder for binding_probe.csv.")
    batch_size: int = batch_size_option(64)
    threads: Optional[int] = threads_option()


@plan_command(BindingProbePlan)
def main(**values) -> None:
    """Per layer: does a caption's noun, and a focus region inside the CE, keep its own colour, and does the noun
    read its object's colour from the image? (CPU: a few thousand captions.)"""
    with cli_errors(KeyError):
        plan = plan_from_cli(BindingProbePlan, values)
        apply_device_and_threads("cpu", plan.threads)
        collection, model_dir, fit_split, split = plan.collection, plan.model, plan.fit_split, plan.split
        m = load_manifest(plan.manifest)
        name = collection or m.benchmark.get("query_collection") or next(iter(m.collections))
        spec = m.synthetic_spec(name)
        model = VLRetrievalModel.load(model_dir).eval()
        rows = probe(StagedDataset(plan.staged), spec, model, fit_split, split, plan.max_captions or None,
                     plan.batch_size)
    click.echo(f"\nown colour kept, per layer (%; {name}, fitted on {fit_split}, scored on {split}; "
               f"own_over_other chance 50 %):")
    click.echo(rows.pivot(index="layer", columns="side", values=["top1", "own_over_other"]).round(1).to_string())
    if plan.output:
        os.makedirs(plan.output, exist_ok=True)
        path = os.path.join(plan.output, "binding_probe.csv")
        rows.assign(model=model_dir, collection=name).to_csv(path, index=False)
        click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()

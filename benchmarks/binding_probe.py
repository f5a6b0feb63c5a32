"""Where a model loses attribute binding: linear probes on the hidden states of its cross-encoder, layer by layer.

    python -m benchmarks.binding_probe --staged runs/demo/staged --manifest demo --model runs/demo/model/best \\
        [--fit-split train] [--split dev] [--max-captions 3000] --output results/ [--threads N]

``benchmarks.family_probe`` shows that no head tells a binding sibling (two objects' colours swapped) from the
gold image, although the features hold it. This probe asks which half of the comparison is missing. Two
probes, each a multinomial logistic regression per layer (layer 0 = the input tokens), fitted on the tokens of
``--fit-split`` captions and scored on ``--split``:

* ``text``: from the hidden state of a noun (its last word piece) that follows a colour word, predict that
  colour. A caption names two focus objects of different colours, so a noun that only knows the caption's bag
  of words cannot tell its own colour from the other one;
* ``image``: inside the CE input (caption + its gold image), from a region token that the codebook oracle
  (``synthetic.decode_regions``) decodes to one of the caption's two focus (class, colour) pairs, predict the
  colour. A region mixed into the image's average would lose it.

Each row reports ``top1`` (the probe's colour is right) and ``own_over_other``: the share of tokens whose own
colour scores above the caption's other focus colour (chance 50 %). When both sides keep their own colour to the
last layer and the CE still scores a binding sibling like the gold image, what is missing is the comparison
between them, not the information (README, *Status*).
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

from benchmarks.family_probe import sampled_captions
from retrieval_core import synthetic
from retrieval_core.cli import CONTEXT_SETTINGS, apply_device_and_threads, cli_errors, threads_option
from retrieval_core.collate import collate_pairs
from retrieval_core.manifest import load_manifest
from retrieval_core.model import VLRetrievalModel
from retrieval_core.store import StagedDataset

#: caption spelling -> colour name (the generator's variants: "violet" is purple, "gray" grey)
_COLOUR_OF = {variant: name for name, variants in synthetic.COLOURS.items() for variant in variants}
_COLOURS = sorted(synthetic.COLOURS)
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


def collect_tokens(staged: StagedDataset, spec: synthetic.SyntheticSpec, model: VLRetrievalModel, split: str,
                   max_captions: Optional[int], batch_size: int = 64, seed: int = 0) -> dict[str, dict]:
    """Per side ("text", "image"): per-layer hidden states of the probed tokens (``x``: [(n, H)] per layer),
    their colour (``y``) and the caption's other focus colour (``other``), from the CE input caption + gold image."""
    caps, index_of = sampled_captions(staged, spec, split, max_captions, seed, stream=17)
    table = staged.load_images(item_ids=caps["image_item_id"].astype(np.int64).unique())
    pos = table.position_of()
    codebook = dataclasses.replace(spec, feature_dim=table.feature_dim)  # the width staged (see family_probe)
    tok, collator = model.tokenizer, model.text_collator()
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
            offsets = tok(text, return_offsets_mapping=True, truncation=True,
                          max_length=model.cfg.max_text_len)["offset_mapping"]
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
            scene = scenes.setdefault(index, synthetic.describe_scene(spec, index))
            focus = synthetic.focus_pairs(scene)
            focus_colours = sorted({c for _, c in focus})
            if len(focus_colours) != 2:
                continue
            n_reg = int(batch["img_mask"][j].sum())
            decoded = synthetic.decode_regions(codebook, batch["img_feats"][j, :n_reg].numpy())
            for r, pair in enumerate(decoded):
                if pair in focus:
                    for layer, s in enumerate(states):
                        out["image"]["x"][layer].append(s[j, n_text + r].float().numpy())
                    out["image"]["y"].append(_COLOURS.index(pair[1]))
                    out["image"]["other"].append(_COLOURS.index(next(c for c in focus_colours if c != pair[1])))
    return out


def probe(staged: StagedDataset, spec: synthetic.SyntheticSpec, model: VLRetrievalModel, fit_split: str = "train",
          split: str = "dev", max_captions: Optional[int] = 3000, batch_size: int = 64) -> pd.DataFrame:
    """Rows (side, layer, top1, own_over_other, fitted_on, scored_on) of both probes."""
    fit = collect_tokens(staged, spec, model, fit_split, max_captions, batch_size)
    test = collect_tokens(staged, spec, model, split, max_captions, batch_size)
    rows = []
    for side in ("text", "image"):
        if not fit[side]["y"] or not test[side]["y"]:
            raise ValueError(f"no {side} tokens to probe in {fit_split!r} or {split!r} (captions without two "
                             f"colour-noun phrases, or no focus regions)")
        for layer in range(len(fit[side]["x"])):
            top1, own = fit_and_score(np.stack(fit[side]["x"][layer]), np.asarray(fit[side]["y"]),
                                      np.stack(test[side]["x"][layer]), np.asarray(test[side]["y"]),
                                      np.asarray(test[side]["other"]), len(_COLOURS))
            rows.append({"side": side, "layer": layer, "top1": top1, "own_over_other": own,
                         "fitted_on": len(fit[side]["y"]), "scored_on": len(test[side]["y"])})
    return pd.DataFrame(rows)


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--staged", required=True, help="A staged synthetic collection (pipelines.stage).")
@click.option("--manifest", required=True, help="The manifest it was staged from (its generator settings).")
@click.option("--collection", default=None, help="Collection [the manifest's query collection].")
@click.option("--model", "model_dir", required=True, help="Model folder whose cross-encoder is probed.")
@click.option("--fit-split", default="train", show_default=True, help="Split whose tokens fit the probes.")
@click.option("--split", default="dev", show_default=True, help="Split whose tokens score them.")
@click.option("--max-captions", default=3000, show_default=True, type=click.IntRange(min=0),
              help="Seeded sample of captions per split (0: all).")
@click.option("--output", default=None, help="Folder for binding_probe.csv.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1))
@threads_option()
def main(staged: str, manifest: str, collection: Optional[str], model_dir: str, fit_split: str, split: str,
         max_captions: int, output: Optional[str], batch_size: int, threads: Optional[int]) -> None:
    """Per layer: does a caption's noun, and a focus region inside the CE, keep its own colour? (CPU: a few
    thousand captions.)"""
    apply_device_and_threads("cpu", threads)
    with cli_errors(KeyError):
        m = load_manifest(manifest)
        name = collection or m.benchmark.get("query_collection") or next(iter(m.collections))
        spec = m.synthetic_spec(name)
        model = VLRetrievalModel.load(model_dir).eval()
        rows = probe(StagedDataset(staged), spec, model, fit_split, split, max_captions or None, batch_size)
    click.echo(f"\nown colour kept, per layer (%; {name}, fitted on {fit_split}, scored on {split}; "
               f"own_over_other chance 50 %):")
    click.echo(rows.pivot(index="layer", columns="side", values=["top1", "own_over_other"]).round(1).to_string())
    if output:
        os.makedirs(output, exist_ok=True)
        rows.assign(model=model_dir, collection=name).to_csv(os.path.join(output, "binding_probe.csv"), index=False)
        click.echo(f"wrote {os.path.join(output, 'binding_probe.csv')}")


if __name__ == "__main__":
    main()

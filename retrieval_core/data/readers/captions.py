"""Readers of caption files -> ``RawCaption`` or ``Reject``.

Text: every caption is decoded as UTF-8 per record; a caption that is not valid UTF-8 is yielded as a
RawCaption whose ``text`` is the raw ``bytes`` (the stager rejects it with the locator). Empty captions are
rejected here. Surrounding whitespace is stripped; the text is otherwise kept as written (tokenised files
stay tokenised).

Image source ids (they must match the ids of the feature readers of the same collection):
- karpathy_json: ``cocoid`` (COCO) or the file-name stem (Flickr30k: ``1000092795``);
- caption_lines: the ids-file value, or the stem of ``id_mapping[value]`` (LAPS/SCAN f30k);
- flickr30k_entities: the sentences file stem (the Flickr30k image id);
- cc_tsv: the 0-based line number (``image_id="line"``) or the image URL (``image_id="url"``);
- multi30k: the image-list file-name stem.
``source_id_pattern`` (regex with one group; numeric groups lose leading zeros) applies to those ids in
all readers but cc_tsv. An id that is not valid UTF-8 (an ids-file line, an image-list line, a URL, a file
name) is a Reject, never decoded with replacement characters (two ids would become one).

Files (the caption file and any ids/mapping/image-list file) are read through ``files`` (a ``FileAccess``,
default local), each reader's second parameter; it is not keyword-only, so it is not a format option.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import Iterator, Optional

from ..schema import KIND_CAPTION, RawCaption, Reject
from ._common import (
    FileAccess,
    apply_source_id_pattern,
    bad_id_reason,
    decode_id,
    decode_text,
    file_stem,
    is_unicode_text,
    iter_lines,
    read_bytes,
    read_lines,
    str_or_bytes,
)

CaptionRecord = RawCaption | Reject


def _reject(path: str, locator: str, reason: str) -> Reject:
    return Reject(source=path, locator=locator, reason=reason, kind=KIND_CAPTION)


def _image_id(raw: str, pattern: Optional[str], path: str, locator: str) -> str | Reject:
    if not is_unicode_text(raw):  # undecodable bytes of a file name or of a JSON string
        return _reject(path, locator, bad_id_reason("image id", raw))
    sid = apply_source_id_pattern(raw, pattern)
    if not sid:
        reason = "empty image id" if not raw else f"image id {raw!r} does not match source_id_pattern {pattern!r}"
        return _reject(path, locator, reason)
    return sid


def _caption(line: bytes) -> str | bytes:
    text = decode_text(line)
    return text.strip() if isinstance(text, str) else text


# ------------------------------------------------------------------------------------ Karpathy JSON
#: What ``restval`` (the 30,504 COCO val2014 images Karpathy's split leaves out of val and test) becomes:
#: "train" (the usual training set: train + restval = 113,287 images, as in LAPS/SCAN's train_ids.txt),
#: "restval" (a split of its own: ``split: train`` is then the 82,783 train2014 images), or "skip" (not read).
KARPATHY_RESTVAL = ("train", "restval", "skip")


def _karpathy_split(split: Optional[str], restval: str) -> Optional[str]:
    """The split an image of Karpathy split ``split`` is staged in; None = not read (restval: skip)."""
    if split == "restval":
        return None if restval == "skip" else restval
    return split


def read_karpathy_json(path: str, files: Optional[FileAccess] = None, *, split: Optional[str | list[str]] = None,
                       restval: str = "train", image_id: str = "auto",
                       source_id_pattern: Optional[str] = None) -> Iterator[CaptionRecord]:
    """Karpathy ``dataset_coco.json`` / ``dataset_flickr30k.json``.

    ``split``: keep only images of that split, or of those splits (a list); None keeps all, each captioned
    with its own split. Karpathy's names are kept (train, val, test), except COCO's ``restval``, which
    ``restval`` decides (KARPATHY_RESTVAL; default "train": restval images are train images, and
    ``split: restval`` then selects them with the rest of train). ``image_id``: "cocoid", "filename_stem",
    or "auto" (cocoid when the image entry has one). caption_key = sentid; lang "en".
    """
    if restval not in KARPATHY_RESTVAL:
        raise ValueError(f"karpathy_json restval must be one of {', '.join(KARPATHY_RESTVAL)}, got {restval!r}")
    wanted = None if split is None else [split] if isinstance(split, str) else list(split)
    if wanted is not None and (not wanted or not all(isinstance(w, str) and w for w in wanted)):
        raise ValueError(f"karpathy_json split must be a split name or a list of them, got {split!r}")
    want = None if wanted is None else {_karpathy_split(w, restval) for w in wanted} - {None}
    if image_id not in ("auto", "cocoid", "filename_stem"):
        raise ValueError(f"karpathy_json image_id must be 'auto', 'cocoid' or 'filename_stem', got {image_id!r}")
    try:  # surrogateescape: an undecodable caption becomes bytes later instead of failing the whole file
        doc = json.loads(read_bytes(path, files).decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    images = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(images, list):
        raise ValueError(f"{path}: expected a Karpathy split file {{'images': [...]}}")
    for i, img in enumerate(images):
        locator = f"{path}:images[{i}]"
        if not isinstance(img, dict):
            yield _reject(path, locator, "image entry is not an object")
            continue
        raw_split = img.get("split")
        img_split = _karpathy_split(raw_split, restval)
        if (raw_split == "restval" and img_split is None) or (want is not None and img_split not in want):
            continue
        use_cocoid = image_id == "cocoid" or (image_id == "auto" and "cocoid" in img)
        if use_cocoid and "cocoid" not in img:
            yield _reject(path, locator, "image entry has no 'cocoid'")
            continue
        raw_id = str(img["cocoid"]) if use_cocoid else file_stem(str(img.get("filename", "")))
        sid = _image_id(raw_id, source_id_pattern, path, locator)
        if isinstance(sid, Reject):
            yield sid
            continue
        sentences = img.get("sentences")
        if not isinstance(sentences, list):
            yield _reject(path, locator, "image entry has no 'sentences' list")
            continue
        for j, sent in enumerate(sentences):
            sloc = f"{locator}.sentences[{j}]"
            if not isinstance(sent, dict) or "sentid" not in sent:
                yield _reject(path, sloc, "sentence has no 'sentid'")
                continue
            raw = sent.get("raw")
            if not isinstance(raw, str) or not raw.strip():
                yield _reject(path, sloc, "sentence has no 'raw' text")
                continue
            if not is_unicode_text(str(sent["sentid"])):
                yield _reject(path, sloc, bad_id_reason("sentid", str(sent["sentid"])))
                continue
            yield RawCaption(image_source_id=sid, text=str_or_bytes(raw.strip()), caption_key=str(sent["sentid"]),
                             lang="en", split=img_split, locator=sloc)


# ------------------------------------------------------------------------------ caps + ids line files
def _default_ids_path(caps_path: str) -> str:
    folder, name = os.path.split(caps_path)
    if "_caps" not in name:
        raise ValueError(f"{caps_path}: cannot derive the ids file name (no '_caps' in it): pass ids_path")
    return os.path.join(folder, name.replace("_caps", "_ids"))


def read_caption_lines(path: str, files: Optional[FileAccess] = None, *, ids_path: Optional[str] = None,
                       id_mapping: Optional[str] = None, lang: str = "en", split: Optional[str] = None,
                       source_id_pattern: Optional[str] = None) -> Iterator[CaptionRecord]:
    """LAPS/SCAN-style caption lines: ``path`` has one caption per line, ``ids_path`` (default: the same
    name with ``_caps`` -> ``_ids``) one image id per line, in the same order.

    ``id_mapping``: JSON {id: file name} (LAPS f30k ``id_mapping.json``); the image source id is then the
    mapped file name's stem. caption_key = index of the caption among its image's lines (0..4), counted
    over all lines (a rejected line still uses its index, so keys never shift). Files of different lengths
    are a ValueError; an empty caption line is a Reject.
    """
    ids_path = ids_path or _default_ids_path(path)
    caps, ids = read_lines(path, files), read_lines(ids_path, files)
    if len(caps) != len(ids):
        raise ValueError(f"caption file {path} has {len(caps)} lines but ids file {ids_path} has {len(ids)}")
    mapping = None
    if id_mapping:
        try:
            mapping = json.loads(read_bytes(id_mapping, files).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{id_mapping}: not a UTF-8 JSON file ({e})") from None
        if not isinstance(mapping, dict):
            raise ValueError(f"{id_mapping}: expected a JSON object {{id: file name}}")
        mapping = {str(k): v for k, v in mapping.items()}
    seen: dict[str, int] = defaultdict(int)
    for lineno, (cap, raw_id) in enumerate(zip(caps, ids), start=1):
        locator = f"{path}:{lineno}"
        key = decode_id(raw_id)
        if key is None:
            yield _reject(path, locator, bad_id_reason(f"image id (line {lineno} of {ids_path})", raw_id))
            continue
        index = seen[key]
        seen[key] += 1
        if mapping is not None:
            if key not in mapping:
                yield _reject(path, locator, f"image id {key!r} is not in id_mapping {id_mapping}")
                continue
            key = file_stem(str(mapping[key]))
        sid = _image_id(key, source_id_pattern, path, locator)
        if isinstance(sid, Reject):
            yield sid
            continue
        text = _caption(cap)
        if not text:
            yield _reject(path, locator, "empty caption line")
            continue
        yield RawCaption(image_source_id=sid, text=text, caption_key=str(index), lang=lang, split=split,
                         locator=locator)


# ------------------------------------------------------------------------------ Flickr30k Entities
_ENTITY = re.compile(r"\[/EN#[^\s\]]*\s+([^\]]*)\]")


def strip_entities_markup(text: str) -> str:
    """``[/EN#18/people A man] runs`` -> ``A man runs`` (whitespace collapsed)."""
    return " ".join(_ENTITY.sub(r"\1", text).split())


def read_flickr30k_entities(path: str, files: Optional[FileAccess] = None, *, lang: str = "en",
                            split: Optional[str] = None,
                            source_id_pattern: Optional[str] = None) -> Iterator[CaptionRecord]:
    """One Flickr30k Entities ``Sentences/<image_id>.txt`` file: one caption per line with entity markup,
    stripped to plain text. Image source id = file stem; caption_key = 0-based line index."""
    sid = _image_id(file_stem(path), source_id_pattern, path, path)
    if isinstance(sid, Reject):
        yield sid
        return
    for lineno, line in iter_lines(path, files):
        locator = f"{path}:{lineno}"
        text = _caption(line)
        if isinstance(text, str):
            text = strip_entities_markup(text)
            if "[/EN#" in text:
                yield _reject(path, locator, "unbalanced Flickr30k Entities markup")
                continue
        if not text:
            yield _reject(path, locator, "empty caption line")
            continue
        yield RawCaption(image_source_id=sid, text=text, caption_key=str(lineno - 1), lang=lang, split=split,
                         locator=locator)


# ------------------------------------------------------------------------------ Conceptual Captions
def read_cc_tsv(path: str, files: Optional[FileAccess] = None, *, image_id: str = "line", lang: str = "en",
                split: Optional[str] = None) -> Iterator[CaptionRecord]:
    """Conceptual Captions TSV: ``caption<TAB>image URL`` per line, no header, one caption per image.

    Image source id: ``image_id="line"`` -> the 0-based line number as a string (line 1 of the file is
    image "0"); ``"url"`` -> the URL. caption_key = the 0-based line number in both cases (unique even
    when a URL repeats).
    """
    if image_id not in ("line", "url"):
        raise ValueError(f"cc_tsv image_id must be 'line' or 'url', got {image_id!r}")
    for lineno, line in iter_lines(path, files):
        locator = f"{path}:{lineno}"
        fields = line.split(b"\t")
        if len(fields) != 2:
            yield _reject(path, locator, f"expected 2 tab-separated columns (caption, url), found {len(fields)}")
            continue
        url = decode_id(fields[1]) if image_id == "url" else None  # "line" ids never read the URL
        if image_id == "url" and url is None:
            yield _reject(path, locator, bad_id_reason("image URL", fields[1]))
            continue
        if image_id == "url" and not url:
            yield _reject(path, locator, "empty image URL")
            continue
        text = _caption(fields[0])
        if not text:
            yield _reject(path, locator, "empty caption")
            continue
        sid = str(lineno - 1) if image_id == "line" else url
        yield RawCaption(image_source_id=sid, text=text, caption_key=str(lineno - 1), lang=lang, split=split,
                         locator=locator)


# ------------------------------------------------------------------------------------------ Multi30k
_M30K_LANG = re.compile(r"\.([a-z]{2})(?:\.gz)?$")
_M30K_NUMBER = re.compile(r"\.(\d+)\.[a-z]{2}(?:\.gz)?$")


def read_multi30k(path: str, files: Optional[FileAccess] = None, *, image_list: str, lang: Optional[str] = None,
                  split: Optional[str] = None,
                  source_id_pattern: Optional[str] = None) -> Iterator[CaptionRecord]:
    """One Multi30k caption file (plain or .gz, one caption per line) with its ``image_list`` (one image
    file name per line, same order; a length mismatch is a ValueError).

    Image source id = image file-name stem (a ``#...`` suffix, as in the COCO lists, is dropped). lang =
    the option, else the file suffix (``.de``/``.en``/``.fr``/``.cs``, optionally ``.gz``). caption_key =
    the file's number for task2 files (``test_2016.3.en.gz`` -> "3"), else "0", with ``.<lang>`` appended
    for every language but English ("3.de", "0.fr"): one collection can hold an image's captions in several
    languages with distinct ids (the synthetic captions' convention). Task2's five files are five tasks
    (plan_read_tasks expands the glob).
    """
    name = os.path.basename(path)
    if lang is None:
        m = _M30K_LANG.search(name)
        if m is None:
            raise ValueError(f"{path}: cannot tell the language from the file name: pass lang")
        lang = m.group(1)
    m = _M30K_NUMBER.search(name)
    caption_key = (m.group(1) if m else "0") + ("" if lang == "en" else f".{lang}")
    caps, images = read_lines(path, files), read_lines(image_list, files)
    if len(caps) != len(images):
        raise ValueError(f"caption file {path} has {len(caps)} lines but image list {image_list} has {len(images)}")
    for lineno, (cap, image) in enumerate(zip(caps, images), start=1):
        locator = f"{path}:{lineno}"
        name = decode_id(image)
        if name is None:
            yield _reject(path, locator, bad_id_reason(f"image file name (line {lineno} of {image_list})", image))
            continue
        sid = _image_id(file_stem(name), source_id_pattern, path, locator)
        if isinstance(sid, Reject):
            yield sid
            continue
        text = _caption(cap)
        if not text:
            yield _reject(path, locator, "empty caption line")
            continue
        yield RawCaption(image_source_id=sid, text=text, caption_key=caption_key, lang=lang, split=split,
                         locator=locator)

"""Readers of region-feature files (docs/CONVENTIONS.md#region-feature-formats) -> ``RawImage`` or ``Reject``.

Readers parse faithfully and reject only what cannot be parsed (truncated rows, bad base64, arrays whose
size does not fit the declared box count, missing npz keys...). They do not check feature dims, NaNs,
region caps or box ranges: the stager does that from the RawImage fields (``num_boxes`` carries the count
the file declares, None where the format declares none).

Source ids: ``butd_tsv`` the image_id column; ``oscar_pt`` the dict key; the npz formats the file stem.
``source_id_pattern`` (regex with one group, searched in that raw id; numeric groups lose leading zeros)
applies to all of them. An id that is not valid UTF-8 (a TSV field, a file name) is a Reject, never decoded
with replacement characters (two ids would become one).

Every reader takes ``files`` (a ``FileAccess``, default local) as its second, non-keyword-only parameter:
the keyword-only parameters are the manifest's format options, and how files are reached is not one.
"""
from __future__ import annotations

import base64
import binascii
import os
import pickle
import struct
from typing import Iterator, Optional, Sequence

import numpy as np

from ..paths import join_path
from ..schema import KIND_IMAGE, RawImage, Reject
from ._common import (
    LOCAL_FILES,
    FileAccess,
    URLAccessError,
    _open_binary,
    apply_source_id_pattern,
    bad_id_reason,
    decode_id,
    file_stem,
    is_unicode_text,
    iter_lines,
    npz_bytes,
)

ImageRecord = RawImage | Reject

BUTD_COLUMNS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
_BUTD_REQUIRED = ("image_id", "num_boxes", "boxes", "features")


def _reject(path: str, locator: str, reason: str) -> Reject:
    return Reject(source=path, locator=locator, reason=reason, kind=KIND_IMAGE)


def _source_id(raw_id: str, pattern: Optional[str], path: str, locator: str) -> str | Reject:
    if not is_unicode_text(raw_id):  # a file stem with undecodable bytes
        return _reject(path, locator, bad_id_reason("image id", raw_id))
    sid = apply_source_id_pattern(raw_id, pattern)
    if sid is None or sid == "":
        return _reject(path, locator, f"source id {raw_id!r} does not match source_id_pattern {pattern!r}")
    return sid


# ---------------------------------------------------------------------------------------- BUTD TSV
def _b64_floats(field: bytes, name: str) -> np.ndarray:
    try:
        raw = base64.b64decode(field, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"column {name!r} is not valid base64 ({e})") from None
    if len(raw) % 4:
        raise ValueError(f"column {name!r} holds {len(raw)} bytes, not a whole number of float32 values")
    return np.frombuffer(raw, dtype=np.float32)


def _parse_butd_row(fields: list[bytes], columns: Sequence[str]) -> dict:
    row = dict(zip(columns, fields))
    out: dict = {"image_id": decode_id(row["image_id"])}
    if out["image_id"] is None:
        raise ValueError(bad_id_reason("image_id", row["image_id"]))
    if not out["image_id"]:
        raise ValueError("empty image_id")
    for name in ("image_w", "image_h", "num_boxes"):
        if name in row:
            try:
                out[name] = int(float(row[name]))
            except ValueError:
                raise ValueError(f"column {name!r} is not a number: {row[name][:40]!r}") from None
    n = out["num_boxes"]
    if n <= 0:
        raise ValueError(f"num_boxes is {n}: no regions, the feature width cannot be derived")
    boxes = _b64_floats(row["boxes"], "boxes")
    if boxes.size % 4:
        raise ValueError(f"boxes hold {boxes.size} values, not a multiple of 4")
    features = _b64_floats(row["features"], "features")
    if features.size == 0 or features.size % n:
        raise ValueError(f"features hold {features.size} values, not a multiple of num_boxes={n}")
    out["boxes"] = boxes.reshape(-1, 4)
    out["features"] = features.reshape(n, -1)
    if "objects_conf" in row:
        out["confidences"] = _b64_floats(row["objects_conf"], "objects_conf")
    return out


def read_butd_tsv(path: str, files: Optional[FileAccess] = None, *, columns: Sequence[str] = BUTD_COLUMNS,
                  source_id_pattern: Optional[str] = None, split: Optional[str] = None) -> Iterator[ImageRecord]:
    """Bottom-up-attention TSV: no header, tab-separated ``columns`` (default image_id, image_w, image_h,
    num_boxes, boxes, features); boxes/features (and ``objects_conf`` if named) are base64 float32.

    Columns not used here (cls_prob, attrs, ...) may be named and are ignored. Boxes are (N,4) pixel
    x1,y1,x2,y2 (box_format "xyxy"); ``confidences`` come from an ``objects_conf`` column when present.
    Lines are parsed by hand, so row size is unlimited.
    """
    columns = tuple(columns)
    missing = [c for c in _BUTD_REQUIRED if c not in columns]
    if missing or len(set(columns)) != len(columns):
        raise ValueError(f"butd_tsv columns {columns} must name each column once and include {_BUTD_REQUIRED}")
    for lineno, line in iter_lines(path, files):
        locator = f"{path}:{lineno}"
        if not line.strip():
            yield _reject(path, locator, "empty line")
            continue
        fields = line.split(b"\t")
        if len(fields) != len(columns):
            yield _reject(path, locator, f"expected {len(columns)} tab-separated columns {columns}, found "
                                         f"{len(fields)} (truncated or malformed row)")
            continue
        try:
            row = _parse_butd_row(fields, columns)
        except ValueError as e:
            yield _reject(path, locator, str(e))
            continue
        sid = _source_id(row["image_id"], source_id_pattern, path, locator)
        if isinstance(sid, Reject):
            yield sid
            continue
        yield RawImage(source_id=sid, features=row["features"], boxes=row["boxes"],
                       image_w=row.get("image_w", 0), image_h=row.get("image_h", 0), box_format="xyxy",
                       confidences=row.get("confidences"), num_boxes=row["num_boxes"], split=split,
                       locator=locator)


# --------------------------------------------------------------------------------------- npz files
# numpy's own array reconstruction: all that an object array of numbers, strings, arrays and dicts needs
_NUMPY_PICKLE_GLOBALS = frozenset({("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
                                   ("numpy", "ndarray"), ("numpy", "dtype")})


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays, numbers, strings, lists and dicts; refuses every other global (no code runs)."""

    def find_class(self, module, name):
        if module == "numpy.core.multiarray":  # written by numpy 1.x; numpy 2 keeps it in numpy._core
            module = "numpy._core.multiarray"
        if (module, name) in _NUMPY_PICKLE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _npz_object(npz, key: str):
    """The object array ``key`` of an open npz (bottom-up-attention.pytorch's ``info`` dict is one), unpickled
    through :class:`_NumpyOnlyUnpickler`: numpy reconstructors only, never arbitrary code."""
    from numpy.lib import format as npy

    with npz.zip.open(f"{key}.npy") as f:
        version = npy.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"unsupported .npy format version {version}")
        read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        _, _, dtype = read_header(f)
        if not dtype.hasobject:
            raise ValueError(f"expected an object array, found dtype {dtype}")
        return _NumpyOnlyUnpickler(f).load()


def _load_npz(path: str, keys: Sequence[str], optional: Sequence[str] = (),
              files: Optional[FileAccess] = None, objects: Sequence[str] = ()) -> dict | str:
    """The named arrays of an npz file, or a reject reason. Nothing is unpickled, except the object arrays
    named in ``objects``, and those by :func:`_npz_object` (numpy arrays, numbers, strings, dicts only)."""
    try:
        npz = np.load(npz_bytes(path, files), allow_pickle=False)
    except (FileNotFoundError, URLAccessError):
        raise
    except Exception as e:  # zipfile.BadZipFile, ValueError, OSError: one bad file, not a crash
        return f"not a readable npz file ({type(e).__name__}: {e})"
    if not hasattr(npz, "files"):
        return "not an npz archive (a single .npy array)"
    with npz:
        absent = [k for k in keys if k not in npz.files]
        if absent:
            return f"missing npz key(s) {absent} (has {sorted(npz.files)})"
        out = {}
        for k in list(keys) + [k for k in optional if k in npz.files]:
            try:
                out[k] = npz[k]
            except ValueError as e:  # object arrays need pickle: refused unless named in objects
                if k not in objects:
                    return f"npz key {k!r} cannot be loaded without unpickling ({e})"
                try:
                    out[k] = _npz_object(npz, k)
                except Exception as e2:  # noqa: BLE001 - one bad file (or a refused global), not a crash
                    return f"npz key {k!r} cannot be read safely ({type(e2).__name__}: {e2})"
            except Exception as e:
                return f"npz key {k!r} is corrupt ({type(e).__name__}: {e})"
    return out


def _scalar_int(value: np.ndarray, name: str) -> int:
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"{name} should be a scalar, has shape {arr.shape}")
    return int(arr.reshape(()))


def _bua_confidences(info) -> Optional[np.ndarray] | str:
    """``info["objects_conf"]`` of a bottom-up-attention.pytorch npz as (N,) floats; None when the file has
    no ``info`` or its ``info`` has no confidences; a reject reason when ``info`` is not a dict."""
    if info is None:
        return None
    info = info.item() if isinstance(info, np.ndarray) and info.shape == () else info
    if not isinstance(info, dict):
        return f"npz key 'info' should hold a dict, holds {type(info).__name__}"
    conf = info.get("objects_conf")
    if conf is None:
        return None
    try:
        return np.asarray(conf, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        return f"info['objects_conf'] is not numeric ({e})"


def read_bua_npz(path: str, files: Optional[FileAccess] = None, *, source_id_pattern: Optional[str] = None,
                 split: Optional[str] = None) -> Iterator[ImageRecord]:
    """One bottom-up-attention.pytorch npz (keys x, bbox, num_bbox, image_h, image_w, info); source id = stem.

    ``x`` may be stored (N,F) or (F,N); the orientation is taken from ``num_bbox``. ``confidences`` are
    ``info["objects_conf"]`` (the tool's per-region max class score; its ``keep_boxes`` are in index order, not
    confidence order), so the stager keeps regions most-confident first. ``info`` is a pickled dict: it is
    read with numpy's array reconstructors only (:class:`_NumpyOnlyUnpickler`); a file without it has no
    confidences.
    """
    locator = path
    data = _load_npz(path, ("x", "bbox", "num_bbox", "image_h", "image_w"), optional=("info",), files=files,
                     objects=("info",))
    if isinstance(data, str):
        yield _reject(path, locator, data)
        return
    sid = _source_id(file_stem(path), source_id_pattern, path, locator)
    if isinstance(sid, Reject):
        yield sid
        return
    try:
        n = _scalar_int(data["num_bbox"], "num_bbox")
        w, h = _scalar_int(data["image_w"], "image_w"), _scalar_int(data["image_h"], "image_h")
    except (ValueError, TypeError) as e:
        yield _reject(path, locator, str(e))
        return
    x, bbox = data["x"], data["bbox"]
    if x.ndim != 2 or bbox.ndim != 2 or bbox.shape[1] != 4:
        yield _reject(path, locator, f"x {x.shape} must be 2-D and bbox {bbox.shape} (N,4)")
        return
    if x.shape[0] != n and x.shape[1] == n:
        x = x.T  # stored (F, N)
    conf = _bua_confidences(data.get("info"))
    if isinstance(conf, str):
        yield _reject(path, locator, conf)
        return
    yield RawImage(source_id=sid, features=x, boxes=bbox, image_w=w, image_h=h, box_format="xyxy",
                   confidences=conf, num_boxes=n, split=split, locator=locator)


def read_uniter_npz(path: str, files: Optional[FileAccess] = None, *, source_id_pattern: Optional[str] = None,
                    split: Optional[str] = None) -> Iterator[ImageRecord]:
    """One UNITER npz (float16 features (N,F), norm_bb (N,6) or (N,7) with area, conf (N,1), soft_labels).

    Boxes are already normalised (box_format "normalized6"; a 7th area column is dropped); no image size
    (0, 0). Features keep their float16 dtype. UNITER files declare no box count: ``num_boxes`` is None.
    """
    locator = path
    data = _load_npz(path, ("features", "norm_bb"), optional=("conf",), files=files)
    if isinstance(data, str):
        yield _reject(path, locator, data)
        return
    sid = _source_id(file_stem(path), source_id_pattern, path, locator)
    if isinstance(sid, Reject):
        yield sid
        return
    feats, bb = data["features"], data["norm_bb"]
    if feats.ndim != 2 or bb.ndim != 2 or bb.shape[1] not in (6, 7):
        yield _reject(path, locator, f"features {feats.shape} must be (N,F) and norm_bb {bb.shape} (N,6) or (N,7)")
        return
    conf = data.get("conf")
    yield RawImage(source_id=sid, features=feats, boxes=bb[:, :6], box_format="normalized6",
                   confidences=None if conf is None else conf.reshape(-1), num_boxes=None, split=split,
                   locator=locator)


# ----------------------------------------------------------------------------------------- plain npz
_CONF_KEYS = ("conf", "confidences", "scores", "objects_conf")
_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")


def image_size(path: str, files: Optional[FileAccess] = None) -> tuple[int, int]:
    """(width, height) of a JPEG or PNG file from its header (PIL when installed, else a small parser)."""
    try:
        from PIL import Image
    except ImportError:
        Image = None
    with _open_binary(path, files) as f:
        if Image is not None:
            with Image.open(f) as im:
                return int(im.size[0]), int(im.size[1])
        return _header_size(f, path)


def _header_size(f, path: str) -> tuple[int, int]:
    head = f.read(26)
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        w, h = struct.unpack(">II", head[16:24])
        return int(w), int(h)
    if head[:2] != b"\xff\xd8":
        raise ValueError(f"{path}: neither a JPEG nor a PNG file")
    f.seek(2)
    while True:  # walk JPEG segments to the first start-of-frame marker
        marker = f.read(2)
        if len(marker) < 2 or marker[0] != 0xFF:
            raise ValueError(f"{path}: no JPEG frame header found")
        code = marker[1]
        if code in (0xD8, 0x01) or 0xD0 <= code <= 0xD7:
            continue  # markers without a length
        (length,) = struct.unpack(">H", f.read(2))
        if 0xC0 <= code <= 0xCF and code not in (0xC4, 0xC8, 0xCC):
            _, h, w = struct.unpack(">BHH", f.read(5))
            return int(w), int(h)
        f.seek(length - 2, os.SEEK_CUR)


def _find_image(image_dir: str, stem: str, files: Optional[FileAccess] = None) -> Optional[str]:
    """``<image_dir>/<stem>.<jpg|jpeg|png>``; ``image_dir`` may be a glob (``images/*``)."""
    files = files or LOCAL_FILES
    if any(c in image_dir for c in "*?["):
        hits = [p for p in files.match(join_path(image_dir, stem + ".*")) if p.endswith(_IMAGE_EXTS)]
        return hits[0] if hits else None
    for ext in _IMAGE_EXTS:
        candidate = join_path(image_dir, stem + ext)
        if files.exists(candidate):
            return candidate
    return None


def detector_frame_size(w: int, h: int, min_size: int, max_size: int) -> tuple[int, int]:
    """Size of the image as a torchvision/detectron-style detector saw it after resizing (shorter side to
    ``min_size`` unless the longer side would exceed ``max_size``; sizes floored like
    ``interpolate(scale_factor=...)``). Boxes of such detectors are in this frame, not the original's."""
    scale = min(min_size / min(w, h), max_size / max(w, h))
    return int(w * scale), int(h * scale)


def read_plain_npz(path: str, files: Optional[FileAccess] = None, *, image_w: int = 0, image_h: int = 0,
                   image_dir: Optional[str] = None, detector_resize: Optional[Sequence[int]] = None,
                   source_id_pattern: Optional[str] = None, split: Optional[str] = None) -> Iterator[ImageRecord]:
    """One "features + boxes" npz: ``features`` (N,F), ``boxes`` (N,4) pixel x1,y1,x2,y2 (or (N,6)
    normalised), optional ``image_w``/``image_h`` keys and a confidence key (conf/confidences/scores).

    Image size, first found: the npz keys; the ``image_w``/``image_h`` options; the header of
    ``<image_dir>/<stem>.jpg|jpeg|png`` (``image_dir`` may be a glob such as ``images/*``). When the
    detector ran on resized images (AllenNLP / torchvision Faster R-CNN: ``detector_resize=(800, 1333)``),
    a size from the options or the image file is mapped to that resized frame, the one the boxes are in.
    Source id = file stem. The format declares no box count: ``num_boxes`` is None.
    """
    locator = path
    data = _load_npz(path, ("features", "boxes"), optional=("image_w", "image_h") + _CONF_KEYS, files=files)
    if isinstance(data, str):
        yield _reject(path, locator, data)
        return
    stem = file_stem(path)
    sid = _source_id(stem, source_id_pattern, path, locator)
    if isinstance(sid, Reject):
        yield sid
        return
    feats, boxes = data["features"], data["boxes"]
    if feats.ndim != 2 or boxes.ndim != 2 or boxes.shape[1] not in (4, 6):
        yield _reject(path, locator, f"features {feats.shape} must be (N,F) and boxes {boxes.shape} (N,4) or (N,6)")
        return
    box_format = "xyxy" if boxes.shape[1] == 4 else "normalized6"
    w = h = 0
    if "image_w" in data and "image_h" in data:
        try:
            w, h = _scalar_int(data["image_w"], "image_w"), _scalar_int(data["image_h"], "image_h")
        except (ValueError, TypeError) as e:
            yield _reject(path, locator, str(e))
            return
    elif box_format == "xyxy":
        if image_w and image_h:
            w, h = int(image_w), int(image_h)
        elif image_dir:
            image_path = _find_image(image_dir, stem, files)
            if image_path is None:
                yield _reject(path, locator,
                              f"no image {stem}.jpg/.jpeg/.png in image_dir {image_dir!r} to size the boxes")
                return
            try:
                w, h = image_size(image_path, files)
            except URLAccessError:
                raise
            except Exception as e:  # a broken image file is this record's problem
                yield _reject(path, locator, f"cannot read the size of {image_path}: {e}")
                return
        if w and h and detector_resize:
            w, h = detector_frame_size(w, h, int(detector_resize[0]), int(detector_resize[1]))
    conf = next((data[k].reshape(-1) for k in _CONF_KEYS if k in data), None)
    yield RawImage(source_id=sid, features=feats, boxes=boxes, image_w=w, image_h=h, box_format=box_format,
                   confidences=conf, num_boxes=None, split=split, locator=locator)


# --------------------------------------------------------------------------------------- OSCAR .pt
def read_oscar_pt(path: str, files: Optional[FileAccess] = None, *, source_id_pattern: Optional[str] = None,
                  split: Optional[str] = None) -> Iterator[ImageRecord]:
    """OSCAR torch-saved dict {image_id: tensor (N, F+6)}: the last 6 columns are normalised boxes.

    Loaded with ``torch.load(weights_only=True)`` only; a file that needs a full unpickle is a ValueError
    saying so. Source id = str(key). Entries are yielded in sorted key order (deterministic).
    ``num_boxes`` is None (the format declares no count).
    """
    import torch  # only this format needs torch

    with _open_binary(path, files) as f:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path}: refusing to load: the file needs a full (unsafe) unpickle, "
                             f"torch.load(weights_only=True) failed: {str(e).splitlines()[0]}") from None
        except Exception as e:
            raise ValueError(f"{path}: not a readable torch file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict {{image_id: tensor}}, got {type(obj).__name__}")
    for key in sorted(obj, key=lambda k: (str(type(k)), k)):
        locator = f"{path}:{key}"
        value = obj[key]
        if not isinstance(value, torch.Tensor) or value.ndim != 2 or value.shape[1] < 7:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            yield _reject(path, locator, f"value must be a tensor (N, F+6), got {shape}")
            continue
        sid = _source_id(str(key), source_id_pattern, path, locator)
        if isinstance(sid, Reject):
            yield sid
            continue
        if value.dtype not in (torch.float16, torch.float32, torch.float64):
            value = value.float()  # bfloat16 and ints have no numpy twin
        arr = value.numpy()
        yield RawImage(source_id=sid, features=arr[:, :-6], boxes=arr[:, -6:], box_format="normalized6",
                       num_boxes=None, split=split, locator=locator)

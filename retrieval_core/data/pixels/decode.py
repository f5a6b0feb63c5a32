"""Image files -> RGB pictures at the backbone's input size, or the reason they cannot be: every file is either
decoded (its conversions named, so they are counted) or rejected with a reason (:data:`REASONS`).

Pillow decodes; nothing is unpickled. Only the header is read before the size check, so a decompression
bomb (a small file declaring billions of pixels) is refused before any pixel is allocated.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

#: Reject reason categories (the text before the first ':' of a reject's reason).
R_EMPTY = "empty file"
R_NOT_IMAGE = "not an image"
R_CORRUPT = "truncated or corrupt image"
R_ZERO_SIZE = "zero-size image"
R_TOO_LARGE = "absurd dimensions"
REASONS = (R_EMPTY, R_NOT_IMAGE, R_CORRUPT, R_ZERO_SIZE, R_TOO_LARGE)

#: Conversion names (counted per collection in summary.json's images.converted).
C_GREY, C_PALETTE, C_ALPHA, C_CMYK, C_16BIT, C_EXIF = ("greyscale", "palette", "alpha", "CMYK", "16-bit",
                                                       "EXIF rotation")
#: Largest image accepted, in pixels: 16,384 x 16,384 (a 256-megapixel panorama passes, a 20k x 20k bomb not).
DEFAULT_MAX_PIXELS = 1 << 28


class DecodeError(Exception):
    """A file that cannot be staged; ``category`` is one of REASONS."""
    def __init__(self, category: str, detail: str):
        super().__init__(f"{category}: {detail}")
        self.category = category


@dataclass
class Decoded:
    """An image resized to the backbone's input: ``pixels`` (size, size, 3) uint8; ``width``/``height``: the
    picture's size after EXIF rotation (what the boxes are relative to); ``conversions``: what was done."""
    pixels: np.ndarray
    width: int
    height: int
    conversions: tuple[str, ...]


def _to_rgb(im, conversions: list):
    from PIL import Image

    mode = im.mode
    if mode == "RGB":
        return im
    if mode == "P":
        conversions.append(C_PALETTE)
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        # Pillow's convert("RGB") clips 16-bit values at 255 (a white picture): scale the range down instead
        conversions.append(C_16BIT)
        arr = np.asarray(im, dtype=np.float64)
        scale = 257.0 if mode != "F" else 1.0
        im = Image.fromarray(np.clip(arr / scale, 0, 255).astype(np.uint8), "L")
        mode = "L"
    if mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        conversions.append(C_ALPHA)
        # transparent pixels hold arbitrary colours: composite on white, as a viewer shows them
        rgba = im.convert("RGBA")
        im = Image.new("RGB", rgba.size, (255, 255, 255))
        im.paste(rgba, mask=rgba.getchannel("A"))
        return im
    if mode in ("L", "1"):
        conversions.append(C_GREY)
    elif mode == "CMYK":
        conversions.append(C_CMYK)
    return im.convert("RGB")


def decode_image(data: bytes, size: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> Decoded:
    """One file's bytes -> a :class:`Decoded` picture squashed to ``size`` x ``size`` (the whole picture, no
    crop: grid boxes then cover it); raises :class:`DecodeError` with the reason otherwise."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise DecodeError(R_EMPTY, "0 bytes")
    conversions: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise DecodeError(R_NOT_IMAGE, f"Pillow recognises no image format in {len(data)} bytes "
                                           f"(starting {data[:8]!r})") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise DecodeError(R_TOO_LARGE, str(exc)) from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise DecodeError(R_CORRUPT, f"{type(exc).__name__}: {exc}") from None
        w, h = im.size
        if w <= 0 or h <= 0:
            raise DecodeError(R_ZERO_SIZE, f"{w} x {h} pixels")
        if w * h > max_pixels:
            raise DecodeError(R_TOO_LARGE, f"{w} x {h} = {w * h:,} pixels > the limit of {max_pixels:,}")
        try:
            if im.format == "JPEG":
                # the JPEG decoder scales by 1/2, 1/4 or 1/8 while decoding, never below size: most of the cost
                im.draft(im.mode, (size, size))
            im.load()
            orientation = im.getexif().get(0x0112, 1)
            if orientation not in (1, None):
                im = ImageOps.exif_transpose(im)
                conversions.append(C_EXIF)
            im = _to_rgb(im, conversions)
            out = im.resize((size, size), Image.BILINEAR)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning) as exc:
            raise DecodeError(R_CORRUPT, f"{type(exc).__name__}: {exc}") from None
    # the size the boxes refer to: the file's full size, rotated as displayed (draft may have decoded smaller)
    width, height = (h, w) if C_EXIF in conversions and orientation in (5, 6, 7, 8) else (w, h)
    return Decoded(np.asarray(out, dtype=np.uint8), width, height, tuple(conversions))


def decode_or_reason(data: bytes, size: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[Optional[Decoded], str]:
    """(decoded, "") or (None, reason)."""
    try:
        return decode_image(data, size, max_pixels), ""
    except DecodeError as exc:
        return None, str(exc)

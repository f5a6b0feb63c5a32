"""benchmarks.run.stage(): which manifests may be restaged at the model's feature_dim."""
from __future__ import annotations

import os

import click
import pytest

from benchmarks.run import stage


def _staged(workdir, name):
    """A finished staged dir under the name stage() would choose (stage() then reuses it, staging nothing)."""
    out = os.path.join(workdir, "staged", name)
    os.makedirs(out)
    open(os.path.join(out, "summary.json"), "w").close()
    return out


def test_synthetic_manifest_is_restaged_at_the_models_feature_dim(tmp_path):
    # synthetic_f30k1k is 1024-d; its generator makes features of any dimension
    expected = _staged(str(tmp_path), "synthetic_f30k1k-f16")
    assert stage("synthetic_f30k1k", str(tmp_path), 16, quick=False) == expected


def test_real_manifest_with_another_feature_dim_is_refused_naming_both(tmp_path):
    # coco_5k holds 2048-d region features from files; restaging them at 1024 would reject every image
    with pytest.raises(click.ClickException) as err:
        stage("coco_5k", str(tmp_path), 1024, quick=False)
    message = err.value.format_message()
    assert "coco_5k" in message and "2048" in message and "1024" in message
    assert not os.path.exists(os.path.join(str(tmp_path), "staged"))  # nothing was staged


def test_real_manifest_with_the_models_feature_dim_is_staged_as_is(tmp_path):
    expected = _staged(str(tmp_path), "coco_5k")
    assert stage("coco_5k", str(tmp_path), 2048, quick=False) == expected

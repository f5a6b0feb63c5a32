"""benchmarks.suites.planner.stage_job(): which manifests may be restaged at the model's feature_dim, and how."""
from __future__ import annotations

import os

import pytest

from benchmarks.suites.planner import Models, SuiteConfig, stage_job


def _cfg(tmp_path, feature_dim, quick=False):
    return SuiteConfig(suite="standard", workdir=str(tmp_path), models=Models(join="unused"),
                       feature_dim=feature_dim, quick=quick)


def test_synthetic_manifest_is_restaged_at_the_models_feature_dim(tmp_path):
    # synthetic_f30k1k is 1024-d; its generator makes features of any dimension
    st = stage_job(_cfg(tmp_path, 16), "synthetic_f30k1k")
    assert st.path == os.path.join(str(tmp_path), "bench", "staged", "synthetic_f30k1k-f16")
    assert st.job.module == "pipelines.stage" and "feature_dim=16" in st.job.args
    assert st.images == {"synthetic_f30k1k": 1000} and st.captions == {"synthetic_f30k1k": 5000}
    assert st.job.work == (("stage_records", 6000),)


def test_quick_and_cut_collections_get_their_own_folders(tmp_path):
    quick = stage_job(_cfg(tmp_path, 1024, quick=True), "synthetic_f30k1k")
    assert quick.path.endswith("synthetic_f30k1k-quick") and quick.images == {"synthetic_f30k1k": 40}
    cut = stage_job(_cfg(tmp_path, 1024), "synthetic_coco5k", images=1000)
    assert cut.path.endswith("synthetic_coco5k-n1000") and cut.captions == {"synthetic_coco5k": 5000}
    assert "synthetic_coco5k.images.num_images=1000" in cut.job.args


def test_real_manifest_with_another_feature_dim_is_refused_naming_both(tmp_path):
    # coco_5k holds 2048-d region features from files; restaging them at 1024 would reject every image
    with pytest.raises(ValueError) as err:
        stage_job(_cfg(tmp_path, 1024), "coco_5k")
    message = str(err.value)
    assert "coco_5k" in message and "2048" in message and "1024" in message
    assert not os.path.exists(os.path.join(str(tmp_path), "bench"))  # nothing was staged


def test_real_manifest_with_the_models_feature_dim_is_staged_as_is(tmp_path):
    st = stage_job(_cfg(tmp_path, 2048), "coco_5k")
    assert st.path == os.path.join(str(tmp_path), "bench", "staged", "coco_5k")
    assert not any(a.startswith("feature_dim=") for a in st.job.args)

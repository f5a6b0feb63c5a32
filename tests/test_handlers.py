"""VLModelHandler: keyed ids stay attached through RunInference, per-batch padding, device checks."""
from __future__ import annotations

import apache_beam as beam
import numpy as np
import pytest
import torch
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that

from pipelines.handlers import (
    TASK_EMBED_IMAGE,
    TASK_EMBED_TEXT,
    TASK_SCORE_PAIRS,
    DeviceUnavailableError,
    VLModelHandler,
    element_length,
)
from tests.helpers_model import tiny_model

FEATURE_DIM = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("handler")
    model = tiny_model(str(root), feature_dim=FEATURE_DIM)
    model.save(str(root / "model"))
    return str(root / "model")


def regions(n: int, seed: int):
    rng = np.random.default_rng(seed)
    boxes = np.tile(np.array([[0.1, 0.1, 0.5, 0.5, 0.4, 0.4]], dtype=np.float32), (n, 1))
    return rng.normal(size=(n, FEATURE_DIM)).astype(np.float32), boxes


def test_keyed_ids_stay_attached_through_run_inference(model_dir):
    from retrieval_core.model.network import VLRetrievalModel

    model = VLRetrievalModel.load(model_dir)
    images = {100 + i: regions(n, i) for i, n in enumerate([1, 7, 3, 12, 2, 5, 9])}  # varied region counts
    texts = {200 + i: t for i, t in enumerate(["a dog", "a red car next to a big blue bus", "two cats",
                                               "there is a man on the beach with a kite and a ball"])}
    want_img = {k: model.encode_image([v])[0] for k, v in images.items()}  # one at a time: no padding at all
    want_txt = {k: model.encode_text([v])[0] for k, v in texts.items()}

    def check(expected):
        def _check(outputs):
            got = {k: r.inference for k, r in outputs}
            assert sorted(got) == sorted(expected)
            for k, vec in got.items():
                np.testing.assert_allclose(vec, expected[k], atol=1e-5)
        return _check

    with BeamTestPipeline() as p:
        img = (p | "images" >> beam.Create(sorted(images.items()))
               | "embed images" >> RunInference(KeyedModelHandler(
                   VLModelHandler(model_dir, TASK_EMBED_IMAGE, max_batch_size=3))))
        txt = (p | "texts" >> beam.Create(sorted(texts.items()))
               | "embed texts" >> RunInference(KeyedModelHandler(
                   VLModelHandler(model_dir, TASK_EMBED_TEXT, max_batch_size=2))))
        assert_that(img, check(want_img), label="images keyed")
        assert_that(txt, check(want_txt), label="texts keyed")


def test_batches_are_padded_to_their_own_longest_element(model_dir):
    from retrieval_core.model.network import VLRetrievalModel

    model = VLRetrievalModel.load(model_dir)
    h = VLModelHandler(model_dir, TASK_EMBED_IMAGE)
    assert h.collate([regions(2, 0), regions(5, 1)], model)["img_feats"].shape == (2, 5, FEATURE_DIM)
    assert h.collate([regions(2, 0), regions(3, 1)], model)["img_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    t = VLModelHandler(model_dir, TASK_EMBED_TEXT)
    assert t.collate(["a dog", "a cat"], model)["input_ids"].shape == (2, 4)  # [CLS] a dog [SEP]
    pairs = VLModelHandler(model_dir, TASK_SCORE_PAIRS)
    batch = pairs.collate([("a dog", *regions(2, 0)), ("a big red dog", *regions(4, 1))], model)
    assert batch["input_ids"].shape == (2, 6) and batch["img_feats"].shape == (2, 4, FEATURE_DIM)
    # score_pairs through the handler equals the model's own score()
    examples = [("a dog", *regions(2, 0)), ("a big red dog", *regions(4, 1)), ("two cats", *regions(9, 2))]
    got = [r.inference for r in pairs.run_inference(examples, model)]
    want = model.score([e[0] for e in examples], [(e[1], e[2]) for e in examples])
    np.testing.assert_allclose(np.array(got), want, atol=1e-5)
    assert [r.example[0] for r in pairs.run_inference(examples, model)] == ["a dog", "a big red dog", "two cats"]
    assert element_length(TASK_SCORE_PAIRS, examples[2]) == 2 + 9


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_gpu_without_cuda_is_an_error_not_a_silent_cpu_run(model_dir):
    with pytest.raises(DeviceUnavailableError, match="cuda"):
        VLModelHandler(model_dir, TASK_EMBED_TEXT, device="cuda").load_model()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_loads_on_cuda(model_dir):
    model = VLModelHandler(model_dir, TASK_EMBED_TEXT, device="cuda").load_model()
    assert model.device.type == "cuda"


def test_beam_plumbing(model_dir):
    h = VLModelHandler(model_dir, TASK_EMBED_IMAGE, max_batch_size=32, min_batch_size=4)
    assert h.batch_elements_kwargs() == {"min_batch_size": 4, "max_batch_size": 32}
    assert not h.share_model_across_processes()
    shared = VLModelHandler(model_dir, TASK_EMBED_IMAGE, model_copies=1)
    assert shared.share_model_across_processes() and shared.model_copies() == 1
    assert h.get_metrics_namespace().endswith(TASK_EMBED_IMAGE)
    assert KeyedModelHandler(h).get_metrics_namespace() == h.get_metrics_namespace()
    assert h.get_num_bytes([regions(3, 0)]) == 3 * FEATURE_DIM * 4 + 3 * 6 * 4
    with pytest.raises(ValueError, match="task"):
        VLModelHandler(model_dir, "classify")
    with pytest.raises(ValueError, match="device"):
        VLModelHandler(model_dir, TASK_EMBED_TEXT, device="TPU")
    with pytest.raises(ValueError, match="inference_args"):
        h.validate_inference_args({"x": 1})


def test_dead_letter_handler_returns_the_failure_per_element_instead_of_raising(model_dir):
    from pipelines.handlers import FailedBatch

    bad = [regions(2, 0)[0][:, :8], regions(2, 0)[1]]  # 8-d features for a 16-d model
    batch = [tuple(bad), regions(3, 1)]
    loud = VLModelHandler(model_dir, TASK_EMBED_IMAGE)
    with pytest.raises(Exception, match="feature dim"):
        loud.run_inference(batch, loud.load_model())
    quiet = VLModelHandler(model_dir, TASK_EMBED_IMAGE, dead_letter=True)
    out = quiet.run_inference(batch, quiet.load_model())
    assert len(out) == 2 and all(isinstance(r.inference, FailedBatch) for r in out)
    assert "feature dim" in out[0].inference.reason and out[1].example is batch[1]
    good = quiet.run_inference([regions(3, 1)], quiet.load_model())
    assert good[0].inference.shape == (quiet.load_model().embedding_dim,)


def test_running_out_of_memory_is_not_dead_lettered_but_fails_the_batch(model_dir, monkeypatch):
    """An allocation that fails is the machine's limit, not a bad record: the dead-letter handler re-raises
    it (the CLI then names the need and the option) instead of going on without memory."""
    quiet = VLModelHandler(model_dir, TASK_EMBED_IMAGE, dead_letter=True)
    model = quiet.load_model()
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10745856 bytes.")
    monkeypatch.setattr(quiet, "_infer", lambda batch, m: (_ for _ in ()).throw(oom))
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        quiet.run_inference([regions(3, 1)], model)


TRIM_PROBE = """
from retrieval_core.memory import trim_heap

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

# 3,000 blocks of 64 KiB come from glibc's heap (under its 128 KiB mmap threshold); keeping every tenth pins
# the heap's top, so freeing the rest leaves ~170 MiB of free chunks between live ones, resident until trimmed
blocks = [bytearray(b"x" * (64 << 10)) for _ in range(3000)]
kept = blocks[9::10]
del blocks
before = rss()
assert trim_heap()
print(before - rss())
"""


def test_trim_heap_returns_the_free_holes_of_the_heap_to_the_os():
    """The handler trims every TRIM_EVERY batches: the heap's free chunks between live ones leave RSS only
    through malloc_trim (a fresh interpreter, so this test's heap is the probe's alone)."""
    import subprocess
    import sys

    from pipelines.handlers import TRIM_EVERY

    assert TRIM_EVERY >= 1
    res = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=120)
    if res.returncode and "AssertionError" in res.stderr and "trim_heap()" in res.stderr:
        pytest.skip("this libc has no malloc_trim (not glibc)")
    assert res.returncode == 0, res.stderr[-2000:]
    released = int(res.stdout.split()[-1])
    assert released > 100 << 20, f"malloc_trim released {released / 2**20:.0f} MiB of ~170 MiB of free chunks"

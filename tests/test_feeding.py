"""Feeding the model: token ids made once per tokenizer, batches collated ahead, results equal to per-batch
collation (the code path before the token store and the prefetching loop), attention kernels per device."""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from retrieval_core.model.attention import sdpa_backends
from retrieval_core.model.collate import BatchMaker, TextCollator, collate_images, prefetched
from tests.helpers_model import make_tiny_dataset, tiny_model

FEATURE_DIM = 16


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    model = tiny_model(str(tmp_path_factory.mktemp("feeding")), feature_dim=FEATURE_DIM).eval()
    captions, images = make_tiny_dataset(num_images=40, feature_dim=FEATURE_DIM, captions_per_image=2)
    return model, captions["text"].tolist(), images


def _reference(model, make_batch, order, fn, batch_size, width):
    """The batched loop as it was: each batch tokenised and collated when its turn comes, one copy, one sync."""
    out = np.zeros((len(order), width), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            out[idx] = fn(make_batch(idx)).float().cpu().numpy()
    return out


def test_token_ids_padded_equal_the_tokenizers_own_padding(model_and_data):
    model, texts, _ = model_and_data
    col = TextCollator(model.tokenizer, max_len=7)  # truncation included
    want = model.tokenizer(texts[:9], padding="longest", truncation=True, max_length=7, return_tensors="pt")
    got = col.pad(col.ids(texts[:9]))
    assert torch.equal(got["input_ids"], want["input_ids"].long())
    assert torch.equal(got["attention_mask"], want["attention_mask"].long())
    mixed = [texts[0], col.ids([texts[1]])[0]]  # a str and ids in one batch
    assert torch.equal(col(mixed)["input_ids"], col(texts[:2])["input_ids"])
    with pytest.raises(TypeError, match="token-id arrays"):
        col([3.5])
    with pytest.raises(ValueError, match="token ids"):
        col([np.zeros(40, dtype=np.int32)])


def test_batched_loops_equal_per_batch_collation(model_and_data):
    """fp32 results of encode_text / encode_image / score (tokenised once, collated ahead by a worker thread) equal
    the old per-batch path's within float tolerance: the same batches, the same padding."""
    model, texts, images = model_and_data
    col, mr = model.text_collator(), model.cfg.max_regions
    bs = 8
    order_t = np.argsort(col.token_lengths(texts), kind="stable")
    want_t = _reference(model, lambda idx: col([texts[i] for i in idx]), order_t, model.embed_text, bs,
                        model.embedding_dim)
    np.testing.assert_allclose(model.encode_text(texts, batch_size=bs), want_t, rtol=0, atol=1e-6)
    counts = images.num_boxes()
    order_i = np.argsort(counts, kind="stable")
    want_i = _reference(model, lambda idx: collate_images([images.regions(i) for i in idx], mr), order_i,
                        model.embed_image, bs, model.embedding_dim)
    np.testing.assert_allclose(model.encode_image(images, batch_size=bs), want_i, rtol=0, atol=1e-6)
    pair_images = [images.regions(i // 2) for i in range(len(texts))]
    order_p = np.lexsort((col.token_lengths(texts), np.minimum(counts.repeat(2), mr)))
    want_p = _reference(model, lambda idx: {**col([texts[i] for i in idx]),
                                            **collate_images([pair_images[i] for i in idx], mr)},
                        order_p, lambda b: model.score_pairs(b)[:, None], bs, 1)[:, 0]
    got_p = model.score(texts, pair_images, batch_size=bs)
    np.testing.assert_allclose(got_p, want_p, rtol=0, atol=1e-5)
    # the rankings are today's: every caption's images ordered the same
    ids = col.ids(texts)
    np.testing.assert_array_equal(model.score(ids, pair_images, batch_size=bs), got_p)


def test_prefetched_keeps_order_and_raises_at_the_failing_batch():
    chunks = [np.arange(i, i + 2) for i in range(0, 10, 2)]
    assert [int(c[0]) for c, b in prefetched(lambda c: int(c.sum()), chunks)] == [0, 2, 4, 6, 8]
    assert [b for _, b in prefetched(lambda c: int(c.sum()), chunks)] == [1, 5, 9, 13, 17]

    def bad(c):
        if c[0] == 6:
            raise RuntimeError("batch at 6")
        return c
    seen = []
    with pytest.raises(RuntimeError, match="batch at 6"):
        for c, _ in prefetched(bad, chunks):
            seen.append(int(c[0]))
    assert seen == [0, 2, 4]


def test_batch_maker_carries_regions_as_numpy_fills_them(model_and_data):
    model, texts, images = model_and_data
    regions = [images.regions(i) for i in range(3)]
    half = BatchMaker(model.text_collator(), model.cfg.max_regions, torch.float16).pairs(texts[:3], regions)
    assert half["img_feats"].dtype == half["img_boxes"].dtype == torch.float16
    # bf16, which numpy lacks, travels as float32 and the model narrows it: the same scores as narrowed on the host
    wide = BatchMaker(model.text_collator(), model.cfg.max_regions, torch.bfloat16).pairs(texts[:3], regions)
    assert wide["img_feats"].dtype == torch.float32
    assert wide["img_mask"].dtype == wide["input_ids"].dtype == torch.int64
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()  # any CPU: the test is of the rounding, not speed
    narrowed = {**wide, "img_feats": wide["img_feats"].to(torch.bfloat16),
                "img_boxes": wide["img_boxes"].to(torch.bfloat16)}
    with torch.inference_mode():
        assert torch.equal(bf16.score_pairs(wide), bf16.score_pairs(narrowed))
    assert model.batch_maker().dtype == torch.float32 and not model.batch_maker().pin
    assert model.batch_maker(torch.device("cuda")).pin  # pinned host memory for asynchronous copies


def test_collating_threads_and_reused_blocks_give_the_same_tensors():
    """Workers fill slices of one batch and a ring reuses host blocks: every tensor equals a single thread's on
    fresh memory, batch after batch of other widths (stale rows of a larger batch never leak into padding), for
    float16 and float32 staged regions; a bad image in any slice is named."""
    rng = np.random.default_rng(0)
    feats = [rng.standard_normal((int(rng.integers(1, 9)), 16)).astype(np.float16 if i % 2 else np.float32)
             for i in range(70)]
    images = [(f, rng.random((len(f), 6)).astype(np.float32)) for f in feats]
    fresh = BatchMaker(None, max_regions=6)
    ringed = BatchMaker(None, max_regions=6, workers=3, ring=2)
    for size in (40, 17, 70, 9, 33):  # batches smaller than the last: reused blocks hold other rows' values
        order = rng.permutation(len(images))[:size]
        want, got = fresh.images([images[i] for i in order]), ringed.images([images[i] for i in order])
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    bad = list(images[:40])
    bad[33] = (np.zeros((3, 15), np.float32), np.zeros((3, 6), np.float32))
    with pytest.raises(ValueError, match="image 33 has feature dim 15"):
        ringed.images(bad)


def test_sdpa_backends_leave_cudnn_out_in_16_bit_on_cuda():
    from torch.nn.attention import SDPBackend

    assert sdpa_backends(torch.device("cpu"), torch.bfloat16) is None
    assert sdpa_backends(torch.device("cuda"), torch.float32) is None
    for dtype in (torch.bfloat16, torch.float16):
        allowed = sdpa_backends(torch.device("cuda"), dtype)
        assert SDPBackend.CUDNN_ATTENTION not in allowed and SDPBackend.EFFICIENT_ATTENTION in allowed


def test_token_store_once_per_tokenizer_refused_on_mismatch(tmp_path):
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.model.token_store import TokenStore, TokenStoreError, ensure_token_store, tokenizer_fingerprint
    from tests.helpers_model import staged_demo_and_tiny_model

    staged, model_dir = staged_demo_and_tiny_model(
        str(tmp_path), ("feature_dim=8", "demo.images.num_images=12", "demo.expected_images=12",
                        "demo.expected_captions=60"), feature_dim=8)
    from retrieval_core.model.network import VLRetrievalModel

    model = VLRetrievalModel.load(model_dir)
    ds = StagedDataset(staged)
    summary_before = open(os.path.join(staged, "summary.json")).read()
    col = model.text_collator()
    store = ensure_token_store(ds, col)
    assert open(os.path.join(staged, "summary.json")).read() == summary_before  # staged content untouched
    rel = ds.shard_names("captions")[0]
    cids, ids = store.read_shard(rel)
    table = ds.read_shard_columns(rel, ("caption_id", "text"))
    assert cids.tolist() == table.column("caption_id").to_pylist()
    for a, b in zip(ids, col.ids(table.column("text").to_pylist())):
        np.testing.assert_array_equal(a, b)
    model.tokenizer(["a dog"], truncation=True, max_length=3)  # a call's settings are not the tokenizer's
    assert tokenizer_fingerprint(model.text_collator()) == store.fingerprint
    from pipelines.handlers import TASK_SCORE_PAIRS, VLModelHandler
    VLModelHandler(model_dir, TASK_SCORE_PAIRS, token_fingerprint=store.fingerprint).load_model()
    with pytest.raises(ValueError, match="other words"):
        VLModelHandler(model_dir, TASK_SCORE_PAIRS, token_fingerprint="0" * 16).load_model()
    # another truncation length is another tokenizer: its own folder, never the other's ids
    other = TextCollator(model.tokenizer, max_len=5)
    assert tokenizer_fingerprint(other) != store.fingerprint
    with pytest.raises(TokenStoreError, match="no token-id store"):
        TokenStore(ds, tokenizer_fingerprint(other))
    # ids made from another version of a caption shard are refused
    npz = [f for f in os.listdir(store.root) if f.endswith(".npz")][0]
    with np.load(os.path.join(store.root, npz)) as z:
        parts = {k: z[k] for k in z.files}
    parts["source_sha256"] = np.str_("0" * 64)
    np.savez(os.path.join(store.root, npz), **parts)
    with pytest.raises(TokenStoreError, match="rebuild"):
        ensure_token_store(StagedDataset(staged), col)


def test_jobs_serve_bf16_on_cuda_and_float32_on_cpu_by_default():
    from pipelines.rerank.plan import RerankPlan
    from retrieval_core import precision

    assert precision.resolve_quantize("auto", "cuda", cuda_bf16=True) == "bf16"
    assert precision.resolve_quantize("auto", "cuda", cuda_bf16=False) == "none"  # a card without native bf16
    assert precision.resolve_quantize("auto", "cpu", cuda_bf16=True) == "none"
    assert precision.resolve_quantize("int8", "cpu", cuda_bf16=True) == "int8"
    ce = dict(staged="s", embeddings="e", output="o", mode="co", ce_model="ce")
    assert RerankPlan(**ce).precision == "none"
    if not torch.cuda.is_available() or torch.cuda.is_bf16_supported(including_emulation=False):
        assert RerankPlan(**ce, device="cuda").precision == "bf16"
    assert RerankPlan(**ce, device="cuda", quantize="none").precision == "none"
    assert RerankPlan(staged="s", embeddings="e", output="o", mode="emb", device="cuda").precision == "none"


def test_a_batch_size_sweep_names_the_fastest_job_path_size_per_task_and_precision():

    from benchmarks.meters.feeding import WAYS, best_batch_sizes, parse_sizes

    def row(task, precision, bs, way, rate):
        return {"collection": f"feeding_{task}", "mode": f"{task}: {WAYS[way]}", "quantize": precision,
                "batch_size": bs, "rate_per_s": rate}

    rows = [row("pairs", "fp32", 32, "job", 400.0), row("pairs", "fp32", 64, "job", 450.0),
            row("pairs", "fp32", 128, "job", 440.0), row("pairs", "fp32", 128, "model", 900.0),
            row("images", "bf16", 32, "job", 2000.0), row("images", "bf16", 64, "job", 1900.0)]
    assert best_batch_sizes(rows) == {("pairs", "fp32"): (64, 450.0), ("images", "bf16"): (32, 2000.0)}
    assert best_batch_sizes(rows, way="model") == {("pairs", "fp32"): (128, 900.0)}
    assert parse_sizes("16, 32,64") == (16, 32, 64) and parse_sizes("") == ()
    with pytest.raises(ValueError, match="positive integers"):
        parse_sizes("16,0")

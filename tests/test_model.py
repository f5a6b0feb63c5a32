import json
import os

import numpy as np
import pytest
import torch
from transformers import BertConfig

from retrieval_core.model.backbones import minilm_path
from retrieval_core.model.checkpoints import CheckpointError, from_text_backbone, load_mmt_retrieval, load_oscar
from retrieval_core.model.collate import TextCollator, collate_images, collate_pairs
from retrieval_core.model.network import VLModelConfig, VLRetrievalModel, ce_agreement_default
from retrieval_core.training.losses import batch_hard_triplet_loss, ce_pair_loss
from tests.helpers_model import make_tiny_dataset, tiny_model, write_tiny_bert

F = 16


@pytest.fixture(scope="module")
def data():
    return make_tiny_dataset(num_images=12, feature_dim=F, seed=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("m")), feature_dim=F)


def test_collate_images_pads_per_batch_and_keeps_first_regions():
    a = (np.ones((3, F), np.float32), np.full((3, 6), 0.5, np.float32))
    b = (np.arange(7 * F, dtype=np.float32).reshape(7, F), np.zeros((7, 6), np.float32))
    out = collate_images([a, b], max_regions=5)
    assert out["img_feats"].shape == (2, 5, F) and out["img_boxes"].shape == (2, 5, 6)
    assert out["img_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert torch.equal(out["img_feats"][1], torch.from_numpy(b[0][:5]))  # the first (most confident) five
    assert out["img_feats"].dtype == torch.float32
    with pytest.raises(ValueError, match="no regions"):
        collate_images([(np.zeros((0, F), np.float32), np.zeros((0, 6), np.float32))])
    with pytest.raises(ValueError, match="boxes"):
        collate_images([(np.zeros((2, F), np.float32), np.zeros((2, 4), np.float32))])


def test_text_collator_pads_to_longest(model):
    col = TextCollator(model.tokenizer, max_len=6)
    out = col(["a dog", "a red dog and a blue cat and a green bird"])
    assert out["input_ids"].shape == (2, 6)  # truncated to max_len, [CLS]/[SEP] included
    out = col(["a dog", "a red dog"])
    assert out["input_ids"].shape == (2, 5) and out["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1] * 5]


def test_embeddings_are_normalised_and_padding_invariant(model, data):
    captions, images = data
    texts = captions["text"].tolist()
    together = model.encode_text(texts, batch_size=8)
    alone = np.stack([model.encode_text([t])[0] for t in texts[:4]])
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(together[:4], alone, atol=1e-5)
    img_all = model.encode_image(images, batch_size=5)
    img_one = model.encode_image([images.regions(0)])
    np.testing.assert_allclose(img_all[0], img_one[0], atol=1e-5)
    assert img_all.shape == (len(images), model.embedding_dim) and img_all.dtype == np.float32
    scores = model.score(texts[:6], images.take(range(6)))  # an ImageTable works as well as a list
    one = model.score([texts[2]], [images.regions(2)])
    assert scores.shape == (6,) and scores[2] == pytest.approx(one[0], abs=1e-5)


def test_gradients_reach_the_image_projection(model, data):
    captions, images = data
    model.train()
    col = model.text_collator()
    texts = captions["text"].tolist()[:4]
    regions = [images.regions(i // 2) for i in range(4)]  # 2 captions per image
    ids = torch.tensor([i // 2 for i in range(4)])
    model.zero_grad()
    loss = batch_hard_triplet_loss(model.embed_text(col(texts)), model.embed_image(collate_images(regions)), ids,
                                   margin=0.5)
    loss.backward()
    assert model.img_embedding.weight.grad is not None and model.img_embedding.weight.grad.abs().sum() > 0
    model.zero_grad()
    batch = collate_pairs(col, texts, regions)
    ce_pair_loss(model.ce_logits(batch), torch.tensor([1, 0, 1, 0])).backward()
    assert model.img_embedding.weight.grad.abs().sum() > 0
    assert model.ce_classifier.weight.grad.abs().sum() > 0
    model.zero_grad()
    model.eval()


def test_ce_layer_states_are_the_states_ce_logits_reads(model, data):
    """The probe's view (benchmarks.probes.binding_probe) is the CE's own: its last layer's [CLS] through the pooler and
    classifier gives ce_logits; one state per layer plus the input tokens, caption positions first."""
    captions, images = data
    model.eval()
    texts = captions["text"].tolist()[:4]
    batch = collate_pairs(model.text_collator(), texts, [images.regions(i // 2) for i in range(4)])
    states = model.ce_layer_states(batch)
    assert len(states) == model.bert.config.num_hidden_layers + 1
    assert states[0].shape[1] == batch["input_ids"].shape[1] + batch["img_feats"].shape[1]
    cls = states[-1][:, 0]
    if model.ce_pooler is not None:
        cls = torch.tanh(model.ce_pooler(cls))
    with torch.no_grad():
        torch.testing.assert_close(model.ce_classifier(cls), model.ce_logits(batch))
    assert not any(layer._forward_hooks for layer in model.bert.encoder.layer)  # hooks removed


@pytest.mark.parametrize("kind", ["mean", "maxsim"])
def test_ce_agreement_adds_its_scaled_term_of_the_states_entering_the_last_layer(model, data, tmp_path, kind):
    """With an agreement term the match logit gains s * agreement of the states entering the last layer
    (ce_layer_states[-2]), computed by hand here - mean: cos(mean caption state, mean region state); maxsim: the
    mean over caption tokens of their best cosine with a real region; the [CLS] logits stay the CE's own, and
    save/load keeps the term and its scale."""
    captions, images = data
    agreeing = VLRetrievalModel(model.bert.config, VLModelConfig(**{**model.cfg.__dict__, "ce_agreement": kind}),
                                model.tokenizer)
    missing, unexpected = agreeing.load_state_dict(model.state_dict(), strict=False)
    assert missing == ["ce_agreement_log_scale"] and not unexpected
    with torch.no_grad():
        agreeing.ce_agreement_log_scale.fill_(np.log(3.0))
    agreeing.eval()
    model.eval()
    texts = captions["text"].tolist()[:6]
    regions = [images.regions(i) for i in (0, 5, 1, 3, 2, 2)]
    batch = collate_pairs(model.text_collator(), texts, regions)
    entering = agreeing.ce_layer_states(batch)[-2].double()
    n_text = batch["input_ids"].shape[1]
    by_hand = []
    for row in range(len(texts)):
        t = entering[row, :n_text][batch["attention_mask"][row].bool()]
        r = entering[row, n_text:][batch["img_mask"][row].bool()]
        assert len(r) == min(len(regions[row][0]), model.cfg.max_regions)
        if kind == "mean":
            by_hand.append(torch.nn.functional.cosine_similarity(t.mean(0), r.mean(0), dim=0))
        else:
            cos = torch.nn.functional.normalize(t, dim=-1) @ torch.nn.functional.normalize(r, dim=-1).T
            by_hand.append(cos.max(1).values.mean())
    by_hand = 3.0 * torch.stack(by_hand)
    with torch.no_grad():
        plain, agreed = model.ce_logits(batch), agreeing.ce_logits(batch)
    torch.testing.assert_close(agreed[:, 0], plain[:, 0])
    torch.testing.assert_close((agreed[:, 1] - plain[:, 1]).double(), by_hand, atol=1e-5, rtol=1e-5)
    assert by_hand.std() > 0  # the pairs differ: the test would see a term that ignored its input
    agreeing.save(str(tmp_path / "a"))
    again = VLRetrievalModel.load(str(tmp_path / "a"))
    assert again.cfg.ce_agreement == kind
    assert float(again.ce_agreement_log_scale.detach()) == pytest.approx(np.log(3.0))
    with torch.no_grad():
        torch.testing.assert_close(again.ce_logits(batch), agreed)
    assert VLModelConfig.from_json({"feature_dim": F}).ce_agreement == "none"  # folders written before it: none
    with pytest.raises(ValueError, match="ce_agreement must be one of"):
        VLModelConfig(feature_dim=F, ce_agreement="max")


def test_one_rule_gives_the_ce_agreement_default(tmp_path):
    """New models maxsim; converted checkpoints and the multilingual recipes none; a model folder its own; a
    model built from a backbone without a term named gets the new models' one."""
    assert [ce_agreement_default(o) for o in ("new", "converted")] == ["maxsim", "none"]
    assert ce_agreement_default("folder", "mean") == "mean" and ce_agreement_default("folder") == "none"
    with pytest.raises(ValueError, match="origin must be one of"):
        ce_agreement_default("backbone")
    assert from_text_backbone(write_tiny_bert(str(tmp_path / "b")), feature_dim=F).cfg.ce_agreement == "maxsim"


def _outputs(m, data):
    captions, images = data
    texts = captions["text"].tolist()
    return (m.encode_text(texts), m.encode_image(images),
            m.score(texts, [images.regions(i // 2) for i in range(len(texts))]))


def test_save_load_save_load_is_bit_identical(model, data, tmp_path):
    model.save(str(tmp_path / "a"))
    a = VLRetrievalModel.load(str(tmp_path / "a"))
    a.save(str(tmp_path / "b"))
    b = VLRetrievalModel.load(str(tmp_path / "b"))
    for x, y, z in zip(_outputs(model, data), _outputs(a, data), _outputs(b, data)):
        assert np.array_equal(x, y) and np.array_equal(y, z)
    cfg = json.load(open(tmp_path / "b" / "rr_model.json"))
    assert cfg["feature_dim"] == F and cfg["provenance"]["init"] == "text_backbone"
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "b" / name).is_file()


def _oscar_like_model(tmp_path, use_img_layernorm: bool):
    folder = write_tiny_bert(str(tmp_path / "bert"))
    from transformers import AutoTokenizer
    torch.manual_seed(3)
    cfg = VLModelConfig(feature_dim=F, image_token_type=False, image_layer_norm=use_img_layernorm, ce_agreement="none")
    m = VLRetrievalModel(BertConfig.from_pretrained(folder), cfg, AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():  # non-trivial LayerNorm / bias values so a wrong mapping shows
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval(), folder


def _oscar_keys(m):
    """Our weights under OSCAR's names (BertImgModel inside ImageBertForSequenceClassification)."""
    sd = m.state_dict()
    out = {}
    for k, v in sd.items():
        if k.startswith("bert."):
            out[k] = v
        elif k.startswith("img_embedding."):
            out["bert." + k] = v
        elif k.startswith("img_layer_norm."):
            out["bert.LayerNorm." + k.split(".")[-1]] = v
        elif k.startswith("ce_pooler."):
            out["bert.pooler.dense." + k.split(".")[-1]] = v
        elif k.startswith("ce_classifier."):
            out["classifier." + k.split(".")[-1]] = v
    out["bert.embeddings.position_ids"] = torch.arange(128)[None]  # serialised by old transformers
    return out


def _write_bert_config(folder, src_folder, use_img_layernorm):
    cfg = json.load(open(os.path.join(src_folder, "config.json")))
    cfg.update(img_feature_dim=F + 6, img_feature_type="faster_r-cnn", use_img_layernorm=int(use_img_layernorm),
               img_layer_norm_eps=1e-12, num_labels=2)
    os.makedirs(folder, exist_ok=True)
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src_folder, name), "rb") as src, open(os.path.join(folder, name), "wb") as dst:
            dst.write(src.read())


def test_load_mmt_retrieval_layout_reproduces_outputs(tmp_path, data):
    orig, bert_folder = _oscar_like_model(tmp_path, use_img_layernorm=True)
    root = tmp_path / "mmt"
    keys = _oscar_keys(orig)
    _write_bert_config(str(root / "0_OSCAR"), bert_folder, True)
    trunk = {k: v for k, v in keys.items() if k.startswith("bert.")}
    torch.save(trunk, root / "0_OSCAR" / "pytorch_model.bin")
    json.dump({"max_seq_length": 70, "max_image_seq_len": 50},
              open(root / "0_OSCAR" / "sentence_bert_config.json", "w"))
    (root / "1_ClassificationHead").mkdir()
    torch.save({k: v for k, v in keys.items() if k.startswith("classifier.")},
               root / "1_ClassificationHead" / "class_head.pt")
    json.dump({"num_labels": 2, "input_key": "pooled_cls_token_embeddings", "input_dim": 32,
               "classifier_type": "linear", "scaling_factor": 2, "dropout": 0.1},
              open(root / "1_ClassificationHead" / "sentence_bert_config.json", "w"))
    (root / "2_Pooling").mkdir()
    json.dump({"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False},
              open(root / "2_Pooling" / "config.json", "w"))
    json.dump([{"idx": 0, "name": "0", "path": "0_OSCAR", "type": "mmt_retrieval.model.models.OSCAR"},
               {"idx": 1, "name": "1", "path": "1_ClassificationHead",
                "type": "mmt_retrieval.model.models.ClassificationHead"},
               {"idx": 2, "name": "2", "path": "2_Pooling", "type": "mmt_retrieval.model.models.Pooling"}],
              open(root / "modules.json", "w"))
    loaded = load_mmt_retrieval(str(root))
    assert loaded.feature_dim == F and loaded.cfg.provenance["heads_trained"] == ["be", "ce"]
    # MMT's max_seq_length of 70 word pieces excludes [CLS] and [SEP]; MMT ranks CE pairs by logit 1
    assert loaded.cfg.max_text_len == 72 and loaded.cfg.ce_score == "logit1"
    orig.cfg.max_text_len, orig.cfg.ce_score = 72, "logit1"
    for x, y in zip(_outputs(orig, data), _outputs(loaded, data)):
        np.testing.assert_array_equal(x, y)

    # an unknown key is an error that names it
    trunk["bert.mystery.weight"] = torch.zeros(2)
    torch.save(trunk, root / "0_OSCAR" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="mystery"):
        load_mmt_retrieval(str(root))


def test_load_oscar_layout_reproduces_outputs(tmp_path, data):
    orig, bert_folder = _oscar_like_model(tmp_path, use_img_layernorm=False)
    folder = tmp_path / "oscar"
    _write_bert_config(str(folder), bert_folder, False)
    keys = _oscar_keys(orig)
    torch.save(keys, folder / "pytorch_model.bin")
    loaded = load_oscar(str(folder))
    assert loaded.cfg.image_token_type is False and loaded.cfg.image_layer_norm is False
    for x, y in zip(_outputs(orig, data), _outputs(loaded, data)):
        np.testing.assert_array_equal(x, y)
    del keys["classifier.weight"]
    torch.save(keys, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="ce_classifier.weight"):
        load_oscar(str(folder))


def test_halving_keeps_even_layers(tmp_path):
    folder = write_tiny_bert(str(tmp_path / "b4"), num_layers=4)
    full = from_text_backbone(folder, feature_dim=F)
    half = from_text_backbone(folder, feature_dim=F, keep_every_other_layer=True)
    assert half.bert.config.num_hidden_layers == 2 and len(half.bert.encoder.layer) == 2
    for new, old in ((0, 0), (1, 2)):
        a = half.bert.encoder.layer[new].attention.self.query.weight
        b = full.bert.encoder.layer[old].attention.self.query.weight
        assert torch.equal(a, b)


def test_minilm_backbone_loads():
    try:
        path = minilm_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    m = from_text_backbone(path, feature_dim=8, keep_every_other_layer=True)
    assert m.embedding_dim == 384 and m.bert.config.num_hidden_layers == 3
    assert "ce_pooler" not in m.cfg.provenance["newly_initialised"]  # initialised from MiniLM's pooler
    e = m.encode_text(["a dog on a beach", "a red bus"])
    assert e.shape == (2, 384) and abs(float(e[0] @ e[1])) < 0.99


def test_quantize_refused_off_cpu_and_flop_count_of_a_layer():
    from types import SimpleNamespace

    from pipelines.encode.plan import EncodeError, EncodePlan
    from retrieval_core.model.flops import layer_gemm_shapes, sequence_flops
    from retrieval_core.model.quantize import quantize_model

    lin = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert quantize_model(lin, "none") is lin
    with pytest.raises(ValueError, match="CPU only"):
        quantize_model(lin, "int8", device="cuda")
    with pytest.raises(ValueError, match="quantize must be"):
        quantize_model(lin, "int4")
    with pytest.raises(EncodeError, match="CPU only"):
        EncodePlan("s", "m", "o", device="cuda", quantize="int8")
    assert EncodePlan("s", "m", "o", device="cuda", quantize="bf16").quantize == "bf16"  # CUDA runs bf16
    cfg = SimpleNamespace(hidden_size=8, intermediate_size=32, num_hidden_layers=2)
    # per layer: the dense GEMMs' 2*M*K*N plus QK^T and AV (2 * 2 * L^2 * h)
    dense = sum(2 * m * k * n for m, k, n in layer_gemm_shapes(cfg, 5))
    assert sequence_flops(cfg, 5) == 2 * (dense + 4 * 25 * 8)


def test_bf16_serving_runs_the_heads_in_bf16_and_is_refused_where_the_cpu_emulates_it(tmp_path, monkeypatch):
    """--quantize bf16: the same model object, its weights in bfloat16 (outputs float32, close to float32's but
    not equal); refused on a CPU without native bf16 (there it is slower than float32)."""
    from retrieval_core.model import quantize as quantize_mod
    from retrieval_core.model.collate import collate_images, collate_pairs
    from retrieval_core.model.network import VLRetrievalModel
    from retrieval_core.model.quantize import quantize_model
    model_dir = str(tmp_path / "m")
    tiny_model(str(tmp_path)).save(model_dir)
    fp32 = VLRetrievalModel.load(model_dir)
    texts = ["a red dog on a blue car", "two cats", "a green bus near a white house and a brown horse"]
    rng = np.random.default_rng(0)
    regions = [(rng.standard_normal((n, fp32.feature_dim)).astype(np.float32), rng.random((n, 6)).astype(np.float32))
               for n in (3, 5, 2)]
    batches = {"embed_text": fp32.text_collator()(texts), "embed_image": collate_images(regions, 8),
               "score_pairs": collate_pairs(fp32.text_collator(), texts, regions, 8)}
    with torch.inference_mode():
        ref = {name: getattr(fp32, name)(b) for name, b in batches.items()}
    monkeypatch.setattr(quantize_mod, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(ValueError, match="native bf16"):
        quantize_model(VLRetrievalModel.load(model_dir), "bf16")
    monkeypatch.setattr(quantize_mod, "cpu_has_native_bf16", lambda: True)
    loaded = VLRetrievalModel.load(model_dir)
    bf16 = quantize_model(loaded, "bf16")
    assert bf16 is loaded and {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.attention == "eager" and fp32.attention == "sdpa"  # measured faster in bf16 on CPU
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    with torch.inference_mode():
        for name, b in batches.items():
            got = getattr(bf16, name)(b)
            diff = (got - ref[name]).abs().max().item()
            assert got.dtype == torch.float32 and 0 < diff < 0.05, (name, diff)
    with pytest.raises(ValueError, match="applies to VLRetrievalModel"):
        quantize_model(torch.nn.Linear(2, 2), "bf16")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_packed_encoder_equals_the_padded_one_and_the_ce_reads_cls_alone(model, data, attention):
    """_encode runs the dense layers on the real tokens only and, for the CE, the last layer for [CLS] alone:
    at every real position the states of transformers' own padded BertEncoder (float32, within 1e-5), zeros at
    padded ones, for a CE batch padded inside its stream (caption, then regions) and a BE caption batch."""
    captions, images = data
    model.eval()
    model.set_attention(attention)
    texts = captions["text"].tolist()[:6]
    regions = [images.regions(i % 3) for i in range(6)]
    regions[1] = (regions[1][0][:2], regions[1][1][:2])
    pairs = collate_pairs(model.text_collator(), texts, regions, 4)
    assert pairs["attention_mask"].min() == 0 and pairs["img_mask"].min() == 0  # padding in both segments
    try:
        with torch.no_grad():
            for tokens, mask in (model._ce_input(pairs), (model._text_tokens(model.text_collator()(texts)["input_ids"]),
                                                          model.text_collator()(texts)["attention_mask"])):
                padded = model.bert.encoder(tokens, attention_mask=model._additive_mask(tokens, mask)).last_hidden_state
                packed = model._encode(tokens, mask, "ce")
                real = mask.bool()
                torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=1e-5)
                assert not packed[~real].any()
            tokens, mask = model._ce_input(pairs)
            cls = model._encode(tokens, mask, "ce", cls_only=True)
            assert cls.shape == (6, 1, model.embedding_dim)
            torch.testing.assert_close(cls, padded_cls := model.bert.encoder(
                tokens, attention_mask=model._additive_mask(tokens, mask)).last_hidden_state[:, :1], rtol=0, atol=1e-5)
            pooled = torch.tanh(model.ce_pooler(padded_cls[:, 0])) if model.ce_pooler is not None else padded_cls[:, 0]
            torch.testing.assert_close(model.ce_logits(pairs), model.ce_classifier(pooled), rtol=0, atol=1e-5)
    finally:
        model.set_attention("sdpa")


def test_packed_training_gradients_equal_the_padded_ones(model, data):
    """Packing is arithmetic, not approximation: with dropout off, the gradients of a CE loss through the packed
    encoder equal those through transformers' padded one (float32, within 1e-5)."""
    captions, images = data
    texts = captions["text"].tolist()[:4]
    regions = [images.regions(i % 3) for i in range(4)]
    regions[0] = (regions[0][0][:2], regions[0][1][:2])
    pairs = collate_pairs(model.text_collator(), texts, regions, 4)
    model.eval()  # dropout off: both paths see the same arithmetic
    grads = []
    for packed in (True, False):
        model.zero_grad()
        tokens, mask = model._ce_input(pairs)
        if packed:
            cls = model._encode(tokens, mask, "ce", cls_only=True)[:, 0]
        else:
            cls = model.bert.encoder(tokens, attention_mask=model._additive_mask(tokens, mask)).last_hidden_state[:, 0]
        model.ce_classifier(torch.tanh(model.ce_pooler(cls))).logsumexp(1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad()
    assert grads[0].keys() == grads[1].keys() and "img_embedding.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-5, msg=name)


def test_sdpa_attention_is_the_default_and_equals_the_eager_path(model, data, tmp_path):
    """The encoder runs PyTorch's fused scaled_dot_product_attention (attn_implementation "sdpa"), also after a
    save/load; the eager path gives the same BE embeddings and CE scores within float32 rounding (1e-5)."""
    from retrieval_core.model.network import ATTENTION_IMPLEMENTATIONS

    assert model.attention == "sdpa" and ATTENTION_IMPLEMENTATIONS == ("sdpa", "eager")
    model.save(str(tmp_path / "m"))
    loaded = VLRetrievalModel.load(str(tmp_path / "m"))
    assert loaded.attention == "sdpa"
    sdpa = _outputs(loaded, data)
    loaded.set_attention("eager")
    assert loaded.attention == "eager" and loaded.bert.encoder.layer[0].attention.self.config._attn_implementation \
        == "eager"
    for a, b in zip(sdpa, _outputs(loaded, data)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="attention must be one of"):
        loaded.set_attention("flash")


def test_token_counts_measure_the_padding_the_encoder_runs(model, data):
    """model.token_counts: useful (mask 1) and computed (B x L) positions of every sequence encoded, per head."""
    from retrieval_core.model.collate import TokenCounts

    captions, images = data
    texts = ["a dog", "a red dog and a blue cat"]
    regions = [images.regions(0), (images.regions(1)[0][:1], images.regions(1)[1][:1])]
    model.reset_token_counts()
    model.encode_text(texts, batch_size=2)
    mask = model.text_collator()(texts)["attention_mask"]
    assert (model.token_counts["be"].useful, model.token_counts["be"].computed) == (int(mask.sum()), mask.numel())
    model.token_counts["be"] = TokenCounts()
    model.encode_image(regions, batch_size=2)
    width = min(len(images.regions(0)[0]), model.cfg.max_regions)
    assert (model.token_counts["be"].useful, model.token_counts["be"].computed) == (2 + width + 1, 2 * (1 + width))
    assert model.token_counts["be"].fraction == pytest.approx((width + 3) / (2 * width + 2))
    assert model.token_counts["ce"].computed == 0
    model.score(texts, regions, batch_size=2)
    assert (model.token_counts["ce"].useful, model.token_counts["ce"].computed) == \
        (int(mask.sum()) + width + 1, 2 * (mask.shape[1] + width))


def test_flop_counts_of_the_cls_only_layer_and_of_training_steps(model):
    """The CE's FLOPs count its last layer as run (keys and values of every token, the rest for [CLS]); a
    training step is 3x the forward (2x for the region projection, whose input needs no gradient)."""
    from types import SimpleNamespace

    from retrieval_core.model.flops import model_flops, sequence_flops
    from retrieval_core.training.config import TrainConfig
    from retrieval_core.training.trainer import step_flops

    cfg = SimpleNamespace(hidden_size=8, intermediate_size=32, num_hidden_layers=2)
    full = sequence_flops(cfg, 5)
    last = 2 * 5 * 2 * 64 + 2 * (2 * 64 + 2 * 8 * 32) + 4 * 5 * 8  # K, V over 5 tokens; Q, out, FFN for one
    assert sequence_flops(cfg, 5, cls_only=True) == full / 2 + last
    proj = 2 * 4 * (model.feature_dim + 6) * model.embedding_dim
    assert model_flops(model, "image", regions=4, training=True) == \
        3 * (model_flops(model, "image", regions=4) - proj) + 2 * proj
    tc = TrainConfig(batch_size=4, ce_batch_size=2, ce_negatives=3)
    f = step_flops(model, tc, text_tokens=7, regions=4, images=3)
    assert f["be"] == 4 * model_flops(model, "text", 7, training=True) + 3 * model_flops(model, "image", 0, 4, True)
    assert f["ce"] == 2 * 4 * model_flops(model, "pair", 7, 4, training=True) and f["joint"] == f["be"] + f["ce"]

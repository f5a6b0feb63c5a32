"""Any model folder wherever a model is taken: checkpoints.inspect_model_folder / load_model_folder, and the
encode and rerank CLIs run on a hand-built MMT-Retrieval folder and on a training-free baseline folder."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from pipelines.encode import run as encode_run
from pipelines.rerank import run as rerank_run
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.baseline import MappedBaseline
from retrieval_core.model.checkpoints import CheckpointError, inspect_model_folder, load_model_folder
from retrieval_core.search import embeddings
from tests.helpers_model import make_tiny_dataset, write_tiny_bert
from tests.test_encode_pipeline import write_tiny_model, write_tiny_staged
from tests.test_model import F, _oscar_keys, _oscar_like_model, _write_bert_config


def write_mmt_folder(root, tmp, heads=("be", "ce"), max_seq_length=None):
    """An MMT-Retrieval sentence-transformers folder as UKPLab's code saves it: modules.json, 0_OSCAR/ (BERT
    config with img_feature_dim, weights), 1_ClassificationHead/ (class_head.pt), 2_Pooling/ (mean)."""
    orig, bert_folder = _oscar_like_model(tmp, use_img_layernorm=True)
    keys = _oscar_keys(orig)
    _write_bert_config(str(root / "0_OSCAR"), bert_folder, True)
    torch.save({k: v for k, v in keys.items() if k.startswith("bert.")}, root / "0_OSCAR" / "pytorch_model.bin")
    if max_seq_length is not None:
        json.dump({"max_seq_length": max_seq_length, "max_image_seq_len": 50},
                  open(root / "0_OSCAR" / "sentence_bert_config.json", "w"))
    modules = [{"idx": 0, "name": "0", "path": "0_OSCAR", "type": "mmt_retrieval.model.models.OSCAR"}]
    if "ce" in heads:
        (root / "1_ClassificationHead").mkdir()
        torch.save({k: v for k, v in keys.items() if k.startswith("classifier.")},
                   root / "1_ClassificationHead" / "class_head.pt")
        json.dump({"num_labels": 2, "input_key": "pooled_cls_token_embeddings", "classifier_type": "linear"},
                  open(root / "1_ClassificationHead" / "sentence_bert_config.json", "w"))
        modules.append({"idx": 1, "name": "1", "path": "1_ClassificationHead",
                        "type": "mmt_retrieval.model.models.ClassificationHead"})
    if "be" in heads:
        (root / "2_Pooling").mkdir()
        json.dump({"pooling_mode_mean_tokens": True}, open(root / "2_Pooling" / "config.json", "w"))
        modules.append({"idx": 2, "name": "2", "path": "2_Pooling", "type": "mmt_retrieval.model.models.Pooling"})
    json.dump(modules, open(root / "modules.json", "w"))
    return str(root)


def test_mmt_folders_cut_captions_as_mmt_does(tmp_path):
    long_text = " ".join(["a"] * 40)
    cut = load_model_folder(write_mmt_folder(tmp_path / "m5", tmp_path / "t5", max_seq_length=5))
    assert cut.text_collator()([long_text])["input_ids"].shape[1] == 5 + 2  # + [CLS] and [SEP], as MMT
    default = load_model_folder(write_mmt_folder(tmp_path / "md", tmp_path / "td"))  # no sentence_bert_config
    assert default.cfg.max_text_len == 128 + 2 and default.cfg.ce_score == "logit1"
    native = load_model_folder(write_mmt_folder(tmp_path / "mn", tmp_path / "tn"), ce_score="logit_diff")
    assert native.cfg.ce_score == "logit_diff"


def test_each_kind_is_recognised_and_a_missing_head_is_refused(tmp_path):
    native = write_tiny_model(str(tmp_path / "native"), str(tmp_path))
    be_only = write_mmt_folder(tmp_path / "be_only", tmp_path / "t1", heads=("be",))
    oscar = write_oscar_folder(tmp_path / "oscar", tmp_path / "t2")
    kinds = {p: inspect_model_folder(str(p)) for p in (native, be_only, oscar)}
    assert [k.kind for k in kinds.values()] == ["native", "mmt_retrieval", "oscar"]
    assert kinds[be_only].heads == ("be",) and kinds[oscar].heads == ("ce",)
    # an embedding-only folder used as a CE is refused, not given a random classifier
    with pytest.raises(CheckpointError, match="no trained a cross-encoder"):
        load_model_folder(be_only, need=("ce",))
    with pytest.raises(CheckpointError, match="bi-encoder"):
        load_model_folder(oscar, need=("be",))
    assert load_model_folder(oscar, need=("ce",)).cfg.ce_score == "logit_diff"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a model folder.*modules.json"):
        inspect_model_folder(str(tmp_path / "empty"))
    os.remove(os.path.join(be_only, "modules.json"))  # an MMT folder without modules.json: named, not bare
    with pytest.raises(CheckpointError, match="not a model folder"):
        load_model_folder(be_only)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    return write_tiny_staged(str(tmp_path_factory.mktemp("folders") / "staged"), num_images=12)


def _encode_cli(staged, model, out):
    return CliRunner().invoke(encode_run.main, ["--staged", staged, "--model", model, "--output", out,
                                            "--batch-size", "4"])


def test_encode_and_rerank_clis_take_an_mmt_folder(staged, tmp_path):
    mmt = write_mmt_folder(tmp_path / "mmt", tmp_path / "t", max_seq_length=8)
    out = str(tmp_path / "emb")
    res = _encode_cli(staged, mmt, out)
    assert res.exit_code == 0, res.output
    model = load_model_folder(mmt)
    ds = StagedDataset(staged)
    ids, vecs = embeddings.read_embeddings(out, "text")
    texts = ds.captions().set_index("caption_id")["text"]
    np.testing.assert_allclose(vecs, model.encode_text(texts.loc[ids].tolist()), atol=1e-5)

    run = str(tmp_path / "run")
    res = CliRunner().invoke(rerank_run.main, ["--staged", staged, "--embeddings", out, "--output", run,
                                           "--ce-model", mmt, "--mode", "co", "--k", "3", "--directions", "t2i"])
    assert res.exit_code == 0, res.output
    manifest = json.load(open(os.path.join(run, "rankings_manifest.json")))
    assert manifest["ce_score_key"] == "logit1"
    (name,) = [f for f in os.listdir(os.path.join(run, "rankings")) if f.startswith("t2i")]
    t2i = pq.read_table(os.path.join(run, "rankings", name)).to_pandas().dropna(subset=["ce_score"])
    expected = model.score(texts.loc[t2i["query_id"]].tolist(), ds.load_images(t2i["item_id"].tolist()))
    np.testing.assert_allclose(t2i["ce_score"].to_numpy(), expected, atol=1e-4)  # MMT's key: logit 1

    be_only = write_mmt_folder(tmp_path / "be_only", tmp_path / "t2", heads=("be",))
    assert _encode_cli(staged, be_only, str(tmp_path / "emb_be_only")).exit_code == 0  # a BE-only folder encodes
    res = CliRunner().invoke(rerank_run.main, ["--staged", staged, "--embeddings", out, "--output",
                                               str(tmp_path / "r2"),
                                           "--ce-model", be_only, "--mode", "co", "--k", "3"])
    assert res.exit_code == 1 and "cross-encoder" in res.output, res.output


def write_oscar_folder(root, tmp) -> str:
    """A raw OSCAR fine-tuned retrieval folder (ImageBertForSequenceClassification): a CE head only."""
    orig, bert_folder = _oscar_like_model(tmp, use_img_layernorm=False)
    _write_bert_config(str(root), bert_folder, False)
    torch.save(_oscar_keys(orig), root / "pytorch_model.bin")
    return str(root)


@pytest.mark.parametrize("layout", ["mmt_retrieval", "oscar"])
def test_a_cross_encoder_only_folder_reranks_through_pipelines_rerank(staged, tmp_path, layout):
    """What a user of the paper does: retrieve with one bi-encoder, rerank with a released CE-only folder (an
    MMT-Retrieval CE as its code saves it: OSCAR + ClassificationHead, no Pooling; or a raw OSCAR checkpoint)."""
    be = write_tiny_model(str(tmp_path / "be"), str(tmp_path))
    out = str(tmp_path / "emb")
    assert _encode_cli(staged, be, out).exit_code == 0
    if layout == "mmt_retrieval":
        ce = write_mmt_folder(tmp_path / "ce", tmp_path / "t", heads=("ce",))
    else:
        ce = write_oscar_folder(tmp_path / "ce", tmp_path / "t")
    assert inspect_model_folder(ce).heads == ("ce",)
    run = str(tmp_path / "run")
    res = CliRunner().invoke(rerank_run.main, ["--staged", staged, "--embeddings", out, "--output", run,
                                               "--ce-model", ce, "--mode", "co", "--k", "3"])
    assert res.exit_code == 0, res.output
    manifest = json.load(open(os.path.join(run, "rankings_manifest.json")))
    assert manifest["ce_model"] == ce and manifest["ce_score_key"] == ("logit1" if layout == "mmt_retrieval"
                                                                        else "logit_diff")
    model, ds = load_model_folder(ce, need=("ce",)), StagedDataset(staged)
    texts = ds.captions().set_index("caption_id")["text"]
    (name,) = [f for f in os.listdir(os.path.join(run, "rankings")) if f.startswith("t2i")]
    t2i = pq.read_table(os.path.join(run, "rankings", name)).to_pandas().dropna(subset=["ce_score"])
    expected = model.score(texts.loc[t2i["query_id"]].tolist(), ds.load_images(t2i["item_id"].tolist()))
    np.testing.assert_allclose(t2i["ce_score"].to_numpy(), expected, atol=1e-4)
    # the same folder cannot encode: it has no bi-encoder head
    res = _encode_cli(staged, ce, str(tmp_path / "emb2"))
    assert res.exit_code == 1 and "bi-encoder" in res.output, res.output


def test_encode_cli_takes_a_mapped_baseline_folder(staged, tmp_path):
    captions, images = make_tiny_dataset(num_images=12, feature_dim=F, seed=0, collection="tiny")
    text_model = write_tiny_bert(str(tmp_path / "bert"))
    base = MappedBaseline.fit(captions, images, text_model=text_model, method="lstsq")
    base.save(str(tmp_path / "baseline"))
    out = str(tmp_path / "emb")
    res = _encode_cli(staged, str(tmp_path / "baseline"), out)
    assert res.exit_code == 0, res.output
    ds = StagedDataset(staged)
    ids, vecs = embeddings.read_embeddings(out, "image")
    np.testing.assert_allclose(vecs, base.encode_image(ds.load_images(ids.tolist())), atol=1e-5)
    ids, vecs = embeddings.read_embeddings(out, "text")
    texts = ds.captions().set_index("caption_id")["text"]
    np.testing.assert_allclose(vecs, base.encode_text(texts.loc[ids].tolist()), atol=1e-5)
    # a baseline fitted on a backbone's grid features keeps its fingerprint and refuses region features
    base.image_backbone = "ab" * 32
    base.save(str(tmp_path / "grid_baseline"))
    assert MappedBaseline.load(str(tmp_path / "grid_baseline")).image_backbone == "ab" * 32
    assert inspect_model_folder(str(tmp_path / "grid_baseline")).image_backbone == "ab" * 32
    res = _encode_cli(staged, str(tmp_path / "grid_baseline"), str(tmp_path / "emb_grid"))
    assert res.exit_code != 0 and "but model" in res.output and "trained on the efficientnet-lite0" in res.output


def test_a_region_cap_below_what_the_model_reads_is_refused(staged, tmp_path):
    """A compact staging keeps the regions its models read; a model that reads more is refused by encode (and
    rerank, through the same check) where the cap cut images, naming both numbers."""
    model = write_tiny_model(str(tmp_path / "m"), str(tmp_path))
    reads = inspect_model_folder(model).max_regions
    capped = tmp_path / "capped"
    shutil.copytree(staged, capped)
    summary = json.load(open(capped / "summary.json"))
    summary["max_regions"] = reads - 1
    coll = next(iter(summary["collections"].values()))
    coll["images"]["region_cap"] = {"max_regions": reads - 1, "capped_images": 3, "policy": "confidence"}
    json.dump(summary, open(capped / "summary.json", "w"))
    res = _encode_cli(str(capped), model, str(tmp_path / "emb"))
    assert res.exit_code != 0
    assert f"keeps at most {reads - 1} regions per image (3 images cut)" in res.output
    assert f"reads up to {reads}: stage with --max-regions {reads} or more" in res.output
    coll["images"]["region_cap"]["capped_images"] = 0  # a cap that cut nothing changes nothing the model reads
    json.dump(summary, open(capped / "summary.json", "w"))
    assert StagedDataset(str(capped)).images_cut_below(reads) == 0
    del coll["images"]["region_cap"]  # a summary without the counts: unknown, refused
    json.dump(summary, open(capped / "summary.json", "w"))
    assert StagedDataset(str(capped)).images_cut_below(reads) is None
    assert StagedDataset(str(capped)).images_cut_below(reads - 1) == 0

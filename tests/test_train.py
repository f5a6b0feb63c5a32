import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, replace
from math import comb

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from retrieval_core.model.network import VLRetrievalModel, ce_agreement_default
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.dev_eval import evaluate
from retrieval_core.training.train import main
from retrieval_core.training.train_data import TrainData
from retrieval_core.training.trainer import Trainer
from tests.helpers_model import make_tiny_dataset, split_dataset, tiny_model

F = 16


@pytest.fixture(autouse=True)
def one_thread():
    # tiny matrices: thread hand-offs cost more than they save, and results stay reproducible
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data():
    caps, imgs = make_tiny_dataset(num_images=80, feature_dim=F, seed=0)
    return TrainData(*split_dataset(caps, imgs, "train")), TrainData(*split_dataset(caps, imgs, "dev"))


def chance_mr(n_images: int, captions_per_image: int, ks=(1, 5, 10)) -> float:
    """Expected mR of a random ranking (t2i: k/N; i2t: P(at least one of c captions in a random top-k))."""
    m = n_images * captions_per_image
    t2i = [100.0 * min(k, n_images) / n_images for k in ks]
    i2t = [100.0 * (1 - comb(m - captions_per_image, k) / comb(m, k)) for k in ks]
    return float(np.mean(t2i + i2t))


def _log(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "train_log.jsonl"))]


def test_joint_training_lowers_loss_and_beats_chance(tmp_path, data):
    train, dev = data
    model = tiny_model(str(tmp_path), feature_dim=F)
    before = evaluate(model, dev)["mR"]
    cfg = TrainConfig(objective="joint", steps=60, batch_size=16, lr=1e-3, eval_every=30, progress=False)
    result = Trainer(model, train, cfg, str(tmp_path / "out"), dev).train()
    log = _log(tmp_path / "out")
    be = [r["loss"] for r in log if r.get("objective") == "be"]
    ce = [r["loss"] for r in log if r.get("objective") == "ce"]
    assert len(be) == len(ce) == 60  # JOIN: one BE and one CE optimizer step per step
    assert np.mean(be[-15:]) < 0.8 * np.mean(be[:15])
    chance = chance_mr(n_images=20, captions_per_image=2)
    best = result["best_eval"]
    assert best["mR"] > chance + 10 and best["mR"] > before + 10, (best, chance, before)
    # best/ holds the selected model and reproduces its dev numbers
    reloaded = VLRetrievalModel.load(result["best_dir"])
    assert evaluate(reloaded, dev)["mR"] == pytest.approx(best["mR"])
    assert json.load(open(os.path.join(result["best_dir"], "eval.json")))["step"] == best["step"]
    assert {"step", "objective", "loss", "lr", "seconds"} <= set(log[0])
    assert [r["step"] for r in log if "eval" in r] == [30, 60]


def test_ce_start_step_and_listwise_groups(tmp_path, data):
    """JOIN with ce_start_step: BE-only steps first, then both; a listwise CE step scores (1 + n) pairs per caption
    of its own batch size and still learns."""
    train, dev = data
    model = tiny_model(str(tmp_path), feature_dim=F)
    cfg = TrainConfig(objective="joint", steps=12, batch_size=16, lr=1e-3, ce_loss="listwise", ce_negatives=3,
                      ce_batch_size=8, ce_start_step=5, progress=False)
    Trainer(model, train, cfg, str(tmp_path / "out"), None).train()
    log = [r for r in _log(tmp_path / "out") if "objective" in r]
    assert [r["step"] for r in log if r["objective"] == "ce"] == list(range(6, 13))
    assert [r["step"] for r in log if r["objective"] == "be"] == list(range(1, 13))
    first_ce = next(r for r in log if r["objective"] == "ce")["loss"]
    assert first_ce == pytest.approx(np.log(4), abs=0.3)  # a softmax over 4 candidates starts near ln 4
    with pytest.raises(ValueError, match="ce_start_step"):
        TrainConfig(objective="joint", steps=10, ce_start_step=10).check()
    with pytest.raises(ValueError, match="ce-loss"):
        TrainConfig(ce_loss="margin").check()


def test_be_every_runs_the_be_objective_on_every_nth_step_after_the_ce_starts(tmp_path, data):
    """JOIN with be_every=3: BE-only steps before ce_start_step, then the CE on every step and the BE on every third."""
    train, _ = data
    cfg = TrainConfig(objective="joint", steps=12, batch_size=16, lr=1e-3, ce_start_step=4, be_every=3,
                      progress=False)
    Trainer(tiny_model(str(tmp_path), feature_dim=F), train, cfg, str(tmp_path / "out"), None).train()
    log = [r for r in _log(tmp_path / "out") if "objective" in r]
    assert [r["step"] for r in log if r["objective"] == "ce"] == list(range(5, 13))
    assert [r["step"] for r in log if r["objective"] == "be"] == [1, 2, 3, 4, 5, 8, 11]
    with pytest.raises(ValueError, match="be_every"):  # a resumed run keeps the schedule it started with
        Trainer(tiny_model(str(tmp_path / "b"), feature_dim=F), train, replace(cfg, be_every=1),
                str(tmp_path / "out")).train(resume=True)


def test_freeze_word_embeddings_keeps_them_and_trains_the_rest(tmp_path, data):
    train, _ = data
    for freeze in (True, False):
        model = tiny_model(str(tmp_path / f"m{freeze}"), feature_dim=F)
        words = model.bert.embeddings.word_embeddings.weight.detach().clone()
        layer = model.bert.encoder.layer[0].attention.self.query.weight.detach().clone()
        cfg = TrainConfig(objective="joint", steps=3, batch_size=8, lr=1e-3, freeze_word_embeddings=freeze,
                          progress=False)
        Trainer(model, train, cfg, str(tmp_path / f"out{freeze}"), None).train()
        assert torch.equal(model.bert.embeddings.word_embeddings.weight, words) == freeze
        assert not torch.equal(model.bert.encoder.layer[0].attention.self.query.weight, layer)


def test_joint_ce_head_learns_to_rank_positives_first(tmp_path, data):
    # From a random tiny BERT the CE loss sits at ln 2 for ~200 steps before the cross-attention finds the
    # image-text link (a pretrained backbone gets there sooner); 500 steps take ~15 s on one thread.
    train, dev = data
    model = tiny_model(str(tmp_path), feature_dim=F)
    cfg = TrainConfig(objective="joint", steps=500, batch_size=16, lr=2e-3, image_init="lstsq", progress=False)
    result = Trainer(model, train, cfg, str(tmp_path / "out"), dev).train()
    ce = [r["loss"] for r in _log(tmp_path / "out") if r.get("objective") == "ce"]
    assert np.mean(ce[-50:]) < 0.5 < np.mean(ce[:50])
    # the CE scores the gold image above the other dev images for most (caption, other image) pairs: every dev
    # caption against every other dev image (760 pairs; chance 50 %), not a 40-pair sample
    best = VLRetrievalModel.load(result["best_dir"])
    img_pos = np.unique(dev.image_pos)
    regions = [dev.images.regions(int(p)) for p in img_pos]
    scores = np.stack([best.score([t] * len(img_pos), regions) for t in dev.texts])  # (captions, images)
    gold = np.searchsorted(img_pos, dev.image_pos)
    wins = scores[np.arange(len(gold)), gold][:, None] > scores
    others = np.ones_like(wins)
    others[np.arange(len(gold)), gold] = False
    # chance is 0.5. Seeds 0-5 measured 0.75-0.85 before the encoder skipped padding, 0.68-0.88 after (the same
    # arithmetic, but dropout masks fall on other draws: seed noise, mean 0.79 vs 0.78)
    assert wins[others].mean() > 0.65, wins[others].mean()


def test_infonce_be_training_runs_and_learns(tmp_path, data):
    train, dev = data
    model = tiny_model(str(tmp_path), feature_dim=F)
    cfg = TrainConfig(objective="be", be_loss="infonce", steps=40, batch_size=16, lr=1e-3, progress=False)
    result = Trainer(model, train, cfg, str(tmp_path / "out"), dev).train()
    assert result["best_eval"]["mR"] > chance_mr(20, 2) + 5


@pytest.mark.parametrize("agreement,optimizer", [(False, "shared"), (True, "shared"), (False, "separate")],
                         ids=["cls-head", "ce-agreement", "separate-optimizers"])
def test_resume_gives_identical_weights(tmp_path, data, agreement, optimizer):
    train, dev = data
    cfg = TrainConfig(objective="joint", steps=8, batch_size=8, lr=1e-3, eval_every=3, checkpoint_every=100,
                      joint_optimizer=optimizer, progress=False)

    def fresh(folder, seed=0):
        model = tiny_model(str(tmp_path / folder), feature_dim=F, seed=seed)
        if agreement:
            model.add_ce_agreement("mean")
        return model

    straight = Trainer(fresh("a"), train, cfg, str(tmp_path / "straight"), dev)
    straight.train()

    first = Trainer(fresh("b"), train, cfg, str(tmp_path / "resumed"), dev)
    first.train(stop_at=4)  # an interrupted job: last/ holds step 4
    assert json.load(open(tmp_path / "resumed" / "last" / "trainer_state.json"))["step"] == 4
    # a new process would start from the base model again; resume must replace it entirely
    second = Trainer(fresh("c", seed=5), train, cfg, str(tmp_path / "resumed"), dev)
    second.train(resume=True)

    a = load_file(str(tmp_path / "straight" / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "last" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert ("ce_agreement_log_scale" in a) == agreement
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert straight.best_metric == second.best_metric
    losses_a = [r["loss"] for r in _log(tmp_path / "straight") if "loss" in r]
    losses_b = [r["loss"] for r in _log(tmp_path / "resumed") if "loss" in r]
    assert losses_a == losses_b

    # every objective step logs how hard it pulled: the gradient norm of the model and of the shared transformer
    steps = [r for r in _log(tmp_path / "straight") if "loss" in r]
    assert {r["objective"] for r in steps} == {"be", "ce"}
    assert all(r["grad_norm"] > 0 and 0 < r["grad_norm_trunk"] <= r["grad_norm"] + 1e-6 for r in steps)
    state = json.load(open(tmp_path / "resumed" / "last" / "trainer_state.json"))
    assert ("ce_state_param_groups" in state) == (optimizer == "separate")
    if optimizer == "separate":  # one AdamW state per objective: another model than the shared state trains
        shared = Trainer(fresh("e"), train, replace(cfg, joint_optimizer="shared"), str(tmp_path / "shared"), dev)
        shared.train()
        c = load_file(str(tmp_path / "shared" / "last" / "model.safetensors"))
        assert not all(torch.equal(a[k], c[k]) for k in a)
        with pytest.raises(ValueError, match="joint_optimizer"):
            Trainer(fresh("f"), train, replace(cfg, joint_optimizer="shared"), str(tmp_path / "resumed")).train(
                resume=True)
        with pytest.raises(ValueError, match="joint run"):
            TrainConfig(objective="be", joint_optimizer="separate")

    with pytest.raises(ValueError, match="batch_size"):
        other = TrainConfig(objective="joint", steps=8, batch_size=4, progress=False)
        Trainer(tiny_model(str(tmp_path / "d"), feature_dim=F), train, other, str(tmp_path / "resumed")).train(
            resume=True)


def run_train_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "retrieval_core.training.train", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_help():
    out = run_train_cli("-h")
    assert out.returncode == 0, out.stderr
    for flag in ("--staged", "--objective", "--base-model", "--halve-layers", "--be-loss", "--resume",
                 "--max-train-captions", "--eval-every", "--checkpoint-every", "--device [auto|cpu|cuda|cuda:N]",
                 "--threads"):
        assert flag in out.stdout


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory):
    from tests.helpers_model import write_tiny_bert
    from tests.test_encode_pipeline import write_tiny_staged  # the stager's own shard encoders

    root = tmp_path_factory.mktemp("train_cli")
    return write_tiny_staged(str(root / "staged"), num_images=24), write_tiny_bert(str(root / "bert"), num_layers=4)


def test_cli_trains_from_a_staged_dir_and_continues_a_model(tmp_path, cli_inputs):
    staged, base = cli_inputs
    args = ["--staged", staged, "--objective", "joint", "--base-model", base, "--steps", "6", "--batch-size", "8",
            "--lr", "1e-3", "--output", str(tmp_path / "run"), "--dev-split", "test", "--no-progress",
            "--max-train-captions", "30"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "best model:" in res.stdout and "dev mR" in res.stdout
    model = VLRetrievalModel.load(str(tmp_path / "run" / "best"))
    assert model.cfg.provenance["train_captions"] == 30
    # the default --device auto: the device it resolved to, printed as auto's choice and recorded with the model
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.cfg.provenance["training"]["device"] == auto
    assert f"device: {auto} (auto" in res.stdout
    assert model.cfg.ce_agreement == ce_agreement_default("new")  # a new model's CE head, unless asked otherwise
    # continue fine-tuning the trained model (an existing VLRetrievalModel folder as --base-model): its own head
    args2 = ["--staged", staged, "--objective", "ce", "--base-model", str(tmp_path / "run" / "best"), "--steps", "3",
             "--batch-size", "8", "--output", str(tmp_path / "run2"), "--dev-split", "test", "--no-progress"]
    assert CliRunner().invoke(main, args2, catch_exceptions=False).exit_code == 0
    assert os.path.isdir(tmp_path / "run2" / "last")
    assert VLRetrievalModel.load(str(tmp_path / "run2" / "last")).cfg.ce_agreement == ce_agreement_default("new")


def test_cli_ce_agreement_is_built_trained_kept_and_never_dropped(tmp_path, cli_inputs):
    """--ce-agreement builds the CE head's agreement term and a joint run trains its scale; a model folder keeps its
    own term unless asked, gets one it lacks (with a note), and another or none in place of its own is refused in
    one line."""
    from retrieval_core.model.network import AGREEMENT_SCALE_INIT

    staged, base = cli_inputs
    common = ["--staged", staged, "--steps", "4", "--batch-size", "8", "--lr", "1e-3", "--dev-split", "test",
              "--no-progress", "--max-train-captions", "30"]
    res = CliRunner().invoke(main, [*common, "--base-model", base, "--ce-agreement", "maxsim", "--output",
                                    str(tmp_path / "a")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    trained = VLRetrievalModel.load(str(tmp_path / "a" / "last"))
    assert trained.cfg.ce_agreement == "maxsim"
    assert float(trained.ce_agreement_log_scale.detach()) != pytest.approx(np.log(AGREEMENT_SCALE_INIT), abs=1e-6)
    for other in ("none", "mean"):
        res = CliRunner().invoke(main, [*common, "--objective", "ce", "--base-model", str(tmp_path / "a" / "last"),
                                        "--ce-agreement", other, "--output", str(tmp_path / "b")])
        assert res.exit_code == 1 and "has the 'maxsim' CE agreement term: continue with --ce-agreement maxsim" in \
            res.output
    res = CliRunner().invoke(main, [*common, "--objective", "ce", "--base-model", str(tmp_path / "a" / "last"),
                                    "--output", str(tmp_path / "b")], catch_exceptions=False)
    assert res.exit_code == 0 and VLRetrievalModel.load(str(tmp_path / "b" / "last")).cfg.ce_agreement == "maxsim"
    res = CliRunner().invoke(main, [*common, "--base-model", base, "--ce-agreement", "none", "--output",
                                    str(tmp_path / "c")])
    assert res.exit_code == 0 and VLRetrievalModel.load(str(tmp_path / "c" / "last")).cfg.ce_agreement == "none"
    res = CliRunner().invoke(main, [*common, "--objective", "ce", "--base-model", str(tmp_path / "c" / "last"),
                                    "--ce-agreement", "mean", "--output", str(tmp_path / "d")], catch_exceptions=False)
    assert res.exit_code == 0 and "has no CE agreement term" in res.output
    assert VLRetrievalModel.load(str(tmp_path / "d" / "last")).cfg.ce_agreement == "mean"


def test_cli_with_the_demo_flags_trains_exactly_what_the_library_trains(tmp_path, cli_inputs):
    """The click port keeps every flag's meaning: the demo recipe's flag set (retrieval_core/training/recipes.py, scaled
    down) gives bit-identical weights, optimizer state and log to the same run built through the library; and
    to_argv (how the recipes run the CLI) writes exactly the flags that build its TrainPlan."""
    from retrieval_core.cli import plan_from_cli, to_argv
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.model.checkpoints import from_text_backbone
    from retrieval_core.training.train import TrainPlan
    from retrieval_core.training.train_data import load_split

    staged, base = cli_inputs
    cfg = TrainConfig(objective="joint", be_loss="infonce", image_init="lstsq", new_layers_lr_mult=20.0,
                      ce_start_step=3, ce_loss="listwise", ce_negatives=3, ce_batch_size=6, hard_negative_prob=0.5,
                      hard_negative_k=4, mined_negative_prob=0.5, mine_k=5, mine_every=3, mine_pool=40,
                      length_chunk_rows=4, freeze_word_embeddings=True, steps=8, batch_size=8, lr=1e-4, eval_every=4,
                      checkpoint_every=2, seed=3, progress=False)
    plan = TrainPlan(staged=staged, output=str(tmp_path / "cli"), config=cfg, base_model=base, halve_layers=True,
                     max_regions=3, dev_split="test", threads=1, ce_agreement="maxsim")
    args = to_argv(plan)
    assert "--no-progress" in args and "--objective" not in args  # the default objective is not written
    assert plan_from_cli(TrainPlan, main.make_context("train", list(args)).params) == plan  # the round trip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert VLRetrievalModel.load(str(tmp_path / "cli" / "last")).cfg.provenance["training"] == \
        {**asdict(cfg), "step": 8}
    with pytest.raises(ValueError, match="TrainConfig.temperature has no command-line flag"):
        to_argv(dataclasses.replace(plan, config=dataclasses.replace(cfg, temperature=0.1)))

    ds = StagedDataset(staged)
    model = from_text_backbone(base, ds.feature_dim, keep_every_other_layer=True, seed=3, ce_agreement="maxsim")
    model.cfg.max_regions = 3
    Trainer(model, load_split(ds, "train", seed=3), cfg, str(tmp_path / "lib"), load_split(ds, "test")).train()
    for name in ("best/model.safetensors", "last/model.safetensors", "last/trainer_state.safetensors"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes(), name
    timeless = lambda d: {k: v for k, v in d.items() if k != "seconds"}  # noqa: E731
    strip = lambda rows: [timeless(r) | {k: timeless(r[k]) for k in ("eval", "mined") if k in r} for r in rows]  # noqa: E731
    assert strip(_log(tmp_path / "cli")) == strip(_log(tmp_path / "lib"))


def test_cli_bad_input_is_one_line_not_a_traceback(tmp_path, cli_inputs):
    from tests.test_cli_errors import assert_clean_failure

    staged, base = cli_inputs
    missing = str(tmp_path / "no_staged")
    res = run_train_cli("--staged", missing, "--output", str(tmp_path / "o"))  # as a user runs it
    assert_clean_failure(res, missing, "not a staged directory")
    runner = CliRunner()
    common = ["--staged", staged, "--output", str(tmp_path / "o"), "--no-progress", "--steps", "2"]
    for extra, expected in ((["--base-model", str(tmp_path / "nope")], "no such folder"),
                            (["--base-model", str(tmp_path)], "neither a retrieval model folder"),
                            (["--max-regions", "0"], "'--max-regions': 0 is not in the range x>=1"),
                            (["--batch-size", "1"], "need steps >= 1 and batch_size >= 2"),
                            (["--device", "gpu"], "device must be one of auto|cpu|cuda|cuda:N, got 'gpu'")):
        res = runner.invoke(main, common + extra)
        assert res.exit_code in (1, 2) and expected in res.output, (extra, res.output)
        assert "Traceback" not in res.output and res.output.count("Error: ") == 1
    if not torch.cuda.is_available():  # one spelling across CLIs, case-insensitive: CUDA is cuda
        res = runner.invoke(main, common + ["--device", "CUDA"])
        assert res.exit_code == 1 and "Error: --device cuda was requested but CUDA is not available" in res.output


def test_dev_evaluation_shows_items_rate_and_eta(data, tmp_path, monkeypatch, capsys):
    """A dev evaluation on the demo takes as long as ~40 training steps: it reports its own progress instead of
    sitting behind the training bar."""
    import functools

    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", functools.partial(tqdm.auto.tqdm, mininterval=0, miniters=1))  # every update
    train, dev = data
    model = tiny_model(str(tmp_path / "m"), feature_dim=F)
    capsys.readouterr()
    quiet = evaluate(model, dev, batch_size=8)
    assert capsys.readouterr().err == ""
    loud = evaluate(model, dev, batch_size=8, progress=True, desc="dev eval at step 7")
    assert loud == quiet  # progress changes nothing measured
    n_images = len(np.unique(dev.image_pos))
    total = len(dev) + n_images + 3 * min(256, len(dev))  # the CE scores gold, random and nearest images
    err = capsys.readouterr().err
    assert "dev eval at step 7" in err and f"/{total} [" in err and "item/s" in err
    counts = [int(c) for c in re.findall(r"(\d+)/" + str(total) + r" \[", err)]
    assert f" 8/{total}" in err and max(counts) == total  # counts per batch, up to every item and never past it


def test_reranked_recall_is_the_ce_order_of_the_be_top_k(data, tmp_path):
    """The screens' reranked dev metric against a per-query recomputation: BE top k by cosine, the CE's best of
    those k at rank 1, a gold the BE left out a miss; with k = every image, EMB R@1 is the dev evaluation's."""
    from retrieval_core.training.dev_eval import reranked_recall

    _, dev = data
    model = tiny_model(str(tmp_path / "m"), feature_dim=F)
    img_pos = np.unique(dev.image_pos)
    images = dev.images.take(img_pos)
    text, img = model.encode_text(dev.texts, 8), model.encode_image(images, 8)
    res = reranked_recall(model, model, dev, queries=12, k=3, batch_size=8)
    rng = np.random.default_rng([0, 7])  # the sample reranked_recall draws
    caps = np.sort(rng.choice(len(dev), size=12, replace=False))
    hits = []
    for c in caps:
        top = np.argsort(-(img @ text[c]), kind="stable")[:3]
        ce = model.score([dev.texts[c]] * 3, [images.regions(int(i)) for i in top], 8)
        hits.append(img_pos[top[int(np.argmax(ce))]] == dev.image_pos[c])
    assert res["co_t2i_hits"].tolist() == [int(h) for h in hits]
    assert res["co_t2i_R@1"] == pytest.approx(100.0 * np.mean(hits))
    full = reranked_recall(model, model, dev, queries=len(dev), k=len(img_pos), batch_size=8)
    ev = evaluate(model, dev, batch_size=8)
    assert full["emb_t2i_R@1"] == pytest.approx(ev["t2i_R@1"]) and full["emb_i2t_R@1"] == pytest.approx(ev["i2t_R@1"])


def test_feature_neighbours_find_the_near_duplicate():
    from retrieval_core.data.schema import ImageTable
    from retrieval_core.training.train_data import feature_neighbours

    rng = np.random.default_rng(0)
    base = [rng.normal(size=(5, F)).astype(np.float32) for _ in range(6)]
    feats = base + [b + 0.01 * rng.normal(size=b.shape).astype(np.float32) for b in base]  # image i+6 ~ image i
    boxes = [np.tile(np.array([0, 0, 1, 1, 1, 1], np.float32), (5, 1))] * 12
    table = ImageTable.from_lists(np.arange(12), feats, boxes)
    nn = feature_neighbours(table, 2)
    assert nn.shape == (12, 2)
    assert (nn[:, 0] == (np.arange(12) + 6) % 12).all()
    assert (nn != np.arange(12)[:, None]).all()  # never the image itself


def test_lstsq_image_embedding_is_a_training_free_start(tmp_path, data):
    from retrieval_core.training.model_init import lstsq_image_embedding

    train, dev = data
    warm = tiny_model(str(tmp_path / "b"), feature_dim=F)
    r2 = lstsq_image_embedding(warm, train)
    assert 0.3 < r2 <= 1.0
    # each dev image's mean region token (before LayerNorm) is nearest to the mean word embedding of its own
    # captions: the map generalises beyond the images it was fitted on
    from retrieval_core.model.baseline import pooled_image_vectors

    with torch.no_grad():
        img = warm.img_embedding(torch.from_numpy(pooled_image_vectors(dev.images)).float()).numpy()
    words = warm.bert.embeddings.word_embeddings.weight.detach().numpy()
    special = set(warm.tokenizer.all_special_ids)
    txt = np.stack([words[[i for i in warm.tokenizer(t)["input_ids"] if i not in special]].mean(0) for t in dev.texts])
    img, txt = img - img.mean(0), txt - txt.mean(0)
    nearest = np.argmax(txt @ img.T / np.linalg.norm(img, axis=1), axis=1)
    assert np.mean(nearest == dev.image_pos) > 0.3  # chance: 1 in 20 dev images
    # the trainer applies it before step 1 and logs the fit
    cfg = TrainConfig(objective="be", steps=1, batch_size=8, image_init="lstsq", progress=False)
    Trainer(tiny_model(str(tmp_path / "c"), feature_dim=F), train, cfg, str(tmp_path / "out")).train()
    assert _log(tmp_path / "out")[0]["image_init"] == "lstsq"


def test_mined_negatives_are_the_be_top_k_wrong_items_in_both_directions(tmp_path, data):
    """mine_be_negatives against a brute-force ranking by the model's own embeddings: per caption its k best
    wrong images (t2i), per gold image its k best wrong captions in the pool (i2t); never a positive."""
    from retrieval_core.training.train_data import mine_be_negatives

    train, _ = data
    model = tiny_model(str(tmp_path / "m"), feature_dim=F)
    caps = np.arange(0, len(train), 7)
    mined, record = mine_be_negatives(model, train, caps, k=3, pool_size=len(train), seed=0)
    img_pos = np.unique(train.image_pos)
    img_emb = model.encode_image(train.images.take(img_pos))
    txt_emb = model.encode_text(train.texts)
    for row, c in enumerate(mined.caption_keys):
        gold = train.image_pos[c]
        order = [p for p in img_pos[np.argsort(-(img_emb @ txt_emb[c]), kind="stable")] if p != gold]
        assert mined.caption_images[row].tolist() == order[:3]
    for row, i in enumerate(mined.image_keys):
        order = [c for c in np.argsort(-(txt_emb @ img_emb[np.searchsorted(img_pos, i)]), kind="stable")
                 if train.image_pos[c] != i]
        assert mined.image_captions[row].tolist() == order[:3]
    assert set(mined.image_keys) == set(train.image_pos[caps]) and record["mined_captions"] == len(caps)
    rng = np.random.default_rng(0)
    assert np.all(train.image_pos[caps] != mined.images(rng, caps))
    assert np.all(train.image_pos[mined.captions(rng, mined.image_keys)] != mined.image_keys)


def test_joint_training_with_mined_negatives_resumes_identically(tmp_path, data):
    """Negatives mined by the model at its window start are part of the trainer state: a run killed inside a
    window and resumed trains exactly like an uninterrupted one; the log records every mining."""
    train, _ = data
    cfg = TrainConfig(objective="joint", steps=8, batch_size=8, lr=1e-3, ce_negatives=2, ce_loss="listwise",
                      mined_negative_prob=0.7, mine_k=3, mine_every=3, mine_pool=40, checkpoint_every=100,
                      progress=False)
    straight = Trainer(tiny_model(str(tmp_path / "a"), feature_dim=F), train, cfg, str(tmp_path / "straight"))
    straight.train()
    Trainer(tiny_model(str(tmp_path / "b"), feature_dim=F), train, cfg, str(tmp_path / "resumed")).train(stop_at=4)
    Trainer(tiny_model(str(tmp_path / "c"), feature_dim=F, seed=5), train, cfg,
            str(tmp_path / "resumed")).train(resume=True)
    a = load_file(str(tmp_path / "straight" / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "last" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    minings = [r for r in _log(tmp_path / "straight") if "mined" in r]
    assert [r["step"] for r in minings] == [0, 3, 6] and minings[0]["mined"]["until_step"] == 3


def test_no_mined_negatives_before_mine_start_step(tmp_path, data):
    """A CE fine-tuned from a bi-encoder (SEP) first learns from random and nearest images: before
    mine_start_step nothing is mined and the steps equal a run without mining; from it on the BE's lists come in."""
    train, _ = data
    common = dict(objective="ce", steps=6, batch_size=8, lr=1e-3, ce_negatives=2, ce_loss="listwise",
                  checkpoint_every=100, progress=False)
    delayed = TrainConfig(**common, mined_negative_prob=1.0, mine_k=3, mine_pool=40, mine_start_step=4)
    Trainer(tiny_model(str(tmp_path / "a"), feature_dim=F), train, delayed, str(tmp_path / "delayed")).train()
    Trainer(tiny_model(str(tmp_path / "b"), feature_dim=F), train, TrainConfig(**common),
            str(tmp_path / "plain")).train(stop_at=4)
    minings = [r for r in _log(tmp_path / "delayed") if "mined" in r]
    assert [r["step"] for r in minings] == [4] and minings[0]["mined"]["until_step"] == 6
    losses = lambda d: [r["loss"] for r in _log(d) if r.get("objective") == "ce"]  # noqa: E731
    assert losses(tmp_path / "delayed")[:4] == losses(tmp_path / "plain")[:4]
    assert losses(tmp_path / "delayed")[4:] != [] and len(losses(tmp_path / "delayed")) == 6
    with pytest.raises(ValueError, match="mine_start_step >= 0"):
        TrainConfig(**common, mine_start_step=-1)


def test_length_chunks_cover_the_batch_shortest_first(data, tmp_path):
    from retrieval_core.model.collate import length_chunks

    lengths = np.array([9, 2, 7, 2, 5, 1, 8])
    chunks = length_chunks(lengths, 3)
    assert [len(c) for c in chunks] == [3, 3, 1]
    flat = np.concatenate(chunks)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert lengths[flat].tolist() == sorted(lengths.tolist())
    assert np.array_equal(length_chunks(lengths, 0)[0], np.arange(len(lengths)))
    # the key: word pieces as a batch holds them ([CLS] and [SEP] included, truncated), not characters
    collate = tiny_model(str(tmp_path / "m"), feature_dim=F).text_collator()
    texts = ["a dog", "xqzw", "a red dog and a blue cat"]
    assert collate.token_lengths(texts).tolist() == collate(texts)["attention_mask"].sum(1).tolist()
    assert collate.token_lengths(texts)[1] > collate.token_lengths(texts)[0]  # fewer characters, more pieces


def test_length_chunked_losses_equal_one_padded_batch(tmp_path, data):
    """Chunking by length only drops padding: with dropout off, the BE and CE losses are those of one batch."""
    train, _ = data
    losses = {}
    for rows in (0, 4):
        model = tiny_model(str(tmp_path / f"m{rows}"), feature_dim=F)
        cfg = TrainConfig(objective="joint", steps=10, batch_size=16, ce_negatives=3, ce_loss="listwise",
                          length_chunk_rows=rows, progress=False)
        trainer = Trainer(model, train, cfg, str(tmp_path / f"out{rows}"))
        model.eval()
        caps = trainer._batch_indices(3)
        with torch.no_grad():
            losses[rows] = (float(trainer._be_loss(caps)), float(trainer._ce_loss(*trainer._ce_groups(caps, 3))))
    assert losses[4] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("ce_loss", ["listwise", "pair"])
def test_ce_micro_batches_give_the_whole_batchs_loss_and_gradient(tmp_path, data, ce_loss):
    """--ce-micro-batch: with dropout off, the accumulated gradient and loss are those of one pass (float order
    aside); 0 keeps the one pass."""
    train, _ = data
    grads, losses = {}, {}
    for size in (0, 3):
        model = tiny_model(str(tmp_path / f"m{size}"), feature_dim=F)
        cfg = TrainConfig(objective="joint", steps=10, batch_size=16, ce_negatives=3, ce_loss=ce_loss,
                          ce_micro_batch=size, progress=False)
        trainer = Trainer(model, train, cfg, str(tmp_path / f"out{size}"))
        model.eval()  # dropout off: the micro-batches' dropout draws differ from one pass's
        losses[size] = float(trainer._ce_step_loss(trainer._batch_indices(3), 3))
        grads[size] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert losses[3] == pytest.approx(losses[0], rel=1e-5)
    assert torch.allclose(grads[3], grads[0], rtol=1e-4, atol=1e-7)
    assert grads[0].abs().sum() > 0


def test_cpu_bf16_autocasts_training_steps_only(tmp_path, data):
    """--cpu-bf16: the trainer's forward passes run in bf16 on the CPU; without it they stay float32."""
    train, dev = data
    for flag, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        model = tiny_model(str(tmp_path / f"m{flag}"), feature_dim=F)
        cfg = TrainConfig(objective="joint", steps=2, batch_size=8, cpu_bf16=flag, progress=False)
        trainer = Trainer(model, train, cfg, str(tmp_path / f"out{flag}"), dev)
        with trainer._amp():
            out = model.bert.encoder.layer[0].attention.self.query(torch.zeros(2, model.bert.config.hidden_size))
        assert out.dtype == dtype
        result = trainer.train()  # steps run and the dev evaluation (float32) still works
        assert np.isfinite(result["best_eval"]["mR"])


def test_languages_train_and_select_on_those_captions_only(tmp_path):
    """--languages en: the zero-shot setting trains (and selects its checkpoint) on English captions only."""
    from pipelines.stage.plan import StagePlan
    from pipelines.stage.run import run as stage
    from retrieval_core.data.store import StagedDataset
    from retrieval_core.training.train_data import load_split

    staged = str(tmp_path / "staged")
    stage(StagePlan(staged, "demo", overrides=("demo.images.num_images=40", "demo.expected_images=null",
                                               "demo.expected_captions=null", "demo.captions.languages=[en, de]")))
    ds = StagedDataset(staged)
    both, en = load_split(ds, "train"), load_split(ds, "train", languages=("en",))
    langs = ds.captions(split="train").set_index("caption_id")["lang"]
    assert set(langs.loc[both.caption_ids]) == {"en", "de"} and set(langs.loc[en.caption_ids]) == {"en"}
    assert 2 * len(en.caption_ids) == len(both.caption_ids)
    with pytest.raises(ValueError, match=r"in language\(s\) fr"):
        load_split(ds, "train", languages=("fr",))


def test_weight_average_is_what_best_holds_and_resumes_bit_identically(tmp_path, data):
    """ema_decay: best/ (evaluated and saved) holds the moving average of the weights, last/ the raw weights and the
    average for a resume; a run killed midway and resumed gives the uninterrupted run's bytes, average included."""
    train, dev = data
    cfg = TrainConfig(objective="joint", steps=8, batch_size=8, lr=1e-3, eval_every=8, checkpoint_every=100,
                      ema_decay=0.8, progress=False)
    straight = Trainer(tiny_model(str(tmp_path / "a"), feature_dim=F), train, cfg, str(tmp_path / "straight"), dev)
    straight.train()
    Trainer(tiny_model(str(tmp_path / "b"), feature_dim=F), train, cfg, str(tmp_path / "resumed"), dev).train(stop_at=5)
    resumed = Trainer(tiny_model(str(tmp_path / "c"), feature_dim=F, seed=5), train, cfg, str(tmp_path / "resumed"),
                      dev)
    resumed.train(resume=True)
    for name in ("best/model.safetensors", "last/model.safetensors", "last/trainer_state.safetensors"):
        assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    best = load_file(str(tmp_path / "straight" / "best" / "model.safetensors"))
    raw = load_file(str(tmp_path / "straight" / "last" / "model.safetensors"))
    averaged = [n for n in straight.ema if not torch.equal(best[n], raw[n])]
    assert averaged and all(torch.equal(best[n], straight.ema[n]) for n in straight.ema)
    with pytest.raises(ValueError, match="ema_decay"):
        TrainConfig(ema_decay=1.0)

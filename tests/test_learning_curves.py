"""benchmarks.probes.learning_curves on a real (tiny) JOIN run over a staged synthetic collection that kept its
checkpoints: the loss windows are the log's own means, and every probe point is family_probe on the model kept
at that step."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from benchmarks.probes import family_probe, learning_curves
from retrieval_core.data.manifest import load_manifest
from retrieval_core.data.store import StagedDataset
from retrieval_core.model.network import VLRetrievalModel
from retrieval_core.training.config import TrainConfig
from retrieval_core.training.train import main as train_main
from retrieval_core.training.trainer import kept_checkpoints
from tests.helpers_model import staged_demo_and_tiny_model, write_tiny_bert

F = 16
OVERRIDES = (f"feature_dim={F}", "demo.images.num_images=48", "demo.images.min_regions=4", "demo.images.max_regions=8",
             "demo.images.splits={train: 0.5, dev: 0.5}", "demo.expected_images=48", "demo.expected_captions=240")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(staged folder, training folder): 4 JOIN steps, a model kept every 2."""
    tmp = str(tmp_path_factory.mktemp("curves"))
    staged, _ = staged_demo_and_tiny_model(tmp, OVERRIDES, F)
    base = write_tiny_bert(os.path.join(tmp, "bert"))
    out = os.path.join(tmp, "join")
    before = torch.get_num_threads()
    res = CliRunner().invoke(train_main, [
        "--staged", staged, "--objective", "joint", "--base-model", base, "--steps", "4", "--batch-size", "8",
        "--lr", "1e-3", "--checkpoint-every", "2", "--keep-checkpoints", "--output", out, "--no-progress",
        "--threads", "1"], catch_exceptions=False)
    torch.set_num_threads(before)
    assert res.exit_code == 0, res.output
    return staged, out


def test_training_keeps_a_model_per_checkpoint_and_the_last_is_the_final_model(run):
    _, out = run
    kept = kept_checkpoints(out)
    assert [step for step, _ in kept] == [2, 4]
    final, last = load_file(os.path.join(kept[-1][1], "model.safetensors")), load_file(
        os.path.join(out, "last", "model.safetensors"))
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    early = load_file(os.path.join(kept[0][1], "model.safetensors"))
    assert any(not torch.equal(early[k], final[k]) for k in final)  # step 2 is another model
    assert VLRetrievalModel.load(kept[0][1]).cfg.provenance["training"]["step"] == 2
    with pytest.raises(ValueError, match="checkpoint_every"):
        TrainConfig(keep_checkpoints=True)


def test_loss_windows_are_the_logs_means(run):
    _, out = run
    records = learning_curves.read_log(out)
    curves = learning_curves.log_curves(records, window=3)
    be = [r["loss"] for r in records if r.get("objective") == "be"]
    got = curves[curves["series"] == "be loss"]
    assert got["step"].tolist() == [3, 4]  # windows of steps 1-3 and 4
    assert got["value"].tolist() == pytest.approx([np.mean(be[:3]), be[3]])
    dev = curves[curves["series"] == "dev mR"]
    assert dev["step"].tolist() == [4] and learning_curves.trained_heads(records) == ("BE", "CE")
    ce = [(r["step"], r["grad_norm_trunk"]) for r in records if r.get("objective") == "ce"]
    windows: dict = {}
    for step, norm in ce:
        windows.setdefault((step - 1) // 3, []).append(norm)
    got = curves[curves["series"] == "ce trunk gradient norm"]  # the shared weights' pull, per objective
    assert got["value"].tolist() == pytest.approx([np.mean(v) for _, v in sorted(windows.items())]) and len(got)
    with pytest.raises(ValueError, match="window"):
        learning_curves.log_curves(records, window=0)
    # a run resumed from step 2 logs steps 3-4 and the final evaluation again: the later records count, once
    redone = [dict(r, loss=r["loss"] + 1.0) if r.get("step", 0) > 2 and "loss" in r else r
              for r in records if r.get("step", 0) > 2]
    redone = [dict(r, eval={**r["eval"], "mR": -1.0}) if "eval" in r else r for r in redone]
    twice = learning_curves.log_curves(records + redone, window=3)
    assert twice[twice["series"] == "dev mR"]["value"].tolist() == [-1.0]
    assert twice[twice["series"] == "be loss"]["value"].tolist() == pytest.approx(
        [np.mean(be[:2] + [be[2] + 1.0]), be[3] + 1.0])


def test_cli_probes_every_kept_model(run, tmp_path):
    staged, out = run
    res = CliRunner().invoke(learning_curves.main, [
        "--run", f"tiny={out}", "--staged", staged, "--manifest", "demo", "--max-captions", "0", "--window", "2",
        "--output", str(tmp_path), "--threads", "1"])
    assert res.exit_code == 0, res.output
    curves = pd.read_csv(tmp_path / "learning_curves.csv")
    assert (tmp_path / "learning_curves.png").stat().st_size > 0
    probe = curves[curves["series"].str.contains(" pairwise ")]
    assert set(probe["series"]) == {f"{h} pairwise {c}" for h in ("BE", "CE") for c in ("attribute", "binding", "all")}
    assert sorted(set(probe["step"])) == [2, 4]
    # the step-2 point is family_probe on the step-2 model, all dev captions
    spec = load_manifest("demo", OVERRIDES).synthetic_spec("demo")
    model = VLRetrievalModel.load(kept_checkpoints(out)[0][1])
    ref = family_probe.probe(StagedDataset(staged), spec, model, model, "dev")
    ref = ref[(ref["table"] == "pairwise") & (ref["head"] == "CE") & (ref["change"] == "binding")]
    point = probe[(probe["step"] == 2) & (probe["series"] == "CE pairwise binding")]
    assert point["value"].item() == pytest.approx(ref["accuracy"].item())
    assert curves["run"].unique().tolist() == ["tiny"]


def test_cli_refuses_what_it_cannot_draw(run, tmp_path):
    staged, out = run
    no_manifest = CliRunner().invoke(learning_curves.main, ["--run", f"a={out}", "--staged", staged,
                                                            "--output", str(tmp_path)])
    assert no_manifest.exit_code == 2 and "--manifest" in no_manifest.output
    same_label = CliRunner().invoke(learning_curves.main, ["--run", f"a={out}", "--run", f"a={out}",
                                                           "--output", str(tmp_path)])
    assert same_label.exit_code == 2 and "labels must differ" in same_label.output
    bad_spec = CliRunner().invoke(learning_curves.main, ["--run", out, "--output", str(tmp_path)])
    assert bad_spec.exit_code == 2 and "LABEL=TRAIN_DIR" in bad_spec.output
    not_a_run = CliRunner().invoke(learning_curves.main, ["--run", f"a={tmp_path}", "--output", str(tmp_path)])
    assert not_a_run.exit_code == 1 and "train_log.jsonl" in not_a_run.output
    assert "Traceback" not in not_a_run.output
    # a run that kept no models has nothing to probe: said, not skipped
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train_log.jsonl").write_text(open(os.path.join(out, "train_log.jsonl")).read())
    nothing = CliRunner().invoke(learning_curves.main, ["--run", f"a={plain}", "--staged", staged, "--manifest",
                                                        "demo", "--output", str(tmp_path)])
    assert nothing.exit_code == 1 and "--keep-checkpoints" in nothing.output


def test_joint_screen_ranks_the_dev_split_and_reads_the_training_log(run, tmp_path):
    """benchmarks.probes.joint_screen on the tiny JOIN run: a model against itself named as a SEP pair gives the
    same CO (difference 0), CO minus EMB is the two recalls' difference, the binding accuracy and the log's mean
    trunk gradient norms and its training seconds land in the CSV, and its table prints them."""
    from benchmarks.probes import joint_screen
    from benchmarks.report.published import joint_screen_block

    staged, out = run
    best = os.path.join(out, "best")
    csv_path = str(tmp_path / "screen.csv")
    res = CliRunner().invoke(joint_screen.main, [
        "--staged", staged, "--manifest", "demo", "--pair", f"join={best}", "--pair", f"pair={best}:{best}",
        "--queries", "20", "--k", "3", "--binding-captions", "40", "--threads", "1", "--label", "tiny",
        "--output", csv_path], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = pd.read_csv(csv_path)
    assert len(rows) == 4 and set(rows["direction"]) == {"t2i", "i2t"}
    assert (rows["co_minus_first"] == 0).all()
    assert np.allclose(rows["co_minus_emb"], rows["co_R@1"] - rows["emb_R@1"], atol=0.01)
    assert rows["binding_pairwise"].between(0, 100).all()
    records = learning_curves.read_log(out)
    ce_steps = {r["step"] for r in records if r.get("objective") == "ce"}
    be = [r["grad_norm_trunk"] for r in records if r.get("objective") == "be" and r["step"] in ce_steps]
    assert rows["be_grad_trunk"].iloc[0] == pytest.approx(np.mean(be), abs=1e-3)
    # the training's logged time: its steps, minings and dev evaluations (one run: the same for both pairs)
    logged = (sum(r["seconds"] for r in records if "objective" in r)
              + sum(r[k]["seconds"] for r in records for k in ("mined", "eval") if k in r))
    assert rows["train_seconds"].tolist() == [pytest.approx(logged, abs=0.1)] * 4 and logged > 0
    table = joint_screen_block(rows.astype(str).to_dict("records"))
    assert "| tiny | join |" in table and f"{rows['co_R@1'].iloc[0]:.1f}" in table


def test_a_resumed_runs_replayed_steps_count_once_in_its_training_seconds():
    """A run killed after step 1's checkpoint and resumed logs steps 2-3 twice: the training's time counts each step
    once (its last record), plus its mining and evaluation."""
    from benchmarks.probes.joint_screen import logged_seconds

    records = [{"step": s, "objective": "be", "seconds": 1.0} for s in (1, 2, 3)]
    records += [{"step": s, "objective": "be", "seconds": 2.0} for s in (2, 3)]  # the resumed run
    records += [{"step": 3, "mined": {"seconds": 5.0}}, {"step": 3, "eval": {"seconds": 0.5}}]
    assert logged_seconds(records) == 1.0 + 2.0 + 2.0 + 5.0 + 0.5

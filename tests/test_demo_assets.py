"""The demo cache reuses a trained model only when its training run reached the final step."""
import json

from pipelines import demo_assets


def _write_state(out, step):
    (out / "last").mkdir(parents=True, exist_ok=True)
    (out / "last" / "trainer_state.json").write_text(json.dumps({"step": step, "best_metric": 50.0}))


def test_best_of_a_killed_run_is_not_a_finished_model(tmp_path):
    out = tmp_path / "model"
    (out / "best").mkdir(parents=True)
    (out / "best" / "rr_model.json").write_text("{}")  # written at the first dev evaluation, mid-run
    assert not demo_assets.training_finished(str(out), 340)
    _write_state(out, 170)  # a periodic checkpoint: resumable, not finished
    assert not demo_assets.training_finished(str(out), 340)
    _write_state(out, 340)
    assert demo_assets.training_finished(str(out), 340)


def test_unreadable_trainer_state_counts_as_unfinished(tmp_path):
    out = tmp_path / "model"
    (out / "last").mkdir(parents=True)
    (out / "last" / "trainer_state.json").write_text("{not json")
    assert not demo_assets.training_finished(str(out), 10)

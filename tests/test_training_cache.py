"""The training cache (retrieval_core.training.cache) reuses a trained model only when its training run reached the
final step and ran the same command; the recipes (retrieval_core.training.recipes) are typed train configs."""
import json

from retrieval_core.training import cache, recipes


def _write_state(out, step):
    (out / "last").mkdir(parents=True, exist_ok=True)
    (out / "last" / "trainer_state.json").write_text(json.dumps({"step": step, "best_metric": 50.0}))


def test_best_of_a_killed_run_is_not_a_finished_model(tmp_path):
    out = tmp_path / "model"
    (out / "best").mkdir(parents=True)
    (out / "best" / "rr_model.json").write_text("{}")  # written at the first dev evaluation, mid-run
    assert not cache.training_finished(str(out), 340)
    _write_state(out, 170)  # a periodic checkpoint: resumable, not finished
    assert not cache.training_finished(str(out), 340)
    _write_state(out, 340)
    assert cache.training_finished(str(out), 340)


def test_unreadable_trainer_state_counts_as_unfinished(tmp_path):
    out = tmp_path / "model"
    (out / "last").mkdir(parents=True)
    (out / "last" / "trainer_state.json").write_text("{not json")
    assert not cache.training_finished(str(out), 10)


def test_recipes_are_typed_train_configs_run_through_the_train_cli():
    from dataclasses import replace

    import pytest

    from retrieval_core.cli import to_argv
    from retrieval_core.training.train import TrainPlan

    demo, bench = recipes.DEMO_RECIPE, recipes.BENCH_RECIPE
    args = to_argv(TrainPlan(staged="s", output="o", config=demo.join))
    for flag, value in (("--steps", "260"), ("--mined-negative-prob", "0.5"),
                        ("--ce-start-step", "40"), ("--image-init", "lstsq")):
        assert args[args.index(flag) + 1] == value
    assert "--freeze-word-embeddings" in args
    # every model the demo and the suites build has the late-interaction CE head, the multilingual ones included
    plan_args = to_argv(TrainPlan(staged="s", output="o", config=demo.join, ce_agreement=demo.ce_agreement))
    assert plan_args[plan_args.index("--ce-agreement") + 1] == "maxsim" == bench.ce_agreement
    assert {r.ce_agreement for r in recipes.ML_RECIPES.values()} == {"maxsim"}
    # all-language fine-tuning gives every language the English recipe's steps
    ml = recipes.ML_RECIPES
    assert ml["all_languages"].join.steps == 4 * ml["zero_shot"].join.steps and ml["all_languages"].languages == ()
    # the suites' recipe: every CE reranks what it was trained on, its bi-encoder's top-k
    assert bench.join.mine_k >= 20 and bench.sep_ce.mined_negative_prob > 0 and bench.sep_ce.mine_k >= 20
    # the suites' JOIN: one AdamW state per objective (issue 56), written into its train command and stamp
    bench_args = to_argv(TrainPlan(staged="s", output="o", config=bench.join))
    assert bench_args[bench_args.index("--joint-optimizer") + 1] == "separate"
    assert {r.join.seed for r in (bench.with_seed(2),)} == {2} and bench.with_seed(2).sep_ce.seed == 2
    with pytest.raises(ValueError, match="sep_ce must have objective 'ce'"):
        replace(demo, sep_ce=demo.sep_be)
    # demo seed 0 keeps its folders beside the staged collection; other recipes and seeds have their own
    assert recipes.model_dirs(demo).join == recipes.model_dir()
    assert recipes.recipe_dir(bench, 1).endswith("bench-models/seed1")
    assert recipes.recipe_dir(demo, 1) != recipes.demo_dir()


def test_a_cached_model_is_reused_only_for_the_same_training_command(tmp_path, capsys):
    """_ensure_trained runs the train CLI once; the same command on the same staged content reuses the finished
    model, another command (here: one more step) retrains it from scratch."""
    import os
    from dataclasses import replace

    from retrieval_core.training.config import TrainConfig
    from tests.helpers_model import write_tiny_bert
    from tests.test_encode_pipeline import write_tiny_staged

    staged = write_tiny_staged(str(tmp_path / "staged"), num_images=12, collection=recipes.DEMO_MANIFEST)
    base = write_tiny_bert(str(tmp_path / "bert"), num_layers=2)
    cfg = TrainConfig(objective="be", steps=2, batch_size=4, progress=False)
    recipe = replace(recipes.DEMO_RECIPE, name="t", sep_be=cfg)
    out = str(tmp_path / "model")
    best = cache._ensure_trained(staged, out, cfg, recipe, base_model=base)
    assert best == os.path.join(out, "best")
    weights = os.path.join(out, "last", "model.safetensors")  # the tiny set has no dev split: no best/
    first = os.stat(weights).st_mtime_ns
    assert cache._ensure_trained(staged, out, cfg, recipe, base_model=base) == best
    assert os.stat(weights).st_mtime_ns == first and "retraining" not in capsys.readouterr().out
    cache._ensure_trained(staged, out, replace(cfg, steps=3), recipe, base_model=base)
    assert "retraining" in capsys.readouterr().out and cache.training_finished(out, 3)
    write_tiny_bert(base, num_layers=2, seed=1)  # the base checkpoint retrained in place: so is this model
    cache._ensure_trained(staged, out, replace(cfg, steps=3), recipe, base_model=base)
    assert "retraining" in capsys.readouterr().out and cache.training_finished(out, 3)

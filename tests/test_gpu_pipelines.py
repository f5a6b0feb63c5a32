"""The GPU run's script and parts at the test size on the CPU (the same code as on the GPU machine: every part, both
model sizes' input shapes at one encoder layer, several rerank waves, the limits of what the device returns), its
one-line failure, its estimates, and the install check of the carried wheels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pandas as pd
import pytest

from benchmarks.meters import gpu_device, gpu_pipelines


def _run(args, out, work, timeout=900):
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "PY": sys.executable}
    return subprocess.run(["bash", "scripts/gpu_pipelines.sh", "part", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_part_runs_at_both_sizes_and_reports_as_it_goes(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = _run(["all", "--scale", "test", "--device", "cpu", "--threads", "1", "--batch-size", "8"], out, work)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "check-out: " in done.stdout and "fits what the device returns" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["env.txt", "rows.csv", "rows.schema.json", "verdicts.txt"]
    rows = pd.read_csv(out / "rows.csv")
    steps = rows[rows["collection"] == "steps"]
    assert {("pipelines", s) for s in ("stage", "train", "encode", "index", "rerank", "evaluate")} <= set(
        zip(steps["recipe"], steps["mode"]))
    assert {("co5k", s) for s in ("stage", "encode", "rerank", "model alone")} <= set(zip(steps["recipe"],
                                                                                          steps["mode"]))
    recall = rows[rows["mode"].isin(["CO", "EMB"]) & rows["direction"].isin(["t2i", "i2t"])]
    assert len(recall) >= 4 and recall["R@1"].between(0, 100).all()
    # the 5k CO's shape: BERT-base-size pairs through pipelines.rerank, in several Beam waves
    co = rows[(rows["collection"] == "co_5k") & (rows["mode"] == "CE pairs: pipelines.rerank")]
    assert len(co) == 1 and co["rate_per_s"].iloc[0] > 0 and co["ce_pairs"].iloc[0] > 0
    manifest = json.loads((work / "rerank-base" / "rankings_manifest.json").read_text())
    assert manifest["ce_pairs_scored"] == co["ce_pairs"].iloc[0]
    assert manifest["waves_run"] >= 2
    feeding = rows[rows["collection"].astype(str).str.startswith("feeding_")]
    assert set(feeding["recipe"]) == {"demo", "base"} and (feeding["rate_per_s"] > 0).all()
    assert {"job path (handler)", "library loop", "model alone (batches collated ahead)"} == set(
        feeding["mode"].str.split(": ").str[1])
    assert set(rows.loc[rows["collection"] == "collate", "mode"]) >= {"collate base pairs: 1 threads",
                                                                      "collate base pairs: 2 threads"}
    assert {"JOIN step (demo, fp32)", "JOIN step (base, fp32)"} <= set(rows.loc[rows["collection"] == "training",
                                                                             "mode"])
    verdicts = (out / "verdicts.txt").read_text()
    for part in gpu_pipelines.PARTS:
        assert f"{part}: " in verdicts and "estimated on the H200" in verdicts
    assert "collation, 2 threads / 1" in verdicts and "5k CO through pipelines.rerank" in verdicts


def test_a_failing_step_stops_the_part_with_one_line_naming_it(tmp_path):
    work = tmp_path / "work"
    work.write_text("a file where the work folder should be")
    done = _run(["pipelines", "--scale", "test", "--device", "cpu"], tmp_path / "out", work, timeout=300)
    assert done.returncode == 1
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 1 and failed[0].startswith("FAILED pipelines/stage: "), done.stdout[-3000:]


def test_the_full_run_fits_the_lent_time_by_the_committed_rates():
    for part in gpu_pipelines.PARTS:
        assert sum(gpu_pipelines.estimate(part, gpu_pipelines.SCALES["full"]).values()) <= gpu_pipelines.PART_SECONDS
    _, total = gpu_pipelines.estimate_table()
    assert total <= 600


def _wheel(folder, name, version, requires=()):
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return gpu_device.read_wheel(path)


def test_the_install_plan_names_every_conflict_it_cannot_vouch_for(tmp_path):
    from packaging.version import Version

    beam = _wheel(tmp_path, "beam", "2.0", ["numpy<2.5", "proto<7", "extra-only; extra == 'gcp'", "absent>=1"])
    proto = _wheel(tmp_path, "proto", "6.0")
    image = {"numpy": Version("2.5.2"), "proto": Version("7.1"), "beam": Version("1.0")}
    harmless = [{"package": "beam", "requirement_of": "numpy", "installed": "2.5.2", "evidence": "the rehearsal"}]
    picked, notes, conflicts, missing = gpu_device.plan_install(
        [beam, proto], {k: v for k, v in image.items() if k != "beam"}, harmless)
    assert [w.name for w in picked] == ["beam", "proto"]  # proto 7.1 refused by beam: the carried 6.0 shadows it
    assert notes == ["beam 2.0 requires numpy<2.5; numpy 2.5.2 is what runs: harmless by the rehearsal"]
    assert conflicts == [] and missing == ["beam 2.0 requires absent>=1: not in the image and not carried"]
    _, _, conflicts, _ = gpu_device.plan_install([beam], {"numpy": Version("2.6.0")}, harmless)
    assert conflicts == ["beam 2.0 requires numpy<2.5; numpy 2.6.0 is what runs"]  # another version: not vouched for


def test_check_out_refuses_what_the_device_would_not_return(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}.txt").write_text("x")
    assert gpu_device.check_out_folder(str(tmp_path)) is None
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    assert "9 files" in gpu_device.check_out_folder(str(tmp_path))
    (tmp_path / "f0.txt").unlink()
    assert "folders down" in gpu_device.check_out_folder(str(tmp_path))


@pytest.mark.parametrize("size", ["demo", "base"])
def test_models_built_from_a_word_list_keep_the_whole_vocabulary(tmp_path, size):
    from benchmarks.meters import feeding

    texts = ["a red cube left of a blue ball", "two green cones"]
    model = feeding.build_model(size, texts, str(tmp_path), layers=1)
    assert model.tokenizer.vocab_size == len(feeding.collection_vocab(texts)) > 100
    assert model.tokenizer.tokenize("a red cube") == ["a", "red", "cube"]

"""scripts/gpu_pipelines.sh at the test size on the CPU: the GPU run's script and driver cannot rot between GPU
machines (stage -> train -> encode -> build_index -> rerank -> evaluate, the feeding rows, the CO step, verdicts)."""
from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd


def test_gpu_pipelines_script_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_pipelines.sh", "run", "--device", "cpu", "--images", "40", "--tiny",
                           "--threads", "1"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + (out / "log.txt").read_text()[-3000:] \
        if (out / "log.txt").exists() else done.stderr[-3000:]
    rows = pd.read_csv(out / "pipeline_rows.csv")
    steps = set(rows.loc[rows["collection"] == "steps", "mode"])
    assert {"stage", "train", "encode", "index", "rerank", "encode images", "encode texts"} <= steps
    feeding = rows[rows["collection"].astype(str).str.startswith("feeding_")]
    assert set(feeding["mode"].str.split(": ").str[1]) == {"job path (handler)", "library loop",
                                                            "model alone (batches collated ahead)"}
    assert (feeding["rate_per_s"] > 0).all()
    recall = rows[rows["mode"].isin(["CO", "EMB"]) & rows["direction"].isin(["t2i", "i2t"])]
    assert len(recall) >= 4 and recall["R@1"].between(0, 100).all() and (recall["R@1_lo"] <= recall["R@1"]).all()
    sweep = rows[rows["collection"].astype(str).str.startswith("batch_sweep_")]
    assert set(sweep["batch_size"]) == {4, 8} and (sweep["rate_per_s"] > 0).all()
    verdicts = (out / "verdicts.txt").read_text()
    assert "best batch size on cpu, demo pairs fp32: " in verdicts
    assert "job / model alone" in verdicts and "5k CO" in verdicts and "script run time" in verdicts

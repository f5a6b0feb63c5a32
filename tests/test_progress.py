"""Progress and counters of the long jobs (pipelines.encode, pipelines.rerank in CO mode), run as a user runs
them (``python -m ...`` in a subprocess): stderr shows a progress line with a rate and an ETA, stdout one
``counters[...]`` line naming the counts, and RR_PROGRESS=0 (bar off) writes byte-identical outputs. Also: a
step that fails inside Beam is one line, without Beam's logged traceback."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pipelines.beam_kit import PROGRESS_ENV
from retrieval_core.cli import DEBUG_ENV
from tests.conftest import REPO_ROOT
from tests.test_encode_pipeline import write_tiny_model, write_tiny_staged

NUM_IMAGES = 16  # 4 test images, 8 test captions; 32 captions in all


def run_cli(module: str, *args: str, progress: bool = True, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    full.update(PYTHONPATH=str(REPO_ROOT), **{PROGRESS_ENV: "1" if progress else "0"}, **env)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=str(REPO_ROOT), env=full,
                          capture_output=True, text=True, timeout=300)


def bar_lines(stderr: str, label: str) -> list[str]:
    """The progress bar's states (tqdm redraws with \\r) that carry a rate and an ETA."""
    unit_rate = r"(?:[\d.]+\S+/s|[\d.]+s/\S+)"  # "45.20items/s", or "2.10s/items" below one per second
    pattern = re.compile(rf"{re.escape(label)}: (\d+)/(\d+) .* \|\s+{unit_rate} \| elapsed \S+ \| ETA [\d:]+$")
    return [s.strip() for s in re.split(r"[\r\n]", stderr) if pattern.search(s.strip())]


def files_bytes(root: str, sub: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(os.path.join(root, sub)):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("progress"))
    staged = write_tiny_staged(os.path.join(root, "staged"), num_images=NUM_IMAGES)
    model = write_tiny_model(os.path.join(root, "model"), root)
    runs = {}
    for progress in (True, False):
        out = os.path.join(root, f"emb-{progress}")
        runs[progress] = (out, run_cli("pipelines.encode", "--staged", staged, "--model", model, "--output", out,
                                       "--batch-size", "4", progress=progress))
    return root, staged, model, runs


def test_encode_shows_progress_and_counters_and_the_bar_changes_no_output(assets):
    _root, _staged, _model, runs = assets
    out, res = runs[True]
    assert res.returncode == 0, res.stderr
    done = bar_lines(res.stderr, "encode")
    total = NUM_IMAGES + 2 * NUM_IMAGES  # every image and caption of the collection
    assert done and done[-1].startswith(f"encode: {total}/{total} items (100%)"), res.stderr
    assert f"counters[encode]: captions_encoded={2 * NUM_IMAGES} images_encoded={NUM_IMAGES}" in res.stdout
    assert "INFO apache_beam" not in res.stderr  # Beam's INFO chatter stays muted

    off_out, off = runs[False]
    assert off.returncode == 0 and not bar_lines(off.stderr, "encode"), off.stderr
    assert "counters[encode]:" in off.stdout  # the counters do not depend on the bar
    on_files, off_files = files_bytes(out, "embeddings"), files_bytes(off_out, "embeddings")
    assert on_files and on_files == off_files
    for name in ("embeddings_manifest.json", "dead_letter.jsonl"):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(off_out, name), "rb") as b:
            assert a.read() == b.read().replace(off_out.encode(), out.encode()), name


def test_rerank_co_shows_ce_progress_and_counters_and_the_bar_changes_no_output(assets, tmp_path):
    _root, staged, model, runs = assets
    emb_dir = runs[True][0]
    outs, results = {}, {}
    for progress in (True, False):
        outs[progress] = str(tmp_path / f"run-{progress}")
        results[progress] = run_cli("pipelines.rerank", "--staged", staged, "--embeddings", emb_dir,
                                    "--be-model", model, "--mode", "co", "--k", "3", "--batch-size", "4",
                                    "--output", outs[progress], progress=progress)
    res = results[True]
    assert res.returncode == 0, res.stderr
    # 8 t2i queries x top 3 images + 4 i2t queries x top 3 captions = 36 CE requests
    done = bar_lines(res.stderr, "rerank CE")
    assert done and done[-1].startswith("rerank CE: 36/36 pairs (100%)"), res.stderr
    line = next(s for s in res.stdout.splitlines() if s.startswith("counters[rerank]:"))
    counts = dict(kv.split("=") for kv in line.split(": ", 1)[1].split())
    assert counts["queries_searched"] == counts["queries_ranked"] == "12", line
    assert counts["ce_pair_requests"] == "36" and 0 < int(counts["ce_pairs_scored"]) <= 36, line
    assert f"CE: {counts['ce_pairs_scored']} unique pairs scored for 36 requested" in res.stdout

    off = results[False]
    assert off.returncode == 0 and not bar_lines(off.stderr, "rerank CE"), off.stderr
    on_files, off_files = files_bytes(outs[True], "rankings"), files_bytes(outs[False], "rankings")
    assert on_files and on_files == off_files


def test_a_failing_step_is_one_line_without_beams_traceback(tmp_path):
    """A captions JSON that cannot be parsed fails its read task inside Beam: one line naming the file and the
    step, and RR_DEBUG=1 keeps the traceback."""
    caps = tmp_path / "caps.json"
    caps.write_text("not json{{{")
    (tmp_path / "m.yaml").write_text(f"""
name: bad
feature_dim: 4
collections:
  c:
    images: {{format: synthetic, num_images: 4, seed: 0, min_regions: 1, max_regions: 2}}
    captions: {{format: karpathy_json, path: {caps}, image_id: filename_stem}}
""")
    args = ("--manifest", str(tmp_path / "m.yaml"), "--output", str(tmp_path / "out"))
    res = run_cli("pipelines.stage", *args)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    errors = [s for s in res.stderr.splitlines() if s.startswith("Error: ")]
    assert len(errors) == 1 and "caps.json: not valid JSON" in errors[0] and "ReadAndStage" in errors[0], res.stderr
    debug = run_cli("pipelines.stage", *args, **{DEBUG_ENV: "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_the_bar_exists_only_where_the_steps_run_in_this_process(monkeypatch, capsys):
    from pipelines.beam_kit import Progress, counter_line, pipeline_options

    monkeypatch.setenv(PROGRESS_ENV, "1")
    with Progress.running(10, "items", "elsewhere", pipeline_options(["--direct_running_mode=multi_processing"])):
        assert Progress._bar is None  # a bar stuck at 0 would mislead: the counters are the progress there
        Progress.advance(3)  # a no-op, not an error
    with Progress.running(10, "items", "here", pipeline_options([])):
        Progress.advance(10)
    assert Progress._bar is None and bar_lines(capsys.readouterr().err, "here")[-1].startswith("here: 10/10 items")
    monkeypatch.setenv(PROGRESS_ENV, "0")
    with Progress.running(10, "items", "off", pipeline_options([])):
        assert Progress._bar is None
    assert counter_line("encode", None, "DaskRunner") == \
        "counters[encode]: not reported by DaskRunner (see its dashboard)"
    assert counter_line("rerank", {"queries_ranked": 4, "ce_pairs_scored": 9}) == \
        "counters[rerank]: ce_pairs_scored=9 queries_ranked=4"

"""The tutorial "Your own data, end to end" (docs/OWN_FEATURES.md), run as written on a tiny collection in the user's
formats.

The commands are parsed from the doc's section itself (every ``python -m`` line of its ``bash`` blocks, in order),
so the doc cannot drift from what is tested: a line that is neither a setting nor a ``python -m`` command fails the
parse, and the settings the doc names must be exactly the ones this test provides.
Each command runs in this process through its click entry point (the same argv; a subprocess per command would
spend most of the budget importing torch and Beam).

The collection is written here in the formats the walkthrough reads: region features as bottom-up-attention
TSV rows (base64 float32 boxes and features, 2048-d) for COCO, Flickr30k and CC images; captions as a Karpathy
``dataset_coco.json`` (train, restval, val, test), LAPS/SCAN ``test_caps.txt`` / ``test_ids.txt`` /
``id_mapping.json`` for Flickr30k and the Conceptual Captions validation TSV. Where ``../shared/realdata`` is
present the caption text and ids are the real ones (COCO 5k test and dev lines of laps_karpathy_ids, Flickr30k
test lines with their id mapping, the first CC validation rows; which Karpathy split a COCO image is put in is
this test's choice); elsewhere captions are generated from a word list. Features are random either way.
"""
from __future__ import annotations

import base64
import importlib
import json
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tests.conftest import REPO_ROOT, realdata_dir
from tests.helpers_model import write_tiny_bert

DOC = REPO_ROOT / "docs" / "OWN_FEATURES.md"  # the tutorial the README links to
SECTION = "# Your own data, end to end"
FEATURE_DIM = 2048
# COCO images per Karpathy split in the tiny collection, and TSV rows no caption names (skipped by staging)
N_TEST, N_VAL, N_TRAIN, N_RESTVAL, N_UNCAPTIONED = 12, 8, 16, 8, 5
N_F30K, N_CC, N_CC_CAPTIONS = 8, 10, 11  # the last CC caption's image has no features: one reject
CAPS_PER_IMAGE = 5
WORDS = ("a man woman dog cat red blue green on in with riding sitting next to the street table grass "
         "two small large white black bike horse car tree").split()


# ------------------------------------------------------------------------------------------- the doc
def walkthrough(doc: str, section: str = SECTION) -> tuple[dict[str, str], list[list[str]]]:
    """(settings as the doc gives them, commands as argv lists with $VARS unexpanded) of the section."""
    start = doc.index(section)
    end = doc.find("\n## ", start + len(section))
    text = doc[start:end if end >= 0 else len(doc)]
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert blocks, f"no bash block in the section {section!r}"
    settings, commands = {}, []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            if not tokens:
                continue
            if tokens[0] == "export":
                tokens = tokens[1:]
            if all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", t) for t in tokens):
                settings.update(t.split("=", 1) for t in tokens)
            elif tokens[:2] == ["python", "-m"] and len(tokens) > 2:
                commands.append(tokens[2:])
            else:
                raise AssertionError(f"walkthrough line is neither a setting nor a python -m command: {line!r}")
    return settings, commands


def expand(token: str, values: dict[str, str]) -> str:
    """$NAME / ${NAME} from ``values`` only: a variable the settings do not define fails the test."""
    def sub(m):
        name = m.group(1) or m.group(2)
        assert name in values, f"walkthrough command uses ${name}, which the settings block does not set"
        return values[name]

    return re.sub(r"\$(?:\{([A-Z_][A-Z0-9_]*)\}|([A-Z_][A-Z0-9_]*))", sub, token)


def run_command(module: str, args: list[str]) -> str:
    """``python -m module args`` through the module's click command in this process; its output. A pipeline is a
    package whose command lives in its ``run`` module (what its ``__main__`` calls)."""
    found = importlib.import_module(module)
    command = getattr(found, "main", None) or importlib.import_module(f"{module}.run").main
    result = CliRunner().invoke(command, args, catch_exceptions=False)
    assert result.exit_code == 0, f"python -m {module} {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result.output


# ---------------------------------------------------------------------------------------- the inputs
def _b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.float32).tobytes()).decode()


def write_butd_tsv(path: Path, ids: list[str], rng: np.random.Generator) -> None:
    """Bottom-up-attention TSV rows: image_id, image_w, image_h, num_boxes, boxes (N,4 pixel xyxy), features."""
    rows = []
    for image_id in ids:
        n = int(rng.integers(3, 7))
        w, h = int(rng.integers(300, 640)), int(rng.integers(300, 480))
        x1, y1 = rng.uniform(0, w / 2, n), rng.uniform(0, h / 2, n)
        boxes = np.stack([x1, y1, x1 + rng.uniform(10, w / 2, n), y1 + rng.uniform(10, h / 2, n)], axis=1)
        feats = np.maximum(rng.normal(0, 1, (n, FEATURE_DIM)), 0)  # post-ReLU, like BUTD features
        rows.append("\t".join([image_id, str(w), str(h), str(n), _b64(boxes), _b64(feats)]))
    path.write_text("\n".join(rows) + "\n")


def _generated(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 11)))) for _ in range(n)]


def _line_groups(caps_path: Path, ids_path: Path, n_images: int, skip: int = 0) -> list[tuple[str, list[str]]]:
    """(image id, its caption lines) of images skip..skip+n_images of a LAPS caps/ids pair, in file order."""
    caps = caps_path.read_text(encoding="utf-8").splitlines()
    ids = ids_path.read_text().split()
    groups: dict[str, list[str]] = {}
    for cap, image in zip(caps, ids):
        if image not in groups and len(groups) == skip + n_images:
            break
        groups.setdefault(image, []).append(cap)
    return list(groups.items())[skip:]


def write_inputs(root: Path, real) -> dict:
    """The user's files; returns their paths (the walkthrough's settings) and what the test expects of them."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    laps = real / "laps_karpathy_ids" / "data" if real else None
    # COCO: a Karpathy dataset_coco.json and one BUTD TSV with every image of it plus uncaptioned ones
    if laps:
        test = _line_groups(laps / "coco" / "testall_caps.txt", laps / "coco" / "testall_ids.txt",
                            N_TEST + N_TRAIN + N_RESTVAL)
        val = _line_groups(laps / "coco" / "dev_caps.txt", laps / "coco" / "dev_ids.txt", N_VAL)
        taken = {i for i, _ in test + val}
        uncaptioned = [i for i in (laps / "coco" / "train_ids.txt").read_text().split() if i not in taken]
        uncaptioned = list(dict.fromkeys(uncaptioned))[:N_UNCAPTIONED]
    else:
        ids = [str(100000 + 7 * i) for i in range(N_TEST + N_TRAIN + N_RESTVAL + N_VAL + N_UNCAPTIONED)]
        groups = [(i, _generated(rng, CAPS_PER_IMAGE)) for i in ids]
        test, val = groups[:N_TEST + N_TRAIN + N_RESTVAL], groups[N_TEST + N_TRAIN + N_RESTVAL:][:N_VAL]
        uncaptioned = ids[-N_UNCAPTIONED:]
    split_of = ["test"] * N_TEST + ["train"] * N_TRAIN + ["restval"] * N_RESTVAL
    entries = [(cid, caps, split) for (cid, caps), split in zip(test, split_of)] + [(c, t, "val") for c, t in val]
    images, sentid = [], 0
    for imgid, (cocoid, caps, split) in enumerate(entries):
        sentences = []
        for cap in caps:
            sentences.append({"raw": cap, "tokens": cap.lower().split(), "imgid": imgid, "sentid": sentid})
            sentid += 1
        images.append({"filepath": "val2014", "filename": f"COCO_val2014_{int(cocoid):012d}.jpg", "imgid": imgid,
                       "split": split, "sentids": [s["sentid"] for s in sentences], "cocoid": int(cocoid),
                       "sentences": sentences})
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    coco_ids = [str(cid) for cid, _, _ in entries] + uncaptioned
    write_butd_tsv(root / "coco_trainval_butd.tsv", coco_ids, rng)

    # Flickr30k 1k test as LAPS/SCAN lines (index ids + id_mapping.json) and its BUTD TSV (ids = file stems)
    f30k = root / "laps_f30k"
    f30k.mkdir()
    if laps:
        groups = _line_groups(laps / "f30k" / "test_caps.txt", laps / "f30k" / "test_ids.txt", N_F30K)
        mapping = json.loads((laps / "f30k" / "id_mapping.json").read_text())
        mapping = {i: mapping[i] for i, _ in groups}
    else:
        groups = [(str(i), _generated(rng, CAPS_PER_IMAGE)) for i in range(N_F30K)]
        mapping = {i: f"{1000092795 + int(i)}.jpg" for i, _ in groups}
    (f30k / "test_caps.txt").write_text("".join(c + "\n" for _, caps in groups for c in caps), encoding="utf-8")
    (f30k / "test_ids.txt").write_text("".join(f"{i}\n" for i, caps in groups for _ in caps))
    (f30k / "id_mapping.json").write_text(json.dumps(mapping))
    write_butd_tsv(root / "f30k_butd.tsv", [mapping[i].rsplit(".", 1)[0] for i, _ in groups], rng)

    # Conceptual Captions validation rows (caption<TAB>URL) and a BUTD TSV of their images (ids = line numbers)
    if real:
        cc_rows = (real / "conceptual_captions_val" / "Validation_GCC-1.1.0-Validation.tsv").read_text(
            encoding="utf-8").splitlines()[:N_CC_CAPTIONS]
    else:
        cc_rows = [f"{c}\thttp://example.com/{i}.jpg" for i, c in enumerate(_generated(rng, N_CC_CAPTIONS))]
    (root / "cc_val.tsv").write_text("\n".join(cc_rows) + "\n", encoding="utf-8")
    write_butd_tsv(root / "cc_butd.tsv", [str(i) for i in range(N_CC)], rng)
    return {
        "settings": {"COCO_FEATURES": str(root / "coco_trainval_butd.tsv"),
                     "COCO_KARPATHY_JSON": str(root / "dataset_coco.json"),
                     "F30K_FEATURES": str(root / "f30k_butd.tsv"), "F30K_CAPTIONS_DIR": str(f30k),
                     "CC_FEATURES": str(root / "cc_butd.tsv"), "CC_CAPTIONS": str(root / "cc_val.tsv")},
        "test_captions": {str(cid): caps for cid, caps, split in entries if split == "test"},
    }


# ------------------------------------------------------------------------------------------- the run
@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """The walkthrough run once (module scope): its settings, outputs and the commands' output."""
    tmp = tmp_path_factory.mktemp("walkthrough")
    real = realdata_dir()
    real = real if real and (real / "laps_karpathy_ids" / "data" / "coco" / "testall_caps.txt").is_file() else None
    inputs = write_inputs(tmp / "data", real)
    work = tmp / "runs" / "coco"
    # BASE_MODEL: a 2-layer BERT (hidden 32) instead of MiniLM: MiniLM's CPU time for the train, encode and CE
    # steps (~3 min on 2 busy cores) is far over this test's budget; loading MiniLM is tested elsewhere
    base = write_tiny_bert(str(tmp / "bert"), extra_words=WORDS)
    values = {**inputs["settings"], "W": str(work), "BASE_MODEL": base, "DEVICE": "cpu", "STEPS": "3",
              "BATCH": "8", "EVAL_EVERY": "3", "CE_START": "1"}
    doc_settings, commands = walkthrough(DOC.read_text(encoding="utf-8"))
    assert sorted(doc_settings) == sorted(values), "the walkthrough's settings are not the ones this test sets"
    exported = [k for k in doc_settings if k in inputs["settings"]]
    saved = {k: os.environ.get(k) for k in exported + ["RR_DATA_ROOT"]}
    os.environ.pop("RR_DATA_ROOT", None)  # the settings' absolute paths, not a data root
    os.environ.update({k: values[k] for k in exported})
    outputs = []
    import torch

    threads = torch.get_num_threads()
    # one torch thread: the tiny model's batches are far too small to gain from more, and on a busy machine
    # (2 cores shared) idle OpenMP threads spin: a CE batch took 0.7 s on 2 threads, 0.06 s on 1
    torch.set_num_threads(1)
    try:
        for argv in commands:
            outputs.append(run_command(argv[0], [expand(a, values) for a in argv[1:]]))
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"W": work, "commands": commands, "outputs": outputs, "real": real, **inputs}


def _summary(staged: Path) -> dict:
    return json.loads((staged / "summary.json").read_text())


def test_walkthrough_runs_as_written(walked):
    modules = [argv[0] for argv in walked["commands"]]
    assert modules == ["pipelines.stage", "retrieval_core.training.train", "pipelines.encode", "pipelines.build_index",
                       "pipelines.rerank", "benchmarks.evaluate", "benchmarks.evaluate",
                       "pipelines.stage", "pipelines.encode", "pipelines.build_index", "pipelines.rerank",
                       "benchmarks.evaluate", "benchmarks.evaluate"]
    w = walked["W"]
    assert (w / "join" / "best" / "rr_model.json").is_file()
    log = [json.loads(line) for line in (w / "join" / "train_log.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in log) == 3


def test_staging_takes_each_images_split_from_karpathy_and_skips_the_rest(walked):
    coco = _summary(walked["W"] / "staged")["collections"]["coco"]
    images, captions = coco["images"], coco["captions"]
    # restval counts as train; the uncaptioned TSV rows are read, counted as skipped, and not staged
    assert images["staged_by_split"] == {"test": N_TEST, "train": N_TRAIN + N_RESTVAL, "val": N_VAL}
    assert images["records_in"] == N_TEST + N_TRAIN + N_RESTVAL + N_VAL + N_UNCAPTIONED
    assert images["skipped"] == N_UNCAPTIONED and images["rejected"] == 0
    assert captions["staged_by_split"]["test"] == sum(len(c) for c in walked["test_captions"].values())
    # the Karpathy sizes do not hold for this tiny collection: warnings naming the key to set, not errors
    stage_out = walked["outputs"][0]
    assert f"set coco.expected_images.train={N_TRAIN + N_RESTVAL}" in stage_out
    assert f"set coco.expected_images.test={N_TEST}" in stage_out
    assert f"+ {N_UNCAPTIONED} skipped" in stage_out


def _metrics(walked) -> pd.DataFrame:
    return pd.read_csv(walked["W"] / "results" / "metrics.csv")


def test_the_csv_holds_the_5k_and_20k_rows(walked):
    df = _metrics(walked)
    assert len(df) == 8
    n_caps = sum(len(c) for c in walked["test_captions"].values())
    for pool, collection, size in (("5k", "coco", N_TEST), ("20k", "coco_5k", N_TEST + N_F30K + N_CC)):
        rows = df[df["pool"] == pool]
        assert set(zip(rows["mode"], rows["direction"])) == {(m, d) for m in ("JOIN+CO", "EMB") for d in ("t2i", "i2t")}
        assert set(rows["collection"]) == {collection} and set(rows["split"]) == {"test"}
        assert set(rows["collection_size"]) == {size}
        assert dict(zip(rows["direction"], rows["queries"])) == {"t2i": n_caps, "i2t": N_TEST}
        for col in ("R@1", "R@5", "R@10"):
            assert rows[col].between(0, 100).all()


def test_the_distractor_run_ranks_and_reranks_the_other_collections_items(walked):
    """Queries are COCO's, candidates every collection's: the CE scored Flickr30k and CC images too."""
    from retrieval_core.data.store import StagedDataset

    staged = StagedDataset(str(walked["W"] / "staged_20k"))
    meta = staged.images_meta()
    coll_of = dict(zip(meta["item_id"], meta["collection"]))
    caps = staged.captions()
    cap_coll = dict(zip(caps["caption_id"], caps["collection"]))
    run = walked["W"] / "rank_20k"
    manifest = json.loads((run / "rankings_manifest.json").read_text())
    rk = pd.concat([pq.read_table(run / "rankings" / s["name"]).to_pandas() for s in manifest["shards"]])
    t2i, i2t = rk[rk["direction"] == "t2i"], rk[rk["direction"] == "i2t"]
    assert {cap_coll[q] for q in t2i["query_id"]} == {"coco_5k"}
    assert {coll_of[q] for q in i2t["query_id"]} == {"coco_5k"}
    # t2i: 30 candidate images, 12 of them COCO's: each query's CE-scored top 20 holds >= 8 distractor images,
    # which the CE could score only by reading the other collections' regions
    k = 20
    for _, group in t2i[t2i["ce_score"].notna()].groupby("query_id"):
        assert len(group) == k
        assert sum(coll_of[i] != "coco_5k" for i in group["item_id"]) >= k - N_TEST
    i2t_scored = i2t[i2t["ce_score"].notna()]
    assert (i2t_scored.groupby("query_id").size() == k).all()
    assert {cap_coll[i] for i in i2t["item_id"]} <= {"coco_5k", "flickr30k_1k", "cc_dev"}
    cc = _summary(walked["W"] / "staged_20k")["collections"]["cc_dev"]["captions"]
    assert cc["rejected"] == N_CC_CAPTIONS - N_CC  # the caption whose image has no features


def test_the_caption_side_is_the_real_caption_files(walked):
    if walked["real"] is None:
        pytest.skip("real data not found (../shared/realdata/laps_karpathy_ids): the walkthrough ran on "
                    "generated captions")
    from retrieval_core.data.store import StagedDataset

    staged = StagedDataset(str(walked["W"] / "staged"))
    caps = staged.captions(split="test")
    meta = staged.images_meta(split="test")
    source_of = dict(zip(meta["item_id"], meta["source_id"]))
    got = {}
    for image, text in zip(caps["image_item_id"], caps["text"]):
        got.setdefault(source_of[image], set()).add(text)
    real_lines = (walked["real"] / "laps_karpathy_ids" / "data" / "coco" / "testall_caps.txt").read_text(
        encoding="utf-8").splitlines()
    assert got == {i: {c.strip() for c in t} for i, t in walked["test_captions"].items()}
    real_set = {line.strip() for line in real_lines}
    assert all(c in real_set for t in got.values() for c in t)
    assert "391895" in got  # the first image of the COCO 5k Karpathy test


def test_flickr30k_karpathy_manifest_stages_train_val_test(tmp_path, monkeypatch):
    """The walkthrough's Flickr30k variant (its staging step): a Karpathy dataset_flickr30k.json (image id =
    file-name stem) whose captions are the real Flickr30k test captions of the Multi30k DERIVED json where
    ../shared/realdata has it (generated elsewhere; the split of each image is this test's choice), and a BUTD
    TSV holding those images plus uncaptioned ones."""
    rng = np.random.default_rng(1)
    real = realdata_dir()
    derived = real / "multi30k" / "DERIVED_flickr30k_1k_test_5en_5de.json" if real else None
    n_train, n_val, n_test, n_extra = 10, 4, 4, 3
    n = n_train + n_val + n_test
    if derived is not None and derived.is_file():
        items = [(d["image"], d["captions_en"]) for d in json.loads(derived.read_text(encoding="utf-8"))[:n]]
    else:
        items = [(f"{1000092795 + i}.jpg", _generated(rng, CAPS_PER_IMAGE)) for i in range(n)]
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * n_test
    images = [{"filename": name, "imgid": i, "split": split,
               "sentences": [{"raw": c, "sentid": 5 * i + k, "imgid": i} for k, c in enumerate(caps)]}
              for i, ((name, caps), split) in enumerate(zip(items, splits))]
    (tmp_path / "dataset_flickr30k.json").write_text(json.dumps({"images": images, "dataset": "flickr30k"}))
    stems = [name.rsplit(".", 1)[0] for name, _ in items] + [str(900 + i) for i in range(n_extra)]
    write_butd_tsv(tmp_path / "f30k_butd.tsv", stems, rng)
    monkeypatch.setenv("F30K_FEATURES", str(tmp_path / "f30k_butd.tsv"))
    monkeypatch.setenv("F30K_KARPATHY_JSON", str(tmp_path / "dataset_flickr30k.json"))
    monkeypatch.delenv("RR_DATA_ROOT", raising=False)
    out = run_command("pipelines.stage", ["--manifest", "flickr30k_karpathy", "--output", str(tmp_path / "staged")])
    f30k = _summary(tmp_path / "staged")["collections"]["flickr30k"]
    assert f30k["images"]["staged_by_split"] == {"train": n_train, "val": n_val, "test": n_test}
    assert f30k["images"]["skipped"] == n_extra
    assert f30k["captions"]["staged_by_split"] == {s: CAPS_PER_IMAGE * k for s, k in
                                                   (("train", n_train), ("val", n_val), ("test", n_test))}
    assert f"set flickr30k.expected_captions.val={CAPS_PER_IMAGE * n_val}" in out

"""The fault suite: what stage, encode, build_index and rerank (and training, where it applies) do when the
machine misbehaves -- another run in the same output folder, a full disk, a read-only output, a shard whose
bytes changed after it was written, a run interrupted midway, a Dask worker killed, a memory cap -- and that a
rerun after the fault gives the bytes of an undisturbed run.

Each case adds a row (fault, job, outcome, rerun identical) to ``TABLE``; tests/conftest.py prints the table
after the run. The cheap cases run in the default suite (tiny inputs, seconds each). The heavy ones (a Dask
worker SIGKILLed mid-job, a 1.5 GB RLIMIT_DATA cap on tiny inputs and on a 20k-image collection) run with
``RR_FAULTS_HEAVY=1``::

    RR_FAULTS_HEAVY=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_faults.py

A full disk and a read-only folder use a real small filesystem (a tmpfs mounted here: needs root, as in the
project's CI container) and fall back to an injected ENOSPC / EROFS where mounting is not allowed.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Optional

import pytest
from click.testing import CliRunner

from pipelines.build_index import run as index_run
from pipelines.encode import run as encode_run
from pipelines.rerank import run as rerank_run
from pipelines.stage import run as stage_run
from retrieval_core import errors
from retrieval_core.data import outputs
from retrieval_core.training import train
from tests.conftest import REPO_ROOT
from tests.helpers_dask import relative_files
from tests.test_encode_pipeline import write_tiny_model, write_tiny_staged

HEAVY = os.environ.get("RR_FAULTS_HEAVY") == "1"
JOBS = ("stage", "encode", "build_index", "rerank")

#: (fault, job, outcome, rerun identical): printed by tests/conftest.py after the run.
TABLE: list[tuple[str, str, str, str]] = []


def record(fault: str, job: str, outcome: str, identical: str = "n/a") -> None:
    TABLE.append((fault, job, outcome, identical))


# ------------------------------------------------------------------------------------------ inputs
STAGE_MANIFEST = """
name: faults
feature_dim: 32
max_regions: 12
collections:
  syn:
    images: {format: synthetic, num_images: 200, seed: 3, min_regions: 5, max_regions: 12,
             splits: {train: 0.5, test: 0.5}}
    captions: {format: synthetic, captions_per_image: 2}
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Inputs of every job (a manifest, a staged set, a model, embeddings) and each job's undisturbed output."""
    root = str(tmp_path_factory.mktemp("faults"))
    manifest = os.path.join(root, "faults.yaml")
    with open(manifest, "w") as f:
        f.write(STAGE_MANIFEST)
    a = {"root": root, "manifest": manifest, "staged": write_tiny_staged(os.path.join(root, "staged")),
         "model": write_tiny_model(os.path.join(root, "model"), root)}
    for job in JOBS:
        out = os.path.join(root, "clean", job)
        run_job(job, a, out)
        a["clean_" + job] = out
    return a


def job_args(job: str, a: dict, out: str) -> list[str]:
    """The job's CLI arguments from ``a``'s inputs into ``out``."""
    if job == "stage":
        return ["--manifest", a["manifest"], "--output", out, "--images-per-shard", "40"]
    if job == "encode":
        return ["--staged", a["staged"], "--model", a["model"], "--output", out, "--batch-size", "8",
                "--images-per-shard", "8", "--texts-per-shard", "16", "--threads", "1"]
    if job == "build_index":
        return ["--embeddings", a["clean_encode"], "--output", out]
    return ["--staged", a["staged"], "--embeddings", a["clean_encode"], "--index", a["clean_build_index"],
            "--output", out, "--mode", "co", "--k", "3", "--ce-model", a["model"], "--batch-size", "8",
            "--queries-per-shard", "4", "--threads", "1"]  # CE scores' bytes depend on torch's thread count


MAINS = {"stage": stage_run.main, "encode": encode_run.main, "build_index": index_run.main,
         "rerank": rerank_run.main}


def run_job(job: str, a: dict, out: str) -> tuple[int, str]:
    """The job's CLI in this process: (exit code, output); an undisturbed run must exit 0."""
    res = CliRunner().invoke(MAINS[job], job_args(job, a, out))
    if res.exception and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.output


def data_files(root: str) -> list[str]:
    """What a rerun must reproduce byte for byte: every file but the JSON records (which hold timings)."""
    return [f for f in relative_files(root) if not f.endswith(".json")]


def same_as_clean(job: str, a: dict, out: str) -> str:
    """"yes" when ``out`` holds the undisturbed run's files with the same bytes (the test fails otherwise)."""
    clean = a["clean_" + job]
    files = data_files(clean)
    assert files and files == data_files(out), (files, data_files(out))
    for name in files:
        with open(os.path.join(clean, name), "rb") as fa, open(os.path.join(out, name), "rb") as fb:
            assert fa.read() == fb.read(), f"{name} differs from the undisturbed run"
    return "yes"


# ------------------------------------------------------------------------- two runs, one folder
@contextlib.contextmanager
def lock_held_by_another_process(output: str):
    """A live process (not this one) holding ``output``'s run lock; yields its pid."""
    code = ("import sys, time\nfrom retrieval_core.data.outputs import run_lock\n"
            "with run_lock(sys.argv[1], 'holder'):\n    print('held', flush=True)\n    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, output], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("job", JOBS + ("train",))
def test_a_second_run_into_a_held_folder_is_refused_naming_the_first(assets, tmp_path, job):
    out = str(tmp_path / "out")
    with lock_held_by_another_process(out) as holder:
        if job == "train":
            plan = train.TrainPlan(staged=assets["staged"], output=out, config=train.TrainConfig(),
                                    base_model=assets["model"])
            with pytest.raises(errors.OutputBusy) as err:
                train.run(plan)
            msg = str(err.value)
        else:
            code, msg = run_job(job, assets, out)
            assert code != 0
        assert f"pid {holder.pid} on {socket.gethostname()}" in msg and "in use by another run" in msg, msg
        assert os.listdir(out) == [outputs.LOCK_FILE]  # the refused run wrote nothing
    record("second run into a held folder", job, "refused naming the holder (host, pid, start, command)")


@pytest.mark.parametrize("job", JOBS)
def test_a_lock_whose_process_died_is_taken_over_and_the_run_is_whole(assets, tmp_path, job):
    out = str(tmp_path / "out")
    with lock_held_by_another_process(out) as holder:
        pass  # killed: its lock stays, naming a pid that is gone
    assert json.load(open(os.path.join(out, outputs.LOCK_FILE)))["pid"] == holder.pid
    code, msg = run_job(job, assets, out)
    assert code == 0, msg
    assert not os.path.exists(os.path.join(out, outputs.LOCK_FILE))  # released on exit
    record("stale lock (owner SIGKILLed)", job, "taken over with a warning, run completes",
           same_as_clean(job, assets, out))


def test_stale_lock_rules(tmp_path):
    now = time.time()
    here, there = socket.gethostname(), "another-host-" + uuid.uuid4().hex[:6]
    assert outputs.stale_reason({"host": here, "pid": os.getpid()}, now) is None
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert "gone on this host" in outputs.stale_reason({"host": here, "pid": proc.pid}, now)
    assert outputs.stale_reason({"host": there, "pid": 1, "started_s": now - 60}, now) is None
    assert "another host" in outputs.stale_reason({"host": there, "pid": 1, "started_s": now - 2 * 86400}, now)
    # a lock from another host is refused until it is older than stale_after_s, then taken over
    out = tmp_path / "out"
    out.mkdir()
    (out / outputs.LOCK_FILE).write_text(json.dumps({"host": there, "pid": 1, "started_s": now - 3600,
                                                     "started": "an hour ago", "command": "stage"}))
    with pytest.raises(errors.OutputBusy, match=f"pid 1 on {there}"):
        with outputs.run_lock(str(out), "test"):
            pass
    with outputs.run_lock(str(out), "test", stale_after_s=60) as path:
        assert json.load(open(path))["pid"] == os.getpid()
    assert not (out / outputs.LOCK_FILE).exists()
    # a lock being written (unreadable) is busy for a minute, then stale
    (out / outputs.LOCK_FILE).write_text("")
    with pytest.raises(errors.OutputBusy):
        with outputs.run_lock(str(out), "test"):
            pass
    old = now - 2 * outputs.UNREADABLE_STALE_S
    os.utime(out / outputs.LOCK_FILE, (old, old))
    with outputs.run_lock(str(out), "test"):
        pass


@pytest.mark.parametrize("job", JOBS)
def test_the_lock_is_released_when_the_job_fails(assets, tmp_path, job):
    out = str(tmp_path / "out")
    bad = {**assets, "manifest": str(tmp_path / "missing.yaml"), "staged": str(tmp_path / "missing"),
           "clean_encode": str(tmp_path / "missing")}
    code, msg = run_job(job, bad, out)
    assert code != 0 and "Traceback" not in msg
    assert not os.path.exists(out)  # a run refused before writing leaves no folder (and no lock) behind
    os.makedirs(out)
    code, _ = run_job(job, bad, out)
    assert code != 0 and os.listdir(out) == []


def test_two_runs_started_at_once_one_refused_the_other_whole(assets, tmp_path):
    """Two ``python -m pipelines.stage`` into one folder at the same moment: exactly one runs."""
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "pipelines.stage", *job_args("stage", assets, out)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RR_PROGRESS": "0"}
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    refused = next(err for code, err in results if code == 1)
    assert "in use by another run" in refused and "pid" in refused, refused
    record("two runs started at once", "stage", "one refused naming the other; the other whole",
           same_as_clean("stage", assets, out))


# ------------------------------------------------------------------------ full disk, read-only
def _can_mount() -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    probe = f"/tmp/rr-mount-probe-{uuid.uuid4().hex[:8]}"
    os.makedirs(probe)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", probe], check=True)
        return ok
    finally:
        os.rmdir(probe)


CAN_MOUNT = _can_mount()


class SmallDisk:
    """A real tmpfs of ``size`` at ``path`` (needs root); ``fill(leave)`` leaves ``leave`` bytes free,
    ``free()`` gives the space back, ``read_only(flag)`` remounts it."""

    def __init__(self, path: str, size: str = "16m"):
        self.path = path
        os.makedirs(path)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
        self.filler = os.path.join(path, "filler")

    def fill(self, leave: int = 0) -> None:
        with open(self.filler, "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
        st = os.statvfs(self.path)
        if leave:  # give back exactly what the job may use before the disk is full
            with open(self.filler, "r+b") as f:
                f.truncate(max(os.path.getsize(self.filler) - leave + st.f_bavail * st.f_frsize, 0))

    def free(self) -> None:
        os.remove(self.filler)

    def read_only(self, flag: bool) -> None:
        subprocess.run(["mount", "-o", f"remount,{'ro' if flag else 'rw'}", self.path], check=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", self.path], check=False)


@pytest.fixture
def small_disk(tmp_path):
    if not CAN_MOUNT:
        pytest.skip("mounting a tmpfs needs root: test_injected_enospc_in_the_spill_writer_is_one_line covers it")
    disk = SmallDisk(str(tmp_path / "disk"))
    yield disk
    disk.close()


#: Bytes each job may write before the disk is full: past its lock and markers, into its shards.
LEAVE = {"stage": 96 << 10, "encode": 16 << 10, "build_index": 0, "rerank": 8 << 10}


def run_cli_subprocess(job: str, a: dict, out: str) -> tuple[int, str]:
    """The job as a user runs it (its own process: a crash shows as a signal exit code)."""
    res = subprocess.run([sys.executable, "-m", f"pipelines.{job}", *job_args(job, a, out)], cwd=REPO_ROOT,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "RR_PROGRESS": "0"},
                         capture_output=True, text=True, timeout=300)
    return res.returncode, res.stderr


@pytest.mark.parametrize("job", JOBS)
def test_full_disk_then_read_only_output_are_one_line_and_the_rerun_is_identical(assets, small_disk, job):
    out = os.path.join(small_disk.path, "out")
    small_disk.fill(LEAVE[job])
    code, err = (run_cli_subprocess if job == "stage" else run_job)(job, assets, out)
    last = err.strip().splitlines()[-1]
    assert code == 1, (code, err[-3000:])  # never 139 (the h5py segfault) nor a traceback
    assert "no space left on device (ENOSPC)" in last and small_disk.path in last, err[-3000:]
    assert "Traceback" not in err
    record("disk full", job, "one line: ENOSPC + path, exit 1")

    small_disk.free()
    small_disk.read_only(True)
    code, err = run_job(job, assets, out)
    assert code != 0 and "read-only file system (EROFS)" in err, err[-3000:]
    record("read-only output folder", job, "one line: EROFS + path")

    small_disk.read_only(False)
    code, err = run_job(job, assets, out)
    assert code == 0, err[-3000:]
    identical = same_as_clean(job, assets, out)
    record("disk full / read-only, then space freed", job, "rerun completes", identical)


def test_injected_enospc_in_the_spill_writer_is_one_line(assets, tmp_path, monkeypatch):
    """Where no small filesystem can be mounted: ENOSPC injected under h5py's spill writer (the write that
    crashed the interpreter) -- the stage run fails in one line, and the rerun gives the undisturbed bytes."""
    real_open = open
    budget = {"left": 64 << 10}

    class FullDisk:
        def __init__(self, f):
            self._f = f

        def write(self, b):
            budget["left"] -= len(b)
            if budget["left"] < 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)
            return self._f.write(b)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode else f

    monkeypatch.setattr(outputs, "open", full_open, raising=False)
    out = str(tmp_path / "out")
    code, msg = run_job("stage", assets, out)
    assert code == 1 and "no space left on device (ENOSPC) writing" in msg and "_spill" in msg, msg
    assert os.path.exists(os.path.join(out, "_INCOMPLETE"))  # nothing counted as done
    monkeypatch.undo()
    code, msg = run_job("stage", assets, out)
    assert code == 0, msg
    record("disk full (injected in the spill writer)", "stage", "one line: ENOSPC + path, exit 1",
           same_as_clean("stage", assets, out))


def test_write_failures_are_recognised_through_any_wrapper():
    raw = OSError(errno.ENOSPC, "No space left on device", "/data/x.parquet")
    assert errors.write_failure(raw).startswith("no space left on device (ENOSPC) writing /data/x.parquet")
    wrapped = RuntimeError("RuntimeError: , filename = '/o/_spill/a.h5.tmp-1', file descriptor = 8, errno = 28, "
                           "error message = 'No space left on device' [while running 'ReadAndStage']")
    assert "ENOSPC) writing /o/_spill/a.h5.tmp-1" in errors.write_failure(wrapped)
    assert "EDQUOT" in errors.write_failure(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert "EROFS" in errors.write_failure(RuntimeError("OSError: [Errno 30] Read-only file system: '/ro/x'"))
    assert errors.write_failure(OSError(errno.ENOENT, "No such file")) is None
    assert errors.write_failure(ValueError("bad value")) is None


# ---------------------------------------------------------------- a shard changed after writing
def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _copy(a: dict, key: str, dst: str) -> str:
    shutil.copytree(a[key], dst)
    return dst


def test_a_shard_changed_after_writing_is_refused_by_every_reader(assets, tmp_path):
    from benchmarks import evaluate

    a = assets
    staged = _copy(a, "staged", str(tmp_path / "staged"))
    _flip_last_byte(os.path.join(staged, "images", sorted(os.listdir(os.path.join(staged, "images")))[0]))
    bad = {**a, "staged": staged}
    for job in ("encode", "rerank"):
        code, msg = run_job(job, bad, str(tmp_path / f"{job}-of-bad-staged"))
        assert code != 0 and ("checksum" in msg.lower() or "sha256" in msg.lower()), msg
        record("staged shard changed after writing", job, "refused by its sha256")
    with pytest.raises(Exception, match="(?i)checksum|sha256"):
        train.run(train.TrainPlan(staged=staged, output=str(tmp_path / "train"), config=train.TrainConfig(),
                                  base_model=a["model"]))
    record("staged shard changed after writing", "train", "refused by its sha256")

    emb = _copy(a, "clean_encode", str(tmp_path / "emb"))
    shard = sorted(os.listdir(os.path.join(emb, "embeddings", "image")))[0]
    _flip_last_byte(os.path.join(emb, "embeddings", "image", shard))
    for job in ("build_index", "rerank"):
        code, msg = run_job(job, {**a, "clean_encode": emb}, str(tmp_path / f"{job}-of-bad-emb"))
        assert code != 0 and shard in msg, msg
        record("embedding shard changed after writing", job, "refused naming the shard")

    index = _copy(a, "clean_build_index", str(tmp_path / "index"))
    shard = sorted(os.listdir(os.path.join(index, "shards")))[0]
    _flip_last_byte(os.path.join(index, "shards", shard))
    code, msg = run_job("rerank", {**a, "clean_build_index": index}, str(tmp_path / "rerank-of-bad-index"))
    assert code != 0 and shard in msg, msg
    record("index shard changed after writing", "rerank", "refused naming the shard")

    ranks = _copy(a, "clean_rerank", str(tmp_path / "ranks"))
    shard = sorted(os.listdir(os.path.join(ranks, "rankings")))[0]
    _flip_last_byte(os.path.join(ranks, "rankings", shard))
    res = CliRunner().invoke(evaluate.main, ["--rankings", ranks, "--staged", a["staged"], "--output",
                                             str(tmp_path / "results"), "--model", "m"])
    assert res.exit_code != 0 and shard in res.output, res.output
    record("ranking shard changed after writing", "evaluate", "refused naming the shard")


# ------------------------------------------------------------------------------- interrupted
def test_an_interrupted_build_index_resumes_to_the_same_bytes(assets, tmp_path):
    out = _copy(assets, "clean_build_index", str(tmp_path / "index"))
    shards = sorted(os.listdir(os.path.join(out, "shards")))
    os.remove(os.path.join(out, "index_manifest.json"))  # killed before its manifest
    os.remove(os.path.join(out, "shards", shards[-1]))  # and before its last shard
    code, msg = run_job("build_index", assets, out)
    assert code == 0, msg
    record("interrupted (killed before its last shard)", "build_index", "resumes",
           same_as_clean("build_index", assets, out))


# ------------------------------------------------------------------------------------ heavy
@pytest.mark.skipif(not HEAVY, reason="heavy: RR_FAULTS_HEAVY=1 runs it (a Dask cluster per job)")
@pytest.mark.parametrize("job", JOBS)
def test_a_dask_worker_killed_mid_job_then_the_rerun_is_identical(assets, tmp_path, job):
    distributed = pytest.importorskip("distributed")
    from tests.helpers_dask import dask_args

    with distributed.LocalCluster(n_workers=3, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        client = distributed.Client(cluster)
        out = str(tmp_path / "out")
        cmd = [sys.executable, "-m", f"pipelines.{job}", *job_args(job, assets, out), *dask_args(cluster)]
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killed = None
        deadline = time.time() + 120
        while killed is None and time.time() < deadline and proc.poll() is None:
            busy = [w for w, n in client.processing().items() if n]
            if busy:
                pid = client.run(os.getpid, workers=[busy[0]])[busy[0]]
                os.kill(pid, signal.SIGKILL)
                killed = pid
            time.sleep(0.05)
        _, err = proc.communicate(timeout=600)
        client.close()
    if proc.returncode == 0:
        outcome = f"finished through retries (worker pid {killed} killed)" if killed else "finished before a kill"
    else:
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in last and ("while running" in last or "step" in last or "failed" in last), err
        outcome = "failed in one line naming the step"
    code, msg = run_job(job, assets, out)
    assert code == 0, msg
    record("Dask worker SIGKILLed mid-job", job, outcome, same_as_clean(job, assets, out))


def _status_kib(pid: int) -> dict[str, int]:
    """VmData and VmHWM (kB) of a live process; {} once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmData", "VmHWM")}
    except (OSError, ValueError):
        return {}


def run_capped(job: str, a: dict, out: str, cap: int, code: str = "",
               args: Optional[list[str]] = None) -> subprocess.CompletedProcess:
    """``python -m pipelines.<job>`` (or ``code``) in a process whose RLIMIT_DATA is ``cap``, as ``ulimit -d``
    sets it; nothing else of the environment is tuned for it. ``args`` replaces job_args; the result carries
    the peaks sampled from /proc every 0.1 s: ``peak_data`` (VmData, what the cap counts) and ``peak_rss``."""
    # RLIMIT_DATA (heap and private mappings), not RLIMIT_AS: Beam's gRPC and torch reserve GBs of address
    # space they never touch, so under a 1.5 GB RLIMIT_AS no thread starts (measured: stage fails at once)
    code = code or f"import runpy, sys\nsys.argv = ['{job}'] + sys.argv[1:]\n" \
                   f"runpy.run_module('pipelines.{job}', run_name='__main__')\n"
    code = f"import resource\nresource.setrlimit(resource.RLIMIT_DATA, ({cap}, {cap}))\n" + code
    cmd = [sys.executable, "-c", code, *(job_args(job, a, out) if args is None else args)]
    peaks, deadline = {"VmData": 0, "VmHWM": 0}, time.time() + 600
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                                                         "RR_PROGRESS": "0"}, stdout=fo, stderr=fe, text=True)
        while proc.poll() is None:
            for k, v in _status_kib(proc.pid).items():
                peaks[k] = max(peaks[k], v)
            if time.time() > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, 600)
            time.sleep(0.1)
        fo.seek(0)
        fe.seek(0)
        res = subprocess.CompletedProcess(cmd, proc.returncode, fo.read(), fe.read())
    res.peak_data, res.peak_rss = peaks["VmData"] << 10, peaks["VmHWM"] << 10
    return res


@pytest.mark.skipif(not HEAVY, reason="heavy: RR_FAULTS_HEAVY=1 runs it (each job in a capped process)")
@pytest.mark.parametrize("job", JOBS)
def test_a_job_under_a_hard_memory_cap_completes_or_names_the_need(assets, tmp_path, job):
    """Under a 1.5 GB cap every job completes with the undisturbed bytes (or names its need: never a SIGABRT);
    under a cap just above what the job has loaded when it starts, it is refused in one line naming its need,
    the cap and the options that lower the need, before anything runs."""
    cap = int(os.environ.get("RR_FAULTS_MEMORY_CAP", 1536 << 20))
    out = str(tmp_path / "out")
    res = run_capped(job, assets, out, cap)
    assert res.returncode in (0, 1), (res.returncode, res.stderr[-3000:])  # 134 was gRPC's abort
    if res.returncode == 0:
        outcome, identical = "completes", same_as_clean(job, assets, out)
    else:
        last = res.stderr.strip().splitlines()[-1]
        assert "memory" in last.lower() and "--" in last, res.stderr[-3000:]
        outcome, identical = "fails naming the memory need and the option", "n/a"
    record(f"memory (RLIMIT_DATA) capped at {cap >> 20} MB", job, outcome, identical)

    # what the job holds once its modules are loaded, measured under the same cap
    probe = run_capped(job, assets, out, cap, f"import pipelines.{job}.run\nfrom retrieval_core.memory import "
                                             "vm_data\nprint(vm_data())\n")
    low = int(probe.stdout.split()[-1]) + (32 << 20)
    low_out = str(tmp_path / "low")
    res = run_capped(job, assets, low_out, low)
    last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
    assert res.returncode == 1, (res.returncode, res.stderr[-3000:])
    assert f"{job} needs about" in last and f"RLIMIT_DATA (getrlimit) is {low / 2**20:.0f} MiB" in last \
        and "lower --threads" in last, res.stderr[-3000:]
    assert not os.path.exists(os.path.join(low_out, "_RUN_LOCK"))
    record("memory capped 32 MB above what the job has loaded at start", job,
           "refused at start: one line naming the need, the cap and the options")


#: The 20k case: the project's memory-scaling collection (data_manifests/synthetic_memory.yaml: 1 caption and
#: 12 float16 1024-d regions per image, what benchmarks.run --suite memory stages) at BIG_IMAGES images.
BIG_IMAGES = int(os.environ.get("RR_FAULTS_BIG_IMAGES", 20_000))
#: Queries per direction the 20k rerank ranks against the whole pool (every query would be 40k CE rankings).
BIG_QUERIES = 50


def big_args(job: str, b: dict, out: str) -> list[str]:
    """The 20k jobs' arguments: the manifest's own shard sizes and the CLIs' defaults, but one torch thread
    (the CE scores' bytes depend on it) and a queries file for rerank."""
    if job == "stage":
        return ["--manifest", "synthetic_memory", "--set", f"synthetic_memory.images.num_images={BIG_IMAGES}",
                "--output", out]
    if job == "encode":
        return ["--staged", b["staged"], "--model", b["model"], "--output", out, "--threads", "1"]
    if job == "build_index":
        return ["--embeddings", b["clean_encode"], "--output", out]
    return ["--staged", b["staged"], "--embeddings", b["clean_encode"], "--index", b["clean_build_index"],
            "--output", out, "--mode", "co", "--k", "3", "--ce-model", b["model"], "--queries", b["queries"],
            "--threads", "1"]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The 20k collection staged, encoded, indexed and reranked once without a cap (the bytes each capped run
    must give), with a tiny model that reads its 12 regions of 1024-d features (a job's memory follows the
    data's shapes and the model's size; ``RR_FAULTS_BIG_MODEL`` names a real model folder to use instead)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.rerank.plan import split_query_ids
    from retrieval_core.data.store import StagedDataset
    from tests.helpers_model import tiny_model

    root = str(tmp_path_factory.mktemp("faults20k"))
    b = {"root": root, "model": os.environ.get("RR_FAULTS_BIG_MODEL") or os.path.join(root, "model")}
    if not os.environ.get("RR_FAULTS_BIG_MODEL"):
        model = tiny_model(root, feature_dim=1024)
        model.cfg.max_regions = 12
        model.save(b["model"])
    for job in JOBS:
        out = os.path.join(root, "clean", job)
        res = CliRunner().invoke(MAINS[job], big_args(job, b, out))
        assert res.exit_code == 0, res.output[-3000:]
        b["clean_" + job] = out
        if job == "stage":  # a copy: encode and rerank add their token-id cache to the staged folder they read
            b["staged"] = shutil.copytree(out, os.path.join(root, "staged"))
            ds, directions, ids = StagedDataset(out), [], []
            for d in ("t2i", "i2t"):
                every = split_query_ids(ds, d, None, "test")
                pick = every[:: max(len(every) // BIG_QUERIES, 1)][:BIG_QUERIES].tolist()
                directions, ids = directions + [d] * len(pick), ids + pick
            b["queries"] = os.path.join(root, "queries.parquet")
            pq.write_table(pa.table({"direction": directions, "query_id": pa.array(ids, pa.int64())}), b["queries"])
    return b


@pytest.mark.skipif(not HEAVY, reason="heavy: RR_FAULTS_HEAVY=1 runs it (20k images, each job in a capped process)")
@pytest.mark.parametrize("job", JOBS)
def test_a_job_on_a_20k_collection_under_a_hard_memory_cap_completes_or_names_the_need(big, tmp_path, job):
    """The issue's case: 1.5 GB per process on a 20k collection. Each job completes with the uncapped run's
    bytes, or fails in one line naming its memory need and the option that lowers it (never a signal or a
    traceback)."""
    cap = int(os.environ.get("RR_FAULTS_MEMORY_CAP", 1536 << 20))
    out = str(tmp_path / "out")
    res = run_capped(job, big, out, cap, args=big_args(job, big, out))
    peak = f"peak VmData {res.peak_data >> 20} MB, RSS {res.peak_rss >> 20} MB"
    assert res.returncode in (0, 1), (res.returncode, peak, res.stderr[-3000:])
    if res.returncode == 0:
        outcome, identical = f"completes ({peak})", same_as_clean(job, big, out)
    else:
        last = res.stderr.strip().splitlines()[-1]
        assert "memory" in last.lower() and "lower --" in last and "Traceback" not in res.stderr, res.stderr[-3000:]
        outcome, identical = f"fails in one line naming the need and the option ({peak})", "n/a"
    record(f"memory (RLIMIT_DATA) capped at {cap >> 20} MB, {BIG_IMAGES:,} images", job, outcome, identical)


# ----------------------------------------------------------------------------------- hostile inputs
def test_hostile_records_are_each_rejected_with_a_reason_and_counted(tmp_path):
    """Two feature files (shards of one source) with NaN / inf features, a zero-region image, a gigantic
    line, an id in both files; captions with non-UTF-8 bytes and a gigantic caption: every record is staged or
    rejected with its reason, and in = staged + rejected holds."""
    import numpy as np

    from tests.test_stage_pipeline import b64, tsv_row

    f = 16
    big = "x" * (8 << 20)  # an 8 MB line: read, judged and rejected like any other
    (tmp_path / "a.tsv").write_text("\n".join([
        tsv_row("a", dim=f, seed=1), tsv_row("b", dim=f, seed=2), tsv_row("nan", dim=f, nan=True),
        "\t".join(["inf", "100", "80", "1", b64([[5, 5, 50, 40]]), b64(np.full((1, f), np.inf))]),
        "\t".join(["zero", "100", "80", "0", "", ""]),
        "\t".join(["huge", "100", "80", "1", b64([[5, 5, 50, 40]]), big]),
    ]) + "\n")
    (tmp_path / "b.tsv").write_text("\n".join([tsv_row("c", dim=f, seed=3), tsv_row("a", dim=f, seed=9)]) + "\n")
    images = [{"filename": f"{x}.jpg", "split": "test", "sentences": [{"sentid": i, "raw": f"photo {x}"}]}
              for i, x in enumerate("abc")]
    images[1]["sentences"].append({"sentid": 10, "raw": "BADUTF8"})
    images[2]["sentences"].append({"sentid": 11, "raw": "word " * (1 << 20)})  # a 5 MB caption
    (tmp_path / "caps.json").write_bytes(json.dumps({"images": images}).encode().replace(b"BADUTF8", b"caf\xff"))
    (tmp_path / "m.yaml").write_text(f"""
name: hostile
feature_dim: {f}
max_regions: 12
collections:
  h:
    images: {{format: butd_tsv, path: '{tmp_path}/*.tsv'}}
    captions: {{format: karpathy_json, path: {tmp_path / 'caps.json'}, image_id: filename_stem}}
""")
    out = str(tmp_path / "out")
    code, msg = run_job("stage", {"manifest": str(tmp_path / "m.yaml")}, out)
    summary = json.load(open(os.path.join(out, "summary.json")))
    counts = {}
    for kind in ("images", "captions"):
        src = summary["collections"]["h"][kind]
        assert src["records_in"] == src["staged"] + src["rejected"] + src.get("skipped", 0), src
        counts[kind] = src
    reasons = " ".join(counts["images"]["reject_reasons"])
    for why in ("non-finite", "num_boxes is 0", "duplicate", "wrong feature dim"):  # the last: the 8 MB line
        assert why in reasons, counts["images"]["reject_reasons"]
    assert counts["images"]["staged"] == 3 and counts["images"]["rejected"] == 5, counts["images"]
    assert counts["captions"]["rejected"] >= 1, counts["captions"]  # the non-UTF-8 caption
    record("hostile records (NaN, inf, zero regions, 8 MB line, duplicate id across files, non-UTF-8)", "stage",
           f"{counts['images']['rejected'] + counts['captions']['rejected']} rejected with reasons; "
           "in = staged + rejected")


@pytest.mark.parametrize("where", ["manifest", "--set"])
def test_yaml_tags_that_construct_objects_are_refused(tmp_path, where):
    marker = tmp_path / "constructed"
    tag = f"!!python/object/apply:os.system ['touch {marker}']"
    manifest = tmp_path / "m.yaml"
    manifest.write_text(STAGE_MANIFEST.replace("name: faults", f"name: {tag}" if where == "manifest"
                                                else "name: faults"))
    args = ["--manifest", str(manifest), "--output", str(tmp_path / "out")]
    if where == "--set":
        args += ["--set", f"name={tag}"]
    res = CliRunner().invoke(stage_run.main, args)
    assert res.exit_code == 1 and "python/object" in res.output, res.output
    assert not marker.exists()  # yaml.safe_load everywhere: nothing was constructed
    record(f"YAML tag constructing an object ({where})", "stage", "refused in one line, nothing constructed")


def test_running_out_of_memory_is_one_line_naming_the_need_and_the_options():
    from retrieval_core.cli import memory_failure

    wrapped = RuntimeError("numpy._core._exceptions._ArrayMemoryError: Unable to allocate 1.50 GiB for an array "
                           "with shape (400000, 1024) [while running 'WriteShard']")
    msg = memory_failure(wrapped, ("--batch-size",))
    assert msg.startswith("out of memory allocating 1.50 GiB") and "lower --batch-size" in msg, msg
    torch_text = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 268435456 bytes.")
    assert "allocating 256 MiB" in memory_failure(torch_text, ("--batch-size", "--pairs-per-wave"))
    assert memory_failure(MemoryError()).startswith("out of memory: give the job more memory")
    assert memory_failure(ValueError("bad value")) is None


def _python_without_mimalloc_setting(code: str, timeout: int) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose environment lacks MIMALLOC_ARENA_EAGER_COMMIT (as a user's would)."""
    env = {k: v for k, v in os.environ.items() if k != "MIMALLOC_ARENA_EAGER_COMMIT"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(REPO_ROOT)}, timeout=timeout)


def test_a_memory_cap_below_what_a_job_needs_to_start_is_refused_in_one_line():
    """A real RLIMIT_DATA in a small process: under it mimalloc is told to reserve, not commit (what let gRPC
    abort), and a start need above the cap is one line naming the need, the cap and the options."""
    code = ("import os, resource\nfrom retrieval_core import memory\n"
            "print(os.environ.get('MIMALLOC_ARENA_EAGER_COMMIT'))\n"
            "cap = memory.vm_data() + (64 << 20)\n"
            "resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))\n"
            "memory.bound_reservations()\nprint(os.environ.get('MIMALLOC_ARENA_EAGER_COMMIT'))\n"
            "memory.require_headroom('encode', 1, ('--threads', '--batch-size'), model_bytes=1 << 20)\n")
    res = _python_without_mimalloc_setting(code, timeout=60)
    assert res.stdout.split() == ["None", "0"], res.stdout  # nothing changes without a cap
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("retrieval_core.errors.MemoryCapTooLow: encode needs about"), res.stderr
    assert "1.0 MiB of model weights" in last and "RLIMIT_DATA (getrlimit) is" in last, last
    assert "lower --threads or --batch-size, or raise the limit (ulimit -d)" in last, last
    record("memory cap below the start need (small process)", "any", "one line: need, cap, options")


def test_the_train_cli_under_a_memory_cap_does_not_commit_pyarrows_arena():
    """``python -m retrieval_core.training.train`` reads Parquet through pyarrow without pipelines/__init__:
    under a cap its package must still tell mimalloc to reserve, not commit, its 1 GiB arena (measured: VmData
    +1 GiB on pyarrow's first allocation without it), or a 1.5 GB cap leaves training a third of its memory."""
    code = ("import os, resource\nresource.setrlimit(resource.RLIMIT_DATA, (3 << 30, resource.RLIM_INFINITY))\n"
            "import retrieval_core.training.train\nimport pyarrow as pa\nfrom retrieval_core.memory import vm_data\n"
            "before = vm_data()\npa.array(list(range(1000)))\n"
            "print(os.environ.get('MIMALLOC_ARENA_EAGER_COMMIT'), (vm_data() - before) >> 20)\n")
    res = _python_without_mimalloc_setting(code, timeout=120)
    setting, grown_mib = res.stdout.split()
    assert setting == "0" and int(grown_mib) < 256, (res.stdout, res.stderr[-2000:])
    record("memory capped: pyarrow's arena at the train CLI's start", "train", "reserved, not committed")


# ------------------------------------------------------------------------- paths escaping their root
ESCAPES = ("..", "absolute", "symlink")


def _escaping_path(kind: str, root, outside) -> str:
    """A path written under ``root`` that leads to ``outside`` (a file outside it) by ``kind``."""
    if kind == "..":
        return os.path.relpath(outside, root)  # ../outside/...: relative, resolved against the root
    if kind == "absolute":
        return str(outside)
    link = root / "link.tsv"
    link.symlink_to(outside)
    return "link.tsv"


@pytest.mark.parametrize("kind", ESCAPES)
def test_a_manifest_path_leading_outside_its_root_is_refused_naming_path_and_root(tmp_path, kind):
    from retrieval_core.data.manifest import load_manifest
    from retrieval_core.data.manifest_spec import ManifestError

    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "caps.json").write_text('{"images": []}')
    (elsewhere / "secret.tsv").write_text("")
    manifest = root / "m.yaml"
    written = _escaping_path(kind, root, elsewhere / "secret.tsv")
    manifest.write_text(f"""
name: escape
feature_dim: 8
collections:
  c:
    images: {{format: butd_tsv, path: '{written}'}}
    captions: {{format: karpathy_json, path: caps.json}}
""")
    env = {"RR_DATA_ROOT": str(root)}
    with pytest.raises(ManifestError) as err:
        load_manifest(str(manifest), env=env)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("m.yaml: collections.c.images.path:"), msg
    assert written in msg and str(elsewhere / "secret.tsv") in msg and f"{root} (RR_DATA_ROOT" in msg, msg
    # the CLI: one line, nothing written
    res = CliRunner().invoke(stage_run.main, ["--manifest", str(manifest), "--output", str(tmp_path / "out")],
                             env=env)
    assert res.exit_code == 1 and "outside the manifest's roots" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()
    # the legitimate ways to read data kept elsewhere: the user's command line or environment, or a root the
    # file declares with ${VAR} set to that folder
    m = load_manifest(str(manifest), [f"c.images.path={elsewhere / 'secret.tsv'}"], env=env)
    assert m.collections["c"].images.path == str(elsewhere / "secret.tsv")
    m = load_manifest(str(manifest), env={**env, "RR_C_IMAGES_PATH": str(elsewhere / "secret.tsv")})
    assert m.collections["c"].images.path == str(elsewhere / "secret.tsv")
    manifest.write_text(manifest.read_text().replace(f"'{written}'", "'${FEATS_DIR:-feats}/secret.tsv'"))
    m = load_manifest(str(manifest), env={**env, "FEATS_DIR": str(elsewhere)})
    assert m.collections["c"].images.path == str(elsewhere / "secret.tsv")
    manifest.write_text(manifest.read_text().replace("/secret.tsv'", "/../data/caps.json'"))
    load_manifest(str(manifest), env={**env, "FEATS_DIR": str(elsewhere)})  # back inside the data root: fine
    manifest.write_text(manifest.read_text().replace("'${FEATS_DIR:-feats}/../data/caps.json'",
                                                     "'${FEATS_DIR:-feats}/../../x.tsv'"))
    with pytest.raises(ManifestError, match=r"\$FEATS_DIR"):  # out of its declared folder and every other root
        load_manifest(str(manifest), env={**env, "FEATS_DIR": str(elsewhere)})
    record(f"manifest path leading outside its root ({kind})", "stage", "refused in one line naming path and roots")


def test_image_list_entries_leading_outside_their_root_are_rejected_with_a_reason_and_counted(tmp_path):
    """A list of image files whose lines lead outside the list's folder (``..``, an absolute path, a symlink
    out): each is rejected unread with its reason, the others staged, and in = staged + rejected."""
    from PIL import Image

    photos, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    photos.mkdir()
    elsewhere.mkdir()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(photos / "good.jpg")
    for name in ("up.jpg", "abs.jpg", "target.jpg"):
        Image.new("RGB", (40, 30), (30, 30, 200)).save(elsewhere / name)
    (photos / "linked.jpg").symlink_to(elsewhere / "target.jpg")
    (photos / "list.txt").write_text(f"good.jpg\n../elsewhere/up.jpg\n{elsewhere / 'abs.jpg'}\nlinked.jpg\n")
    captions = [{"filename": f"{n}.jpg", "split": "test", "sentences": [{"sentid": i, "raw": f"photo {n}"}]}
                for i, n in enumerate(("good", "up", "abs", "linked"))]
    (tmp_path / "caps.json").write_text(json.dumps({"images": captions}))
    (tmp_path / "m.yaml").write_text(f"""
name: lists
feature_dim: 1280
collections:
  p:
    images: {{format: image_files, path: {photos / 'list.txt'}, grids: [1], batch_size: 4}}
    captions: {{format: karpathy_json, path: {tmp_path / 'caps.json'}, image_id: filename_stem}}
""")
    out = str(tmp_path / "out")
    res = CliRunner().invoke(stage_run.main, ["--manifest", str(tmp_path / "m.yaml"), "--output", out,
                                              "--max-reject-fraction", "1.0"])
    summary = json.load(open(os.path.join(out, "summary.json")))
    images = summary["collections"]["p"]["images"]
    assert images["records_in"] == 4 == images["staged"] + images["rejected"], (images, res.output)
    assert (images["staged"], images["rejected"]) == (1, 3), images
    rejects = [json.loads(line) for line in open(os.path.join(out, "rejects", "p-images.jsonl"))]
    assert sorted(os.path.basename(r["locator"]) for r in rejects) == ["abs.jpg", "linked.jpg", "up.jpg"]
    assert all("outside its root" in r["reason"] and str(photos) in r["reason"] for r in rejects), rejects
    record("image list lines leading outside the list's folder (.., absolute, symlink)", "stage",
           "3 rejected unread with the reason; in = staged + rejected")


@pytest.mark.parametrize("entry", ["glob", "folder"])
def test_a_symlink_out_of_a_globbed_or_listed_feature_folder_is_refused(tmp_path, entry):
    """The manifest names a folder (or a glob in it) inside its root; a file there is a symlink leading out:
    staging refuses to plan the reads, in one line naming the file, where it leads and the folder."""
    from tests.test_stage_pipeline import tsv_row

    feats, elsewhere = tmp_path / "feats", tmp_path / "elsewhere"
    feats.mkdir()
    elsewhere.mkdir()
    (feats / "a.tsv").write_text(tsv_row("a", dim=8, seed=1) + "\n")
    (elsewhere / "b.tsv").write_text(tsv_row("b", dim=8, seed=2) + "\n")
    (feats / "b.tsv").symlink_to(elsewhere / "b.tsv")
    (tmp_path / "caps.json").write_text(json.dumps({"images": [
        {"filename": f"{x}.jpg", "split": "test", "sentences": [{"sentid": i, "raw": f"photo {x}"}]}
        for i, x in enumerate("ab")]}))
    path = "feats/*.tsv" if entry == "glob" else "feats"
    (tmp_path / "m.yaml").write_text(f"""
name: linked
feature_dim: 8
collections:
  c:
    images: {{format: butd_tsv, path: '{path}'}}
    captions: {{format: karpathy_json, path: caps.json, image_id: filename_stem}}
""")
    out = tmp_path / "out"
    res = CliRunner().invoke(stage_run.main, ["--manifest", str(tmp_path / "m.yaml"), "--output", str(out)],
                             env={"RR_DATA_ROOT": str(tmp_path)})
    last = res.output.strip().splitlines()[-1]
    assert res.exit_code == 1 and "cannot plan the reads" in last, res.output
    assert f"{feats / 'b.tsv'}" in last and str(elsewhere / "b.tsv") in last and f"outside its folder {feats}" in last
    assert not out.exists() or not (out / "summary.json").exists()
    record(f"symlink out of a feature {entry} the manifest names", "stage",
           "refused in one line naming file and folder")

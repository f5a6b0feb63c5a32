"""Benchmark steps as pipeline jobs: plan a list of :class:`Job` s, print it, run it, reuse finished ones.

A job is ``python -m <module> <args> <the user's Beam args>``: the same command a user would type, run as a
child process (``benchmarks.suites.launch``: a fresh interpreter, or forked from a forkserver that preloaded Beam, torch
and the pipelines, 3-6 s less per job on 2 cores) whose output is streamed with a prefix. For every job the runner
records its wall time and the peak RSS of the child (``os.wait4``'s ``ru_maxrss``, KiB on Linux; it covers the
child and the processes it waited for, e.g. DirectRunner's multi-processing workers, not Dask or Dataflow workers
elsewhere). The suites fork their jobs (``run_job(preload=True)``); a forked job's peak includes the preloaded
modules (~430 MB, which a torch job imports anyway; a job without torch, e.g. build_index, reads ~200 MB
higher), so the ``memory`` suite, whose figure is RSS, starts every job as a fresh interpreter.

Reuse: after a job succeeds the runner writes ``<output>.job.json`` beside its output: the job's
fingerprint (module + args + the version of the code that runs it, ``code_version``; Beam args excluded,
since every runner writes the same outputs), the sha256 of
the output's manifest (``Job.done``) and what the job cost. A later plan with the same job finds the stamp,
the manifest and its checksum unchanged and skips it, reporting the cost it had when it ran.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from benchmarks.queries import QueriesPlan
from benchmarks.suites import launch
from pipelines.build_index.plan import IndexPlan
from pipelines.encode.plan import EncodePlan
from pipelines.files import write_json_atomic
from pipelines.rerank.plan import RerankPlan
from pipelines.stage.plan import StagePlan
from retrieval_core.cli import to_argv
from retrieval_core.data.paths import local_folder_sha256, local_sha256

#: What a job's work is measured in, for cost estimates (``UnitCosts``).
UNITS = ("stage_records", "images_encoded", "captions_encoded", "ce_pairs")
#: Start-up of one pipeline job on DirectRunner (interpreter, torch/Beam imports, graph construction).
JOB_START_S = 10.0
#: The same for a job forked from the preloaded forkserver (no imports; model load, graph, runner start).
PRELOADED_JOB_START_S = 4.0
#: Jobs shorter than this teach no rate: their start-up would dominate (a --quick run must not overwrite the
#: rates of a full one).
MIN_LEARN_S = 60.0
STAMP_SUFFIX = ".job.json"
#: The packages whose code decides what a job writes (benchmarks/ only plans and reports).
CODE_PACKAGES = ("pipelines", "retrieval_core")
#: The CLI each plan type runs as (``python -m MODULE``); the pipelines take Beam flags.
PLAN_MODULES = {StagePlan: "pipelines.stage", EncodePlan: "pipelines.encode", IndexPlan: "pipelines.build_index",
                RerankPlan: "pipelines.rerank", QueriesPlan: "benchmarks.queries"}


def source_digest(roots: Sequence[str]) -> str:
    """sha256 over the .py files under ``roots`` (each root's name, then its ``local_folder_sha256``)."""
    h = hashlib.sha256()
    for root in roots:
        h.update(os.path.basename(os.path.normpath(root)).encode() + b"\0" + local_folder_sha256(root, ".py").encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``source_digest`` of ``CODE_PACKAGES``: a finished output is reused only by the code that wrote it.
    Coarse on purpose (a comment edit reruns the jobs too): a changed writer, default or model head must
    never be read as the old one's output (a staged format change once was, until its outputs were deleted)."""
    import importlib.util

    return source_digest([os.path.dirname(importlib.util.find_spec(p).origin) for p in CODE_PACKAGES])


class JobFailed(RuntimeError):
    """A job exited non-zero; str() is one line naming the step and its command."""


@dataclass(frozen=True)
class Job:
    """One pipeline run. ``output`` is the folder it writes; ``done`` names the file under it that a finished
    run leaves (its manifest); ``work`` = ((unit, count), ...) for estimates; ``beam`` = takes Beam flags;
    ``inputs`` = files it reads (upstream manifests, query files, model weights): if one changes, a finished
    output is stale and the job runs again."""
    name: str
    module: str
    args: tuple[str, ...]
    output: str
    done: str
    work: tuple[tuple[str, int], ...] = ()
    beam: bool = True
    inputs: tuple[str, ...] = ()
    plan: object = None  # the typed plan ``args`` were written from (Job.of)

    def __post_init__(self) -> None:
        bad = [u for u, _ in self.work if u not in UNITS]
        if bad:
            raise ValueError(f"job {self.name!r}: unknown work unit(s) {bad} (known: {UNITS})")

    @classmethod
    def of(cls, name: str, plan, done: str, work: tuple[tuple[str, int], ...] = (),
           inputs: tuple[str, ...] = ()) -> "Job":
        """The job that runs a typed plan through its CLI (the plan written back as arguments)."""
        module = PLAN_MODULES[type(plan)]
        return cls(name, module, tuple(to_argv(plan)), plan.output, done, work, beam=module.startswith("pipelines."),
                   inputs=inputs, plan=plan)

    def argv(self, beam_args: Sequence[str] = ()) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args, *(beam_args if self.beam else ())]

    def command(self, beam_args: Sequence[str] = ()) -> str:
        """The command line as a user would type it."""
        return " ".join(shlex.quote(a) for a in ["python", *self.argv(beam_args)[1:]])

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([self.module, list(self.args), code_version()]).encode()).hexdigest()

    @property
    def stamp_path(self) -> str:
        return self.output.rstrip("/") + STAMP_SUFFIX

    @property
    def done_path(self) -> str:
        return os.path.join(self.output, self.done)


@dataclass
class JobResult:
    job: Job
    wall_s: float
    peak_rss_kib: int
    reused: bool = False
    preloaded: bool = False  # forked from the preloaded forkserver: less start-up in wall_s
    # when it finished (UTC) and the command as it ran: a reused job's come from its stamp (an earlier run may have
    # given it other --threads than this one, which its wall time reflects)
    finished: str = ""
    command: str = ""

    @property
    def start_s(self) -> float:
        """The start-up share of wall_s (the constants above)."""
        return PRELOADED_JOB_START_S if self.preloaded else JOB_START_S

    @property
    def peak_rss_mb(self) -> float:
        return self.peak_rss_kib / 1024.0


def _input_digests(job: Job) -> dict:
    return {p: local_sha256(p) if os.path.isfile(p) else "missing" for p in job.inputs}


def finished(job: Job) -> Optional[dict]:
    """The stamp of an earlier successful run of exactly this job, on the same inputs, whose output is still
    intact; else None."""
    try:
        with open(job.stamp_path) as f:
            stamp = json.load(f)
        if stamp.get("fingerprint") == job.fingerprint() and stamp.get("done_sha256") == local_sha256(job.done_path) \
                and stamp.get("inputs") == _input_digests(job):
            return stamp
    except (OSError, ValueError):
        pass
    return None


def _write_stamp(job: Job, result: JobResult, beam_args: Sequence[str]) -> None:
    write_json_atomic(job.stamp_path, {
        "fingerprint": job.fingerprint(), "done_sha256": local_sha256(job.done_path), "inputs": _input_digests(job),
        "command": job.command(beam_args), "code_version": code_version(),
        "wall_s": round(result.wall_s, 3), "peak_rss_kib": result.peak_rss_kib,
        "finished": result.finished})


def run_job(job: Job, beam_args: Sequence[str] = (), log: Callable[[str], None] = print,
            reuse: bool = True, preload: bool = False) -> JobResult:
    """Run one job to completion (or reuse its finished output); raises JobFailed on a non-zero exit.
    ``preload``: fork it from the preloaded forkserver (module docstring) instead of a fresh interpreter."""
    if reuse:
        stamp = finished(job)
        if stamp is not None:
            log(f"reuse {job.name}: {job.output} (finished {stamp['finished']}, {stamp['wall_s']:.1f}s then)")
            return JobResult(job, float(stamp["wall_s"]), int(stamp["peak_rss_kib"]), reused=True,
                             finished=stamp["finished"], command=stamp.get("command", ""))
    log(f"run {job.name}\n+ {job.command(beam_args)}")
    if os.path.exists(job.stamp_path):
        os.remove(job.stamp_path)  # the output is about to change: a kill now must not leave it "finished"
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rr-job-") as tmp:
        rss_file = os.path.join(tmp, "maxrss")
        t0 = time.perf_counter()
        lines, wait = launch.start(job.argv(beam_args), rss_file, preload)
        tail: list[str] = []  # the job's own one-line error if it printed one, else its last line
        try:
            for line in lines:
                print("  | " + line, end="", flush=True)
                if line.strip() and not (tail and tail[0].startswith("Error:")):
                    tail = [line.strip()]
            returncode = wait(stop=False)
        finally:
            wait(stop=True)  # a no-op once the job has ended; stops it on Ctrl-C or a launcher error
        wall = time.perf_counter() - t0
        try:
            with open(rss_file) as f:
                peak_kib = int(f.read())
        except (OSError, ValueError):
            peak_kib = 0  # the wrapper was killed before the job ended
    if returncode != 0:
        last = tail[0] if tail else ""
        raise JobFailed(f"{job.name} failed (exit {returncode}){': ' + last if last else ''}; "
                        f"command: {job.command(beam_args)}")
    if not os.path.exists(job.done_path):
        raise JobFailed(f"{job.name} exited 0 but wrote no {job.done_path} (a --dry_run writes nothing: "
                        f"use benchmarks.run --plan to see the jobs)")
    result = JobResult(job, wall, peak_kib, preloaded=preload, command=job.command(beam_args),
                       finished=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()))
    _write_stamp(job, result, beam_args)
    log(f"done {job.name}: {wall:.1f}s, peak RSS {result.peak_rss_mb:.0f} MB")
    return result


@dataclass
class JobRunner:
    """Runs jobs in plan order, each at most once per suite run (several rows may need the same job)."""
    beam_args: tuple[str, ...] = ()
    log: Callable[[str], None] = print
    results: dict[str, JobResult] = field(default_factory=dict)
    preload: bool = True  # fork jobs from the preloaded forkserver (module docstring); False: fresh interpreters

    def run(self, job: Job) -> JobResult:
        if job.name not in self.results:
            self.results[job.name] = run_job(job, self.beam_args, self.log, preload=self.preload)
        return self.results[job.name]


def unique(jobs: Sequence[Job]) -> list[Job]:
    """Jobs in first-seen order, one per name; two different jobs under one name are a planning bug."""
    out: dict[str, Job] = {}
    for j in jobs:
        if j.name in out and out[j.name] != j:
            raise ValueError(f"two different jobs are both named {j.name!r}")
        out.setdefault(j.name, j)
    return list(out.values())


# ------------------------------------------------------------------------------------- unit costs
@dataclass
class UnitCosts:
    """Measured throughput per unit of work (units/s), each with where it came from; kept in a small JSON
    (``<workdir>/bench/unit_costs.json``) that runs update and ``--plan`` reads."""
    rates: dict = field(default_factory=dict)  # unit -> {"per_s": float, "source": str}

    @classmethod
    def load(cls, path: str) -> "UnitCosts":
        try:
            with open(path) as f:
                return cls(json.load(f).get("rates", {}))
        except FileNotFoundError:
            return cls()

    def save(self, path: str) -> None:
        write_json_atomic(path, {"rates": self.rates})

    def set(self, unit: str, per_s: float, source: str, work: int = 0) -> None:
        """Record a rate; ``work`` = units of the job it was measured on (0: a small in-process sample)."""
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r}")
        if per_s > 0:
            self.rates[unit] = {"per_s": float(per_s), "source": source, "work": int(work)}

    def missing(self, jobs: Sequence[Job]) -> list[str]:
        return sorted({u for j in jobs for u, n in j.work if n and u not in self.rates})

    def estimate(self, job: Job) -> Optional[float]:
        """Seconds the job's work takes at the recorded rates (None if a rate is unknown)."""
        total = 0.0
        for unit, n in job.work:
            if n and unit not in self.rates:
                return None
            total += n / self.rates[unit]["per_s"] if n else 0.0
        return total

    def learn(self, result: JobResult) -> None:
        """Update the rates from a job that ran now (a reused one measured nothing new), over its wall time
        less its start-up (``JobResult.start_s``); only jobs of at least MIN_LEARN_S, and only where the job did
        at least as much work as the one the rate came from. Encode jobs do images and captions together: their
        time rescales the recorded per-item rates (or, with none recorded yet, counts an image as costing what a
        caption does)."""
        if result.reused or result.wall_s < MIN_LEARN_S:
            return
        busy = result.wall_s - result.start_s
        work = {u: n for u, n in result.job.work if n and n >= self.rates.get(u, {}).get("work", 0)}
        src = f"{result.job.name} ({result.wall_s:.1f}s, {time.strftime('%Y-%m-%d')})"
        for unit in ("stage_records", "ce_pairs"):
            if unit in work:
                self.set(unit, work[unit] / busy, src, work[unit])
        enc = {u: work[u] for u in ("images_encoded", "captions_encoded") if u in work}
        if len(enc) == len([u for u, n in result.job.work if n and u.endswith("_encoded")]) and enc:
            rate = {u: self.rates.get(u, {}).get("per_s") for u in enc}
            if any(r is None for r in rate.values()):
                rate = {u: 1.0 for u in enc}
            scale = sum(n / rate[u] for u, n in enc.items()) / busy
            for u in enc:
                self.set(u, rate[u] * scale, src, enc[u])


def format_plan(jobs: Sequence[Job], beam_args: Sequence[str] = (), costs: Optional[UnitCosts] = None) -> str:
    """The numbered job list, with each job's state (reused/to run) and, given unit costs, its estimate."""
    lines, total, unknown = [], 0.0, False
    for i, job in enumerate(jobs, 1):
        state = "finished, reused" if finished(job) else "to run"
        est = costs.estimate(job) if costs is not None else None
        work = ", ".join(f"{n:,} {u.replace('_', ' ')}" for u, n in job.work if n)
        cost = ""
        if costs is not None:
            if est is None and job.work:
                unknown = True
                cost = "; estimate: unknown rate"
            elif est is not None and job.work:
                cost = f"; estimate {_hms(est)}"
                total += est
        lines.append(f"{i:3d}. [{state}] {job.name}" + (f" ({work}{cost})" if work else ""))
        lines.append(f"     {job.command(beam_args)}")
    if costs is not None:
        lines.append(f"estimated work: {_hms(total)}" + (" (plus jobs whose rate is unknown)" if unknown else "")
                     + f"; per-job start-up (~{JOB_START_S:.0f} s on DirectRunner, ~{PRELOADED_JOB_START_S:.0f} s "
                       f"forked from the preloaded server) not included, nor build_index jobs; a rerank is "
                       f"estimated from its CE pairs, whose learned rate holds its BE search at the pool size it "
                       f"was learned at")
        for unit, r in sorted(costs.rates.items()):
            lines.append(f"  rate {unit}: {r['per_s']:,.1f}/s from {r['source']}")
    return "\n".join(lines)


def _hms(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"

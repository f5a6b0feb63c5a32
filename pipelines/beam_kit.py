"""The Beam kit every job here shares: options and the unknown-flag check, running a graph, the run report a
graph hands its launcher, the progress bar, the counters line and logging. File access is :mod:`pipelines.files`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Iterator, Optional, Sequence

import click
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.files import join, read_json, remove_tree, write_json_atomic
from retrieval_core.cli import DEBUG_ENV
from retrieval_core.errors import UsageFault
from retrieval_core.memory import trim_heap

log = logging.getLogger(__name__)

# click settings for CLIs that pass unknown --flags through to Beam (--runner, --direct_num_workers...).
BEAM_CLI_CONTEXT = dict(ignore_unknown_options=True, allow_extra_args=True, help_option_names=["-h", "--help"])


class UnknownFlagError(UsageFault):
    """A --flag that neither the CLI nor any Beam PipelineOptions class knows (Beam would only log
    "Discarding unparseable args" and run with its default)."""


def _register_runner_options() -> None:
    # Runner-specific options classes register themselves on import; DaskRunner's (--dask_client_address...)
    # is not imported by apache_beam itself.
    with contextlib.suppress(ImportError):
        import apache_beam.runners.dask.dask_runner  # noqa: F401


def unknown_beam_flags(beam_args: Sequence[str]) -> list[str]:
    """The flags in ``beam_args`` that no PipelineOptions class parses (what Beam would discard)."""
    from apache_beam.options.pipeline_options import _BeamArgumentParser

    _register_runner_options()
    parser = _BeamArgumentParser(allow_abbrev=False)
    for cls in {str(c): c for c in PipelineOptions.__subclasses__()}.values():
        cls._add_argparse_args(parser)  # the same parser Beam builds in PipelineOptions.get_all_options
    _, unknown = parser.parse_known_args(list(beam_args))
    return [a for a in unknown if a.startswith("-")] or list(unknown)


def check_beam_flags(beam_args: Sequence[str]) -> None:
    """Refuse the leftover CLI args a launcher would hand to Beam, first thing in every pipeline CLI: an
    unknown flag is reported before a plan error or any work (see :func:`pipeline_options`)."""
    pipeline_options(beam_args)


def pipeline_options(beam_args: Sequence[str], default_runner: str = "DirectRunner") -> PipelineOptions:
    """PipelineOptions from the leftover CLI args; DirectRunner unless --runner says otherwise.

    Refuses (UnknownFlagError) any flag Beam does not know either: a mistyped ``--top-k`` or a misplaced
    ``--index_factory`` is an error before anything runs, not a silently ignored option."""
    args = list(beam_args)
    for a in args:  # Beam parses --dry_run as a string: "--dry_run=False" would still be a dry run
        if a.startswith("--dry_run=") and a.split("=", 1)[1].lower() in ("false", "0", "no", ""):
            raise UsageFault(f"{a}: Beam treats any --dry_run value as true; leave the flag out to run")
    unknown = unknown_beam_flags(args)
    if unknown:
        raise UnknownFlagError(f"unknown option(s) {' '.join(unknown)}: neither this command nor Beam's pipeline "
                               f"options know them (see --help)")
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.append(f"--runner={default_runner}")
    return PipelineOptions(args)


def runner_name(options: PipelineOptions) -> str:
    """The runner's short class name ("DirectRunner", "DaskRunner", "DataflowRunner"...)."""
    from apache_beam.options.pipeline_options import StandardOptions

    runner = options.view_as(StandardOptions).runner or "DirectRunner"
    return runner if isinstance(runner, str) and "." not in runner else str(runner).rsplit(".", 1)[-1]


def is_dry_run(options: PipelineOptions) -> bool:
    """``--dry_run`` (Beam's TestOptions): DataflowRunner builds and translates the job without submitting."""
    from apache_beam.options.pipeline_options import TestOptions

    return bool(options.view_as(TestOptions).dry_run)


def run_pipeline(p) -> Optional[object]:
    """Run ``p`` to completion; the one place every launcher runs its graph.

    Returns the PipelineResult, or None for ``--dry_run`` (the graph was translated, nothing ran: the
    launcher must not look for outputs). Closes the distributed.Client DaskRunner leaves open. A step that
    fails re-raises its exception here, once, without Beam's logged copy of the traceback (see
    :func:`quiet_worker_tracebacks`): the CLI's cli_errors reports it in one line."""
    with quiet_worker_tracebacks():
        result = p.run()
        if is_dry_run(p.options):
            log.info("dry run: the pipeline was translated for %s and not submitted", runner_name(p.options))
            return None
        result.wait_until_finish()
    client = getattr(result, "client", None)  # DaskRunner leaves its distributed.Client open
    if client is not None:
        client.close()
    return result


# ------------------------------------------------------------------------------------- run reports
#: Per-run scratch folder under a pipeline's output: the report its graph hands to the launcher.
RUN_DIR = "_run"
RUN_REPORT = RUN_DIR + "/report.json"


def write_report(items: list, path: str) -> int:
    """Write a run report (a JSON list of dicts, sorted for determinism); returns how many items."""
    items = sorted(items, key=lambda r: json.dumps(r, sort_keys=True, default=str))
    write_json_atomic(path, items)
    return len(items)


class WriteRunReport:
    """The last step of every graph: flatten the PCollections of report dicts (shard infos, counts, rejects)
    into one list and write it to ``<output>/_run/report.json``; the launcher reads it with
    :func:`read_run_report`. One final step on purpose: DaskRunner (Beam 2.77) computes only the graph of
    the last transform, so every write must feed it."""
    @staticmethod
    def apply(parts: Sequence, output: str, label: str = "run report"):
        import apache_beam as beam

        path = join(output, RUN_REPORT)
        return (tuple(parts) | f"{label}: flatten" >> beam.Flatten()
                | f"{label}: one key" >> beam.Map(lambda r: (None, r))
                | f"{label}: collect" >> beam.GroupByKey()
                | f"{label}: write" >> beam.MapTuple(lambda _, items: write_report(list(items), path)))


def read_run_report(output: str) -> list[dict]:
    return read_json(join(output, RUN_REPORT))


def clear_run_dir(output: str) -> None:
    """Remove ``<output>/_run`` (the report of this or an earlier, killed run)."""
    remove_tree(join(output, RUN_DIR))


# ------------------------------------------------------------------------------------- runners
def is_dask(options: PipelineOptions) -> bool:
    return runner_name(options) == "DaskRunner"


def task_pipeline_options(beam_args: Sequence[str], tasks_per_partition: int = 1) -> PipelineOptions:
    """:func:`pipeline_options` for graphs that start from a list of read tasks (shards, input chunks).

    On DaskRunner a ``beam.Create`` is cut into dask partitions of ``tasks_per_partition`` elements
    (``--dask_partition_size``, unless --dask_npartitions/--dask_partition_size is given). Beam 2.77's default
    packs 128 elements into one partition: one worker would read 128 shards and hold all their outputs in one
    list (a partition's outputs are materialised; Reshuffle is a no-op there). Small partitions cost
    scheduling, though: a GroupByKey shuffles as many partitions as its input has, and Flatten adds them up
    (a tiny staging graph took 160 s with one task per partition, 15 s with one partition)."""
    options = pipeline_options(beam_args)
    refuse_local_dry_run(options)
    if is_dask(options) and not any(a.split("=", 1)[0] in ("--dask_npartitions", "--dask_partition_size")
                                    for a in beam_args):
        options = pipeline_options([*beam_args, f"--dask_partition_size={max(1, int(tasks_per_partition))}"])
    return options


def dry_run_message(pipeline: str, options: PipelineOptions) -> str:
    return f"dry run: {pipeline} translated for {runner_name(options)}, nothing written"


def translated_only(p, pipeline: str) -> bool:
    """On ``--dry_run``: translate ``p`` (nothing runs), print the one dry-run line and return True, so the
    launcher returns before it writes or reads anything; otherwise False."""
    if not is_dry_run(p.options):
        return False
    run_pipeline(p)
    print(dry_run_message(pipeline, p.options))
    return True


def refuse_local_dry_run(options: PipelineOptions) -> None:
    """``--dry_run`` only means "translate, do not submit" on DataflowRunner; the local runners ignore it and
    would run the job, so it is refused there (one line) instead of writing outputs the launcher skips."""
    if is_dry_run(options) and runner_name(options) != "DataflowRunner":
        raise UsageFault(f"--dry_run is a DataflowRunner option; {runner_name(options)} would run the job")

# ------------------------------------------------------------------- progress, counters, logging, errors
#: RR_PROGRESS=0 turns the terminal progress bar off; counters, outputs and exit codes do not change.
PROGRESS_ENV = "RR_PROGRESS"

#: What every pipeline CLI's --help says about progress (appended to its docstring).
PROGRESS_HELP = (
    "Progress: on DirectRunner (in-memory, the default) a bar on stderr shows items done, rate and "
    "ETA; RR_PROGRESS=0 turns it off (outputs do not change). Elsewhere the steps run in other processes: "
    "Dataflow's job page shows the Beam counters of the namespace above, Dask's dashboard its tasks (DaskRunner "
    "collects no Beam metrics). The counters' final values are printed after the run as one "
    "'counters[...]' line. RR_DEBUG=1: full tracebacks.")


class Progress:
    """The one terminal progress bar of this process: items done, rate and ETA on stderr.

    The launcher opens it with the total it planned (``with Progress.running(total, "pairs", "rerank CE"):
    run_pipeline(p)``) and the DoFns call :meth:`advance`. DirectRunner's default in-memory mode runs the DoFns
    in the launcher's process, so they find the bar; on DaskRunner/Dataflow (and in Beam worker processes) no
    bar exists there, ``advance`` does nothing and the Beam counters (:func:`counter_values`, the runner's
    dashboard) are what shows progress. The bar only writes to stderr: it never changes an output."""
    _bar = None

    @classmethod
    @contextlib.contextmanager
    def running(cls, total: int, unit: str, desc: str, options: Optional[PipelineOptions] = None) -> Iterator[None]:
        """A bar over ``total`` ``unit`` while the block runs; none when the DoFns of ``options``' runner run in
        other processes (a bar stuck at 0 would mislead: the counters are the progress there)."""
        if os.environ.get(PROGRESS_ENV, "1") == "0" or cls._bar is not None or total <= 0:
            yield  # off, already running (a nested launcher), or nothing to count
            return
        if options is not None and not runs_in_process(options):
            log.info("%s: progress is in the Beam counters of %s (its steps run in other processes)",
                     desc, runner_name(options))
            yield
            return
        import sys

        from tqdm import tqdm

        # A terminal redraws in place twice a second; a log file gets a line every 30 s, not a flood of \r.
        tty = sys.stderr.isatty()
        cls._bar = tqdm(total=int(total), unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=tty,
                        mininterval=0.5 if tty else 30.0, smoothing=0.1, leave=True, disable=False,
                        bar_format="{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:3.0f}%) "
                                   "| {rate_fmt} | elapsed {elapsed} | ETA {remaining}")
        try:
            yield
        finally:
            bar, cls._bar = cls._bar, None
            bar.close()

    @classmethod
    def advance(cls, n: int = 1) -> None:
        bar = cls._bar
        if bar is not None and n:
            bar.update(n)


def add_progress_help(command: click.Command) -> click.Command:
    """Append :data:`PROGRESS_HELP` to a CLI's --help (its docstring, dedented first so both wrap alike)."""
    import inspect

    command.help = inspect.cleandoc(command.help or "") + "\n\n" + PROGRESS_HELP
    return command


def runs_in_process(options: PipelineOptions) -> bool:
    """True when the runner executes the DoFns in this process: DirectRunner in its in-memory or
    multi-threading mode (not --direct_running_mode=multi_processing, not Dask or Dataflow)."""
    from apache_beam.options.pipeline_options import DirectOptions

    mode = getattr(options.view_as(DirectOptions), "direct_running_mode", "in_memory") or "in_memory"
    return runner_name(options) in ("DirectRunner", "BundleBasedDirectRunner") and mode != "multi_processing"


def release_memory() -> None:
    """Hand memory freed by a finished Beam job back to the OS before the next job in this process: Python's
    garbage, Arrow's pool and glibc's heap (``memory.trim_heap``). A launcher that runs several jobs in one
    process (rerank's waves) otherwise keeps every job's high-water mark."""
    import gc

    gc.collect()
    try:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
    except (ImportError, AttributeError):
        pass
    trim_heap()


def counter_values(result, namespace: str) -> Optional[dict[str, int]]:
    """{name: value} of the Beam counters of ``namespace`` in a finished run (committed, else attempted), or
    None when the runner does not report metrics (DaskRunner in Beam 2.77)."""
    from apache_beam.metrics.metric import MetricsFilter

    if result is None:
        return None
    try:
        found = result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]
    except (NotImplementedError, AttributeError, KeyError):
        return None
    out: dict[str, int] = {}
    for c in found:
        value = c.committed if c.committed is not None else c.attempted
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(value or 0)
    return out


def add_counters(total: Optional[dict], more: Optional[dict]) -> Optional[dict]:
    """Sum the counters of several jobs (rerank's waves); None stays None (no runner reported any)."""
    if more is None:
        return total
    out = dict(total or {})
    for name, value in more.items():
        out[name] = out.get(name, 0) + value
    return out


def counter_line(namespace: str, values: Optional[dict], runner: str = "") -> str:
    """The one line a launcher prints after its run: ``counters[encode]: captions_encoded=12 ...``."""
    if values is None:
        return f"counters[{namespace}]: not reported by {runner or 'this runner'} (see its dashboard)"
    return f"counters[{namespace}]: " + (" ".join(f"{k}={v}" for k, v in sorted(values.items())) or "none")


#: Loggers of this project; Beam and h5py chatter stays at WARNING unless -v.
OWN_LOGGERS = ("pipelines", "retrieval_core", "benchmarks", "__main__")
NOISY_LOGGERS = ("apache_beam", "h5py")


def configure_logging(fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """Every pipeline CLI's logging: our loggers at INFO (DEBUG with RR_DEBUG=1, which also keeps tracebacks),
    Beam's INFO lines muted. Our loggers get their own level because Beam resets the root logger's level while a
    pipeline runs."""
    verbose = os.environ.get(DEBUG_ENV) == "1"
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format=fmt)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level if verbose else logging.WARNING)


class _DropWorkerTraceback(logging.Filter):
    """Beam logs a failing DoFn's traceback at ERROR (``apache_beam.runners.common``) and then re-raises the
    exception with the step appended (``... [while running 'read batches']``): the launcher reports that one
    line, so the logged copy of the traceback is dropped (RR_DEBUG=1 keeps it)."""
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "[while running" in record.getMessage())


@contextlib.contextmanager
def quiet_worker_tracebacks() -> Iterator[None]:
    if os.environ.get(DEBUG_ENV) == "1":
        yield
        return
    drop = _DropWorkerTraceback()
    logger = logging.getLogger("apache_beam.runners.common")  # a filter sees only its own logger's records
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


"""What every command-line entry point shares (no Beam): plans whose fields are the options, one spelling of
--device, --threads and --batch-size, and one-line errors at the CLI boundary.

A plan is a frozen dataclass; each of its options is declared once, on its field (:func:`option`). The click
CLI (:func:`plan_options`, :func:`plan_from_cli`) and the arguments a plan writes back (:func:`to_argv`: what
the demo and the suites launch) both come from that one declaration.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import click

from retrieval_core.errors import MemoryCapTooLow, OutputFault, StagedDataError, UsageFault, write_failure
from retrieval_core.precision import QUANTIZE_AUTO, QUANTIZE_OPTIONS

#: Set to 1 to get the full traceback of an error that cli_errors would report in one line.
DEBUG_ENV = "RR_DEBUG"

#: click context settings of every CLI here: -h is --help.
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}

#: The kinds of device, everywhere (Beam's handlers included); a device is a kind, or cuda:N for one GPU of several.
DEVICES = ("cpu", "cuda")
#: --device auto: CUDA when torch sees a GPU on the host that builds the plan, else the CPU (:func:`resolve_device`).
AUTO_DEVICE = "auto"


_MEMORY_TEXT = re.compile(r"MemoryError|Unable to allocate|can't allocate memory|Cannot allocate memory|bad_alloc")
_MEMORY_NEED = re.compile(r"Unable to allocate ([\d.]+ \w+)|tried to allocate (\d+) bytes")


def memory_failure(exc: BaseException, lower: Sequence[str] = ()) -> Optional[str]:
    """One line for running out of memory anywhere in ``exc``'s chain (a runner may keep only its text): the
    allocation that failed, the process's address-space limit, and the options that lower the need."""
    import resource

    seen, text = set(), ""
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or _MEMORY_TEXT.search(str(exc)):
            text = f"{type(exc).__name__}: {exc}"
            break
        exc = exc.__cause__ or exc.__context__
    if not text:
        return None
    m = _MEMORY_NEED.search(text)
    need = (m.group(1) or f"{int(m.group(2)) / 2**20:.0f} MiB") if m else None
    limits = [f"{name} limit of {lim >> 20} MiB" for name, kind in (("an address-space", resource.RLIMIT_AS),
                                                                    ("a data", resource.RLIMIT_DATA))
              if (lim := resource.getrlimit(kind)[0]) != resource.RLIM_INFINITY]
    return (f"out of memory{f' allocating {need}' if need else ''}{' under ' + ' and '.join(limits) if limits else ''}"
            f": {'lower ' + ' or '.join(lower) + ' or ' if lower else ''}give the job more memory")


_STEP_TEXT = re.compile(r"\[while running '([^']+)'\]")


def job_failure(exc: BaseException, job: str) -> str:
    """One line for an unexpected failure inside a pipeline: the step Beam names (``[while running 'x']``) and the
    exception's last line."""
    lines = str(exc).strip().splitlines()
    step = _STEP_TEXT.search(str(exc))
    return (f"{job} failed{' in ' + step.group(1) if step else ''}: {type(exc).__name__}: "
            f"{lines[-1] if lines else ''} ({DEBUG_ENV}=1 for the traceback)")


@contextlib.contextmanager
def cli_errors(*error_types: type, memory_options: Sequence[str] = (), job: Optional[str] = None) -> Iterator[None]:
    """At a CLI boundary: report a failure as one ``Error: ...`` line, not a traceback; the one error style of
    every CLI here. Exit 2 for a wrong command line (:class:`UsageFault`, click's usage errors), 1 otherwise.

    Reported in one line: bad input = a missing or inconsistent staged dir (StagedDataError), a missing file,
    the library's validation errors (ValueError and its subclasses) and the caller's own ``error_types``; an
    output another run owns, a memory limit too low to start the job (retrieval_core.memory), a full disk /
    quota / read-only filesystem, and running out of memory (naming ``memory_options``, the job's options that
    lower its need), however deep a runner wrapped them; with ``job`` (a pipeline's name), any other failure
    too, naming the pipeline step it came from. ``RR_DEBUG=1`` re-raises them all with the traceback."""
    debug = os.environ.get(DEBUG_ENV) == "1"
    try:
        yield
    except UsageFault as exc:
        if debug:
            raise
        raise click.UsageError(str(exc)) from None
    except (StagedDataError, FileNotFoundError, ValueError, OutputFault, MemoryCapTooLow, *error_types) as exc:
        if debug:
            raise
        raise click.ClickException(write_failure(exc) or str(exc)) from None
    except click.ClickException:
        raise
    except (Exception, MemoryError) as exc:  # noqa: BLE001 -- only a write or memory failure becomes one line
        msg = write_failure(exc) or memory_failure(exc, memory_options)
        if msg is None and job is not None:
            msg = job_failure(exc, job)
        if msg is None or debug:
            raise
        raise click.ClickException(msg) from None


# ------------------------------------------------------------------------------------ validation
class AutoDevice(str):
    """The device ``--device auto`` resolved to (``cpu`` or ``cuda``): a plain ``str`` everywhere (==, hash, JSON,
    f-strings, to_argv), so a plan and its fingerprints are those of the same device given explicitly; only
    :func:`describe_device` tells it apart, to say in a job's summary that the device was chosen for the user."""


def check_device(device) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` in any case -> lower case; anything else is a one-line ValueError.
    ``auto`` stays ``auto`` here: plans resolve it (:func:`resolve_device`)."""
    if isinstance(device, AutoDevice):
        return device
    value = str(device).lower()
    kind, _, index = value.partition(":")
    if value != AUTO_DEVICE and (kind not in DEVICES or (":" in value and (kind != "cuda" or not index.isdigit()))):
        raise ValueError(f"device must be one of auto|cpu|cuda|cuda:N, got {device!r}")
    return value


def resolve_device(device) -> str:
    """A checked device made concrete: ``auto`` -> ``cuda`` when ``torch.cuda.is_available()``, else ``cpu`` (an
    :class:`AutoDevice`); any other device as given (``cuda`` on a machine without one fails where it is used).

    Plans call this when built, on the host that launches the job. Why there: the plan is what the workers'
    handlers, the manifests and the resume fingerprints read, so each sees one concrete device, decided once (not
    per worker), and on a machine without CUDA ``auto`` is ``cpu``: the plan, fingerprints and launched arguments
    of an explicit ``--device cpu``, so earlier runs resume. The cost: a launcher without a GPU (a Dataflow
    launcher starting GPU workers) resolves ``auto`` to ``cpu``, so such a job passes ``--device cuda``."""
    value = check_device(device)
    if value != AUTO_DEVICE:
        return value
    import torch

    return AutoDevice("cuda" if torch.cuda.is_available() else "cpu")


def describe_device(device) -> str:
    """A job summary's device: ``cuda``, or where ``--device auto`` chose it, ``cuda (auto)`` / ``cpu (auto: torch
    sees no CUDA device)``."""
    if not isinstance(device, AutoDevice):
        return str(device)
    return f"{device} (auto)" if device != "cpu" else f"{device} (auto: torch sees no CUDA device)"


def device_kind(device: str) -> str:
    """``cpu`` or ``cuda`` (the kind of a checked device: cuda:1 -> cuda; auto resolved first)."""
    return resolve_device(device).partition(":")[0]


def apply_device_and_threads(device: str, threads: Optional[int]) -> None:
    """Set the torch thread count and check that a requested GPU exists (one line if not)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if device_kind(device) == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was requested but CUDA is not available on this machine")


# ------------------------------------------------------------------------------- plan options
@dataclass(frozen=True)
class Flag:
    """How a plan field appears on the command line (see :func:`option`)."""
    help: str = ""
    name: Optional[str] = None  # the flag; default --field-name
    short: Optional[str] = None  # a one-letter alias on the command line ("-v"); to_argv writes the long flag
    type: Any = None  # a click type; default: the field default's type (str when None)
    off: Optional[str] = None  # a True-by-default bool: the switch that turns it off ("--no-amp")
    multiple: bool = False  # repeatable; the field is a tuple of the values
    sep: Optional[str] = None  # a tuple written as one value joined by ``sep`` ("t2i,i2t"); ``type``: of each item
    metavar: Optional[str] = None
    show_default: bool = True
    argument: bool = False  # positional (click.argument, named by the field in upper case); multiple: nargs=-1

    def flag(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


_FLAG, _GROUP, _DERIVED = "rr_flag", "rr_group", "rr_derived"


def option(default=dataclasses.MISSING, **flag) -> Any:
    """A plan field that is a command-line option (``Flag``'s keywords); no default = a required option."""
    return dataclasses.field(default=default, metadata={_FLAG: Flag(**flag)})


def derived(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING) -> Any:
    """A plan field that is no option: resolved from the options when the plan runs (the model folders a suite
    trains); ``to_argv`` leaves it out, since the same arguments resolve it again."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_DERIVED: True})


def option_group(cls: type) -> Any:
    """A plan field holding another plan whose fields are options too (a training run's TrainConfig)."""
    return dataclasses.field(default_factory=cls, metadata={_GROUP: cls})


class DeviceType(click.ParamType):
    """--device's click type: :func:`check_device`'s spelling, its error as click's usage error; ``auto`` resolved
    (:func:`resolve_device`)."""
    name = "auto|cpu|cuda|cuda:N"

    def get_metavar(self, *args, **kwargs) -> str:
        return "[auto|cpu|cuda|cuda:N]"

    def convert(self, value, param, ctx):
        try:
            return resolve_device(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def device_option(default: str = AUTO_DEVICE) -> Any:
    """A plan's --device field: the one declaration of --device (default auto, resolved when the plan is built)."""
    return option(default, type=DeviceType(),
                  help="Where the model runs: auto (CUDA when torch sees a GPU on this machine, else the CPU), cpu, "
                       "cuda or cuda:N (cuda fails when no GPU is visible). auto is resolved on the machine that "
                       "launches the job: a launcher without a GPU starting GPU workers passes --device cuda.")


def threads_option(default: Optional[int] = None, help: Optional[str] = None) -> Any:
    """A plan's --threads field: the one declaration of --threads (``help``: what the threads run, where it is
    not torch)."""
    return option(default, type=click.IntRange(min=1),
                  help=help or "torch (and faiss) CPU threads per process" + ("" if default else " [torch's default]")
                  + ".")


def collate_workers_option() -> Any:
    """A plan's --collate-workers field: threads that copy each batch's regions into its tensors (the jobs' outputs
    are the same for any count, so it is in no fingerprint)."""
    return option(None, type=click.IntRange(min=1),
                  help="threads that collate each batch's regions [the torch threads: they idle while a batch is "
                       "made]")


def batch_size_option(default: int, help: str = "items per model call") -> Any:
    """A plan's --batch-size field: the one declaration of --batch-size (what one model call holds)."""
    return option(default, type=click.IntRange(min=1), help=help)


def quantize_option(default: str = QUANTIZE_AUTO, help: Optional[str] = None) -> Any:
    """A plan's --quantize field: the one declaration of --quantize and its one vocabulary (retrieval_core.precision);
    ``help``: what the precision applies to, where it is not the job's models."""
    return option(default, type=click.Choice(QUANTIZE_OPTIONS, case_sensitive=False),
                  help=help or "serving precision: auto (bf16 on a CUDA device with native bf16, float32 elsewhere), "
                               "none (float32), int8 (dynamic int8 Linear layers, CPU only) or bf16 (bfloat16 weights: "
                               "CUDA, or a CPU with native bf16); recorded in the job's outputs.")


def count_option(default: Optional[int], help: str = "") -> Any:
    """A plan field that counts something (shards, queries, pairs): an int >= 1 (None where it has no default)."""
    return option(default, type=click.IntRange(min=1), help=help)


def k_option(default: Optional[int], help: str) -> Any:
    """A plan's --k field (a rerank depth: how many of the BE's top hits the CE scores): the one declaration of --k."""
    return option(default, type=click.IntRange(min=1), help=help)


def lam_option(default: Optional[float], help: str = "ADD/NORM_ADD weight of the BE score") -> Any:
    """A plan's --lam field (the weight of the BE score in add / norm_add fusion): the one declaration, in [0, 1]."""
    return option(default, type=click.FloatRange(0, 1), help=help)


def nprobe_option() -> Any:
    """A plan's --nprobe field: the one declaration of an IVF index's search breadth."""
    return count_option(None, help="IVF lists searched per query in every index shard (default: the index "
                                   "manifest's, else faiss' 1)")


def ef_search_option() -> Any:
    """A plan's --ef-search field: the one declaration of an HNSW index's search breadth."""
    return count_option(None, help="HNSW search breadth in every index shard (default: the index manifest's, else "
                                   "faiss' 16)")


def _flagged(cls: type) -> Iterator[tuple[dataclasses.Field, Flag]]:
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            yield from _flagged(f.metadata[_GROUP])
        elif _FLAG in f.metadata:
            yield f, f.metadata[_FLAG]


def check_options(plan) -> None:
    """Check (and normalise: a case-insensitive choice, a device) every flagged field of ``plan`` with its click
    type, as the CLI would: a plan built in code is refused like the same arguments typed (one-line ValueError
    naming the field). For a plan's ``__post_init__``; its option groups check themselves."""
    for f in dataclasses.fields(plan):
        fl = f.metadata.get(_FLAG)
        value = getattr(plan, f.name)
        if fl is None or not isinstance(fl.type, click.ParamType) or value is None:
            continue
        try:
            if fl.multiple or fl.sep:
                value = tuple(fl.type.convert(v, None, None) for v in value)
            else:
                value = fl.type.convert(value, None, None)
        except click.BadParameter as exc:
            raise ValueError(f"{fl.flag(f.name)}: {exc.message}") from None
        object.__setattr__(plan, f.name, value)


class CheckedPlan:
    """Base of a plan checked by its options' click types when built (:func:`check_options`); a plan with checks
    of its own calls ``super().__post_init__()`` first."""

    def __post_init__(self) -> None:
        check_options(self)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def plan_options(cls: type) -> Callable:
    """A decorator adding one click option per flagged field of ``cls`` (and of its option groups); the command
    remembers its plan (:func:`plan_of`)."""
    def decorate(command: Callable) -> Callable:
        command.rr_plan = cls
        for f, fl in reversed(list(_flagged(cls))):
            default = _default(f)
            required = default is dataclasses.MISSING
            if fl.argument:
                command = click.argument(f.name, type=fl.type, nargs=-1 if fl.multiple else 1,
                                         required=required)(command)
                continue
            kw: dict = dict(help=fl.help, metavar=fl.metavar)
            if isinstance(default, bool) and fl.type is None:
                if fl.off:  # True by default: only the switch that turns it off
                    command = click.option(fl.off, f.name, flag_value=False, default=True, help=fl.help)(command)
                    continue
                decls = [fl.short] if fl.short else []
                command = click.option(*decls, fl.flag(f.name), f.name, is_flag=True, help=fl.help)(command)
                continue
            if fl.multiple:
                kw.update(multiple=True, default=None if required else (default or ()))
            elif fl.sep:
                kw.update(default=None if required else fl.sep.join(map(str, default)), show_default=fl.show_default)
            else:
                kw.update(default=None if required else default,
                          show_default=fl.show_default and not required and default is not None)
            typed = default not in (None, dataclasses.MISSING) and not isinstance(default, tuple)
            kw["type"] = fl.type if fl.type is not None else (type(default) if typed else str)
            if fl.sep:  # the joined text; its items are checked with ``type`` when the plan is built
                kw["type"] = str
            command = click.option(fl.flag(f.name), f.name, required=required, **kw)(command)
        return command
    return decorate


def plan_command(cls: type, **context_settings) -> Callable:
    """``@click.command`` whose options are the fields of ``cls`` (:func:`plan_options`); ``-h`` is ``--help``."""
    def decorate(f: Callable) -> click.Command:
        return click.command(context_settings={**CONTEXT_SETTINGS, **context_settings})(plan_options(cls)(f))
    return decorate


def plan_of(command: click.Command) -> Optional[type]:
    """The plan class whose fields are ``command``'s options (None for a command not built by plan_options)."""
    return getattr(command.callback, "rr_plan", None)


def plan_flags(cls: type) -> dict[str, Flag]:
    """{field name: its Flag} of every option of ``cls`` and of its option groups."""
    return {f.name: fl for f, fl in _flagged(cls)}


def plan_from_cli(cls: type, values: dict, **extra):
    """The plan ``cls`` from click's parsed ``values`` (keyed by field name) and ``extra`` fields; values of
    other options are ignored. Validation is the plan's own (its ``__post_init__``)."""
    kwargs = dict(extra)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            continue
        if _GROUP in f.metadata:
            kwargs[f.name] = plan_from_cli(f.metadata[_GROUP], values)
        elif _FLAG in f.metadata and f.name in values:
            value, fl = values[f.name], f.metadata[_FLAG]
            if fl.sep and isinstance(value, str):
                value = tuple(v.strip() for v in value.split(fl.sep) if v.strip())
            elif fl.multiple:
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def _auto_device_default(fl: Flag, value, default) -> bool:
    """A --device whose default is auto, holding what auto resolves to here: the default (the launched command
    resolves it again, on this host), so a plan writes the arguments it wrote when the default was that device."""
    return isinstance(fl.type, DeviceType) and isinstance(default, str) and default.lower() == AUTO_DEVICE \
        and value == resolve_device(AUTO_DEVICE)


def to_argv(plan) -> list[str]:
    """The command-line arguments that build ``plan`` (its CLI's inverse): every option whose value is not
    the field's default (a --device auto resolves to on this host counts as the default), in declaration order.
    Fields without a flag must keep their defaults."""
    argv: list[str] = []
    positional: list[str] = []
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        if _GROUP in f.metadata:
            argv += to_argv(value)
            continue
        default = _default(f)
        if _DERIVED in f.metadata:
            continue
        if _FLAG not in f.metadata:
            if value != default:
                raise ValueError(f"{type(plan).__name__}.{f.name} has no command-line flag: keep its default")
            continue
        fl = f.metadata[_FLAG]
        if value == default or value is None or _auto_device_default(fl, value, default):
            continue
        if fl.argument:
            positional += [str(v) for v in value] if fl.multiple else [str(value)]
        elif isinstance(value, bool) and fl.type is None:
            argv += [fl.off] if fl.off else [fl.flag(f.name)]
        elif fl.multiple:
            for v in value:
                argv += [fl.flag(f.name), str(v)]
        elif fl.sep:
            argv += [fl.flag(f.name), fl.sep.join(map(str, value))]
        else:
            argv += [fl.flag(f.name), str(value)]
    return argv + positional

"""Run a CLI step, ``python -m MODULE ARGS``, as a child process: a fresh interpreter, or forked from a preloaded
forkserver. The one launcher of the benchmark jobs (``benchmarks.suites.jobs``) and the demo's steps
(``benchmarks.demo``, and the staging and training steps of ``retrieval_core.training.cache``, which it passes as
their ``run``).

Importing Beam, torch and the pipelines takes 3.4 s (a 2-core AMD EPYC at 196 GFLOP/s) to ~6 s (the slower
2-core machines) per process. Preloaded, a step is
forked from a ``multiprocessing`` forkserver that imported :data:`PRELOAD` once (and ran nothing: no torch thread
pool exists yet, so forking is safe), and runs its module exactly as ``python -m`` would (``runpy``, as
``__main__``, same argv, cwd and environment); its output and exit status stream back the same way, and it reports
its own peak RSS (ru_maxrss of itself and of the processes it waited for) just before it exits. That peak includes
the preloaded modules (~430 MB, which a torch step imports anyway), so RSS measurements start fresh interpreters.

A fresh interpreter is started by a bare ``python -c`` wrapper that does ``os.wait4``: a child forked straight
from the launcher would report at least the launcher's own peak (Linux carries the parent's high-water mark
through fork and exec), 460 MB with torch loaded.
"""
from __future__ import annotations

import codecs
import functools
import os
import subprocess
import sys
from typing import Sequence

# argv: RSS_FILE CMD...; runs CMD, writes its ru_maxrss (KiB) to RSS_FILE, exits with its status.
_WAIT4 = ("import os, subprocess, sys\n"
          "p = subprocess.Popen(sys.argv[2:])\n"
          "_, status, usage = os.wait4(p.pid, 0)\n"
          "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
          "sys.exit(os.waitstatus_to_exitcode(status))\n")

#: What the forkserver imports before forking steps: Beam with RunInference (which imports torch), transformers'
#: BERT, and the step modules themselves (the pipelines and the trainer; callers add theirs with :func:`preload`).
PRELOAD = ["apache_beam.ml.inference.base", "transformers.models.bert.modeling_bert", "pipelines.stage.run",
           "pipelines.encode.run", "pipelines.build_index.run", "pipelines.rerank.run", "retrieval_core.training.train"]


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` too (a caller's own step modules); effective until it starts."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def start(argv: list[str], rss_file: str, preload: bool):
    """Start ``argv`` (``[python, -m, MODULE, ARGS...]``): (its output stream, wait(stop) -> exit status); its
    peak RSS (KiB) lands in ``rss_file`` when it ends. ``preload``: forked from the forkserver."""
    return (_start_forked if preload else _start_subprocess)(argv, rss_file)


def run_module(argv: Sequence[str], preload: bool = True) -> None:
    """Run ``argv`` (``[python, -m, MODULE, ARGS...]``) to completion, its output passed through to ours, as
    ``subprocess.run(argv, check=True)`` would; raises ``subprocess.CalledProcessError`` on a non-zero exit."""
    argv = list(argv)
    stream, wait = start(argv, os.devnull, preload)  # its peak RSS is not asked for here
    try:
        # raw chunks, not lines: a progress bar redraws its line with "\r" and must show as it goes
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        while chunk := os.read(stream.fileno(), 65536):
            sys.stdout.write(decode(chunk))
            sys.stdout.flush()
        returncode = wait(stop=False)
    finally:
        wait(stop=True)  # a no-op once the step has ended; stops it on Ctrl-C
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, argv)


def _start_subprocess(argv: list[str], rss_file: str):
    """A fresh interpreter under the wait4 wrapper: (its output lines, wait(stop) -> exit status)."""
    proc = subprocess.Popen([sys.executable, "-c", _WAIT4, rss_file, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def wait(stop: bool) -> int:
        if stop and proc.poll() is None:
            proc.terminate()
        return proc.wait()
    return proc.stdout, wait


@functools.lru_cache(maxsize=1)
def forkserver():
    """The multiprocessing context whose server imports PRELOAD, started on first use. As with any forkserver,
    the caller's ``__main__`` must keep its work under ``if __name__ == "__main__"``: the server imports it."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _start_forked(argv: list[str], rss_file: str):
    """``argv`` (python -m MODULE ARGS...) forked from the preloaded forkserver: (its output lines, wait)."""
    if argv[1:2] != ["-m"]:
        raise ValueError(f"a preloaded job runs `python -m MODULE ...`, not {argv[:3]}")
    ctx = forkserver()
    read_end, write_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_forked_job_main, args=(argv[2:], os.getcwd(), dict(os.environ), write_end, rss_file),
                       name=argv[2])
    proc.start()
    write_end.close()  # the child holds the only writer: its exit ends the stream
    stream = os.fdopen(os.dup(read_end.fileno()), "r", buffering=1)
    read_end.close()

    def wait(stop: bool) -> int:
        if stop and proc.exitcode is None:
            proc.terminate()
        proc.join()
        stream.close()
        return proc.exitcode
    return stream, wait


def _forked_job_main(module_argv: list[str], cwd: str, env: dict, write_end, rss_file: str) -> None:
    """In the forked child: run ``python -m`` module_argv with the launcher's cwd and environment, output to
    the launcher's pipe; write this process's peak RSS (KiB) to ``rss_file``; exit with the module's status."""
    import resource
    import runpy
    import traceback
    import warnings

    os.dup2(write_end.fileno(), 1)
    os.dup2(write_end.fileno(), 2)
    write_end.close()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, cwd)  # as python -m does
    sys.argv = list(module_argv)
    code = 1
    # The server imported the module on purpose (that is the preload); runpy warns that it runs it again as
    # __main__, which is exactly what python -m does in a fresh interpreter.
    warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package",
                            category=RuntimeWarning)
    try:
        runpy.run_module(module_argv[0], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- printed as python -m would, then the exit status says it failed
        traceback.print_exc()
    finally:
        import atexit

        # what interpreter shutdown does after `python -m`: e.g. multiprocessing's finalizers release the
        # semaphores a job created (tqdm's lock), or the shared resource tracker reports them as leaked
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        usage = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                    resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        with open(rss_file, "w") as f:
            f.write(str(usage))
        os._exit(code)

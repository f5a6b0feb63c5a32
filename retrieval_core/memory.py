"""A job under a hard memory cap (RLIMIT_DATA, ``ulimit -d``): keep libraries from counting memory they never
touch, and refuse early, in one line, a cap the job cannot start under.

RLIMIT_DATA counts every private writable mapping when it is made, touched or not. Two such mappings do not
hold data: pyarrow's bundled mimalloc commits a 1 GiB arena on its first allocation (Beam imports pyarrow),
and every thread's stack (RLIMIT_STACK, 8 MiB by default) counts whole. Under a 1.5 GB cap the arena left
gRPC (inside Beam's runner) no room for its threads' stacks, and gRPC aborts the process when a thread cannot
start: SIGABRT, no Python error. glibc's per-thread malloc arenas are reserved PROT_NONE and count only
as they are used, so they need no bound here. Imports nothing of the project but errors.py (the bottom floor).

And a long job's free heap: ``trim_heap`` hands the pages of glibc's free chunks back to the OS; and
``without_onednn``, the float32 CPU inference of a long-lived query engine without oneDNN's per-shape primitives.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import resource
import threading
from typing import Optional, Sequence

from retrieval_core.errors import MemoryCapTooLow

#: Threads an in-process Beam job starts beside torch's own: gRPC's pools and Beam's worker and bundle
#: threads; their stacks count in full against RLIMIT_DATA. Counted generously: a thread that cannot start
#: aborts the process, a refused start is one line (docs/ERRORS.md has what the fault suite's jobs start).
RUNNER_THREADS = 24

#: glibc's thread stack size when RLIMIT_STACK is unlimited (x86_64).
UNLIMITED_STACK = 32 << 20


def data_limit() -> Optional[int]:
    """This process's soft RLIMIT_DATA in bytes, None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def vm_data() -> int:
    """The bytes RLIMIT_DATA counts now (VmData of /proc/self/status); 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def available_bytes() -> Optional[int]:
    """What this process may still take: the machine's MemAvailable (/proc/meminfo), lowered to what RLIMIT_DATA
    leaves when a limit is set; None where neither is known."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) << 10
                    break
    except OSError:
        pass
    limit = data_limit()
    if limit is not None:
        left = max(0, limit - vm_data())
        avail = left if avail is None else min(avail, left)
    return avail


def thread_stack_bytes() -> int:
    """What one new thread's stack counts against RLIMIT_DATA (glibc sizes it from RLIMIT_STACK)."""
    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return UNLIMITED_STACK if soft == resource.RLIM_INFINITY else soft


def bound_reservations() -> None:
    """Under a data limit, make mimalloc reserve its arenas without committing them (PROT_NONE until used),
    so they count as they fill. Must run before pyarrow's first allocation (pipelines/__init__ calls it before
    importing Beam); a value the user set is kept. Without a limit nothing changes."""
    if data_limit() is not None:
        os.environ.setdefault("MIMALLOC_ARENA_EAGER_COMMIT", "0")


def trim_heap() -> bool:
    """Return the pages of glibc's free heap chunks to the OS (``malloc_trim(0)``); False where libc has none.

    Why: once a model's activations are freed, glibc raises its mmap threshold to their size (up to 32 MiB), so
    later batches take them from the heap, and batches of other lengths leave free holes between live chunks
    that only a trim releases (docs/ARCHITECTURE.md, `pipelines.encode`)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrimmer:
    """``trim_heap`` once per ``every`` units of work (batches, queries) of a long-lived caller: one trim walks the
    heap (~2.5 ms with a model loaded, 2-core AMD EPYC): too much per single-query call, little once per batch."""

    def __init__(self, every: int):
        self.every, self._done = every, 0

    def tick(self, units: int = 1) -> None:
        self._done += units
        if self._done >= self.every:
            trim_heap()
            self._done = 0


_ONEDNN_LOCK = threading.Lock()
_onednn_holders = 0
_onednn_was: Optional[bool] = None


@contextlib.contextmanager
def without_onednn(active: bool = True):
    """torch's oneDNN (``torch.backends.mkldnn``) off while any holder is inside (counted, so the threads of one job
    agree), as before once the last leaves. Float32 CPU inference over ever new batch shapes (caption lengths) makes
    oneDNN primitives per shape and the heap around them fragments: a long-lived query engine's peak grew with the
    queries with it and stayed flat without, at the same speed (docs/log/ENGINEERING-2026-11.md). bf16 needs oneDNN:
    ``active`` False leaves it on."""
    global _onednn_holders, _onednn_was
    if not active:
        yield
        return
    import torch

    with _ONEDNN_LOCK:
        if _onednn_holders == 0:
            _onednn_was = torch.backends.mkldnn.enabled
            torch.backends.mkldnn.enabled = False
        _onednn_holders += 1
    try:
        yield
    finally:
        with _ONEDNN_LOCK:
            _onednn_holders -= 1
            if _onednn_holders == 0:
                torch.backends.mkldnn.enabled = _onednn_was


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """libc's malloc_trim, looked up once per process (None where libc has none)."""
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def mib(n: int) -> str:
    return f"{n / 2**20:.{0 if n >= 10 << 20 else 1}f} MiB"


def require_headroom(job: str, threads: Optional[int], lower: Sequence[str], model_bytes: int = 0) -> None:
    """Refuse to start ``job`` (MemoryCapTooLow, one line) when this process's RLIMIT_DATA cannot hold what is
    loaded now plus what the run adds before its data: the runner's and torch's ``threads`` thread stacks and
    ``model_bytes`` of weights. Past this check a cap that is still too small fails on an allocation Python
    sees (numpy, torch), reported by cli.memory_failure; a thread that cannot start would abort instead, which
    is why the stacks are counted here."""
    limit = data_limit()
    if limit is None:
        return
    now, stacks = vm_data(), (RUNNER_THREADS + (threads or os.cpu_count() or 1)) * thread_stack_bytes()
    need = now + stacks + model_bytes
    if need <= limit:
        return
    parts = [f"{mib(now)} loaded", f"{mib(stacks)} of thread stacks"] + ([f"{mib(model_bytes)} of model weights"]
                                                                        if model_bytes else [])
    raise MemoryCapTooLow(
        f"{job} needs about {mib(need)} of data memory to start ({' + '.join(parts)}) but this process's "
        f"RLIMIT_DATA (getrlimit) is {mib(limit)}: lower {' or '.join(lower)}, or raise the limit (ulimit -d)")


def weights_bytes(folder: str) -> int:
    """The size of a model folder's weight files (what loading its model adds, per copy)."""
    total = 0
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            total += os.path.getsize(os.path.join(folder, name))
    return total

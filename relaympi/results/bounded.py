"""Reading run files with a time and a memory limit: each file is read in a worker process that is
killed when it takes longer than the limit, and that cannot allocate more than its memory limit.

Some damaged HDF5 files send the HDF5 library into a loop that never returns (seen in its reading
of attributes); no signal interrupts it, so the report and ``python -m relaympi.results`` read
every file in a small pool of worker processes instead. A file whose read does not finish within
the limit, or whose read crashes the worker, becomes a RunFileError with the reason, and the
remaining files are read as usual. The limit is READ_TIMEOUT_ENV's value in seconds
(DEFAULT_READ_TIMEOUT when unset); the training reads its own files in-process (read_run,
run_status), as before.

A run file may come from anyone, and a crafted one can claim sizes that would exhaust the
machine's memory. Each worker's address space is capped at what it held when it started plus
READ_MEMORY_ENV's value in MiB (DEFAULT_READ_MEMORY_MIB when unset): an allocation beyond it
fails, and the file is listed with the reason. Before that, read_run refuses a file whose datasets
claim more than a DATA_SHARE of the limit (the reply's copy for the caller needs as much again).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from relaympi.results.errors import RunFileError
from relaympi.results.reader import Run, read_run, run_status

READ_TIMEOUT_ENV = "RELAYMPI_READ_TIMEOUT"
DEFAULT_READ_TIMEOUT = 30.0  # seconds per file; a healthy small run file reads in milliseconds
MAX_WORKERS = 4
# a worker's own start (the imports that unpickling its function needs) is not the file's time
START_GRACE = 60.0
READY = "ready"
# what the workers import before they fork (the forkserver's preload): the reader and HDF5
_PRELOAD = ["relaympi.results.reader"]
READ_MEMORY_ENV = "RELAYMPI_READ_MEMORY"
DEFAULT_READ_MEMORY_MIB = 4096  # per worker; a healthy run file needs a few MiB
DATA_SHARE = 4  # the datasets read may take a quarter of the limit (read, pickled, headroom)


def read_timeout() -> float:
    """The time limit per file in seconds: READ_TIMEOUT_ENV's value, else DEFAULT_READ_TIMEOUT."""
    text = os.environ.get(READ_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_READ_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(
            f"{READ_TIMEOUT_ENV}={text!r}: expected a positive number of seconds per run file"
        )
    return value


def read_memory() -> int:
    """The memory limit per file in bytes: READ_MEMORY_ENV's value in MiB, else
    DEFAULT_READ_MEMORY_MIB.

    Returns:
        The limit in bytes.

    Raises:
        ValueError: a value that is not a number of MiB of at least 64 (one line, naming it).
    """
    text = os.environ.get(READ_MEMORY_ENV, "").strip()
    if not text:
        return DEFAULT_READ_MEMORY_MIB << 20
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 64 <= value < float("inf"):
        raise ValueError(
            f"{READ_MEMORY_ENV}={text!r}: expected a number of MiB per run file, at least 64"
        )
    return int(value * 2**20)


def memory_reason(memory: int) -> str:
    """Why a file whose read ran out of its memory limit is left out."""
    return (
        f"unreadable: reading it needed more than the memory limit of {memory / 2**20:g} MiB "
        f"per run file ({READ_MEMORY_ENV}; a crafted file?)"
    )


def _limit_memory(memory: int) -> None:
    """Cap this process's address space at its present size plus ``memory`` bytes, so that an
    allocation beyond that fails (MemoryError) instead of exhausting the machine. Where there is
    no /proc or RLIMIT_AS (not Linux), read_run's budget alone holds."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = size + memory
        for limit in (soft, hard):
            if limit != resource.RLIM_INFINITY:
                cap = min(cap, limit)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ImportError, OSError, ValueError):
        pass


def timeout_reason(timeout: float) -> str:
    return f"unreadable: reading it did not finish in {timeout:g} s (corrupted?)"


def _crash_reason(exitcode: int | None) -> str:
    how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit {exitcode}"
    return f"unreadable: reading it crashed the reader process ({how}; corrupted?)"


def _serve(conn: Connection, fn: Callable[..., Any], memory: int | None = None) -> None:
    """A worker: call ``fn(*args)`` for each (index, args) received until None or EOF; send back
    (index, True, result) or (index, False, reason). READY first: the file's clock starts then.
    Ctrl-C is the caller's to handle (it stops its workers), not each worker's to print. With
    ``memory``, the worker allocates at most that many bytes more than it holds at its start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory is not None:
        _limit_memory(memory)
    try:
        conn.send(READY)
    except (EOFError, OSError):
        return
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        index, args = job
        try:
            reply = (index, True, fn(*args))
        except RunFileError as error:
            reply = (index, False, error.reason)
        except MemoryError:
            reply = (index, False, memory_reason(memory or 0))
        except Exception as error:  # noqa: BLE001 - any failure of a damaged file is its reason
            reply = (index, False, f"unreadable ({type(error).__name__}: {error})")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except MemoryError:  # its copy for the caller did not fit
            conn.send((index, False, memory_reason(memory or 0)))
        except Exception as error:  # noqa: BLE001 - a result that cannot be sent back
            conn.send((index, False, f"unreadable ({type(error).__name__}: {error})"))


def _context() -> Any:
    """How workers start. "fork" where this process has one thread (the report's and
    `python -m relaympi.results`'s case): a copy of it, with HDF5 loaded and no file open, ready at
    once. Elsewhere a fork could copy a lock that another thread holds, so "forkserver" (workers
    forked from a clean server that preloads the reader) or, without it, "spawn"; both import the
    caller's main module afresh in each worker, so a script that calls this needs the usual
    guard of its main code (multiprocessing's "safe importing of main module")."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
        return context
    return multiprocessing.get_context("spawn")


@dataclass
class _Worker:
    process: Any
    conn: Connection
    job: int | None = None  # the index of the call it is making
    deadline: float = 0.0
    ready: bool = False  # started: its calls' clocks run

    def stop(self, kill: bool = False) -> None:
        """End the worker: asked to (idle), or killed (busy or unresponsive); idempotent."""
        if self.process is None:
            return
        if not kill:
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                kill = True
        if kill:
            self.process.kill()
        self.process.join(timeout=None if kill else 5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
        self.process = None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bounded_map(
    fn: Callable[..., Any],
    calls: Sequence[tuple],
    timeout: float,
    workers: int | None = None,
    memory: int | None = None,
) -> Iterator[tuple[bool, Any]]:
    """``fn(*args)`` for each args of ``calls``, each in a worker process with ``timeout``
    seconds (and, with ``memory``, that many bytes to allocate beyond its start); yields, in the
    order of ``calls``, (True, result) or (False, reason): the reason of a RunFileError or other
    exception, or that the call did not finish in time (its worker is killed), ran out of its
    memory or crashed its worker. ``fn`` must be a module-level function (workers import it)."""
    if not calls:
        return
    size = max(1, min(len(calls), workers or min(_cpus(), MAX_WORKERS)))
    context = _context()
    pending = deque(enumerate(calls))
    results: dict[int, tuple[bool, Any]] = {}
    pool: list[_Worker] = []
    done = 0
    try:
        while done < len(calls):
            for worker in pool:  # idle workers take the next calls
                if worker.job is None and pending:
                    _give(worker, pending.popleft(), timeout)
            while pending and len(pool) < size:
                worker = _start(context, fn, memory)
                pool.append(worker)
                _give(worker, pending.popleft(), timeout)
            busy = [w for w in pool if w.job is not None]
            if busy:
                left = min(w.deadline for w in busy) - time.monotonic()
                ready = set(wait([w.conn for w in busy], timeout=max(0.0, left)))
                for worker in busy:
                    if worker.conn in ready:
                        _collect(worker, results, timeout)
                now = time.monotonic()
                for worker in busy:
                    if worker.job is not None and now >= worker.deadline:
                        results[worker.job] = (False, timeout_reason(timeout))
                        worker.job = None
                        worker.stop(kill=True)
                pool = [w for w in pool if w.process is not None]
            while done in results:
                yield results.pop(done)
                done += 1
    finally:
        for worker in pool:
            worker.stop(kill=worker.job is not None)


def _start(context: Any, fn: Callable[..., Any], memory: int | None = None) -> _Worker:
    parent, child = context.Pipe()
    process = context.Process(target=_serve, args=(child, fn, memory), daemon=True)
    process.start()
    child.close()  # the worker's end lives in the worker: its exit is the parent's EOF
    return _Worker(process, parent)


def _give(worker: _Worker, job: tuple[int, tuple], timeout: float) -> None:
    worker.job = job[0]
    worker.deadline = time.monotonic() + timeout + (0.0 if worker.ready else START_GRACE)
    worker.conn.send(job)


def _collect(worker: _Worker, results: dict[int, tuple[bool, Any]], timeout: float) -> None:
    """The worker's message: READY (its call's clock starts) or its reply; a worker that died (EOF)
    is stopped and its call gets the reason."""
    try:
        message = worker.conn.recv()
        if message == READY:
            worker.ready = True
            worker.deadline = time.monotonic() + timeout
            return
        index, ok, value = message
    except (EOFError, OSError):
        worker.process.join()
        if worker.job is not None:
            results[worker.job] = (False, _crash_reason(worker.process.exitcode))
        worker.job = None
        worker.stop(kill=True)
        return
    results[index] = (ok, value)
    worker.job = None


def _read(path: Path, datasets: tuple[str, ...] | None, budget: int | None) -> Run:
    return read_run(path, datasets=datasets, budget=budget)


def read_runs(
    paths: Iterable[str | os.PathLike],
    *,
    datasets: Iterable[str] | None = None,
    timeout: float | None = None,
    memory: int | None = None,
) -> Iterator[tuple[Path, Run | RunFileError]]:
    """(path, its Run or the RunFileError saying why it cannot be read) for each path, in order;
    each read in a worker process with ``timeout`` seconds (default: read_timeout()) and
    ``memory`` bytes (default: read_memory()), its datasets at most a DATA_SHARE of that.

    Args:
        paths: the run files.
        datasets: the datasets to read (None: all).
        timeout: seconds per file.
        memory: bytes per file.

    Returns:
        An iterator of (path, Run or RunFileError), in the order of ``paths``.
    """
    files = [Path(p) for p in paths]
    limit = read_timeout() if timeout is None else timeout
    memory = read_memory() if memory is None else memory
    wanted = None if datasets is None else tuple(datasets)
    calls = [(path, wanted, memory // DATA_SHARE) for path in files]
    outcomes = bounded_map(_read, calls, limit, memory=memory)
    for path, (ok, value) in zip(files, outcomes, strict=True):
        yield path, value if ok else RunFileError(path, value)


def read_run_bounded(
    path: str | os.PathLike,
    *,
    datasets: Iterable[str] | None = None,
    timeout: float | None = None,
    memory: int | None = None,
) -> Run:
    """read_run in a worker process with a time and memory limit; raises RunFileError as read_run
    does, and for a read that does not finish in time or in its memory."""
    ((_, outcome),) = read_runs([path], datasets=datasets, timeout=timeout, memory=memory)
    if isinstance(outcome, RunFileError):
        raise outcome
    return outcome


def run_statuses(
    paths: Sequence[str | os.PathLike], *, timeout: float | None = None
) -> Iterator[tuple[str, str | None]]:
    """run_status of each path in a worker process: (status, None), or ("corrupt", reason) where
    the read did not finish in time or crashed its worker."""
    limit = read_timeout() if timeout is None else timeout
    calls = [(Path(p),) for p in paths]
    for ok, value in bounded_map(run_status, calls, limit, memory=read_memory()):
        yield (value, None) if ok else ("corrupt", value)

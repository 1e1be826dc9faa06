"""The progress thread: MPI's progress engine kept running while the ranks compute (--overlap).

No MPI import: whoever starts the thread (MPICommunicator.start_progress_thread in
relaympi.comm.mpi) hands it its own communicator, an mpi4py Comm, after checking that MPI provides
MPI_THREAD_MULTIPLE.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ProgressThread:
    """A thread that runs MPI's progress engine every ``interval`` seconds inside ``running()``
    blocks
    (backward, under --overlap), so transfers posted from the hooks keep moving between them; asleep
    outside them.

    It tests a receive of its own, posted on its own communicator and never matched (MPI_Test runs
    the progress engine for every request in flight): it never touches the requests of the main
    thread, which MPI forbids two threads to complete at once. Needs MPI_THREAD_MULTIPLE. Between
    polls it sleeps, holding neither a core nor the GIL (a spinning thread, like MPICH's
    MPIR_CVAR_ASYNC_PROGRESS, takes a core from the ranks where there is none to spare).
    ``comm`` is the thread's own (nobody else sends on it); close() frees it.
    """

    def __init__(self, comm: Any, interval: float):
        self._comm = comm
        self._request = comm.Irecv(bytearray(1), source=comm.Get_rank(), tag=0)  # never matched
        self.interval = interval
        self.polls = 0  # progress-engine calls made (the tests check the thread ran)
        self._resumed = threading.Event()
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="relaympi-mpi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._resumed.wait()
                if self._closing:
                    return
                self._request.Test()
                self.polls += 1
                time.sleep(self.interval)
        except BaseException as exc:  # raised in the main thread when its running() block ends
            self._error = exc

    @contextmanager
    def running(self) -> Iterator[None]:
        """Poll within the block; after it, raise what the thread failed with (unless the block
        raised:
        its own error is the one to see)."""
        self._resumed.set()
        try:
            yield
        finally:
            self._resumed.clear()
        if self._error is not None:
            raise RuntimeError(f"the MPI progress thread failed: {self._error}") from self._error

    def close(self) -> None:
        self._closing = True
        self._resumed.set()
        self._thread.join()
        self._request.Cancel()
        self._request.Wait()
        self._comm.Free()

"""How a rank waits for its transfers: MPI's own blocking wait, or polls that give the core away.

MPICH and Open MPI wait by polling (MPI_Wait spins in the progress engine), so a rank waiting for
a slower one burns a core; on a node with more ranks than cores (or busy with other work) that
core is taken from the ranks still computing. ``RELAYMPI_WAIT`` chooses (docs/running.md):

    spin   MPI_Waitall (MPI's own wait, a busy poll)
    yield  MPI_Testall, then sched_yield, in a loop: a rank that is runnable gets the core first
    sleep  MPI_Testall for a short spin, then sleeps that grow with the wait (a quarter of the time
           waited so far, 2 ms at most): a long wait costs little CPU and is overshot by at most a
           quarter (default)

No MPI import: the communicator hands in its test (``done``) and what to check between polls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

WAIT_ENV = "RELAYMPI_WAIT"
WAIT_MODES = ("spin", "yield", "sleep")
DEFAULT_WAIT = "sleep"
SPIN_S = 50e-6  # polls before the first sleep: a transfer about to land costs no sleep
MAX_SLEEP_S = 2e-3  # the longest single sleep (the most a wait overshoots a late transfer by)
SLEEP_FRACTION = 0.25  # each sleep: this fraction of the time waited so far


def wait_mode() -> str:
    """RELAYMPI_WAIT's mode (DEFAULT_WAIT where unset).

    Returns:
        One of WAIT_MODES.

    Raises:
        ValueError: another value (one line naming it and the modes).
    """
    value = os.environ.get(WAIT_ENV, "").strip() or DEFAULT_WAIT
    if value not in WAIT_MODES:
        raise ValueError(f"{WAIT_ENV}={value!r}; choose one of {', '.join(WAIT_MODES)}")
    return value


def poll(done: Callable[[], bool], between: Callable[[], None], mode: str) -> None:
    """Return once ``done()`` is true, calling ``between()`` after each false poll.

    Args:
        done: tests the transfers without blocking (MPI_Testall); true once they completed.
        between: what to check while waiting (a failure another rank reported); may raise.
        mode: "yield" or "sleep" (WAIT_MODES; "spin" is MPI's own wait, not a poll loop here).
    """
    if done():
        return
    start = time.perf_counter()
    while True:
        between()
        if mode == "yield":
            os.sched_yield()
        else:
            waited = time.perf_counter() - start
            if waited > SPIN_S:
                time.sleep(min(MAX_SLEEP_S, waited * SLEEP_FRACTION))
        if done():
            return

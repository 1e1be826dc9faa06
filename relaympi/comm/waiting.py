"""How a rank waits for its transfers: MPI's own blocking wait, or polls that give the core away.

MPICH and Open MPI wait by polling (MPI_Wait spins in the progress engine), so a rank waiting for
a slower one burns a core; on a node with more ranks than cores (or busy with other work) that
core is taken from the ranks still computing. ``RELAYMPI_WAIT`` chooses (docs/running.md):

    spin   MPI_Waitall (MPI's own wait, a busy poll)
    yield  MPI_Testall, then sched_yield, in a loop: a rank that is runnable gets the core first
    sleep  as yield for the first 10 ms of a wait, then sleeps that grow with the wait (a quarter
           of the time waited so far, 2 ms at most): a wait for a stalled or much slower rank costs
           little CPU and is overshot by at most a quarter (default)

Why yields for so long: MPI moves a message only inside the MPI calls of both its ends (a sleeping
sender's next chunk waits for its next poll too), so each sleep delays the ranks waiting on this
one, and they sleep in turn. With 4 ranks on a quiet 2-core machine, sleeping after 50 us took 2-8x
longer per step than yielding, and sleeping after 1 or 2 ms still up to 2x; from 10 ms on the steps
were as fast as yielding (docs/benchmarks.md). A yield returns at once where no other process waits
for the core, and gives the core away where one does (on an oversubscribed node, the rank this one
waits for).

A wait with a deadline (``--message-deadline``) polls in every mode, spin included, and stops
polling at the deadline. No MPI import: the communicator hands in its test (``done``) and what to
check between polls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

WAIT_ENV = "RELAYMPI_WAIT"
WAIT_MODES = ("spin", "yield", "sleep")
DEFAULT_WAIT = "sleep"
YIELD_S = 10e-3  # how long "sleep" polls and yields before its first sleep
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


def poll(
    done: Callable[[], bool],
    between: Callable[[], None],
    mode: str,
    until: float | None = None,
) -> bool:
    """Return once ``done()`` is true, calling ``between()`` after each false poll; or give up at
    ``until``.

    Args:
        done: tests the transfers without blocking (MPI_Testall); true once they completed.
        between: what to check while waiting (a failure another rank reported); may raise.
        mode: one of WAIT_MODES ("spin" polls without giving the core away).
        until: a ``time.perf_counter()`` time to give up at (None: wait as long as it takes).
            A sleep never runs past it.

    Returns:
        True once ``done()`` was true, False where ``until`` came first.
    """
    if done():
        return True
    start = time.perf_counter()
    while True:
        between()
        now = time.perf_counter()
        if until is not None and now >= until:
            return False
        if mode == "sleep" and now - start > YIELD_S:
            pause = min(MAX_SLEEP_S, (now - start) * SLEEP_FRACTION)
            time.sleep(pause if until is None else max(0.0, min(pause, until - now)))
        elif mode != "spin":
            os.sched_yield()
        if done():
            return True

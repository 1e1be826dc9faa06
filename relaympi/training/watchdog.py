"""The watchdog of ``--on-failure continue``: a heal, the run's end agreement or closing the run
file that outlasts RELAYMPI_HEAL_TIMEOUT ends the process with one line naming the phase, so that
no rank waits for ever inside MPI (relaympi.training.healing arms it)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from relaympi.config import ConfigError

# seconds a heal, the end agreement or the close may take
HEAL_TIMEOUT_ENV = "RELAYMPI_HEAL_TIMEOUT"
DEFAULT_HEAL_TIMEOUT_S = 60.0

_ENDING = threading.Lock()  # held by the watchdog that ends this process


def heal_timeout() -> float:
    """RELAYMPI_HEAL_TIMEOUT in seconds (default 60).

    Raises:
        ConfigError: not a positive number (one line).
    """
    value = os.environ.get(HEAL_TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_HEAL_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{HEAL_TIMEOUT_ENV}={value!r}; expected seconds > 0, e.g. 60")
    return seconds


class Watchdog:
    """Ends this process when a watched phase outlasts its limit: one line naming the phase,
    ``on_expiry(phase)`` (marks the run file where this process writes it; returns the exit status),
    then ``os._exit``. A process stuck inside MPI holds no Python lock, so the timer's thread runs.
    """

    def __init__(self, limit_s: float, on_expiry: Callable[[str], int], who: str) -> None:
        self.limit_s, self.on_expiry, self.who = limit_s, on_expiry, who

    @contextmanager
    def watching(self, phase: str) -> Iterator[None]:
        """Arm the limit for the body's duration.

        Args:
            phase: what the body does, as the line names it ("heal", "end agreement", ...).
        """
        timer = threading.Timer(self.limit_s, self._expire, args=(phase,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _expire(self, phase: str) -> None:
        if not _ENDING.acquire(blocking=False):  # another worker of this process ends it already
            return
        print(
            f"failed: {self.who}: the {phase} did not finish within {self.limit_s:g} s "
            f"({HEAL_TIMEOUT_ENV}); ending this process",
            file=sys.stderr,
            flush=True,
        )
        code = 1
        try:
            code = self.on_expiry(phase)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

"""Test-only injections into a run's steps, each set by an environment variable (docs/running.md):
a failure (RELAYMPI_INJECT_FAILURE, parsed in relaympi.training.membership), a signal the run file's
process sends itself (RELAYMPI_INJECT_SIGNAL) and a worker held back before its exchange
(RELAYMPI_INJECT_DELAY)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Container, Sequence

from relaympi.config import ConfigError
from relaympi.training.membership import FAULT_ENV, Injection

SIGNAL_ENV = "RELAYMPI_INJECT_SIGNAL"
DELAY_ENV = "RELAYMPI_INJECT_DELAY"


def signal_injection() -> tuple[signal.Signals, int] | None:
    """RELAYMPI_INJECT_SIGNAL=NAME:STEP makes the run file's process send itself that signal (TERM,
    INT, USR1) during the step before STEP, as a user or scheduler would: the run stops at STEP
    plus the agreement's lag, or sooner at an evaluation or checkpoint (training.agreement)."""
    value = os.environ.get(SIGNAL_ENV, "")
    if not value:
        return None
    name, _, step = value.partition(":")
    try:
        signum = signal.Signals["SIG" + name.upper().removeprefix("SIG")]
        return signum, int(step)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{SIGNAL_ENV}={value!r}; expected NAME:STEP, e.g. TERM:20") from exc


def delay_injection() -> tuple[int, frozenset[int], float] | None:
    """RELAYMPI_INJECT_DELAY=WORKER:STEP[,STEP...]:SECONDS makes that worker sleep so long between
    its gradient and its algorithm step at each STEP, as a stalled process would (to test
    --message-deadline with a known late worker)."""
    value = os.environ.get(DELAY_ENV, "")
    if not value:
        return None
    try:
        worker, steps, seconds = value.split(":")
        return int(worker), frozenset(int(s) for s in steps.split(",")), float(seconds)
    except ValueError as exc:
        raise ConfigError(
            f"{DELAY_ENV}={value!r}; expected WORKER:STEP[,STEP...]:SECONDS, e.g. 1:3,7:0.5"
        ) from exc


def check_failures(inject: Sequence[Injection], world_size: int, backend: str, noun: str) -> None:
    """Refuse a RELAYMPI_INJECT_FAILURE that names no worker of the run, or a start-up failure
    off MPI.

    Args:
        inject: the injected losses.
        world_size: the run's workers.
        backend: the run's backend.
        noun: what the run calls a worker ("rank" or "worker").

    Raises:
        ConfigError: one that cannot apply.
    """
    for loss in inject:
        if loss.phase == "startup" and backend != "mpi":
            raise ConfigError(
                f"{FAULT_ENV} {loss.rank}:{loss.step}:startup: only MPI ranks (--backend mpi) "
                "fail at start-up"
            )
        if not 0 <= loss.rank < world_size:
            raise ConfigError(
                f"{FAULT_ENV} names {noun} {loss.rank}, but the run has {noun}s 0..{world_size - 1}"
            )


def failure_at(
    inject: Sequence[Injection], step: int, workers: Container[int], noun: str
) -> str | None:
    """The message of the failure RELAYMPI_INJECT_FAILURE asks of these workers at this step.

    Args:
        inject: the injected losses.
        step: the step about to run.
        workers: the workers this process runs.
        noun: what the run calls a worker.

    Returns:
        The failure's message, or None.
    """
    for loss in inject:
        # a start-up failure fails before the loop (relaympi.train)
        if loss.step == step and loss.rank in workers and loss.phase != "startup":
            return f"injected failure on {noun} {loss.rank} at step {step} ({FAULT_ENV})"
    return None


def send_signal(
    injection: tuple[signal.Signals, int] | None, step: int, is_root: bool, stop: threading.Event
) -> None:
    """RELAYMPI_INJECT_SIGNAL: the run file's process signals itself during the step before STEP.

    Args:
        injection: signal_injection()'s value.
        step: the step about to run.
        is_root: whether this process writes the run file.
        stop: the event the signal handler sets.
    """
    if injection is not None and is_root and step + 1 == injection[1]:
        os.kill(os.getpid(), injection[0])
        stop.wait(10.0)  # the handler runs in the main thread: stop at this very step


def hold_back(
    injection: tuple[int, frozenset[int], float] | None, step: int, workers: Container[int]
) -> None:
    """RELAYMPI_INJECT_DELAY: the named worker sleeps before its exchange at the named steps.

    Args:
        injection: delay_injection()'s value.
        step: the step about to exchange.
        workers: the workers this process runs.
    """
    if injection is not None and injection[0] in workers and step in injection[1]:
        time.sleep(injection[2])

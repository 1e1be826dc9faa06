"""The per-step agreement of every rank on stopping and divergence, lagged: the flags each rank
posts at the end of step t are reduced without blocking, and the steps act on the result at the end
of step t + lag, so that no step waits for the slowest rank on their account.

Every rank, and every backend (MPI, in-process threads, batched), posts the same flags at the same
step boundaries and acts at the same boundaries, so a run stops at the same step everywhere. Where
the model is read (an evaluation, a checkpoint, the last step) every pending agreement is completed
first, so a run that neither diverges nor stops early records exactly what an unlagged run records,
and a diverged run records the same diverged step. A stop (SIGTERM, Ctrl-C) takes effect up to
``lag`` steps later than it would unlagged: at the next boundary where its agreement is due.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from relaympi.config import ConfigError

# steps between posting a step's flags and acting on their agreement (docs/design.md); 0 agrees
# at every step's end (one all-reduce every rank waits for)
AGREEMENT_LAG = 1
# under --message-deadline: how far (in steps) a rank may run ahead of the slowest before it waits
# for it; a stall of up to this many of the others' steps costs them no wait (docs/membership.md)
DEADLINE_AGREEMENT_LAG = 64
# under --message-deadline: a rank whose neighbour is this many steps ahead skips steps until it
# is level again (docs/membership.md, "Catching up")
CATCH_UP_BEHIND = 4
LAG_ENV = "RELAYMPI_AGREEMENT_LAG"


class FlagsRequest(Protocol):
    """A started agreement: ``wait()`` completes it (the agreed flags are then in its buffer)."""

    def wait(self) -> object: ...


class Agreed:
    """The agreement of a process with itself (one process runs every worker): complete when
    started."""

    def wait(self) -> None:
        return None


# starts the element-wise maximum over ranks of a host float64 buffer, in place
StartAgreement = Callable[[np.ndarray], FlagsRequest]


def agreement_lag(default: int | None = AGREEMENT_LAG) -> int | None:
    """The lag from RELAYMPI_AGREEMENT_LAG.

    Args:
        default: what to return where it is unset (AGREEMENT_LAG; None lets the caller choose,
            as the training loop does under --message-deadline: DEADLINE_AGREEMENT_LAG).

    Returns:
        Steps between posting a step's flags and acting on them (0: at once).

    Raises:
        ConfigError: not a whole number >= 0 (one line).
    """
    value = os.environ.get(LAG_ENV, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ConfigError(f"{LAG_ENV}={value!r}; expected a whole number of steps >= 0, e.g. 1")
    return int(value)


@dataclass
class _Posted:
    step: int  # the boundary the flags were posted at (steps done)
    bad_step: int | None  # this rank's own divergence step there (what the root records)
    flags: np.ndarray  # [stop, bad]: this rank's, then (once waited for) every rank's maximum
    request: FlagsRequest


@dataclass(frozen=True)
class Verdict:
    """What the agreements completed at one boundary decided."""

    resolved: int  # how many agreements were completed
    diverged_step: int | None  # the step a divergence is recorded at, if one was agreed
    stop: bool  # a stop was agreed (and no divergence)


class LaggedAgreement:
    """The agreements in flight of one run of the steps (made again after a heal: the old
    communicator's are void)."""

    def __init__(self, start: StartAgreement, lag: int) -> None:
        """Args:
        start: begins the agreement of one boundary's flags (the engine's transport).
        lag: steps between posting and acting (0: complete each at once).
        """
        self.start, self.lag = start, lag
        self._posted: deque[_Posted] = deque()

    @property
    def in_flight(self) -> int:
        """How many agreements are posted and not yet completed."""
        return len(self._posted)

    def post(self, step: int, stop: bool, bad_step: int | None) -> None:
        """Start the agreement of boundary ``step``'s flags.

        Args:
            step: the steps done (the boundary).
            stop: this rank was asked to stop.
            bad_step: the step this rank's divergence is recorded at, None where it saw none.
        """
        flags = np.array([float(stop), float(bad_step is not None)])
        self._posted.append(_Posted(step, bad_step, flags, self.start(flags)))

    def due(self, step: int, drain: bool) -> Verdict:
        """Complete the agreements due at boundary ``step``: those posted ``lag`` or more steps
        before, or all of them with ``drain`` (the model is read next) or once one says stop or
        diverged (a stopped run's checkpoint must hold no diverged step, and no agreement is left
        in flight when the run ends).

        Args:
            step: the current boundary.
            drain: complete every agreement in flight.

        Returns:
            The Verdict: a divergence agreed in the earliest completed agreement that has one wins
            over a stop (the model went on past it).

        Raises:
            PeerLost: a rank was lost (surfacing as an agreement completes).
        """
        done: list[_Posted] = []
        while self._posted and (drain or self._posted[0].step <= step - self.lag):
            entry = self._posted.popleft()
            entry.request.wait()
            done.append(entry)
            if entry.flags.any():  # the run ends here: nothing left in flight behind it
                drain = True
        for entry in done:
            if entry.flags[1] > 0:
                at = entry.step if entry.bad_step is None else entry.bad_step
                return Verdict(len(done), at, False)
        return Verdict(len(done), None, any(entry.flags[0] > 0 for entry in done))

"""Simulated message loss (``--drop-prob``), replayed late drops and skipped steps
(``--replay-drops``): DropPolicy, torch-free, so the run's configuration checks its probability
before torch loads; relaympi.comm re-exports it beside the Communicator."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# communication rounds reserved per gradient step, so (step, sub-round) -> a unique round id
# (relaympi.algorithms.round_id); a skipped step is all of its rounds
ROUNDS_PER_STEP = 4

# the columns of a run file's late drops (its ``late_drops`` group): one row per message that
# missed --message-deadline, as its receiver recorded it
LATE_DROP_COLUMNS = ("step", "round", "tag", "sender", "receiver")


class DropPolicy:
    """Seeded, reproducible simulated message loss.

    Whether the message from ``src`` to ``dst`` in communication round ``round`` (with
    ``tag``) is lost is a pure function of (seed, round, tag, src, dst): sender and receiver
    decide identically without talking, a resumed run drops the same messages, and the
    decision does not depend on the backend or on the order in which ranks ask.

    A replayed late drop (``late``) is another kind of loss: the message was sent (and its bytes
    counted) but its receiver treats it as lost, as a message that missed ``--message-deadline``
    on MPI was; only the receiver asks ``late``.

    A replayed skipped step (``skipped``) is a step that a worker behind its neighbours left out to
    catch up (docs/membership.md): it neither sent nor received in the step's rounds. Its
    neighbours' messages to it were sent (their bytes counted) and discarded; its messages to them
    were never sent, and each neighbour recorded the one it waited for as late.

    Args:
        prob: the probability that any one message is lost, in [0, 1).
        seed: the seed of every decision.
        late: the (round, tag, sender, receiver) of each message its receiver discards
            (``--replay-drops``: the late drops a run file recorded).
        skipped: the (step, worker) of each step a worker skipped (``--replay-drops``).
        rounds_per_step: how many communication rounds each step numbers (``skipped`` is by step).

    Raises:
        ValueError: ``prob`` is outside [0, 1).

    Example:
        ```python
        drops = DropPolicy(0.1, seed=3)
        drops.dropped(round=7, tag=0, src=1, dst=2)  # the same answer on every rank, every time
        ```
    """

    def __init__(
        self,
        prob: float = 0.0,
        seed: int = 0,
        late: Iterable[tuple[int, int, int, int]] = (),
        skipped: Iterable[tuple[int, int]] = (),
        rounds_per_step: int = ROUNDS_PER_STEP,
    ) -> None:
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"drop probability must be in [0, 1), got {prob}")
        self.prob = float(prob)
        self.seed = int(seed)
        self.replayed: frozenset[tuple[int, int, int, int]] = frozenset(
            (int(r), int(t), int(s), int(d)) for r, t, s, d in late
        )
        self.skips: frozenset[tuple[int, int]] = frozenset((int(t), int(w)) for t, w in skipped)
        self.rounds_per_step = int(rounds_per_step)

    def dropped(self, round: int, tag: int, src: int, dst: int) -> bool:
        """Whether the message from ``src`` to ``dst`` in ``round`` with ``tag`` is lost.

        Args:
            round: the communication round (the number both ends pass to ``exchange``).
            tag: the message's tag.
            src: the sending rank.
            dst: the receiving rank.

        Returns:
            True if the message is lost.
        """
        if self.prob == 0.0:
            return False
        rng = np.random.default_rng([self.seed, 0x5EED, round, tag, src, dst])
        return bool(rng.random() < self.prob)

    def late(self, round: int, tag: int, src: int, dst: int) -> bool:
        """Whether the receiver discards the message from ``src`` to ``dst`` in ``round`` with
        ``tag`` as late (a replayed late drop: the sender still sends it).

        Args:
            round: the communication round.
            tag: the message's tag.
            src: the sending rank.
            dst: the receiving rank.

        Returns:
            True if the run being replayed recorded it as a late drop.
        """
        return (round, tag, src, dst) in self.replayed

    def skipped(self, round: int, worker: int) -> bool:
        """Whether ``worker`` skipped the step that ``round`` belongs to (a replayed skipped step).

        Args:
            round: the communication round.
            worker: the rank asked about.

        Returns:
            True if the run being replayed recorded that the worker skipped that step.
        """
        return bool(self.skips) and (round // self.rounds_per_step, worker) in self.skips

"""Simulated message loss (``--drop-prob``): DropPolicy, torch-free, so the run's configuration
checks its probability before torch loads; relaympi.comm re-exports it beside the Communicator."""

from __future__ import annotations

import numpy as np


class DropPolicy:
    """Seeded, reproducible simulated message loss.

    Whether the message from ``src`` to ``dst`` in communication round ``round`` (with
    ``tag``) is lost is a pure function of (seed, round, tag, src, dst): sender and receiver
    decide identically without talking, a resumed run drops the same messages, and the
    decision does not depend on the backend or on the order in which ranks ask.

    Args:
        prob: the probability that any one message is lost, in [0, 1).
        seed: the seed of every decision.

    Raises:
        ValueError: ``prob`` is outside [0, 1).

    Example:
        ```python
        drops = DropPolicy(0.1, seed=3)
        drops.dropped(round=7, tag=0, src=1, dst=2)  # the same answer on every rank, every time
        ```
    """

    def __init__(self, prob: float = 0.0, seed: int = 0):
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"drop probability must be in [0, 1), got {prob}")
        self.prob = float(prob)
        self.seed = int(seed)

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

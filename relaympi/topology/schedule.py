"""SGP's time-varying exponential schedule: who sends to whom in each communication round."""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np

from .errors import TopologyError

__all__ = ["ExponentialSchedule", "is_power_of_two"]


def is_power_of_two(value: int) -> bool:
    """Whether value is 1, 2, 4, 8, ..."""
    return value >= 1 and value & (value - 1) == 0


def _nonnegative_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TopologyError(f"{what} must be an integer, got {value!r}")
    if value < 0:
        raise TopologyError(f"{what} must be >= 0, got {value}")
    return int(value)


class ExponentialSchedule:
    """Time-varying exponential graph of Stochastic Gradient Push (paper appendix, Algorithm "SGP").

    In communication round k (a global counter; SGP runs two rounds per gradient step) every
    rank i sends its model to i - o and averages it with the model of i + o, where
    o = 2 ** (k mod log2 n). After log2 n consecutive rounds every rank holds the exact average.
    A pure function of (round, rank): it never communicates.
    """

    def __init__(self, world_size: int, any_size: bool = False) -> None:
        """``any_size``: any world_size >= 2, with hops 2^k < n and a period of ceil(log2 n)
        rounds (the survivors of a lost worker; the average is exact only for a power of two).
        Without it, a power of two only (the paper's schedule)."""
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
            raise TopologyError(
                f"exponential schedule world_size must be an integer, got {world_size!r}"
            )
        if world_size < 2 or not (any_size or is_power_of_two(int(world_size))):
            raise TopologyError(
                "the exponential schedule needs a power of two world_size (2, 4, 8, 16, "
                f"...), got {world_size}"
            )
        self.world_size = int(world_size)
        # log2 n for a power of two; ceil(log2 n) hops 1, 2, 4, ... < n otherwise
        self.period = (self.world_size - 1).bit_length()

    def __repr__(self) -> str:
        return f"ExponentialSchedule(world_size={self.world_size})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExponentialSchedule):
            return NotImplemented
        return self.world_size == other.world_size

    def __hash__(self) -> int:
        return hash((ExponentialSchedule, self.world_size))

    def _rank(self, rank: Any) -> int:
        rank = _nonnegative_int(rank, "rank")
        if rank >= self.world_size:
            raise TopologyError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank

    def offset(self, round: int) -> int:
        """Hop length 2 ** (round mod log2 n) used in communication round `round` (>= 0)."""
        return 2 ** (_nonnegative_int(round, "round") % self.period)

    def send_peer(self, round: int, rank: int) -> int:
        """The rank that `rank` sends its model to in this round: rank - offset (mod n)."""
        return (self._rank(rank) - self.offset(round)) % self.world_size

    def recv_peer(self, round: int, rank: int) -> int:
        """The rank that `rank` receives from and averages with in this round: rank + offset (mod
        n)."""
        return (self._rank(rank) + self.offset(round)) % self.world_size

    def mixing_matrix(self, round: int) -> np.ndarray:
        """W of this round: x_i <- (x_i + x_{i+o}) / 2, i.e. W[i, i] = W[i, i+o] = 1/2 (doubly
        stochastic)."""
        n = self.world_size
        ranks = np.arange(n)
        weights = np.zeros((n, n), dtype=np.float64)
        weights[ranks, ranks] = 0.5
        weights[ranks, (ranks + self.offset(round)) % n] = 0.5  # offset < n, so never the diagonal
        return weights

    def send_peers(self, round: int) -> np.ndarray:
        """send_peer(round, rank) of every rank, shape [n]."""
        return (np.arange(self.world_size) - self.offset(round)) % self.world_size

    def recv_peers(self, round: int) -> np.ndarray:
        """recv_peer(round, rank) of every rank, shape [n]."""
        return (np.arange(self.world_size) + self.offset(round)) % self.world_size

    def union_edges(self) -> np.ndarray:
        """union_graph's pairs (i, i + 2^k mod n) as an [n log2 n, 2] array (with repeats)."""
        ranks = np.arange(self.world_size, dtype=np.int64)
        return np.concatenate(
            [
                np.stack([ranks, (ranks + 2**k) % self.world_size], axis=1)
                for k in range(self.period)
            ]
        )

    def union_graph(self) -> nx.Graph:
        """Undirected graph of every pair that communicates in some round of the period."""
        graph = nx.Graph()
        graph.add_nodes_from(range(self.world_size))
        for k in range(self.period):
            o = 2**k
            graph.add_edges_from((i, (i + o) % self.world_size) for i in range(self.world_size))
        return graph

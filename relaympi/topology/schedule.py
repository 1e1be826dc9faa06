"""Time-varying schedules: who sends to whom in each communication round (SGP's exponential
schedule, and the one-peer topologies of the gossip algorithms)."""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np

from .errors import TopologyError

__all__ = [
    "ALTERNATING_RING",
    "ONE_PEER_EXPONENTIAL",
    "ONE_PEER_NAMES",
    "ExponentialSchedule",
    "OnePeerSchedule",
    "is_power_of_two",
    "one_peer_schedule",
]


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


ONE_PEER_EXPONENTIAL = "one-peer-exponential"
ALTERNATING_RING = "alternating-ring"
# the time-varying one-peer topologies of the gossip algorithms: each round a perfect matching
ONE_PEER_NAMES = (ONE_PEER_EXPONENTIAL, ALTERNATING_RING)


class OnePeerSchedule:
    """A time-varying topology where every rank averages with exactly one peer per round.

    Round k pairs the ranks into a perfect matching and each pair averages:
    x_i <- (x_i + x_peer) / 2, so W(k) is symmetric and doubly stochastic and every rank sends
    one model per round (half of a ring's two). Two families:

    - ``one-peer-exponential`` (n a power of two): the peer of i is i XOR 2^(k mod log2 n), that
      is i + 2^b when bit b of i is 0 and i - 2^b otherwise. The matchings are the hypercube's
      dimensions in turn, so log2 n consecutive rounds give every rank the exact average.
    - ``alternating-ring`` (n even): on even rounds the pairs (0, 1), (2, 3), ..., on odd rounds
      (1, 2), (3, 4), ..., (n-1, 0): each rank takes its ring neighbours in turn, right then left
      for even ranks. With n = 2 both rounds pair (0, 1).

    A pure function of (round, rank), like ExponentialSchedule: it never communicates.
    """

    def __init__(self, name: str, world_size: int) -> None:
        """The schedule of topology ``name`` (one of ONE_PEER_NAMES) over world_size ranks.

        Args:
            name: ``one-peer-exponential`` or ``alternating-ring``.
            world_size: the number of ranks: a power of two >= 2, or an even number >= 2.

        Raises:
            TopologyError: another name, or a world size the family cannot pair.
        """
        if name not in ONE_PEER_NAMES:
            raise TopologyError(
                f"no one-peer schedule called {name!r}; allowed: {', '.join(ONE_PEER_NAMES)}"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
            raise TopologyError(f"{name} world_size must be an integer, got {world_size!r}")
        n = int(world_size)
        if name == ONE_PEER_EXPONENTIAL and (n < 2 or not is_power_of_two(n)):
            raise TopologyError(
                f"{name} needs a power of two world_size (2, 4, 8, ...) so that every rank has "
                f"a peer in every round, got {n}"
            )
        if name == ALTERNATING_RING and (n < 2 or n % 2):
            raise TopologyError(
                f"{name} needs an even world_size >= 2 (ranks are paired off each step), got {n}"
            )
        self.name = name
        self.world_size = n
        self.period = max(1, (n - 1).bit_length()) if name == ONE_PEER_EXPONENTIAL else 2

    def __repr__(self) -> str:
        return f"OnePeerSchedule({self.name!r}, world_size={self.world_size})"

    def peers(self, round: int) -> np.ndarray:
        """Every rank's peer in communication round ``round`` (>= 0), shape [n]: an involution
        without fixed points (peers[peers[i]] == i != peers[i])."""
        k = _nonnegative_int(round, "round") % self.period
        ranks = np.arange(self.world_size)
        if self.name == ONE_PEER_EXPONENTIAL:
            return ranks ^ (1 << k)
        if k == 0:  # (2j, 2j + 1)
            return ranks ^ 1
        # (2j + 1, 2j + 2) and (n - 1, 0): odd ranks to the right, even ranks to the left
        return np.where(ranks % 2 == 1, ranks + 1, ranks - 1) % self.world_size

    def peer(self, round: int, rank: int) -> int:
        """The one rank that ``rank`` exchanges with and averages with in this round."""
        rank = _nonnegative_int(rank, "rank")
        if rank >= self.world_size:
            raise TopologyError(f"rank must be in [0, {self.world_size}), got {rank}")
        return int(self.peers(round)[rank])

    def mixing_matrix(self, round: int) -> np.ndarray:
        """W of this round: W[i, i] = W[i, peer(i)] = 1/2 (symmetric, doubly stochastic)."""
        n = self.world_size
        ranks = np.arange(n)
        weights = np.zeros((n, n), dtype=np.float64)
        weights[ranks, ranks] = 0.5
        weights[ranks, self.peers(round)] += 0.5  # a peer is never the rank itself
        return weights

    def union_edges(self) -> np.ndarray:
        """Every pair that meets in some round of the period, each once, as an [m, 2] array (the
        hypercube, or the ring; one edge for n = 2)."""
        ranks = np.arange(self.world_size, dtype=np.int64)
        pairs = {
            (int(i), int(j))
            for k in range(self.period)
            for i, j in zip(ranks, self.peers(k), strict=True)
            if i < j
        }
        return np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)


def one_peer_schedule(name: str, world_size: int) -> OnePeerSchedule | None:
    """The OnePeerSchedule of topology ``name`` over world_size ranks; None for a topology whose
    gossip matrix is fixed.

    Args:
        name: a topology's name.
        world_size: its number of ranks.

    Returns:
        The schedule, or None when ``name`` is not one of ONE_PEER_NAMES.
    """
    return OnePeerSchedule(name, world_size) if name in ONE_PEER_NAMES else None

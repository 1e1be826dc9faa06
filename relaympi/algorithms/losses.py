"""The matrix forms' model of lost messages: each lost message explicit, vectorized over workers.

Written from the paper's semantics (Algorithm 1 and eq. robust-relaysum-model, the appendix
algorithms for D², gradient tracking, SGP and RelaySum/Grad) and the loss rules in
docs/algorithms.md's "Message loss" section, not from the message-passing code, which the tests
hold against it. Which messages are lost is an input: ``delivered(round, tag, src, dst)``, normally
``not DropPolicy.dropped(...)``, asked with the round and tag numbering the algorithms use
(``round_id(step, sub)``; tag = tree layer for RelaySum, 0 otherwise). Each algorithm's
``MatrixForm.lossy_step`` uses the pieces here that fit it.

Rows of X are workers. Nothing here communicates.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np

from relaympi.algorithms.base import Delivered, MatrixForm, round_id


def layer_coordinates(d: int, num_layers: int) -> list[np.ndarray]:
    """The coordinates tree k of a T-tree topology relays: block k of np.array_split(arange(d), T)
    (contiguous blocks, as NCCL splits data between its two trees; docs/design.md, "Algorithm
    notes and traps").

    Args:
        d: the model's size.
        num_layers: the topology's number of trees.

    Returns:
        One array of coordinates per tree.
    """
    return np.array_split(np.arange(d), num_layers)


class LossyRelaySum:
    """RelaySum on every directed edge of every tree (paper Algorithm 1, lines 4-9), with lost
    messages.

    On each edge i -> j of tree k, in step t::

        m_ij(t) = p_i(t) + sum_{k in N(i) \\ {j}} m_ki(t-1)
        c_ij(t) = 1 + sum_{k in N(i) \\ {j}} c_ki(t-1)

    where m_ki(t-1), c_ki(t-1) are what i *received* from k in step t-1. A lost message arrives
    EMPTY: payload 0, counter 0, so the counters always say how many parcels a sum holds.
    Then s_i(t) = sum_{j in N(i)} m_ji(t) and n-bar_i(t+1) = 1 + sum_{j in N(i)} c_ji(t).
    """

    def __init__(self, topology: Any, d: int) -> None:
        self.n = topology.world_size
        self.d = d
        self.coords = layer_coordinates(d, topology.num_layers)
        self.neighbors = [
            [topology.neighbors(i, k) for i in range(self.n)] for k in range(topology.num_layers)
        ]
        # per layer, the last message received on each directed edge (src, dst): payload and counter
        # (m(-1) = 0, c(-1) = 0)
        self.message = [
            {(i, j): np.zeros(len(coords)) for i in range(self.n) for j in nbrs[i]}
            for coords, nbrs in zip(self.coords, self.neighbors, strict=True)
        ]
        self.counter = [{edge: 0.0 for edge in messages} for messages in self.message]

    def step(
        self, parcels: np.ndarray, round: int, delivered: Delivered
    ) -> tuple[np.ndarray, np.ndarray]:
        """Send this step's messages, those ``delivered`` says arrive.

        Args:
            parcels: every worker's parcel p(t), [n, d].
            round: the communication round (``round_id(step)``).
            delivered: whether a message (round, tag = layer, src, dst) arrived.

        Returns:
            (s: the sum of the messages each worker received [n, d], n-bar [n, d] per coordinate).
        """
        sums, nbar = np.zeros((self.n, self.d)), np.ones((self.n, self.d))
        for layer, (coords, nbrs) in enumerate(zip(self.coords, self.neighbors, strict=True)):
            old_m, old_c = self.message[layer], self.counter[layer]
            new_m, new_c = {}, {}
            for i, j in old_m:
                relayed = [k for k in nbrs[i] if k != j]
                m = parcels[i, coords] + sum(
                    (old_m[(k, i)] for k in relayed), np.zeros(len(coords))
                )
                c = 1.0 + sum(old_c[(k, i)] for k in relayed)
                arrived = delivered(round, layer, i, j)
                new_m[(i, j)] = m if arrived else np.zeros(len(coords))
                new_c[(i, j)] = c if arrived else 0.0
            self.message[layer], self.counter[layer] = new_m, new_c
            for i in range(self.n):
                for j in nbrs[i]:
                    sums[i, coords] += new_m[(j, i)]
                    nbar[i, coords] += new_c[(j, i)]
        return sums, nbar


def lossy_mixing(W: np.ndarray, round: int, delivered: Delivered, tag: int = 0) -> np.ndarray:
    """The gossip matrix of one round with losses: W_ij -> 0 where j's message to i was lost, then
    each row renormalized to sum to one (the lost mass is shared in proportion to the remaining
    weights, self included), so a worker never mixes in a stale or empty model.

    Args:
        W: the lossless mixing matrix [n, n].
        round: the communication round.
        delivered: whether a message (round, tag, src, dst) arrived.
        tag: the messages' tag.

    Returns:
        This round's mixing matrix.
    """
    n = W.shape[0]
    arrived = np.eye(n)
    for i in range(n):
        for j in range(n):
            if i != j and W[i, j] != 0 and delivered(round, tag, j, i):
                arrived[i, j] = 1.0
    kept = W * arrived
    return kept / kept.sum(axis=1, keepdims=True)


class GossipMatrixForm(MatrixForm):
    """The matrix form of a gossip algorithm over the mixing matrices ``Ws`` (set by the subclass):
    step t mixes with W(t) = Ws[t mod len(Ws)], one matrix on a fixed graph and one per round of a
    one-peer topology's schedule. ``mixed`` is its step with a round's matrix, which lost messages
    thin (``lossy_mixing`` of that step's W(t))."""

    Ws: list[np.ndarray]

    def gossip_matrix(self, t: int) -> np.ndarray:
        """W(t), the lossless mixing matrix of step ``t``.

        Args:
            t: the gradient step.

        Returns:
            W(t), [n, n].
        """
        return self.Ws[t % len(self.Ws)]

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        return self.mixed(X, G, lr, self.gossip_matrix(t))

    def lossy_step(
        self, X: np.ndarray, G: np.ndarray, lr: float, t: int, delivered: Delivered
    ) -> np.ndarray:
        return self.mixed(X, G, lr, lossy_mixing(self.gossip_matrix(t), round_id(t), delivered))

    @abstractmethod
    def mixed(self, X: np.ndarray, G: np.ndarray, lr: float, W: np.ndarray) -> np.ndarray:
        """X(t+1) from X(t) and the gradients G, mixing with this round's ``W``."""

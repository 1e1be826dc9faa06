"""An independent model of message loss: every algorithm vectorized over all workers, each lost
message explicit.

Written from the paper's semantics (Algorithm 1 and eq. robust-relaysum-model, the appendix
algorithms for D², gradient tracking, SGP, RelaySum/Grad and mean estimation) and the loss
rules in docs/algorithms.md's "Message loss" section, not from the message-passing code. Which
messages are lost is an input: ``delivered(round, tag, src, dst)``, normally
``not DropPolicy.dropped(...)``, asked with the round and tag numbering the algorithms use
(``round_id(step, sub)``; tag = tree layer for RelaySum, 0 otherwise).

Rows of X are workers. Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relaympi.algorithms.base import round_id
from relaympi.algorithms.matrix import MatrixOptimizer
from relaympi.comm import DropPolicy
from relaympi.optim import OptimizerConfig

Delivered = Callable[
    [int, int, int, int], bool
]  # (round, tag, src, dst) -> did the message arrive?

GOSSIP_ALGORITHMS = ("dpsgd", "qgm", "d2", "gt")
RELAY_ALGORITHMS = ("relay", "relay-grad")


def delivered_by(drops: DropPolicy) -> Delivered:
    """The loss pattern of a DropPolicy, as the question 'did this message arrive?'."""
    return lambda round, tag, src, dst: not drops.dropped(round, tag, src, dst)


def layer_coordinates(d: int, num_layers: int) -> list[np.ndarray]:
    """The coordinates tree k of a T-tree topology relays: block k of np.array_split(arange(d), T)
    (contiguous blocks, as NCCL splits data between its two trees; docs/design.md, "Algorithm
    notes and traps")."""
    return np.array_split(np.arange(d), num_layers)


class LossyRelaySum:
    """RelaySum on every directed edge of every tree (paper Algorithm 1, lines 4-9), with lost
    messages.

    On each edge i -> j of tree k, in step t:
        m_ij(t) = p_i(t) + sum_{k in N(i) \\ {j}} m_ki(t-1),    c_ij(t) = 1 + sum_{k in N(i) \\ {j}}
        c_ki(t-1),
    where m_ki(t-1), c_ki(t-1) are what i *received* from k in step t-1. A lost message arrives
    EMPTY: payload 0, counter 0, so the counters always say how many parcels a sum holds.
    Then s_i(t) = sum_{j in N(i)} m_ji(t) and n-bar_i(t+1) = 1 + sum_{j in N(i)} c_ji(t).
    """

    def __init__(self, topology: Any, d: int, delivered: Delivered):
        self.n = topology.world_size
        self.d = d
        self.delivered = delivered
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

    def step(self, parcels: np.ndarray, round: int) -> tuple[np.ndarray, np.ndarray]:
        """Send this step's messages; return (s [n, d]: the sum of messages received, n-bar [n, d]
        per coordinate)."""
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
                arrived = self.delivered(round, layer, i, j)
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
    each
    row renormalized to sum to one (the lost mass is shared in proportion to the remaining weights,
    self included), so a worker never mixes in a stale or empty model."""
    n = W.shape[0]
    arrived = np.eye(n)
    for i in range(n):
        for j in range(n):
            if i != j and W[i, j] != 0 and delivered(round, tag, j, i):
                arrived[i, j] = 1.0
    kept = W * arrived
    return kept / kept.sum(axis=1, keepdims=True)


def sgp_round(Y: np.ndarray, k: int, round: int, delivered: Delivered) -> np.ndarray:
    """Communication round k of SGP (appendix Algorithm "SGP"): with o = 2^(k mod log2 n), worker i
    receives x_{i+o} and sets x_i <- (x_i + x_{i+o}) / 2; if that message is lost, x_i stays as it
    was."""
    n = Y.shape[0]
    o = 2 ** (k % (n.bit_length() - 1))
    out = Y.copy()
    for i in range(n):
        src = (i + o) % n
        if delivered(round, 0, src, i):
            out[i] = (Y[i] + Y[src]) / 2
    return out


def one_peer_mixing(name: str, n: int, t: int) -> np.ndarray:
    """W(t) of a one-peer topology, from docs/algorithms.md's definition: one-peer-exponential pairs
    i with i XOR 2^(t mod log2 n); alternating-ring pairs (2j, 2j+1) on even steps and (2j+1, 2j+2
    mod n) on odd steps; each pair averages at weights 1/2."""
    W = np.eye(n) / 2
    if name == "one-peer-exponential":
        hop = 2 ** (t % int(np.log2(n)))
        pairs = [(i, i + hop) for i in range(n) if not i & hop]
    else:
        pairs = [(i, (i + 1) % n) for i in range(t % 2, n, 2)]
    for i, j in pairs:
        W[i, j] = W[j, i] = 0.5
    return W


ONE_PEER = ("one-peer-exponential", "alternating-ring")


@dataclass
class LossyOracle:
    """x(t) -> x(t+1) for all workers at once, with the messages ``delivered`` says were lost."""

    algo: str
    topology: Any
    x0: np.ndarray  # [d]
    optimizer_config: OptimizerConfig
    delivered: Delivered
    relay_mode: str = "counts"
    d2_exact_diffusion: bool = False  # D² with (W + I) / 2, as the paper on the social network
    optimizer: MatrixOptimizer = field(init=False)

    def __post_init__(self) -> None:
        self.n, self.d = self.topology.world_size, self.x0.shape[0]
        self.optimizer = MatrixOptimizer(self.optimizer_config, (self.n, self.d))
        self.C = np.zeros((self.n, self.d))  # d2 / gt corrections c(t)
        self.M = np.zeros((self.n, self.d))  # qgm momentum buffer
        if self.algo in GOSSIP_ALGORITHMS:
            self.W = self.topology.mixing_matrix(0)
            if self.algo == "d2" and self.d2_exact_diffusion:
                self.W = (self.W + np.eye(self.n)) / 2
        if self.algo in RELAY_ALGORITHMS:
            self.relay = LossyRelaySum(self.topology, self.d, self.delivered)

    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        algo = self.algo
        if (
            algo == "allreduce"
        ):  # a collective: simulated loss applies to point-to-point messages only
            return X + self.optimizer.update(
                np.repeat(G.mean(axis=0, keepdims=True), self.n, axis=0), X, lr
            )
        if algo == "qgm":
            return self._qgm(X, G, lr, t)
        U = self.optimizer.update(G, X, lr)
        if algo in ("dpsgd", "d2", "gt"):
            W = lossy_mixing(self._w(t), round_id(t), self.delivered)
            if algo == "dpsgd":  # x(t+1) = W(t) x(t+1/2)
                return W @ (X + U)
            X_new = W @ (X + U + self.C)  # x(t+1/2) = x(t) + u + c, averaged (appendix D² / GT)
            # D²: c(t+1) = x(t+1) - x(t) - u(t); GT: c(t+1) = W(t) (c(t) + u(t)) - u(t), the same
            # W(t)
            # as the model, since both halves travel in one message
            self.C = X_new - X - U if algo == "d2" else W @ (self.C + U) - U
            return X_new
        if algo == "sgp":
            Y = X + U
            for r in range(
                2
            ):  # two communication rounds per gradient step, global counter k = 2t + r
                Y = sgp_round(Y, 2 * t + r, round_id(t, r), self.delivered)
            return Y
        if algo == "relay-grad":  # x(t+1) = x(t) + (u_i(t) + sum_j m_ji(t)) / n
            S, _ = self.relay.step(U, round_id(t))
            return X + (U + S) / self.n
        if algo == "relay":
            X_half = X + U
            S, nbar = self.relay.step(X_half, round_id(t))
            if self.relay_mode == "counts":  # Algorithm 1, line 10
                return (X_half + S) / nbar
            if (
                self.relay_mode == "previous"
            ):  # eq. robust-relaysum-model: missing models replaced by x_i(t)
                return (X_half + S + (self.n - nbar) * X) / self.n
            if self.relay_mode == "initial":  # missing models replaced by x(0)
                return (X_half + S + (self.n - nbar) * self.x0) / self.n
            raise ValueError(f"unknown relay mode {self.relay_mode!r}")
        raise ValueError(f"no lossy model for {algo!r}")

    def _w(self, t: int) -> np.ndarray:
        """The gossip matrix of step t: the graph's, or a one-peer topology's of that step."""
        if self.topology.name in ONE_PEER:
            return one_peer_mixing(self.topology.name, self.n, t)
        return self.W

    def _qgm(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        """Quasi-global momentum: a local step with m, lossy gossip, then m <- beta m + (1 -
        beta)(x(t) - x(t+1)) / lr."""
        c = self.optimizer_config
        beta = c.momentum
        G = G + c.weight_decay * X if c.weight_decay else G
        D = beta * self.M + G
        if c.nesterov:
            D = G + beta * D
        X_new = lossy_mixing(self._w(t), round_id(t), self.delivered) @ (X - lr * D)
        if lr > 0:
            self.M = beta * self.M + (1 - beta) * (X - X_new) / lr
        return X_new


class LossyMeanEstimator:
    """RelaySum for distributed mean estimation (appendix Algorithm "RelaySum for DME") with lost
    messages:
    y_i += d_i(t) + sum_j m_ji(t),  s_i += 1 + sum_j c_ji(t),  estimate y_i / s_i."""

    def __init__(self, topology: Any, d: int, delivered: Delivered):
        self.relay = LossyRelaySum(topology, d, delivered)
        self.total = np.zeros((topology.world_size, d))
        self.count = np.zeros((topology.world_size, d))

    def step(self, samples: np.ndarray, round: int) -> np.ndarray:
        S, nbar = self.relay.step(samples, round)
        self.total += samples + S
        self.count += nbar
        return self.total / self.count

"""Every algorithm of relaympi.algorithms vectorized over workers: all-reduce, gossip (D-PSGD, QGM, D², GT), SGP."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relaympi.algorithms import AlgorithmOptions, get_algorithm_class, round_id
from relaympi.algorithms.d2 import d2_mixing_matrix
from relaympi.algorithms.gossip import mixing_matrix_for
from relaympi.algorithms.sgp import ROUNDS as SGP_ROUNDS
from relaympi.batched.base import (
    BatchedAlgorithm,
    check_combination,
    delivered,
    never_drops,
    to_device,
)
from relaympi.batched.optim import BatchedOptimizer
from relaympi.batched.relay import BatchedRelaySGD, BatchedRelaySGDGrad
from relaympi.comm import DropPolicy
from relaympi.topology import ExponentialSchedule


def mix(weights: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> None:
    """out = weights @ X at full float32 precision: TF32 (which a model may switch on for speed)
    would round every model to a 10-bit mantissa in each average."""
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        torch.mm(weights, X, out=out)
    finally:
        if precision != "highest":
            torch.set_float32_matmul_precision(precision)


class GossipMatrix:
    """x_i <- W_ii x_i + sum_j W_ij x_j for all workers as one matmul with a dense W on the device.

    As relaympi.algorithms.gossip.GossipMixer: every worker sends its x to each topology
    neighbour (round ``round_id(step)``, tag 0); a lost message's weight is dropped and the
    receiver's remaining weights renormalized to sum to one.
    """

    def __init__(self, mixing: np.ndarray, topology: Any, like: torch.Tensor, drops: DropPolicy):
        n = mixing.shape[0]
        pairs = [(j, i) for i in range(n) for j in topology.neighbors(i)]  # j -> i, i's neighbours sorted
        self.src = np.array([p[0] for p in pairs], dtype=np.int64)
        self.dst = np.array([p[1] for p in pairs], dtype=np.int64)
        self.mixing = mixing
        self.drops = drops
        self._opts = {"dtype": like.dtype, "device": like.device}
        self._fixed = self._weights(np.ones(len(pairs), dtype=bool)) if never_drops(drops) else None

    def _weights(self, arrived: np.ndarray) -> torch.Tensor:
        """W with lost messages' weights dropped, each row divided by self weight + (0 + the kept
        weights in neighbour order): the divisor GossipMixer computes."""
        n, w = self.mixing.shape[0], self.mixing
        kept = np.zeros_like(w)
        kept[self.dst[arrived], self.src[arrived]] = w[self.dst[arrived], self.src[arrived]]
        others = np.zeros(n)
        for j in range(n):  # column by column: per row, the neighbours' weights in ascending order
            others += kept[:, j]
        total = np.diag(w) + others
        out = kept / total[:, None]
        np.fill_diagonal(out, np.diag(w) / total)
        return to_device(out, **self._opts)

    def weights(self, step: int, bytes_sent: np.ndarray, nbytes: int) -> torch.Tensor:
        """W(step) on the device, with this step's lost messages; counts ``nbytes`` per message sent."""
        if self._fixed is not None:
            bytes_sent[self.src, self.dst] += nbytes
            return self._fixed
        arrived = delivered(self.drops, round_id(step), 0, self.src, self.dst)
        bytes_sent[self.src[arrived], self.dst[arrived]] += nbytes
        return self._weights(arrived)


class BatchedAllReduce(BatchedAlgorithm):
    """Every worker applies the mean gradient (relaympi.algorithms.allreduce: a collective, never dropped,
    no bytes counted)."""

    name = "allreduce"

    def step(self, X: torch.Tensor, G: torch.Tensor, lr: float, step: int) -> None:
        G.copy_((G.sum(dim=0) / self.n).expand_as(G))  # in place, as comm.allreduce_mean(grad)
        self.optimizer.update(G, X, lr, apply=True)


class _GossipAlgorithm(BatchedAlgorithm):
    def __init__(self, topology, optimizer, X0, options, drops):
        super().__init__(topology, optimizer, X0, options, drops)
        self.gossip = GossipMatrix(self._mixing(topology, options), topology, X0, drops)
        self._mixed = torch.zeros_like(X0)

    def _mixing(self, topology: Any, options: AlgorithmOptions) -> np.ndarray:
        return mixing_matrix_for(topology)

    def _weights(self, step: int, width: int = 1) -> torch.Tensor:
        """This step's W; each message carries ``width`` models."""
        return self.gossip.weights(step, self.bytes_sent, width * self.numel * self.itemsize)


class BatchedDPSGD(_GossipAlgorithm):
    """X(t+1) = W (X(t) + U(t))."""

    name = "dpsgd"

    def step(self, X, G, lr, step):
        self.optimizer.update(G, X, lr, apply=True)
        mix(self._weights(step), X, self._mixed)
        X.copy_(self._mixed)


class BatchedQGM(_GossipAlgorithm):
    """Quasi-global momentum (relaympi.algorithms.qgm): a step along g + beta (beta m + g), gossip,
    then m <- beta m + (1 - beta) (x(t) - x(t+1)) / lr."""

    name = "qgm"

    def __init__(self, topology, optimizer, X0, options, drops):
        super().__init__(topology, optimizer, X0, options, drops)
        self.beta = optimizer.config.momentum
        self.momentum_buffer = torch.zeros_like(X0)
        self._x_before = torch.zeros_like(X0)

    def step(self, X, G, lr, step):
        cfg, beta, m, d = self.optimizer.config, self.beta, self.momentum_buffer, self._mixed
        g = G.add(X, alpha=cfg.weight_decay) if cfg.weight_decay else G
        torch.add(g, m, alpha=beta, out=d)  # beta m + g
        if cfg.nesterov:
            d.mul_(beta).add_(g)
        self._x_before.copy_(X)
        X.add_(d, alpha=-lr)
        mix(self._weights(step), X, d)
        X.copy_(d)
        if lr > 0:  # during a warm-up from lr = 0 the model did not move: keep m
            m.mul_(beta).add_(self._x_before.sub_(X), alpha=(1 - beta) / lr)

    def state_dict(self):
        return {"momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state):
        self.momentum_buffer.copy_(state["momentum_buffer"])


class BatchedD2(_GossipAlgorithm):
    """X(t+1/2) = X + U + C;  X(t+1) = W X(t+1/2);  C(t+1) = C + X(t+1) - X(t+1/2)."""

    name = "d2"

    def __init__(self, topology, optimizer, X0, options, drops):
        super().__init__(topology, optimizer, X0, options, drops)
        self.correction = torch.zeros_like(X0)

    def _mixing(self, topology, options):
        return d2_mixing_matrix(topology, options.d2_exact_diffusion, options.d2_force)

    def step(self, X, G, lr, step):
        self.optimizer.update(G, X, lr, apply=True)
        X.add_(self.correction)
        mix(self._weights(step), X, self._mixed)
        self.correction.add_(self._mixed).sub_(X)
        X.copy_(self._mixed)

    def state_dict(self):
        return {"correction": self.correction}

    def load_state_dict(self, state):
        self.correction.copy_(state["correction"])


class BatchedGT(_GossipAlgorithm):
    """X(t+1) = W (X + U + C),  C(t+1) = W (C + U) - U, with one W(t) for both (one packed message of 2 d)."""

    name = "gt"

    def __init__(self, topology, optimizer, X0, options, drops):
        super().__init__(topology, optimizer, X0, options, drops)
        self.correction = torch.zeros_like(X0)

    def step(self, X, G, lr, step):
        u, c, scratch = self.optimizer.update(G, X, lr, apply=False), self.correction, self._mixed
        weights = self._weights(step, width=2)  # both halves travel in one message: one W(t)
        torch.add(X, u, out=scratch).add_(c)
        mix(weights, scratch, X)
        torch.add(c, u, out=scratch)
        mix(weights, scratch, c)
        c.sub_(u)

    def state_dict(self):
        return {"correction": self.correction}

    def load_state_dict(self, state):
        self.correction.copy_(state["correction"])


class BatchedSGP(BatchedAlgorithm):
    """Two rounds per step on the exponential schedule: worker i averages with i + 2^(t' mod log2 n)
    (round round_id(step, r), tag 0); a lost message leaves the receiver's model as it was."""

    name = "sgp"

    def __init__(self, topology, optimizer, X0, options, drops):
        super().__init__(topology, optimizer, X0, options, drops)
        self.schedule = ExponentialSchedule(self.n)
        self._received = torch.zeros_like(X0)
        self._ranks = np.arange(self.n)
        self._senders: dict[int, tuple[np.ndarray, torch.Tensor]] = {}  # per hop length, on host and device

    def _receives_from(self, round: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
        """Whom each worker receives from in communication round ``round`` (the schedule's recv_peer)."""
        hop = self.schedule.offset(round)
        if hop not in self._senders:
            peers = np.array([self.schedule.recv_peer(round, i) for i in range(self.n)], dtype=np.int64)
            self._senders[hop] = (peers, torch.as_tensor(peers, device=device))
        return self._senders[hop]

    def step(self, X, G, lr, step):
        self.optimizer.update(G, X, lr, apply=True)
        ranks, nbytes = self._ranks, self.numel * self.itemsize
        for r in range(SGP_ROUNDS):
            frm, frm_on_device = self._receives_from(SGP_ROUNDS * step + r, X.device)
            arrived = delivered(self.drops, round_id(step, r), 0, frm, ranks)
            self.bytes_sent[frm[arrived], ranks[arrived]] += nbytes
            torch.index_select(X, 0, frm_on_device, out=self._received)
            self._received.add_(X).mul_(0.5)
            if arrived.all():
                X.copy_(self._received)
            elif arrived.any():
                rows = to_device(ranks[arrived], None, X.device)
                X.index_copy_(0, rows, self._received.index_select(0, rows))


BATCHED_ALGORITHMS: dict[str, type[BatchedAlgorithm]] = {
    cls.name: cls
    for cls in (BatchedAllReduce, BatchedDPSGD, BatchedQGM, BatchedD2, BatchedGT, BatchedSGP, BatchedRelaySGD, BatchedRelaySGDGrad)
}


def make_batched_algorithm(
    algo: str, topology: Any, optimizer: BatchedOptimizer, X0: torch.Tensor, options: AlgorithmOptions | None = None,
    drops: DropPolicy | None = None,
) -> BatchedAlgorithm:
    """The batched form of ``algo`` for the workers of X0 [N, numel]; refuses what make_algorithm refuses."""
    get_algorithm_class(algo)  # an unknown name: the same AlgorithmError
    options = options or AlgorithmOptions()
    check_combination(algo, topology, optimizer, X0, options)
    return BATCHED_ALGORITHMS[algo](topology, optimizer, X0, options, drops or DropPolicy())

"""Gossip averaging with a fixed mixing matrix W over the topology's neighbours (with drop renormalization)."""

from __future__ import annotations

import numpy as np
import torch

from relaympi.comm import Communicator
from relaympi.topology import Topology


class GossipMixer:
    """x_i <- W_ii x_i + sum_j W_ij x_j over neighbours j.

    A lost message's weight is dropped and the remaining weights are renormalized to sum
    to one, so a worker never mixes in stale or empty models.
    """

    def __init__(self, comm: Communicator, mixing: np.ndarray, neighbors: tuple[int, ...], numel: int, like: torch.Tensor):
        self.comm = comm
        self.neighbors = tuple(sorted(neighbors))
        self.self_weight = float(mixing[comm.rank, comm.rank])
        self.weights = {j: float(mixing[comm.rank, j]) for j in self.neighbors}
        self.received = {j: torch.empty(numel, dtype=like.dtype, device=like.device) for j in self.neighbors}

    def mix(self, x: torch.Tensor, round: int, tag: int = 0) -> None:
        """In place: x <- the weighted average of x and the neighbours' x."""
        request = self.comm.exchange({j: x for j in self.neighbors}, self.received, tag=tag, round=round)
        delivered = request.wait()
        total = self.self_weight + sum(self.weights[j] for j in delivered)
        x.mul_(self.self_weight / total)
        for j in self.neighbors:  # sorted: the same summation order on every backend
            if j in delivered:
                x.add_(self.received[j], alpha=self.weights[j] / total)


def mixing_matrix_for(topology: Topology) -> np.ndarray:
    if topology.num_layers != 1:
        raise ValueError(f"gossip needs a single-graph topology, {topology.name!r} has {topology.num_layers} layers")
    return topology.mixing_matrix(0)

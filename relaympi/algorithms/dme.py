"""RelaySum for distributed mean estimation (paper appendix Algorithm "RelaySum for Distributed Mean
Estimation")."""

from __future__ import annotations

import torch

from relaympi.algorithms.relaysum import RelaySum
from relaympi.comm import Communicator
from relaympi.topology import Topology


class RelaySumMeanEstimator:
    """Each step a worker adds its new sample; its estimate is the uniform average of every
    sample that has reached it so far (y / s), with variance O(1/(n T))."""

    def __init__(self, comm: Communicator, topology: Topology, like: torch.Tensor):
        self.relay = RelaySum(comm, topology, like.numel(), like)
        self.total = torch.zeros_like(like)  # y: sum of samples received
        self.count = 0.0  # s: number of samples in y (per layer identical for one layer)
        if topology.num_layers != 1:
            raise ValueError("mean estimation is defined on a single tree")

    def step(self, sample: torch.Tensor, round: int) -> torch.Tensor:
        self.relay.exchange(sample, round)
        self.total.add_(sample)
        self.relay.add_received(self.total)
        self.count += self.relay.counts()[0]
        return self.total / self.count

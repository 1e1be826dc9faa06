"""All-reduce (centralized) baseline: average gradients over all workers, then the local optimizer."""

from __future__ import annotations

import torch

from relaympi.algorithms.base import Algorithm


class AllReduce(Algorithm):
    """Synchronous data-parallel SGD: every worker applies the same averaged gradient, so all
    models stay identical (momentum/Adam then act on the global gradient, as centralized training).

    The all-reduce is a collective: simulated message loss (--drop-prob) does not apply to it."""

    name = "allreduce"
    default_topology = "fully-connected"

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.comm.allreduce_mean(grad)
        self.optimizer.update(grad, x, lr, apply=True)

"""Every algorithm of relaympi.algorithms over all workers at once: each algorithm's own class
stepping
X [N, d], communicating through BatchedMixers (gossip as W products, RelaySum as
BatchedRelaySum)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from relaympi.algorithms import (
    ALGORITHMS,
    Algorithm,
    Options,
    algorithm_options,
    check_combination,
    check_topology_fits_world,
)
from relaympi.batched.base import BatchedAlgorithm
from relaympi.batched.mixer import BatchedMixers
from relaympi.batched.optim import BatchedOptimizer
from relaympi.comm import DropPolicy


class StackedAlgorithm(BatchedAlgorithm):
    """``algorithm``'s own step and state on the stacked X: its communication goes through
    BatchedMixers (W products, RelaySum for all workers; the same drop decisions, bytes counted)."""

    algorithm: ClassVar[type[Algorithm]]

    def __init__(
        self,
        topology: Any,
        optimizer: BatchedOptimizer,
        X0: torch.Tensor,
        options: Options,
        drops: DropPolicy,
        nodes: Sequence[int] | None = None,
    ):
        super().__init__(topology, optimizer, X0, options, drops, nodes)
        mixers = BatchedMixers(drops, self.bytes_sent, self.nodes)
        self.stacked = self.algorithm(None, topology, optimizer, X0, options, mixers)

    def step(self, X: torch.Tensor, G: torch.Tensor, lr: float, step: int) -> None:
        self.stacked.step(X, G, lr, step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.stacked.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.stacked.load_state_dict(state)


def _stacked(cls: type[Algorithm]) -> type[BatchedAlgorithm]:
    return type(
        f"Batched{cls.__name__}",
        (StackedAlgorithm,),
        {"name": cls.name, "algorithm": cls, "__module__": __name__},
    )


BATCHED_ALGORITHMS: dict[str, type[BatchedAlgorithm]] = {
    name: _stacked(cls) for name, cls in ALGORITHMS.items()
}


def make_batched_algorithm(
    algo: str,
    topology: Any,
    optimizer: BatchedOptimizer,
    X0: torch.Tensor,
    options: Options | None = None,
    drops: DropPolicy | None = None,
    nodes: Sequence[int] | None = None,
) -> BatchedAlgorithm:
    """The batched form of ``algo`` for the workers of X0 [N, numel]; refuses what make_algorithm
    refuses."""
    options = algorithm_options(algo, options)  # its own (make_algorithm's)
    check_topology_fits_world(topology, X0.shape[0])
    # make_algorithm's refusals, with its messages
    check_combination(algo, topology, optimizer.config, options)
    return BATCHED_ALGORITHMS[algo](topology, optimizer, X0, options, drops or DropPolicy(), nodes)

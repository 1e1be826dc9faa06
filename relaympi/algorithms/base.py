"""The Algorithm interface: explicit state and one step over a Communicator; no training loop inside."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from relaympi.comm import Communicator
from relaympi.optim import LocalOptimizer

# communication rounds reserved per gradient step, so (step, sub-round) -> a unique round id
ROUNDS_PER_STEP = 4


def round_id(step: int, sub: int = 0) -> int:
    """The communication-round number of sub-round ``sub`` of gradient step ``step`` (for drops)."""
    return step * ROUNDS_PER_STEP + sub


class AlgorithmError(ValueError):
    """An invalid algorithm/topology/optimizer combination; the message names the allowed choices."""


@dataclass(frozen=True)
class AlgorithmOptions:
    relay_mode: str = "counts"  # relay: counts | previous | initial
    relay_in_place: bool = False  # RelaySum: assemble and swap messages in the receive buffers (least memory)
    relay_chunk: int | None = None  # RelaySum: elements per message chunk (None: relaysum.DEFAULT_CHUNK)
    d2_force: bool = False  # run D² even if the gossip matrix's smallest eigenvalue is < -1/3
    d2_exact_diffusion: bool = False  # D² with (W + I) / 2 (the paper's choice on the social network)


class Algorithm(ABC):
    """One decentralized optimizer. ``step`` turns every worker's x(t) into x(t+1) in place.

    The local optimizer turns the gradient into the local update u(t) (x(t+1/2) = x(t) + u(t));
    the algorithm decides what is communicated and how models are combined.
    """

    name: ClassVar[str]
    default_topology: ClassVar[str]

    def __init__(self, comm: Communicator, topology: Any, optimizer: LocalOptimizer, x0: torch.Tensor, options: AlgorithmOptions):
        self.comm = comm
        self.topology = topology
        self.optimizer = optimizer
        self.options = options
        self.numel = x0.numel()

    @abstractmethod
    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """x(t) -> x(t+1) in place, given this worker's gradient at x(t)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything besides x needed to resume exactly (in-flight messages, counters, corrections)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless algorithms keep the default
        pass

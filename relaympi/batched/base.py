"""The batched algorithm interface, and the simulated-drop decisions of message passing as masks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from relaympi.algorithms import Options
from relaympi.batched.optim import BatchedOptimizer
from relaympi.comm import DropPolicy
from relaympi.comm.base import checked_nodes


def never_drops(drops: DropPolicy) -> bool:
    """Whether ``drops`` loses no message at all (then no decision needs to be asked)."""
    return type(drops).dropped is DropPolicy.dropped and drops.prob == 0.0 and not drops.replayed


def delivered(
    drops: DropPolicy, round: int, tag: int, src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per message src[e] -> dst[e] of this round and tag: was it sent, and did it arrive? (the
    same DropPolicy decisions as Communicator.exchange asks, so exactly the messages lost on the
    other backends are lost here; a replayed late drop was sent, and its bytes count, but did not
    arrive)

    Args:
        drops: the run's simulated and replayed losses.
        round: the communication round.
        tag: the messages' tag.
        src: each message's sender.
        dst: each message's receiver.

    Returns:
        (sent, arrived), bool per message.
    """
    if never_drops(drops):
        return np.ones(len(src), dtype=bool), np.ones(len(src), dtype=bool)
    pairs = list(zip(src.tolist(), dst.tolist(), strict=True))
    sent = np.array([not drops.dropped(round, tag, s, d) for s, d in pairs], dtype=bool)
    if not drops.replayed:
        return sent, sent
    late = np.array([drops.late(round, tag, s, d) for s, d in pairs], dtype=bool)
    return sent, sent & ~late


def to_device(
    values: np.ndarray | torch.Tensor, dtype: torch.dtype | None, device: torch.device
) -> torch.Tensor:
    """A host array or tensor (this step's weights, lost edges, counts, batch indices) on the device
    without waiting for it: a plain copy to a GPU synchronizes the stream, so the host could no
    longer run ahead."""
    # already on a device (a task that batches there)
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device=device, dtype=dtype)
    host = torch.as_tensor(
        values if isinstance(values, torch.Tensor) else np.ascontiguousarray(values), dtype=dtype
    )
    if device.type != "cuda":
        return host.to(device)
    # the caching host allocator keeps it until copied
    return host.pin_memory().to(device, non_blocking=True)


class BatchedAlgorithm:
    """One decentralized optimizer for all N workers at once: ``step`` turns X(t) [N, d] into X(t+1)
    in place.

    ``bytes_sent[i, j]``: bytes worker i's messages to worker j would have carried under message
    passing (row i is rank i's Communicator.bytes_sent; lost messages are not counted, the
    fixed-tree all-reduce's are, as there). ``nodes``: each worker's node (None: one node), which
    orders the all-reduce's tree as the message-passing ranks order it.
    """

    name: ClassVar[str]

    def __init__(
        self,
        topology: Any,
        optimizer: BatchedOptimizer,
        X0: torch.Tensor,
        options: Options,
        drops: DropPolicy,
        nodes: Sequence[int] | None = None,
    ):
        if X0.dim() != 2:
            raise ValueError(f"X0 must be [workers, numel], got shape {tuple(X0.shape)}")
        self.topology = topology
        self.optimizer = optimizer
        self.options = options
        self.drops = drops
        self.n, self.numel = X0.shape
        self.itemsize = X0.element_size()
        self.bytes_sent = np.zeros((self.n, self.n), dtype=np.int64)
        self.nodes = checked_nodes(nodes, self.n)

    def step(self, X: torch.Tensor, G: torch.Tensor, lr: float, step: int) -> None:
        """X(t) -> X(t+1) in place, given every worker's gradient G at X(t)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Everything besides X and the optimizer needed to resume exactly (tensors only; live
        buffers, as Algorithm.state_dict: save or clone them before the next step)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass

"""Gossip averaging with a mixing matrix W (with drop renormalization), and the injectable Mixers every algorithm communicates through."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from relaympi.algorithms.relays import Relays
from relaympi.algorithms.relaysum import DEFAULT_CHUNK, RelaySum
from relaympi.comm import Communicator, Request
from relaympi.topology import Topology


class Started(Protocol):
    """Communication started by a mixer; ``finish`` completes it (receives, then the combination)."""

    def finish(self) -> None: ...


class Mixer(Protocol):
    def mix(self, x: torch.Tensor, round: int, tag: int = 0) -> None:
        """In place: x <- W x over this mixer's matrix, in communication round ``round``."""

    def start(self, x: torch.Tensor, lo: int, hi: int, round: int, tag: int = 0, chunk: int = 0) -> Started:
        """Start mixing coordinates [lo, hi) of x (the last dimension): its sends leave now, and
        ``finish()`` sets them to W x. The ranges of one round, started in the same order on every
        worker (``chunk`` = 0, 1, ...), give mix's bits: the weights are the same for every coordinate."""


class Mixers(Protocol):
    """What every algorithm communicates through: CommMixers here (one worker's x), relaympi.batched.mixer.BatchedMixers
    in the batched engine (every worker's x as the rows of X). Gossip, SGP and all-reduce mix; RelaySGD and
    RelaySGD/Grad relay (relays.Relays)."""

    def gossip(self, mixing: np.ndarray, like: torch.Tensor) -> Mixer:
        """A mixer averaging tensors shaped as ``like`` with W = ``mixing``: worker i receives from
        every j != i with W_ij != 0 (the topology's neighbours for a gossip matrix)."""

    def allreduce_mean(self, x: torch.Tensor) -> None:
        """In place: x <- the mean of x over all workers (a collective: never dropped, no bytes counted)."""

    def start_allreduce_mean(self, x: torch.Tensor) -> Started:
        """allreduce_mean, started now and complete after ``finish()``; pieces of a buffer started
        separately (in the same order on every worker) give the whole buffer's bits."""

    def relays(self, topology: Topology, like: torch.Tensor, in_place: bool = False, chunk: int | None = None) -> Relays:
        """RelaySum over ``topology``'s trees for parcels shaped as ``like``; ``in_place`` and ``chunk``
        (None: relaysum.DEFAULT_CHUNK) choose message passing's buffers, not the numbers."""


class GossipMixer:
    """x_i <- W_ii x_i + sum_j W_ij x_j over neighbours j.

    A lost message's weight is dropped and the remaining weights are renormalized to sum
    to one, so a worker never mixes in stale or empty models. x goes to ``send_to``
    (default: the neighbours).
    """

    def __init__(
        self, comm: Communicator, mixing: np.ndarray, neighbors: tuple[int, ...], numel: int, like: torch.Tensor,
        send_to: tuple[int, ...] | None = None, received: dict[int, torch.Tensor] | None = None,
    ):
        self.comm = comm
        self.neighbors = tuple(sorted(neighbors))
        self.send_to = self.neighbors if send_to is None else tuple(sorted(send_to))
        self.self_weight = float(mixing[comm.rank, comm.rank])
        self.weights = {j: float(mixing[comm.rank, j]) for j in self.neighbors}
        if received is None:
            received = {j: torch.empty(numel, dtype=like.dtype, device=like.device) for j in self.neighbors}
        self.received = received

    def mix(self, x: torch.Tensor, round: int, tag: int = 0) -> None:
        """In place: x <- the weighted average of x and the neighbours' x."""
        self.start(x, 0, x.numel(), round, tag).finish()

    def start(self, x: torch.Tensor, lo: int, hi: int, round: int, tag: int = 0, chunk: int = 0) -> _MixingRange:
        """Send x[lo:hi] and post the receives of the neighbours' [lo:hi]; finish() averages them in."""
        part = x[lo:hi]
        request = self.comm.exchange(
            {j: part for j in self.send_to}, {j: self.received[j][lo:hi] for j in self.neighbors}, tag=tag, round=round, chunk=chunk,
        )
        return _MixingRange(self, part, lo, hi, request)


class _MixingRange:
    """One range of a GossipMixer round in flight (x's range is not touched until finish)."""

    def __init__(self, mixer: GossipMixer, part: torch.Tensor, lo: int, hi: int, request: Request):
        self.mixer, self.part, self.lo, self.hi, self.request = mixer, part, lo, hi, request

    def finish(self) -> None:
        """x[lo:hi] <- the weighted average, renormalized over the messages that arrived (a lost
        message is lost for every range of its round: drops ignore the range)."""
        mixer, part = self.mixer, self.part
        delivered = self.request.wait()
        total = mixer.self_weight + sum(mixer.weights[j] for j in delivered)
        part.mul_(mixer.self_weight / total)
        for j in mixer.neighbors:  # sorted: the same summation order on every backend
            if j in delivered:
                part.add_(mixer.received[j][self.lo : self.hi], alpha=mixer.weights[j] / total)


class _AllreduceMean:
    def __init__(self, comm: Communicator, x: torch.Tensor):
        self.comm, self.x, self.request = comm, x, comm.iallreduce_sum(x)

    def finish(self) -> None:
        self.request.wait()
        if self.comm.world_size > 1:
            self.x /= self.comm.world_size


class CommMixers:
    """Mixers over one worker's Communicator. Mixers of the same size share receive buffers
    (an algorithm's mixers take turns: SGP's one per hop length needs one buffer, not one per hop)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}  # (k-th neighbour, numel) -> buffer

    def gossip(self, mixing: np.ndarray, like: torch.Tensor) -> GossipMixer:
        rank, numel = self.comm.rank, like.numel()
        receive = tuple(int(j) for j in np.flatnonzero(mixing[rank]) if j != rank)
        send = tuple(int(j) for j in np.flatnonzero(mixing[:, rank]) if j != rank)
        received = {}
        for k, j in enumerate(receive):
            if (k, numel) not in self._buffers:
                self._buffers[k, numel] = torch.empty(numel, dtype=like.dtype, device=like.device)
            received[j] = self._buffers[k, numel]
        return GossipMixer(self.comm, mixing, receive, numel, like, send_to=send, received=received)

    def allreduce_mean(self, x: torch.Tensor) -> None:
        self.comm.allreduce_mean(x)

    def start_allreduce_mean(self, x: torch.Tensor) -> _AllreduceMean:
        return _AllreduceMean(self.comm, x)

    def relays(self, topology: Topology, like: torch.Tensor, in_place: bool = False, chunk: int | None = None) -> RelaySum:
        return RelaySum(self.comm, topology, like.numel(), like, in_place=in_place, chunk=chunk or DEFAULT_CHUNK)


def mixing_matrix_for(topology: Topology) -> np.ndarray:
    if topology.num_layers != 1:
        raise ValueError(f"gossip needs a single-graph topology, {topology.name!r} has {topology.num_layers} layers")
    return topology.mixing_matrix(0)

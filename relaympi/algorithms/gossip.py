"""Gossip averaging with a mixing matrix W (with drop renormalization), and the injectable Mixers
every algorithm communicates through."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from relaympi.algorithms.relays import Relays
from relaympi.algorithms.relaysum import DEFAULT_CHUNK, RelaySum
from relaympi.comm import Communicator, Request
from relaympi.topology import Topology, one_peer_schedule


class Started(Protocol):
    """Communication started by a mixer; ``finish`` completes it (receives, then the
    combination)."""

    def test(self) -> bool:
        """Advance it without blocking; whether finish() would not wait."""

    def finish(self) -> None: ...


# Elements per piece of a gossip message: averaging piece p in overlaps the transfer of the pieces
# after it (the same size as RelaySum's chunks, relaysum.DEFAULT_CHUNK); a range has at most
# PIECES_PER_RANGE pieces (its chunk numbers for the transport's staging buffers)
PIECE = 1 << 20
PIECES_PER_RANGE = 1 << 12


class Mixer(Protocol):
    def mix(self, x: torch.Tensor, round: int, tag: int = 0) -> None:
        """In place: x <- W x over this mixer's matrix, in communication round ``round``."""

    def start(
        self, x: torch.Tensor, lo: int, hi: int, round: int, tag: int = 0, chunk: int = 0
    ) -> Started:
        """Start mixing coordinates [lo, hi) of x (the last dimension): its sends leave now, and
        ``finish()`` sets them to W x. The ranges of one round, started in the same order on every
        worker (``chunk`` = 0, 1, ...), give mix's bits: the weights are the same for every
        coordinate."""


class Mixers(Protocol):
    """What every algorithm communicates through: CommMixers here (one worker's x),
    relaympi.batched.mixer.BatchedMixers
    in the batched engine (every worker's x as the rows of X). Gossip, SGP and all-reduce mix;
    RelaySGD and
    RelaySGD/Grad relay (relays.Relays)."""

    def gossip(self, mixing: np.ndarray, like: torch.Tensor) -> Mixer:
        """A mixer averaging tensors shaped as ``like`` with W = ``mixing``: worker i receives from
        every j != i with W_ij != 0 (the topology's neighbours for a gossip matrix)."""

    def allreduce_mean(self, x: torch.Tensor) -> None:
        """In place: x <- the mean of x over all workers (a collective: never dropped; on MPI the
        library's own all-reduce, whose bytes are not counted)."""

    def start_allreduce_mean(self, x: torch.Tensor) -> Started:
        """allreduce_mean, started now and complete after ``finish()``; pieces of a buffer started
        separately (in the same order on every worker) give the whole buffer's bits. Never dropped;
        its messages (the fixed-tree all-reduce's) are counted in bytes_sent on every engine."""

    def relays(
        self,
        topology: Topology,
        like: torch.Tensor,
        in_place: bool = False,
        chunk: int | None = None,
    ) -> Relays:
        """RelaySum over ``topology``'s trees for parcels shaped as ``like``; ``in_place`` and
        ``chunk``
        (None: relaysum.DEFAULT_CHUNK) choose message passing's buffers, not the numbers."""


class GossipMixer:
    """x_i <- W_ii x_i + sum_j W_ij x_j over neighbours j.

    A lost message's weight is dropped and the remaining weights are renormalized to sum
    to one, so a worker never mixes in stale or empty models. x goes to ``send_to``
    (default: the neighbours).
    """

    def __init__(
        self,
        comm: Communicator,
        mixing: np.ndarray,
        neighbors: tuple[int, ...],
        numel: int,
        like: torch.Tensor,
        send_to: tuple[int, ...] | None = None,
        received: dict[int, torch.Tensor] | None = None,
    ):
        self.comm = comm
        self.neighbors = tuple(sorted(neighbors))
        self.send_to = self.neighbors if send_to is None else tuple(sorted(send_to))
        self.self_weight = float(mixing[comm.rank, comm.rank])
        self.weights = {j: float(mixing[comm.rank, j]) for j in self.neighbors}
        if received is None:
            received = {
                j: torch.empty(numel, dtype=like.dtype, device=like.device) for j in self.neighbors
            }
        self.received = received

    def mix(self, x: torch.Tensor, round: int, tag: int = 0) -> None:
        """In place: x <- the weighted average of x and the neighbours' x."""
        self.start(x, 0, x.numel(), round, tag).finish()

    def start(
        self, x: torch.Tensor, lo: int, hi: int, round: int, tag: int = 0, chunk: int = 0
    ) -> _MixingRange:
        """Send x[lo:hi] and post the receives of the neighbours' [lo:hi]; finish() averages them
        in.

        The range travels in pieces of at most ``PIECE`` elements, all posted now (in the same order
        on both ends), so that finish() averages each piece in as it lands while the later ones are
        still on the wire: the averaging is elementwise, so the pieces change no bit."""
        part = x[lo:hi]
        requests = []
        # under a deadline a message is late or on time as a whole: one piece
        piece = PIECE if self.comm.deadline is None else max(hi - lo, 1)
        for i, start in enumerate(range(lo, max(hi, lo + 1), piece)):
            end = min(start + piece, hi)
            requests.append(
                self.comm.exchange(
                    {j: x[start:end] for j in self.send_to},
                    {j: self.received[j][start:end] for j in self.neighbors},
                    tag=tag,
                    round=round,
                    chunk=chunk * PIECES_PER_RANGE + i,
                )
            )
        return _MixingRange(self, part, lo, hi, requests)

    def _combine(
        self,
        part: torch.Tensor,
        lo: int,
        hi: int,
        delivered: frozenset[int],
        pending: Request | None = None,
    ) -> None:
        """x[lo:hi] (``part``) <- the weighted average, renormalized over the messages that arrived
        (a
        lost message is lost for every range of its round: drops ignore the range). Between the
        passes, ``pending.test()`` lets the transport move the next piece (MPI copies only inside
        calls)."""
        total = self.self_weight + sum(self.weights[j] for j in delivered)
        part.mul_(self.self_weight / total)
        for j in self.neighbors:  # sorted: the same summation order on every backend
            if pending is not None:
                pending.test()
            if j in delivered:
                part.add_(self.received[j][lo:hi], alpha=self.weights[j] / total)


class _MixingRange:
    """One range of a GossipMixer round in flight, as pieces (x's range is not touched until
    finish)."""

    def __init__(
        self, mixer: GossipMixer, part: torch.Tensor, lo: int, hi: int, requests: list[Request]
    ):
        self.mixer, self.part, self.lo, self.hi, self.requests = mixer, part, lo, hi, requests

    def test(self) -> bool:
        return all([request.test() for request in self.requests])

    def finish(self) -> None:
        """Average each piece in as it lands, in posting order."""
        for i, request in enumerate(self.requests):
            delivered = request.wait()  # every piece of a message is dropped or delivered with it
            piece = PIECE if self.mixer.comm.deadline is None else max(self.hi - self.lo, 1)
            lo = self.lo + i * piece
            hi = min(lo + piece, self.hi)
            following = self.requests[i + 1] if i + 1 < len(self.requests) else None
            self.mixer._combine(
                self.part[lo - self.lo : hi - self.lo], lo, hi, delivered, following
            )


class _AllreduceMean:
    def __init__(self, comm: Communicator, x: torch.Tensor):
        self.comm, self.x, self.request = comm, x, comm.iallreduce_sum(x)

    def test(self) -> bool:
        return self.request.test()

    def finish(self) -> None:
        self.request.wait()
        if self.comm.world_size > 1:
            self.x /= self.comm.world_size


class CommMixers:
    """Mixers over one worker's Communicator. Mixers of the same size share receive buffers
    (an algorithm's mixers take turns: SGP's one per hop length needs one buffer, not one per
    hop)."""

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

    def relays(
        self,
        topology: Topology,
        like: torch.Tensor,
        in_place: bool = False,
        chunk: int | None = None,
    ) -> RelaySum:
        if self.comm.deadline is not None:  # a message is late or on time as a whole: one chunk
            chunk = like.numel() + 1
        return RelaySum(
            self.comm, topology, like.numel(), like, in_place=in_place, chunk=chunk or DEFAULT_CHUNK
        )


def mixing_matrix_for(topology: Topology) -> np.ndarray:
    """The one fixed gossip matrix of a single-graph topology (its Metropolis-Hastings weights).

    Args:
        topology: a single-layer topology whose gossip matrix does not change with the step.

    Returns:
        W, [n, n].

    Raises:
        ValueError: several layers, or a time-varying one-peer topology (``gossip_matrices``).
    """
    if one_peer_schedule(topology.name, topology.world_size) is not None:
        raise ValueError(
            f"{topology.name!r} changes its gossip matrix every step: use gossip_matrices"
        )
    if topology.num_layers != 1:
        raise ValueError(
            f"gossip needs a single-graph topology, {topology.name!r} has "
            f"{topology.num_layers} layers"
        )
    return topology.mixing_matrix(0)


def gossip_matrices(topology: Topology) -> list[np.ndarray]:
    """The gossip matrix of each step of the topology's period: W(t) is entry t mod len.

    A fixed graph has one (its Metropolis-Hastings weights); a one-peer topology
    (``one-peer-exponential``, ``alternating-ring``) one per round of its schedule, each pairing
    every rank with one peer at weights 1/2.

    Args:
        topology: a single-layer topology.

    Returns:
        The matrices [n, n] of one period, in step order.
    """
    schedule = one_peer_schedule(topology.name, topology.world_size)
    if schedule is None:
        return [mixing_matrix_for(topology)]
    return [schedule.mixing_matrix(k) for k in range(schedule.period)]

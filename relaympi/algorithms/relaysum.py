"""RelaySum (paper Algorithm 1): per-edge relayed messages with counters, on one or more spanning trees."""

from __future__ import annotations

from typing import Any

import torch

from relaympi.comm import Communicator, Request

# Messages carry their counter in the last element of the same buffer as the payload:
# one message per edge and step, so no transport may reorder a counter against its payload.


class RelaySum:
    """Delivers to each worker the sum of every worker's delayed parcel, and how many parcels it holds.

    Parcel p_j(t) of worker j reaches worker i in step t + tau_ij - 1 (Algorithm 1's timing:
    neighbours' parcels arrive in the same step). Each step, worker i sends to each tree
    neighbour j the message  m_ij(t) = p_i(t) + sum_{k in N(i)\\{j}} m_ki(t-1)  with the
    counter  c_ij(t) = 1 + sum_{k in N(i)\\{j}} c_ki(t-1),  keeping only the last message
    received from each neighbour.

    Memory: the state is one buffer per neighbour (the last message received); a node of
    degree >= 3 adds one scratch sum. Outgoing messages need room too, in one of two ways:

    - ``in_place=False`` (default, fastest): one send buffer per neighbour, reused every step,
      so sends and receives run full duplex with no copy beyond assembling the messages;
    - ``in_place=True`` (leanest): messages are assembled in the receive buffers themselves and
      swapped with Communicator.exchange_replace (MPI_Isendrecv_replace, whose MPI library
      allocates a transient buffer per call). On a chain the state is then 2 model copies, on
      double binary trees (layer k relays coordinates k, k+L, ...) at most 2.5.

    Either way every rank moves at most the equivalent of two models per step on double binary
    trees. A dropped message counts as an empty one (payload 0, counter 0): the counters then
    say exactly how many parcels a sum holds.
    """

    def __init__(self, comm: Communicator, topology: Any, numel: int, like: torch.Tensor, in_place: bool = False):
        if not topology.is_tree:
            raise ValueError(f"RelaySum needs a tree topology (every layer a spanning tree); {topology.name!r} is not")
        if topology.world_size != comm.world_size:
            raise ValueError(f"topology is for {topology.world_size} workers but the world has {comm.world_size}")
        self.comm = comm
        self.num_layers = topology.num_layers
        self.numel = numel
        self.neighbors = [topology.neighbors(comm.rank, layer) for layer in range(self.num_layers)]
        self.sizes = [len(range(k, numel, self.num_layers)) for k in range(self.num_layers)]
        opts = {"dtype": like.dtype, "device": like.device}
        # last message received from each neighbour, [payload..., counter]
        self.received = [{j: torch.zeros(size + 1, **opts) for j in nbrs} for size, nbrs in zip(self.sizes, self.neighbors, strict=True)]
        self._scratch = [torch.zeros(size + 1, **opts) if len(nbrs) >= 3 else None for size, nbrs in zip(self.sizes, self.neighbors, strict=True)]
        self.in_place = in_place
        self._outgoing = None if in_place else [
            {j: torch.zeros(size + 1, **opts) for j in nbrs} for size, nbrs in zip(self.sizes, self.neighbors, strict=True)
        ]
        self._in_flight: list[tuple[int, dict[int, torch.Tensor], Request]] = []

    def _coords(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        return flat if self.num_layers == 1 else flat[layer :: self.num_layers]

    def _assemble(self, p: torch.Tensor, layer: int) -> dict[int, torch.Tensor]:
        """This step's outgoing messages (peer -> buffer): in the send buffers, or in place in the receive buffers."""
        received, nbrs = self.received[layer], self.neighbors[layer]
        out = self._outgoing[layer] if self._outgoing is not None else None
        if len(nbrs) == 1:  # a leaf relays nothing: m = [p, 1]
            (j,) = nbrs
            target = received[j] if out is None else out[j]
            target[:-1].copy_(p)
            target[-1] = 1.0
            return {j: target}
        if len(nbrs) == 2:  # m_ia = [p, 1] + m_bi
            a, b = nbrs
            if out is None:  # add the parcel into b's buffer and send that one to a
                for buf in (received[a], received[b]):
                    buf[:-1].add_(p)
                    buf[-1] += 1.0
                return {a: received[b], b: received[a]}
            for j, k in ((a, b), (b, a)):
                torch.add(received[k][:-1], p, out=out[j][:-1])
                out[j][-1] = received[k][-1] + 1.0
            return out
        total = self._scratch[layer]  # [p, 1] + every message received; m_ij = total - m_ji
        torch.add(p, received[nbrs[0]][:-1], out=total[:-1])
        total[-1] = 1.0 + received[nbrs[0]][-1]
        for k in nbrs[1:]:
            total.add_(received[k])
        targets = received if out is None else out
        for j in nbrs:
            torch.sub(total, received[j], out=targets[j])
        return dict(targets)

    def start(self, parcel: torch.Tensor, round: int) -> None:
        """Assemble this step's outgoing messages from ``parcel`` and post the exchange."""
        if self._in_flight:
            raise RuntimeError("RelaySum.start called twice without wait()")
        for layer in range(self.num_layers):
            if not self.neighbors[layer]:
                continue
            outgoing = self._assemble(self._coords(parcel, layer), layer)
            if self.in_place:
                request = self.comm.exchange_replace(outgoing, tag=layer, round=round)
                self._in_flight.append((layer, outgoing, request))
            else:
                request = self.comm.exchange(outgoing, self.received[layer], tag=layer, round=round)
                self._in_flight.append((layer, self.received[layer], request))

    def wait(self) -> None:
        """Complete the exchange; dropped messages become empty (0 payload, 0 count)."""
        for layer, buffers_by_peer, request in self._in_flight:
            delivered = request.wait()
            for j, buf in buffers_by_peer.items():
                if j not in delivered:
                    buf.zero_()
            self.received[layer] = buffers_by_peer  # each buffer now holds its peer's message
        self._in_flight = []

    def exchange(self, parcel: torch.Tensor, round: int) -> None:
        self.start(parcel, round)
        self.wait()

    def add_received(self, out: torch.Tensor) -> None:
        """out += the sum of the messages received this step (every layer to its coordinates)."""
        for layer in range(self.num_layers):
            coords = self._coords(out, layer)
            for j in self.neighbors[layer]:  # sorted: the same summation order on every backend
                coords.add_(self.received[layer][j][:-1])

    def counts(self) -> list[float]:
        """Per layer, n-bar = 1 + the counters received this step: how many parcels the sum holds."""
        return [1.0 + sum(float(self.received[layer][j][-1]) for j in self.neighbors[layer]) for layer in range(self.num_layers)]

    def coords(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """The view of ``flat`` that layer ``layer`` relays."""
        return self._coords(flat, layer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"received.{layer}.{j}": buf for layer in range(self.num_layers) for j, buf in self.received[layer].items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for layer in range(self.num_layers):
            for j, buf in self.received[layer].items():
                buf.copy_(state[f"received.{layer}.{j}"])

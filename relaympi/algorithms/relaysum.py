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
    received from each neighbour (memory linear in the degree).

    With several layers (double binary trees), layer k relays coordinates k, k+L, k+2L, ...
    of the flat parcel, so every rank moves at most the equivalent of two models per step.
    A dropped message counts as an empty one (payload 0, counter 0): the counters then say
    exactly how many parcels a sum holds.
    """

    def __init__(self, comm: Communicator, topology: Any, numel: int, like: torch.Tensor):
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
        self._outgoing = [{j: torch.zeros(size + 1, **opts) for j in nbrs} for size, nbrs in zip(self.sizes, self.neighbors, strict=True)]
        self._requests: list[Request] = []

    def _coords(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        return flat if self.num_layers == 1 else flat[layer :: self.num_layers]

    def start(self, parcel: torch.Tensor, round: int) -> None:
        """Compute this step's outgoing messages from ``parcel`` and post the exchange."""
        if self._requests:
            raise RuntimeError("RelaySum.start called twice without wait()")
        for layer in range(self.num_layers):
            p = self._coords(parcel, layer)
            received, outgoing = self.received[layer], self._outgoing[layer]
            for j, out in outgoing.items():
                # out = [p, 1] + sum of the other neighbours' last messages, with the first addition
                # fused into the copy (one pass over the model per term)
                others = [k for k in self.neighbors[layer] if k != j]  # sorted: one summation order on every backend
                if others:
                    torch.add(p, received[others[0]][:-1], out=out[:-1])
                    out[-1] = 1.0 + received[others[0]][-1]
                    for k in others[1:]:
                        out.add_(received[k])
                else:
                    out[:-1].copy_(p)
                    out[-1] = 1.0
            self._requests.append(self.comm.exchange(outgoing, received, tag=layer, round=round))

    def wait(self) -> None:
        """Complete the exchange; dropped messages become empty (0 payload, 0 count)."""
        for layer, request in enumerate(self._requests):
            delivered = request.wait()
            for j, buf in self.received[layer].items():
                if j not in delivered:
                    buf.zero_()
        self._requests = []

    def exchange(self, parcel: torch.Tensor, round: int) -> None:
        self.start(parcel, round)
        self.wait()

    def add_received(self, out: torch.Tensor) -> None:
        """out += the sum of the messages received this step (every layer to its coordinates)."""
        for layer in range(self.num_layers):
            coords = self._coords(out, layer)
            for j in self.neighbors[layer]:
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

"""RelaySum (paper Algorithm 1): per-edge relayed messages with counters, on one or more spanning trees, for one worker."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relaympi.comm import Communicator, Request
from relaympi.flat import padded_zeros, spare_slots
from relaympi.topology import Topology

# Elements per chunk of a message: assembly of chunk c + 1 overlaps the transfer of chunk c.
# Measured with `python -m benchmarks.comm --chunk ...` (README, "Communication figures").
DEFAULT_CHUNK = 1 << 20
# Elements per cache block: a node of degree >= 2 runs its several passes over one block at a time,
# so that the block's rows are still in cache for the next pass (every op is elementwise, so the
# bits do not depend on the blocking).
CACHE_BLOCK = 1 << 15


@dataclass
class _Layer:
    """One tree's share of RelaySum: its coordinate block, neighbours and message buffers.

    A message is [payload (block size s), counter] with the counter at index ``counter``:
    first for layer 0 of a multi-tree topology, last otherwise, so that both can sit in the
    spare slots around a flat parcel (relaympi.flat.padded_zeros) and a leaf sends its parcel
    without a copy.
    """

    block: slice
    neighbors: tuple[int, ...]
    counter: int  # 0 or s
    received: torch.Tensor  # [k, s + 1]: the last message from each neighbour (see row_of)
    incoming: torch.Tensor | None  # [k, s + 1] receive buffers (default mode, k >= 2); swapped with received
    total: torch.Tensor | None  # [s + 1] scratch for k >= 3: [p, 1] + every message received
    total_is_sum: bool = False  # total holds the sum of received's rows (computed by add_received)
    row_of: list[int] = field(default_factory=list)  # row of received holding neighbors[p]'s message
    chunks: list[slice] = field(default_factory=list)  # of a message, in sending order
    leaf_chunks: list[torch.Tensor] | None = None  # a leaf's receive buffer, chunk by chunk

    def __post_init__(self) -> None:
        self.row_of = self.row_of or list(range(len(self.neighbors)))

    @property
    def size(self) -> int:
        return self.block.stop - self.block.start

    @property
    def payload(self) -> slice:
        return slice(1, None) if self.counter == 0 else slice(0, self.size)


class RelaySum:
    """Delivers to each worker the sum of every worker's delayed parcel, and how many parcels it holds:
    relays.Relays for one worker over a Communicator.

    Parcel p_j(t) of worker j reaches worker i in step t + tau_ij - 1 (Algorithm 1's timing:
    neighbours' parcels arrive in the same step). Each step, worker i sends to each tree
    neighbour j the message  m_ij(t) = p_i(t) + sum_{k in N(i)\\{j}} m_ki(t-1)  with the
    counter  c_ij(t) = 1 + sum_{k in N(i)\\{j}} c_ki(t-1),  keeping only the last message
    received from each neighbour. A dropped message counts as an empty one (payload 0,
    counter 0): the counters then say exactly how many parcels a sum holds.

    Layer k of a T-tree topology relays the contiguous coordinate block k
    (``Topology.coordinate_blocks``). Messages travel in chunks of ``chunk`` elements: receives
    are posted first, then each chunk is sent as soon as it is assembled, so assembly overlaps
    the transfer. Passes over a layer's data to assemble the messages of a node of degree k:

    - k = 1 (leaf): none. The message [p, 1] is a view of the parcel and its spare slot when
      the parcel came from ``padded_zeros`` (flat models and optimizer updates do); any other
      parcel is first copied into a padded buffer of RelaySum's own (one pass);
    - k = 2: one fused pass per message, in place: m_ia = m_bi + [p, 1] in b's buffer;
    - k >= 3: total = sum of the k messages (k - 1 adds, skipped when ``add_received``
      left it there: then two) + [p, 1], then every m_ij = total - m_ji in one broadcast
      subtraction: k + 1 kernels.

    Memory (copies of a layer's block, besides the parcel): the k received messages, plus
    ``in_place=False`` (default, full duplex): k receive buffers swapped with them each step;
    ``in_place=True`` (leanest): messages are assembled in the received buffers and swapped
    chunk by chunk through a bounce buffer of 2 x k x ``chunk`` elements.
    A node of degree >= 3 adds one scratch sum. No step allocates a model-sized buffer.
    """

    def __init__(
        self,
        comm: Communicator,
        topology: Topology,
        numel: int,
        like: torch.Tensor,
        in_place: bool = False,
        chunk: int = DEFAULT_CHUNK,
    ):
        if not topology.is_tree:
            raise ValueError(f"RelaySum needs a tree topology (every layer a spanning tree); {topology.name!r} is not")
        if topology.world_size != comm.world_size:
            raise ValueError(f"topology is for {topology.world_size} workers but the world has {comm.world_size}")
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
        self.comm = comm
        self.numel = numel
        self.in_place = in_place
        self.chunk = int(chunk)
        self.num_layers = topology.num_layers
        self._opts = {"dtype": like.dtype, "device": like.device}
        # CPU: passes run CACHE_BLOCK elements at a time; a GPU runs each op over a whole chunk
        self._block = CACHE_BLOCK if like.device.type == "cpu" else max(self.chunk, numel + 1)
        self.layers: list[_Layer] = []
        for index, block in enumerate(topology.coordinate_blocks(numel)):
            nbrs = topology.neighbors(comm.rank, index)
            k, s = len(nbrs), block.stop - block.start
            self.layers.append(
                _Layer(
                    block=block,
                    neighbors=nbrs,
                    counter=0 if (index == 0 and self.num_layers > 1) else s,
                    received=torch.zeros(k, s + 1, **self._opts),
                    incoming=torch.zeros(k, s + 1, **self._opts) if (k >= 2 and not in_place) else None,
                    total=torch.zeros(s + 1, **self._opts) if k >= 3 else None,
                    chunks=[slice(lo, min(lo + self.chunk, s + 1)) for lo in range(0, s + 1, self.chunk)],
                )
            )
        self._bounce = None
        if in_place:
            widest = max((len(layer.neighbors) for layer in self.layers), default=0)
            longest = min(self.chunk, max(layer.size + 1 for layer in self.layers))
            self._bounce = torch.zeros(2, widest, longest, **self._opts)
        self._own_parcel: torch.Tensor | None = None  # padded copy of parcels without spare slots
        self._messages: tuple[torch.Tensor, list] | None = None  # (last parcel, its message chunks per layer)
        # per layer: requests that receive every live neighbour's message (or chunk of it), and
        # either the send-only requests or, in place, the chunk that has yet to land
        self._in_flight: list[tuple[_Layer, list[Request], list[Request] | tuple]] = []

    # -- messages ---------------------------------------------------------------------------

    def _parcel_messages(self, parcel: torch.Tensor) -> list[list[torch.Tensor] | None]:
        """Per layer, the chunks of [p, 1] as views of the parcel and one of its spare slots (which hold 1.0).

        A parcel without spare slots is first copied into a padded buffer of RelaySum's own. The
        views are kept for the next step: the same parcel buffer comes back every step.
        """
        if self._messages is not None and self._messages[0] is parcel:
            return self._messages[1]
        storage = spare_slots(parcel)
        if storage is None:
            if self._own_parcel is None:
                self._own_parcel = padded_zeros(self.numel, **self._opts)
            self._own_parcel.copy_(parcel)
            return self._parcel_messages(self._own_parcel)
        messages = []
        for layer in self.layers:
            lo, hi = layer.block.start + 1, layer.block.stop + 1  # storage index = flat index + 1
            if not layer.neighbors:
                messages.append(None)
                continue
            if layer.counter == 0 and lo == 1:
                message = storage[0:hi]
            elif layer.counter == layer.size and hi == self.numel + 1:
                message = storage[lo : hi + 1]
            else:
                raise RuntimeError("a middle layer of a topology with more than 2 trees has no spare slot")
            messages.append([message[c] for c in layer.chunks])
        self._messages = (parcel, messages)
        return messages

    def _assemble(self, layer: _Layer, parcel: torch.Tensor, c: slice, pending: Request | None = None) -> None:
        """Chunk c of every outgoing message, in place in ``received`` (see ``_targets``), from
        ``parcel``, chunk c of [p, 1]. Between cache blocks, ``pending.test()`` lets the transport
        move the chunks already posted: a shared-memory MPI copies only inside MPI calls (measured:
        without these calls a transfer does not overlap computation at all)."""
        rows, total = layer.received, layer.total
        a, b = layer.row_of[0], layer.row_of[-1]
        for lo in range(c.start, c.stop, self._block):
            if pending is not None and lo > c.start:
                pending.test()
            block = slice(lo, min(lo + self._block, c.stop))
            mine = parcel[lo - c.start : block.stop - c.start]
            if total is None:  # degree 2: m_ia = [p, 1] + m_bi, the two rows swap roles
                rows[b, block].add_(mine)
                rows[a, block].add_(mine)
                continue
            if not layer.total_is_sum:
                _sum_rows(rows, block, total[block])
            total[block].add_(mine)
            torch.sub(total[block], rows[:, block], out=rows[:, block])  # m_ij = total - m_ji, every row at once

    @staticmethod
    def _targets(layer: _Layer) -> list[int]:
        """After assembly, row r of ``received`` holds the message for neighbour targets[r]."""
        nbrs = layer.neighbors
        if len(nbrs) == 2:  # the row that held b's message now holds a's, and vice versa
            targets = [0, 0]
            targets[layer.row_of[1]], targets[layer.row_of[0]] = nbrs[0], nbrs[1]
            return targets
        return list(nbrs)

    # -- the exchange -----------------------------------------------------------------------

    def start(self, parcel: torch.Tensor, round: int) -> None:
        """Assemble this step's messages from ``parcel`` and post them, chunk by chunk."""
        if self._in_flight:
            raise RuntimeError("RelaySum.start called twice without wait()")
        if parcel.numel() != self.numel:
            raise ValueError(f"parcel has {parcel.numel()} elements, RelaySum was built for {self.numel}")
        messages = self._parcel_messages(parcel)
        for tag, (layer, message) in enumerate(zip(self.layers, messages, strict=True)):
            if message is None:
                continue
            if len(layer.neighbors) == 1:
                self._start_leaf(tag, layer, message, round)
            elif self.in_place:
                self._start_in_place(tag, layer, message, round)
            else:
                self._start_relay(tag, layer, message, round)

    def _start_leaf(self, tag: int, layer: _Layer, message: list[torch.Tensor], round: int) -> None:
        (peer,) = layer.neighbors
        if layer.leaf_chunks is None:  # a leaf's receive buffer never moves: keep its chunk views
            layer.leaf_chunks = [layer.received[0, c] for c in layer.chunks]
        requests = [  # the leaf's message is its parcel: nothing to assemble, nothing to swap
            self.comm.exchange({peer: send}, {peer: recv}, tag=tag, round=round, chunk=i)
            for i, (send, recv) in enumerate(zip(message, layer.leaf_chunks, strict=True))
        ]
        self._in_flight.append((layer, requests, []))

    def _start_relay(self, tag: int, layer: _Layer, message: list[torch.Tensor], round: int) -> None:
        chunks = layer.chunks
        targets = self._targets(layer)
        incoming, rows = layer.incoming, layer.received
        if len(chunks) == 1:
            self._assemble(layer, message[0], chunks[0])
            sends = {peer: rows[r] for r, peer in enumerate(targets)}
            recvs = {peer: incoming[r] for r, peer in enumerate(layer.neighbors)}
            self._in_flight.append((layer, [self.comm.exchange(sends, recvs, tag=tag, round=round)], []))
            return
        requests = [  # receives first, so every chunk can land as soon as it is sent
            self.comm.exchange({}, {peer: incoming[r, c] for r, peer in enumerate(layer.neighbors)}, tag=tag, round=round, chunk=i)
            for i, c in enumerate(chunks)
        ]
        sends = []
        for i, c in enumerate(chunks):
            self._assemble(layer, message[i], c, pending=sends[-1] if sends else self._last_posted())
            sends.append(self.comm.exchange({peer: rows[r, c] for r, peer in enumerate(targets)}, {}, tag=tag, round=round, chunk=i))
        self._in_flight.append((layer, requests, sends))

    def _start_in_place(self, tag: int, layer: _Layer, message: list[torch.Tensor], round: int) -> None:
        """Assemble in the received buffers and swap each chunk with its peer through the bounce buffer.

        Chunk i + 1 is posted before chunk i lands, so one chunk is always in flight.
        """
        targets = self._targets(layer)
        rows = layer.received
        previous = None
        for i, c in enumerate(layer.chunks):
            self._assemble(layer, message[i], c, pending=previous[0] if previous else None)
            bounce = self._bounce[i % 2, :, : c.stop - c.start]
            sends = {peer: rows[r, c] for r, peer in enumerate(targets)}
            recvs = {peer: bounce[r] for r, peer in enumerate(targets)}
            request = self.comm.exchange(sends, recvs, tag=tag, round=round, chunk=i)
            if previous is not None:
                self._land(layer, targets, *previous)
            previous = (request, bounce, c)
        # what arrives from targets[r] lands in row r: the row that carried the message to it
        layer.row_of = [targets.index(peer) for peer in layer.neighbors]
        self._in_flight.append((layer, [], (targets, *previous)))  # the last chunk lands in wait()

    def _last_posted(self) -> Request | None:
        """A request of an earlier layer still in flight, to let the transport progress."""
        for _, requests, rest in reversed(self._in_flight):
            if requests:
                return requests[-1]
            if isinstance(rest, tuple):
                return rest[1]
        return None

    @staticmethod
    def _land(layer: _Layer, targets: list[int], request: Request, bounce: torch.Tensor, c: slice) -> None:
        """Wait for one in-place chunk and move what arrived from the bounce buffer into place."""
        delivered = request.wait()
        for r, peer in enumerate(targets):
            if peer in delivered:
                layer.received[r, c].copy_(bounce[r])

    def wait(self) -> None:
        """Complete the exchange; dropped messages become empty (0 payload, 0 count)."""
        for layer, requests, rest in self._in_flight:
            if isinstance(rest, tuple):  # in place: the last chunk still sits in the bounce buffer
                targets, request, bounce, c = rest
                self._land(layer, targets, request, bounce, c)
                requests = [request]
            else:  # sends posted separately from the receives
                for request in rest:
                    request.wait()
            delivered = frozenset(layer.neighbors)
            for request in requests:  # every one of these received from every live neighbour
                delivered &= request.wait()  # chunks of a message are dropped together
            if layer.incoming is not None:  # the receive buffers now hold the state
                layer.received, layer.incoming = layer.incoming, layer.received
            for position, peer in enumerate(layer.neighbors):
                if peer not in delivered:
                    layer.received[layer.row_of[position]].zero_()
            layer.total_is_sum = False
        self._in_flight = []

    def exchange(self, parcel: torch.Tensor, round: int) -> None:
        self.start(parcel, round)
        self.wait()

    # -- what arrived -----------------------------------------------------------------------

    def add_received(self, out: torch.Tensor, divide_by: list[float] | None = None) -> None:
        """out += the sum of the messages received this step (every layer to its block), then, with
        ``divide_by``, each layer's block /= divide_by[layer], in one cache-blocked sweep."""
        for index, layer in enumerate(self.layers):
            target = out[layer.block]
            divisor = None if divide_by is None else divide_by[index]
            payload = layer.payload.start
            rows, total = layer.received, layer.total
            for lo in range(0, layer.size, self._block):
                hi = min(lo + self._block, layer.size)
                part, block = target[lo:hi], slice(lo + payload, hi + payload)
                if total is not None:  # keep the sum: next step's assembly starts from it
                    _sum_rows(rows, block, total[block])
                    part.add_(total[block])
                else:  # in neighbour order, whichever rows hold them
                    for row in layer.row_of:
                        part.add_(rows[row, block])
                if divisor is not None:
                    part.div_(divisor)
            if total is not None:
                # the counter too, so that total is the whole sum of the rows
                _sum_rows(rows, slice(layer.counter, layer.counter + 1), total[layer.counter : layer.counter + 1])
                layer.total_is_sum = True

    def counts(self) -> list[float]:
        """Per layer, n-bar = 1 + the counters received this step: how many parcels the sum holds."""
        out = []
        for layer in self.layers:
            rows = layer.received
            on_host = rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.float64)
            counters = (rows.numpy() if on_host else rows)[:, layer.counter]  # numpy: no torch dispatch
            if len(layer.neighbors) == 1:
                out.append(1.0 + float(counters[0]))
            else:
                out.append(1.0 + float(counters.sum()) if layer.neighbors else 1.0)
        return out

    def factor(self, values: float, layer: int) -> float:
        """Relays.factor for one worker: a count is already a scalar factor."""
        return float(values)

    def coords(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """The contiguous block of ``flat`` that layer ``layer`` relays."""
        return flat[self.layers[layer].block]

    @property
    def sizes(self) -> list[int]:
        return [layer.size for layer in self.layers]

    @property
    def neighbors(self) -> list[tuple[int, ...]]:
        return [layer.neighbors for layer in self.layers]

    def messages(self) -> list[dict[int, torch.Tensor]]:
        """Per layer, neighbour -> the last message received from it ([counter, payload] on layer 0
        of a multi-tree topology, [payload, counter] otherwise)."""
        return [
            {peer: layer.received[layer.row_of[p]] for p, peer in enumerate(layer.neighbors)}
            for layer in self.layers
        ]

    def buffers(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Every buffer RelaySum holds that scales with the model, and the fixed-size bounce buffer."""
        held = [layer.received for layer in self.layers]
        held += [b for layer in self.layers for b in (layer.incoming, layer.total) if b is not None]
        if self._own_parcel is not None:
            held.append(self._own_parcel)
        return held, self._bounce

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            f"received.{index}.{peer}": message
            for index, by_peer in enumerate(self.messages())
            for peer, message in by_peer.items()
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for index, by_peer in enumerate(self.messages()):
            for peer, message in by_peer.items():
                message.copy_(state[f"received.{index}.{peer}"])
            self.layers[index].total_is_sum = False


def _sum_rows(rows: torch.Tensor, c: slice, out: torch.Tensor) -> None:
    """out = rows[0, c] + rows[1, c] + ... in row order: elementwise adds give the same bits for any chunking."""
    torch.add(rows[0, c], rows[1, c], out=out)
    for r in range(2, rows.shape[0]):
        out.add_(rows[r, c])

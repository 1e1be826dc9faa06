"""RelaySum (paper Algorithm 1): per-edge relayed messages with counters, on one or more spanning
trees, for one worker."""

# Long module: RelaySum's one mechanism (messages, counters, drops, ranges)

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from relaympi.comm import Communicator, Request
from relaympi.flat import spare_slots
from relaympi.topology import Topology

# Elements per chunk of a message: assembly of chunk c + 1 overlaps the transfer of chunk c.
# Measured with `python -m benchmarks.comm --chunk ...` (docs/benchmarks.md, "Communication on
# one node").
DEFAULT_CHUNK = 1 << 20
# Elements per cache block: a node of degree >= 2 runs its several passes over one block at a time,
# so that the block's rows are still in cache for the next pass (every op is elementwise, so the
# bits do not depend on the blocking).
CACHE_BLOCK = 1 << 15


@dataclass
class _Layer:
    """One tree's share of RelaySum: its coordinate block, neighbours and message buffers.

    A message is [payload (block size s), counter], the counter at index s. Its chunks travel last
    to first, so the counter leads: a receiver knows n-bar before the payload chunks land, and
    backward, which finishes the high indices first, finishes the leading chunk first.
    """

    block: slice
    neighbors: tuple[int, ...]
    received: torch.Tensor  # [k, s + 1]: the last message from each neighbour (see row_of)
    # [k, s + 1] receive buffers (default mode, k >= 2); swapped with received
    incoming: torch.Tensor | None
    total: torch.Tensor | None  # [s + 1] scratch for k >= 3: [p, 1] + every message received
    # a leaf's last chunk [p[a:s], 1] where no spare slot follows the parcel's block
    tail: torch.Tensor | None
    total_is_sum: bool = False  # total holds the sum of received's rows (computed by add_received)
    # row of received holding neighbors[p]'s message
    row_of: list[int] = field(default_factory=list)
    # of a message, in index order (sent last to first)
    chunks: list[slice] = field(default_factory=list)
    # this step's, from begin() to finish()
    # row r of received goes to targets[r] (see RelaySum._targets)
    targets: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # per chunk, its coordinates not ready yet
    next_send: int = -1  # the chunk to send next (chunks go last to first); -1: all sent
    # per chunk, the request receiving it (None: in place, landed in ready)
    recvs: list = field(default_factory=list)
    sends: list = field(default_factory=list)  # per chunk, the request sending it
    summed: int = 0  # chunks whose rows add_received_chunk summed into total this step

    def __post_init__(self) -> None:
        self.row_of = self.row_of or list(range(len(self.neighbors)))

    @property
    def size(self) -> int:
        return self.block.stop - self.block.start

    def coords(self, j: int) -> slice:
        """The flat coordinates whose payload chunk j carries (the counter's chunk may carry
        none)."""
        c = self.chunks[j]
        return slice(self.block.start + c.start, self.block.start + min(c.stop, self.size))

    @property
    def arrivals(self) -> torch.Tensor:
        """Where this step's messages land: the receive buffers, or (leaf, in place) received
        itself."""
        return self.incoming if self.incoming is not None else self.received


class RelaySum:
    """Delivers to each worker the sum of every worker's delayed parcel, and how many parcels it
    holds:
    relays.Relays for one worker over a Communicator, and relays.RangedRelays (range by range).

    Parcel p_j(t) of worker j reaches worker i in step t + tau_ij - 1 (Algorithm 1's timing:
    neighbours' parcels arrive in the same step). Each step, worker i sends to each tree
    neighbour j the message  m_ij(t) = p_i(t) + sum_{k in N(i)\\{j}} m_ki(t-1)  with the
    counter  c_ij(t) = 1 + sum_{k in N(i)\\{j}} c_ki(t-1),  keeping only the last message
    received from each neighbour. A dropped message counts as an empty one (payload 0,
    counter 0): the counters then say exactly how many parcels a sum holds.

    Layer k of a T-tree topology relays the contiguous coordinate block k
    (``Topology.coordinate_blocks``). Messages travel in chunks of ``chunk`` elements, last chunk
    first (it holds the counter): ``begin`` posts every receive of the step, ``ready(lo, hi)`` sends
    each chunk as soon as all its coordinates are ready and the chunks after it are sent (so both
    ends agree on the order chunks of one tag travel in, whatever the ranges), and ``finish``
    completes the receives chunk by chunk, handing each landed chunk to the caller. Passes over a
    layer's data to assemble the messages of a node of degree k:

    - k = 1 (leaf): none. Each chunk is a view of the parcel; the last one, [p[a:s], 1], is a view
      when the parcel's spare slot follows the block (``padded_zeros``: flat models and optimizer
      updates; the last layer), else a copy of at most ``chunk`` elements (no pass over the model);
    - k = 2: one fused pass per message, in place: m_ia = m_bi + [p, 1] in b's buffer;
    - k >= 3: total = sum of the k messages (k - 1 adds, skipped when ``add_received``
      left it there: then two) + [p, 1], then every m_ij = total - m_ji in one broadcast
      subtraction: k + 1 kernels.

    Memory (copies of a layer's block, besides the parcel): the k received messages, plus
    ``in_place=False`` (default, full duplex): k receive buffers swapped with them each step;
    ``in_place=True`` (leanest): messages are assembled in the received buffers and swapped
    chunk by chunk through a bounce buffer of 2 x k x ``chunk`` elements (a chunk's receive is
    posted with its send, and lands when the next one is posted). A node of degree >= 3 adds one
    scratch sum, a leaf one chunk. No step allocates a model-sized buffer.
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
            raise ValueError(
                "RelaySum needs a tree topology (every layer a spanning tree); "
                f"{topology.name!r} is not"
            )
        if topology.world_size != comm.world_size:
            raise ValueError(
                f"topology is for {topology.world_size} workers but the world has {comm.world_size}"
            )
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
        self.comm = comm
        self.numel = numel
        self.in_place = in_place
        self.chunk = int(chunk)
        self.num_layers = topology.num_layers
        self._opts: dict[str, Any] = {"dtype": like.dtype, "device": like.device}
        # CPU: passes run CACHE_BLOCK elements at a time; a GPU runs each op over a whole chunk
        self._block = CACHE_BLOCK if like.device.type == "cpu" else max(self.chunk, numel + 1)
        # ready()'s pieces between two progress calls (the optimizer's block)
        self._progress_block = 4 * self._block
        self.layers: list[_Layer] = []
        for index, block in enumerate(topology.coordinate_blocks(numel)):
            nbrs = topology.neighbors(comm.rank, index)
            k, s = len(nbrs), block.stop - block.start
            chunks = [slice(lo, min(lo + self.chunk, s + 1)) for lo in range(0, s + 1, self.chunk)]
            tail = None
            if k == 1 and block.stop < numel:  # no parcel has a spare slot after this block
                tail = self._tail(chunks[-1])
            self.layers.append(
                _Layer(
                    block=block,
                    neighbors=nbrs,
                    received=torch.zeros(k, s + 1, **self._opts),
                    incoming=torch.zeros(k, s + 1, **self._opts)
                    if (k >= 2 and not in_place)
                    else None,
                    total=torch.zeros(s + 1, **self._opts) if k >= 3 else None,
                    tail=tail,
                    chunks=chunks,
                )
            )
        self._bounce: torch.Tensor | None = None
        if in_place:
            widest = max((len(layer.neighbors) for layer in self.layers), default=0)
            longest = min(self.chunk, max(layer.size + 1 for layer in self.layers))
            self._bounce = torch.zeros(2, widest, longest, **self._opts)
        # this step's, from begin() to finish()
        self._parcel: torch.Tensor | None = None
        self._storage: torch.Tensor | None = None  # the parcel's spare slots, if it has them
        self._round = 0
        self._last_request: Request | None = (
            None  # the last request posted: tested to let the transport progress
        )
        self._swaps = 0  # in-place chunks posted this step (they take turns in the bounce buffer)
        self._landing: tuple | None = None  # the in-place chunk posted last, not landed yet
        self._progress: Request | None = (
            None  # in finish(): the next receive, tested between normalized blocks
        )

    # -- messages ---------------------------------------------------------------------------

    def _leaf_chunk(self, layer: _Layer, j: int) -> torch.Tensor:
        """Chunk j of a leaf's message [p, 1]: a view of the parcel (and its spare slot), or the
        tail copy."""
        assert self._parcel is not None  # called between begin() and finish()
        c, coords = layer.chunks[j], layer.coords(j)
        if c.stop <= layer.size:  # payload only
            return self._parcel[coords]
        # storage index = flat index + 1
        if self._storage is not None and layer.block.stop == self.numel:
            return self._storage[coords.start + 1 : self.numel + 2]
        if layer.tail is None:  # the last layer's, for a parcel without spare slots
            layer.tail = self._tail(c)
        layer.tail[:-1].copy_(self._parcel[coords])
        return layer.tail

    def _tail(self, c: slice) -> torch.Tensor:
        return torch.ones(c.stop - c.start, **self._opts)  # its last slot: the counter 1

    def _assemble(self, layer: _Layer, j: int) -> None:
        """Chunk j of every outgoing message, in place in ``received`` (see ``_targets``), from the
        parcel's coordinates (and the counter 1). Between cache blocks, ``test()`` on the request
        posted last lets the transport move the chunks already posted: a shared-memory MPI copies
        only inside MPI calls (measured: without these calls a transfer does not overlap
        computation at all)."""
        assert self._parcel is not None  # called between begin() and finish()
        rows, total = layer.received, layer.total
        a, b = layer.row_of[0], layer.row_of[-1]
        c, coords = layer.chunks[j], layer.coords(j)
        payload_stop = c.start + coords.stop - coords.start
        pieces = [
            (lo, min(lo + self._block, payload_stop))
            for lo in range(c.start, payload_stop, self._block)
        ]
        if c.stop > layer.size:
            pieces.append((layer.size, layer.size + 1))  # the counter: mine = 1
        for i, (lo, hi) in enumerate(pieces):
            if i and self._last_request is not None:
                self._last_request.test()
            block = slice(lo, hi)
            mine = (
                1.0
                if lo == layer.size
                else self._parcel[layer.block.start + lo : layer.block.start + hi]
            )
            if total is None:  # degree 2: m_ia = [p, 1] + m_bi, the two rows swap roles
                rows[b, block].add_(mine)
                rows[a, block].add_(mine)
                continue
            if not layer.total_is_sum:
                _sum_rows(rows, block, total[block])
            total[block].add_(mine)
            # m_ij = total - m_ji, every row at once
            torch.sub(total[block], rows[:, block], out=rows[:, block])

    @staticmethod
    def _targets(layer: _Layer) -> list[int]:
        """After assembly, row r of ``received`` holds the message for neighbour targets[r]."""
        nbrs = layer.neighbors
        if len(nbrs) == 2:  # the row that held b's message now holds a's, and vice versa
            targets = [0, 0]
            targets[layer.row_of[1]], targets[layer.row_of[0]] = nbrs[0], nbrs[1]
            return targets
        return list(nbrs)

    # -- the exchange, range by range -------------------------------------------------------

    def begin(self, parcel: torch.Tensor, round: int) -> None:
        """Start this step's exchange of ``parcel`` (whose coordinates become final range by range,
        see ``ready``): post every receive of the step, the chunks last to first."""
        if self._parcel is not None:
            raise RuntimeError("RelaySum.begin called twice without finish()")
        if parcel.numel() != self.numel:
            raise ValueError(
                f"parcel has {parcel.numel()} elements, RelaySum was built for {self.numel}"
            )
        self._parcel, self._storage, self._round = parcel, spare_slots(parcel), round
        self._swaps, self._landing = 0, None
        for tag, layer in enumerate(self.layers):
            if not layer.neighbors:
                continue
            layer.targets = self._targets(layer)
            layer.missing = [
                layer.coords(j).stop - layer.coords(j).start for j in range(len(layer.chunks))
            ]
            layer.next_send = len(layer.chunks) - 1
            layer.sends = [None] * len(layer.chunks)
            layer.recvs = [None] * len(layer.chunks)
            if self.in_place and len(layer.neighbors) >= 2:  # posted with each chunk's send
                continue
            into = layer.arrivals
            # receives first, so every chunk can land as soon as it is sent
            for j in reversed(range(len(layer.chunks))):
                c = layer.chunks[j]
                request = self.comm.exchange(
                    {},
                    {peer: into[r, c] for r, peer in enumerate(layer.neighbors)},
                    tag=tag,
                    round=round,
                    chunk=j,
                )
                layer.recvs[j] = self._last_request = request
        for tag, layer in enumerate(self.layers):
            self._send_ready(tag, layer)  # a chunk of the counter alone is ready now

    def ready(self, lo: int, hi: int, prepare: Callable[[int, int], None] | None = None) -> None:
        """The parcel's [lo, hi) is final once ``prepare(a, b)`` has run on each piece [a, b) of it
        (a
        chunk's share of the range, last to first): send every chunk that is now complete."""
        if self._parcel is None:
            raise RuntimeError("RelaySum.ready called before begin()")
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"range [{lo}, {hi}) is not within [0, {self.numel})")
        for tag in reversed(range(len(self.layers))):
            layer = self.layers[tag]
            if (
                layer.block.stop <= lo
                or layer.block.start >= hi
                or layer.block.start == layer.block.stop
            ):
                continue
            for j in reversed(range(len(layer.chunks))):
                coords = layer.coords(j)
                a, b = max(lo, coords.start), min(hi, coords.stop)
                if a >= b:
                    continue
                # (with the transport progressing between blocks, as in _assemble)
                if prepare is not None:
                    for piece in range(a, b, self._progress_block):
                        if piece > a and self._last_request is not None:
                            self._last_request.test()
                        prepare(piece, min(piece + self._progress_block, b))
                if layer.neighbors:
                    layer.missing[j] -= b - a
                    self._send_ready(tag, layer)

    def _send_ready(self, tag: int, layer: _Layer) -> None:
        """Send layer's chunks, last to first, while the next one is complete."""
        while layer.next_send >= 0 and layer.missing[layer.next_send] == 0:
            j = layer.next_send
            layer.next_send -= 1
            if len(layer.neighbors) == 1:
                layer.sends[j] = self.comm.exchange(
                    {layer.neighbors[0]: self._leaf_chunk(layer, j)},
                    {},
                    tag=tag,
                    round=self._round,
                    chunk=j,
                )
            else:
                self._assemble(layer, j)
                self._send_assembled(tag, layer, j)
            self._last_request = layer.sends[j]

    def _send_assembled(self, tag: int, layer: _Layer, j: int) -> None:
        c, rows = layer.chunks[j], layer.received
        sends = {peer: rows[r, c] for r, peer in enumerate(layer.targets)}
        if not self.in_place:
            layer.sends[j] = self.comm.exchange(sends, {}, tag=tag, round=self._round, chunk=j)
            return
        # in place: the chunk goes out of received and comes back into the bounce buffer; it lands
        # (into the rows that carried it out) once the next in-place chunk is posted, so one is
        # always in flight; the two bounce halves take turns
        assert self._bounce is not None  # made by __init__ when in_place
        bounce = self._bounce[self._swaps % 2, :, : c.stop - c.start]
        self._swaps += 1
        recvs = {peer: bounce[r] for r, peer in enumerate(layer.targets)}
        layer.sends[j] = self.comm.exchange(sends, recvs, tag=tag, round=self._round, chunk=j)
        if self._landing is not None:
            self._land(*self._landing)
        self._landing = (layer, j, bounce)

    def _land(self, layer: _Layer, j: int, bounce: torch.Tensor) -> None:
        """Wait for one in-place chunk and move what arrived from the bounce buffer into place; a
        dropped message leaves its rows empty."""
        delivered = layer.sends[j].wait()
        c = layer.chunks[j]
        for r, peer in enumerate(layer.targets):
            if peer in delivered:
                layer.received[r, c].copy_(bounce[r])
            else:
                layer.received[r, c].zero_()

    def finish(self, landed: Callable[[int, int, float], None] | None = None) -> None:
        """Complete the exchange, chunk by chunk in the order they travel (dropped messages become
        empty: 0 payload, 0 count); ``landed(layer, chunk, nbar)`` runs on each chunk once it has
        arrived from every neighbour, with its layer's n-bar (see ``counts``)."""
        if self._parcel is None:
            raise RuntimeError("RelaySum.finish called before begin()")
        for layer in self.layers:
            if layer.neighbors and layer.next_send >= 0:
                raise RuntimeError(
                    "RelaySum.finish before every range was ready (coordinates "
                    f"{layer.coords(layer.next_send)})"
                )
        if self._landing is not None:
            self._land(*self._landing)
            self._landing = None
        upcoming = [
            r
            for index in reversed(range(len(self.layers)))
            for r in reversed(self.layers[index].recvs)
            if r is not None
        ]
        for index in reversed(range(len(self.layers))):
            layer = self.layers[index]
            in_place = self.in_place and len(layer.neighbors) >= 2
            # what arrives from targets[r] lands in row r: the row that carried the message to it
            if in_place:
                layer.row_of = [layer.targets.index(peer) for peer in layer.neighbors]
            nbar = 1.0
            for j in reversed(range(len(layer.chunks))):
                if layer.neighbors and not in_place:
                    delivered = layer.recvs[j].wait()
                    upcoming.pop(0)
                    # tested while this chunk is normalized
                    self._progress = upcoming[0] if upcoming else None
                    if j == len(layer.chunks) - 1:  # chunks of a message are dropped together
                        for r, peer in enumerate(layer.neighbors):
                            if peer not in delivered:
                                layer.arrivals[r].zero_()
                    # the chunk is a view of the parcel, which landed() may change
                    if len(layer.neighbors) == 1 and landed is not None:
                        layer.sends[j].wait()
                if j == len(layer.chunks) - 1:
                    nbar = self._nbar(layer, layer.arrivals)
                if landed is not None:
                    landed(index, j, nbar)
            for request in layer.sends:
                if request is not None:
                    request.wait()
            if layer.incoming is not None:  # the receive buffers now hold the state
                layer.received, layer.incoming = layer.incoming, layer.received
            layer.total_is_sum = layer.total is not None and layer.summed == len(layer.chunks)
            layer.summed = 0
            layer.recvs, layer.sends = [], []
        self._parcel = self._storage = self._last_request = self._progress = None

    def exchange(self, parcel: torch.Tensor, round: int) -> None:
        """The whole exchange at once: begin, ready(0, numel), finish."""
        self.begin(parcel, round)
        self.ready(0, self.numel)
        self.finish()

    # -- what arrived -----------------------------------------------------------------------

    def add_received(self, out: torch.Tensor, divide_by: list[float] | None = None) -> None:
        """out += the sum of the messages received this step (every layer to its block), then, with
        ``divide_by``, each layer's block /= divide_by[layer], in one cache-blocked sweep."""
        for index, layer in enumerate(self.layers):
            divisor = None if divide_by is None else divide_by[index]
            self._add_rows(out, layer, layer.received, slice(0, layer.size + 1), divisor)
            if layer.total is not None:
                layer.total_is_sum = True

    def add_received_chunk(
        self,
        out: torch.Tensor,
        layer: int,
        chunk: int,
        divisor: float | None = None,
        before: Callable[[slice], object] | None = None,
        after: Callable[[slice], object] | None = None,
    ) -> None:
        """In ``finish``'s ``landed(layer, chunk, nbar)``: out += that chunk's sum of the messages
        received this step, then /= ``divisor``; per cache block [a, b) of flat coordinates,
        ``before(slice(a, b))`` runs first and ``after`` last (so a caller's fill-ins and its use of
        the sum stay in cache)."""
        here = self.layers[layer]
        self._add_rows(
            out, here, here.arrivals, here.chunks[chunk], divisor, before, after, self._progress
        )
        here.summed += 1

    def _add_rows(
        self,
        out: torch.Tensor,
        layer: _Layer,
        rows: torch.Tensor,
        c: slice,
        divisor: float | None,
        before: Callable[[slice], object] | None = None,
        after: Callable[[slice], object] | None = None,
        progress: Request | None = None,
    ) -> None:
        """out[coords of message slice c] += the sum of rows (k >= 3: through total, kept for the
        next
        assembly; else in neighbour order), /= divisor; the counters too into total. ``progress``
        (a request) is tested between blocks so that the chunks still in flight move meanwhile."""
        start, total = layer.block.start, layer.total
        payload_stop = min(c.stop, layer.size)
        for lo in range(c.start, payload_stop, self._block):
            if progress is not None and lo > c.start:
                progress.test()
            hi = min(lo + self._block, payload_stop)
            coords, block = slice(start + lo, start + hi), slice(lo, hi)
            if before is not None:
                before(coords)
            part = out[coords]
            if total is not None:  # keep the sum: next step's assembly starts from it
                _sum_rows(rows, block, total[block])
                part.add_(total[block])
            else:  # in neighbour order, whichever rows hold them
                for row in layer.row_of:
                    part.add_(rows[row, block])
            if divisor is not None:
                part.div_(divisor)
            if after is not None:
                after(coords)
        # the counter too, so that total is the whole sum of the rows
        if total is not None and c.stop > layer.size:
            _sum_rows(rows, slice(layer.size, layer.size + 1), total[layer.size : layer.size + 1])

    @staticmethod
    def _nbar(layer: _Layer, rows: torch.Tensor) -> float:
        if not layer.neighbors:
            return 1.0
        on_host = rows.device.type == "cpu" and rows.dtype in (torch.float32, torch.float64)
        counters = (rows.numpy() if on_host else rows)[:, layer.size]  # numpy: no torch dispatch
        if len(layer.neighbors) == 1:
            return 1.0 + float(counters[0])
        return 1.0 + float(counters.sum())

    def counts(self) -> list[float]:
        """Per layer, n-bar = 1 + the counters received this step: how many parcels the sum
        holds."""
        return [self._nbar(layer, layer.received) for layer in self.layers]

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
        """Per layer, neighbour -> the last message received from it, [payload, counter]."""
        return [
            {peer: layer.received[layer.row_of[p]] for p, peer in enumerate(layer.neighbors)}
            for layer in self.layers
        ]

    def buffers(self) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Every buffer RelaySum holds that scales with the model, and the fixed-size bounce
        buffer."""
        held = [layer.received for layer in self.layers]
        held += [b for layer in self.layers for b in (layer.incoming, layer.total) if b is not None]
        held += [layer.tail for layer in self.layers if layer.tail is not None]
        return held, self._bounce

    def _counter_first(self, index: int) -> bool:
        # checkpoints keep the layout messages had before counters moved to the end: [counter,
        # payload] on layer 0 of a multi-tree topology (so checkpoints of either version resume)
        return index == 0 and self.num_layers > 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            f"received.{index}.{peer}": message.roll(1) if self._counter_first(index) else message
            for index, by_peer in enumerate(self.messages())
            for peer, message in by_peer.items()
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for index, by_peer in enumerate(self.messages()):
            for peer, message in by_peer.items():
                saved = state[f"received.{index}.{peer}"]
                message.copy_(saved.roll(-1) if self._counter_first(index) else saved)
            self.layers[index].total_is_sum = False


def _sum_rows(rows: torch.Tensor, c: slice, out: torch.Tensor) -> None:
    """out = rows[0, c] + rows[1, c] + ... in row order: elementwise adds give the same bits for any
    chunking."""
    torch.add(rows[0, c], rows[1, c], out=out)
    for r in range(2, rows.shape[0]):
        out.add_(rows[r, c])

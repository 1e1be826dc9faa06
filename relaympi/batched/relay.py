"""RelaySum over all workers at once: the messages of every directed tree edge as one [E, s] tensor
per
layer, updated in place. RelaySGD and RelaySGD/Grad (relaympi.algorithms.relay) run on it as
relays.Relays."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relaympi.batched.base import delivered, to_device
from relaympi.comm import DropPolicy


@dataclass
class _Parity:
    """Where one tree's messages sit while its rows hold the directions of one parity (see _Tree):
    every index a step needs, built once."""

    row_of: np.ndarray  # [E]: edge id -> the row holding that edge's message
    row_of_on_device: torch.Tensor
    leaf_rows: slice  # the rows received by leaves (contiguous),
    leaf_nodes: torch.Tensor  # and their receivers, row by row
    relay_rows: slice  # the rows received by workers of degree >= 2 (contiguous)
    # relay_rows in runs with distinct receivers; the receivers' rows of total
    sums: list[tuple[slice, torch.Tensor]]
    # slot r: for total's rows 0, 1, ..., the row of the r-th message that worker received
    slots: list[torch.Tensor]
    # all rows in runs with distinct receivers; the receivers
    received: list[tuple[slice, torch.Tensor]]


@dataclass
class _Tree:
    """One tree's share of RelaySum. Edge ids: in-slot order (slot r: from each worker's r-th
    neighbour, ascending, to it); ``counters`` and the checkpoint use them.

    Each undirected edge owns two rows of ``messages``; each step a message is replaced, in place,
    by the message its receiver sends back (m_ji -> m_ij = total_i - m_ji, or p_i at a leaf), so
    the two rows swap directions every step: ``parities[parity]`` says where everything sits now.
    Rows are laid out [rows to leaves | edges between inner workers | rows from leaves] at parity 0
    so that the rows received by leaves and by the others stay two contiguous blocks at both
    parities.
    """

    block: slice
    src: np.ndarray  # [E] by edge id
    dst: np.ndarray  # [E]
    reverse: np.ndarray  # [E]: the id of dst[e] -> src[e] (an involution)
    relays: torch.Tensor  # the workers of degree >= 2, by degree (descending): total's rows
    parities: tuple[_Parity, _Parity] | None  # None: one worker, no edge
    parity: int
    # [E, s]: the last message received on each edge (0 if lost), rows per parity
    messages: torch.Tensor
    total: torch.Tensor  # [len(relays), s] scratch: p_i + the messages relay i received
    # [E] float64 by edge id: parcels in each message (0 if lost); on the host, data-independent
    counters: np.ndarray


def _colours(nbrs: list[tuple[int, ...]], inner: list[bool]) -> dict[tuple[int, int], int]:
    """A proper edge colouring of the edges between inner workers (a forest): (u, v), u < v ->
    colour.
    Outward from each root, a worker's child edges take the lowest colours its parent edge does not
    use, so that each colour is a matching and there are at most max-degree colours."""
    colour: dict[tuple[int, int], int] = {}
    seen: set[int] = set()
    for root in (i for i, inside in enumerate(inner) if inside):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, -1)]
        while stack:
            u, used = stack.pop()
            free = (c for c in itertools.count() if c != used)
            for v in nbrs[u]:
                if inner[v] and v not in seen:
                    seen.add(v)
                    colour[(min(u, v), max(u, v))] = c = next(free)
                    stack.append((v, c))
    return colour


def _row_edges(
    nbrs: list[tuple[int, ...]], edge_id: dict[tuple[int, int], int]
) -> tuple[np.ndarray, range]:
    """Per row, the id of the edge it holds at parity 0: x -> leaf rows, by (which leaf of x, x);
    pairs
    of rows between inner workers, colour by colour; leaf -> x rows, in the order of the first
    block.
    Also the rows between inner workers."""
    n = len(nbrs)
    if n == 2:
        return np.array([edge_id[(0, 1)], edge_id[(1, 0)]]), range(0, 0)
    inner = [len(v) > 1 for v in nbrs]
    outer = sorted(
        (r, x, leaf)
        for x in range(n)
        if inner[x]
        for r, leaf in enumerate(v for v in nbrs[x] if not inner[v])
    )
    pairs = sorted((c, u, v) for (u, v), c in _colours(nbrs, inner).items())
    rows = [edge_id[(x, leaf)] for _, x, leaf in outer]
    rows += [edge_id[e] for _, u, v in pairs for e in ((u, v), (v, u))]
    rows += [edge_id[(leaf, x)] for _, x, leaf in outer]
    return np.array(rows, dtype=np.int64), range(len(outer), len(outer) + 2 * len(pairs))


def _runs(pieces: list[range], receivers: np.ndarray) -> list[slice]:
    """The rows of ``pieces``, in that order, cut into consecutive runs in which no worker receives
    twice: one indexed add per run, deterministic on any device (each target row is added to
    once)."""
    runs = []
    seen: set[Any]  # the receivers of the run so far
    for rows in pieces:
        start, seen = rows.start, set()
        for r in rows:
            if receivers[r] in seen:
                runs.append(slice(start, r))
                start, seen = r, set()
            seen.add(receivers[r])
        if rows.stop > start:
            runs.append(slice(start, rows.stop))
    return runs


def _block(mask: np.ndarray) -> slice:
    """The rows where ``mask`` holds, which must be one contiguous block."""
    where = np.flatnonzero(mask)
    block = slice(int(where[0]), int(where[-1]) + 1) if len(where) else slice(0, 0)
    if block.stop - block.start != len(where):
        raise RuntimeError("BatchedRelaySum's row layout lost a contiguous block")
    return block


def _parity(
    edges: np.ndarray,
    inner: range,
    dst: np.ndarray,
    degree: np.ndarray,
    relays: np.ndarray,
    device: torch.device,
) -> _Parity:
    """The indices for rows holding edges ``edges`` (row -> edge id); ``inner``: the rows between
    inner workers. Sums run over those rows first, then over the rows from leaves, at both parities:
    each worker adds its messages in the same order whichever rows hold them (bit-identical
    resumes)."""
    as_index = lambda values: torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)  # noqa: E731
    receivers = dst[edges]
    row_of = np.empty_like(edges)
    row_of[edges] = np.arange(len(edges))
    leaf_rows, relay_rows = _block(degree[receivers] == 1), _block(degree[receivers] > 1)
    # one of them empty
    from_leaves = [range(relay_rows.start, inner.start), range(inner.stop, relay_rows.stop)]
    relay_order = [inner, *from_leaves]
    position = np.empty(len(degree), dtype=np.int64)
    position[relays] = np.arange(len(relays))
    incoming = [np.flatnonzero(receivers == i) for i in relays]  # rows, per relay, by total's row
    slots = [
        as_index([rows[r] for rows in incoming if len(rows) > r])
        for r in range(len(incoming[0]) if incoming else 0)
    ]
    return _Parity(
        row_of=row_of,
        row_of_on_device=as_index(row_of),
        leaf_rows=leaf_rows,
        leaf_nodes=as_index(receivers[leaf_rows]),
        relay_rows=relay_rows,
        sums=[(run, as_index(position[receivers[run]])) for run in _runs(relay_order, receivers)],
        slots=slots,
        received=[
            (run, as_index(receivers[run]))
            for run in _runs([range(leaf_rows.start, leaf_rows.stop), *relay_order], receivers)
        ],
    )


def _add_rows(target: torch.Tensor, receivers: torch.Tensor, rows: torch.Tensor) -> None:
    """target[receivers] += rows, receivers distinct; target may be a column block of the models.
    On a CPU index_put_ (index_add_ into a column block is ~6x slower, measured); elsewhere
    index_add_ (CUDA's index_put_ with accumulate copies a non-contiguous target whole)."""
    if target.device.type == "cpu":
        target.index_put_((receivers,), rows, accumulate=True)
    else:
        target.index_add_(0, receivers, rows)


class BatchedRelaySum:
    """RelaySum (relaympi.algorithms.relaysum) for all workers: on each directed edge i -> j of tree
    k,
    m_ij(t) = p_i(t) + sum_{l in N(i) \\ {j}} m_li(t-1) = total_i - m_ji(t-1) with total_i = p_i +
    the
    messages i received (a leaf sends p_i), and counters c_ij(t) = 1 + sum_{l in N(i) \\ {j}}
    c_li(t-1).
    A lost message (DropPolicy, the round given to exchange, tag k) arrives empty: payload 0,
    counter 0.
    Tree k relays coordinate block k (coordinate_blocks). relays.Relays for every worker at once:
    parcels [N, numel], counts one per worker; ``bytes_sent[i, j]`` counts the bytes of i's messages
    to j.

    Memory per tree (rows of its block): the 2(N - 1) last messages, each overwritten in place by
    the message going back (_Tree), and ``total`` for the workers of degree >= 2; no step allocates
    a block-sized temporary (measured in tests/test_batched_algorithms.py: no more than message
    passing's RelaySum holds). As message passing, the last message per edge and no older model.
    """

    def __init__(
        self, topology: Any, like: torch.Tensor, drops: DropPolicy, bytes_sent: np.ndarray
    ):
        n, numel = like.shape
        self.n, self.drops, self.itemsize = n, drops, like.element_size()
        self.bytes_sent = bytes_sent
        self._counts: list[np.ndarray] = [np.ones(n) for _ in range(topology.num_layers)]
        self._device = _DeviceCounts(like)
        opts: dict[str, Any] = {"dtype": like.dtype, "device": like.device}
        self.trees: list[_Tree] = []
        for k, block in enumerate(topology.coordinate_blocks(numel)):
            nbrs = [tuple(topology.neighbors(i, k)) for i in range(n)]
            edges = [
                (nbrs[i][r], i)
                for r in range(max(len(v) for v in nbrs))
                for i in range(n)
                if len(nbrs[i]) > r
            ]
            edge_id = {e: position for position, e in enumerate(edges)}
            src = np.array([e[0] for e in edges], dtype=np.int64)
            dst = np.array([e[1] for e in edges], dtype=np.int64)
            reverse = np.array([edge_id[(j, i)] for i, j in edges], dtype=np.int64)
            degree = np.array([len(v) for v in nbrs])
            relays = np.array(
                sorted((i for i in range(n) if degree[i] > 1), key=lambda i: (-degree[i], i)),
                dtype=np.int64,
            )
            parities: tuple[_Parity, _Parity] | None = None
            if edges:
                at_zero, inner = _row_edges(nbrs, edge_id)
                parities = (
                    _parity(at_zero, inner, dst, degree, relays, like.device),
                    _parity(reverse[at_zero], inner, dst, degree, relays, like.device),
                )
            size = block.stop - block.start
            self.trees.append(
                _Tree(
                    block=block,
                    src=src,
                    dst=dst,
                    reverse=reverse,
                    relays=torch.as_tensor(relays, device=like.device),
                    parities=parities,
                    parity=0,
                    messages=torch.zeros(len(edges), size, **opts),
                    total=torch.zeros(len(relays), size, **opts),
                    counters=np.zeros(len(edges)),
                )
            )

    def exchange(self, parcel: torch.Tensor, round: int) -> None:
        """Send this step's messages built from ``parcel`` [N, numel] (every worker's) in round
        ``round``
        (counts() then says how many parcels each sum holds). Counts the bytes sent."""
        counts: list[np.ndarray] = []
        for k, tree in enumerate(self.trees):
            if tree.parities is None:  # one worker: nothing to relay
                counts.append(np.ones(self.n))
                continue
            sent, arrived = delivered(self.drops, round, k, tree.src, tree.dst)
            self.bytes_sent[tree.src[sent], tree.dst[sent]] += (
                tree.messages.shape[1] + 1
            ) * self.itemsize
            now, after = tree.parities[tree.parity], tree.parities[1 - tree.parity]
            parcel_k, messages = parcel[:, tree.block], tree.messages
            torch.index_select(parcel_k, 0, tree.relays, out=tree.total)
            for run, positions in now.sums:
                tree.total.index_add_(0, positions, messages[run])
            messages[now.relay_rows].neg_()  # then + total: m_ij = total_i - m_ji, in m_ji's row
            for rows in now.slots:
                messages.index_add_(0, rows, tree.total[: len(rows)])
            # a leaf sends its parcel
            torch.index_select(parcel_k, 0, now.leaf_nodes, out=messages[now.leaf_rows])
            lost = np.flatnonzero(~arrived)
            if len(lost):
                messages.index_fill_(0, to_device(after.row_of[lost], None, messages.device), 0)
            tree.parity = 1 - tree.parity
            # counters, on the host (they depend only on which messages were lost)
            held = np.bincount(tree.dst, weights=tree.counters, minlength=self.n)
            tree.counters = np.where(
                arrived, 1.0 + held[tree.src] - tree.counters[tree.reverse], 0.0
            )
            counts.append(1.0 + np.bincount(tree.dst, weights=tree.counters, minlength=self.n))
        self._counts = counts

    def counts(self) -> list[np.ndarray]:
        """Per tree, n-bar [N] (float64, on the host): 1 + the counters each worker received this
        step."""
        return self._counts

    def factor(self, values: np.ndarray, layer: int) -> torch.Tensor:
        """``values`` [N] as an [N, 1] factor of coords(X, layer), in X's dtype on X's device."""
        return self._device(layer, values)

    def add_received(
        self, out: torch.Tensor, divide_by: list[torch.Tensor | float] | None = None
    ) -> None:
        """out[:, block k] += the messages received this step, then /= divide_by[k] (a float or [N,
        1])."""
        for k, tree in enumerate(self.trees):
            target = out[:, tree.block]
            if tree.parities is not None:
                for rows, receivers in tree.parities[tree.parity].received:
                    _add_rows(target, receivers, tree.messages[rows])
            if divide_by is not None:
                target.div_(divide_by[k])

    def coords(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """Every worker's block that tree ``layer`` relays: columns of ``flat`` [N, numel], a
        view."""
        return flat[:, self.trees[layer].block]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Messages [E, s] and counters [E] by edge id (the messages a copy: rows move every
        step)."""
        state = {}
        for k, tree in enumerate(self.trees):
            parity = tree.parities and tree.parities[tree.parity]
            state[f"messages.{k}"] = (
                tree.messages.index_select(0, parity.row_of_on_device) if parity else tree.messages
            )
            state[f"counters.{k}"] = torch.from_numpy(tree.counters)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, tree in enumerate(self.trees):
            tree.parity = 0
            if tree.parities is not None:
                rows = tree.parities[0].row_of_on_device
                tree.messages.index_copy_(0, rows, state[f"messages.{k}"].to(tree.messages))
            tree.counters = state[f"counters.{k}"].cpu().numpy().astype(np.float64, copy=True)


class _DeviceCounts:
    """Counts per worker (n-bar, or n - n-bar) as [N, 1] device tensors, sent to the device only
    when they change."""

    def __init__(self, like: torch.Tensor):
        self._opts: dict[str, Any] = {"dtype": like.dtype, "device": like.device}
        self._cache: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def __call__(self, layer: int, values: np.ndarray) -> torch.Tensor:
        cached = self._cache.get(layer)
        if cached is None or not np.array_equal(cached[0], values):
            cached = (values.copy(), to_device(values[:, None], **self._opts))
            self._cache[layer] = cached
        return cached[1]

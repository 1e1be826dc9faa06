"""RelaySum over all workers at once: the messages of every directed tree edge as one [E, s] tensor per
layer; RelaySGD and RelaySGD/Grad on top of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relaympi.algorithms import round_id
from relaympi.batched.base import BatchedAlgorithm, delivered, to_device
from relaympi.comm import DropPolicy


@dataclass
class _Tree:
    """One tree's share of RelaySum: directed edges e = src[e] -> dst[e], ordered by in-slot.

    In-slot r holds, for every worker i of degree > r, the edge from i's r-th neighbour (ascending)
    to i: edges slots[r] (a contiguous range) land on workers slot_nodes[r]. Slot 0 is every
    worker in rank order, so the sum a worker received starts as a copy and then adds its
    neighbours' messages in ascending order, as message passing's _sum_rows does.
    """

    block: slice
    src: np.ndarray  # [E]
    dst: np.ndarray  # [E]
    reverse: np.ndarray  # [E]: the index of dst[e] -> src[e] (an involution)
    reverse_on_device: torch.Tensor
    sources: torch.Tensor  # [E] src on the device
    slots: list[tuple[slice, torch.Tensor]]
    messages: torch.Tensor  # [E, s]: the last message received on each edge (0 if lost)
    spare: torch.Tensor  # [E, s]: next step's messages are assembled here, then swapped in
    counters: np.ndarray  # [E] float64: parcels in each message (0 if lost); on the host, data-independent
    inbox: torch.Tensor  # [N, s]: per worker, the sum of the messages it holds


class BatchedRelaySum:
    """RelaySum (relaympi.algorithms.relaysum) for all workers: on each directed edge i -> j of tree k,
    m_ij(t) = p_i(t) + sum_{l in N(i) \\ {j}} m_li(t-1) = (p_i + inbox_i) - m_ji(t-1), with counters
    c_ij(t) = 1 + sum_{l in N(i) \\ {j}} c_li(t-1). A lost message (DropPolicy, round round_id(step),
    tag k) arrives empty: payload 0, counter 0. Tree k relays coordinate block k (coordinate_blocks).

    Held per tree: the received messages, the buffer the next ones are assembled in, and each
    worker's inbox sum; as message passing, the last message per edge and no older model.
    """

    def __init__(self, topology: Any, like: torch.Tensor, drops: DropPolicy):
        n, numel = like.shape
        self.n, self.drops, self.itemsize = n, drops, like.element_size()
        opts = {"dtype": like.dtype, "device": like.device}
        self.trees: list[_Tree] = []
        for k, block in enumerate(topology.coordinate_blocks(numel)):
            nbrs = [topology.neighbors(i, k) for i in range(n)]
            edges, slots = [], []
            for r in range(max(len(v) for v in nbrs)):
                nodes = [i for i in range(n) if len(nbrs[i]) > r]
                slots.append((slice(len(edges), len(edges) + len(nodes)), torch.as_tensor(nodes, device=like.device)))
                edges += [(nbrs[i][r], i) for i in nodes]
            index = {e: position for position, e in enumerate(edges)}
            reverse = np.array([index[(j, i)] for i, j in edges], dtype=np.int64)
            size = block.stop - block.start
            self.trees.append(_Tree(
                block=block,
                src=np.array([e[0] for e in edges], dtype=np.int64),
                dst=np.array([e[1] for e in edges], dtype=np.int64),
                reverse=reverse,
                reverse_on_device=torch.as_tensor(reverse, device=like.device),
                sources=torch.as_tensor([e[0] for e in edges], dtype=torch.int64, device=like.device),
                slots=slots,
                messages=torch.zeros(len(edges), size, **opts),
                spare=torch.zeros(len(edges), size, **opts),
                counters=np.zeros(len(edges)),
                inbox=torch.zeros(n, size, **opts),
            ))

    def exchange(self, parcels: torch.Tensor, step: int, bytes_sent: np.ndarray) -> list[np.ndarray]:
        """Send this step's messages built from ``parcels`` [N, numel]; per tree, n-bar [N] (float64):
        1 + the counters received, how many parcels each worker's sum holds. Counts the bytes sent."""
        counts = []
        for k, tree in enumerate(self.trees):
            if not len(tree.src):  # one worker: nothing to relay
                counts.append(np.ones(self.n))
                continue
            arrived = delivered(self.drops, round_id(step), k, tree.src, tree.dst)
            bytes_sent[tree.src[arrived], tree.dst[arrived]] += (tree.inbox.shape[1] + 1) * self.itemsize
            # payloads: inbox + parcel per worker, gathered per edge, minus what the edge's target sent
            tree.inbox.add_(parcels[:, tree.block])
            torch.index_select(tree.inbox, 0, tree.sources, out=tree.spare)
            tree.spare.index_add_(0, tree.reverse_on_device, tree.messages, alpha=-1)  # spare[reverse[e]] -= messages[e]
            lost = np.flatnonzero(~arrived)
            if len(lost):
                tree.spare.index_fill_(0, to_device(lost, None, tree.spare.device), 0)
            tree.messages, tree.spare = tree.spare, tree.messages
            # counters, on the host (they depend only on which messages were lost)
            held = np.bincount(tree.dst, weights=tree.counters, minlength=self.n)
            tree.counters = np.where(arrived, 1.0 + held[tree.src] - tree.counters[tree.reverse], 0.0)
            self._sum_inbox(tree)
            counts.append(1.0 + np.bincount(tree.dst, weights=tree.counters, minlength=self.n))
        return counts

    @staticmethod
    def _sum_inbox(tree: _Tree) -> None:
        """inbox_i = the messages worker i holds, summed in ascending neighbour order (slot by slot)."""
        first, _ = tree.slots[0]
        tree.inbox.copy_(tree.messages[first])
        for edges, nodes in tree.slots[1:]:
            tree.inbox.index_add_(0, nodes, tree.messages[edges])  # each worker once per slot

    def add_received(self, out: torch.Tensor, divide_by: list[torch.Tensor | float] | None = None) -> None:
        """out[:, block k] += the sum of messages received this step, then /= divide_by[k] (a float or [N, 1])."""
        for k, tree in enumerate(self.trees):
            target = out[:, tree.block]
            if len(tree.src):
                target.add_(tree.inbox)
            if divide_by is not None:
                target.div_(divide_by[k])

    def coords(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        return flat[:, self.trees[layer].block]

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for k, tree in enumerate(self.trees):
            state[f"messages.{k}"] = tree.messages
            state[f"counters.{k}"] = torch.from_numpy(tree.counters)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, tree in enumerate(self.trees):
            tree.messages.copy_(state[f"messages.{k}"])
            tree.counters = state[f"counters.{k}"].cpu().numpy().astype(np.float64, copy=True)
            if len(tree.src):
                self._sum_inbox(tree)


class _DeviceCounts:
    """n-bar per worker as [N, 1] device tensors, sent to the device only when they change."""

    def __init__(self, like: torch.Tensor):
        self._opts = {"dtype": like.dtype, "device": like.device}
        self._cache: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def __call__(self, layer: int, values: np.ndarray) -> torch.Tensor:
        cached = self._cache.get(layer)
        if cached is None or not np.array_equal(cached[0], values):
            cached = (values.copy(), to_device(values[:, None], **self._opts))
            self._cache[layer] = cached
        return cached[1]


class BatchedRelaySGD(BatchedAlgorithm):
    """X(t+1/2) = X + U; relay X(t+1/2); per tree with n-bar parcels received (relaympi.algorithms.relay):
    counts: (x(t+1/2) + sum) / n-bar; previous: (x(t+1/2) + sum + (n - n-bar) x(t)) / n;
    initial: (x(t+1/2) + sum + (n - n-bar) x(0)) / n."""

    name = "relay"

    def __init__(self, topology, optimizer, X0, options, drops):
        super().__init__(topology, optimizer, X0, options, drops)
        self.mode = options.relay_mode
        self.relay = BatchedRelaySum(topology, X0, drops)
        self.x_initial = X0.detach().clone() if self.mode == "initial" else None
        self._device = _DeviceCounts(X0)

    def step(self, X, G, lr, step):
        u = self.optimizer.update(G, X, lr, apply=True)  # X(t+1/2)
        counts = self.relay.exchange(X, step, self.bytes_sent)
        if self.mode == "counts":
            self.relay.add_received(X, divide_by=[self._device(k, c) for k, c in enumerate(counts)])
            return
        for k, nbar in enumerate(counts):
            missing = self.n - nbar
            if not missing.any():
                continue
            xs, m = self.relay.coords(X, k), self._device(k, missing)
            if self.mode == "previous":  # x(t) = x(t+1/2) - u(t); rows with nothing missing stay as they are
                xs.mul_(1.0 + m).addcmul_(self.relay.coords(u, k), -m)
            else:
                xs.addcmul_(self.relay.coords(self.x_initial, k), m)
        self.relay.add_received(X, divide_by=[float(self.n)] * len(counts))

    def state_dict(self):
        return self.relay.state_dict()

    def load_state_dict(self, state):
        self.relay.load_state_dict(state)


class BatchedRelaySGDGrad(BatchedAlgorithm):
    """U = local updates; relay U; X(t+1) = X + (U + sum) / n."""

    name = "relay-grad"

    def __init__(self, topology, optimizer, X0, options, drops):
        super().__init__(topology, optimizer, X0, options, drops)
        self.relay = BatchedRelaySum(topology, X0, drops)
        self._total = torch.zeros_like(X0)

    def step(self, X, G, lr, step):
        u = self.optimizer.update(G, X, lr, apply=False)
        self.relay.exchange(u, step, self.bytes_sent)
        self._total.copy_(u)
        self.relay.add_received(self._total)
        X.add_(self._total, alpha=1.0 / self.n)

    def state_dict(self):
        return self.relay.state_dict()

    def load_state_dict(self, state):
        self.relay.load_state_dict(state)

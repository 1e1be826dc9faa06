"""The Mixers of relaympi.algorithms.gossip over every worker at once: gossip as a W product on X
[N, d],
RelaySum as relaympi.batched.relay.BatchedRelaySum."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from relaympi.batched.base import delivered, never_drops, to_device
from relaympi.batched.relay import BatchedRelaySum
from relaympi.comm import DropPolicy
from relaympi.comm.base import checked_nodes
from relaympi.comm.tree_allreduce import stage_order, tree_bytes
from relaympi.topology import Topology

# columns of X per float64 product in mix: bounds its temporaries to 2 x N x MIX_COLUMNS float64s
MIX_COLUMNS = 1 << 18


def mix(weights: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> None:
    """out = weights @ X, each float32 entry the rounding of its float64 sum.

    A float32 matmul may run in TF32 (a model may switch it on for speed, torch's global matmul
    precision), which would round every model to a 10-bit mantissa in each average. Products and
    sums in float64, column block by column block, are exact to float32 whatever that setting,
    without touching it. The inner dimension is the number of workers, so the product stays
    memory-bound: the float64 copies cost two extra passes over each block (GPUs with slow
    float64, consumer cards, pay more)."""
    if X.dtype != torch.float32:
        torch.mm(weights.to(X.dtype), X, out=out)
        return
    W64 = weights.to(torch.float64)
    for start in range(0, X.shape[1], MIX_COLUMNS):
        block = slice(start, start + MIX_COLUMNS)
        out[:, block] = torch.mm(W64, X[:, block].to(torch.float64))


class BatchedMixer:
    """GossipMixer for all workers as one matmul with a dense W on the device.

    Every worker i receives x_j from each j != i with W_ij != 0 (in round ``round``, tag ``tag``);
    a lost message's weight is dropped and the receiver's remaining weights renormalized to sum to
    one, with the divisor GossipMixer computes.
    """

    def __init__(
        self,
        mixing: np.ndarray,
        like: torch.Tensor,
        drops: DropPolicy,
        bytes_sent: np.ndarray,
        scratch: torch.Tensor,
    ):
        self.dst, self.src = (
            a.astype(np.int64) for a in np.nonzero(mixing * (1 - np.eye(mixing.shape[0])))
        )
        self.mixing = mixing
        self.drops = drops
        self.bytes_sent = bytes_sent
        self.nbytes = like.shape[-1] * like.element_size()  # one message: one worker's row
        self._opts: dict[str, Any] = {"dtype": like.dtype, "device": like.device}
        self._fixed = (
            self._weights(np.ones(len(self.src), dtype=bool)) if never_drops(drops) else None
        )
        self._mixed = scratch  # shaped as like

    def _weights(self, arrived: np.ndarray) -> torch.Tensor:
        """W with lost messages' weights dropped, each row divided by self weight + (0 + the kept
        weights in neighbour order): the divisor GossipMixer computes."""
        n, w = self.mixing.shape[0], self.mixing
        kept = np.zeros_like(w)
        kept[self.dst[arrived], self.src[arrived]] = w[self.dst[arrived], self.src[arrived]]
        others = np.zeros(n)
        for j in range(n):  # column by column: per row, the neighbours' weights in ascending order
            others += kept[:, j]
        total = np.diag(w) + others
        out = kept / total[:, None]
        np.fill_diagonal(out, np.diag(w) / total)
        return to_device(out, **self._opts)

    def mix(self, X: torch.Tensor, round: int, tag: int = 0) -> None:
        """In place: X <- W(round) X, with this round's lost messages; counts the bytes of each
        message sent."""
        if self._fixed is not None:
            self.bytes_sent[self.src, self.dst] += self.nbytes
            weights = self._fixed
        else:
            sent, arrived = delivered(self.drops, round, tag, self.src, self.dst)
            self.bytes_sent[self.src[sent], self.dst[sent]] += self.nbytes
            weights = self._weights(arrived)
        mix(weights, X, self._mixed)
        X.copy_(self._mixed)

    def start(
        self, X: torch.Tensor, lo: int, hi: int, round: int, tag: int = 0, chunk: int = 0
    ) -> _Deferred:
        """The whole mix at finish() ([lo, hi) must be every coordinate)."""
        return _Deferred(lambda X: self.mix(X, round, tag), X, lo, hi)


class _Deferred:
    """A batched mix or mean, run whole at finish(): the batched engine has no wire to overlap."""

    def __init__(
        self, run: Callable[[torch.Tensor], object], X: torch.Tensor, lo: int, hi: int
    ) -> None:
        if (lo, hi) != (0, X.shape[-1]):
            raise ValueError(
                f"the batched engine steps whole models: got the range [{lo}, {hi}) of "
                f"{X.shape[-1]} coordinates"
            )
        self.run, self.X = run, X

    def test(self) -> bool:
        return False  # nothing runs before finish()

    def finish(self) -> None:
        self.run(self.X)


class BatchedMixers:
    """gossip.Mixers for X [N, d]: ``bytes_sent[i, j]`` counts the bytes of worker i's messages to
    j.
    Mixers of the same shape share one scratch buffer (an algorithm's mixers take turns).
    ``nodes``: each worker's node (None: one node), for the all-reduce tree's stage order."""

    def __init__(
        self, drops: DropPolicy, bytes_sent: np.ndarray, nodes: Sequence[int] | None = None
    ):
        self.drops = drops
        self.bytes_sent = bytes_sent
        self.sum_order = stage_order(checked_nodes(nodes, bytes_sent.shape[0]))
        self._scratch: dict[tuple[int, ...], torch.Tensor] = {}
        self._tree_bytes: dict[tuple[int, int], np.ndarray] = {}  # (numel, itemsize) -> [N, N]

    def gossip(self, mixing: np.ndarray, like: torch.Tensor) -> BatchedMixer:
        if tuple(like.shape) not in self._scratch:
            self._scratch[tuple(like.shape)] = torch.zeros_like(like)
        return BatchedMixer(
            mixing, like, self.drops, self.bytes_sent, self._scratch[tuple(like.shape)]
        )

    def allreduce_mean(self, X: torch.Tensor) -> None:
        X.copy_((X.sum(dim=0) / X.shape[0]).expand_as(X))

    def start_allreduce_mean(self, X: torch.Tensor) -> _Deferred:
        """The mean at finish(), counting the messages of message passing's fixed-tree all-reduce
        (Communicator.count_tree_sum: bfloat16/float16 as float32)."""

        def counted_mean(X: torch.Tensor) -> None:
            numel = X.shape[-1]
            itemsize = 4 if X.dtype in (torch.float16, torch.bfloat16) else X.element_size()
            if (numel, itemsize) not in self._tree_bytes:
                self._tree_bytes[numel, itemsize] = tree_bytes(
                    X.shape[0], numel, self.sum_order, itemsize
                )
            self.bytes_sent += self._tree_bytes[numel, itemsize]
            self.allreduce_mean(X)

        return _Deferred(counted_mean, X, 0, X.shape[-1])

    def relays(
        self,
        topology: Topology,
        like: torch.Tensor,
        in_place: bool = False,
        chunk: int | None = None,
    ) -> BatchedRelaySum:
        """RelaySum for X [N, d]. ``in_place`` and ``chunk`` shape message passing's buffers and do
        not
        apply here: the messages of each tree are one tensor, overwritten in place every step."""
        return BatchedRelaySum(topology, like, self.drops, self.bytes_sent)

"""The fixed-tree sum behind MPICommunicator.iallreduce_sum: which messages each rank exchanges, in
which order, and what it adds. Every element is summed in one tree whatever the buffer's length, so
pieces of a buffer reduced separately give the whole reduction's bits.

No MPI import: ``tree_sum`` takes any communicator with Get_rank, Get_size, Isend and Irecv, and
yields the requests of each stage; the MPI communicator (relaympi.comm.mpi) waits on them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# tags per nonblocking all-reduce on its own communicator: one per stage (a fold, log2 n
# halvings, log2 n doublings, an unfold), so stages and all-reduces in flight can never match
# each other's messages
SUM_STAGES = 64


def stage_order(nodes: Sequence[int]) -> tuple[int, ...]:
    """The partner bits d of tree_sum's halving stages, in stage order: the bits that pair ranks on
    the same node first (fewest pairs r, r ^ d across nodes), so the halves that cross between nodes
    are the smallest (m nodes of 2^k consecutive ranks: each rank sends 2 (1 - 1/m) / 2^k of its
    buffer's size to other nodes, against 2 (1 - 1/m) in the order p/2, ..., 1). Ties keep that
    order: on one node (every bit ties) it, and so every sum's bits, are those of the tree before
    node-awareness."""
    n = len(nodes)
    p = 1 << (n.bit_length() - 1)
    bits = [1 << i for i in range(p.bit_length() - 1)]
    return tuple(sorted(bits, key=lambda d: (sum(nodes[r] != nodes[r ^ d] for r in range(p)), -d)))


def tree_sum(
    comm: Any,
    data: np.ndarray,
    tag: int,
    order: Sequence[int],
    sent: np.ndarray | None = None,
) -> Iterator[list]:
    """buf <- the sum over ranks, as a generator that yields each stage's MPI requests.

    A reduce-scatter by recursive halving, then an allgather by recursive doubling, over
    point-to-point messages (Rabenseifner's all-reduce): with p the largest power of two <= n,
    rank p + q first adds its data to rank q's; at the stage of each bit d of ``order``
    (stage_order: p/2, p/4, ..., 1 on one node) rank r keeps half of its segment, sends the other
    half to r ^ d and adds what r ^ d sends back; the allgather undoes the stages in reverse. Every
    element is thus summed in one fixed tree, x_q + x_(q+p) at the leaves then pairs r, r ^ d in
    ``order``, whatever the buffer's length and whichever rank holds the element: pieces of a buffer
    reduced separately give the whole reduction's bits, which MPI_Allreduce does not promise
    (MPICH's
    ring and Open MPI's segmented ring sum an element in an order set by the message's length).

    ``sent`` (bytes per destination rank, as Communicator.bytes_sent) counts each message as it is
    posted: what ``tree_sends`` lists."""
    rank, n = comm.Get_rank(), comm.Get_size()
    p = 1 << (n.bit_length() - 1)
    extra = n - p

    def send(buf: np.ndarray, dest: int, tag: int) -> Any:
        if sent is not None:
            sent[dest] += buf.nbytes
        return comm.Isend(buf, dest=dest, tag=tag)

    if rank >= p:  # folded into rank - p, which sends the sum back at the end
        yield [send(data, rank - p, tag)]
        yield [comm.Irecv(data, source=rank - p, tag=tag + SUM_STAGES - 1)]
        return
    scratch = np.empty(len(data) if rank < extra else (len(data) + 1) // 2, dtype=data.dtype)
    if rank < extra:
        yield [comm.Irecv(scratch, source=rank + p, tag=tag)]
        data += scratch
    lo, hi, stage, splits = 0, len(data), 1, []
    for d in order:
        partner, mid = rank ^ d, lo + (hi - lo) // 2
        (keep_lo, keep_hi), (give_lo, give_hi) = (
            ((mid, hi), (lo, mid)) if rank & d else ((lo, mid), (mid, hi))
        )
        received = scratch[: keep_hi - keep_lo]
        yield [
            comm.Irecv(received, source=partner, tag=tag + stage),
            send(data[give_lo:give_hi], partner, tag + stage),
        ]
        data[keep_lo:keep_hi] += received
        splits.append((lo, hi))
        lo, hi, stage = keep_lo, keep_hi, stage + 1
    for d in reversed(
        order
    ):  # allgather: the partner holds the other part of the segment split at this stage
        partner, (seg_lo, seg_hi) = rank ^ d, splits.pop()
        other = data[seg_lo:lo] if lo > seg_lo else data[hi:seg_hi]
        yield [
            comm.Irecv(other, source=partner, tag=tag + stage),
            send(data[lo:hi], partner, tag + stage),
        ]
        lo, hi, stage = seg_lo, seg_hi, stage + 1
    if rank < extra:
        yield [send(data, rank + p, tag + SUM_STAGES - 1)]


def tree_sends(rank: int, n: int, numel: int, order: Sequence[int]) -> list[tuple[int, int]]:
    """(destination, elements) of every message ``tree_sum`` sends from ``rank`` of ``n`` for a
    buffer of ``numel`` elements, in posting order: the fold (a rank beyond the largest power of
    two p sends its buffer to rank - p, which sends the sum back at the end), the half each halving
    stage gives away, and the part each doubling stage holds."""
    p = 1 << (n.bit_length() - 1)
    if rank >= p:
        return [(rank - p, numel)]
    sends, lo, hi, splits = [], 0, numel, []
    for d in order:
        mid = lo + (hi - lo) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & d else ((lo, mid), (mid, hi))
        sends.append((rank ^ d, give[1] - give[0]))
        splits.append((lo, hi))
        lo, hi = keep
    for d in reversed(order):
        sends.append((rank ^ d, hi - lo))
        lo, hi = splits.pop()
    if rank < n - p:
        sends.append((rank + p, numel))
    return sends


def tree_bytes(n: int, numel: int, order: Sequence[int], itemsize: int) -> np.ndarray:
    """[n, n] int64: the bytes rank i sends rank j in one ``tree_sum`` of ``numel`` elements of
    ``itemsize`` bytes (row i is what rank i's Communicator.bytes_sent grows by)."""
    out = np.zeros((n, n), dtype=np.int64)
    for rank in range(n):
        for dest, count in tree_sends(rank, n, numel, order):
            out[rank, dest] += count * itemsize
    return out

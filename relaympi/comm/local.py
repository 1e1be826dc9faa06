"""In-process backend: n ranks as threads of one process, with the MPI backend's semantics."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from relaympi.comm import buffers
from relaympi.comm.base import (
    Communicator,
    DropPolicy,
    PeerLost,
    RemoteFailure,
    Request,
    Vanished,
    checked_nodes,
    number_nodes,
)


class WorldAborted(RemoteFailure):
    """Raised in every rank's blocking call once some rank of the local world failed."""


class LocalWorld:
    """Shared mailboxes and collective rendezvous for ``world_size`` in-process ranks.

    Sends are buffered (the payload is copied when posted), so a send never blocks and
    a receive completes once the matching message was posted, as with MPI's eager protocol.
    Collectives reduce in rank order, so results do not depend on thread scheduling.
    """

    def __init__(
        self, world_size: int, drops: DropPolicy | None = None, nodes: Sequence[int] | None = None
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.drops = drops or DropPolicy()
        # each rank's node (emulated: one process is one node; None: every rank on node 0)
        self.nodes = checked_nodes(nodes, world_size)
        self._cond = threading.Condition()
        self._mail: dict[tuple[int, int, int], deque] = defaultdict(deque)
        self._aborted: str | None = None
        self._slots: list[Any] = [None] * world_size
        self._arrived = 0
        self._generation = 0
        self._result: Any = None
        self._sums: dict[
            int, _PendingSum
        ] = {}  # nonblocking all-reduces in flight, by sequence number
        # membership (--on-failure continue): ranks that vanished, whether losses are survived
        # (else a vanished rank aborts the world), and the survivors' shrink rendezvous
        self.lost: set[int] = set()
        self.survives = False
        self.revoked = False  # a survivor noticed a loss: every rank's next call raises PeerLost
        self._shrinking: set[int] = set()
        self._shrunk: tuple[LocalWorld, tuple[int, ...], tuple[int, ...]] | None = None
        # agree(): the votes of the round in progress, and each finished round's (AND, lost)
        self._votes: dict[int, bool] = {}
        self._agreed: list[tuple[bool, bool]] = []

    def communicator(self, rank: int) -> LocalCommunicator:
        return LocalCommunicator(self, rank)

    def abort(self, reason: str) -> None:
        with self._cond:
            if self._aborted is None:
                self._aborted = reason
            self._cond.notify_all()
            shrunk = self._shrunk
        if shrunk is not None:  # the survivors' world: a failure there must release them too
            shrunk[0].abort(reason)

    def _check(self, peer: int | None = None, arrived: int = 0) -> None:
        """Raise where this call cannot complete (the caller holds ``_cond``): the world aborted;
        or, where losses are survived, a survivor revoked the world, or the call waits for a lost
        rank: its ``peer``, or, for a collective, once every rank not lost has ``arrived`` in it.
        A survivor that raises revokes the world, as an MPI survivor revokes its communicators:
        as on MPI, a loss reaches a rank only through a call that needs the lost rank, or through
        that revocation (so survivors that need nothing of the lost rank finish their step)."""
        if self._aborted is not None:
            raise WorldAborted(f"local world aborted: {self._aborted}")
        if not (self.lost and self.survives):
            return
        stuck = arrived >= self.world_size - len(self.lost) if peer is None else peer in self.lost
        if self.revoked or stuck:
            if not self.revoked:
                self.revoked = True
                self._cond.notify_all()
            lost = ", ".join(str(r) for r in sorted(self.lost))
            raise PeerLost(f"local world revoked: rank {lost} lost")

    def lose(self, rank: int) -> None:
        """Rank ``rank`` vanished: every survivor's call that needs it raises PeerLost (and revokes
        the world), or the world is aborted where losses are not survived."""
        with self._cond:
            self.lost.add(rank)
            if not self.survives and self._aborted is None:
                self._aborted = f"rank {rank} vanished"
            self._cond.notify_all()

    def agree(self, rank: int, flag: bool) -> bool:
        """Rank ``rank``'s vote in a uniform agreement of the ranks not lost (MPI_Comm_agree): once
        each of them voted, the AND of the votes, or PeerLost on every one of them where a rank was
        lost."""
        with self._cond:
            round_ = len(self._agreed)
            self._votes[rank] = flag
            self._cond.notify_all()
            while len(self._agreed) == round_:
                if self._aborted is not None:
                    raise WorldAborted(f"local world aborted: {self._aborted}")
                alive = set(range(self.world_size)) - self.lost
                if alive <= set(self._votes):
                    votes = [self._votes[r] for r in sorted(alive)]
                    self._agreed.append((all(votes), bool(self.lost) and self.survives))
                    self._votes = {}
                    self._cond.notify_all()
                    break
                self._cond.wait(timeout=1.0)
            value, failed = self._agreed[round_]
        if failed:
            lost = ", ".join(str(r) for r in sorted(self.lost))
            raise PeerLost(f"local world revoked: rank {lost} lost")
        return value

    def shrink(self, rank: int) -> tuple[LocalWorld, int, tuple[int, ...]]:
        """Rank ``rank``'s part of the survivors' shrink: once every rank not lost arrived, the
        survivors' new world (ranks in old order, nodes kept), this rank's rank in it and the old
        ranks lost."""
        with self._cond:
            if self._aborted is not None:
                raise WorldAborted(f"local world aborted: {self._aborted}")
            self._shrinking.add(rank)
            self._cond.notify_all()
            while self._shrunk is None:
                alive = set(range(self.world_size)) - self.lost
                if alive <= self._shrinking:
                    survivors = tuple(sorted(alive))
                    world = LocalWorld(
                        len(survivors),
                        self.drops,
                        number_nodes([self.nodes[r] for r in survivors]),
                    )
                    world.survives = True
                    self._shrunk = (world, survivors, tuple(sorted(self.lost)))
                    self._cond.notify_all()
                    break
                if self._aborted is not None:
                    raise WorldAborted(f"local world aborted: {self._aborted}")
                self._cond.wait(timeout=1.0)
            world, survivors, lost = self._shrunk
            return world, survivors.index(rank), lost

    def _deliver(self, src: int, dst: int, tag: int, payload: Any) -> None:
        with self._cond:
            self._mail[(src, dst, tag)].append(payload)
            self._cond.notify_all()

    def _take(self, src: int, dst: int, tag: int, block: bool) -> Any:
        key = (src, dst, tag)
        with self._cond:
            while not self._mail[key]:
                self._check(src)
                if not block:
                    return None
                self._cond.wait(timeout=1.0)
            return self._mail[key].popleft()

    def _has(self, src: int, dst: int, tag: int) -> bool:
        with self._cond:
            return bool(self._mail[(src, dst, tag)])

    def _collective(self, rank: int, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        with self._cond:
            self._check(arrived=-1)  # revoked or aborted
            generation = self._generation
            self._slots[rank] = value
            self._arrived += 1
            self._cond.notify_all()
            if self._arrived == self.world_size:
                self._result = combine(list(self._slots))
                self._slots = [None] * self.world_size
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
            else:
                while self._generation == generation:
                    self._check(arrived=self._arrived)
                    self._cond.wait(timeout=1.0)
            return self._result

    def _start_sum(
        self, rank: int, seq: int, value: Any, combine: Callable[[Any, Any], Any] | None = None
    ) -> None:
        """Rank ``rank``'s contribution to the ``seq``-th nonblocking all-reduce; the last one sums
        in rank order (or folds them with ``combine``: the maximum of iallreduce_max)."""
        with self._cond:
            self._check(arrived=-1)  # revoked or aborted
            pending = self._sums.setdefault(seq, _PendingSum(self.world_size))
            pending.values[rank] = value
            pending.arrived += 1
            if pending.arrived == self.world_size:
                total = buffers.clone(pending.values[0])
                for v in pending.values[1:]:
                    if combine is None:
                        total += v
                    else:
                        total = combine(total, v)
                pending.total, pending.values = total, []
                self._cond.notify_all()

    def _sum_ready(self, seq: int) -> bool:
        with self._cond:
            self._check(arrived=self._sums[seq].arrived)
            return self._sums[seq].total is not None

    def _take_sum(self, seq: int, buf: Any) -> None:
        """Copy the ``seq``-th all-reduce's sum into buf once every rank contributed (blocks until
        then)."""
        with self._cond:
            pending = self._sums[seq]
            while pending.total is None:
                self._check(arrived=pending.arrived)
                self._cond.wait(timeout=1.0)
            buffers.copy_into(buf, pending.total)
            pending.taken += 1
            if pending.taken == self.world_size:
                del self._sums[seq]


class _PendingSum:
    def __init__(self, world_size: int):
        self.values: list[Any] = [None] * world_size
        self.arrived = 0
        self.total: Any = None
        self.taken = 0


class _LocalSum(Request):
    """One rank's share of a nonblocking all-reduce: its value was handed over (a copy) when
    started."""

    def __init__(self, comm: LocalCommunicator, seq: int, buf: Any):
        self._world, self._seq, self._buf = comm.world, seq, buf
        self._done = False

    def wait(self) -> frozenset[int]:
        if not self._done:
            self._world._take_sum(self._seq, self._buf)
            self._done = True
        return frozenset()

    def test(self) -> bool:
        return self._done or self._world._sum_ready(self._seq)


class _LocalRequest(Request):
    def __init__(self, comm: LocalCommunicator, recvs: Mapping[int, Any], tag: int):
        self._comm = comm
        self._pending = dict(recvs)
        self._tag = tag
        self._done: set[int] = set()

    def wait(self) -> frozenset[int]:
        world, rank = self._comm.world, self._comm.rank
        for peer in sorted(self._pending):
            buffers.copy_into(self._pending[peer], world._take(peer, rank, self._tag, block=True))
            self._done.add(peer)
        self._pending.clear()
        return frozenset(self._done)

    def test(self) -> bool:
        world, rank = self._comm.world, self._comm.rank
        with world._cond:
            for peer in self._pending:
                if not world._has(peer, rank, self._tag):
                    world._check(peer)
        return all(world._has(peer, rank, self._tag) for peer in self._pending)


class LocalCommunicator(Communicator):
    """One rank of a LocalWorld."""

    def __init__(self, world: LocalWorld, rank: int):
        super().__init__(rank, world.world_size, world.drops, world.nodes)
        self.world = world
        self._sums_started = 0  # every rank starts its nonblocking all-reduces in the same order

    def _post(
        self,
        sends: Mapping[int, Any],
        recvs: Mapping[int, Any],
        tag: int,
        chunk: int = 0,
        round: int = 0,
    ) -> Request:
        # chunks of a message arrive in posting order: mailboxes are FIFO per (src, dst, tag)
        for peer, buf in sends.items():
            self.world._deliver(self.rank, peer, tag, buffers.clone(buf))
        return _LocalRequest(self, recvs, tag)

    def _post_replace(self, items: list[tuple[int, Any, bool, bool]], tag: int) -> Request:
        for peer, buf, send, _ in items:
            if send:
                self.world._deliver(self.rank, peer, tag, buffers.clone(buf))
        return _LocalRequest(self, {peer: buf for peer, buf, _, recv in items if recv}, tag)

    def allreduce_sum(self, buf: Any) -> None:
        def total(values: list[Any]) -> Any:
            acc = buffers.clone(values[0])
            for v in values[1:]:
                acc += v
            return acc

        buffers.copy_into(buf, self.world._collective(self.rank, buffers.clone(buf), total))

    def iallreduce_sum(self, buf: Any) -> Request:
        """Nonblocking: the sum in rank order, like allreduce_sum (elementwise, so the same bits for
        any cut); counts the bytes the MPI backend's fixed-tree all-reduce sends."""
        self.count_tree_sum(buf)
        seq, self._sums_started = self._sums_started, self._sums_started + 1
        self.world._start_sum(self.rank, seq, buffers.clone(buf))
        return _LocalSum(self, seq, buf)

    def iallreduce_max(self, buf: np.ndarray) -> Request:
        """Nonblocking, in the same sequence as iallreduce_sum's (every rank starts them in the
        same order)."""
        seq, self._sums_started = self._sums_started, self._sums_started + 1
        self.world._start_sum(self.rank, seq, np.array(buf, dtype=np.float64), np.maximum)
        return _LocalSum(self, seq, buf)

    def allreduce_flags(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        return self.world._collective(
            self.rank, values.copy(), lambda vs: np.max(np.stack(vs), axis=0)
        ).copy()

    def gather(self, obj: Any) -> list[Any] | None:
        result = self.world._collective(self.rank, obj, list)
        return list(result) if self.rank == 0 else None

    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        row = np.asarray(row, dtype=np.float64).copy()
        result = self.world._collective(self.rank, row, lambda vs: np.stack(vs))
        return result.copy() if self.rank == 0 else None

    def report_failure(self, message: str) -> None:
        self.world.abort(f"rank {self.rank} failed: {message}")

    def bcast(self, obj: Any) -> Any:
        return self.world._collective(self.rank, obj, lambda vs: vs[0])

    def barrier(self) -> None:
        self.world._collective(self.rank, None, lambda vs: None)

    def abort(self, code: int = 1) -> None:
        self.world.abort(f"rank {self.rank} called abort({code})")

    def survive_losses(self) -> None:
        self.world.survives = True

    def agree(self, flag: bool) -> bool:
        return self.world.agree(self.rank, flag)

    def shrink(self) -> tuple[Communicator, tuple[int, ...]]:
        world, rank, lost = self.world.shrink(self.rank)
        self.successor = world.communicator(rank)
        return self.successor, lost

    def vanish(self) -> None:
        self.world.lose(self.rank)
        raise Vanished(f"rank {self.rank} vanished")

    @property
    def backend(self) -> str:
        return "local"


VANISHED = "vanished"  # run_local's result for a rank that vanished (an injected loss)


def run_local(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    drops: DropPolicy | None = None,
    nodes: Sequence[int] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` in-process ranks (one thread each).

    If any rank raises, the world is aborted (every other rank's blocking call raises
    WorldAborted instead of hanging) and the real exception of the lowest rank is re-raised here.

    Args:
        world_size: how many ranks to run.
        fn: the body of every rank; its first argument is that rank's Communicator.
        *args: passed on to ``fn``.
        drops: simulated message loss; None drops nothing.
        nodes: the node each rank is said to be on (emulated); None: all on node 0.
        **kwargs: passed on to ``fn``.

    Returns:
        What ``fn`` returned on each rank, indexed by rank.

    Raises:
        BaseException: the exception of the lowest rank that raised one.

    Example:
        ```python
        def body(comm):
            x = np.full(3, float(comm.rank))
            comm.allreduce_mean(x)
            return x

        run_local(4, body)  # four arrays [1.5, 1.5, 1.5]
        ```
    """
    world = LocalWorld(world_size, drops, nodes)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.communicator(rank), *args, **kwargs)
        except Vanished:  # an injected loss: the rank is gone (vanish() revoked its world)
            results[rank] = VANISHED
        except BaseException as exc:  # noqa: BLE001 - every failure must release the other ranks
            with lock:
                errors.append((rank, exc))
            world.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

    if world_size == 1:
        body(0)
    else:
        threads = [
            threading.Thread(target=body, args=(r,), name=f"relaympi-rank{r}", daemon=True)
            for r in range(world_size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        real = [e for e in errors if not isinstance(e[1], WorldAborted)] or errors
        # the lowest rank's: rank 0 says why the others refused
        rank, exc = min(real, key=lambda e: e[0])
        raise exc
    return results

"""The Communicator interface: nonblocking neighbour exchange, collectives, byte counts, drops."""

# Long module: the Communicator interface: every backend's contract with its docs

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from relaympi.comm import buffers
from relaympi.comm.tree_allreduce import stage_order, tree_sends
from relaympi.comm.waiting import DEFAULT_WAIT
from relaympi.drops import DropPolicy as DropPolicy  # torch-free: the configuration checks it

# the progress thread's poll period (--progress-interval): 0.5, 1, 2 and 4 ms measured on VGG-11
# over an
# emulated cluster (docs/overlap.md); a transfer waits at most this long for its next MPI call
# while backward runs
PROGRESS_INTERVAL_S = 2e-3


class CommError(RuntimeError):
    """Communication failed (an aborted world, a peer outside the world, mismatched buffers)."""


class RemoteFailure(CommError):
    """Another rank failed (or the world was aborted) while this rank was waiting for it."""


class PeerLost(CommError):
    """A rank of this world is gone (its process died, or an injected loss made it vanish) and the
    world is revoked: every survivor's next call raises this until it calls ``shrink``.

    Raised only by a communicator that ``survive_losses`` was called on; elsewhere a lost rank
    fails the run (RemoteFailure, or MPI's own error)."""


class Vanished(BaseException):  # noqa: N818 - not an error: a worker leaving on purpose
    """Raised in an in-process rank that an injected loss removes: it leaves its thread at once, as
    a killed process would (no failure recorded, nothing reported)."""


def checked_nodes(nodes: Sequence[int] | None, world_size: int) -> tuple[int, ...]:
    """Each rank's node id as a tuple (None: every rank on node 0); refuses a list of the wrong
    length, or ids that are not numbered 0, 1, ... in the order of each node's lowest rank."""
    if nodes is None:
        return (0,) * world_size
    nodes = tuple(int(node) for node in nodes)
    if len(nodes) != world_size:
        raise ValueError(f"expecting a node id for each of {world_size} ranks, got {len(nodes)}")
    if nodes != number_nodes(nodes):
        raise ValueError(
            "node ids must be numbered 0, 1, ... in the order of each node's lowest "
            f"rank, got {list(nodes)[:16]}"
        )
    return nodes


def number_nodes(labels: Sequence[Any]) -> tuple[int, ...]:
    """Node ids 0, 1, ... from any per-rank node label (a host name, a node's lowest rank), numbered
    in the order of each node's lowest rank: the same on every rank, whatever the labels are."""
    ids: dict[Any, int] = {}
    return tuple(ids.setdefault(label, len(ids)) for label in labels)


class Request(ABC):
    """Outstanding sends and receives of one exchange; wait() completes them all."""

    @abstractmethod
    def wait(self) -> frozenset[int]:
        """Block until every posted transfer completed.

        Returns:
            The peers whose message was received (a dropped message's peer is missing).

        Raises:
            RemoteFailure: another rank failed, or the world was aborted, while waiting.
        """

    @abstractmethod
    def test(self) -> bool:
        """Advance the transfers without blocking.

        Returns:
            Whether wait() would return without blocking.
        """


class Completed(Request):
    """A request with nothing outstanding (a collective that completed when it was started)."""

    def wait(self) -> frozenset[int]:
        return frozenset()

    def test(self) -> bool:
        return True


class _Discarding(Request):
    """A request whose messages from ``late`` peers were received into scratch buffers and are
    reported missing (replayed late drops)."""

    def __init__(self, request: Request, late: frozenset[int]) -> None:
        self._request, self._late = request, late

    def wait(self) -> frozenset[int]:
        return self._request.wait() - self._late

    def test(self) -> bool:
        return self._request.test()


class Communicator(ABC):
    """What algorithms may use to talk to other workers.

    Everything above this interface (algorithms, the training loop) runs unchanged on every
    backend. Buffers are numpy arrays, torch tensors (CPU or CUDA) or cupy arrays; receive
    buffers must be contiguous. Messages between a pair of ranks with the same tag arrive in
    the order they were posted.

    Backends: ``mpi_communicator()`` (MPI, one process per rank) and ``run_local`` (every rank
    a thread of this process).

    Attributes:
        rank: this rank, 0 .. world_size - 1.
        world_size: how many ranks there are.
        drops: the simulated message loss every exchange applies.
        nodes: each rank's node, numbered 0, 1, ... in the order of each node's lowest rank.
        bytes_sent: bytes handed to the transport per destination rank (dropped messages
            excluded), int64 [world_size].

    Example:
        One gossip step with the ring neighbours, on any backend:

        ```python
        left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
        got = {left: np.empty_like(x), right: np.empty_like(x)}
        delivered = comm.exchange({left: x, right: x}, got, round=step).wait()
        ```
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        drops: DropPolicy | None = None,
        nodes: Sequence[int] | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.drops = drops or DropPolicy()
        # each rank's node, numbered 0, 1, ... in the order of each node's lowest rank (None:
        # one node)
        self.nodes: tuple[int, ...] = checked_nodes(nodes, world_size)
        # bytes actually handed to the transport, per destination rank (dropped messages excluded;
        # the fixed-tree all-reduce's messages included, count_tree_sum)
        self.bytes_sent = np.zeros(world_size, dtype=np.int64)
        # the fixed-tree all-reduce's stage order: node-aware, the halves crossing nodes smallest
        self.sum_order: tuple[int, ...] = stage_order(self.nodes)
        # requests progress() tests; None until progress() is first called (then every new one
        # is tracked)
        self._in_flight: list[Request] | None = None
        # the survivors' communicator that replaced this one after a lost rank (shrink)
        self.successor: Communicator | None = None
        # --message-deadline: seconds a receive waits once its exchange is waited for; a message
        # not arrived by then is dropped (None: receives wait for their message). Only a backend
        # with a clock honours it (MPI); exchange refuses chunked messages under it
        self.deadline: float | None = None
        # the (round, tag, sender, receiver) of each message this rank received as late (missed
        # the deadline, or a replayed late drop), in the order decided; the engine drains it
        self.late_drops: list[tuple[int, int, int, int]] = []
        # seconds the call that a lost rank interrupted had waited (0: none yet): a stalled rank's
        # silence as this rank saw it (--peer-timeout)
        self.interrupted_s = 0.0
        # where ranks behind catch up by skipping (the engine sets it, under a deadline): a
        # neighbour that is behind is waited for again only once a message of it lands from at
        # most this many rounds before this rank's (None: any late message of it will do)
        self.catch_up_rounds: int | None = None
        # each rank's original worker id, where a heal renumbered the ranks (None: rank = id): a
        # replay's late drops and skips name workers by it
        self.worker_ids: tuple[int, ...] | None = None
        # how an MPI rank waits for its transfers (RELAYMPI_WAIT, relaympi.comm.waiting; in-process
        # ranks wait on a condition variable)
        self.wait_mode = DEFAULT_WAIT

    # -- point to point -------------------------------------------------------------------
    def exchange(
        self,
        sends: Mapping[int, Any],
        recvs: Mapping[int, Any],
        *,
        tag: int = 0,
        round: int = 0,
        chunk: int = 0,
    ) -> Request:
        """Post nonblocking sends of ``sends[peer]`` and receives into ``recvs[peer]``.

        ``round`` identifies the communication round for simulated drops (the same number
        on both sides). A dropped message is neither sent nor received: the receive buffer
        keeps its content and the peer is missing from ``wait()``'s result. A late message (one
        that missed ``deadline``, or a replayed late drop, ``drops.late``) was sent and counted,
        but is missing from ``wait()``'s result as a dropped one is, and its receive buffer keeps
        its content; it is appended to ``late_drops``. A replayed skipped step of a peer
        (``drops.skipped``) is late for its receiver the same way, except that it was never sent;
        a message to that peer is counted but not delivered.

        A message may travel as several chunks, posted by separate calls, each with its number
        ``chunk`` (0, 1, ...), in the same order on both sides: chunks of one tag match in posting
        order (MPI's non-overtaking rule), so the sender and the receiver must agree on it (RelaySum
        sends them last to first). Chunks of one message are dropped or delivered together (the
        decision ignores ``chunk``), and a backend that stages device memory through the host keeps
        one staging buffer per chunk in flight.

        Args:
            sends: peer -> the buffer to send it.
            recvs: peer -> the contiguous buffer its message lands in.
            tag: the message tag (both sides use the same one).
            round: the communication round, for simulated drops.
            chunk: the number of this chunk of a message (0 for a message in one piece).

        Returns:
            The Request of these transfers; its ``wait()`` says which peers' messages arrived.

        Raises:
            CommError: a peer is not another rank of this world.
            BufferError: a receive buffer cannot be transferred into (not contiguous, say).
        """
        for peer in (*sends, *recvs):
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise CommError(
                    f"rank {self.rank}: peer {peer} is not another rank of a world of "
                    f"size {self.world_size}"
                )
        for peer, buf in recvs.items():
            buffers.check_transferable(buf, f"receive buffer for peer {peer}")
        live_sends = {
            p: b for p, b in sends.items() if not self.drops.dropped(round, tag, self.rank, p)
        }
        live_recvs = {
            p: b for p, b in recvs.items() if not self.drops.dropped(round, tag, p, self.rank)
        }
        if self.deadline is not None and chunk != 0:
            # a message is late or on time as a whole; chunks land one by one
            raise CommError(
                f"rank {self.rank}: a message in chunks (chunk {chunk}) cannot have a deadline"
            )
        # replayed late drops: received into a scratch buffer and discarded, as on MPI
        ids = self.worker_ids or range(self.world_size)
        late = (
            frozenset(p for p in live_recvs if self.drops.late(round, tag, ids[p], ids[self.rank]))
            if self.drops.replayed
            else frozenset()
        )
        if late:
            live_recvs = {p: (buffers.clone(b) if p in late else b) for p, b in live_recvs.items()}
        # replayed skipped steps: a message from a peer that skipped the round never came (its
        # receiver recorded it as late); one to it was sent (counted) and discarded there
        away = (
            frozenset(p for p in (*sends, *recvs) if self.drops.skipped(round, ids[p]))
            if self.drops.skips
            else frozenset()
        )
        if late or away:
            if chunk == 0:
                absent = late | (away & set(live_recvs))
                self.late_drops.extend((round, tag, p, self.rank) for p in sorted(absent))
            live_recvs = {p: b for p, b in live_recvs.items() if p not in away}
        for peer, buf in live_sends.items():
            self.bytes_sent[peer] += buffers.nbytes(buf)
        if away:
            live_sends = {p: b for p, b in live_sends.items() if p not in away}
        request = self._post(live_sends, live_recvs, tag, chunk, round)
        return self.track(_Discarding(request, late) if late else request)

    @abstractmethod
    def _post(
        self,
        sends: Mapping[int, Any],
        recvs: Mapping[int, Any],
        tag: int,
        chunk: int = 0,
        round: int = 0,
    ) -> Request:
        """Post the transfers ``exchange`` decided on (``round``: for a backend that keeps rounds
        apart on the wire, as MPI under a deadline)."""

    def exchange_replace(
        self, buffers_by_peer: Mapping[int, Any], *, tag: int = 0, round: int = 0
    ) -> Request:
        """Send ``buffers_by_peer[peer]`` to ``peer`` and replace its content with what ``peer``
        sends.

        The in-place exchange needs no separate receive buffers (MPI_Isendrecv_replace). A
        buffer whose incoming message was dropped keeps what it held; its peer is missing from
        ``wait()``'s result.

        Args:
            buffers_by_peer: peer -> the contiguous buffer sent to it and overwritten by its
                message.
            tag: the message tag (both sides use the same one).
            round: the communication round, for simulated drops.

        Returns:
            The Request of these transfers.

        Raises:
            CommError: a peer is not another rank of this world.
            BufferError: a buffer cannot be transferred.
        """
        for peer, buf in buffers_by_peer.items():
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise CommError(
                    f"rank {self.rank}: peer {peer} is not another rank of a world of "
                    f"size {self.world_size}"
                )
            buffers.check_transferable(buf, f"exchange buffer for peer {peer}")
        if self.deadline is not None:
            raise CommError(f"rank {self.rank}: an in-place exchange cannot have a deadline")
        items = []
        for peer, buf in buffers_by_peer.items():
            send = not self.drops.dropped(round, tag, self.rank, peer)
            recv = not self.drops.dropped(round, tag, peer, self.rank)
            if send:
                self.bytes_sent[peer] += buffers.nbytes(buf)
            items.append((peer, buf, send, recv))
        return self.track(self._post_replace(items, tag))

    @abstractmethod
    def _post_replace(self, items: list[tuple[int, Any, bool, bool]], tag: int) -> Request:
        """Post (peer, buffer, send?, receive?) in-place exchanges."""

    # -- collectives ----------------------------------------------------------------------
    @abstractmethod
    def allreduce_sum(self, buf: Any) -> None:
        """In place: buf <- sum over ranks of buf (a collective: never dropped, no bytes counted).

        Args:
            buf: the same-shaped buffer on every rank.
        """

    def iallreduce_sum(self, buf: Any) -> Request:
        """Start buf <- sum over ranks of buf (in place); the sum is in buf once ``wait()`` returns.

        Several may be in flight; every rank starts them in the same order. Each element's sum is
        the same bits whatever piece of a larger buffer it is reduced in (the same order of
        additions per element), so a step that reduces its gradient range by range equals the
        whole step's reduction bit for bit. This default reduces at once (blocking
        allreduce_sum): a backend whose allreduce_sum keeps that property, or that has a
        nonblocking one, overrides it.

        Args:
            buf: the same-shaped buffer on every rank.

        Returns:
            The Request whose ``wait()`` completes the sum.
        """
        self.allreduce_sum(buf)
        return Completed()

    def count_tree_sum(self, buf: Any) -> None:
        """Count in ``bytes_sent`` the messages this rank sends in the fixed-tree all-reduce of
        ``buf`` (relaympi.comm.tree_allreduce, which MPICommunicator.iallreduce_sum runs and counts
        as it posts them): a backend that sums otherwise (in memory) reports the bytes message
        passing sends. bfloat16/float16 travel as float32, as the MPI backend sums them.

        Args:
            buf: the buffer being summed (its shape and dtype set the message sizes).
        """
        numel = int(np.prod(tuple(buf.shape), dtype=np.int64))
        itemsize = 4 if buffers.is_half(buf) else buffers.nbytes(buf) // max(numel, 1)
        for dest, count in tree_sends(self.rank, self.world_size, numel, self.sum_order):
            self.bytes_sent[dest] += count * itemsize

    def allreduce_mean(self, buf: Any) -> None:
        """In place: buf <- mean over ranks of buf.

        Args:
            buf: the same-shaped buffer on every rank.
        """
        self.allreduce_sum(buf)
        if self.world_size > 1:
            buf /= self.world_size

    @abstractmethod
    def allreduce_flags(self, values: np.ndarray) -> np.ndarray:
        """Element-wise max over ranks of a small host float64 array (stop/diverged flags).

        Args:
            values: this rank's flags.

        Returns:
            The maximum of each flag over all ranks.
        """

    def iallreduce_max(self, buf: np.ndarray) -> Request:
        """Start buf <- element-wise max over ranks of buf (in place), like allreduce_flags but
        without waiting: the maximum is in buf once ``wait()`` returns. Every rank starts them in
        the same order, among its other collectives. This default reduces at once (blocking).

        Args:
            buf: a small contiguous host float64 array, the same shape on every rank.

        Returns:
            The Request whose ``wait()`` completes the maximum.
        """
        buf[...] = self.allreduce_flags(buf)
        return Completed()

    @abstractmethod
    def gather(self, obj: Any) -> list[Any] | None:
        """Small picklable objects to rank 0.

        Args:
            obj: this rank's object.

        Returns:
            On rank 0 every rank's object, indexed by rank; None on the other ranks.
        """

    @abstractmethod
    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        """Equal-length float64 vectors to rank 0, stacked by rank.

        Args:
            row: this rank's vector, of length k (the same on every rank).

        Returns:
            On rank 0 the [world_size, k] rows; None on the other ranks.
        """

    @abstractmethod
    def report_failure(self, message: str) -> None:
        """Tell the other ranks this rank failed, so none of them waits for it forever.

        Rank 0 then sees RemoteFailure(message) in its next blocking call.

        Args:
            message: what failed, for rank 0 to report.
        """

    @abstractmethod
    def bcast(self, obj: Any) -> Any:
        """A small picklable object from rank 0 to every rank.

        Args:
            obj: rank 0's object (the other ranks' is ignored).

        Returns:
            Rank 0's object, on every rank.
        """

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has called barrier()."""

    def track(self, request: Request) -> Request:
        """Hand ``request`` to progress() (once progress() is in use).

        Args:
            request: a request this communicator posted.

        Returns:
            ``request`` itself.
        """
        if self._in_flight is not None:
            self._in_flight.append(request)
        return request

    def start_progress_thread(self, interval: float = PROGRESS_INTERVAL_S) -> bool:
        """Start a thread that lets the transport move data every ``interval`` seconds inside
        ``progressing()`` blocks (a second call keeps the first thread). The base transport moves
        data in its own calls (in-process copies): no thread.

        Args:
            interval: the thread's poll period in seconds (--progress-interval).

        Returns:
            Whether a progress thread runs.
        """
        return False

    def progressing(self) -> AbstractContextManager[None]:
        """A block (backward under --overlap) during which the progress thread, if started, runs.

        Returns:
            A context manager (a no-op where no progress thread runs).
        """
        return nullcontext()

    def progress(self) -> None:
        """Let the transport move what is in flight, without waiting: test() every tracked request
        (on MPI a Testall, which runs the progress engine). Called between pieces of computation
        (backward's hooks under --overlap): MPICH's and Open MPI's transports move data only inside
        MPI calls unless a progress thread runs (docs/overlap.md). Completed requests are dropped;
        wait() on them still returns their result."""
        if self._in_flight is None:
            self._in_flight = []
        self._in_flight = [r for r in self._in_flight if not r.test()]

    # -- a rank behind its neighbours under a deadline (docs/membership.md, "Catching up") ------
    def steps_ahead(self, step: int, rounds_per_step: int, at_least: int, limit: int) -> int:
        """How many steps ahead of ``step`` the furthest neighbour is, as far as the messages it
        already sent this rank show: the largest k <= ``limit`` such that its message of step
        ``step + k`` is here, where k >= ``at_least``, else 0. Only a backend with a deadline and a
        wire to look at answers (MPI); this default sees none ahead.

        Args:
            step: this rank's step.
            rounds_per_step: the communication rounds each step numbers.
            at_least: the fewest steps ahead that count.
            limit: the most steps ahead looked for.

        Returns:
            The steps ahead (0: no neighbour is ``at_least`` steps ahead).
        """
        return 0

    def skip_rounds(self, first: int, end: int) -> None:  # noqa: B027 - nothing on the wire here
        """This rank leaves rounds [first, end) out: it sends nothing in them, and discards what
        its neighbours send it in them (a backend with a wire takes those messages off it; a
        replay's DropPolicy keeps them from being delivered at all).

        Args:
            first: the first round skipped.
            end: the round after the last one skipped.
        """

    # -- membership: the survivors of a lost rank (--on-failure continue, docs/membership.md) ----
    def survive_losses(self) -> None:
        """From now on a lost rank raises PeerLost in the survivors' calls, instead of failing the
        run.

        Raises:
            CommError: this backend cannot survive a lost rank (one line: which, and what can).
        """
        raise CommError(f"the {self.backend} backend cannot survive a lost rank")

    def shrink(self) -> tuple[Communicator, tuple[int, ...]]:
        """After PeerLost: collective over the survivors.

        Returns:
            The communicator of the survivors (ranks renumbered in their old order, nodes kept) and
            the old ranks that were lost.

        Raises:
            PeerLost: another rank was lost while shrinking (shrink again).
            CommError: this backend cannot survive a lost rank.
        """
        raise CommError(f"the {self.backend} backend cannot survive a lost rank")

    def agree(self, flag: bool) -> bool:
        """A uniform agreement of every rank still in the world (ULFM's MPI_Comm_agree): the AND of
        their flags, the same on every rank; or, on every rank alike, PeerLost where a rank was lost
        since this communicator was made. It completes on a revoked communicator, so survivors that
        are healing and survivors that think the run is over meet in it.

        Args:
            flag: this rank's vote.

        Returns:
            True where every rank voted True.

        Raises:
            PeerLost: a rank of this communicator was lost (on every rank that returns).
            CommError: this backend cannot survive a lost rank.
        """
        raise CommError(f"the {self.backend} backend cannot survive a lost rank")

    def vanish(self) -> None:
        """This rank leaves the world at once, as a killed process would (an injected loss): never
        returns."""
        raise CommError(f"the {self.backend} backend cannot lose a rank on purpose")

    @abstractmethod
    def abort(self, code: int = 1) -> None:
        """Tear the whole world down now: no rank may be left waiting in a receive.

        Args:
            code: the exit status (MPI_Abort's error code).
        """

    def inter_node_bytes(self) -> int:
        """The bytes this rank sent so far to ranks on other nodes.

        Returns:
            The sum of ``bytes_sent`` over destinations on another node than this rank's.
        """
        other = np.asarray(self.nodes) != self.node
        return int(self.bytes_sent[other].sum())

    @property
    def node(self) -> int:
        """This rank's node (``nodes[rank]``)."""
        return self.nodes[self.rank]

    @property
    def backend(self) -> str:
        """The backend's name (its class name)."""
        return type(self).__name__

    def describe(self) -> dict[str, Any]:
        """Provenance of the transport (library versions, CUDA-awareness).

        Returns:
            A JSON-able dict, recorded in the run file; at least ``{"backend": ...}``.
        """
        return {"backend": self.backend}

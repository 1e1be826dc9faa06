"""MPI backend (mpi4py): the only module that imports mpi4py.

The communicator over MPI (MPICommunicator), its requests, its failure channel and the collectives.
Its parts that need no MPI call of their own live beside it: device staging (staging.py), the
fixed-tree sum's schedule (tree_allreduce.py) and the progress thread (progress.py).
"""

# Long module: the only module importing mpi4py: the communicator and its requests

from __future__ import annotations

import atexit
import functools
import os
import signal
import time
from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from relaympi.comm import buffers
from relaympi.comm.base import (
    PROGRESS_INTERVAL_S,
    CommError,
    Communicator,
    DropPolicy,
    PeerLost,
    RemoteFailure,
    Request,
    number_nodes,
)
from relaympi.comm.progress import ProgressThread
from relaympi.comm.staging import DeviceStaging, StagedSend
from relaympi.comm.tree_allreduce import SUM_STAGES, tree_sum
from relaympi.comm.waiting import poll

_FAILURE_TAG = 0x7E
_FAILURE_BYTES = 1 << 16
# under a deadline, each round's messages travel with a tag of their own: tag + TAGS_PER_ROUND x
# (round mod the rounds the tag space holds), so a late message can only ever match its own
# round's receive (or the receive that discards it), never a later round's
TAGS_PER_ROUND = 8
# how many times steps_ahead runs MPI's progress engine before it decides that a neighbour whose
# next message is here is not further ahead (MPICH's shared memory brings in a few messages a call)
PROGRESS_BURST = 8
# under a deadline: how many of a neighbour's newest receives (tag, round) steps_ahead reads to tell
# in which rounds of a step that neighbour sends (SGP's in-neighbours take turns across the rounds)
EXPECTS_KEPT = 8
# skipped rounds whose messages are still taken off the wire when they come: a message later
# than this many rounds stays unreceived (its sender's send from a copy is given up at close)
DRAIN_HORIZON = 1 << 16
# at close, how long sends from copies (under a deadline) are given to complete
DETACHED_CLOSE_S = 10.0


def _lost_on_failure(method: Any) -> Any:
    """A method of a communicator (or of a request with ``_comm``) under --on-failure continue:
    an MPI error (a dead peer, a revoked communicator) revokes this rank's communicators, so that
    no survivor stays blocked on a live rank that waits for the dead one, and raises PeerLost."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        comm = getattr(self, "_comm", self)
        if not comm.survives:
            return method(self, *args, **kwargs)
        outermost = comm._call_since is None  # a guarded call inside another: the outer's start
        if outermost:
            comm._call_since = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        except MPI.Exception as exc:
            # the longest: a heal's own calls fail at once afterwards
            comm.interrupted_s = max(comm.interrupted_s, time.perf_counter() - comm._call_since)
            comm._revoke()
            raise PeerLost(
                f"rank {comm.rank}: a rank is gone ({exc.Get_error_string().strip()})"
            ) from None
        finally:
            if outermost:
                comm._call_since = None

    return guarded


def world_size() -> int:
    """Size of MPI.COMM_WORLD (1 when not launched by mpirun/srun)."""
    return MPI.COMM_WORLD.Get_size()


def node_allgather(obj: Any) -> list[Any]:
    """A small picklable object from every rank on this rank's node (MPI_COMM_TYPE_SHARED), in
    node-local rank order.

    Collective over MPI.COMM_WORLD: every rank must call it.
    """
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.allgather(obj)
    finally:
        node.Free()


def library_version() -> str:
    # Open MPI's ends in a NUL
    return MPI.Get_library_version().strip().rstrip("\x00").splitlines()[0].rstrip("\x00")


class _Deadline:
    """What an exchange under a deadline needs: the round and tag to record a late receive by, the
    tag it travels with, each receive's (peer, index among the request's MPI requests, spec) and
    each send's (peer, index, the copy it is sent from, the slot the copy returns to once sent)."""

    def __init__(self, round: int, tag: int, wire_tag: int, receives: list, sends: list) -> None:
        self.round, self.tag, self.wire_tag = round, tag, wire_tag
        self.receives, self.sends = receives, sends


class _Discard(NamedTuple):
    """A receive that takes a late message off the wire: (request, scratch buffer), its sender and
    its round."""

    receive: tuple[Any, Any]
    peer: int
    round: int


class _MPIRequest(Request):
    def __init__(
        self,
        comm: MPICommunicator,
        requests: list,
        delivered: frozenset[int],
        on_complete: list,
        staged: list | None = None,
        deadline: _Deadline | None = None,
    ):
        self._comm = comm
        self._requests = requests
        self._delivered = delivered
        self._on_complete = on_complete
        self._staged = staged or []
        self._deadline = deadline
        self._done = False

    def _all_requests(self, block: bool) -> list | None:
        """This exchange's MPI requests, posting its staged sends first (None: some copy still
        runs)."""
        if self._staged:
            # blocking: post every queued send, not just this exchange's, so that all chunks are in
            # flight at once instead of one exchange's transfer at a time
            self._comm._post_staged(
                until=self._comm._staged_sends[-1] if block and self._comm._staged_sends else None
            )
            if any(send.request is None for send in self._staged):
                return None
            self._requests = self._requests + [send.request for send in self._staged]
            self._staged = []
        return self._requests

    @_lost_on_failure
    def wait(self) -> frozenset[int]:
        if not self._done:
            requests = self._all_requests(block=True)
            assert requests is not None  # block=True posts every staged send
            if self._deadline is None:
                self._comm._wait(requests)
            else:
                self._delivered -= self._comm._wait_until_deadline(requests, self._deadline)
            for finish in self._on_complete:
                finish()
            self._done = True
        return self._delivered

    @_lost_on_failure
    def test(self) -> bool:
        if self._done:
            return True
        requests = self._all_requests(block=False)
        return requests is not None and MPI.Request.Testall(requests)


class _TreeSumRequest(Request):
    """A nonblocking tree_sum: each test() or wait() (of any of the communicator's sums) posts the
    stages whose predecessors completed; ``on_complete`` runs once the sum is in place."""

    def __init__(self, comm: MPICommunicator, stages: Any, on_complete: list):
        self._comm, self._stages, self._on_complete = comm, stages, on_complete
        self._pending: list | None = next(self._stages, None)
        self._done = False

    def advance(self) -> bool:
        """Post every stage whose predecessor completed; whether all completed."""
        while self._pending is not None:
            if not MPI.Request.Testall(self._pending):
                return False
            self._pending = next(self._stages, None)
        return True

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._comm._sums.remove(self)
            for finish in self._on_complete:
                finish()

    @_lost_on_failure
    def test(self) -> bool:
        if self._done:
            return True
        self._comm._advance_sums()
        if self._pending is None:
            self._finish()
        return self._done

    @_lost_on_failure
    def wait(self) -> frozenset[int]:
        if self._comm._staged_sends:  # as _wait: no blocking with this rank's sends held back
            self._comm._post_staged(until=self._comm._staged_sends[-1])
        comm = self._comm
        if comm.wait_mode != "spin":
            poll(self.test, comm._check_failures, comm.wait_mode)
            return frozenset()
        polls = 0
        while not self.test():
            if comm._failure_req is None and self._pending is not None:
                # no failure channel to watch: block on this stage
                MPI.Request.Waitall(self._pending)
                continue
            comm._check_failures()
            polls += 1
            if polls > 1000:
                time.sleep(5e-5)
        return frozenset()


THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


class MPICommunicator(Communicator):
    """A Communicator over a duplicate of MPI.COMM_WORLD (library traffic never matches users')."""

    def __init__(
        self,
        comm: Any = None,
        drops: DropPolicy | None = None,
        cuda_aware: bool | None = None,
        nodes: Sequence[int] | None = None,
    ):
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        # nodes: each rank's node as given (emulated, e.g. --ranks-per-node); None: as MPI places
        # the ranks
        super().__init__(
            self.comm.Get_rank(),
            self.comm.Get_size(),
            drops,
            self._discover_nodes() if nodes is None else nodes,
        )
        self.cuda_aware = buffers.query_cuda_aware_mpi() if cuda_aware is None else cuda_aware
        self._staging = DeviceStaging()  # device memory through pinned host memory (not CUDA-aware)
        self._staged_sends: list[StagedSend] = []  # copies not yet posted, in posting order
        # failure channel: any rank may tell rank 0 it failed; rank 0 checks it while it waits
        self._failures = (comm or MPI.COMM_WORLD).Dup()
        self._failure_buf = bytearray(_FAILURE_BYTES)
        # nonblocking all-reduces (iallreduce_sum): their own communicator, a tag range each,
        # in flight
        self._sum_comm = (comm or MPI.COMM_WORLD).Dup()
        tag_ub = self._sum_comm.Get_attr(MPI.TAG_UB)
        assert tag_ub is not None  # every MPI defines TAG_UB
        self._sum_tags = max(1, (int(tag_ub) + 1) // SUM_STAGES)
        self._sums_started = 0
        self._sums: list[_TreeSumRequest] = []
        self._failure_req = (
            self._failures.Irecv(self._failure_buf, source=MPI.ANY_SOURCE, tag=_FAILURE_TAG)
            if self.rank == 0
            else None
        )
        # the progress thread's own communicator, made here with every rank (a Dup later, when one
        # rank failed its set-up and waits in another collective, would leave the others waiting)
        self._progress_comm = (comm or MPI.COMM_WORLD).Dup()
        self._progress_thread: ProgressThread | None = None
        self.survives = False  # survive_losses(): an MPI error raises PeerLost (ULFM)
        # --message-deadline: how many rounds the tag space keeps apart, and the receives that
        # take late messages off the wire (request, scratch buffer) until they land
        self._round_tags = max(1, (int(tag_ub) + 1) // TAGS_PER_ROUND)
        self._discards: list[_Discard] = []
        self._detached: list[tuple[Any, Any]] = []  # sends from copies: (request, copy)
        # host copies whose send completed, by slot: the next send of the slot copies into its
        # buffer instead of a new one (a buffer in flight is never here: taken out when posted)
        self._spare_copies: dict[tuple, np.ndarray] = {}
        # a neighbour is behind from the round its message was dropped until one of its late
        # messages lands (it is sending again): no wait for it meanwhile
        self._behind: set[int] = set()
        # each neighbour's newest round whose message landed here: a discarding receive of an older
        # round of it that is still pending never will be (its sender skipped that round)
        self._landed: dict[int, int] = {}
        # each neighbour's (tag, round) of this rank's newest receives from it (EXPECTS_KEPT): what
        # steps_ahead probes for
        self._expects: dict[int, deque[tuple[int, int]]] = {}
        # the rounds this rank skipped ([first, end) ranges) and the receives that take the
        # messages sent to it in them off the wire (request, scratch buffer)
        self._skipped: list[tuple[int, int]] = []
        self._drained: list[tuple[Any, Any]] = []
        self._round_now = 0  # the round of the newest exchange (catch_up_rounds counts from it)
        self._call_since: float | None = None  # when the guarded call in progress began
        atexit.register(self.close)

    # -- progress while the ranks compute (--overlap) ----------------------------------------
    @staticmethod
    def thread_level() -> str:
        """The thread support MPI provides ("multiple" lets a progress thread call MPI beside the
        rank)."""
        return THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread()))

    def start_progress_thread(self, interval: float = PROGRESS_INTERVAL_S) -> bool:
        if self._progress_thread is None:
            if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                return False
            self._progress_thread = ProgressThread(self._progress_comm, interval)
        return True

    @property
    def progress_polls(self) -> int:
        return self._progress_thread.polls if self._progress_thread is not None else 0

    def progressing(self) -> AbstractContextManager[None]:
        return nullcontext() if self._progress_thread is None else self._progress_thread.running()

    def _discover_nodes(self) -> tuple[int, ...]:
        """Every rank's node (collective): ranks that share memory (MPI_COMM_TYPE_SHARED) are one
        node,
        numbered by each node's lowest rank, so every rank computes the same list."""
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            lowest = node.allreduce(self.comm.Get_rank(), op=MPI.MIN)
        finally:
            node.Free()
        return number_nodes(self.comm.allgather(lowest))

    def close(self) -> None:
        """Stop the progress thread and cancel the pending failure receive, so MPI finalizes
        cleanly."""
        if self._progress_thread is not None:
            self._progress_thread.close()
            self._progress_thread = None
        if self._failure_req is not None:
            try:
                self._failure_req.Cancel()
                self._failure_req.Wait()
            except MPI.Exception:  # a revoked communicator (a lost rank): nothing left to cancel
                pass
            self._failure_req = None
        # sends from copies: every rank posts a receive for each message it is sent (its own or
        # a discarding one), so they complete; a rank that is gone would leave one pending
        expires = time.perf_counter() + DETACHED_CLOSE_S
        while self._detached and time.perf_counter() < expires:
            self._detached = [(r, b) for r, b in self._detached if not r.Test()]
            time.sleep(1e-3)
        self._detached = []
        # late messages whose senders never sent them, and messages of skipped rounds being taken
        for request in [d.receive[0] for d in self._discards] + [r for r, _ in self._drained]:
            try:
                request.Cancel()
                request.Wait()
            except MPI.Exception:
                pass
        self._discards, self._drained = [], []

    # -- waiting ---------------------------------------------------------------------------
    def _check_failures(self) -> None:
        if self._failure_req is not None:
            status = MPI.Status()
            if self._failure_req.Test(status):
                self._failure_req = None
                text = bytes(self._failure_buf[: status.Get_count(MPI.BYTE)]).decode(
                    "utf-8", "replace"
                )
                raise RemoteFailure(f"rank {status.Get_source()} failed: {text}")

    def _wait(self, requests: list) -> None:
        """Waitall that rank 0 interrupts when another rank reports a failure (no rank waits
        forever).
        Staged sends still queued are posted first (their copies waited for): a peer may be blocked
        waiting for them, as this rank may be for its sends (overlapped steps on a GPU queue them
        while the copies are still behind backward's kernels)."""
        if self._staged_sends:
            self._post_staged(until=self._staged_sends[-1])
        if self.wait_mode == "spin":
            if self._failure_req is None:
                MPI.Request.Waitall(requests)
                return
            polls = 0  # rank 0 watches the failure channel: polls, sleeping once it waited long
            while not MPI.Request.Testall(requests):
                self._check_failures()
                polls += 1
                if polls > 1000:
                    time.sleep(5e-5)
            return
        poll(lambda: MPI.Request.Testall(requests), self._check_failures, self.wait_mode)

    def _wait_until_deadline(self, requests: list, deadline: _Deadline) -> frozenset[int]:
        """Wait for ``requests`` until ``self.deadline`` seconds have passed, then give up on each
        receive still pending: cancelled, its message is late (recorded in ``late_drops``) and a
        receive into a scratch buffer takes it off the wire whenever it comes, so that its sender's
        send completes and nothing of it lands anywhere else. A receive that can no longer be
        cancelled (its message is landing) is waited for and counts as arrived. The sends (each
        from a copy of its own) are waited for up to the deadline too; one still in flight then
        completes later, so that a large message to a neighbour that is behind holds nobody.

        A neighbour that is behind (its message was dropped, and none of its late messages has
        landed since) is not waited for at all, neither its message nor the taking of ours: its
        receive counts only if its message is already here. So a stalled neighbour costs its
        receivers one deadline, not one per step, and is waited for again as soon as it sends
        again (and so catches up).

        Returns:
            The peers whose message was late.
        """
        if self._staged_sends:
            self._post_staged(until=self._staged_sends[-1])
        assert self.deadline is not None  # a request gets a _Deadline only under one
        expires = time.perf_counter() + self.deadline  # the poller's clock
        self._reap_discards()
        waited, skipped = requests, False
        if self._behind:
            behind = {
                i for peer, i, *_ in deadline.receives + deadline.sends if peer in self._behind
            }
            waited = [request for i, request in enumerate(requests) if i not in behind]
            skipped = bool(behind)
        if poll(lambda: MPI.Request.Testall(waited), self._check_failures, self.wait_mode, expires):
            if not skipped or MPI.Request.Testall(requests):
                for peer, _, _ in deadline.receives:
                    self._arrived(peer, deadline.round)
                self._spare(deadline.sends)
                return frozenset()
        late = []
        for peer, index, spec in deadline.receives:
            request = requests[index]
            if request.Test():
                self._arrived(peer, deadline.round)
                continue
            request.Cancel()
            status = MPI.Status()
            request.Wait(status)
            if status.Is_cancelled():
                late.append(peer)
                self._behind.add(peer)
                receive = self._discarding_receive(peer, deadline.wire_tag, spec)
                self._discards.append(_Discard(receive, peer, deadline.round))
                self.late_drops.append((deadline.round, deadline.tag, peer, self.rank))
            else:
                self._arrived(peer, deadline.round)
        # the receives that landed after all; a send still in flight completes later, from its copy
        self._wait([requests[index] for _, index, _ in deadline.receives])
        sent = []
        for send in deadline.sends:
            request = requests[send[1]]
            if request.Test():
                sent.append(send)
            else:
                self._detached.append((request, send[2]))
        self._spare(sent)
        return frozenset(late)

    def _send_copy(self, spec: Any, slot: tuple) -> Any:
        """The copy of a send's ``spec`` that it is sent from under a deadline: host memory into
        the slot's spare buffer where one of the same shape and dtype is free (a large message
        then costs no fresh allocation, and no page faults, each step), else a new one."""
        if isinstance(spec, list):  # [bytes view, MPI.BYTE] (device bfloat16)
            return [buffers.clone(spec[0]), spec[1]]
        if not isinstance(spec, np.ndarray):  # device memory (CUDA-aware MPI)
            return buffers.clone(spec)
        own = self._spare_copies.pop(slot, None)
        if own is None or own.shape != spec.shape or own.dtype != spec.dtype:
            return spec.copy()
        np.copyto(own, spec)
        return own

    def _spare(self, sends: list) -> None:
        """The copies of ``sends`` (completed) are free for their slots' next sends."""
        for _, _, own, slot in sends:
            if isinstance(own, np.ndarray):
                self._spare_copies[slot] = own

    def _discarding_receive(self, peer: int, wire_tag: int, spec: Any) -> tuple[Any, Any]:
        """A receive of a late message into a buffer of its own, which nothing reads."""
        if isinstance(spec, list):  # [bytes view, MPI.BYTE]
            scratch: Any = [np.empty(buffers.nbytes(spec[0]), dtype=np.uint8), MPI.BYTE]
        elif isinstance(spec, np.ndarray):
            scratch = np.empty_like(spec)
        else:  # device memory (CUDA-aware MPI)
            scratch = buffers.clone(spec)
        return self.comm.Irecv(scratch, source=peer, tag=wire_tag), scratch

    def _arrived(self, peer: int, round: int) -> None:
        """``peer``'s message of ``round`` landed: it is sending again (waited for again, if that
        round is recent enough: ``catch_up_rounds``), and its messages of older rounds that have
        not landed never will."""
        if self.catch_up_rounds is None or round >= self._round_now - self.catch_up_rounds:
            self._behind.discard(peer)
        if round > self._landed.get(peer, -1):
            self._landed[peer] = round

    def _reap_discards(self) -> None:
        """Forget the discarding receives whose late message has landed (its sender is sending
        again, so it is waited for again) and the sends from copies that completed; cancel those
        whose sender skipped their round (a newer message of it landed: a sender's messages match
        in the order sent, so the older one was never sent)."""
        if self._detached:
            self._detached = [(r, b) for r, b in self._detached if not r.Test()]
        if self._drained:
            self._drained = [(r, b) for r, b in self._drained if not r.Test()]
        if self._discards:
            pending = []
            for discard in self._discards:
                request = discard.receive[0]
                if request.Test():
                    self._arrived(discard.peer, discard.round)
                elif discard.round < self._landed.get(discard.peer, -1):
                    request.Cancel()
                    request.Wait()
                else:
                    pending.append(discard)
            self._discards = pending

    def steps_ahead(self, step: int, rounds_per_step: int, at_least: int, limit: int) -> int:
        """Under a deadline only (0 without one). Each neighbour is probed (MPI_Iprobe, nothing
        received) for step ``step + k``'s message in each round of a step that this rank's newest
        receives from it (EXPECTS_KEPT) were posted in: a fixed topology's neighbour is probed once
        a step, one of a schedule whose neighbours take turns across a step's rounds (SGP's) in
        each of its rounds, and one that sends only every few steps is seen where it does (the
        others fill the gaps). Where its next step's message is here but not the
        ``at_least``-th, a progress burst (PROGRESS_BURST) brings in what is queued behind it;
        then k doubles and bisects. Two probes per neighbour and round when none is ahead (the usual
        case).
        """
        if self.deadline is None or at_least > limit:
            return 0
        furthest = 0
        for peer, kept in self._expects.items():
            # the rounds of a step this neighbour sent in lately, each with its newest tag
            subs = {round % rounds_per_step: tag for tag, round in kept}

            def here(k: int, peer: int = peer, subs: dict[int, int] = subs) -> bool:
                first = (step + k) * rounds_per_step
                return any(
                    self.comm.Iprobe(source=peer, tag=self.wire_tag(tag, first + sub))
                    for sub, tag in subs.items()
                )

            if not here(at_least) and not (
                here(1) and self._progress_burst(lambda: here(at_least))
            ):
                continue
            present, absent = at_least, 2 * at_least
            while absent <= limit and here(absent):
                present, absent = absent, 2 * absent
            absent = min(absent, limit + 1)
            while absent - present > 1:
                middle = (present + absent) // 2
                present, absent = (middle, absent) if here(middle) else (present, middle)
            furthest = max(furthest, present)
        return furthest

    def _progress_burst(self, ready: Any) -> bool:
        """Run MPI's progress engine a few times (PROGRESS_BURST) until ``ready()``: a neighbour
        whose next message is here may have more queued behind it, and a shared-memory transport
        brings in only a few messages per call."""
        for _ in range(PROGRESS_BURST):
            self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
            if ready():
                return True
        return False

    def skip_rounds(self, first: int, end: int) -> None:
        """This rank leaves rounds [first, end) out (a skipped step): it sends nothing in them, and
        the messages its neighbours send it in them are taken off the wire as they come and
        discarded (not recorded: the skipped step says it).

        Args:
            first: the first round skipped.
            end: the round after the last one skipped.
        """
        if self._skipped and self._skipped[-1][1] == first:
            self._skipped[-1] = (self._skipped[-1][0], end)
        else:
            self._skipped.append((first, end))
        self._drain(end)

    def _drain(self, now: int) -> None:
        """Take off the wire every message that has come from a neighbour for a round this rank
        skipped (``now``: the round this rank is at), oldest first; a sender's messages match in
        the order sent, so the first one of a later round ends the search for that sender. Skipped
        rounds over DRAIN_HORIZON rounds old are forgotten."""
        self._skipped = [(a, b) for a, b in self._skipped if b > now - DRAIN_HORIZON]
        if not self._skipped:
            return
        status = MPI.Status()
        for peer in self._expects:
            while self.comm.Iprobe(source=peer, tag=MPI.ANY_TAG, status=status):
                wire = status.Get_tag()
                # the round nearest ``now`` whose messages travel with this tag
                base = wire // TAGS_PER_ROUND
                sent_in = base + self._round_tags * int(np.rint((now - base) / self._round_tags))
                if not any(a <= sent_in < b for a, b in self._skipped):
                    break
                scratch = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                request = self.comm.Irecv([scratch, MPI.BYTE], source=peer, tag=wire)
                self._drained.append((request, scratch))

    def wire_tag(self, tag: int, round: int) -> int:
        """The MPI tag a message of ``tag`` travels with in ``round``: under a deadline, one of
        its round's own (TAGS_PER_ROUND per round), else ``tag``.

        Args:
            tag: the message's tag.
            round: the communication round.

        Returns:
            The tag on the wire.

        Raises:
            CommError: under a deadline, a tag outside [0, TAGS_PER_ROUND).
        """
        if self.deadline is None:
            return tag
        if not 0 <= tag < TAGS_PER_ROUND:
            raise CommError(
                f"rank {self.rank}: tag {tag} under a deadline; tags are 0..{TAGS_PER_ROUND - 1}"
            )
        return tag + TAGS_PER_ROUND * (round % self._round_tags)

    def report_failure(self, message: str) -> None:
        if self.rank == 0:
            return
        data = message.encode("utf-8")[: _FAILURE_BYTES - 1]
        request = self._failures.Isend(data, dest=0, tag=_FAILURE_TAG)
        deadline = time.monotonic() + 10.0
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- buffers ---------------------------------------------------------------------------
    def _send_spec(self, buf: Any, slot: tuple) -> Any:
        buffers.check_transferable(buf, "send buffer")
        if buffers.is_device(buf):
            if self.cuda_aware:
                # MPI reads device memory outside the stream's order
                buffers.synchronize_stream(buf)
                return self._device_spec(buf)
            host = self._staging.host_buffer(buf, slot)
            # blocking copy: the host copy is complete before MPI reads it
            buffers.copy_into(host, buf)
            return buffers.host_view(host)
        return buffers.host_view(buf)

    def _recv_spec(self, buf: Any, slot: tuple, on_complete: list) -> Any:
        if buffers.is_device(buf):
            if self.cuda_aware:
                buffers.synchronize_stream(buf)  # no pending kernel may still read/write the target
                return self._device_spec(buf)
            host = self._staging.host_buffer(buf, slot)
            on_complete.append(lambda: buffers.copy_into(buf, host))
            return buffers.host_view(host)
        return buffers.host_view(buf)

    @staticmethod
    def _device_spec(buf: Any) -> Any:
        if buffers.is_half(buf) and buffers.dtype_name(buf) == "bfloat16":
            import torch

            return [buf.view(torch.uint8), MPI.BYTE]
        return buf

    def _async_staging(self, buf: Any) -> bool:
        """Stage through the host on a side stream (torch CUDA tensors without CUDA-aware MPI)."""
        return (
            not self.cuda_aware and buffers.array_kind(buf) == "torch" and buf.device.type == "cuda"
        )

    def _post_staged(self, until: StagedSend | None = None) -> None:
        """Post queued staged sends in order (MPI keeps their order per peer and tag): those whose
        copy is done, and with ``until`` every one up to it, waiting for their copies."""
        if until is not None and until.request is not None:
            return
        while self._staged_sends:
            send = self._staged_sends[0]
            if not send.copied.query():
                if until is None:
                    return
                send.copied.synchronize()
            send.request = self.comm.Isend(
                buffers.host_view(send.host), dest=send.peer, tag=send.tag
            )
            self._staged_sends.pop(0)
            if send is until:
                return

    @_lost_on_failure
    def _post(
        self,
        sends: Mapping[int, Any],
        recvs: Mapping[int, Any],
        tag: int,
        chunk: int = 0,
        round: int = 0,
    ) -> Request:
        # chunks of one message share the tag: they match in posting order (non-overtaking), which
        # both sides share
        requests: list[Any] = []
        staged: list[StagedSend] = []
        on_complete: list[Any] = []  # callables, run once the receives complete
        logical, tag = tag, self.wire_tag(tag, round)
        receives: list[tuple[int, int, Any]] = []  # (peer, index, spec) for the deadline
        copies: list[tuple[int, int, Any, tuple]] = []  # (peer, index, copy, slot) under one
        self._round_now = round
        self._reap_discards()
        if self.deadline is not None:
            for peer in recvs:
                kept = self._expects.setdefault(peer, deque(maxlen=EXPECTS_KEPT))
                if not kept or kept[-1] != (logical, round):
                    kept.append((logical, round))
            if self._skipped:  # messages of skipped rounds from senders that were behind
                self._drain(round)
        for peer in sorted(recvs):
            slot = ("recv", peer, logical, chunk)
            if self._async_staging(recvs[peer]):
                spec = self._staging.stage_recv(recvs[peer], slot, on_complete)
            else:
                spec = self._recv_spec(recvs[peer], slot, on_complete)
            receives.append((peer, len(requests), spec))
            requests.append(self.comm.Irecv(spec, source=peer, tag=tag))
        for peer in sorted(sends):
            slot = ("send", peer, logical, chunk)
            if self._async_staging(sends[peer]):
                buffers.check_transferable(sends[peer], "send buffer")
                send = self._staging.stage_send(sends[peer], slot, peer, tag)
                self._staged_sends.append(send)
                staged.append(send)
                continue
            spec = self._send_spec(sends[peer], slot)
            if self.deadline is not None:
                # from a copy of its own, waited for up to the deadline: a message too large to
                # leave at once (MPI's rendezvous) to a neighbour that is behind then completes
                # later, and the sender's buffer is free for the next step meanwhile
                spec = self._send_copy(spec, slot)
                copies.append((peer, len(requests), spec, slot))
            requests.append(self.comm.Isend(spec, dest=peer, tag=tag))
        if self._staged_sends:
            self._post_staged()  # whatever copies are done: their transfers start now
        deadline = (
            _Deadline(round, logical, tag, receives, copies)
            if self.deadline is not None and (receives or copies)
            else None
        )
        return _MPIRequest(self, requests, frozenset(recvs), on_complete, staged, deadline)

    @_lost_on_failure
    def _post_replace(self, items: list[tuple[int, Any, bool, bool]], tag: int) -> Request:
        requests, on_complete = [], []
        for peer, buf, send, recv in sorted(items, key=lambda item: item[0]):
            if send and recv:
                spec = self._send_spec(buf, ("replace", peer, tag))
                if buffers.is_device(buf) and not self.cuda_aware:
                    host = self._staging.host_buffer(buf, ("replace", peer, tag))
                    on_complete.append(lambda buf=buf, host=host: buffers.copy_into(buf, host))
                requests.extend(self._isendrecv_replace(spec, peer, tag, on_complete))
            elif send:
                requests.append(
                    self.comm.Isend(self._send_spec(buf, ("send", peer, tag)), dest=peer, tag=tag)
                )
            elif recv:
                requests.append(
                    self.comm.Irecv(
                        self._recv_spec(buf, ("recv", peer, tag), on_complete), source=peer, tag=tag
                    )
                )
        return _MPIRequest(
            self, requests, frozenset(peer for peer, _, _, recv in items if recv), on_complete
        )

    def _isendrecv_replace(self, spec: Any, peer: int, tag: int, on_complete: list) -> list:
        try:
            return [
                self.comm.Isendrecv_replace(spec, dest=peer, sendtag=tag, source=peer, recvtag=tag)
            ]
        except NotImplementedError:  # an MPI-3 library: receive into a transient copy instead
            target, datatype = (spec[0], spec[1]) if isinstance(spec, list) else (spec, None)
            temp = target.clone() if buffers.array_kind(target) == "torch" else target.copy()
            on_complete.insert(0, lambda: buffers.copy_into(target, temp))
            recv_spec = [temp, datatype] if datatype is not None else temp
            return [
                self.comm.Irecv(recv_spec, source=peer, tag=tag),
                self.comm.Isend(spec, dest=peer, tag=tag),
            ]

    # -- collectives -----------------------------------------------------------------------
    @_lost_on_failure
    def allreduce_sum(self, buf: Any) -> None:
        buffers.check_transferable(buf, "allreduce buffer")
        if buffers.is_half(buf):
            # bfloat16 would travel as MPI_BYTE and be summed bytewise (or refused): reduce
            # in float32
            wide = buf.float() if buffers.array_kind(buf) == "torch" else buf.astype(np.float32)
            self.allreduce_sum(wide)
            buffers.copy_into(
                buf, wide.to(buf.dtype) if buffers.array_kind(buf) == "torch" else wide
            )
            return
        if buffers.is_device(buf) and not self.cuda_aware:
            host = self._staging.host_buffer(buf, ("allreduce",))
            buffers.copy_into(host, buf)
            self._wait([self.comm.Iallreduce(MPI.IN_PLACE, buffers.host_view(host), op=MPI.SUM)])
            buffers.copy_into(buf, host)
            return
        if buffers.is_device(buf):
            buffers.synchronize_stream(buf)  # MPI reads device memory outside the stream's order
            self._wait([self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)])
        else:
            self._wait([self.comm.Iallreduce(MPI.IN_PLACE, buffers.host_view(buf), op=MPI.SUM)])

    @_lost_on_failure
    def iallreduce_sum(self, buf: Any) -> Request:
        """Nonblocking, and the same bits for any cut (tree_sum, not MPI_Iallreduce); device memory
        and bfloat16/float16 are summed on the host in float32, as allreduce_sum stages them."""
        buffers.check_transferable(buf, "allreduce buffer")
        on_complete: list = []
        if buffers.is_half(buf) or buffers.is_device(buf):
            half = buffers.is_half(buf)
            wide = (
                (buf.float() if buffers.array_kind(buf) == "torch" else buf.astype(np.float32))
                if half
                else buf
            )
            host = np.empty(
                tuple(buf.shape), dtype=np.float32 if half else np.dtype(buffers.dtype_name(buf))
            )
            buffers.copy_into(host, wide)  # a blocking copy: complete before MPI reads it
            on_complete.append(lambda: buffers.copy_into(buf, host))
        else:
            host = buffers.host_view(buf)
        seq, self._sums_started = self._sums_started, self._sums_started + 1
        tag = (seq % self._sum_tags) * SUM_STAGES
        request = _TreeSumRequest(
            self,
            tree_sum(self._sum_comm, host.reshape(-1), tag, self.sum_order, self.bytes_sent),
            on_complete,
        )
        self._sums.append(request)
        return request

    def _advance_sums(self) -> None:
        for request in list(self._sums):
            request.advance()

    @_lost_on_failure
    def allreduce_flags(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.float64).copy()
        self._wait([self.comm.Iallreduce(MPI.IN_PLACE, values, op=MPI.MAX)])
        return values

    @_lost_on_failure
    def iallreduce_max(self, buf: np.ndarray) -> Request:
        """MPI_Iallreduce (MAX) in place; a lost rank surfaces as PeerLost when it is waited for."""
        request = self.comm.Iallreduce(MPI.IN_PLACE, buffers.host_view(buf), op=MPI.MAX)
        return _MPIRequest(self, [request], frozenset(), [])

    @_lost_on_failure
    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        row = np.ascontiguousarray(row, dtype=np.float64)
        out = np.empty((self.world_size, row.shape[0])) if self.rank == 0 else None
        self._wait([self.comm.Igather(row, out, root=0)])
        return out

    @_lost_on_failure
    def gather(self, obj: Any) -> list[Any] | None:
        return self.comm.gather(obj, root=0)

    @_lost_on_failure
    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    @_lost_on_failure
    def barrier(self) -> None:
        self._wait([self.comm.Ibarrier()])

    @_lost_on_failure
    def progress(self) -> None:
        if self._staged_sends:
            self._post_staged()  # device sends whose host copy is done start now
        self._advance_sums()  # the nonblocking all-reduces' next stages
        super().progress()

    def abort(self, code: int = 1) -> None:
        MPI.COMM_WORLD.Abort(code)

    # -- membership (ULFM: Open MPI under --with-ft ulfm) --------------------------------------
    def survive_losses(self) -> None:
        self.survives = True

    def _communicators(self) -> tuple[Any, ...]:
        # the ones a rank can block on: the exchanges and collectives, and the fixed-tree sums
        # (rank 0 only tests the failure channel; the progress thread needs --overlap, refused)
        return (self.comm, self._sum_comm)

    def _revoke(self) -> None:
        """Revoke every communicator of this rank (ULFM): each survivor's pending or next call on
        them fails at once, wherever it waits."""
        for comm in self._communicators():
            try:
                comm.Revoke()
            except (MPI.Exception, NotImplementedError):
                pass

    def agree(self, flag: bool) -> bool:
        since = time.perf_counter()
        try:
            return bool(self.comm.Agree(1 if flag else 0))
        except MPI.Exception as exc:
            self.interrupted_s = max(self.interrupted_s, time.perf_counter() - since)
            raise PeerLost(
                f"rank {self.rank}: a rank is gone ({exc.Get_error_string().strip()})"
            ) from None

    def shrink(self) -> tuple[Communicator, tuple[int, ...]]:
        self._revoke()
        if self._progress_thread is not None:
            self._progress_thread.close()
            self._progress_thread = None
        self._failure_req = None  # its receive died with the revoked communicator
        self._detached, self._discards = [], []  # so did their transfers
        try:
            survivors_comm = self.comm.Shrink()
        except MPI.Exception as exc:
            raise PeerLost(f"rank {self.rank}: shrinking failed ({exc})") from None
        try:
            old = self.comm.Get_group()
            new = survivors_comm.Get_group()
            survivors = MPI.Group.Translate_ranks(new, list(range(new.Get_size())), old)
            old.Free()
            new.Free()
            lost = tuple(sorted(set(range(self.world_size)) - set(survivors)))
            healed = MPICommunicator(
                survivors_comm,
                self.drops,
                self.cuda_aware,
                number_nodes([self.nodes[r] for r in survivors]),
            )
        except MPI.Exception as exc:  # another rank died while the survivors rebuilt
            raise PeerLost(f"rank {self.rank}: a rank was lost while shrinking ({exc})") from None
        finally:
            survivors_comm.Free()
        healed.survives = True
        healed.deadline = self.deadline
        healed.wait_mode = self.wait_mode
        self.successor = healed
        return healed, lost

    def vanish(self) -> None:
        """An injected loss: this process dies as a killed one would (SIGKILL: no clean-up, no
        MPI_Finalize), so the survivors see exactly what a real loss shows them."""
        os.kill(os.getpid(), signal.SIGKILL)

    @property
    def backend(self) -> str:
        return "mpi"

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "mpi",
            "mpi_library": library_version(),
            "mpi_standard": "{}.{}".format(*MPI.Get_version()),
            "mpi4py": __import__("mpi4py").__version__,
            "cuda_aware": bool(self.cuda_aware),
            "thread_level": self.thread_level(),
            "progress_thread": self._progress_thread is not None,
            "processor_name": MPI.Get_processor_name(),
        }


_GET_ULFM = (
    "run under Open MPI with ULFM: bash scripts/setup.sh --mpi openmpi, "
    "then scripts/mpirun-ulfm -n N ..."
)


def fault_tolerance_missing() -> str | None:
    """Whether this job can survive a lost rank: None where it can, else one line saying why not.

    It can under Open MPI 5 with ULFM enabled for the job (``mpirun --with-ft ulfm``, as
    ``scripts/mpirun-ulfm`` launches): the survivors then get an MPI error instead of being killed,
    and can revoke and shrink a communicator. Open MPI's mpirun hands ``--with-ft ulfm`` to the
    ranks as its MCA parameter ``mpi_ft_enable`` (``OMPI_MCA_mpi_ft_enable`` in their environment),
    which is what is read here. Setting that parameter alone (``--mca mpi_ft_enable 1`` without
    ``--with-ft ulfm``) reads the same, but then mpirun still ends the job when a rank dies.

    Returns:
        None, or one line naming the library (``"MPICH 5.0.2 cannot survive ..."``) and the
        commands that give a job that can.
    """
    name, version = MPI.get_vendor()
    library = f"{name} {'.'.join(map(str, version))}"
    if name != "Open MPI":
        return f"{library} cannot survive a lost rank; {_GET_ULFM}"
    if version < (5,):
        return f"{library} has no ULFM fault tolerance (Open MPI 5 has); {_GET_ULFM}"
    enabled = os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower()
    if enabled not in ("1", "true", "yes", "enabled"):
        return f"{library} was launched without ULFM (mpirun --with-ft ulfm); {_GET_ULFM}"
    return None

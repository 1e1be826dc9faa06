"""The Algorithm interface: what an algorithm accepts, explicit state and one step over a
Communicator; no training loop inside."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from relaympi.algorithms.gossip import CommMixers, Mixers
from relaympi.algorithms.options import AlgorithmError, Options
from relaympi.comm import Communicator
from relaympi.drops import ROUNDS_PER_STEP
from relaympi.optim import LocalOptimizer, OptimizerConfig
from relaympi.topology import ONE_PEER_NAMES, Topology


def round_id(step: int, sub: int = 0) -> int:
    """The communication-round number of sub-round ``sub`` of gradient step ``step`` (for drops)."""
    return step * ROUNDS_PER_STEP + sub


@dataclass(frozen=True)
class Topologies:
    """Which topologies an algorithm takes (``Algorithm.topologies``): any predicate, with the
    words that say why not. The ones below are those the algorithms here share; an algorithm with
    other needs declares its own.

    Attributes:
        what: the topologies it takes, in words (Markdown: the docs' algorithm table).
        refusal: ``refusal(algo, topology)``: why ``algo`` cannot run on ``topology``, naming what
            it can; None where it can.
    """

    what: str
    refusal: Callable[[str, Topology], str | None]

    def check(self, algo: str, topology: Topology) -> None:
        """Raise AlgorithmError unless ``algo`` runs on ``topology``.

        Args:
            algo: the algorithm's name, for the message.
            topology: the topology to run on.

        Raises:
            AlgorithmError: why not, naming the topologies it takes.
        """
        why = self.refusal(algo, topology)
        if why is not None:
            raise AlgorithmError(why)


def _not_trees(algo: str, topology: Topology) -> str | None:
    if topology.is_tree:
        return None
    return (
        f"{algo} relays over spanning trees; topology {topology.name!r} is not a tree. Choose "
        "chain, star, binary-tree, double-binary-trees, social-network-tree or "
        "spanning-tree:<graph>"
    )


def _not_one_graph(algo: str, topology: Topology) -> str | None:
    if topology.num_layers != 1:
        return (
            f"{algo} gossips over one graph; {topology.name!r} has {topology.num_layers} "
            "layers (use ring, chain, binary-tree, ...)"
        )
    if topology.name == "exponential":
        return f"{algo} needs a fixed graph; 'exponential' is SGP's time-varying schedule"
    if topology.name in ONE_PEER_NAMES:
        return (
            f"{algo} needs a fixed gossip matrix; {topology.name!r} changes it every step "
            "(use ring, chain, ... or dpsgd, qgm, gt on it)"
        )
    return None


def _not_gossip_graph(algo: str, topology: Topology) -> str | None:
    # a one-peer topology's W(t) changes every step; gossip without other state follows it
    if topology.name in ONE_PEER_NAMES:
        return None
    return _not_one_graph(algo, topology)


def _only(name: str, why: str) -> Callable[[str, Topology], str | None]:
    def refusal(algo: str, topology: Topology) -> str | None:
        if topology.name == name:
            return None
        return f"{algo} {why} (topology {name}), not over {topology.name!r}"

    return refusal


# every layer a spanning tree: RelaySum relays over them
SPANNING_TREES = Topologies(
    "any tree: chain, star, binary-tree, double-binary-trees, social-network-tree, "
    "`spanning-tree:<graph>`",
    _not_trees,
)
# one fixed graph: gossip with its Metropolis-Hastings matrix
ONE_GRAPH = Topologies(
    "any one fixed graph (not exponential or a one-peer topology)", _not_one_graph
)
# one fixed graph, or a one-peer topology whose W(t) pairs each rank with one peer per step
GOSSIP_GRAPHS = Topologies(
    "any one fixed graph (not exponential), one-peer-exponential, alternating-ring",
    _not_gossip_graph,
)
# the collective all-reduce
FULLY_CONNECTED = Topologies(
    "fully-connected", _only("fully-connected", "averages over all workers")
)
# SGP's time-varying exponential graph
EXPONENTIAL = Topologies(
    "exponential (n a power of two)",
    _only("exponential", "runs on the time-varying exponential graph"),
)


# (round, tag, src, dst) -> whether that message arrived: the loss pattern a matrix form is stepped
# with (``MatrixForm.lossy_step``; relaympi.algorithms.losses)
Delivered = Callable[[int, int, int, int], bool]


class MatrixForm(ABC):
    """An algorithm vectorized over all n workers (rows of X, numpy), an independent formulation of
    its message passing: the test oracle and the quadratics studies' fast path (see
    MatrixAlgorithm)."""

    def __init__(self, matrix_algorithm: Any):
        # matrix_algorithm: the relaympi.algorithms.matrix.MatrixAlgorithm this form steps (its n,
        # d, topology, optimizer and options); not imported here, so the interfaces stay the lowest
        # algorithm module
        self.matrix_algorithm = matrix_algorithm

    @abstractmethod
    def step(self, X: np.ndarray, G: np.ndarray, lr: float, t: int) -> np.ndarray:
        """X(t+1) from X(t) and every worker's gradient G at X(t)."""

    def lossy_step(
        self, X: np.ndarray, G: np.ndarray, lr: float, t: int, delivered: Delivered
    ) -> np.ndarray:
        """``step`` with the messages ``delivered`` says were lost, by the loss rules of
        docs/algorithms.md ("Message loss"; relaympi.algorithms.losses): the oracle the message
        passing is held to under ``--drop-prob``. A form is stepped one way or the other, never
        both. This default is ``step``: it serves an algorithm that sends no message that can be
        lost (its declared communication is not lossy); one that does overrides it.

        Args:
            X: every worker's model x(t), [n, d].
            G: every worker's gradient at x(t), [n, d].
            lr: this step's learning rate.
            t: the step number (it numbers the rounds whose messages ``delivered`` judges).
            delivered: whether message (round, tag, src, dst) arrived.

        Returns:
            X(t+1), [n, d].
        """
        return self.step(X, G, lr, t)


class Algorithm(ABC):
    """One decentralized optimizer. ``step`` turns every worker's x(t) into x(t+1) in place.

    The local optimizer turns the gradient into the local update u(t) (x(t+1/2) = x(t) + u(t));
    the algorithm decides what is communicated and how models are combined.

    A class declares what it accepts (``topologies``) and ``check`` refuses anything else;
    ``matrix_form`` is its vectorized form (and its behaviour under lost messages), ``heal_rule``
    what it does over the survivors of a lost worker. The rest of its declaration is its line in
    relaympi.algorithms.registry (``Declared``, torch-free: its label, its options, how it
    communicates, its default topology and whether it needs momentum);
    tests/test_algorithm_declarations.py checks both. Its options
    class is also the type of its ``options``. Every algorithm is built by this constructor; a
    subclass builds its own state in ``_setup``.

    Every algorithm communicates only through ``mixers`` (gossip.Mixers: gossip mixers, all-reduce,
    and RelaySum as relays.Relays): by default CommMixers over ``comm``; the batched engine passes
    its BatchedMixers (and no comm), and the same step then runs on every worker's x stacked as the
    rows of x [N, numel].

    Build one by name with ``relaympi.algorithms.make_algorithm``.

    Args:
        comm: this worker's Communicator; None where ``mixers`` communicate.
        topology: the topology it runs on.
        optimizer: the local optimizer that turns gradients into updates.
        x0: the initial flat model ([N, numel] with the batched engine's mixers).
        options: its options (an instance of its class in relaympi.algorithms.options).
        mixers: what it communicates through (None: CommMixers over ``comm``).

    Raises:
        AlgorithmError: ``check`` refuses the topology, optimizer or options.

    Example:
        A new algorithm: declare what it accepts, then its step (and add its line to the registry,
        with ``default_topology="fully-connected"``).

        ```python
        class Average(Algorithm):
            name = "average"
            summary = "the workers' mean, every step"
            topologies = FULLY_CONNECTED
            matrix_form = AllReduceMatrix
            heal_rule = "the mean over the survivors"

            def step(self, x, grad, lr, step):
                self.optimizer.update(grad, x, lr, apply=True)
                self.mixers.allreduce_mean(x)
        ```
    """

    name: ClassVar[str]
    summary: ClassVar[str]  # what it is, in one line (the docs' algorithm table)
    topologies: ClassVar[Topologies]  # the topologies it takes (SPANNING_TREES, ... or its own)
    matrix_form: ClassVar[type[MatrixForm]]
    # --on-failure continue: what this algorithm does over the survivors of a lost worker. Every
    # algorithm is built again by its constructor from each survivor's model (its state starts
    # fresh; the model and the local optimizer's state are the survivor's own); this text says
    # what that means for it (docs/membership.md's table is made from it)
    heal_rule: ClassVar[str]

    options: Options  # a subclass with options names their class here: ``options: D2Options``
    _ranged: tuple[torch.Tensor, torch.Tensor, float, int]  # begin_step's (x, grad, lr, step)

    @classmethod
    def check(cls, topology: Topology, optimizer: OptimizerConfig, options: Options) -> None:
        """Raise AlgorithmError unless this algorithm runs on ``topology`` with this optimizer and
        options (what its registry line declares, such as ``needs_momentum``, is checked by
        ``relaympi.algorithms.check_combination``).

        Args:
            topology: the topology to run on.
            optimizer: the local optimizer's settings.
            options: the algorithm's options.

        Raises:
            AlgorithmError: the combination is refused; the message names the allowed choices.
        """
        cls.topologies.check(cls.name, topology)

    def __init__(
        self,
        comm: Communicator | None,
        topology: Topology,
        optimizer: LocalOptimizer,
        x0: torch.Tensor,
        options: Options,
        mixers: Mixers | None = None,
    ) -> None:
        """One worker's algorithm over ``comm`` (None: ``mixers`` communicate, as the batched
        engine's for every worker at once, x0 then [N, numel]), from the model x0; refuses what
        ``check`` refuses."""
        self.check(topology, optimizer.config, options)
        self.comm = comm
        if mixers is None:
            assert comm is not None, "an algorithm without mixers communicates over comm"
            self.mixers: Mixers = CommMixers(comm)
        else:
            self.mixers = mixers
        self.topology = topology
        self.optimizer = optimizer
        self.options = options
        self.numel = x0.numel()
        self._setup(x0)

    def _setup(self, x0: torch.Tensor) -> None:  # noqa: B027 - stateless algorithms keep the default
        """This algorithm's own state (buffers, mixers, relays like x0), built once the constructor
        has set comm, mixers, topology, optimizer and options."""

    @abstractmethod
    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """x(t) -> x(t+1) in place, given this worker's gradient at x(t).

        Args:
            x: the flat model x(t), updated in place.
            grad: the gradient at x(t), flat as x.
            lr: this step's learning rate.
            step: the step number t (every worker passes the same; it numbers the
                communication rounds, and so decides simulated drops).
        """

    # -- a step range by range: the pipelined and the overlapped step --------------------------
    #
    # Every algorithm here updates coordinate by coordinate (elementwise local optimizers; the same
    # mixing weights or relay counters for every coordinate), so a step can start on a range of the
    # flat model as soon as that range's gradient is final, while backward still computes the rest:
    #
    #     algorithm.begin_step(x, grad, lr, step)   # before backward: nothing of grad is final yet
    #     algorithm.ready(lo, hi)                   # grad[lo:hi] is final: update, start sending
    #     ...                                       # (ranges disjoint, covering [0, numel) in all)
    #     algorithm.finish_step()                   # the remaining receives, then x(t+1)
    #
    # Every rank calls ready() with the same ranges in the same order (backward visits the same
    # layers everywhere), so messages of a range match by their order. The result is bit-identical
    # to step(): the default here runs the whole step() in finish_step(); an algorithm that starts
    # work in ready() overrides all three, and its step() is begin_step, ready(0, numel),
    # finish_step (RangedAlgorithm below: all-reduce, D-PSGD, QGM, D², gradient tracking, SGP).

    def begin_step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """Start step ``step`` on ``x`` with the gradient that will be in ``grad`` (not final yet).

        Args:
            x: the flat model x(t), updated in place by ``finish_step``.
            grad: the buffer backward fills with the gradient at x(t), flat as x.
            lr: this step's learning rate.
            step: the step number t (the same on every worker).
        """
        self._ranged = (x, grad, lr, step)

    def ready(self, lo: int, hi: int) -> None:  # noqa: B027 - the default does everything in finish_step
        """``grad[lo:hi]`` is final: start that range's update and communication if this algorithm
        can.

        Args:
            lo: the range's first flat coordinate.
            hi: one past its last (ranges of a step are disjoint and cover [0, numel)).
        """

    def finish_step(self) -> None:
        """Complete the step begun by ``begin_step`` (every range has been ``ready``)."""
        x, grad, lr, step = self._ranged
        self.step(x, grad, lr, step)

    def state_dict(self) -> dict[str, Any]:
        """Everything besides x needed to resume exactly (in-flight messages, counters,
        corrections).

        Returns:
            Tensors and numbers by name, as ``load_state_dict`` takes them back.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless algorithms keep the default
        """Restore what ``state_dict`` returned, on resume.

        Args:
            state: the tensors and numbers by name, as ``state_dict`` gave them.
        """


def check_ranges(ranges: list[tuple[int, int]], numel: int) -> None:
    """Raise ValueError unless the ranges of one step are disjoint and cover [0, numel) (each ready
    once; an empty range anywhere is harmless)."""
    position = 0
    for lo, hi in sorted(r for r in ranges if r[0] != r[1]):
        if lo != position or hi < lo:
            break
        position = hi
    else:
        if position == numel:
            return
    shown = ", ".join(f"[{lo}, {hi})" for lo, hi in ranges[:8]) + (
        ", ..." if len(ranges) > 8 else ""
    )
    raise ValueError(
        f"the ranges made ready in a step must be disjoint and cover [0, {numel}) once; got {shown}"
    )


class RangedAlgorithm(Algorithm):
    """An algorithm that starts a range's update and communication as soon as the range is ready;
    its step() is begin_step, ready(0, numel), finish_step: the whole and the ranged step are one
    code path. A subclass defines ``_start`` (grad[lo:hi] is final: the local update of the range,
    then its sends) and ``_finish`` (receives and combination, range by range in the order started,
    round by round).

    ``numel`` is x's last dimension (the batched engine steps x [N, numel], whole steps only)."""

    def step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        self.begin_step(x, grad, lr, step)
        self.ready(0, x.shape[-1])
        self.finish_step()

    def begin_step(self, x: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        super().begin_step(x, grad, lr, step)
        self._started: list[tuple[int, int, Any]] = []
        # per-step counters (Adam's bias correction) before any range's update
        self.optimizer.begin_step()

    def ready(self, lo: int, hi: int) -> None:
        self._started.append((lo, hi, self._start(lo, hi, len(self._started))))

    def progress(self) -> None:
        """Let the communication of the ranges made ready so far advance without waiting (a hook may
        call it while backward runs: the MPI backend's all-reduce posts its next stages only here
        or in finish_step)."""
        for _, _, pending in self._started:
            self._test(pending)

    def _test(self, pending: Any) -> None:
        pending.test()

    def finish_step(self) -> None:
        started, self._started = self._started, []
        check_ranges([(lo, hi) for lo, hi, _ in started], self._ranged[0].shape[-1])
        # every range's round in the order started (messages of a round match in that order), then
        # the next round
        while started:
            started = [
                (lo, hi, later)
                for lo, hi, pending in started
                if (later := self._finish(lo, hi, pending)) is not None
            ]

    @abstractmethod
    def _start(self, lo: int, hi: int, index: int) -> Any:
        """Coordinates [lo, hi) are final in grad: update them and start their communication (the
        ``index``-th range of this step); return what ``_finish`` needs."""

    @abstractmethod
    def _finish(self, lo: int, hi: int, pending: Any) -> Any:
        """Complete the round of range [lo, hi) that ``pending`` started; None when the range is
        done, or what its next round started (SGP's second round)."""

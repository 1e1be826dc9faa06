"""Every algorithm with lost messages, message passing held against the independent loss model
(tests/drop_oracle.py)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from relaympi.algorithms import AlgorithmOptions, make_algorithm, round_id
from relaympi.algorithms.dme import RelaySumMeanEstimator
from relaympi.algorithms.matrix import make_matrix_algorithm
from relaympi.comm import DropPolicy, run_local
from relaympi.optim import make_optimizer
from relaympi.tasks.quadratics import QuadraticsSpec, generate
from relaympi.topology import TopologyError, build
from tests.algorithm_cases import SGD, Case, cases
from tests.drop_oracle import LossyMeanEstimator, LossyOracle, delivered_by
from tests.node_layouts import build_named

STEPS = 10
DIM = 7
DROP_PROB = 0.25
SEEDS = (1, 2)

CASES = cases("drops")


def _problem(n: int):
    return generate(n, QuadraticsSpec(dim=DIM, zeta2=2.0, r0=3.0), seed=11)


def _lr(t: int) -> float:
    return 0.05 + 0.01 * t  # time-varying, as warm-up produces


def _x0() -> np.ndarray:
    return np.linspace(-1.0, 1.0, DIM)


def _message_passing(comm, case: Case) -> tuple[int, np.ndarray]:
    topology, problem = build_named(case.topology, comm.world_size), _problem(comm.world_size)
    x = torch.tensor(_x0(), dtype=torch.float64)
    options = AlgorithmOptions(
        relay_mode=case.relay_mode,
        relay_in_place=case.relay_in_place,
        relay_chunk=case.relay_chunk,
        d2_exact_diffusion=case.d2_exact_diffusion,
    )
    algorithm = make_algorithm(
        case.algo, comm, topology, make_optimizer(case.optimizer, x), x, options
    )
    H, c = torch.from_numpy(problem.H[comm.rank]), torch.from_numpy(problem.c[comm.rank])
    trajectory = []
    for t in range(STEPS):
        algorithm.step(x, H @ x - c, _lr(t), t)
        trajectory.append(x.numpy().copy())
    return comm.rank, np.array(trajectory)


def _oracle(case: Case, n: int, drops: DropPolicy) -> np.ndarray:
    """The lossy model's trajectory, [steps, n, d]."""
    topology, problem = build_named(case.topology, n), _problem(n)
    oracle = LossyOracle(
        case.algo,
        topology,
        _x0(),
        case.optimizer,
        delivered_by(drops),
        case.relay_mode,
        case.d2_exact_diffusion,
    )
    X = np.repeat(_x0()[None], n, axis=0)
    trajectory = []
    for t in range(STEPS):
        X = oracle.step(X, problem.gradients(X), _lr(t), t)
        trajectory.append(X.copy())
    return np.array(trajectory)


def _world_size(spmd_results: list) -> int:
    if len(spmd_results) > 1:
        return len(spmd_results)
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


@pytest.mark.spmd
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_message_passing_with_drops_matches_loss_model(spmd, case, seed):
    drops = DropPolicy(DROP_PROB, seed=seed)
    try:
        results = spmd(_message_passing, case, drops=drops, world_size=case.workers)
    except TopologyError as exc:  # under mpirun: a world size this topology does not accept
        pytest.skip(str(exc))
    n = _world_size(results)
    expected = _oracle(case, n, drops)
    for rank, trajectory in results:
        np.testing.assert_allclose(
            trajectory, expected[:, rank], rtol=0, atol=1e-10, err_msg=f"rank {rank}"
        )


@pytest.mark.parametrize(
    "case", [c for c in CASES if not (c.relay_in_place or c.relay_chunk)], ids=lambda c: c.id
)
def test_loss_model_without_drops_is_the_matrix_form(case):
    """With every message delivered, the loss model is the matrix oracle (delayed averages, W x)."""
    n = case.workers
    topology, problem = build_named(case.topology, n), _problem(n)
    lossy = LossyOracle(
        case.algo,
        topology,
        _x0(),
        case.optimizer,
        lambda *_: True,
        case.relay_mode,
        case.d2_exact_diffusion,
    )
    matrix = make_matrix_algorithm(
        case.algo,
        topology,
        n,
        _x0(),
        case.optimizer,
        relay_mode=case.relay_mode,
        d2_exact_diffusion=case.d2_exact_diffusion,
    )
    X = Y = np.repeat(_x0()[None], n, axis=0)
    for t in range(STEPS):
        X = lossy.step(X, problem.gradients(X), _lr(t), t)
        Y = matrix.step(Y, problem.gradients(Y), _lr(t), t)
        np.testing.assert_allclose(X, Y, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_case_loses_messages(case):
    """Each case exercises loss: its lossy trajectory leaves the lossless one, unless its
    algorithm sends no message that can be lost (as it declares)."""
    lossless, lossy = (
        _oracle(case, case.workers, DropPolicy(0.0)),
        _oracle(case, case.workers, DropPolicy(DROP_PROB, seed=SEEDS[0])),
    )
    gap = np.abs(lossless - lossy).max()
    assert gap > 1e-6 if case.loses_messages else gap == 0


def _one_peer_pairs(name: str, n: int, t: int) -> list[tuple[int, int]]:
    """Step t's pairs of a one-peer topology, from docs/algorithms.md's definition:
    one-peer-exponential pairs i with i XOR 2^(t mod log2 n); alternating-ring pairs (2j, 2j+1) on
    even steps and (2j+1, 2j+2 mod n) on odd steps."""
    if name == "one-peer-exponential":
        hop = 2 ** (t % (n.bit_length() - 1))
        return [(i, i + hop) for i in range(n) if not i & hop]
    return [(i, (i + 1) % n) for i in range(t % 2, n, 2)]


@pytest.mark.parametrize("name, n", [("one-peer-exponential", 8), ("alternating-ring", 6)])
def test_loss_model_mixes_with_each_steps_one_peer(name, n):
    """On a one-peer topology the loss model mixes with W(t) of step t: each rank averages with
    its peer at 1/2, and keeps its own model where the peer's message was lost."""
    drops = DropPolicy(0.3, seed=5)
    oracle = LossyOracle("dpsgd", build(name, n), np.zeros(n), SGD, delivered_by(drops))
    for t in range(7):
        expected = np.eye(n)
        for i, j in _one_peer_pairs(name, n, t):
            for dst, src in ((i, j), (j, i)):
                if not drops.dropped(round_id(t), 0, src, dst):
                    expected[dst, dst] = expected[dst, src] = 0.5
        # X = I, no update: X(t+1) = W(t) with its lost messages
        np.testing.assert_array_equal(oracle.step(np.eye(n), np.zeros((n, n)), 0.0, t), expected)


class _LoseOne(DropPolicy):
    """Exactly one lost message: (round, tag, src, dst)."""

    def __init__(self, lost: tuple[int, int, int, int]):
        super().__init__()
        self.lost = lost

    def dropped(self, round: int, tag: int, src: int, dst: int) -> bool:
        return (round, tag, src, dst) == self.lost


def test_relay_hand_derived_chain_with_a_lost_message():
    """Chain 0-1-2, only worker 0 has a constant update +1; its message to 1 in step 1 is lost.

    t=0: x(1/2) = (1,0,0); n-bar = (2,3,2); x(1) = (1/2, 1/3, 0).
    t=1: x(3/2) = (3/2, 1/3, 0); m_01 = 3/2 is lost: worker 1 receives (0, count 0), n-bar_1 = 2;
         m_10 = 1/3 (count 2), m_12 = 1/3 + m_01(0) = 4/3 (count 2); x(2) = (11/18, 1/6, 4/9).
    t=2: x(5/2) = (29/18, 1/6, 4/9); m_12 = 1/6 + the empty m_01(1) = 1/6 (count 1), m_10 = 1/6,
         m_01 = 29/18, m_21 = 4/9; n-bar = (3, 3, 2); x(3) = (16/27, 20/27, 11/36).
    """
    expected = np.array(
        [
            [Fraction(1, 2), Fraction(1, 3), Fraction(0)],
            [Fraction(11, 18), Fraction(1, 6), Fraction(4, 9)],
            [Fraction(16, 27), Fraction(20, 27), Fraction(11, 36)],
        ],
        dtype=np.float64,
    )
    drops, topology = _LoseOne((round_id(1), 0, 0, 1)), build("chain", 3)
    G = np.array([[-1.0], [0.0], [0.0]])

    def body(comm):
        x = torch.zeros(1, dtype=torch.float64)
        algorithm = make_algorithm("relay", comm, topology, make_optimizer(SGD, x), x)
        out = []
        for t in range(3):
            algorithm.step(x, torch.from_numpy(G[comm.rank].copy()), 1.0, t)
            out.append(float(x[0]))
        return out

    np.testing.assert_allclose(
        np.array(run_local(3, body, drops=drops)).T, expected, rtol=0, atol=1e-15
    )
    oracle, X = (
        LossyOracle("relay", topology, np.zeros(1), SGD, delivered_by(drops)),
        np.zeros((3, 1)),
    )
    for t in range(3):
        X = oracle.step(X, G, 1.0, t)
        np.testing.assert_allclose(X[:, 0], expected[t], rtol=0, atol=1e-15)


@pytest.mark.parametrize("topo, n", [("chain", 5), ("binary-tree", 7), ("star", 5)])
def test_mean_estimation_with_drops_matches_loss_model(topo, n):
    """RelaySum for distributed mean estimation: y / s over the samples whose messages arrived."""
    drops, topology = DropPolicy(DROP_PROB, seed=4), build(topo, n)

    def sample(t: int) -> np.ndarray:
        return np.sin(np.arange(n * 3, dtype=np.float64).reshape(n, 3) + 0.7 * t)

    def body(comm):
        estimator = RelaySumMeanEstimator(comm, topology, torch.zeros(3, dtype=torch.float64))
        return [
            estimator.step(torch.from_numpy(sample(t)[comm.rank].copy()), t).numpy().copy()
            for t in range(STEPS)
        ]

    got = np.array(run_local(n, body, drops=drops)).transpose(1, 0, 2)  # [steps, n, 3]
    oracle = LossyMeanEstimator(topology, 3, delivered_by(drops))
    expected = np.array([oracle.step(sample(t), t) for t in range(STEPS)])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)

"""The batched engine's algorithms and optimizers against message passing, the matrix oracle and the
loss model."""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import warnings

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from relaympi.algorithms import (
    RELAY_MODES,
    AlgorithmError,
    AlgorithmOptions,
    make_algorithm,
    round_id,
)
from relaympi.algorithms.matrix import MatrixAlgorithm, make_matrix_algorithm
from relaympi.algorithms.relaysum import RelaySum
from relaympi.batched import BatchedOptimizer, make_batched_algorithm
from relaympi.batched.relay import BatchedRelaySum
from relaympi.comm import DropPolicy, run_local
from relaympi.flat import padded_zeros
from relaympi.optim import OptimizerConfig, make_optimizer
from relaympi.tasks.quadratics import QuadraticsSpec, generate
from relaympi.topology import build
from tests.algorithm_cases import ADAM, HEAVY_BALL, MOMENTUM, SGD, Case, cases
from tests.drop_oracle import LossyOracle, delivered_by
from tests.node_layouts import build_named

STEPS = 30
DIM = 7
DROP_PROB = 0.25


CASES = cases("batched")
DROPS = (0.0, DROP_PROB)


def _problem(n: int):
    return generate(n, QuadraticsSpec(dim=DIM, zeta2=2.0, r0=3.0), seed=11)


def _lr(t: int) -> float:
    return 0.05 + 0.003 * t  # time-varying, as warm-up produces


def _x0() -> np.ndarray:
    return np.linspace(-1.0, 1.0, DIM)


def _message_passing(comm, case: Case) -> tuple[np.ndarray, np.ndarray]:
    topology, problem = build_named(case.topology, comm.world_size), _problem(comm.world_size)
    x = torch.tensor(_x0(), dtype=torch.float64)
    algorithm = make_algorithm(
        case.algo, comm, topology, make_optimizer(case.optimizer, x), x, case.options
    )
    H, c = torch.from_numpy(problem.H[comm.rank]), torch.from_numpy(problem.c[comm.rank])
    trajectory = []
    for t in range(STEPS):
        algorithm.step(x, H @ x - c, _lr(t), t)
        trajectory.append(x.numpy().copy())
    return np.array(trajectory), comm.bytes_sent.copy()


class _Batched:
    """The batched engine on the case's quadratics, driven one step at a time."""

    def __init__(self, case: Case, drops: DropPolicy):
        n = case.workers
        self.problem = _problem(n)
        self.X = torch.tensor(np.repeat(_x0()[None], n, axis=0))
        self.optimizer = BatchedOptimizer(case.optimizer, self.X)
        self.algorithm = make_batched_algorithm(
            case.algo,
            build_named(case.topology, n),
            self.optimizer,
            self.X.clone(),
            case.options,
            drops,
        )
        self.H, self.c = torch.from_numpy(self.problem.H), torch.from_numpy(self.problem.c)

    def step(self, t: int) -> np.ndarray:
        G = torch.einsum("nij,nj->ni", self.H, self.X) - self.c
        self.algorithm.step(self.X, G, _lr(t), t)
        return self.X.numpy().copy()


def _oracle(case: Case, drops: DropPolicy) -> np.ndarray:
    """[steps, n, d]: the matrix oracle without drops, the independent loss model
    (tests/drop_oracle.py) with them."""
    n = case.workers
    topology, problem = build_named(case.topology, n), _problem(n)
    engine: MatrixAlgorithm | LossyOracle
    if drops.prob == 0:
        engine = make_matrix_algorithm(
            case.algo,
            topology,
            n,
            _x0(),
            case.optimizer,
            relay_mode=case.relay_mode,
            d2_exact_diffusion=case.d2_exact_diffusion,
        )
    else:
        engine = LossyOracle(
            case.algo,
            topology,
            _x0(),
            case.optimizer,
            delivered_by(drops),
            case.relay_mode,
            case.d2_exact_diffusion,
        )
    X, trajectory = np.repeat(_x0()[None], n, axis=0), []
    for t in range(STEPS):
        X = engine.step(X, problem.gradients(X), _lr(t), t)
        trajectory.append(X.copy())
    return np.array(trajectory)


@pytest.mark.parametrize("prob", DROPS, ids=lambda p: f"drop{p}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_batched_equals_message_passing_and_oracle(case, prob):
    drops = DropPolicy(prob, seed=3)
    batched = _Batched(case, drops)
    trajectory = np.array([batched.step(t) for t in range(STEPS)])
    results = run_local(case.workers, _message_passing, case, drops=drops)
    passed = np.stack([r[0] for r in results], axis=1)
    assert np.abs(trajectory).max() < 1e3  # a stable run: absolute tolerances mean something
    np.testing.assert_allclose(trajectory, passed, rtol=0, atol=1e-9)
    np.testing.assert_allclose(trajectory, _oracle(case, drops), rtol=0, atol=1e-9)
    np.testing.assert_array_equal(batched.algorithm.bytes_sent, np.stack([r[1] for r in results]))
    if prob and case.loses_messages:  # the drops were real: some link carried less than it would
        lossless = _Batched(case, DropPolicy())
        for t in range(STEPS):
            lossless.step(t)
        assert (batched.algorithm.bytes_sent < lossless.algorithm.bytes_sent).any()


@pytest.mark.parametrize("mode", RELAY_MODES)
def test_relay_on_an_irregular_tree_equals_the_loss_model(mode):
    """The social network's spanning tree (32 workers, degrees 1 to 8) with drops, against the loss
    model only
    (32 message-passing threads would dominate this file's time)."""
    case, drops = (
        Case("relay", "social-network-tree", 32, MOMENTUM, mode),
        DropPolicy(DROP_PROB, seed=4),
    )
    batched = _Batched(case, drops)
    trajectory = np.array([batched.step(t) for t in range(STEPS)])
    np.testing.assert_allclose(trajectory, _oracle(case, drops), rtol=0, atol=1e-9)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_state_dict_round_trip_continues_bit_identically(case):
    drops, split = DropPolicy(DROP_PROB, seed=5), 7
    first = _Batched(case, drops)
    for t in range(split):
        first.step(t)
    saved = copy.deepcopy((first.X, first.algorithm.state_dict(), first.optimizer.state_dict()))
    expected = [first.step(t) for t in range(split, split + 8)]
    resumed = _Batched(case, drops)
    X, algorithm_state, optimizer_state = saved
    resumed.X.copy_(X)
    resumed.algorithm.load_state_dict(algorithm_state)
    resumed.optimizer.load_state_dict(optimizer_state)
    for t, want in zip(range(split, split + 8), expected, strict=True):
        np.testing.assert_array_equal(resumed.step(t), want)


@pytest.mark.parametrize(
    "config",
    [
        SGD,
        MOMENTUM,
        HEAVY_BALL,
        ADAM,
        OptimizerConfig(momentum=0.7, weight_decay=0.1, nesterov=False),
    ],
    ids=["sgd", "nesterov-wd", "heavy-ball", "adam-wd", "heavy-ball-wd"],
)
def test_batched_optimizer_matches_the_local_optimizer(config):
    rng = np.random.default_rng(0)
    n, d = 5, 33
    X = torch.tensor(rng.standard_normal((n, d)))
    rows = [X[i].clone() for i in range(n)]
    batched = BatchedOptimizer(config, X)
    local = [make_optimizer(config, row) for row in rows]
    for t in range(12):
        G = torch.tensor(rng.standard_normal((n, d)))
        lr = 0.1 + 0.01 * t
        if t % 3 == 2:  # apply=False returns the update and leaves X alone
            before = X.clone()
            U = batched.update(G, X, lr, apply=False)
            assert torch.equal(X, before)
            X.add_(U)
            for i in range(n):
                rows[i].add_(local[i].update(G[i], rows[i], lr))
        else:
            batched.update(G, X, lr)
            for i in range(n):
                local[i].update(G[i], rows[i], lr, apply=True)
        np.testing.assert_allclose(X.numpy(), torch.stack(rows).numpy(), rtol=0, atol=1e-12)
    state = batched.state_dict()
    for key, value in local[0].state_dict().items():
        np.testing.assert_allclose(
            np.asarray(state[key])[0] if state[key].dim() else state[key], value, rtol=0, atol=1e-12
        )


def test_relay_counts_parcels_like_message_passing_on_a_chain():
    """Chain of 3 with one lost message: the messages and counters the hand derivation gives
    (tests/test_algorithms_with_drops.py's chain, here through the batched engine)."""

    class LoseOne(DropPolicy):
        def dropped(self, round, tag, src, dst):
            return (round, tag, src, dst) == (4, 0, 0, 1)  # step 1's message 0 -> 1

    X = torch.zeros(3, 1, dtype=torch.float64)
    optimizer = BatchedOptimizer(SGD, X)
    algorithm = make_batched_algorithm(
        "relay", build("chain", 3), optimizer, X.clone(), AlgorithmOptions(), LoseOne()
    )
    G = torch.tensor([[-1.0], [0.0], [0.0]])  # worker 0's update is +1 per step (lr 1)
    expected = [(1 / 2, 1 / 3, 0.0), (11 / 18, 1 / 6, 4 / 9), (16 / 27, 20 / 27, 11 / 36)]
    for t, want in enumerate(expected):
        algorithm.step(X, G.clone(), 1.0, t)
        np.testing.assert_allclose(X[:, 0].numpy(), want, rtol=0, atol=1e-15)
    itemsize = 8
    # [payload, counter] in steps 0 and 2, step 1 lost
    assert algorithm.bytes_sent[0, 1] == 2 * 2 * itemsize
    assert algorithm.bytes_sent[1, 0] == 3 * 2 * itemsize


@pytest.mark.parametrize(
    "algo, topology, n, config, match",
    [
        ("relay", "ring", 6, SGD, "not a tree"),
        ("sgp", "ring", 8, SGD, "exponential"),
        ("qgm", "ring", 6, SGD, "momentum"),
        ("nope", "ring", 6, SGD, "unknown algorithm"),
    ],
)
def test_refuses_what_message_passing_refuses(algo, topology, n, config, match):
    X = torch.zeros(n, 3, dtype=torch.float64)
    with pytest.raises(AlgorithmError, match=match):
        make_batched_algorithm(algo, build(topology, n), BatchedOptimizer(config, X), X)


def _final_message_passing(comm, case: Case, dtype: torch.dtype) -> np.ndarray:
    topology, problem = build_named(case.topology, comm.world_size), _problem(comm.world_size)
    x = torch.tensor(_x0(), dtype=dtype)
    algorithm = make_algorithm(
        case.algo, comm, topology, make_optimizer(case.optimizer, x), x, case.options
    )
    H, c = (
        torch.from_numpy(problem.H[comm.rank]).to(dtype),
        torch.from_numpy(problem.c[comm.rank]).to(dtype),
    )
    for t in range(STEPS):
        algorithm.step(x, H @ x - c, _lr(t), t)
    return x.numpy().copy()


@pytest.mark.parametrize(
    "case",
    [Case("d2", "ring", 7), Case("relay", "double-binary-trees", 8, MOMENTUM, "previous")],
    ids=lambda c: c.id,
)
def test_float32_agrees_with_message_passing_at_full_precision_even_with_tf32_allowed(case):
    """float32 to rounding; allowing TF32 for the models leaves the gossip average in full
    precision,
    and the setting as it was.

    Not a fixed tolerance (float32 rounding differs between CPUs): the batched float32 models may be
    at most 10x further from float64 message passing than float32 message passing is (measured on
    both, after 30 steps, values ~2: 5e-6 for D² on a ring, 5e-7 for RelaySGD), plus 16 float32
    epsilons of the scale. An average rounded to TF32's 10-bit mantissa moves the models by 4e-3
    (RelaySGD) to 1e-1 (D²).
    """
    n, drops, before = (
        case.workers,
        DropPolicy(DROP_PROB, seed=3),
        torch.get_float32_matmul_precision(),
    )
    problem = _problem(n)
    X = torch.tensor(np.repeat(_x0()[None], n, axis=0), dtype=torch.float32)
    algorithm = make_batched_algorithm(
        case.algo,
        build_named(case.topology, n),
        BatchedOptimizer(case.optimizer, X),
        X.clone(),
        case.options,
        drops,
    )
    H, c = torch.from_numpy(problem.H).float(), torch.from_numpy(problem.c).float()
    torch.set_float32_matmul_precision("medium")
    try:
        for t in range(STEPS):
            # the gradient without a matmul: "medium" also sets oneDNN's float32 matmul precision to
            # bfloat16 (no effect
            # seen on AMD EPYC or on a Xeon with AMX, but nothing promises that); only the algorithm
            # is under test
            algorithm.step(X, (H * X[:, None, :]).sum(dim=2) - c, _lr(t), t)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    message_passing = np.stack(
        run_local(n, _final_message_passing, case, torch.float32, drops=drops)
    )
    reference = np.stack(run_local(n, _final_message_passing, case, torch.float64, drops=drops))
    batched_error = np.abs(X.numpy().astype(np.float64) - reference).max()
    own_error = np.abs(message_passing.astype(np.float64) - reference).max()
    eps = float(np.finfo(np.float32).eps)
    assert batched_error <= 10 * own_error + 16 * eps * np.abs(reference).max(), (
        batched_error,
        own_error,
    )


def _held_bytes(obj, seen: set) -> int:
    """Bytes of every tensor and numpy array reachable from ``obj`` through dataclasses, lists,
    tuples and dicts, each storage once."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        fresh = key not in seen
        seen.add(key)
        return obj.untyped_storage().nbytes() if fresh else 0
    if isinstance(obj, np.ndarray):
        base = obj if obj.base is None else obj.base
        fresh = id(base) not in seen
        seen.add(id(base))
        return base.nbytes if fresh else 0
    if isinstance(obj, (list, tuple)):
        return sum(_held_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_held_bytes(x, seen) for x in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_held_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


def _peak_allocated_bytes(fn, tmp_path) -> int:
    """The most CPU memory that what ``fn`` allocated ever held at once: the allocator's events,
    as torch's memory profiler records them (its raw timeline: CREATE = 2, DESTROY = 4)."""
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    path = str(tmp_path / "memory.raw.json.gz")
    with warnings.catch_warnings():
        # deprecated for CUDA's snapshots; the CPU timeline has no successor
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(path, device="cpu")
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    live = peak = 0
    for _, action, nbytes, _ in sorted(events, key=lambda e: e[0]):
        if action in (2, 4):
            live += nbytes
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("n", [16, 64])
@pytest.mark.parametrize("topo", ["chain", "star", "binary-tree", "double-binary-trees"])
def test_relay_memory_is_no_more_than_message_passing(topo, n, tmp_path):
    """Memory per worker is no more than message passing uses. Batched: every tensor and array
    the relay holds plus the peak of what its steps allocate (with drops, both row parities);
    message
    passing: every rank's RelaySum.buffers(), default options (its steps allocate no buffer of its
    own; the transport's copies in flight are not counted, in its favour). float32."""
    numel, topology = 1 << 12, build(topo, n)
    X = torch.randn(n, numel)
    sent = np.zeros((n, n), dtype=np.int64)
    relay = BatchedRelaySum(topology, X, DropPolicy(DROP_PROB, seed=1), sent)

    def steps(first: int) -> None:
        for t in range(first, first + 2):
            relay.exchange(X, round_id(t))
            relay.add_received(X, [float(n)] * topology.num_layers)

    steps(0)
    temporaries = _peak_allocated_bytes(lambda: steps(2), tmp_path)
    batched = _held_bytes(relay.trees, set()) + temporaries
    # it sees temporaries
    assert _peak_allocated_bytes(lambda: X.index_select(0, torch.arange(n)), tmp_path) >= X.nbytes

    def held_by_rank(comm) -> int:
        parcel = padded_zeros(numel, dtype=torch.float32)
        mp = RelaySum(comm, topology, numel, parcel)
        for t in range(2):
            mp.exchange(parcel, t)
        held, bounce = mp.buffers()
        return sum(
            b.untyped_storage().nbytes() for b in held + ([bounce] if bounce is not None else [])
        )

    passing = sum(run_local(n, held_by_rank))
    model = n * numel * X.element_size()
    assert temporaries < 0.05 * model  # no block-sized temporary: index arrays only
    assert batched <= passing, (
        f"batched {batched / model:.3f} vs message passing {passing / model:.3f} models per worker"
    )

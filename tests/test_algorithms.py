"""Message-passing algorithms against the matrix-form oracle, hand-derived trajectories, and
refusals."""

# Long module: the one table of algorithm cases against the matrix-form oracle

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from relaympi.algorithms import AlgorithmError, AlgorithmOptions, make_algorithm
from relaympi.algorithms.matrix import make_matrix_algorithm
from relaympi.algorithms.relaysum import RelaySum
from relaympi.comm import run_local
from relaympi.flat import padded_zeros
from relaympi.optim import make_optimizer
from relaympi.tasks.quadratics import QuadraticsSpec, generate
from relaympi.topology import TopologyError, build
from tests.algorithm_cases import ADAM, MOMENTUM, SGD, Case, cases
from tests.node_layouts import build_named

STEPS = 12


def _problem(n):
    return generate(n, QuadraticsSpec(dim=7, zeta2=2.0, r0=3.0), seed=11)


def _message_passing(comm, case: Case, x0):
    n = comm.world_size
    topology = build_named(case.topology, n)
    problem = _problem(n)
    x = torch.tensor(x0, dtype=torch.float64)
    optimizer = make_optimizer(case.optimizer, x)
    algorithm = make_algorithm(case.algo, comm, topology, optimizer, x, case.options)
    H, c = torch.from_numpy(problem.H[comm.rank]), torch.from_numpy(problem.c[comm.rank])
    trajectory = []
    for t in range(STEPS):
        grad = H @ x - c
        algorithm.step(x, grad, 0.05 + 0.01 * t, t)  # time-varying lr, as warm-up produces
        trajectory.append(x.numpy().copy())
    return comm.rank, np.array(trajectory)


def _oracle(case: Case, n, x0):
    topology = build_named(case.topology, n)
    problem = _problem(n)
    engine = make_matrix_algorithm(
        case.algo,
        topology,
        n,
        x0,
        case.optimizer,
        relay_mode=case.relay_mode,
        d2_exact_diffusion=case.d2_exact_diffusion,
    )
    X = np.repeat(x0[None], n, axis=0)
    trajectory = []
    for t in range(STEPS):
        X = engine.step(X, problem.gradients(X), 0.05 + 0.01 * t, t)
        trajectory.append(X.copy())
    return np.array(trajectory)  # [T, n, d]


@pytest.mark.spmd
@pytest.mark.parametrize("case", cases("oracle"), ids=lambda c: c.id)
def test_message_passing_matches_matrix_oracle(spmd, case):
    x0 = np.linspace(-1.0, 1.0, 7)
    try:
        results = spmd(_message_passing, case, x0, world_size=case.workers)
    except TopologyError as exc:  # under mpirun: a world size this topology does not accept
        pytest.skip(str(exc))
    n = len(results) if len(results) > 1 else _world_size_of(results)
    expected = _oracle(case, n, x0)
    for rank, trajectory in results:
        np.testing.assert_allclose(trajectory, expected[:, rank], rtol=0, atol=1e-10)


def _world_size_of(results):
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def test_relay_hand_derived_chain_trajectory():
    """Chain of 3, only worker 0 has a constant update +1 (derivation in the docstring of the
    expected values).

    t=0: x(1/2) = (1,0,0); n-bar = (2,3,2); x(1) = (1/2, 1/3, 0).
    t=1: x(3/2) = (3/2, 1/3, 0); m_{1->2} = 1/3 + m_{0->1}(0) = 4/3; x(2) = (11/18, 11/18, 4/9).
    t=2: x(5/2) = (29/18, 11/18, 8/18); m_{1->0} = 11/18, m_{1->2} = 11/18 + 3/2 = 38/18;
         x(3) = (20/27, 8/9, 23/27).
    """
    expected = [
        [Fraction(1, 2), Fraction(1, 3), Fraction(0)],
        [Fraction(11, 18), Fraction(11, 18), Fraction(4, 9)],
        [Fraction(20, 27), Fraction(8, 9), Fraction(23, 27)],
    ]

    def body(comm):
        topology = build("chain", 3)
        x = torch.zeros(1, dtype=torch.float64)
        algorithm = make_algorithm("relay", comm, topology, make_optimizer(SGD, x), x)
        out = []
        for t in range(3):
            grad = torch.full((1,), -1.0 if comm.rank == 0 else 0.0, dtype=torch.float64)
            algorithm.step(x, grad, 1.0, t)
            out.append(float(x[0]))
        return out

    got = run_local(3, body)
    for t in range(3):
        for rank in range(3):
            assert got[rank][t] == pytest.approx(float(expected[t][rank]), abs=1e-15)


@pytest.mark.parametrize(
    "topo", ["chain", "binary-tree", "double-binary-trees", "star", "social-network-tree"]
)
def test_relaysum_delivers_exact_delayed_sums(topo):
    """s_i(t) = sum_j p_j(t - max(tau_ij - 1, 0)) once t >= tau_max - 1, and n-bar = n."""
    n = 32 if topo.startswith("social") else 9
    topology = build(topo, n)
    rounds = topology.diameter + 3

    def parcel(j, t):
        return torch.tensor([1000.0 * j + t, -(j + 1) * (t + 1.0), 0.5 * j, t], dtype=torch.float64)

    def body(comm):
        relay = RelaySum(comm, topology, 4, torch.zeros(4, dtype=torch.float64))
        sums, counts = [], []
        for t in range(rounds):
            p = parcel(comm.rank, t)
            relay.exchange(p, t)
            total = p.clone()
            relay.add_received(total)
            sums.append(total.numpy())
            counts.append(relay.counts())
        return sums, counts

    results = run_local(n, body)
    L = topology.num_layers
    for i, (sums, counts) in enumerate(results):
        for t in range(rounds):
            for layer in range(L):
                tau = np.maximum(topology.delays(layer)[i] - 1, 0)
                # contiguous block k of the flat vector
                coords = topology.coordinate_blocks(4)[layer]
                present = [j for j in range(n) if tau[j] <= t]
                want = sum(parcel(j, t - tau[j]).numpy()[coords] for j in present)
                np.testing.assert_array_equal(sums[t][coords], want)
                assert counts[t][layer] == len(present)
        assert all(c == n for c in counts[-1])


def test_relaysum_counts_converge_under_drops():
    """With lost messages the counters say exactly how many parcels a sum holds."""
    from relaympi.comm import DropPolicy

    n, topology = 8, build("binary-tree", 8)

    def body(comm):
        relay = RelaySum(comm, topology, 1, torch.zeros(1, dtype=torch.float64))
        ok = []
        for t in range(30):
            relay.exchange(torch.ones(1, dtype=torch.float64), t)
            total = torch.ones(1, dtype=torch.float64)
            relay.add_received(total)
            ok.append(float(total[0]) == relay.counts()[0])  # each parcel is 1: sum == count
        return all(ok)

    assert all(run_local(n, body, drops=DropPolicy(0.2, seed=3)))


@pytest.mark.parametrize(
    "algo, topo, n, message",
    [
        ("relay", "ring", 6, "not a tree"),
        ("relay-grad", "fully-connected", 4, "not a tree"),
        ("sgp", "ring", 4, "exponential"),
        ("d2", "social-network", 32, "-1/3"),
        ("sgp", "one-peer-exponential", 4, "exponential"),
        ("d2", "alternating-ring", 4, "d2 needs a fixed gossip matrix; 'alternating-ring'"),
        ("d2", "one-peer-exponential", 4, "changes it every step"),
    ],
)
def test_invalid_combinations_are_refused(algo, topo, n, message):
    def body(comm):
        x = torch.zeros(3, dtype=torch.float64)
        with pytest.raises(AlgorithmError, match=message):
            make_algorithm(algo, comm, build(topo, n), make_optimizer(SGD, x), x)
        return True

    assert all(run_local(n, body))


def test_qgm_refuses_adam_and_plain_sgd():
    def body(comm):
        x = torch.zeros(3, dtype=torch.float64)
        for cfg in (SGD, ADAM):
            with pytest.raises(AlgorithmError, match="--momentum"):
                make_algorithm("qgm", comm, build("ring", 3), make_optimizer(cfg, x), x)
        return True

    assert all(run_local(3, body))


def test_d2_force_and_exact_diffusion_on_social_network():
    def body(comm, options):
        x = torch.zeros(2, dtype=torch.float64)
        make_algorithm("d2", comm, build("social-network", 32), make_optimizer(SGD, x), x, options)
        return True

    assert all(run_local(32, body, AlgorithmOptions(d2_force=True)))
    assert all(run_local(32, body, AlgorithmOptions(d2_exact_diffusion=True)))


def test_sgp_refuses_non_power_of_two_world():
    from relaympi.topology import TopologyError

    with pytest.raises((TopologyError, AlgorithmError), match="power of two"):
        build("exponential", 6)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize(
    "topo, n, bound",
    [
        ("chain", 8, 2.0),
        ("double-binary-trees", 16, 2.5),
        ("binary-tree", 16, 4.0),
        ("star", 6, 6.0),
    ],
)
def test_relaysum_memory_is_one_buffer_per_neighbour(topo, n, bound, in_place):
    """In place: the last message per neighbour (+1 scratch sum at degree >= 3) and a bounce buffer
    of 2 x degree x chunk elements, whatever the model size; else twice the messages. A leaf of a
    tree whose block ends before the model's adds one chunk (its last, holding the counter)."""
    numel, chunk, topology = 1000, 16, build(topo, n)
    bound = (bound if in_place else 2 * bound) + chunk / numel

    def body(comm):
        parcel = padded_zeros(numel, dtype=torch.float32)  # as flat models and updates are
        relay = RelaySum(comm, topology, numel, parcel, in_place=in_place, chunk=chunk)
        held, bounce = relay.buffers()
        # minus the counters
        elements = sum(b.numel() for b in held) - sum(
            b.shape[0] if b.dim() == 2 else 1 for b in held
        )
        for t in range(3):  # the exchange allocates no per-step model copies
            parcel.fill_(1.0)
            relay.exchange(parcel, t)
        after, bounce_after = relay.buffers()
        assert {b.data_ptr() for b in after} == {b.data_ptr() for b in held}
        if in_place:
            assert bounce is not None
            assert (
                bounce_after is bounce
                and bounce.numel()
                <= 2
                * max(topology.degree(comm.rank, k) for k in range(topology.num_layers))
                * chunk
            )
        else:
            assert bounce is None
        return elements / numel

    copies = run_local(n, body)
    assert max(copies) <= bound
    if in_place and topo in ("chain", "double-binary-trees"):
        # the paper: at most ~2 extra model copies on double binary trees
        assert max(copies) <= 2.5 + chunk / numel


@pytest.mark.parametrize("topo", ["chain", "binary-tree", "double-binary-trees", "star"])
def test_relay_in_place_exchange_gives_identical_numbers(topo):
    def body(comm, in_place):
        topology, problem = build(topo, comm.world_size), _problem(comm.world_size)
        x = torch.zeros(7, dtype=torch.float64)
        algorithm = make_algorithm(
            "relay",
            comm,
            topology,
            make_optimizer(MOMENTUM, x),
            x,
            AlgorithmOptions(relay_in_place=in_place),
        )
        H, c = (
            torch.from_numpy(problem.H[comm.rank]),
            torch.from_numpy(problem.c[comm.rank]),
        )
        for t in range(10):
            algorithm.step(x, H @ x - c, 0.05, t)
        return x.numpy()

    np.testing.assert_array_equal(
        np.array(run_local(7, body, True)), np.array(run_local(7, body, False))
    )


# RelaySum's ways of moving the same messages: whole or in chunks (pipelined), with separate
# receive buffers or in place through a bounce buffer, from a padded parcel (zero-copy leaves) or a
# plain one.
RELAYSUM_VARIANTS = [
    {"in_place": in_place, "chunk": chunk, "padded": padded}
    for in_place in (False, True)
    for chunk in (1 << 20, 2)
    for padded in (True, False)
]


def _relay_variant_trajectory(comm, algo, topo, mode, variant):
    topology, problem = build(topo, comm.world_size), _problem(comm.world_size)
    x0 = torch.linspace(-1.0, 1.0, 7, dtype=torch.float64)
    x = (
        padded_zeros(7, dtype=torch.float64)
        if variant["padded"]
        else torch.zeros(7, dtype=torch.float64)
    )
    x.copy_(x0)
    options = AlgorithmOptions(
        relay_mode=mode, relay_in_place=variant["in_place"], relay_chunk=variant["chunk"]
    )
    algorithm = make_algorithm(algo, comm, topology, make_optimizer(MOMENTUM, x), x, options)
    H, c = torch.from_numpy(problem.H[comm.rank]), torch.from_numpy(problem.c[comm.rank])
    out = []
    for t in range(10):
        algorithm.step(x, H @ x - c, 0.05, t)
        out.append(x.numpy().copy())
    return np.array(out)


@pytest.mark.slow
@pytest.mark.parametrize("drop_prob", [0.0, 0.25])
@pytest.mark.parametrize(
    "algo, topo, mode",
    [
        ("relay", t, m)
        for t in ("chain", "binary-tree", "double-binary-trees", "star")
        for m in ("counts", "previous")
    ]
    + [
        ("relay", "double-binary-trees", "initial"),
        ("relay-grad", "double-binary-trees", "counts"),
        ("relay-grad", "binary-tree", "counts"),
    ],
)
def test_relaysum_variants_give_identical_bits(algo, topo, mode, drop_prob):
    """Chunking, in-place swapping and zero-copy leaves change how messages move, never a bit of the
    result."""
    from relaympi.comm import DropPolicy

    results = [
        np.array(
            run_local(
                7,
                _relay_variant_trajectory,
                algo,
                topo,
                mode,
                variant,
                drops=DropPolicy(drop_prob, seed=5),
            )
        )
        for variant in RELAYSUM_VARIANTS
    ]
    for variant, got in zip(RELAYSUM_VARIANTS[1:], results[1:], strict=True):
        np.testing.assert_array_equal(got, results[0], err_msg=str(variant))
    if drop_prob == 0:  # and the reference variant is the matrix oracle's trajectory
        expected = np.stack([_oracle_fixed_lr(algo, topo, mode, 7)[:, r] for r in range(7)])
        np.testing.assert_allclose(results[0], expected, rtol=0, atol=1e-10)


def _oracle_fixed_lr(algo, topo, mode, n):
    topology, problem = build(topo, n), _problem(n)
    x0 = np.linspace(-1.0, 1.0, 7)
    engine = make_matrix_algorithm(algo, topology, n, x0, MOMENTUM, relay_mode=mode)
    X = np.repeat(x0[None], n, axis=0)
    out = []
    for t in range(10):
        X = engine.step(X, problem.gradients(X), 0.05, t)
        out.append(X.copy())
    return np.array(out)


@pytest.mark.spmd
@pytest.mark.parametrize(
    "variant",
    [
        {"in_place": False, "chunk": 2, "padded": True},
        {"in_place": True, "chunk": 3, "padded": False},
    ],
    ids=["chunked", "in-place"],
)
@pytest.mark.parametrize("topo", ["chain", "double-binary-trees"])
def test_chunked_relaysum_matches_the_oracle(spmd, topo, variant):
    """Several chunks per message through the real transport (run under mpirun in CI) give the
    oracle's numbers."""
    results = spmd(
        lambda comm: (
            comm.rank,
            comm.world_size,
            _relay_variant_trajectory(comm, "relay", topo, "counts", variant),
        )
    )
    for rank, n, trajectory in results:
        np.testing.assert_allclose(
            trajectory, _oracle_fixed_lr("relay", topo, "counts", n)[:, rank], rtol=0, atol=1e-10
        )


def test_cache_blocking_gives_identical_bits(monkeypatch):
    """Assembly and normalization run block by block; block and chunk boundaries never change a
    bit."""
    import relaympi.algorithms.relaysum as relaysum

    for topo in ("binary-tree", "double-binary-trees", "chain"):
        variant = {"in_place": False, "chunk": 1 << 20, "padded": True}
        whole = np.array(run_local(7, _relay_variant_trajectory, "relay", topo, "counts", variant))
        monkeypatch.setattr(relaysum, "CACHE_BLOCK", 2)
        for in_place, chunk in ((False, 3), (True, 5)):
            blocked = run_local(
                7,
                _relay_variant_trajectory,
                "relay",
                topo,
                "counts",
                {"in_place": in_place, "chunk": chunk, "padded": True},
            )
            np.testing.assert_array_equal(
                np.array(blocked), whole, err_msg=f"{topo} in_place={in_place} chunk={chunk}"
            )
        monkeypatch.undo()


def _hand_metropolis_hastings(topology) -> np.ndarray:
    """W_ij = 1/(1 + max(deg_i, deg_j)) on edges, the rest on the diagonal, from the edge list."""
    n = topology.world_size
    degree = [topology.degree(i) for i in range(n)]
    w = np.zeros((n, n))
    for i, j in topology.edges():
        w[i, j] = w[j, i] = 1.0 / (1 + max(degree[i], degree[j]))
    return w + np.diag(1.0 - w.sum(axis=1))


@pytest.mark.parametrize("topo, n", [("ring", 5), ("social-network", 32)])
def test_d2_exact_diffusion_mixes_with_half_w_plus_identity(topo, n):
    """--d2-exact-diffusion gossips with (W + I)/2: one step from x_i = e_i with no update gives row
    i."""
    from relaympi.algorithms.d2 import d2_mixing_matrix

    topology = build(topo, n)
    expected = (_hand_metropolis_hastings(topology) + np.eye(n)) / 2
    # by hand: MH gives 1/3 everywhere on a ring, so 2/3 self and 1/6 per neighbour
    if topo == "ring":
        for i in range(n):
            assert expected[i, i] == pytest.approx(2 / 3)
            assert expected[i, (i + 1) % n] == expected[i, (i - 1) % n] == pytest.approx(1 / 6)
    np.testing.assert_allclose(
        d2_mixing_matrix(topology, True, False), expected, rtol=0, atol=1e-15
    )
    np.testing.assert_allclose(
        d2_mixing_matrix(topology, False, True),
        _hand_metropolis_hastings(topology),
        rtol=0,
        atol=1e-15,
    )
    assert np.linalg.eigvalsh(expected).min() >= -1e-12  # (W+I)/2 is positive semidefinite

    def body(comm):
        x = torch.zeros(n, dtype=torch.float64)
        x[comm.rank] = 1.0
        algorithm = make_algorithm(
            "d2",
            comm,
            topology,
            make_optimizer(SGD, x),
            x,
            AlgorithmOptions(d2_exact_diffusion=True),
        )
        algorithm.step(x, torch.zeros(n, dtype=torch.float64), 0.1, 0)
        return x.numpy()

    np.testing.assert_allclose(np.array(run_local(n, body)), expected, rtol=0, atol=1e-15)


# ------------------------------------------------------------------- each algorithm's declaration


def test_every_algorithm_is_registered_by_its_name_with_the_options_it_reads() -> None:
    """The registry's name and options class of each algorithm are its class's (name and the
    type of its ``options``); every option is a RunConfig field, so a flag."""
    import dataclasses
    import typing

    from relaympi.algorithms import ALGORITHM_OPTIONS, ALGORITHMS, Algorithm, Options
    from relaympi.algorithms.options import NoOptions
    from relaympi.config import RunConfig

    run_fields = {f.name for f in dataclasses.fields(RunConfig)}
    for name, cls in ALGORITHMS.items():
        assert issubclass(cls, Algorithm) and cls.name == name
        declared, kind = typing.get_type_hints(cls)["options"], ALGORITHM_OPTIONS[name]
        assert declared is kind or (declared is Options and kind is NoOptions), name
        assert {f.name for f in dataclasses.fields(kind)} <= run_fields, name
    built_by = {
        k
        for cls in ALGORITHMS.values()
        for k in cls.__mro__
        if "__init__" in vars(k) and issubclass(k, Algorithm)
    }
    assert built_by == {Algorithm}  # one constructor; a subclass's own state in _setup


def test_an_algorithm_takes_its_own_options_from_any() -> None:
    from relaympi.algorithms import algorithm_options
    from relaympi.algorithms.options import D2Options, NoOptions, RelaySGDOptions

    every = AlgorithmOptions(relay_mode="previous", relay_chunk=8, d2_force=True)
    assert algorithm_options("relay", every) == RelaySGDOptions(
        relay_mode="previous", relay_chunk=8
    )
    assert algorithm_options("d2", every) == D2Options(d2_force=True)
    assert algorithm_options("sgp", every) == NoOptions() == algorithm_options("sgp")
    assert algorithm_options("relay", {"relay_mode": None, "seed": 3}) == RelaySGDOptions()

"""The ranged step of all-reduce, D-PSGD, QGM, D², gradient tracking and SGP.

begin_step, then ready(lo, hi) as backward finishes each range (high indices first), then
finish_step, gives x(t+1) bit for bit as step() does, for any cut; ready() already runs the range's
local update and starts its communication. iallreduce_sum sums each element in one fixed order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from relaympi.algorithms import AlgorithmOptions, make_algorithm
from relaympi.algorithms import base as algorithms_base
from relaympi.comm import DropPolicy, LocalCommunicator, run_local
from relaympi.optim import make_optimizer
from relaympi.topology import build
from tests.algorithm_cases import ADAM, HEAVY_BALL, MOMENTUM, SGD, Case

DIM = 203  # odd: ranges of every alignment
STEPS = 4
# typical range lengths of a cut (each cut's lengths vary around one of them)
BUCKETS = (2, 25, DIM)

CASES = [
    Case("allreduce", "fully-connected", 5, MOMENTUM),
    Case("allreduce", "fully-connected", 4, ADAM),
    Case("dpsgd", "ring", 6, MOMENTUM),
    Case("dpsgd", "binary-tree", 7, ADAM),
    Case("qgm", "ring", 5, MOMENTUM),
    Case("qgm", "chain", 4, HEAVY_BALL),
    Case("d2", "ring", 6, MOMENTUM),
    Case("gt", "ring", 5, SGD),
    Case("gt", "binary-tree", 6, MOMENTUM),
    Case("sgp", "exponential", 8, MOMENTUM),
    Case("sgp", "exponential", 4, ADAM),
    Case("dpsgd", "alternating-ring", 6, MOMENTUM),  # one peer per step: W(t) by the step number
    Case("gt", "one-peer-exponential", 4, SGD),
]


def _id(case: Case) -> str:
    opt = case.optimizer
    return f"{case.algo}-{case.topology}-n{case.workers}-{opt.name}{opt.momentum or ''}"


def backward_cut(numel: int, bucket: int, seed: int) -> list[tuple[int, int]]:
    """Random contiguous ranges covering [0, numel), about ``bucket`` long, highest first (as
    backward
    finishes layers); the same on every rank (seeded by step, not rank)."""
    rng = np.random.default_rng(seed)
    bounds, position = [0], 0
    while position < numel:
        position = min(numel, position + int(rng.integers(1, 2 * bucket + 1)))
        bounds.append(position)
    return list(reversed(list(zip(bounds[:-1], bounds[1:], strict=True))))


def _gradient(rank: int, x: torch.Tensor, t: int) -> torch.Tensor:
    """A heterogeneous gradient that depends on x (elementwise quadratic plus a step-dependent
    term)."""
    g = torch.Generator().manual_seed(1000 * rank + 17)
    a = torch.rand(x.numel(), generator=g, dtype=torch.float64).to(x.dtype) + 0.5
    b = torch.randn(x.numel(), generator=g, dtype=torch.float64).to(x.dtype)
    return a * x - b + 0.01 * t


def _run(
    comm, case: Case, dtype: torch.dtype, cuts: list[list[tuple[int, int]]] | None
) -> np.ndarray:
    """x after STEPS steps: step() when ``cuts`` is None, else begin_step, ready per range of
    cuts[t] with
    grad filled range by range (NaN elsewhere: a range may read only its own gradient),
    finish_step."""
    x = torch.linspace(-1.0, 1.0, DIM, dtype=torch.float64).to(dtype) + 0.1 * comm.rank
    optimizer = make_optimizer(case.optimizer, x)
    algorithm = make_algorithm(
        case.algo, comm, build(case.topology, comm.world_size), optimizer, x, AlgorithmOptions()
    )
    grad = torch.empty_like(x)
    for t in range(STEPS):
        lr = 0.05 + 0.01 * t
        final = _gradient(comm.rank, x, t)
        if cuts is None:
            grad.copy_(final)
            algorithm.step(x, grad, lr, t)
            continue
        grad.fill_(float("nan"))
        algorithm.begin_step(x, grad, lr, t)
        for lo, hi in cuts[t]:
            grad[lo:hi] = final[lo:hi]
            algorithm.ready(lo, hi)
            algorithm.progress()  # as a hook may while backward runs: changes no bit
        algorithm.finish_step()
    return x.numpy().copy()


def _whole_and_ranged(case: Case, dtype: torch.dtype, cuts, drops: DropPolicy | None):
    whole = run_local(case.workers, _run, case, dtype, None, drops=drops)
    ranged = run_local(case.workers, _run, case, dtype, cuts, drops=drops)
    return np.array(whole), np.array(ranged)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ranges_in_backward_order_give_the_whole_steps_bits(case: Case, dtype: torch.dtype) -> None:
    drops = DropPolicy(0.3, seed=5) if case.loses_messages else None
    for k, bucket in enumerate(BUCKETS):
        cuts = [backward_cut(DIM, bucket, seed=100 * k + t) for t in range(STEPS)]
        whole, ranged = _whole_and_ranged(case, dtype, cuts, drops)
        assert np.isfinite(whole).all()
        np.testing.assert_array_equal(ranged, whole, err_msg=f"bucket {bucket}")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_comparison_catches_a_range_made_ready_twice(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut that covers one range twice (the check that refuses it switched off) changes the bits,
    so the comparison above can see a range processed twice; with the check on, it is refused."""
    cut = backward_cut(DIM, 5, seed=3)
    twice = [cut[0], *cut]  # the last range again
    drops = DropPolicy(0.3, seed=5) if case.loses_messages else None
    with pytest.raises(ValueError, match="disjoint and cover"):
        run_local(case.workers, _run, case, torch.float64, [twice] * STEPS, drops=drops)
    monkeypatch.setattr(algorithms_base, "check_ranges", lambda ranges, numel: None)
    whole, ranged = _whole_and_ranged(case, torch.float64, [twice] * STEPS, drops)
    assert not np.array_equal(ranged, whole)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ready_updates_and_starts_sending_its_range_before_the_rest_is_final(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ready() of the last layers' range only, that range's exchange or all-reduce has been
    posted (GT: its [x+u+c, c+u] message), and nothing of the rest of the model was read."""
    posted: dict[int, list[int]] = {}
    exchange, iallreduce = LocalCommunicator.exchange, LocalCommunicator.iallreduce_sum

    def spy_exchange(self, sends, recvs, **kwargs):
        posted.setdefault(self.rank, []).extend(int(b.numel()) for b in sends.values())
        return exchange(self, sends, recvs, **kwargs)

    def spy_iallreduce(self, buf):
        posted.setdefault(self.rank, []).append(int(buf.numel()))
        return iallreduce(self, buf)

    monkeypatch.setattr(LocalCommunicator, "exchange", spy_exchange)
    monkeypatch.setattr(LocalCommunicator, "iallreduce_sum", spy_iallreduce)
    lo, hi = DIM - 20, DIM

    def body(comm):
        x = torch.linspace(-1.0, 1.0, DIM, dtype=torch.float64)
        algorithm = make_algorithm(
            case.algo,
            comm,
            build(case.topology, comm.world_size),
            make_optimizer(case.optimizer, x),
            x,
            AlgorithmOptions(),
        )
        grad = torch.full_like(x, float("nan"))
        algorithm.begin_step(x, grad, 0.1, 0)
        grad[lo:hi] = _gradient(comm.rank, x, 0)[lo:hi]
        algorithm.ready(lo, hi)
        started = list(posted.get(comm.rank, []))
        grad[:lo] = _gradient(comm.rank, x, 0)[:lo]
        algorithm.ready(0, lo)
        algorithm.finish_step()
        return started, bool(torch.isfinite(x).all())

    results = run_local(case.workers, body)
    per_message = 2 * (hi - lo) if case.algo == "gt" else hi - lo
    for started, finite in results:
        assert started and set(started) == {per_message}, started
        assert finite


@pytest.mark.parametrize(
    "ranges",
    [[(0, 5), (5, 9)], [(5, 10), (0, 5)], [(0, 5), (4, 10)], [(0, 4), (5, 10)], [(0, 10), (3, 3)]],
)
def test_check_ranges(ranges) -> None:
    """Disjoint ranges covering [0, 10) once pass (an empty range too); a gap, an overlap or a short
    cover is refused."""
    ok = sorted(r for r in ranges if r[0] != r[1]) in ([(0, 5), (5, 10)], [(0, 10)])
    if ok:
        algorithms_base.check_ranges(ranges, 10)
    else:
        with pytest.raises(ValueError, match=r"cover \[0, 10\) once"):
            algorithms_base.check_ranges(ranges, 10)


# -- iallreduce_sum: pieces of a buffer sum to the whole buffer's bits, on every backend -----------


def _fixed_tree_sum(values: list[np.ndarray], order: tuple[int, ...] | None = None) -> np.ndarray:
    """The MPI backend's order: x_q + x_(q+p) folded in, then pairs r, r ^ d for d in ``order``
    (default p/2, ..., 1: one node's)."""
    n = len(values)
    p = 1 << (n.bit_length() - 1)
    leaves = [values[q] + values[q + p] if q < n - p else values[q].copy() for q in range(p)]
    for d in order or [p >> i for i in range(1, p.bit_length())]:
        for q in range(p):
            # q and q | d hold the two partial sums this stage adds (a + b == b + a in IEEE)
            if not q & d:
                leaves[q] = leaves[q] + leaves[q | d]
    return leaves[0]


def _rank_order_sum(values: list[np.ndarray]) -> np.ndarray:
    total = values[0].copy()
    for v in values[1:]:
        total += v
    return total


def _iallreduce_pieces(comm, numel: int, dtype: str):
    rng = np.random.default_rng(7 * comm.rank + numel)
    # float32 sums that depend on their order
    a = (rng.standard_normal(numel) * rng.exponential(1.0, numel)).astype(dtype)
    whole = torch.from_numpy(a.copy())
    comm.iallreduce_sum(whole).wait()
    pieces = torch.from_numpy(a.copy())
    requests = [
        comm.iallreduce_sum(pieces[lo:hi])
        for lo, hi in backward_cut(numel, max(1, numel // 7), seed=numel)
    ]
    for request in requests:
        request.wait()
    values = comm.gather(a)
    if values is not None:
        oracle = (_fixed_tree_sum if comm.backend == "mpi" else _rank_order_sum)(values)
        np.testing.assert_array_equal(whole.numpy(), oracle)
    np.testing.assert_array_equal(pieces.numpy(), whole.numpy())
    return True


@pytest.mark.parametrize(
    "nodes, order",
    [
        ((0, 0, 0, 0), (2, 1)),  # one node: the order before node-awareness (the same bits)
        # 2 nodes x 2: the intra-node pairs first, a quarter of the buffer crosses each way
        ((0, 0, 1, 1), (1, 2)),
        ((0, 1, 0, 1), (2, 1)),  # round-robin nodes: r ^ 2 is the same node
        ((0, 0, 0, 0, 1, 1, 1, 1), (2, 1, 4)),  # both intra-node bits before the one across
        # ties (every pair across nodes) keep the larger bit first
        ((0, 0, 1, 1, 2, 2, 3, 3), (1, 4, 2)),
        ((0, 0, 0, 1, 1, 1), (2, 1)),  # p = 4: both bits pair 2 of 4 ranks across nodes
        ((0,), ()),
        ((0, 1), (1,)),
    ],
)
def test_the_tree_sums_pairs_on_one_node_first(nodes, order) -> None:
    from relaympi.comm.tree_allreduce import stage_order

    assert stage_order(nodes) == order


def _node_aware_sum(comm, numel: int) -> bool:
    """A communicator on emulated nodes (ranks 2k, 2k + 1 on node k) sums in the node-aware
    order."""
    from relaympi.comm.mpi import MPICommunicator

    nodes = [r // 2 for r in range(comm.world_size)]
    placed = MPICommunicator(nodes=nodes)
    try:
        rng = np.random.default_rng(11 * comm.rank + numel)
        a = (rng.standard_normal(numel) * rng.exponential(1.0, numel)).astype(np.float32)
        whole = torch.from_numpy(a.copy())
        placed.iallreduce_sum(whole).wait()
        pieces = torch.from_numpy(a.copy())
        for request in [
            placed.iallreduce_sum(pieces[lo:hi])
            for lo, hi in backward_cut(numel, max(1, numel // 5), seed=numel)
        ]:
            request.wait()
        values = placed.gather(a)
        if values is not None:
            p = 1 << (len(values).bit_length() - 1)
            # nodes of 2 ranks: d = 1, then p/2, ..., 2
            order = (1, *(p >> i for i in range(1, p.bit_length() - 1)))
            np.testing.assert_array_equal(whole.numpy(), _fixed_tree_sum(values, order))
        np.testing.assert_array_equal(pieces.numpy(), whole.numpy())
    finally:
        placed.close()
    return True


@pytest.mark.mpi
@pytest.mark.spmd
def test_a_node_aware_tree_sum_gives_its_own_trees_bits(spmd, request) -> None:
    if (
        not request.config.getoption("--with-mpi", default=False)
        or spmd(lambda comm: comm.world_size)[0] < 4
    ):
        pytest.skip(
            "MPI ranks only (4 or more, on emulated nodes of 2): the in-process transport "
            "sums in rank order"
        )
    assert all(spmd(_node_aware_sum, 10_000))


@pytest.mark.slow
@pytest.mark.spmd
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("numel", [1, 100, 10_000, 1_000_000])
def test_iallreduce_pieces_sum_to_the_whole_buffers_bits(spmd, numel: int, dtype: str) -> None:
    """Under mpirun (the fixed tree, not MPI_Allreduce, whose algorithm changes with the size) and
    locally (rank order)."""
    assert all(spmd(_iallreduce_pieces, numel, dtype))


def test_local_iallreduce_sums_in_rank_order_for_any_world() -> None:
    for n in (3, 5):
        assert all(run_local(n, _iallreduce_pieces, 1000, "float32"))


def _spmd_whole_and_ranged(comm, algo: str, topology: str):
    case = Case(algo, topology, comm.world_size, MOMENTUM)
    whole = _run(comm, case, torch.float32, None)
    cuts = [backward_cut(DIM, 9, seed=t) for t in range(STEPS)]
    ranged = _run(comm, case, torch.float32, cuts)
    np.testing.assert_array_equal(ranged, whole)
    return True


@pytest.mark.spmd
@pytest.mark.parametrize(
    "algo, topology, drop_prob",
    [
        ("allreduce", "fully-connected", 0.0),
        ("dpsgd", "chain", 0.3),
        ("qgm", "chain", 0.0),
        ("d2", "chain", 0.0),
        ("gt", "chain", 0.3),
        ("sgp", "exponential", 0.3),
    ],
)
def test_ranged_steps_match_whole_steps_over_mpi(
    spmd, algo: str, topology: str, drop_prob: float
) -> None:
    """float32 (MPI's staging and the fixed-tree all-reduce), drops where they apply; any world size
    >= 2 (sgp: a power of two)."""
    assert all(spmd(_spmd_whole_and_ranged, algo, topology, drops=DropPolicy(drop_prob, seed=9)))


def _iallreduce_bfloat16(comm):
    a = (torch.arange(64, dtype=torch.float32) * (comm.rank + 1) / 7).to(torch.bfloat16)
    whole, pieces = a.clone(), a.clone()
    comm.iallreduce_sum(whole).wait()
    for request in [comm.iallreduce_sum(pieces[lo:hi]) for lo, hi in ((40, 64), (0, 40))]:
        request.wait()
    assert torch.equal(whole, pieces)
    expected = torch.arange(64, dtype=torch.float32) * sum(range(1, comm.world_size + 1)) / 7
    # summed as numbers, not bytes
    torch.testing.assert_close(whole.float(), expected, rtol=2e-2, atol=0)
    return True


@pytest.mark.spmd
def test_iallreduce_sums_bfloat16_as_numbers(spmd) -> None:
    assert all(spmd(_iallreduce_bfloat16))


def test_gossip_messages_travel_in_pieces_that_change_no_bit(monkeypatch):
    """GossipMixer sends a range in pieces of PIECE elements (each averaged in as it lands): pieces
    of 7 give the bits of one whole message, with drops (a message's pieces are dropped
    together)."""
    import relaympi.algorithms.gossip as gossip
    from relaympi.comm import DropPolicy, run_local
    from relaympi.topology import build

    calls = []

    def body(comm):
        ring = build("ring", 4)
        x = torch.randn(1001, generator=torch.Generator().manual_seed(comm.rank))
        mixer = gossip.GossipMixer(comm, ring.mixing_matrix(0), ring.neighbors(comm.rank), 1001, x)
        exchange = comm.exchange

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(comm.rank)
            return exchange(*args, **kwargs)

        comm.exchange = counted
        for r in range(4):
            mixer.mix(x, r)
        return x

    whole = run_local(4, body, drops=DropPolicy(0.3, seed=1))
    assert len(calls) == 4 * 4
    calls.clear()
    monkeypatch.setattr(gossip, "PIECE", 7)
    pieces = run_local(4, body, drops=DropPolicy(0.3, seed=1))
    assert len(calls) == 4 * 4 * -(-1001 // 7)
    for a, b in zip(whole, pieces, strict=True):
        assert torch.equal(a, b)

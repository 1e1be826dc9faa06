"""The ranged step of RelaySGD and RelaySGD/Grad: ranges stepped as backward finishes them.

``begin_step``, ``ready(lo, hi)`` for ranges cut anywhere and arriving in backward order (high
indices first), then ``finish_step``, give the bits of ``step()``, for every relay mode, chunked
and in-place RelaySum, zero-copy and copied leaves, degree 2 and >= 3 workers, one and two trees,
dropped messages, float64 and float32, SGD with momentum and Adam; and step() itself is the
whole-step rule (exchange, then add_received) over the same messages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaympi.algorithms import AlgorithmOptions, make_algorithm
from relaympi.comm import DropPolicy, run_local
from relaympi.flat import padded_zeros
from relaympi.optim import OptimizerConfig, make_optimizer
from relaympi.topology import build

D = 23  # model size: several chunks per message with chunk 2 or 5
STEPS = 5
OPTIMIZERS = {
    "momentum": OptimizerConfig(momentum=0.9, weight_decay=1e-3),
    "adam": OptimizerConfig(name="adam"),
}

# (algo, mode, topology, n, in_place, chunk, padded, drop_prob, dtype, optimizer)
CASES = [
    (algo, mode, topo, n, in_place, chunk, padded, drop, dtype, opt)
    for algo, mode in (
        ("relay", "counts"),
        ("relay", "previous"),
        ("relay", "initial"),
        ("relay-grad", "counts"),
    )
    for topo, n in (("chain", 4), ("star", 5), ("double-binary-trees", 6))
    for in_place, chunk, padded in ((False, 5, True), (True, 2, False), (False, 1 << 20, False))
    for drop, dtype, opt in (
        (0.0, torch.float32, "adam"),
        (0.3, torch.float64, "momentum"),
        (0.3, torch.float32, "adam"),
    )
]


def _ids(case) -> str:
    algo, mode, topo, n, in_place, chunk, padded, drop, dtype, opt = case
    buffers = "inplace" if in_place else "duplex"
    layout = "padded" if padded else "plain"
    return f"{algo}-{mode}-{topo}{n}-{buffers}-c{chunk}-{layout}-p{drop}-{str(dtype)[6:]}-{opt}"


def _cuts(rng: np.random.Generator, numel: int, bucket: int) -> list[tuple[int, int]]:
    """[0, numel) in ranges of about ``bucket`` elements (random jitter), last range (high indices)
    first; a negative ``bucket`` shuffles the ranges (the same order on every rank)."""
    edges = [0]
    while edges[-1] < numel:
        edges.append(min(numel, edges[-1] + max(1, int(rng.integers(1, 2 * abs(bucket) + 1)))))
    ranges = [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)][::-1]
    if bucket < 0:
        rng.shuffle(ranges)
    return ranges


def trajectory(comm, case, bucket: int | None = None, resume_at: int | None = None):
    """x after each of STEPS steps on this rank: step() (bucket None) or ranged calls with random
    cuts.

    With ``resume_at``, the run is rebuilt from a state_dict taken after that many steps."""
    algo, mode, topo, n, in_place, chunk, padded, drop, dtype, opt = case
    topology = build(topo, comm.world_size)
    g = torch.Generator().manual_seed(100 + comm.rank)
    A = torch.randn(D, D, generator=g, dtype=torch.float64).to(dtype) / D**0.5
    b = torch.randn(D, generator=g, dtype=torch.float64).to(dtype)
    x0 = torch.linspace(-1.0, 1.0, D, dtype=dtype)
    options = AlgorithmOptions(relay_mode=mode, relay_in_place=in_place, relay_chunk=chunk)
    rng = np.random.default_rng(7)  # the same cuts on every rank

    def build_run():
        x = padded_zeros(D, dtype=dtype) if padded else torch.zeros(D, dtype=dtype)
        x.copy_(x0)
        optimizer = make_optimizer(OPTIMIZERS[opt], x)
        return x, optimizer, make_algorithm(algo, comm, topology, optimizer, x0, options)

    x, optimizer, algorithm = build_run()
    grad = torch.zeros(D, dtype=dtype)
    out = []
    for t in range(STEPS):
        if resume_at is not None and t == resume_at:
            state = {
                "x": x.clone(),
                "opt": {k: v.clone() for k, v in optimizer.state_dict().items()},
                "algo": {k: v.clone() for k, v in algorithm.state_dict().items()},
            }
            x, optimizer, algorithm = build_run()
            x.copy_(state["x"])
            optimizer.load_state_dict(state["opt"])
            algorithm.load_state_dict(state["algo"])
        lr = 0.05 / (1 + t)
        if bucket is None:
            torch.addmv(-b, A, x, out=grad)
            algorithm.step(x, grad, lr, t)
        else:
            grad.fill_(float("nan"))  # not final before ready(): a range read too early poisons x
            algorithm.begin_step(x, grad, lr, t)
            full = torch.addmv(-b, A, x)
            for lo, hi in _cuts(rng, D, bucket):
                grad[lo:hi] = full[lo:hi]
                algorithm.ready(lo, hi)
                # the range's update ran in ready(): its gradient is no longer read
                grad[lo:hi] = float("nan")
            algorithm.finish_step()
        out.append(x.numpy().copy())
    return np.array(out)


def _run(case, **kwargs) -> np.ndarray:
    n, drop = case[3], case[7]
    return np.array(run_local(n, trajectory, case, drops=DropPolicy(drop, seed=3), **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ranged_step_gives_the_bits_of_step(case):
    whole = _run(case)
    assert np.isfinite(whole).all()
    for bucket in (1, 6):
        np.testing.assert_array_equal(_run(case, bucket=bucket), whole, err_msg=f"bucket {bucket}")


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c[2] == "double-binary-trees" and c[7] > 0 and c[8] == torch.float64],
    ids=_ids,
)
def test_ranges_in_any_order_give_the_bits_of_step(case):
    """Chunks that complete out of their travel order wait for the chunks before them."""
    np.testing.assert_array_equal(_run(case, bucket=-3), _run(case))


def test_resume_mid_run_gives_the_same_bits():
    """state_dict between steps holds everything (nothing is in flight): a rebuilt run goes on
    exactly."""
    for case in [
        c for c in CASES if c[2] == "double-binary-trees" and c[7] > 0 and c[8] == torch.float64
    ][:4]:
        np.testing.assert_array_equal(
            _run(case, bucket=4, resume_at=2), _run(case), err_msg=_ids(case)
        )


def _recorded(comm, algo):
    """Per send: (tag, chunk, message chunk) and whether finish_step had begun; x after the first
    ready()."""
    sent, finishing = [], [False]
    exchange = comm.exchange

    def recording(sends, recvs, **kw):
        for buf in sends.values():
            sent.append((kw["tag"], kw["chunk"], buf.clone(), finishing[0]))
        return exchange(sends, recvs, **kw)

    comm.exchange = recording
    x = padded_zeros(D, dtype=torch.float64)
    x.copy_(torch.linspace(-1.0, 1.0, D, dtype=torch.float64))
    x_before = x.clone()
    options = AlgorithmOptions(relay_chunk=5)
    algorithm = make_algorithm(
        algo,
        comm,
        build("double-binary-trees", comm.world_size),
        make_optimizer(OPTIMIZERS["momentum"], x),
        x,
        options,
    )
    grad = torch.ones(D, dtype=torch.float64)
    algorithm.begin_step(x, grad, 0.1, 0)
    algorithm.ready(18, D)
    after_first = x.clone()
    sent_by_ready = len(sent)
    algorithm.ready(0, 18)
    finishing[0] = True
    algorithm.finish_step()
    return sent, sent_by_ready, x_before, after_first


@pytest.mark.parametrize("algo", ["relay", "relay-grad"])
def test_chunks_go_out_from_ready_counter_first(algo):
    """ready() updates its range and sends each complete chunk at once; a message's chunks travel
    last
    to first, so the first one out holds the counter (1 + counters received: 1 in step 0)."""
    for rank, (sent, sent_by_ready, x_before, after_first) in enumerate(
        run_local(6, _recorded, algo)
    ):
        # layer 1 relays [12, 23) in chunks [0, 5), [5, 10), [10, 12) of [payload, counter]: [18,
        # 23) completes the last
        assert sent_by_ready >= 1, f"rank {rank}: nothing sent by ready()"
        assert all(tag == 1 and chunk == 2 for tag, chunk, _, _ in sent[:sent_by_ready])
        assert not any(late for *_, late in sent), "a chunk waited for finish_step"
        if algo == "relay":  # x(t+1/2) on the ready range only
            assert not torch.equal(after_first[18:], x_before[18:]) and torch.equal(
                after_first[:18], x_before[:18]
            )
        for tag in (0, 1):
            chunks = [(chunk, message) for t, chunk, message, _ in sent if t == tag]
            first_chunk, first_message = chunks[0]
            assert first_chunk == max(chunk for chunk, _ in chunks)
            # step 0: every message carries the sender's parcel alone
            assert first_message[-1].item() == 1.0
            order = [chunk for chunk, _ in chunks]
            assert order == sorted(order, reverse=True)


SPMD_CASES = [
    c
    for c in CASES
    if (c[0], c[1], c[2], c[4], c[5], c[7], c[8])
    in {
        ("relay", "counts", "double-binary-trees", False, 5, 0.3, torch.float64),
        ("relay", "previous", "star", True, 2, 0.3, torch.float64),
        ("relay-grad", "counts", "chain", False, 5, 0.3, torch.float32),
        ("relay", "initial", "double-binary-trees", True, 2, 0.0, torch.float32),
    }
]


@pytest.mark.spmd
@pytest.mark.parametrize("case", SPMD_CASES, ids=_ids)
def test_ranged_step_gives_the_bits_of_step_over_the_transport(spmd, case):
    """The same under mpirun (CI: 4 ranks): chunks of one tag posted in agreeing order on both
    ends."""
    drops = DropPolicy(case[7], seed=3)
    whole = spmd(trajectory, case, drops=drops)
    ranged = spmd(trajectory, case, 4, drops=drops)
    for got, want in zip(ranged, whole, strict=True):
        np.testing.assert_array_equal(got, want)

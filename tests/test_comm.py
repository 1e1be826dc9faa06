"""Communicator semantics on every backend: neighbour exchange, collectives, byte counts, drops,
failures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch

from relaympi.comm import (
    BufferError,
    CommError,
    DropPolicy,
    LocalWorld,
    WorldAborted,
    buffers,
    run_local,
)
from relaympi.flat import FlatBuffer, flatten_module

pytestmark = pytest.mark.spmd


def _ring_exchange(comm, kind):
    n, r = comm.world_size, comm.rank
    left, right = (r - 1) % n, (r + 1) % n
    make: Callable[[int], Any] = {
        "numpy": lambda v: np.full(5, v, dtype=np.float64),
        "torch": lambda v: torch.full((5,), float(v), dtype=torch.float32),
    }[kind]
    send = make(r)
    recv = {left: make(-1), right: make(-1)} if left != right else {left: make(-1)}
    before = comm.bytes_sent.copy()  # under MPI the communicator lives for the whole session
    req = comm.exchange({p: send for p in recv}, recv, tag=3)
    got = req.wait()
    assert got == frozenset(recv)
    for peer, buf in recv.items():
        assert float(buf[0]) == peer and float(buf[-1]) == peer
    sent = comm.bytes_sent - before
    return {p: int(sent[p]) for p in range(n) if sent[p]}, sorted(recv)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_neighbour_exchange_and_byte_count(spmd, kind):
    itemsize = 8 if kind == "numpy" else 4
    for sent, peers in spmd(_ring_exchange, kind):
        assert sent == {p: 5 * itemsize for p in peers}  # exactly what was sent, per peer


def _allreduce(comm):
    x = torch.arange(6, dtype=torch.float64) + comm.rank
    comm.allreduce_mean(x)
    n = comm.world_size
    expected = torch.arange(6, dtype=torch.float64) + (n - 1) / 2
    assert torch.allclose(x, expected, rtol=0, atol=1e-12)
    half = torch.full((4,), 1.0 + comm.rank, dtype=torch.bfloat16)
    comm.allreduce_sum(half)  # must reduce as numbers, not as bytes
    assert float(half[0]) == pytest.approx(sum(1.0 + r for r in range(n)), rel=1e-2)
    flags = comm.allreduce_flags(np.array([float(comm.rank == 1), 0.0]))
    assert flags.tolist() == [1.0, 0.0]
    rows = comm.gather_rows(np.array([comm.rank, 2.0 * comm.rank]))
    if comm.rank == 0:
        assert rows.shape == (n, 2) and rows[:, 1].tolist() == [2.0 * r for r in range(n)]
    else:
        assert rows is None
    comm.barrier()
    return True


def test_collectives(spmd):
    assert all(spmd(_allreduce))


def _dropped(comm):
    n, r = comm.world_size, comm.rank
    peers = sorted({(r - 1) % n, (r + 1) % n})
    outcomes = []
    for rnd in range(40):
        recv = {p: np.full(3, -1.0) for p in peers}
        got = comm.exchange({p: np.full(3, float(r)) for p in peers}, recv, tag=0, round=rnd).wait()
        for p in peers:
            lost = comm.drops.dropped(rnd, 0, p, r)
            assert (p not in got) == lost
            assert recv[p][0] == (-1.0 if lost else float(p))
            outcomes.append(lost)
    return outcomes


def test_drops_are_reproducible_and_symmetric(spmd):
    results = spmd(_dropped, drops=DropPolicy(0.3, seed=5))
    lost = np.concatenate([np.asarray(r) for r in results])
    assert 0.1 < lost.mean() < 0.5
    again = spmd(_dropped, drops=DropPolicy(0.3, seed=5))
    assert [list(a) for a in again] == [list(a) for a in results]


def test_drop_policy_validation():
    with pytest.raises(ValueError, match="drop probability"):
        DropPolicy(1.0)
    assert not DropPolicy(0.0).dropped(1, 0, 0, 1)


def test_bad_peer_and_noncontiguous_buffer_are_refused():
    def body(comm):
        with pytest.raises(CommError, match="peer 7"):
            comm.exchange({7: np.zeros(2)}, {})
        with pytest.raises(BufferError, match="non-contiguous"):
            comm.exchange({}, {1 - comm.rank: np.zeros(6)[::2]})
        return True

    assert all(run_local(2, body))


def test_failure_on_one_rank_releases_the_others():
    def body(comm):
        if comm.rank == 2:
            raise RuntimeError("boom on rank 2")
        buf = np.zeros(3)
        comm.exchange({}, {2: buf}).wait()  # would wait forever without the abort

    with pytest.raises(RuntimeError, match="boom on rank 2"):
        run_local(4, body)


def test_world_abort_raises_in_collectives():
    world = LocalWorld(2)
    world.abort("test")
    with pytest.raises(WorldAborted, match="test"):
        world.communicator(0).barrier()


def test_flat_buffer_views_alias_storage():
    flat = torch.zeros(10)
    fb = FlatBuffer(flat, [(2, 3), (4,)])
    fb.views[0][1, 2] = 5.0
    fb.views[1][:] = 1.0
    assert flat[5] == 5.0 and flat[6:].sum() == 4.0
    np_fb = FlatBuffer.zeros([(3,), (1, 2)], like=np.zeros(1, dtype=np.float32))
    assert np_fb.flat.dtype == np.float32 and np_fb.views[1].shape == (1, 2)
    with pytest.raises(BufferError, match="10 elements"):
        FlatBuffer(torch.zeros(9), [(2, 3), (4,)])


def test_flatten_module_backward_fills_flat_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    reference = [p.detach().clone() for p in model.parameters()]
    x, g = flatten_module(model)
    assert x.numel() == sum(p.numel() for p in model.parameters())
    for p, ref in zip(model.parameters(), reference, strict=False):
        assert torch.equal(p, ref)
    inputs = torch.randn(5, 3)
    model(inputs).square().sum().backward()
    expected = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in model.parameters()])
    assert torch.equal(g, expected) and g.abs().sum() > 0
    x.mul_(0)  # updating the flat buffer updates the model
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())


def test_cuda_aware_override(monkeypatch):
    monkeypatch.setenv(buffers.CUDA_AWARE_ENV, "1")
    assert buffers.query_cuda_aware_mpi() is True
    monkeypatch.setenv(buffers.CUDA_AWARE_ENV, "off")
    assert buffers.query_cuda_aware_mpi() is False
    monkeypatch.setenv(buffers.CUDA_AWARE_ENV, "maybe")
    with pytest.raises(ValueError, match="maybe"):
        buffers.query_cuda_aware_mpi()
    monkeypatch.delenv(buffers.CUDA_AWARE_ENV)
    assert buffers.query_cuda_aware_mpi() in (True, False)


def test_host_view_of_bfloat16_is_raw_bytes():
    t = torch.ones(3, dtype=torch.bfloat16)
    view = buffers.host_view(t)
    assert view.dtype == np.uint8 and view.nbytes == 6


def _replace(comm):
    n, r = comm.world_size, comm.rank
    peers = sorted({(r - 1) % n, (r + 1) % n})
    results = []
    for rnd in range(20):
        bufs = {p: torch.full((4,), 100.0 * r + p, dtype=torch.float64) for p in peers}
        got = comm.exchange_replace(bufs, tag=1, round=rnd).wait()
        for p in peers:
            lost = comm.drops.dropped(rnd, 1, p, r)
            assert (p not in got) == lost
            # kept, or the peer's message to us
            expected = (100.0 * r + p) if lost else (100.0 * p + r)
            assert torch.all(bufs[p] == expected)
            results.append(lost)
    return results


@pytest.mark.parametrize("prob", [0.0, 0.3])
def test_exchange_replace_swaps_in_place(spmd, prob):
    lost = np.concatenate([np.asarray(r) for r in spmd(_replace, drops=DropPolicy(prob, seed=9))])
    assert (lost.mean() > 0) == (prob > 0)

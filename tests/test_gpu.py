"""GPU buffers through the Communicator: torch CUDA tensors and cupy arrays, host-staged and
CUDA-aware.

    python -m pytest tests/test_gpu.py -rs                                            # in-process
    ranks
    mpirun -n 2 python -m pytest tests/test_gpu.py --with-mpi -m "gpu and spmd" -rs   # MPI ranks

Every check runs the same computation on CPU tensors and compares the device result with
it: float64 (and bfloat16) bit for bit, float32 to 1e-6 relative. Under MPI each SPMD test
runs twice: with host staging (the communicator's ``cuda_aware = False``, what
RELAYMPI_CUDA_AWARE=0 selects) and with device pointers handed to MPI (``cuda_aware = True``),
the latter only where the loaded MPI library says it is CUDA-aware (MPIX_Query_cuda_support)
or RELAYMPI_CUDA_AWARE=1 forces it; a non-CUDA-aware MPI would crash on a device pointer.

Without a GPU every test is skipped. RELAYMPI_TEST_GPU_DEVICE=cpu runs the bodies on CPU
tensors instead (a dry run of the test logic on a machine without a GPU; cupy tests still
need cupy and a GPU).
"""

# Long module: the GPU paths of every buffer kind, skipped without a GPU

from __future__ import annotations

import copy
import os
from typing import cast

import numpy as np
import pytest
import torch

from benchmarks.gpu_report import mpi_cuda_support
from relaympi.comm import BufferError, buffers, run_local
from relaympi.flat import FlatBuffer, flatten_module

DEVICE_ENV = "RELAYMPI_TEST_GPU_DEVICE"
NUMEL = 1001  # odd: the two trees of double binary trees get unequal halves
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _dry_run() -> bool:
    return os.environ.get(DEVICE_ENV, "cuda").strip().lower() == "cpu"


def _skip_reason() -> str | None:
    if _dry_run():
        return None
    if not torch.cuda.is_available():
        return (
            f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}) "
            "reports torch.cuda.is_available() False"
        )
    return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]


def _with_mpi(config: pytest.Config) -> bool:
    return bool(config.getoption("with_mpi", default=False))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``transport``: 'local' for in-process ranks; 'staged' and 'cuda-aware' under --with-mpi."""
    if "transport" in metafunc.fixturenames:
        modes = ["staged", "cuda-aware"] if _with_mpi(metafunc.config) else ["local"]
        metafunc.parametrize("transport", modes)


# -- helpers ---------------------------------------------------------------------------------


def _device(comm) -> torch.device:
    """This rank's GPU (local rank modulo the GPU count), or the CPU in a dry run."""
    if _dry_run():
        return torch.device("cpu")
    local = os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", ""))
    index = int(local) if local.isdigit() else comm.rank
    return torch.device("cuda", index % torch.cuda.device_count())


def _data(seed: tuple[int, ...], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Seeded normal numbers on the CPU (every rank can recompute any rank's data)."""
    g = torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
    return torch.randn(numel, dtype=torch.float64, generator=g).to(dtype)


def _dyadic(seed: tuple[int, ...], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Seeded numbers whose sums over up to 64 ranks are exact in ``dtype``, in any order:
    a reduction that a CUDA-aware MPI runs in another order must still give the same bits."""
    g = torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))
    if dtype == torch.bfloat16:
        return torch.randint(-2, 2, (numel,), generator=g).to(dtype)  # 8-bit mantissa: |sum| <= 128
    return (torch.randint(-(2**12), 2**12, (numel,), generator=g).to(torch.float64) / 64).to(dtype)


def assert_matches(got, want, what: str) -> None:
    """float64/bfloat16 (and all integers): bit for bit; float32: 1e-6 relative."""
    got = _as_cpu_tensor(got)
    want = _as_cpu_tensor(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    )
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), (
            f"{what}: differs in {int((got != want).sum())} of {got.numel()} elements"
        )


def _as_cpu_tensor(x) -> torch.Tensor:
    kind = buffers.array_kind(x)
    if kind == "cupy":
        return torch.from_numpy(x.get())
    if kind == "numpy":
        return torch.from_numpy(x)
    return x.detach().cpu()


def _ring_peers(comm) -> list[int]:
    n, r = comm.world_size, comm.rank
    return sorted({(r - 1) % n, (r + 1) % n})


def _with_transport(comm, transport: str, body, *args):
    """Run ``body`` with the MPI communicator switched to host staging or to the CUDA-aware path."""
    if transport == "local":
        return body(comm, *args)
    before = comm.cuda_aware
    comm.cuda_aware = transport == "cuda-aware"
    try:
        return body(comm, *args)
    finally:
        comm.cuda_aware = before


@pytest.fixture
def run(spmd, transport):
    """``run(body, *args)``: ``spmd`` with the communicator in the test's transport mode."""
    if transport == "cuda-aware":
        aware, why = mpi_cuda_support()
        if not aware:
            pytest.skip(why)

    def go(body, *args, **kwargs):
        return spmd(_with_transport, transport, body, *args, **kwargs)

    return go


# -- neighbour exchange -----------------------------------------------------------------------


def _exchange(comm, dtype, device, tag):
    peers = _ring_peers(comm)
    send = _data((comm.rank, 1), NUMEL, dtype).to(device)
    recv = {p: torch.full((NUMEL,), -1.0, dtype=dtype, device=device) for p in peers}
    before = int(comm.bytes_sent.sum())
    got = comm.exchange({p: send for p in peers}, recv, tag=tag).wait()
    assert got == frozenset(peers)
    return recv, int(comm.bytes_sent.sum()) - before


def _exchange_body(comm, dtype_name):
    dtype = DTYPES[dtype_name]
    on_cpu, sent_cpu = _exchange(comm, dtype, torch.device("cpu"), tag=11)
    on_device, sent_device = _exchange(comm, dtype, _device(comm), tag=12)
    for p in on_cpu:
        assert on_device[p].device == _device(comm)
        assert_matches(on_device[p], on_cpu[p], f"rank {comm.rank}: {dtype_name} message from {p}")
        assert_matches(
            on_cpu[p],
            _data((p, 1), NUMEL, dtype),
            f"rank {comm.rank}: CPU {dtype_name} message from {p}",
        )
    assert sent_device == sent_cpu == len(on_cpu) * NUMEL * on_cpu[min(on_cpu)].element_size()
    return True


@pytest.mark.spmd
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "bfloat16"])
def test_neighbour_exchange_matches_cpu(run, dtype_name):
    assert all(run(_exchange_body, dtype_name))


# -- allreduce --------------------------------------------------------------------------------


def _allreduce(comm, dtype, device, numel, mean):
    x = _dyadic((comm.rank, numel), numel, dtype).to(device)
    (comm.allreduce_mean if mean else comm.allreduce_sum)(x)
    return x


def _allreduce_body(comm, dtype_name, numel):
    dtype = DTYPES[dtype_name]
    n = comm.world_size
    total = cast(torch.Tensor, sum(_dyadic((r, numel), numel, dtype).double() for r in range(n)))
    results = {}
    for mean in (False, True):
        results[mean] = (
            _allreduce(comm, dtype, torch.device("cpu"), numel, mean),
            _allreduce(comm, dtype, _device(comm), numel, mean),
        )
    for mean, (on_cpu, on_device) in results.items():
        what = f"rank {comm.rank}: {dtype_name} allreduce_{'mean' if mean else 'sum'} of {numel}"
        assert on_device.device == _device(comm) and on_device.dtype == dtype
        assert_matches(on_device, on_cpu, what)
        # exact sums: the CPU result is the true one (bfloat16 reduced as numbers, not bytes)
        if not mean:
            assert_matches(on_cpu, total.to(dtype), what + " (CPU vs exact)")
    return True


@pytest.mark.spmd
@pytest.mark.parametrize("numel", [NUMEL, 300_007])
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "bfloat16"])
def test_allreduce_matches_cpu(run, dtype_name, numel):
    assert all(run(_allreduce_body, dtype_name, numel))


# -- RelaySum ---------------------------------------------------------------------------------


def _relay(comm, topology, dtype, device, **options):
    """world_size + 1 steps of RelaySum; per step the sum received and the parcel counts."""
    from relaympi.algorithms.relaysum import RelaySum

    relay = RelaySum(comm, topology, NUMEL, torch.zeros(1, dtype=dtype, device=device), **options)
    sums, counts = [], []
    for step in range(comm.world_size + 1):
        relay.exchange(_data((comm.rank, 2, step), NUMEL, dtype).to(device), round=step)
        acc = torch.zeros(NUMEL, dtype=dtype, device=device)
        relay.add_received(acc)
        sums.append(acc)
        counts.append(relay.counts())
    return sums, counts


def _relay_body(comm, topo_name, dtype_name, **options):
    from relaympi.topology import build

    topology = build(topo_name, comm.world_size)
    dtype = DTYPES[dtype_name]
    sums_cpu, counts_cpu = _relay(comm, topology, dtype, torch.device("cpu"))
    sums_device, counts_device = _relay(comm, topology, dtype, _device(comm), **options)
    for step, (on_cpu, on_device) in enumerate(zip(sums_cpu, sums_device, strict=True)):
        assert on_device.device == _device(comm)
        assert_matches(
            on_device, on_cpu, f"rank {comm.rank}: RelaySum {topo_name} {dtype_name} step {step}"
        )
    assert counts_device == counts_cpu
    # after world_size steps every parcel reached every worker: n-bar = n on every tree
    assert counts_device[-1] == [float(comm.world_size)] * topology.num_layers
    return True


@pytest.mark.spmd
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("topo_name", ["chain", "double-binary-trees"])
def test_relaysum_matches_cpu(run, topo_name, dtype_name):
    assert all(run(_relay_body, topo_name, dtype_name))


def _chunked_relay_body(comm, topo_name, in_place):
    return _relay_body(comm, topo_name, "float32", chunk=7, in_place=in_place)


@pytest.mark.spmd
@pytest.mark.parametrize("in_place", [False, True], ids=["chunked", "in-place"])
@pytest.mark.parametrize("topo_name", ["chain", "double-binary-trees"])
def test_chunked_relaysum_on_the_device_matches_cpu(run, topo_name, in_place):
    """Many chunks in flight at once: staged copies run on a side stream and their sends are
    posted in order as the copies finish; the sums must be the CPU's, bit for bit."""
    assert all(run(_chunked_relay_body, topo_name, in_place))


# -- flat parameter buffers -------------------------------------------------------------------


def _seeded_model(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """A small model with seeded weights (no global RNG: in-process ranks are threads)."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(
        dtype
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return model


def _flatten_body(comm, dtype_name):
    dtype = DTYPES[dtype_name]
    device = _device(comm)
    model_cpu = _seeded_model(100 + comm.rank, dtype)
    model_device = copy.deepcopy(model_cpu).to(device)
    flat_cpu, grad_cpu = flatten_module(model_cpu)
    flat_device, grad_device = flatten_module(model_device)
    assert flat_device.device == device and grad_device.device == device
    assert_matches(flat_device, flat_cpu, f"rank {comm.rank}: flattened {dtype_name} parameters")
    params = list(model_device.parameters())
    for p in params:  # every parameter and gradient is a view into the flat buffers
        assert p.untyped_storage().data_ptr() == flat_device.untyped_storage().data_ptr()
        assert p.grad is not None
        assert p.grad.untyped_storage().data_ptr() == grad_device.untyped_storage().data_ptr()
    inputs = _data((comm.rank, 3), 5 * 7, dtype).reshape(5, 7)
    # the same (exactly widened) weights, for float32's bound
    reference = copy.deepcopy(model_cpu).double()
    for model, x in (
        (model_cpu, inputs),
        (model_device, inputs.to(device)),
        (reference, inputs.double()),
    ):
        model.zero_grad(set_to_none=model is reference)
        model(x).square().sum().backward()
    if dtype == torch.float32:
        # device and CPU round differently (tanh, summation order), so no fixed tolerance between
        # them: the device's gradient may be at most 10x further from float64 than the CPU's,
        # plus 64 float32 epsilons of the scale (float64 itself is compared directly)
        grad64 = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in reference.parameters()])
        scale = float(grad64.abs().max())
        cpu_error = float((grad_cpu.double() - grad64).abs().max())
        device_error = float((grad_device.cpu().double() - grad64).abs().max())
        assert device_error <= 10 * cpu_error + 64 * torch.finfo(torch.float32).eps * scale, (
            f"rank {comm.rank}: device gradient {device_error / scale:.1e} of the scale "
            f"from float64, the CPU's {cpu_error / scale:.1e}"
        )
    else:
        torch.testing.assert_close(grad_device.cpu(), grad_cpu, rtol=1e-10, atol=1e-12)
    # from here on both sides hold the same bits: compare the transport alone
    grad_cpu.copy_(grad_device.cpu())

    # neighbour exchange of the flat gradient, allreduce of the flat parameters
    peers = _ring_peers(comm)
    received = {}
    for where, grad in (("cpu", grad_cpu), ("device", grad_device)):
        recv = {p: torch.zeros_like(grad) for p in peers}
        comm.exchange({p: grad for p in peers}, recv, tag=21).wait()
        received[where] = recv
    for flat in (flat_cpu, flat_device):
        comm.allreduce_mean(flat)
    for peer in peers:
        assert_matches(
            received["device"][peer],
            received["cpu"][peer],
            f"rank {comm.rank}: flat gradient from {peer}",
        )
    assert_matches(flat_device, flat_cpu, f"rank {comm.rank}: averaged flat parameters")
    # the model sees the averaged parameters without any copy back
    assert_matches(
        params[0].detach().reshape(-1),
        flat_device[: params[0].numel()],
        "first layer's weight view",
    )
    return True


@pytest.mark.spmd
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_flatten_module_on_device(run, dtype_name):
    assert all(run(_flatten_body, dtype_name))


# -- cupy -------------------------------------------------------------------------------------


def _cupy_body(comm, dtype_name):
    import cupy

    device = _device(comm)
    with cupy.cuda.Device(device.index):
        peers = _ring_peers(comm)
        results = {}
        for kind, xp in (("numpy", np), ("cupy", cupy)):
            send = xp.asarray(_data((comm.rank, 4), NUMEL, DTYPES[dtype_name]).numpy())
            recv = {p: xp.full(NUMEL, -1.0, dtype=dtype_name) for p in peers}
            comm.exchange({p: send for p in peers}, recv, tag=31).wait()
            summed = xp.asarray(_dyadic((comm.rank, 5), NUMEL, DTYPES[dtype_name]).numpy())
            comm.allreduce_sum(summed)
            # a flat buffer's views alias it: receive into the flat vectors, read through the views
            flats = {p: FlatBuffer.zeros([(NUMEL - 1,), (1,)], like=send) for p in peers}
            comm.exchange(
                {p: send for p in peers}, {p: flats[p].flat for p in peers}, tag=32
            ).wait()
            results[kind] = (recv, summed, flats)
        recv_cpu, summed_cpu, flats_cpu = results["numpy"]
        recv_gpu, summed_gpu, flats_gpu = results["cupy"]
        assert isinstance(summed_gpu, cupy.ndarray)
        for p in peers:
            assert isinstance(recv_gpu[p], cupy.ndarray)
            assert_matches(
                recv_gpu[p], recv_cpu[p], f"rank {comm.rank}: cupy {dtype_name} message from {p}"
            )
            assert_matches(
                flats_gpu[p].views[0],
                recv_cpu[p][:-1],
                f"rank {comm.rank}: cupy flat buffer view from {p}",
            )
            assert float(flats_gpu[p].views[1][0]) == float(recv_cpu[p][-1])
        assert_matches(summed_gpu, summed_cpu, f"rank {comm.rank}: cupy {dtype_name} allreduce_sum")
    return True


@pytest.mark.spmd
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_cupy_arrays_match_numpy(run, dtype_name):
    pytest.importorskip("cupy", reason="cupy is not installed")
    if _dry_run():
        pytest.skip(f"{DEVICE_ENV}=cpu: cupy arrays always live on a GPU")
    assert all(run(_cupy_body, dtype_name))


# -- the two MPI device paths against each other ----------------------------------------------


def _both_paths_body(comm):
    """Exchange, allreduce and RelaySum on device buffers, staged and then CUDA-aware."""
    from relaympi.topology import build

    outputs = {}
    for aware in (False, True):
        comm.cuda_aware = aware
        got = []
        for dtype in DTYPES.values():
            recv, _ = _exchange(comm, dtype, _device(comm), tag=41)
            got += [recv[p] for p in sorted(recv)]
            got.append(_allreduce(comm, dtype, _device(comm), 300_007, mean=False))
        got += _relay(
            comm, build("double-binary-trees", comm.world_size), torch.float32, _device(comm)
        )[0]
        outputs[aware] = got
    for i, (staged, direct) in enumerate(zip(outputs[False], outputs[True], strict=True)):
        assert torch.equal(staged.cpu(), direct.cpu()), (
            f"rank {comm.rank}: output {i} differs between host staging and CUDA-aware MPI"
        )
    return True


@pytest.mark.spmd
def test_staged_and_cuda_aware_paths_agree(spmd, request):
    if not _with_mpi(request.config):
        pytest.skip(
            "compares the MPI backend's two device paths: run under mpirun ... pytest --with-mpi"
        )
    aware, why = mpi_cuda_support()
    if not aware:
        pytest.skip(why)
    comm = request.getfixturevalue("mpi_comm")
    before = comm.cuda_aware
    try:
        assert all(spmd(_both_paths_body))
    finally:
        comm.cuda_aware = before


# -- single-process checks (plain pytest only) ------------------------------------------------


def test_staged_allreduce_in_a_one_rank_mpi_world(request):
    """Host staging through a real MPI library without mpirun: a world of one rank."""
    if _with_mpi(request.config):
        pytest.skip("plain-pytest check (MPI world of size 1)")
    try:
        from mpi4py import MPI  # noqa: F401 - mpi4py without an MPI library raises RuntimeError
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"mpi4py unusable: {exc}")
    from relaympi.comm import mpi_communicator
    from relaympi.comm.mpi import MPICommunicator

    comm = mpi_communicator(cuda_aware=False)
    if comm.world_size != 1:
        pytest.skip(f"needs a one-rank MPI world, got {comm.world_size}")
    assert isinstance(comm, MPICommunicator) and comm.cuda_aware is False
    device = _device(comm)
    for dtype in DTYPES.values():
        x = _dyadic((0, 6), NUMEL, dtype)
        on_device = x.to(device)
        comm.allreduce_sum(on_device)
        assert_matches(on_device, x, f"one-rank staged allreduce of {dtype}")


def test_device_buffer_checks():
    """Non-contiguous device receive buffers are refused; device buffers count their bytes."""
    device = torch.device("cpu") if _dry_run() else torch.device("cuda", 0)

    def body(comm):
        peer = 1 - comm.rank
        view = torch.zeros(8, 2, device=device)[:, 0]
        with pytest.raises(BufferError, match="non-contiguous"):
            comm.exchange({}, {peer: view})
        recv = torch.zeros(4, dtype=torch.float64, device=device)
        comm.exchange(
            {peer: torch.full((4,), float(comm.rank), dtype=torch.float64, device=device)},
            {peer: recv},
        ).wait()
        assert recv.device == device and recv.tolist() == [float(peer)] * 4
        assert buffers.is_device(recv) == (device.type == "cuda")
        return int(comm.bytes_sent.sum())

    assert run_local(2, body) == [32, 32]

"""The device paths that only a GPU exercises, each held to the same computation on the CPU.

    python -m pytest tests/test_gpu_paths.py -rs                                            # one
    process
    mpirun -n 2 python -m pytest tests/test_gpu_paths.py --with-mpi -m "gpu and spmd" -rs   # MPI
    ranks

- host staging on a side stream (DeviceStaging.side_copy in relaympi.comm.staging): the copy to
  the host waits for the kernels that wrote the send buffer, and kernels reading a receive buffer
  wait for its copy;
- the cached array kinds (buffers.array_kind) for device tensors;
- device augmentation (cifar10.crop_flip) with indices on the images' device, and the batched
  engine's batches on a GPU;
- the batched RelaySum's index_add_ sums on a GPU;
- the gossip product at full float32 precision with TF32 switched on, touching no global state.

Without a GPU the CUDA tests are skipped; the checks that hold on any device run here too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaympi.algorithms import AlgorithmOptions
from relaympi.batched import BatchedOptimizer, make_batched_algorithm
from relaympi.batched import mixer as batched_mixer
from relaympi.comm import DropPolicy, buffers
from relaympi.optim import OptimizerConfig
from relaympi.tasks import cifar10
from relaympi.topology import build
from tests.test_gpu import _device, _ring_peers, pytest_generate_tests, run  # noqa: F401, F811 - fixtures and the transport hook

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
pytestmark = pytest.mark.gpu  # selected by benchmarks/gpu_check.sh's -m gpu / -m "gpu and spmd"


# -- host staging on the side stream ---------------------------------------------------------------


def _busy(device: torch.device) -> None:
    """Queue ~tens of milliseconds of kernels on the current stream (the host returns at once)."""
    a = torch.full((2048, 2048), 1.0 / 2048, device=device)
    for _ in range(40):
        a = a @ a


def _staged_race_body(comm, rounds: int = 3):
    device = _device(comm)
    peers = _ring_peers(comm)
    numel = 1 << 22
    send = torch.zeros(numel, device=device)
    recv = {p: torch.zeros(numel, device=device) for p in peers}
    # the same host buffers again: a copy out must finish before MPI rewrites them
    for r in range(rounds):
        _busy(device)
        send.fill_(comm.rank + 10.0 * r)  # queued behind the busy kernels when exchange starts
        comm.exchange({p: send for p in peers}, recv, tag=40 + r).wait()
        doubled = {p: recv[p] * 2 for p in peers}  # a kernel on the current stream right after wait
        for p in peers:
            want = 2 * (p + 10.0 * r)
            got = doubled[p]
            assert bool((got == want).all()), (
                f"rank {comm.rank} round {r} from {p}: {int((got != want).sum())} of {numel} wrong"
            )
    return True


@pytest.mark.spmd
def test_staged_copies_follow_the_streams_that_write_and_read_the_buffers(run, transport):  # noqa: F811 - run is the fixture
    if transport == "local":
        pytest.skip(
            "the side stream is the MPI backend's host staging: run under mpirun ... --with-mpi"
        )
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    assert all(run(_staged_race_body))


@needs_cuda
def test_array_kinds_of_device_tensors_are_cached_per_type():
    x = torch.zeros(3, device="cuda")
    parameter = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    for _ in range(2):  # the second pass answers from the cache
        assert buffers.array_kind(x) == "torch" and buffers.is_device(x)
        assert buffers.array_kind(parameter) == "torch" and buffers.is_device(parameter)
        assert buffers.array_kind(np.zeros(3)) == "numpy" and not buffers.is_device(np.zeros(3))
        assert buffers.array_kind(torch.zeros(3)) == "torch" and not buffers.is_device(
            torch.zeros(3)
        )
    cupy = pytest.importorskip("cupy")
    c = cupy.zeros(3)
    assert buffers.array_kind(c) == "cupy" and buffers.is_device(c)


# -- device augmentation ---------------------------------------------------------------------------


@needs_cuda
def test_crop_flip_on_the_gpu_with_device_indices_matches_the_cpu():
    g = np.random.default_rng(3)
    images = torch.from_numpy(g.integers(0, 256, (64, 3, 32, 32), dtype=np.uint8))
    top, left, flip = cifar10.draw_crop_flip(g, 64)
    want = cifar10.crop_flip(images, top, left, flip)
    on_gpu = images.cuda()
    for args in ((top, left, flip), tuple(torch.from_numpy(a).cuda() for a in (top, left, flip))):
        got = cifar10.crop_flip(on_gpu, *args)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


@needs_cuda
def test_batched_image_batches_on_the_gpu_match_the_cpu(tmp_path):
    from relaympi.engines.batched.data import BatchedData
    from relaympi.tasks import ClassificationTask, TaskOptions, get_task_class
    from relaympi.tasks.partition import dirichlet_partition
    from tests.data_factories import write_cifar10_binary

    write_cifar10_binary(tmp_path, n_per_batch=40)
    cls = get_task_class("cifar10")
    assert issubclass(cls, ClassificationTask)
    task = cls(TaskOptions(data_dir=tmp_path))
    parts = dirichlet_partition(task.train_labels, 4, 1.0, 0)
    on_cpu, on_gpu = BatchedData(task, parts, 8, 0, "cpu"), BatchedData(task, parts, 8, 0, "cuda")
    for step in (0, 1, 7):
        (xc, yc), (xg, yg) = on_cpu.batch(step), on_gpu.batch(step)
        assert torch.equal(yg.cpu(), yc)
        # (pixel / 255 - mean) / std: a GPU divides by a scalar as a multiplication by its
        # reciprocal (up to 1.5 ulp), and the subtraction cancels: bound by 2 ulp of the operands'
        # scale (<= 1) over the smallest std, plus 2 ulp of the result
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(xg.cpu(), xc, rtol=2 * eps, atol=2 * eps / min(cifar10.STD))


# -- the batched RelaySum's index_add_ sums --------------------------------------------------------


def _relay_trajectory(device: str, topology: str, n: int, steps: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    d = 37
    A = torch.randn(n, d, d, generator=g, dtype=torch.float64) / d**0.5
    b = torch.randn(n, d, generator=g, dtype=torch.float64)
    A, b = A.to(device), b.to(device)
    X = torch.zeros(n, d, dtype=torch.float64, device=device)
    optimizer = BatchedOptimizer(OptimizerConfig(momentum=0.9), X)
    algorithm = make_batched_algorithm(
        "relay",
        build(topology, n),
        optimizer,
        X.clone(),
        AlgorithmOptions(relay_mode="previous"),
        DropPolicy(0.1, seed=2),
    )
    for t in range(steps):
        G = torch.einsum("nij,nj->ni", A, X) - b
        algorithm.step(X, G, 0.05, t)
    return X.cpu()


@needs_cuda
@pytest.mark.parametrize("topology,n", [("double-binary-trees", 16), ("chain", 5), ("star", 6)])
def test_batched_relaysum_on_the_gpu_matches_the_cpu(topology, n):
    torch.testing.assert_close(
        _relay_trajectory("cuda", topology, n),
        _relay_trajectory("cpu", topology, n),
        rtol=1e-12,
        atol=1e-12,
    )


# -- the gossip product ----------------------------------------------------------------------------


def _mixing(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    W = torch.rand(n, n, generator=g, dtype=torch.float64)
    return W / W.sum(dim=1, keepdim=True)


def test_mix_is_the_float64_product_rounded_once_and_leaves_the_matmul_precision_alone(monkeypatch):
    # several column blocks and a short last one
    monkeypatch.setattr(batched_mixer, "MIX_COLUMNS", 100)

    def refuse(*args):
        raise AssertionError("mix changed the global float32 matmul precision")

    monkeypatch.setattr(torch, "set_float32_matmul_precision", refuse)
    W = _mixing(6, 0)
    X = torch.randn(6, 345, dtype=torch.float64).float()
    out = torch.empty_like(X)
    batched_mixer.mix(W.float(), X, out)
    assert torch.equal(out, (W.float().double() @ X.double()).float())


@needs_cuda
def test_mix_on_the_gpu_ignores_tf32():
    W = _mixing(16, 1)
    X = torch.randn(16, 3 * batched_mixer.MIX_COLUMNS + 5, dtype=torch.float64).float()
    want = (W.float().double() @ X.double()).float()
    # TF32 on through one API only (torch >= 2.9 refuses to read a mix of the legacy and
    # new switches)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        out = torch.empty_like(X, device="cuda")
        batched_mixer.mix(W.float().cuda(), X.cuda(), out)
        # (cuBLAS may take a non-tensor-core kernel for the whole 16 x 786437 product: prove TF32 on
        # a slice)
        tf32 = W.float().cuda() @ X[:, :4096].cuda()
        assert torch.get_float32_matmul_precision() == "high", "mix changed the matmul precision"
    finally:
        torch.set_float32_matmul_precision(before)
    # float64 products on the GPU sum in another order than the CPU's: at most one float32
    # rounding apart
    torch.testing.assert_close(out.cpu(), want, rtol=1.2e-7, atol=1e-30)
    assert float((tf32.cpu() - want[:, :4096]).abs().max()) > 1e-5, (
        "TF32 was not in effect: the check proves nothing"
    )

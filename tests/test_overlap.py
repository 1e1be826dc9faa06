"""--overlap: gradient buckets delivered from backward's hooks, and the same numbers with and
without it.

The buckets (relaympi/training/buckets.py) must cover the flat model exactly once per step, in the
same order every step, each with its gradient final when it is delivered; the runs must be bit
for bit those without --overlap (run files compared dataset by dataset, times and the overlap keys
aside) for every algorithm and relay mode, chunked and in-place RelaySum, drops, any bucket size,
a checkpoint resumed with the other setting, and on MPI ranks (the spmd test under mpirun -n 4).
"""

# Long module: every part of --overlap (buckets, hooks, resolution, run files) in one place

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import cast

import h5py
import numpy as np
import pytest
import torch

from relaympi import train
from relaympi.algorithms import AlgorithmOptions, make_algorithm
from relaympi.comm import Request
from relaympi.flat import flatten_module
from relaympi.launcher import ALLOW_CUDA_OVERLAP_ENV, cuda_overlap_mode
from relaympi.optim import OptimizerConfig, make_optimizer
from relaympi.topology import build
from relaympi.training.buckets import GradientBuckets, cut_buckets
from tests.conftest import requires_mpirun, run_train

# ------------------------------------------------------------------------------------ buckets


class _Tied(torch.nn.Module):
    """Embedding and output tied (one parameter used twice), a parameter backward never reaches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(11, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.unused = torch.nn.Linear(6, 2)
        self.last = torch.nn.Linear(6, 6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.embed(tokens)))
        # the embedding again: its gradient accumulates twice
        return self.last(h) @ self.embed.weight.T


def _deliveries(
    model: torch.nn.Module, grad: torch.Tensor, buckets: GradientBuckets, batch: torch.Tensor
):
    """One step's deliveries: (lo, hi, grad[lo:hi] at delivery, delivered during backward)."""
    got, in_backward = [], [True]
    grad.zero_()
    with buckets.delivering(
        lambda lo, hi: got.append((lo, hi, grad[lo:hi].clone(), in_backward[0]))
    ):
        torch.nn.functional.cross_entropy(
            model(batch).reshape(-1, 11), batch.reshape(-1)
        ).backward()
        in_backward[0] = False
    return got


@pytest.mark.parametrize("bucket_mb", [1e-5, 2e-4, 1.0])
def test_buckets_cover_the_model_once_in_the_same_order_with_final_gradients(bucket_mb):
    model = _Tied()
    _, grad = flatten_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = GradientBuckets(grad, params, bucket_mb)
    orders = []
    for step in range(3):
        batch = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
        got = _deliveries(model, grad, buckets, batch)
        covered = np.zeros(grad.numel(), dtype=int)
        for lo, hi, at_delivery, _ in got:
            covered[lo:hi] += 1
            assert torch.equal(at_delivery, grad[lo:hi]), (
                f"grad[{lo}:{hi}] changed after its delivery"
            )
        assert (covered == 1).all()  # every element exactly once
        # last layers first
        assert [hi for _, hi, _, _ in got] == sorted((hi for _, hi, _, _ in got), reverse=True)
        orders.append([(lo, hi) for lo, hi, _, _ in got])
        unused = range(*_flat_range(model.unused, grad))
        # the bucket holding the unused layer waits for the end (its gradient never comes); the tied
        # embedding (flat index 0) waits for both of its uses
        assert all(not during for lo, hi, _, during in got if lo <= unused[0] < hi or lo == 0)
        if len(got) > 2:
            assert got[0][3], "the last layers' bucket was not delivered while backward ran"
    assert orders[0] == orders[1] == orders[2]


def _flat_range(layer: torch.nn.Module, grad: torch.Tensor) -> tuple[int, int]:
    base = grad.data_ptr()
    lows = [
        (cast(torch.Tensor, p.grad).data_ptr() - base) // grad.element_size()
        for p in layer.parameters()
    ]
    return min(lows), max(lo + p.numel() for lo, p in zip(lows, layer.parameters(), strict=True))


def test_buckets_are_cut_from_the_end_to_at_least_the_size():
    ranges = [(0, 10), (10, 12), (12, 30), (30, 31)]
    assert cut_buckets(ranges, 1) == [(30, 31), (12, 30), (10, 12), (0, 10)]
    assert cut_buckets(ranges, 5) == [(12, 31), (0, 12)]
    assert cut_buckets(ranges, 100) == [(0, 31)]


def test_without_autograd_one_bucket_is_delivered_after_the_gradient():
    grad = torch.zeros(7, dtype=torch.float64)
    buckets = GradientBuckets(grad, [], 1.0)
    got = []
    with buckets.delivering(lambda lo, hi: got.append((lo, hi))):
        assert got == []
    assert got == [(0, 7)]


def test_two_backwards_in_one_step_are_refused():
    model = torch.nn.Linear(3, 2)
    _, grad = flatten_module(model)
    buckets = GradientBuckets(grad, list(model.parameters()), 1.0)
    with (
        pytest.raises(RuntimeError, match="accumulated twice"),
        buckets.delivering(lambda lo, hi: None),
    ):
        for _ in range(2):
            model(torch.ones(1, 3)).sum().backward()


def _on_another_thread(work) -> None:
    """Run ``work`` on a new thread and wait for it (backward there runs its hooks there, as
    autograd
    runs CUDA parameters' hooks on its own device thread); its exception is raised here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("any_thread", [False, True])
def test_hooks_on_another_thread_leave_the_delivery_to_the_stepping_thread(any_thread):
    model = _Tied()
    _, grad = flatten_module(model)
    batch = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    here = _deliveries(model, grad, GradientBuckets(grad, list(model.parameters()), 1e-5), batch)
    buckets = GradientBuckets(grad, list(model.parameters()), 1e-5, any_thread=any_thread)
    got: list[tuple[int, int, torch.Tensor]] = []
    threads: set[int] = set()
    grad.zero_()

    def deliver(lo: int, hi: int) -> None:
        got.append((lo, hi, grad[lo:hi].clone()))
        threads.add(threading.get_ident())

    with buckets.delivering(deliver):
        _on_another_thread(
            lambda: torch.nn.functional.cross_entropy(
                model(batch).reshape(-1, 11), batch.reshape(-1)
            ).backward()
        )
    # the same buckets in the same order
    assert [(lo, hi) for lo, hi, _ in got] == [(lo, hi) for lo, hi, _, _ in here]
    for (_, _, at_delivery), (_, _, want, _) in zip(got, here, strict=True):
        assert torch.equal(at_delivery, want)
    # any_thread: the hooks' thread delivers too (the path that hung)
    assert (threads != {threading.get_ident()}) == any_thread


# ---------------------------------------------------------------- the same numbers, run files

DIGITS = [
    "--task",
    "digits",
    "--backend",
    "local",
    "--workers",
    "4",
    "--steps",
    "6",
    "--eval-every",
    "3",
    "--alpha",
    "0.5",
]
# 524 float32: the digits MLP's 4,810 parameters in 4 buckets
SMALL_BUCKETS = ["--bucket-size", "0.002"]

CASES = {
    "allreduce": ["--algo", "allreduce"],
    "dpsgd": ["--algo", "dpsgd"],
    "qgm": ["--algo", "qgm"],
    "d2": ["--algo", "d2", "--topology", "chain"],
    "gt": ["--algo", "gt"],
    "sgp": ["--algo", "sgp"],
    "relay-counts": ["--algo", "relay"],
    "relay-previous-drops": ["--algo", "relay", "--relay-mode", "previous", "--drop-prob", "0.2"],
    "relay-initial-drops": ["--algo", "relay", "--relay-mode", "initial", "--drop-prob", "0.2"],
    "relay-chunked-in-place": ["--algo", "relay", "--relay-chunk", "300", "--relay-in-place"],
    "relay-grad-chain-chunked": [
        "--algo",
        "relay-grad",
        "--topology",
        "chain",
        "--relay-chunk",
        "700",
    ],
    "dpsgd-drops-momentum": ["--algo", "dpsgd", "--drop-prob", "0.2", "--momentum", "0.9"],
}


def _train(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / f"{name}.h5"
    assert train.main([*DIGITS, *args, "--out", str(out)]) == 0
    return out


def _numbers(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """A run file's datasets but the times, and its config but the overlap keys."""
    with h5py.File(path, "r") as file:
        data = {
            name: file[name][:]
            for name in file
            if isinstance(file[name], h5py.Dataset) and not name.startswith("time")
        }
        config = json.loads(file.attrs["config"])
    return data, {k: v for k, v in config.items() if k not in ("overlap", "bucket_size", "out")}


def assert_same_numbers(path: Path, reference: Path) -> None:
    (got, got_config), (want, want_config) = _numbers(path), _numbers(reference)
    assert got_config == want_config
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_overlap_gives_the_same_run_file(tmp_path, case):
    plain = _train(tmp_path, "plain", *CASES[case])
    overlapped = _train(tmp_path, "overlap", *CASES[case], "--overlap", *SMALL_BUCKETS)
    assert_same_numbers(overlapped, plain)
    with h5py.File(overlapped, "r") as file:
        config = json.loads(file.attrs["config"])
    assert config["overlap"] is True and config["bucket_size"] == 0.002


def test_the_bucket_size_changes_no_bit(tmp_path):
    args = ["--algo", "relay", "--relay-chunk", "500", "--drop-prob", "0.1"]
    one = _train(tmp_path, "one", *args, "--overlap", "--bucket-size", "100")
    many = _train(tmp_path, "many", *args, "--overlap", "--bucket-size", "0.0001")
    assert_same_numbers(many, one)


def test_a_checkpoint_resumes_with_the_other_overlap_setting(tmp_path, monkeypatch):
    args = ["--algo", "relay", "--steps", "8", "--eval-every", "2"]
    full = _train(tmp_path, "full", *args)
    resumed = [
        *DIGITS,
        *args,
        "--out",
        str(tmp_path / "resumed.h5"),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", "1:5")
    assert train.main([*resumed, "--overlap"]) == train.EXIT_FAILED
    monkeypatch.delenv("RELAYMPI_INJECT_FAILURE")
    assert train.main([*resumed, "--no-overlap"]) == 0
    got, want = _numbers(tmp_path / "resumed.h5")[0], _numbers(full)[0]
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_quadratics_overlap_in_float64(tmp_path):
    args = [
        "--task",
        "quadratics",
        "--backend",
        "local",
        "--workers",
        "4",
        "--steps",
        "5",
        "--eval-every",
        "1",
        "--algo",
        "relay",
    ]
    outs: list[Path] = []
    for extra in ([], ["--overlap"]):
        outs.append(tmp_path / f"q{len(outs)}.h5")
        assert train.main([*args, *extra, "--out", str(outs[-1])]) == 0
    assert_same_numbers(outs[1], outs[0])


# --overlap and --progress-thread as they run (relaympi.training.plan.resolve): --overlap by default
# on for MPI ranks on more than one node on the CPU (measured faster there) with a model of several
# buckets (VGG-11 here), else off; the thread only where given and MPI overlaps
@pytest.mark.parametrize(
    "flags, nodes, want",
    [
        ([], (0, 0, 1, 1), (True, False)),  # MPI across two nodes
        ([], (0, 0, 0, 0), (False, False)),  # one node: the transfers are the ranks' own copies
        # emulated nodes count as nodes (as for --placement)
        (["--ranks-per-node", "2"], None, (True, False)),
        (["--device", "cuda"], (0, 0, 1, 1), (False, False)),  # refused on GPUs for now
        (["--progress-thread"], (0, 0, 1, 1), (True, True)),
        # nothing to progress on one node (auto: no overlap)
        (["--progress-thread"], (0, 0, 0, 0), (False, False)),
        (["--no-overlap"], (0, 0, 1, 1), (False, False)),
        (["--overlap", "--progress-thread"], (0, 0, 0, 0), (True, True)),
        # no wire between threads
        (["--backend", "local", "--workers", "4", "--ranks-per-node", "2"], None, (False, False)),
        (["--backend", "local", "--workers", "4", "--overlap"], None, (True, False)),
        (["--backend", "batched", "--workers", "4", "--ranks-per-node", "2"], None, (False, False)),
    ],
)
def test_overlap_and_the_progress_thread_resolve_per_run(flags, nodes, want):
    from relaympi.config import parse_args
    from relaympi.training.plan import resolve

    plan = resolve(parse_args(["--task", "cifar10", *flags]), 4, nodes)
    assert (plan.cfg.overlap, plan.cfg.progress_thread) == want


@pytest.mark.parametrize(
    "flags, nodes, notice",
    [
        (
            ["--progress-thread"],
            (0, 0, 0, 0),
            "--progress-thread does nothing: --overlap is off in this run",
        ),
        (
            ["--progress-thread", "--bucket-size", "8", "--progress-interval", "1"],
            (0, 0, 0, 0),
            "--progress-thread, --bucket-size, --progress-interval do nothing",
        ),
        (["--progress-thread", "--device", "cuda"], (0, 0, 1, 1), "--progress-thread does nothing"),
        # overlapping by default across nodes: the thread runs
        (["--progress-thread"], (0, 0, 1, 1), None),
        (["--overlap", "--bucket-size", "8"], (0, 0, 0, 0), None),
        ([], (0, 0, 0, 0), None),
    ],
)
def test_overlap_flags_a_run_resolves_away_are_named(flags, nodes, notice):
    from relaympi.config import parse_args
    from relaympi.training.plan import resolve

    notices = resolve(parse_args(["--task", "cifar10", *flags]), 4, nodes).notices
    assert notices[0].startswith(notice) if notice else notices == (), notices


# Across nodes, a model within one --bucket-size bucket has nothing to overlap: its one bucket is
# complete when backward ends. Off by default there; several buckets (or --overlap) turn it on.
@pytest.mark.parametrize(
    "task, flags, want",
    [
        ("digits", [], False),  # 4,810 float32: 19 KiB, one 4 MiB bucket
        ("digits", ["--bucket-size", "0.004"], True),  # 19 KiB in 4 KiB buckets
        ("digits", ["--overlap"], True),  # asked for
        ("cifar10", [], True),  # VGG-11: 35 MiB, 5 buckets
        ("cifar10", ["--bucket-size", "64"], False),  # all in one bucket
        ("quadratics", ["--steps", "2"], False),  # dim float64s
    ],
)
def test_overlap_is_on_by_default_only_for_a_model_of_several_buckets(task, flags, want):
    from relaympi.config import parse_args
    from relaympi.training.plan import resolve

    plan = resolve(parse_args(["--task", task, *flags]), 4, (0, 0, 1, 1))
    assert plan.cfg.overlap is want


def test_a_model_of_one_bucket_names_the_flags_that_do_nothing():
    from relaympi.config import parse_args
    from relaympi.training.plan import resolve

    notices = resolve(
        parse_args(["--task", "digits", "--progress-thread"]), 4, (0, 0, 1, 1)
    ).notices
    assert notices == (
        "--progress-thread does nothing: --overlap is off in this run (its default on one "
        "node, for a model within one --bucket-size bucket, on --backend local and with "
        "--device cuda; pass --overlap to overlap)",
    )


@pytest.mark.parametrize(
    "model_bytes, bucket_mb, pays",
    [
        (None, 4.0, True),  # not known before the data loads: as before, on
        (4 * 2**20, 4.0, False),  # exactly one bucket
        (4 * 2**20 + 4, 4.0, True),
        (4 * 4810, 4.0, False),
        (4 * 4810, 0.004, True),
    ],
)
def test_overlap_pays_above_one_bucket(model_bytes, bucket_mb, pays):
    from relaympi.training.plan import overlap_pays

    assert overlap_pays(model_bytes, bucket_mb) is pays


def test_tasks_model_bytes_are_their_models():
    import torch

    from relaympi.tasks import TaskOptions, get_task_class
    from relaympi.tasks.digits import DigitsTask
    from relaympi.tasks.models import VGG11_NUM_PARAMETERS

    digits, cifar10, quadratics = (
        get_task_class(name) for name in ("digits", "cifar10", "quadratics")
    )
    model = DigitsTask(TaskOptions()).build_model(0)
    spec = {
        "problem_file": None,
        "seed": 0,
        "dim": 7,
        "mu": None,
        "L": None,
        "zeta2": None,
        "r0": None,
        "sigma2": None,
    }
    settled, problem = quadratics.settle(spec, 4)
    rng = torch.get_rng_state()
    assert (
        digits.model_bytes({}, None) == 4 * sum(p.numel() for p in model.parameters()) == 4 * 4810
    )
    assert cifar10.model_bytes({}, None) == 4 * VGG11_NUM_PARAMETERS  # VGG-11's float32
    assert quadratics.model_bytes(settled, problem) == 8 * 7  # x in float64
    assert torch.equal(torch.get_rng_state(), rng)  # built on the meta device: nothing drawn


def test_the_summary_says_when_a_run_overlapped(tmp_path, capsys):
    _train(tmp_path, "on", "--algo", "relay", "--overlap")
    assert capsys.readouterr().out.rstrip().endswith("| placement ranks | overlap")
    _train(tmp_path, "off", "--algo", "relay")
    assert capsys.readouterr().out.rstrip().endswith("| placement ranks")


def test_a_run_file_records_the_resolved_settings(tmp_path):
    out = _train(tmp_path, "auto", "--algo", "relay")  # the local backend on one node: off
    with h5py.File(out, "r") as file:
        config = json.loads(file.attrs["config"])
    assert (config["overlap"], config["progress_thread"]) == (False, False)


@pytest.mark.parametrize(
    "flags, refused",
    [
        (
            ["--backend", "batched", "--workers", "2", "--overlap"],
            "--overlap cannot apply: the batched engine has no wire",
        ),
        (
            ["--backend", "local", "--workers", "2", "--bucket-size", "1"],
            "--bucket-size cannot apply",
        ),
        (
            ["--backend", "local", "--workers", "2", "--device", "cuda", "--overlap"],
            "--overlap cannot apply: it has not passed a check on a GPU yet",
        ),
        (
            ["--backend", "local", "--workers", "2", "--device", "cuda:0", "--overlap"],
            "--overlap cannot apply: it has not passed a check on a GPU yet",
        ),
        (
            ["--backend", "local", "--workers", "2", "--overlap", "--bucket-size", "0"],
            "--bucket-size must be > 0",
        ),
        (
            ["--backend", "local", "--workers", "2", "--overlap", "--progress-thread"],
            "--progress-thread cannot apply: it runs MPI's progress engine",
        ),
        (
            ["--no-overlap", "--progress-thread"],
            "--progress-thread cannot apply: it progresses transfers started during backward",
        ),
        (["--no-overlap", "--bucket-size", "2"], "--bucket-size cannot apply"),
        (["--overlap", "--progress-interval", "1"], "--progress-interval cannot apply"),
        (
            ["--backend", "local", "--workers", "2", "--overlap", "--progress-interval", "1"],
            "--progress-interval cannot apply",
        ),
        (["--progress-thread", "--progress-interval", "0"], "--progress-interval must be > 0"),
    ],
)
def test_misuse_exits_2_naming_the_flag(tmp_path, capsys, flags, refused):
    assert (
        train.main(["--task", "digits", "--steps", "2", *flags, "--out", str(tmp_path / "r.h5")])
        == 2
    )
    assert refused in capsys.readouterr().err
    assert not (tmp_path / "r.h5").exists()


@pytest.mark.parametrize(
    "value, refused", [("", True), ("0", True), ("1", False), ("hooks", False)]
)
def test_the_diagnostic_switch_lifts_the_refusal_of_overlap_on_cuda(monkeypatch, value, refused):
    from relaympi.config import not_applicable, parse_args

    monkeypatch.setenv(ALLOW_CUDA_OVERLAP_ENV, value)
    cfg = parse_args(["--task", "digits", "--no-overlap", "--device", "cuda", "--out", "r.h5"])
    on = dataclasses.replace(cfg, overlap=True)
    assert any(flag == "--overlap" for flag, _ in not_applicable(on)) == refused
    assert cuda_overlap_mode() == {"": None, "0": None, "1": "owner", "hooks": "hooks"}[value]


def test_the_diagnostic_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(ALLOW_CUDA_OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match="expected 1, hooks or 0"):
        cuda_overlap_mode()


def test_batched_accepts_no_overlap(tmp_path):
    assert (
        train.main(
            [
                "--task",
                "digits",
                "--steps",
                "2",
                "--backend",
                "batched",
                "--workers",
                "2",
                "--no-overlap",
                "--out",
                str(tmp_path / "r.h5"),
            ]
        )
        == 0
    )


# ------------------------------------------------- message passing on MPI ranks (mpirun -n 4)

# chain: any world size >= 2
ALGOS = [
    ("relay", "double-binary-trees", "counts"),
    ("relay", "chain", "previous"),
    ("relay-grad", "double-binary-trees", "counts"),
    ("allreduce", "fully-connected", "counts"),
    ("dpsgd", "chain", "counts"),
    ("gt", "chain", "counts"),
]


def _model_steps(
    comm,
    algo: str,
    topology: str,
    mode: str,
    overlap: bool,
    thread: bool = False,
    backward=lambda work: work(),
    any_thread: bool = False,
) -> np.ndarray:
    """Six steps of a small MLP per rank (its own data) with the algorithm: bucketed (overlap) or
    whole
    steps; ``thread``: with a progress thread polling every 0.1 ms during backward (MPI only);
    ``backward(work)`` runs each backward; ``any_thread``: GradientBuckets' option."""
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 8),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    ).double()
    # the same x(0) everywhere (not the global RNG: in-process ranks are threads)
    init = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=init)
    x, grad = flatten_module(model)
    optimizer = make_optimizer(OptimizerConfig(momentum=0.9), x)
    algorithm = make_algorithm(
        algo,
        comm,
        build(topology, comm.world_size),
        optimizer,
        x,
        AlgorithmOptions(relay_mode=mode, relay_chunk=7),
    )
    buckets = (
        GradientBuckets(grad, list(model.parameters()), 1e-4, comm.progress, any_thread=any_thread)
        if overlap
        else None
    )
    if thread:
        assert comm.start_progress_thread(1e-4) == (
            comm.backend == "mpi" and comm.thread_level() == "multiple"
        )
    inputs = torch.randn(
        6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(comm.rank)
    )
    for t in range(6):
        lr = 0.05 + 0.01 * t
        grad.zero_()
        if buckets is None:
            model(inputs).square().mean().backward()
            algorithm.step(x, grad, lr, t)
        else:
            algorithm.begin_step(x, grad, lr, t)
            with comm.progressing(), buckets.delivering(algorithm.ready):
                backward(lambda: model(inputs).square().mean().backward())
            algorithm.finish_step()
    return x.detach().numpy().copy()


class _CallThreads:
    """The threads that call into ``comm`` (its calls that reach the transport, and its requests'
    test and wait) until ``close()``."""

    NAMES = (
        "exchange",
        "exchange_replace",
        "allreduce_sum",
        "iallreduce_sum",
        "allreduce_flags",
        "progress",
        "barrier",
    )

    def __init__(self, comm) -> None:
        self.comm = comm
        self.threads: set[int] = set()
        for name in self.NAMES:
            setattr(comm, name, self._logged(getattr(comm, name)))

    def _logged(self, method):
        def call(*args, **kwargs):
            self.threads.add(threading.get_ident())
            result = method(*args, **kwargs)
            if isinstance(result, Request):
                # wrapped in place, to log the thread of every call
                result.test, result.wait = self._logged(result.test), self._logged(result.wait)  # type: ignore[method-assign]
            return result

        return call

    def close(self) -> None:
        for name in self.NAMES:
            delattr(self.comm, name)


def _steps_with_backward_elsewhere(
    comm, algo: str, topology: str, any_thread: bool
) -> tuple[np.ndarray, bool]:
    """_model_steps' overlapped steps with each backward on another thread: x, and whether every
    call
    into the communicator came from this rank's thread."""
    calls = _CallThreads(comm)
    try:
        x = _model_steps(
            comm, algo, topology, "counts", True, backward=_on_another_thread, any_thread=any_thread
        )
    finally:
        calls.close()
    return x, calls.threads == {threading.get_ident()}


class _CopyStillRunning:
    """A staging copy's event that reports "not done" until waited for (on a busy GPU, the copies
    of the sends queued in backward's hooks are still behind backward's kernels when they
    return)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _wait_with_sends_held_back(comm, blocking: str) -> bool:
    """Each rank queues a staged send whose copy is still running, then blocks in ``blocking``
    (a receive's wait, or a collective) before waiting for the send: the blocking call must post
    the rank's queued sends first, or every rank waits there for the others' (the hang of
    --device cuda --overlap after its first step)."""
    from relaympi.comm.staging import StagedSend

    left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
    send, recv = torch.full((5,), float(comm.rank)), torch.full((5,), -1.0)
    comm._async_staging = lambda buf: buf is send  # the send goes through the staging queue
    staging = comm._staging
    staging.stage_send = lambda buf, slot, peer, tag: StagedSend(
        buf.clone(), _CopyStillRunning(), peer, tag
    )
    try:
        received = comm.exchange({}, {left: recv}, tag=7)
        sent = comm.exchange({right: send}, {}, tag=7)
        assert sent._staged and sent._staged[0].request is None  # held back: its copy is not done
        if blocking == "barrier":
            comm.barrier()
        received.wait()
        sent.wait()
    finally:
        del comm._async_staging, staging.stage_send
    return bool((recv == float(left)).all())


@pytest.mark.spmd
@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocking", ["receive", "barrier"])
def test_a_blocking_wait_posts_the_ranks_held_back_sends_first(spmd, request, blocking):
    if not request.config.getoption("with_mpi", default=False):
        pytest.skip("the staging queue is the MPI backend's: mpirun ... pytest --with-mpi")
    assert all(spmd(_wait_with_sends_held_back, blocking))


@pytest.mark.spmd
@pytest.mark.parametrize(
    "algo, topology", [("relay", "double-binary-trees"), ("allreduce", "fully-connected")]
)
def test_with_backward_on_another_thread_every_call_into_the_transport_stays_on_the_ranks_thread(
    spmd, algo, topology
):
    plain = spmd(_model_steps, algo, topology, "counts", False)
    for any_thread in (False, True):
        results = spmd(_steps_with_backward_elsewhere, algo, topology, any_thread)
        for (got, on_rank_thread), want in zip(results, plain, strict=True):
            np.testing.assert_array_equal(got, want)
            # any_thread: the hooks' thread called the transport
            assert on_rank_thread != any_thread


@pytest.mark.spmd
@pytest.mark.parametrize("algo, topology, mode", ALGOS, ids=[f"{a}-{t}-{m}" for a, t, m in ALGOS])
def test_bucketed_steps_match_whole_steps_on_every_rank(spmd, algo, topology, mode):
    plain = spmd(_model_steps, algo, topology, mode, False)
    overlapped = spmd(_model_steps, algo, topology, mode, True)
    threaded = spmd(_model_steps, algo, topology, mode, True, True)
    for got, with_thread, want in zip(overlapped, threaded, plain, strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(with_thread, want)


def _moved_while_computing(comm) -> tuple[bool, int, bool]:
    """Rank 0 sends 16 MiB to rank 1 (a rendezvous: it moves only while the progress engine runs);
    then every rank computes for 0.4 s without an MPI call, inside ``progressing()``. Returns (rank
    1's
    buffer held the message before its first MPI call after posting, the thread's polls, the request
    completed)."""
    assert comm.start_progress_thread(2e-4)
    n = 4 << 20
    buf = np.zeros(n, dtype=np.float32) if comm.rank else np.arange(n, dtype=np.float32)
    request = (
        comm.exchange({1: buf}, {}, tag=17)
        if comm.rank == 0
        else comm.exchange({}, {0: buf}, tag=17)
        if comm.rank == 1
        else None
    )
    polls = comm.progress_polls
    with comm.progressing():
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:
            torch.ones(256, 256) @ torch.ones(256, 256)  # compute, no MPI call
    # read before any MPI call
    moved = bool(comm.rank != 1 or np.array_equal(buf, np.arange(n, dtype=np.float32)))
    if request is not None:
        request.wait()
    comm.barrier()
    return moved, comm.progress_polls - polls, request is None or request.test()


def test_the_in_process_transport_starts_no_progress_thread():
    from relaympi.comm import run_local

    # its copies move inside its own calls
    assert run_local(2, lambda comm: comm.start_progress_thread()) == [False, False]


@pytest.mark.mpi
@pytest.mark.spmd
def test_the_progress_thread_moves_a_transfer_while_the_rank_computes(spmd, request):
    if not request.config.getoption("--with-mpi", default=False):
        pytest.skip(
            "MPI ranks only: the in-process transport has no progress engine "
            "(start_progress_thread is False there)"
        )
    if spmd(lambda comm: comm.thread_level())[0] != "multiple":
        pytest.skip("this MPI does not provide MPI_THREAD_MULTIPLE: no progress thread")
    ((moved, polls, completed),) = spmd(_moved_while_computing)
    assert completed
    assert (
        polls > 10
        # asked to poll every 0.2 ms for 0.4 s (~700 polls on an idle machine; fewer when ranks
        # share cores)
    )
    assert moved


@pytest.mark.slow
@requires_mpirun
@pytest.mark.parametrize("thread_level, ran", [("multiple", True), ("serialized", False)])
def test_mpi_ranks_on_two_nodes_overlap_by_default_and_say_whether_the_thread_ran(
    tmp_path, thread_level, ran
):
    """Under mpirun on 2 emulated nodes --overlap is on without being asked; --progress-thread runs
    where MPI provides MPI_THREAD_MULTIPLE, and where it does not rank 0 warns, the run goes on
    without it, and the run file and the summary say so."""
    out = tmp_path / "r.h5"
    args = [
        "--task",
        "digits",
        "--algo",
        "relay",
        "--steps",
        "4",
        "--ranks-per-node",
        "1",
        "--progress-thread",
        "--bucket-size",
        "0.004",
        "--out",
        out,
    ]
    # buckets of 4 KiB: digits' 19 KiB model spans several, so --overlap's default is on
    # across nodes
    proc = run_train(args, mpi=2, env={"MPI4PY_RC_THREAD_LEVEL": thread_level})
    assert proc.returncode == 0, proc.stderr[-2000:]
    with h5py.File(out, "r") as file:
        config, provenance = json.loads(file.attrs["config"]), json.loads(file.attrs["provenance"])
    assert config["overlap"] is True and config["progress_thread"] is True  # as asked and resolved
    assert (
        provenance["transport_thread_level"] == thread_level
        and provenance["transport_progress_thread"] is ran
    )
    assert (
        "no progress thread: this MPI does not provide MPI_THREAD_MULTIPLE"
        in proc.stdout + proc.stderr
    ) is not ran
    assert proc.stdout.rstrip().endswith("| overlap with a progress thread" if ran else "| overlap")

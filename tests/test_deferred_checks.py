"""The batched engine's deferred checks: reading losses and timers every K steps, not every step,
records the same run (rows, status, the diverged step) as reading them every step.

On a GPU (engines/batched/run.py's check_lag) the host reads every DEFERRED_STEPS steps so that the
device
runs ahead; here the same bookkeeping runs on CPU tensors with the lag forced.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from relaympi.batched.algorithms import make_batched_algorithm
from relaympi.batched.optim import BatchedOptimizer
from relaympi.config import parse_args
from relaympi.engines.batched import run as batched_run
from relaympi.results import read_run
from relaympi.training.plan import resolve

ARGS = [
    "--task",
    "digits",
    "--algo",
    "dpsgd",
    "--alpha",
    "0.1",
    "--steps",
    "20",
    "--eval-every",
    "6",
    "--lr",
    "0.2",
]


def _poisoning(step_to_poison: int | None, rows: tuple[int, ...] = (2,)):
    """make_batched_algorithm whose algorithm sets workers ``rows`` of X to NaN after step
    ``step_to_poison``."""

    def make(algo, topology, optimizer, X0, options, drops, nodes=None):
        algorithm = make_batched_algorithm(algo, topology, optimizer, X0, options, drops, nodes)
        inner = type(algorithm).step

        def step(self, X, G, lr, t):
            inner(self, X, G, lr, t)
            if t == step_to_poison:
                X[list(rows)] = float("nan")

        # bound as a method, so that a deep copy (the engine's thread-count trial steps one)
        # steps the copy, not this algorithm and its byte counters
        algorithm.step = types.MethodType(step, algorithm)  # type: ignore[method-assign]
        return algorithm

    return make


def _run(tmp_path, monkeypatch, lag: int, poison: int | None, name: str, extra=(), rows=(2,)):
    monkeypatch.setattr(batched_run, "check_lag", lambda device: lag)
    out = tmp_path / f"{name}-lag{lag}.h5"
    plan = resolve(
        parse_args([*ARGS, *extra, "--backend", "batched", "--workers", "4", "--out", str(out)]), 4
    ).with_out(out)
    status = batched_run.run_batched(
        plan, out, "test", make_optimizer=BatchedOptimizer, make_algorithm=_poisoning(poison, rows)
    )
    return status, read_run(out)


def _outcome(run):
    """The run file's attributes that say how it ended (not its times, provenance or identity)."""
    return {
        k: v
        for k, v in run.attrs.items()
        if "time" not in k and k not in ("provenance", "config", "run_id")
    }


def _numbers(run):
    """The run's numbers: not its times, nor the process's peak GPU memory (bookkeeping that the
    pinned host copies and earlier runs in the same process move)."""
    return {
        k: v
        for k, v in run.data.items()
        if not k.startswith("time") and k != "gpu_max_memory_bytes"
    }


@pytest.mark.parametrize("poison", [None, 0, 3, 4, 5, 11, 12])
@pytest.mark.parametrize("lag", [4, 7])
def test_deferred_checks_record_the_run_that_checking_every_step_records(
    tmp_path, monkeypatch, lag, poison
):
    # poisoned after step t, the loss of step t + 1 is the first non-finite one: with a finite
    # loss on worker 0 (rows=(2,)) message passing records step t + 2; an evaluation at step 6 or
    # 12 between them sees a non-finite model first
    expected_status, expected = _run(tmp_path, monkeypatch, 1, poison, "every")
    status, run = _run(tmp_path, monkeypatch, lag, poison, "deferred")
    assert status == expected_status == ("completed" if poison is None else "diverged")
    assert _outcome(run) == _outcome(expected)
    a, b = _numbers(expected), _numbers(run)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    if poison is not None:
        # hand count: t + 2 (after the bad step, worker 0's loss finite), unless an evaluation
        # at a multiple of 6 falls at t + 1 and sees the NaN model first: then t + 2 as well
        assert run.attrs["diverged_step"] == poison + 2


def test_deferred_checks_record_the_bad_step_when_worker_zero_is_non_finite(tmp_path, monkeypatch):
    # worker 0 itself non-finite: message passing records the bad step, not the one after it
    _, expected = _run(tmp_path, monkeypatch, 1, 8, "every", rows=(0,))
    _, run = _run(tmp_path, monkeypatch, 5, 8, "deferred", rows=(0,))
    assert run.attrs["diverged_step"] == expected.attrs["diverged_step"] == 9


def test_deferred_timers_still_add_up(tmp_path, monkeypatch):
    _, run = _run(tmp_path, monkeypatch, 6, None, "timers")
    compute, comm = run.data["time_compute_s"][-1], run.data["time_comm_s"][-1]
    assert np.all(compute > 0) and np.all(comm > 0)
    assert np.all(np.diff(run.data["time_compute_s"], axis=0) >= 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_deferred_checks_on_the_gpu_record_the_run_of_every_step(tmp_path, monkeypatch):
    for poison in (None, 5):
        runs = []
        for lag in (1, 16):
            monkeypatch.setattr(batched_run, "check_lag", lambda device, lag=lag: lag)
            out = tmp_path / f"gpu-{poison}-{lag}.h5"
            plan = resolve(
                parse_args(
                    [
                        *ARGS,
                        "--device",
                        "cuda",
                        "--backend",
                        "batched",
                        "--workers",
                        "4",
                        "--out",
                        str(out),
                    ]
                ),
                4,
            ).with_out(out)
            batched_run.run_batched(
                plan,
                out,
                "test",
                make_optimizer=BatchedOptimizer,
                make_algorithm=_poisoning(poison),
            )
            runs.append(read_run(out))
        assert runs[0].status == runs[1].status
        assert runs[0].attrs.get("diverged_step") == runs[1].attrs.get("diverged_step")
        for name, values in _numbers(runs[0]).items():
            np.testing.assert_array_equal(_numbers(runs[1])[name], values, err_msg=name)

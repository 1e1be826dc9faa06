"""The batched engine keeps the faster of its share of the CPUs and one thread, and its numbers do
not depend on the count; a busy machine is named in a warning."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from relaympi import threads
from relaympi.config import parse_args
from relaympi.engines.batched import threads as batched_threads
from relaympi.engines.batched.run import run_batched
from relaympi.results import read_run
from relaympi.threads import ThreadTiming, time_thread_counts
from relaympi.training.plan import resolve


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# -- timing the counts ----------------------------------------------------------------------------
def test_a_warm_up_round_is_not_counted_and_rounds_alternate_the_order():
    calls = []
    seconds = {4: [9.0, 0.5, 0.4, 0.6], 1: [9.0, 0.1, 0.3, 0.2]}

    def trial(count):
        calls.append(count)
        return seconds[count].pop(0)

    timing = time_thread_counts([4, 1], trial, rounds=3, clock=lambda: 0.0)
    assert calls == [4, 1, 4, 1, 1, 4, 4, 1]  # warm-up, then 4-1, 1-4, 4-1
    assert timing.seconds == {4: 0.5, 1: 0.2}  # medians of the counted rounds
    assert timing.fastest == 1


def test_no_round_begins_after_the_budget():
    now = iter([0.0, 0.1, 10.0])  # start, after round 1 (within), after round 2 (past)
    calls = []

    def measure(count: int) -> float:
        calls.append(count)
        return 1.0

    timing = time_thread_counts([2, 1], measure, rounds=5, budget_s=5.0, clock=lambda: next(now))
    assert calls == [2, 1, 2, 1, 1, 2]
    assert timing.seconds == {2: 1.0, 1: 1.0}


def test_ties_keep_the_first_candidate():
    assert ThreadTiming({2: 0.1, 1: 0.1}).fastest == 2
    assert ThreadTiming({2: 0.1, 1: 0.2}).fastest == 2


# -- choosing in the batched engine, with stand-ins -----------------------------------------------
class _Engine:
    """X [N, d]; the gradient may depend on the thread count (``skewed``)."""

    def __init__(self, skewed=False):
        self.X = torch.arange(12, dtype=torch.float32).view(3, 4)
        self.skewed = skewed

    def gradient(self, step):
        G = self.X * 0.5 + step
        if self.skewed:
            G = G + 1e-3 * torch.get_num_threads()
        return G, torch.zeros(3)


class _Algorithm:
    def __init__(self):
        self.steps = 0

    def step(self, X, G, lr, step):
        X.sub_(G * lr)
        self.steps += 1


def _timer(seconds):
    """A stand-in for time_thread_counts: runs each trial once, reports ``seconds``."""

    def timer(candidates, trial):
        for count in candidates:
            trial(count)
        return ThreadTiming({count: seconds[count] for count in candidates})

    return timer


def test_the_faster_count_is_kept_and_named():
    torch.set_num_threads(2)
    engine, algorithm = _Engine(), _Algorithm()
    X = engine.X.clone()
    chosen, why = batched_threads.choose_threads(
        engine, algorithm, 0.1, timer=_timer({2: 0.050, 1: 0.002})
    )
    assert (chosen, torch.get_num_threads()) == (1, 1)
    assert why == (
        "torch threads: 1 instead of 2, the faster here now (the first step took 50.0 ms with 2 "
        "threads, 2.0 ms with 1 thread); --threads N sets the count"
    )
    assert torch.equal(engine.X, X) and algorithm.steps == 0  # the trials ran on copies


def test_the_rules_count_is_kept_where_it_is_faster():
    torch.set_num_threads(2)
    assert batched_threads.choose_threads(
        _Engine(), _Algorithm(), 0.1, timer=_timer({2: 0.001, 1: 0.002})
    ) == (2, None)
    assert torch.get_num_threads() == 2


def test_the_rules_count_is_kept_where_the_counts_give_other_numbers():
    torch.set_num_threads(2)
    chosen = batched_threads.choose_threads(
        _Engine(skewed=True), _Algorithm(), 0.1, timer=_timer({2: 0.050, 1: 0.002})
    )
    assert chosen == (2, None) and torch.get_num_threads() == 2


def test_only_cpu_runs_without_threads_and_small_models_are_timed():
    torch.set_num_threads(2)
    small = torch.zeros(16, 4810)
    assert batched_threads.times_threads(small, None)
    assert not batched_threads.times_threads(small, 2)  # --threads given
    # not a CPU
    assert not batched_threads.times_threads(torch.zeros(16, 9_200_000, device="meta"), None)
    # 16 VGG-11s: 590 MiB (a view of one float, for its shape)
    big = torch.zeros(1).expand(16, 9_200_000)
    assert not batched_threads.times_threads(big, None)
    torch.set_num_threads(1)
    assert not batched_threads.times_threads(small, None)  # nothing to give up


# -- whole runs: the same numbers with 1 and 2 threads, and the count recorded ---------------------
RUNS = {
    "digits-relay": [
        "--task",
        "digits",
        "--algo",
        "relay",
        "--alpha",
        "0.01",
        "--steps",
        "24",
        "--eval-every",
        "12",
    ],
    "quadratics-relay-drops": [
        "--task",
        "quadratics",
        "--algo",
        "relay",
        "--topology",
        "double-binary-trees",
        "--drop-prob",
        "0.1",
        "--sigma2",
        "0.1",
        "--steps",
        "30",
        "--eval-every",
        "10",
        "--record-params",
    ],
}


def _run(args, out, count, workers=8):
    torch.set_num_threads(count)
    plan = resolve(
        parse_args([*args, "--backend", "batched", "--workers", str(workers), "--out", str(out)]),
        workers,
    )
    assert run_batched(plan.with_out(out), out, "test") == "completed"
    run = read_run(out)
    return {k: v for k, v in run.data.items() if not k.startswith("time")}, run.provenance[
        "torch_threads"
    ]


@pytest.mark.parametrize("name", RUNS)
def test_numbers_are_bit_identical_with_one_and_two_threads(tmp_path, monkeypatch, name):
    one, recorded_one = _run([*RUNS[name], "--threads", "1"], tmp_path / "one.h5", 1)
    two, recorded_two = _run([*RUNS[name], "--threads", "2"], tmp_path / "two.h5", 2)
    # the default, timed: one thread the faster here (so the run switches count before it starts)
    monkeypatch.setattr(batched_threads, "time_thread_counts", _timer({2: 0.050, 1: 0.002}))
    chosen, recorded_chosen = _run(RUNS[name], tmp_path / "chosen.h5", 2)
    assert (recorded_one, recorded_two, recorded_chosen) == (1, 2, 1)
    assert set(one) == set(two) == set(chosen)
    for key in one:
        np.testing.assert_array_equal(two[key], one[key], err_msg=key)
        np.testing.assert_array_equal(chosen[key], one[key], err_msg=key)


# -- a busy machine ------------------------------------------------------------------------------
def test_a_load_above_the_machines_cpus_is_named():
    assert threads.busy_machine(load=5.6, cpus=2) == (
        "this machine is busy: load average 5.6 on its 2 CPU(s), so other processes hold the "
        "cores; steps will be slower and timings noisier than on an idle machine"
    )
    assert threads.busy_machine(load=2.0, cpus=2) is None


def test_the_trainer_warns_of_a_busy_machine_once(monkeypatch, caplog):
    """Among the run's warnings, which rank 0 alone logs once every usage check passed."""
    from relaympi import train

    class _Plan:
        def warn(self) -> None:
            pass

    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    with caplog.at_level(logging.WARNING, logger="relaympi.train"):
        train._warn(_Plan())  # type: ignore[arg-type]
    busy = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
    assert busy == [f"warning: {threads.busy_machine(64.0)}"]

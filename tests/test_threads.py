"""torch's thread count follows the CPUs a process may run on (relaympi.threads), and the run file
records it."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest

from relaympi import threads
from relaympi.config import parse_args
from relaympi.results import read_run
from tests.conftest import ROOT, env_for_subprocess, module_command, requires_mpirun, train_command

NO_CAPS: dict[str, str] = {}  # an environment without OMP_NUM_THREADS / SLURM_CPUS_PER_TASK


# -- the rule -----------------------------------------------------------------------------------
def test_allowed_cpus_are_the_affinity_not_the_cpu_count(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert threads.allowed_cpus() == frozenset({3, 5})


def test_allowed_cpus_without_an_affinity_query_are_every_cpu(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert threads.allowed_cpus() == frozenset(range(6))


@pytest.mark.parametrize(
    "cpus, sharing, expected",
    [
        (range(4), 1, 4),  # one process on 4 allowed CPUs (of however many the node has)
        (range(4), 2, 2),  # two unbound ranks on the same 4
        (range(4), 3, 1),  # 4 // 3
        (range(2), 16, 1),  # 16 in-process workers on 2 CPUs: at least 1
        ([7], 1, 1),  # taskset -c 7
    ],
)
def test_default_is_the_share_of_the_allowed_cpus(cpus, sharing, expected):
    assert threads.default_threads(frozenset(cpus), sharing, env=NO_CAPS) == expected


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"OMP_NUM_THREADS": "3"}, 3),
        ({"OMP_NUM_THREADS": "64"}, 8),  # a cap, never a raise
        ({"SLURM_CPUS_PER_TASK": "2"}, 2),
        ({"OMP_NUM_THREADS": "4", "SLURM_CPUS_PER_TASK": "6"}, 4),  # the smaller cap
        ({"OMP_NUM_THREADS": "5,2"}, 5),  # one count per nesting level: the first
        ({"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "x"}, 8),  # not positive integers: ignored
        ({"OMP_NUM_THREADS": "0"}, 8),
    ],
)
def test_omp_num_threads_and_slurm_cpus_per_task_cap_the_default(env, expected):
    assert threads.default_threads(frozenset(range(8)), 1, env=env) == expected


def test_default_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert threads.default_threads(frozenset(range(8))) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.default_threads(frozenset(range(8))) == 8


@pytest.mark.parametrize(
    "mine, node, expected",
    [
        ({0, 1, 2, 3}, [{0, 1, 2, 3}] * 4, 4),  # unbound: 4 ranks share the job's CPUs
        # bound (--cpu-bind=cores): each its own share
        ({0, 1}, [{0, 1}, {2, 3}, {4, 5}, {6, 7}], 1),
        # bound to sockets, 2 per socket
        ({0, 1, 2, 3}, [{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}, {4, 5, 6, 7}], 2),
        ({0, 1}, [{0, 1}, {1, 2}], 2),  # overlapping sets compete for CPU 1
    ],
)
def test_sharers_are_the_node_local_ranks_on_overlapping_cpus(mine, node, expected):
    assert threads.sharers(mine, node) == expected
    assert threads.default_threads(
        frozenset(mine), threads.sharers(mine, node), env=NO_CAPS
    ) == max(1, len(mine) // expected)


# -- the trainer's choice -----------------------------------------------------------------------
def _chosen(argv, cpus, sharing, caplog):
    from relaympi import train

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="relaympi.train"):
        return train._threads(
            parse_args(["--backend", "batched", "--workers", "2", *argv]),
            0,
            frozenset(cpus),
            sharing,
        )


def test_threads_flag_above_the_share_warns_once(monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert _chosen([], {0}, 1, caplog) == 1 and not caplog.records
    assert _chosen(["--threads", "1"], {0}, 1, caplog) == 1 and not caplog.records
    assert _chosen(["--threads", "4"], {0, 1, 2, 3}, 1, caplog) == 4 and not caplog.records
    assert _chosen(["--threads", "2"], {0}, 1, caplog) == 2  # the flag wins, with one warning
    assert [r.getMessage() for r in caplog.records] == [
        "--threads 2 is more than the 1 CPU(s) each worker may use (1 CPU(s) this process "
        "may run on, shared by 1 worker(s)): "
        "the threads will compete for cores; leave --threads out for the default, 1"
    ]
    # 4 workers on 4 CPUs
    assert _chosen(["--threads", "2"], {0, 1, 2, 3}, 4, caplog) == 2 and len(caplog.records) == 1


# -- a real run ---------------------------------------------------------------------------------
needs_taskset = pytest.mark.skipif(
    shutil.which("taskset") is None or not hasattr(os, "sched_getaffinity"),
    reason="needs taskset and os.sched_getaffinity (Linux)",
)


def _train_on_cpu0(tmp_path, extra):
    out = tmp_path / "run.h5"
    env = {k: v for k, v in env_for_subprocess().items() if k not in threads.CAP_VARIABLES}
    cpu = min(os.sched_getaffinity(0))
    args = [
        "--task",
        "digits",
        "--backend",
        "batched",
        "--workers",
        "2",
        "--algo",
        "allreduce",
        "--steps",
        "2",
        "--eval-every",
        "2",
        *extra,
        "--out",
        out,
    ]
    cmd = ["taskset", "-c", str(cpu), *train_command(args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_run(out, datasets=()).provenance, proc.stderr


@pytest.mark.slow
@needs_taskset
def test_a_run_under_taskset_records_one_thread(tmp_path):
    provenance, stderr = _train_on_cpu0(tmp_path, [])
    assert (provenance["torch_threads"], provenance["cpus_allowed"]) == (1, 1)
    assert "--threads" not in stderr


@pytest.mark.slow
@needs_taskset
def test_a_run_with_threads_above_its_cpus_warns_and_records_them(tmp_path):
    provenance, stderr = _train_on_cpu0(tmp_path, ["--threads", "2"])
    assert (provenance["torch_threads"], provenance["cpus_allowed"]) == (2, 1)
    assert stderr.count("--threads 2 is more than the 1 CPU(s) each worker may use") == 1


@pytest.mark.spmd
def test_node_allgather_collects_every_rank_of_the_node():
    mpi = pytest.importorskip("mpi4py.MPI")
    from relaympi.comm.mpi import node_allgather

    rank, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    # one host
    assert node_allgather((rank, threads.allowed_cpus())) == [
        (r, threads.allowed_cpus()) for r in range(size)
    ]


@pytest.mark.slow
@requires_mpirun
def test_unbound_mpi_ranks_share_their_cpus(tmp_path):
    out = tmp_path / "run.h5"
    env = {k: v for k, v in env_for_subprocess().items() if k not in threads.CAP_VARIABLES}
    args = [
        "--task",
        "digits",
        "--algo",
        "allreduce",
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--out",
        out,
    ]
    cmd = train_command(args, mpi=2)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # mpirun binds nothing here: both ranks run on this process's CPUs, so each gets half
    assert read_run(out, datasets=()).provenance["torch_threads"] == threads.default_threads(
        threads.allowed_cpus(), 2, env=NO_CAPS
    )


@pytest.mark.slow
def test_engines_benchmark_runs_with_the_trainers_default_threads(tmp_path):
    env = {k: v for k, v in env_for_subprocess().items() if k not in threads.CAP_VARIABLES}
    cmd = module_command(
        "benchmarks.engines", "--workloads", "digits", "--engines", "batched", "--steps", "2"
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    header, row = proc.stdout.splitlines()[:2]
    recorded = dict(zip(header.split(), row.split(), strict=False))["threads"]
    # one process: all its CPUs, or one thread where the batched engine timed that faster
    assert int(recorded) in {threads.default_threads(threads.allowed_cpus(), 1, env=NO_CAPS), 1}

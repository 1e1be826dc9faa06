"""`python -m relaympi.train` end to end: contracts, both backends, resume, failures, bad input."""

# Long module: the trainer end to end: engines, resume, signals, run files

from __future__ import annotations

import os
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

from relaympi.results import read_run, run_status
from tests.conftest import ROOT, env_for_subprocess, requires_mpirun, run_module, train_command
from tests.conftest import run_train as train

# every test here runs the trainer in a subprocess, most of them for seconds
pytestmark = pytest.mark.slow

QUAD = [
    "--task",
    "quadratics",
    "--lr",
    "0.1",
    "--steps",
    "15",
    "--eval-every",
    "1",
    "--record-params",
    "--dim",
    "6",
]
DIGITS = ["--task", "digits", "--alpha", "0.1", "--steps", "24", "--eval-every", "6", "--seed", "3"]


# -- the quadratics contract ------------------------------------------------------------------
@pytest.mark.parametrize(
    "algo, topo",
    [
        ("relay", "chain"),
        ("relay", "double-binary-trees"),
        ("d2", "ring"),
        ("sgp", "exponential"),
        ("gt", "ring"),
    ],
)
def test_quadratics_run_file_matches_the_matrix_oracle(tmp_path, algo, topo):
    from relaympi.algorithms.matrix import make_matrix_algorithm
    from relaympi.optim import OptimizerConfig
    from relaympi.tasks import quadratics
    from relaympi.topology import build

    problem_file, out = tmp_path / "problem.h5", tmp_path / "run.h5"
    quadratics.generate(8, quadratics.QuadraticsSpec(dim=6, zeta2=1.0, r0=5.0), seed=4).save(
        problem_file
    )
    train(
        [
            "--backend",
            "local",
            "--workers",
            8,
            "--algo",
            algo,
            "--topology",
            topo,
            "--momentum",
            0,
            *QUAD,
            "--problem-file",
            problem_file,
            "--out",
            out,
        ],
        check=0,
    )
    run = read_run(out)
    assert run.status == "completed" and run.config["algo"] == algo
    params, steps = run.data["params"], run.data["step"]
    assert steps.tolist() == list(range(16)) and params.shape == (16, 8, 6)
    problem = quadratics.load(problem_file)
    engine = make_matrix_algorithm(algo, build(topo, 8), 8, np.zeros(6), OptimizerConfig())
    X = np.zeros((8, 6))
    np.testing.assert_array_equal(params[0], X)
    for t in range(15):
        X = engine.step(X, problem.gradients(X), 0.1, t)
        np.testing.assert_allclose(params[t + 1], X, rtol=0, atol=1e-10)
    np.testing.assert_allclose(run.data["suboptimality"][-1], problem.suboptimality(X), rtol=1e-9)


def test_save_problem_then_reuse(tmp_path):
    train(
        [
            "--backend",
            "local",
            "--workers",
            4,
            "--algo",
            "relay",
            "--topology",
            "chain",
            *QUAD,
            "--zeta2",
            3,
            "--save-problem",
            tmp_path / "p.h5",
            "--out",
            tmp_path / "a.h5",
        ],
        check=0,
    )
    with h5py.File(tmp_path / "p.h5") as f:
        assert f["A"].shape == (4, 6, 6) and f["b"].shape == (4, 6) and "f_star" in f.attrs
    train(
        [
            "--backend",
            "local",
            "--workers",
            4,
            "--algo",
            "relay",
            "--topology",
            "chain",
            *QUAD,
            "--problem-file",
            tmp_path / "p.h5",
            "--out",
            tmp_path / "b.h5",
        ],
        check=0,
    )
    np.testing.assert_array_equal(
        read_run(tmp_path / "a.h5").data["params"], read_run(tmp_path / "b.h5").data["params"]
    )


# -- both backends give the same numbers -------------------------------------------------------
@requires_mpirun
@pytest.mark.parametrize(
    "args",
    [
        ["--algo", "relay", *DIGITS],
        ["--algo", "dpsgd", "--momentum", "0.9", *DIGITS],
        [
            "--algo",
            "relay",
            "--topology",
            "chain",
            "--drop-prob",
            "0.1",
            "--relay-mode",
            "previous",
            *QUAD,
        ],
    ],
    ids=["digits-relay", "digits-dpsgd", "quadratics-relay-drops"],
)
def test_mpi_and_local_backends_agree(tmp_path, args):
    train(["--backend", "local", "--workers", 4, *args, "--out", tmp_path / "local.h5"], check=0)
    train([*args, "--out", tmp_path / "mpi.h5"], mpi=4, check=0)
    local, mpi = read_run(tmp_path / "local.h5"), read_run(tmp_path / "mpi.h5")
    assert (local.status, mpi.status) == ("completed", "completed")
    steps, every = int(args[args.index("--steps") + 1]), int(args[args.index("--eval-every") + 1])
    assert local.data["step"].tolist() == list(range(0, steps + 1, every))
    numbers = (
        "step",
        "epoch",
        "lr",
        "train_loss",
        "test_accuracy",
        "test_loss",
        "params",
        "bytes_sent",
        "suboptimality",
        "consensus_distance",
    )
    assert {"train_loss", "bytes_sent"} <= set(local.data) and set(local.data) == set(mpi.data)
    for key in numbers:
        if key in local.data:
            np.testing.assert_array_equal(local.data[key], mpi.data[key], err_msg=key)
    differ = {
        k
        for k in local.config.keys() | mpi.config.keys()
        if local.config.get(k) != mpi.config.get(k)
    }
    assert differ <= {"out", "workers", "backend"}, differ
    assert mpi.provenance["transport_backend"] == "mpi" and mpi.provenance["transport_mpi_library"]
    assert local.provenance["transport_backend"] == "local"
    if "test_accuracy" in local.data:  # digits: the report shows the worst worker's window mean
        accuracy = local.data["test_accuracy"]
        assert accuracy.shape == (len(local.data["step"]), 4)
        window = (local.data["epoch"] > local.data["epoch"].max() - 5) & (local.data["epoch"] > 0)
        proc = run_module("relaympi.report", tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        label = "D-PSGD + momentum ring" if "dpsgd" in args else "RelaySGD double-binary-trees"
        row = [*label.split(), f"{100 * accuracy[window].mean(axis=0).min():.1f}%"]
        assert row in [line.split() for line in proc.stdout.splitlines()], (row, proc.stdout)


def test_allreduce_workers_hold_identical_models(tmp_path):
    """All-reduce keeps every model identical: in-process ranks must not share RNG state while
    building models."""
    train(
        [
            "--backend",
            "local",
            "--workers",
            8,
            "--algo",
            "allreduce",
            "--task",
            "digits",
            "--alpha",
            "0.01",
            "--steps",
            60,
            "--eval-every",
            12,
            "--out",
            tmp_path / "a.h5",
        ],
        check=0,
    )
    run = read_run(tmp_path / "a.h5")
    for key in ("test_accuracy", "test_loss"):
        values = run.data[key]
        np.testing.assert_array_equal(
            values, np.repeat(values[:, :1], values.shape[1], axis=1), err_msg=key
        )


# -- preemption and resume ---------------------------------------------------------------------
def _run_and_terminate(cmd, after_line: str, env=None, timeout=240):
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**env_for_subprocess(), **(env or {})},
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout
    seen = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if after_line in line:
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(seen)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, "".join(seen) + err


@pytest.mark.parametrize("algo", ["relay", "d2"])
def test_sigterm_then_rerun_equals_uninterrupted_run(tmp_path, algo):
    args = [
        "--backend",
        "local",
        "--workers",
        4,
        "--algo",
        algo,
        "--task",
        "digits",
        "--alpha",
        "0.1",
        "--momentum",
        "0.9",
        "--steps",
        300,
        "--eval-every",
        10,
        "--seed",
        1,
    ]
    train([*args, "--out", tmp_path / "full.h5"], check=0)
    cmd = train_command(
        [*args, "--out", tmp_path / "resumed.h5", "--checkpoint-dir", tmp_path / "ckpt"]
    )
    code, log = _run_and_terminate(cmd, "step 100/300")
    assert code == 4, log
    assert run_status(tmp_path / "resumed.h5") == "preempted"
    assert (tmp_path / "ckpt" / "meta.json").exists()
    train(args + ["--out", tmp_path / "resumed.h5", "--checkpoint-dir", tmp_path / "ckpt"], check=0)
    full, resumed = read_run(tmp_path / "full.h5"), read_run(tmp_path / "resumed.h5")
    assert resumed.status == "completed" and resumed.attrs.get("resumed_at_steps")
    for key in ("step", "epoch", "train_loss", "test_loss", "test_accuracy", "bytes_sent", "lr"):
        np.testing.assert_array_equal(full.data[key], resumed.data[key], err_msg=key)


@requires_mpirun
def test_mpi_sigterm_checkpoint_and_resume(tmp_path):
    args = [
        "--algo",
        "relay",
        "--task",
        "quadratics",
        "--topology",
        "chain",
        "--steps",
        3000,
        "--lr",
        "0.05",
        "--eval-every",
        100,
        "--dim",
        6,
    ]
    train(["--backend", "local", "--workers", 2, *args, "--out", tmp_path / "full.h5"], check=0)
    cmd = train_command(
        [
            *args,
            "--out",
            tmp_path / "r.h5",
            "--checkpoint-dir",
            tmp_path / "ckpt",
            "--log-every",
            50,
        ],
        mpi=2,
    )
    code, log = _run_and_terminate(cmd, "step 200/3000")
    assert code != 0 and run_status(tmp_path / "r.h5") == "preempted", log
    train(
        [*args, "--out", tmp_path / "r.h5", "--checkpoint-dir", tmp_path / "ckpt"], mpi=2, check=0
    )
    np.testing.assert_array_equal(
        read_run(tmp_path / "full.h5").data["suboptimality"],
        read_run(tmp_path / "r.h5").data["suboptimality"],
    )


# -- failures ----------------------------------------------------------------------------------
@requires_mpirun
def test_sigkill_of_one_rank_ends_the_job(tmp_path):
    cmd = train_command(
        [
            "--task",
            "quadratics",
            "--algo",
            "relay",
            "--topology",
            "chain",
            "--steps",
            "100000000",
            "--eval-every",
            "1000",
            "--out",
            tmp_path / "k.h5",
        ],
        mpi=3,
    )
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env_for_subprocess(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while run_status(tmp_path / "k.h5") != "running":
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    time.sleep(1.0)
    pids = subprocess.run(
        ["pgrep", "-f", f"relaympi.train.*{tmp_path / 'k.h5'}"], capture_output=True, text=True
    ).stdout.split()
    victims = [int(p) for p in pids if int(p) != proc.pid]
    assert victims, "no rank processes found"
    killed_at = time.monotonic()
    os.kill(max(victims), signal.SIGKILL)
    code = proc.wait(timeout=60)
    assert code != 0 and time.monotonic() - killed_at < 60


@requires_mpirun
def test_exception_on_one_rank_fails_the_whole_job_and_is_recorded(tmp_path):
    start = time.monotonic()
    proc = train(
        [
            "--task",
            "quadratics",
            "--algo",
            "relay",
            "--topology",
            "chain",
            "--steps",
            100000,
            "--eval-every",
            1000,
            "--out",
            tmp_path / "f.h5",
        ],
        mpi=3,
        env={"RELAYMPI_INJECT_FAILURE": "2:50"},
        timeout=120,
    )
    assert proc.returncode != 0 and time.monotonic() - start < 90
    run = read_run(tmp_path / "f.h5")
    assert run.status == "failed" and "injected failure on rank 2 at step 50" in run.attrs["error"]


def test_exception_in_local_backend_is_recorded(tmp_path):
    proc = train(
        [
            "--backend",
            "local",
            "--workers",
            3,
            "--task",
            "quadratics",
            "--algo",
            "dpsgd",
            "--steps",
            100,
            "--out",
            tmp_path / "f.h5",
        ],
        env={"RELAYMPI_INJECT_FAILURE": "1:7"},
    )
    assert proc.returncode == 1
    run = read_run(tmp_path / "f.h5")
    assert run.status == "failed" and "rank 1" in run.attrs["error"]


def test_divergence_stops_cleanly(tmp_path):
    proc = train(
        [
            "--backend",
            "local",
            "--workers",
            4,
            "--task",
            "quadratics",
            "--algo",
            "dpsgd",
            "--lr",
            "50",
            "--steps",
            2000,
            "--eval-every",
            10,
            "--out",
            tmp_path / "d.h5",
        ]
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    run = read_run(tmp_path / "d.h5")
    assert run.status == "diverged" and 0 < run.attrs["diverged_step"] < 2000


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["--algo", "nope"], "invalid choice"),
        (["--alpha", "0"], "--alpha must be > 0"),
        (["--alpha", "-1"], "--alpha must be > 0"),
        (["--lr", "-0.1"], "--lr must be > 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--epochs", "2", "--steps", "3"], "either --epochs or --steps"),
        (["--task", "quadratics"], "need --steps"),
        (["--out", "/nonexistent-dir/run.h5"], "does not exist"),
        (["--topology", "moebius"], "unknown topology"),
        (["--algo", "relay", "--topology", "ring"], "not a tree"),
        (["--algo", "sgp", "--workers", "6"], "power of two"),
        (["--task", "cifar10", "--data-dir", "/nonexistent"], "not a readable directory"),
        (["--drop-prob", "1.5"], "--drop-prob"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input_exits_2_without_a_results_file(tmp_path, args, message):
    workers = [] if "--workers" in args else ["--workers", "4"]
    out = [] if "--out" in args else ["--out", tmp_path / "bad.h5"]
    length = [] if {"--epochs", "--steps"} & set(args) or "quadratics" in args else ["--steps", "2"]
    proc = train(["--backend", "local", *workers, *length, *args, *out])
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "bad.h5").exists()


def test_cifar10_without_files_says_what_is_expected(tmp_path):
    proc = train(
        [
            "--backend",
            "local",
            "--workers",
            2,
            "--task",
            "cifar10",
            "--data-dir",
            tmp_path,
            "--steps",
            3,
            "--out",
            tmp_path / "c.h5",
        ]
    )
    assert proc.returncode == 2 and "data_batch_1" in proc.stderr
    assert run_status(tmp_path / "c.h5") in ("missing",)


def test_world_size_one_says_how_to_launch():
    proc = train(["--task", "digits", "--steps", "2"])
    assert proc.returncode == 2 and "mpirun -n" in proc.stderr and "--backend local" in proc.stderr


def test_completed_run_is_not_overwritten(tmp_path):
    args = [
        "--backend",
        "local",
        "--workers",
        2,
        "--task",
        "quadratics",
        "--algo",
        "relay",
        "--topology",
        "chain",
        "--steps",
        5,
        "--out",
        tmp_path / "r.h5",
    ]
    train(args, check=0)
    before = (tmp_path / "r.h5").read_bytes()
    proc = train(args)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert (tmp_path / "r.h5").read_bytes() == before
    train([*args, "--overwrite"], check=0)


def test_config_file_round_trip(tmp_path):
    """A run file's whole config reproduces the run; a length on the command line replaces the
    file's."""
    args = [
        "--backend",
        "local",
        "--workers",
        2,
        "--task",
        "quadratics",
        "--algo",
        "relay",
        "--topology",
        "chain",
        "--steps",
        5,
        "--dim",
        4,
    ]
    train([*args, "--out", tmp_path / "a.h5"], check=0)
    config = read_run(tmp_path / "a.h5").config
    config.pop("out")
    (tmp_path / "c.json").write_text(__import__("json").dumps(config))
    train(["--config", tmp_path / "c.json", "--out", tmp_path / "b.h5"], check=0)
    np.testing.assert_array_equal(
        read_run(tmp_path / "a.h5").data["suboptimality"],
        read_run(tmp_path / "b.h5").data["suboptimality"],
    )
    train(["--config", tmp_path / "c.json", "--steps", 3, "--out", tmp_path / "c.h5"], check=0)
    assert read_run(tmp_path / "c.h5").data["step"][-1] == 3


@requires_mpirun
@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--overwrite"),  # the finished run file is only opened by rank 0
        # checked by rank 0 alone
        (["--save-problem", "/nonexistent-dir/p.h5", "--overwrite"], "does not exist"),
    ],
    ids=["finished-run", "save-problem"],
)
def test_rank0_only_usage_errors_end_every_rank(tmp_path, extra, message):
    args = [
        "--task",
        "quadratics",
        "--algo",
        "relay",
        "--topology",
        "chain",
        "--steps",
        5,
        "--out",
        tmp_path / "r.h5",
    ]
    train(args, mpi=2, check=0)
    start = time.monotonic()
    proc = train([*args, *extra], mpi=2, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and time.monotonic() - start < 60
    assert proc.stderr.count("error:") == 1


@requires_mpirun
def test_backend_local_under_mpirun_is_refused(tmp_path):
    proc = train(
        [
            "--backend",
            "local",
            "--workers",
            2,
            "--task",
            "quadratics",
            "--steps",
            3,
            "--out",
            tmp_path / "r.h5",
        ],
        mpi=2,
    )
    assert (
        proc.returncode == 2
        and "--backend local" in proc.stderr
        and not (tmp_path / "r.h5").exists()
    )


def test_overwrite_with_a_stale_checkpoint_starts_from_scratch(tmp_path):
    args = [
        "--backend",
        "local",
        "--workers",
        2,
        "--task",
        "quadratics",
        "--algo",
        "relay",
        "--topology",
        "chain",
        "--steps",
        40,
        "--eval-every",
        10,
        "--checkpoint-dir",
        tmp_path / "ckpt",
        "--out",
        tmp_path / "r.h5",
    ]
    train(args, check=0)
    assert (tmp_path / "ckpt" / "meta.json").exists()  # the last periodic checkpoint stays behind
    train([*args, "--overwrite"], check=0)
    assert read_run(tmp_path / "r.h5").data["step"].tolist() == [0, 10, 20, 30, 40]


def test_cifar10_contract_runs_on_generated_files(tmp_path):
    from tests.data_factories import write_cifar10_binary

    write_cifar10_binary(tmp_path / "data", n_per_batch=20)
    train(
        [
            "--task",
            "cifar10",
            "--data-dir",
            tmp_path / "data",
            "--backend",
            "local",
            "--workers",
            2,
            "--steps",
            3,
            "--out",
            tmp_path / "run.h5",
        ],
        check=0,
        timeout=600,
    )
    run = read_run(tmp_path / "run.h5")
    assert run.status == "completed" and run.data["test_accuracy"].shape[1] == 2
    assert ((0 <= run.data["test_accuracy"]) & (run.data["test_accuracy"] <= 1)).all()

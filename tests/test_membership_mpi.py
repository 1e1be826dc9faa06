"""--on-failure continue on real MPI processes (Open MPI with ULFM, scripts/mpirun-ulfm): a rank
that dies (it SIGKILLs itself at a step, or a kill loop kills it at a random moment) leaves
survivors whose every number equals the in-process engine's replay of the same loss; under MPICH
the flag is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from benchmarks.kill_loop import differences
from relaympi.algorithms.registry import COLLECTIVE, communication
from relaympi.results import read_run
from tests.conftest import (
    PY,
    ROOT,
    ULFM_MPIRUN,
    requires_mpirun,
    requires_ulfm,
    run_train,
    run_ulfm,
)

pytestmark = [pytest.mark.slow, pytest.mark.ulfm]

QUAD = ["--task", "quadratics", "--steps", "16", "--eval-every", "1", "--record-params"]


def _mpi(ranks: int, args: list, env: dict, timeout: float = 480) -> subprocess.CompletedProcess:
    """The trainer on ``ranks`` Open MPI processes with ULFM, ``env``'s variables passed to them
    (the launcher's exit is no verdict on a run that lost a rank)."""
    passed = [arg for name in env for arg in ("-x", name)]
    train = [PY, "-m", "relaympi.train", *args]
    return run_ulfm([*passed, "-x", "PYTHONPATH", *train], ranks, env=env, timeout=timeout)


def _membership(path) -> list[tuple[int, list[int], int]]:
    with h5py.File(path) as f:
        records = json.loads(f.attrs["membership"])
    return [(r["step"], sorted(r["lost"]), r["world_size"]) for r in records]


CASES = [
    ("relay", "2:6", []),
    ("relay-grad", "0:5", []),  # the run file's writer is lost: the lowest survivor takes it over
    ("dpsgd", "1:7", []),
    ("qgm", "3:4", ["--momentum", "0.9"]),
    ("d2", "2:6", []),
    ("gt", "1:3,2:9", []),
    ("sgp", "3:6", []),
    ("allreduce", "0:8", []),
    ("relay", "2:6,3:6", ["--ranks-per-node", "2"]),  # a whole (emulated) node
]


@requires_ulfm
@pytest.mark.parametrize("algo, inject, extra", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_killed_rank_leaves_survivors_equal_to_the_local_replay(tmp_path, algo, inject, extra):
    env = {"RELAYMPI_INJECT_FAILURE": inject}
    mpi_out, local_out = tmp_path / "mpi.h5", tmp_path / "local.h5"
    args = [*QUAD, "--algo", algo, *extra, "--on-failure", "continue"]
    proc = _mpi(4, [*args, "--out", mpi_out], env)
    run = read_run(mpi_out)
    assert run.status == "completed", proc.stdout + proc.stderr[-3000:]
    lost = len(inject.split(","))
    assert f"{4 - lost} of 4 workers finished" in proc.stdout
    run_train(
        [*args, "--backend", "local", "--workers", 4, "--out", local_out],
        env=env,
        check=0,
    )
    assert _membership(mpi_out) == _membership(local_out)
    if communication(algo) != COLLECTIVE:
        assert differences(mpi_out, local_out) == []
        return
    # the collective all-reduce sums in MPI's order on MPI, in rank order in-process: equal to
    # rounding (as without a loss); everything else exactly
    mpi, local = read_run(mpi_out).data, read_run(local_out).data
    assert set(differences(mpi_out, local_out)) <= {
        f"{name}: values differ"
        for name in ("params", "suboptimality", "train_loss", "consensus_distance")
    }
    for name in ("params", "suboptimality", "train_loss"):
        np.testing.assert_allclose(mpi[name], local[name], rtol=1e-12, atol=1e-12)


@requires_ulfm
def test_the_kill_loop_kills_at_random_moments_and_the_replay_is_identical(tmp_path):
    """Ranks killed from outside, anywhere in a step, until half remain: the run completes, records
    exactly the killed ranks, and equals the in-process replay of its recorded losses."""
    out = tmp_path / "kill.h5"
    env = {**os.environ, "RELAYMPI_OPENMPI": os.environ.get("RELAYMPI_OPENMPI", "")}
    if not env["RELAYMPI_OPENMPI"]:
        del env["RELAYMPI_OPENMPI"]
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "benchmarks.kill_loop",
        *("--every", "12", "--seed", "3", "--replay", "--json", str(tmp_path / "k.json")),
        "--",
        *(str(ULFM_MPIRUN), "-n", "6", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"),
        *(sys.executable, "-m", "relaympi.train", "--task", "quadratics", "--algo", "relay"),
        *("--topology", "double-binary-trees", "--steps", "90", "--eval-every", "3"),
        *("--record-params", "--on-failure", "continue", "--out", str(out)),
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "k.json").read_text())
    assert len(result["killed"]) == 3 and result["status"] == "completed"
    assert result["recorded_equals_killed"] and result["replay_differences"] == []


@requires_mpirun
@pytest.mark.mpirun
def test_mpich_refuses_continue_in_one_line(tmp_path):
    proc = run_train(
        [*QUAD, "--on-failure", "continue", "--out", tmp_path / "r.h5"], mpi=2, check=2
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--on-failure continue" in lines[0] and "MPICH" in lines[0]
    assert "setup.sh --mpi openmpi" in lines[0]
    assert not (tmp_path / "r.h5").exists()

"""--on-failure continue at its edges: survivors that cannot go on end as a recorded failure
(exit status 1, not 2), in one line, on the in-process engine and on MPI; a topology that could
not be rebuilt after any loss is still refused at the start (a misuse)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaympi.config import ConfigError, RunConfig
from relaympi.results import read_run
from relaympi.training.membership import check_heals
from relaympi.training.plan import resolve
from tests.conftest import PY, requires_ulfm, run_train, run_ulfm

QUAD = ["--task", "quadratics", "--algo", "relay", "--steps", "16", "--eval-every", "2"]
ONE_LEFT = "cannot be built again over the 1 surviving workers"


def _check_one_line_failure(proc, out: Path) -> None:
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    failed = [line for line in proc.stderr.splitlines() if line.startswith("failed:")]
    assert len(failed) == 1 and ONE_LEFT in failed[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    run = read_run(out)
    assert run.status == "failed" and ONE_LEFT in run.attrs["error"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "batched"])
def test_all_but_one_lost_in_process_is_a_recorded_failure(tmp_path: Path, backend: str) -> None:
    out = tmp_path / "run.h5"
    proc = run_train(
        [*QUAD, "--backend", backend, "--workers", "4", "--on-failure", "continue", "--out", out],
        env={"RELAYMPI_INJECT_FAILURE": "1:3,2:6,3:9"},
    )
    _check_one_line_failure(proc, out)


@pytest.mark.slow
@requires_ulfm
def test_all_but_one_lost_on_mpi_is_a_recorded_failure(tmp_path: Path) -> None:
    out = tmp_path / "run.h5"
    train = [PY, "-m", "relaympi.train", *QUAD, "--on-failure", "continue", "--out", out]
    env = {"RELAYMPI_INJECT_FAILURE": "1:5"}
    proc = run_ulfm(["-x", "PYTHONPATH", "-x", *env, *train], 2, env=env, timeout=240)
    _check_one_line_failure(proc, out)


def test_a_topology_no_loss_could_rebuild_is_refused_at_the_start(tmp_path: Path) -> None:
    edges = tmp_path / "chain.txt"
    edges.write_text("0 1\n1 2\n2 3\n")
    cfg = RunConfig(
        task="quadratics", backend="local", workers=4, topology=f"edge-list:{edges}", steps=4
    )
    with pytest.raises(ConfigError, match="cannot be built again over the 3 surviving"):
        check_heals(resolve(cfg, 4))

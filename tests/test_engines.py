"""The engine table (relaympi.engines): every --backend has one engine; looking one up, resolving a
plan
and checking a message-passing plan load no engine; the batched check loads its model check alone
and refuses what
the batched engine cannot run; jobs validate through the table; and the shared loop (TrainingLoop)
alone starts, checkpoints, restores, injects failures and records them, for both engines."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from relaympi import config, engines
from relaympi.config import ConfigError, parse_args
from relaympi.engines.batched.run import BatchedRun
from relaympi.engines.message_passing import MessagePassingRank
from relaympi.training.loop import TrainingLoop
from relaympi.training.plan import resolve
from tests.conftest import ROOT, env_for_subprocess


def test_every_backend_has_one_engine() -> None:
    assert tuple(engines.BACKENDS) == config.BACKENDS
    assert {name: b.engine for name, b in engines.BACKENDS.items()} == {
        "mpi": "message-passing",
        "local": "message-passing",
        "batched": "batched",
    }
    assert (
        engines.engine_for("mpi")
        is engines.engine_for("local")
        is engines.ENGINES["message-passing"]
    )
    with pytest.raises(KeyError, match="unknown backend 'gpu'; choose one of mpi, local, batched"):
        engines.engine_for("gpu")


def test_jobs_take_the_backends_from_the_table() -> None:
    from jobs import commands

    assert commands.BACKENDS is engines.BACKENDS


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["mpi", "local", "batched"], ids=["ranks", "threads", "stacked"]
)
def test_resolving_and_checking_load_no_engine_but_the_checked_one(backend: str) -> None:
    """The plan imports no engine (before, it loaded the batched engine's models and torch.func on
    every plan); a message-passing check loads nothing, a batched one its model check alone."""
    workers = "" if backend == "mpi" else ", '--workers', '4'"
    code = (
        "import sys\n"
        "from relaympi.config import parse_args\n"
        "from relaympi.training.plan import resolve\n"
        "from relaympi import engines\n"
        f"plan = resolve(parse_args(['--task', 'digits', '--backend', '{backend}'{workers}]), 4)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('relaympi.batched', "
        "'relaympi.engines.'))))\n"
        "engines.check(plan)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('relaympi.batched', "
        "'relaympi.engines.'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env_for_subprocess(),
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    after_resolve, after_check = proc.stdout.splitlines()
    assert after_resolve == "[]"
    loaded = ast.literal_eval(after_check)
    assert ("relaympi.engines.batched.models" in loaded) == (backend == "batched")
    assert (
        "relaympi.engines.batched.run" not in loaded
        and "relaympi.engines.message_passing" not in loaded
    )


def test_the_batched_check_refuses_a_task_the_engine_cannot_run(tmp_path) -> None:
    args = [
        "--task",
        "agnews",
        "--data-dir",
        str(tmp_path),
        "--model-dir",
        str(tmp_path),
        "--workers",
        "2",
    ]
    # resolving alone refuses nothing of an engine's
    plan = resolve(parse_args([*args, "--backend", "batched"]), 2)
    with pytest.raises(
        ConfigError,
        match="--backend batched cannot run task 'agnews': its model takes structured inputs",
    ):
        engines.check(plan)
    engines.check(resolve(parse_args([*args, "--backend", "local"]), 2))  # message passing runs it


def test_start_state_restore_and_failures_live_in_the_shared_loop() -> None:
    """Neither engine's loop defines its own start, checkpoint state, restore, injected failure or
    run."""
    shared = ("start", "state", "restore", "injected_failure", "run", "check_injection")
    for engine_loop in (MessagePassingRank, BatchedRun):
        assert issubclass(engine_loop, TrainingLoop)
        assert not [name for name in shared if name in vars(engine_loop)], engine_loop
    # recorded once, for every engine
    assert {"record_failure", "close_quietly"} <= set(TrainingLoop.run.__code__.co_names)


@pytest.mark.parametrize("backend", ["local", "batched"])
def test_an_injected_failure_of_no_worker_is_refused_by_both_engines(
    backend, tmp_path, monkeypatch, capsys
) -> None:
    """One rule in the shared loop: RELAYMPI_INJECT_FAILURE naming no worker exits 2 (message
    passing
    used to run to completion without failing)."""
    from relaympi import train
    from relaympi.training.membership import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "5:1")
    out = tmp_path / "r.h5"
    status = train.main(
        [
            "--task",
            "digits",
            "--backend",
            backend,
            "--workers",
            "2",
            "--steps",
            "2",
            "--out",
            str(out),
        ]
    )
    noun = "rank" if backend == "local" else "worker"
    assert status == train.EXIT_USAGE
    assert f"{FAULT_ENV} names {noun} 5, but the run has {noun}s 0..1" in capsys.readouterr().err

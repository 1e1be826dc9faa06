"""The engines that run a resolved plan, and the --backend values that choose them: a torch-free
table.

    message-passing  one worker per rank, exchanging messages over a Communicator: MPI ranks
                     (--backend mpi) or threads of this process (--backend local)
    batched          every worker as one stacked computation on one device (--backend batched)

An engine is two functions: ``check(plan)``, what it refuses before any data loads, and
``run(plan, out, command, comm=None)``, the run (its status: completed, diverged or preempted).
Each imports what it needs when it is called, never to look an engine up: resolving a plan
(relaympi.training.plan) loads no engine, and checking one loads only its engine's check. A new
engine is a module with its run, two functions here and one line in ENGINES (and its --backend in
BACKENDS and relaympi.config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relaympi.registry import Registry

if TYPE_CHECKING:
    from relaympi.training.plan import Plan


def _message_passing_check(plan: Plan) -> None:
    """Message passing runs every task, algorithm and topology a plan resolves to."""


def _message_passing_run(plan: Plan, out: Path, command: str, comm: Any = None) -> str:
    from relaympi.engines.message_passing import run

    return run(plan, out, command, comm)


def _batched_check(plan: Plan) -> None:
    from relaympi.engines.batched.models import refuse_unsupported

    refuse_unsupported(plan.task)  # what the task's class tells (its model is checked once built)


def _batched_run(plan: Plan, out: Path, command: str, comm: Any = None) -> str:
    from relaympi.engines.batched.run import run

    return run(plan, out, command, comm)


@dataclass(frozen=True)
class Engine:
    """One way to run a plan."""

    name: str
    check: Callable[
        [Plan], None
    ]  # refuse (ConfigError) a plan this engine cannot run, before any data loads
    # train the plan, recording it in `out`; comm: this MPI rank's Communicator (None: every worker
    # runs in this process); returns the run's status
    run: Callable[..., str]


ENGINES: Registry[Engine] = Registry(
    "engine",
    {
        "message-passing": Engine("message-passing", _message_passing_check, _message_passing_run),
        "batched": Engine("batched", _batched_check, _batched_run),
    },
)


@dataclass(frozen=True)
class Backend:
    """A --backend value: the engine it runs, and where the workers live."""

    engine: str
    in_process: bool  # every worker in this one process (False: one worker per MPI rank)
    # in process: the workers compute at once, sharing its CPUs (False: as one computation)
    threads_per_worker: bool


BACKENDS: Registry[Backend] = Registry(
    "backend",
    {
        "mpi": Backend("message-passing", in_process=False, threads_per_worker=False),
        "local": Backend("message-passing", in_process=True, threads_per_worker=True),
        "batched": Backend("batched", in_process=True, threads_per_worker=False),
    },
)


def engine_for(backend: str) -> Engine:
    """The engine that --backend ``backend`` runs (KeyError naming the backends for another)."""
    return ENGINES[BACKENDS[backend].engine]


def check(plan: Plan) -> None:
    """Refuse (ConfigError) a plan its backend's engine cannot run (what ``resolve`` leaves to the
    engine)."""
    engine_for(plan.cfg.backend).check(plan)

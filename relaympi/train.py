"""Train with a decentralized algorithm and record the run in one HDF5 file.

Launch one worker per MPI rank, all workers as threads of one process, or all workers as one
batched computation (stacked models on one device; the fastest way to sweep):

    python -m relaympi.data fetch cifar10       # once: into $RELAYMPI_DATA or ~/.cache/relaympi
    mpirun -n 16 python -m relaympi.train --algo relay --task cifar10
    python -m relaympi.train --task digits --backend local --workers 16 --algo relay --alpha 0.01
    python -m relaympi.train --task digits --backend batched --workers 16 --algo relay --alpha 0.01
    python -m relaympi.train --task quadratics --backend local --workers 8 --steps 20

Exit status: 0 completed, 1 failed, 2 misuse, 3 diverged (recorded), 4 preempted (SIGTERM,
SIGUSR1 or Ctrl-C/SIGINT; checkpoint saved: the same command resumes), 5 stopped by such a signal
without a checkpoint (no --checkpoint-dir: a rerun starts over).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from relaympi import threads
from relaympi.config import ConfigError, RunConfig, parse_args
from relaympi.config.validation import check_out_path, check_world_size
from relaympi.engines import BACKENDS, engine_for
from relaympi.launcher import launch
from relaympi.tasks import TaskError
from relaympi.tasks.quadratics import QuadraticsTask
from relaympi.training.out_file import check_out, refuse_finished_run

# torch, MPI and the training modules (which import torch) are imported inside the functions that
# need them: under mpirun every rank imports them, 80 s with 16 ranks on one node, and misuse is
# refused before (parse_args and --help are torch-free; main's _refuse_before_loading checks --out,
# check_world_size the topology against the worker count)
if TYPE_CHECKING:
    from relaympi.training.plan import Plan

log = logging.getLogger("relaympi.train")

EXIT_COMPLETED, EXIT_FAILED, EXIT_USAGE, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_STOPPED = (
    0,
    1,
    2,
    3,
    4,
    5,
)
EXIT_INTERRUPTED = 130  # a second Ctrl-C: exit at once, as a shell reports SIGINT


_first_stop_at: list[float] = []


def _request_stop(signum: int, frame: Any) -> None:
    """Stop at the next step boundary (checkpoint, record, exit); a second Ctrl-C (not one a
    launcher forwards within a second of the first) exits at once."""
    if signum == signal.SIGINT and _first_stop_at and time.monotonic() - _first_stop_at[0] > 1.0:
        os.write(
            2,
            b"interrupted again: exiting at once, without a checkpoint (the run file "
            b"stays 'running')\n",
        )
        os._exit(EXIT_INTERRUPTED)
    if not _first_stop_at:
        _first_stop_at.append(time.monotonic())
    from relaympi.training.loop import STOP

    STOP.set()


class BarSafeHandler(logging.StreamHandler):
    """Log lines written through tqdm.write: it lifts the progress bar off the line, prints the
    message on a line of its own and redraws the bar below (a plain write would land on the bar's
    line)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _save_problem(plan: Plan) -> None:
    """Write --save-problem; an existing file is replaced only with --overwrite (others may train
    on it).

    A file that already holds exactly this problem is left as it is, so re-running the command
    (to resume after preemption) works without --overwrite.
    """
    path = plan.cfg.save_problem
    if path is None or plan.problem is None:
        return
    path = Path(path)
    if not path.resolve().parent.is_dir():
        raise ConfigError(f"--save-problem {path}: its directory does not exist")
    if path.exists() and not plan.cfg.overwrite:
        if QuadraticsTask.holds(path, plan.problem):
            return
        raise ConfigError(
            f"--save-problem {path} already exists and holds another problem (other runs "
            "may use it); "
            "choose another file, or pass --overwrite to replace it"
        )
    plan.problem.save(path)


_EXIT = {"completed": EXIT_COMPLETED, "diverged": EXIT_DIVERGED, "preempted": EXIT_PREEMPTED}


def _finish(cfg: RunConfig, out: Path, status: str) -> int:
    """Print the run's summary line; the exit status (a stop without a checkpoint is not
    'preempted')."""
    from relaympi.training.run_file import print_summary

    print_summary(out, status, cfg.checkpoint_dir)
    if status == "preempted" and cfg.checkpoint_dir is None:
        return EXIT_STOPPED
    return _EXIT[status]


def _configure(cfg: RunConfig, rank: int, cpus: frozenset[int], sharing: int) -> None:
    """Logging, signals and torch's threads: `sharing` processes (or in-process workers) compute on
    `cpus`."""
    import torch

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=[BarSafeHandler(sys.stderr)],
    )
    torch.set_num_threads(_threads(cfg, rank, cpus, sharing))
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGUSR1, _request_stop)
    # Ctrl-C stops like SIGTERM: checkpoint, record, exit 4
    signal.signal(signal.SIGINT, _request_stop)


def _warn(plan: Plan) -> None:
    """The run's warnings (rank 0), once every usage check passed: a usage error says only what is
    wrong."""
    if (busy := threads.busy_machine()) is not None:
        log.warning("warning: %s", busy)
    plan.warn()


def _threads(cfg: RunConfig, rank: int, cpus: frozenset[int], sharing: int) -> int:
    """--threads, or relaympi.threads' rule; more than this worker's share of `cpus` warns (rank 0,
    one line)."""
    default = threads.default_threads(cpus, sharing)
    if cfg.threads is None:
        return default
    allowed = threads.share(cpus, sharing)
    if cfg.threads > allowed and rank == 0:
        log.warning(
            "--threads %d is more than the %d CPU(s) each worker may use (%d CPU(s) this "
            "process may run on, shared by %d "
            "worker(s)): the threads will compete for cores; leave --threads out for the "
            "default, %d",
            cfg.threads,
            allowed,
            len(cpus),
            sharing,
            default,
        )
    return cfg.threads


def _resolve(cfg: RunConfig, size: int, nodes: Any = None) -> Plan:
    """The run's plan; a rerun on exactly the survivors of a run that lost workers resumes them:
    the plan of the run's first count, with the survivors' ids as its members."""
    from relaympi.training.membership import survivors_resume
    from relaympi.training.plan import resolve

    survivors = survivors_resume(cfg, size)
    if survivors is None:
        return resolve(cfg, size, nodes)
    first, members, first_nodes = survivors
    return replace(resolve(cfg, first, first_nodes), members=members)


def _one_process_plan(cfg: RunConfig) -> tuple[Plan, Path]:
    """The plan of a run whose workers all live in this process, and its run file's path."""
    from relaympi.training.plan import default_out

    assert cfg.workers is not None  # validate() requires --workers for such a run
    plan = _resolve(cfg, cfg.workers)
    engine_for(cfg.backend).check(plan)
    plan.task.check_data(plan.task_options)
    out = Path(cfg.out) if cfg.out else default_out(plan.cfg, plan.world_size)
    check_out(out, cfg.overwrite, plan)
    plan = plan.with_out(out)
    _save_problem(plan)
    return plan, out


def _main_in_process(cfg: RunConfig, argv: list[str]) -> int:
    assert cfg.workers is not None  # validate() requires --workers for such a run
    # threads computing at once share this process's CPUs; one batched computation uses all of them
    _configure(
        cfg,
        0,
        threads.allowed_cpus(),
        cfg.workers if BACKENDS[cfg.backend].threads_per_worker else 1,
    )
    plan, out = _one_process_plan(cfg)
    _warn(plan)
    status = engine_for(cfg.backend).run(plan, out, _rerun_command(argv))
    return _finish(cfg, out, status)


def _main_mpi(cfg: RunConfig, argv: list[str]) -> int:
    if cfg.peer_timeout is not None:  # Open MPI's failure detector: read by MPI_Init, set first
        from relaympi.comm.stalls import enable_detector

        enable_detector(cfg.peer_timeout)
    from relaympi.comm import DropPolicy, mpi_communicator

    # lazy: the only mpi4py importer; --backend local runs never load MPI
    from relaympi.comm.mpi import node_allgather, world_size
    from relaympi.training.loop import USAGE_ERRORS
    from relaympi.training.membership import HealError, startup_failure
    from relaympi.training.plan import default_out, run_nodes

    size = world_size()
    # `mpirun -n 1` is the single-worker baseline; plain python is a mistake
    if size == 1 and not launch().launched:
        raise ConfigError(
            "this is one process, so there is only one worker. Launch one worker per rank: "
            "`mpirun -n 16 python -m relaympi.train ...` (or srun under SLURM), or run "
            "all workers in this "
            "process with `--backend local --workers 16`; a single-worker baseline runs as "
            "`mpirun -n 1 python -m relaympi.train --algo allreduce ...` or `--backend "
            "local --workers 1 --algo allreduce`"
        )
    # --ranks-per-node emulates nodes (recorded as emulated); else the nodes MPI placed the ranks on
    emulated = run_nodes(cfg, size) if cfg.ranks_per_node is not None else None
    with _failure_ends_the_job():
        comm = mpi_communicator(drops=DropPolicy(cfg.drop_prob, cfg.seed), nodes=emulated)
        failure = startup_failure(comm.rank)  # RELAYMPI_INJECT_FAILURE=RANK:0:startup
        if failure is not None:
            raise RuntimeError(failure)
        # bound ranks (srun --cpu-bind, mpirun -bind-to) each keep their own CPUs; unbound ones
        # share theirs
        cpus = threads.allowed_cpus()
        _configure(cfg, comm.rank, cpus, threads.sharers(cpus, node_allgather(cpus)))
        error = None
        try:
            if cfg.on_failure == "continue":  # the same library on every rank: all refuse alike
                from relaympi.comm.mpi import fault_tolerance_missing

                missing = fault_tolerance_missing()
                if missing is not None:
                    raise ConfigError(f"--on-failure continue: {missing}")
            plan = _resolve(cfg, size, comm.nodes)
            engine_for(cfg.backend).check(plan)
            plan.task.check_data(plan.task_options)  # every rank: each node needs the data
            out = Path(cfg.out) if cfg.out else default_out(plan.cfg, size)
            if comm.rank == 0:
                check_out(out, cfg.overwrite, plan)
            plan = plan.with_out(out)
            if comm.rank == 0:
                _save_problem(plan)
        except (ConfigError, TaskError) as exc:
            error = exc
        # every rank must agree to stop: one that went on would wait for the others forever
        flags = comm.allreduce_flags(
            np.array([1.0 if error else 0.0, 1.0 if error and comm.rank == 0 else 0.0])
        )
    if flags[0] > 0:
        # one copy of the message where possible
        if error is not None and (comm.rank == 0 or flags[1] == 0):
            print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if comm.rank == 0:
        _warn(plan)
    try:
        status = engine_for(cfg.backend).run(plan, out, _rerun_command(argv, size), comm)
    except USAGE_ERRORS as exc:
        if comm.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except HealError as exc:  # every survivor found the same; the writer recorded it
        while comm.successor is not None:
            comm = comm.successor
        if comm.rank == 0:
            print(f"failed: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)  # healed: MPI_Finalize can hang with a dead process in the world
    except BaseException as exc:  # noqa: BLE001 - tear the whole job down: no rank may wait forever
        print(f"rank {comm.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if comm.rank != 0:
            # let rank 0 record the failure first; it aborts the job when it sees it
            time.sleep(5.0)
        comm.abort(EXIT_FAILED)
        return EXIT_FAILED
    healed = comm.successor is not None
    while comm.successor is not None:  # the survivors' communicator after a lost rank
        comm = comm.successor
    code = (
        _finish(cfg, out, status)
        if comm.rank == 0
        else (
            EXIT_STOPPED if status == "preempted" and cfg.checkpoint_dir is None else _EXIT[status]
        )
    )
    if healed or cfg.on_failure == "continue":
        # MPI_Finalize with a dead process in the world can hang (Open MPI 5 with ULFM, measured in
        # 3 of 14 runs), and a rank lost after the end agreement would leave one there: every rank
        # agreed that the run is over and the run file is closed, so end here without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


@contextlib.contextmanager
def _failure_ends_the_job() -> Iterator[None]:
    """A failure of this rank while the job starts (not a misuse, which every rank finds and
    refuses alike) ends the whole job with MPI_Abort: the other ranks wait for this one in the
    start-up's collectives, and a return would leave this one waiting in MPI_Finalize for them."""
    try:
        yield
    except (ConfigError, TaskError):
        raise
    except Exception as exc:  # noqa: BLE001 - no rank may wait forever for this one
        print(
            f"failed: rank {launch().rank}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(EXIT_FAILED)
        sys.stderr.flush()
        os._exit(EXIT_FAILED)  # MPICH's Abort may return once it has told the launcher


def _rerun_command(argv: list[str], mpi_ranks: int | None = None) -> str:
    """The command that runs this again (recorded in provenance.command): the module, not a file
    path."""
    launcher = ["mpirun", "-n", str(mpi_ranks)] if mpi_ranks else []
    return shlex.join([*launcher, "python", "-m", "relaympi.train", *argv])


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m relaympi.train`` with these arguments: one training run, recorded in one
    run file (the module's docstring shows the three ways to launch it).

    Args:
        argv: the command line after the program name; None: ``sys.argv[1:]``.

    Returns:
        The exit status: 0 completed, 1 failed, 2 misuse (a one-line error on stderr), 3
        diverged, 4 preempted (checkpoint saved), 5 stopped without a checkpoint.

    Example:
        ```python
        main(["--task", "digits", "--backend", "local", "--workers", "4", "--steps", "30",
              "--out", "results/demo.h5"])  # 0
        ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _refuse_before_loading(argv)
        cfg = parse_args(argv)
        if BACKENDS[cfg.backend].in_process:
            if launch().size > 1:
                raise ConfigError(
                    f"--backend {cfg.backend} runs all workers in one process, but this "
                    f"is one of {launch().size} MPI ranks: "
                    "drop --backend/--workers under mpirun/srun, or run the command without mpirun"
                )
            assert cfg.workers is not None  # validate() requires --workers for such a run
            check_world_size(cfg, cfg.workers)
            return _main_in_process(cfg, argv)
        if launch().launched:  # a plain `python` run is refused as one process in _main_mpi
            check_world_size(cfg, launch().size)
        return _main_mpi(cfg, argv)
    except BrokenPipeError:  # `... --help | head`: the reader left; entrypoint.run ends quietly
        raise
    except Exception as exc:  # noqa: BLE001 - misuse, a full disk or a failure: _exit_status says
        return _exit_status(exc)


def _refuse_before_loading(argv: list[str]) -> None:
    """Refuse (ConfigError) a bad --out on the command line before anything loads torch (under
    mpirun every rank does, 80 s with 16 ranks on one node), and before the other flags' checks:
    its folder missing, a name without .h5, or a file this run may not replace (a finished run
    without --overwrite, unless a --config file may allow it; the plan would find that only after
    torch). Every rank checks alike, so all refuse together; the full parse and the plan check
    again (--out from a --config file, a preempted run's configuration)."""
    if "-h" in argv or "--help" in argv:
        return
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("--out")
    early.add_argument("--overwrite", action="store_true")
    early.add_argument("--config")
    try:
        known, _ = early.parse_known_args(argv)
    except argparse.ArgumentError:  # `--out` without its value: the full parse says so
        return
    if known.out is not None:
        check_out_path(known.out)
        if known.config is None:  # a --config file may say overwrite
            refuse_finished_run(Path(known.out), known.overwrite)


def _exit_status(exc: Exception) -> int:
    """Say why the run ended with ``exc``, in one line where that is the whole story; the exit
    status: 2 misuse (rank 0 alone prints: every rank found the same error), 1 a failure."""
    if not isinstance(exc, (ConfigError, TaskError)):
        # imported only here: their modules load torch, which a refusal need not wait for
        from relaympi.training.loop import USAGE_ERRORS
        from relaympi.training.membership import HealError
        from relaympi.training.run_file import WRITE_ERRORS

        # a full disk, or survivors that cannot go on: the reason is the whole story (recorded as
        # failed where the file allows)
        if isinstance(exc, (*WRITE_ERRORS, HealError)):
            print(f"failed: {exc}", file=sys.stderr)
            return EXIT_FAILED
        if not isinstance(exc, USAGE_ERRORS):
            traceback.print_exc()
            print(f"failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_FAILED
    if launch().rank == 0:
        print(f"error: {exc}", file=sys.stderr)
    return EXIT_USAGE


def _main_exiting() -> int:
    status = main()
    from relaympi.results import UNCLOSABLE

    # HDF5 would crash freeing a run file it could not close (a full disk): skip the teardown
    if UNCLOSABLE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(_main_exiting)

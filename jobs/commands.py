"""A sweep's points made concrete: run files, the trainer's --config JSON, launch commands, checks.

Each job's complete ``relaympi.config.RunConfig`` is written as JSON next to its run file
(``NAME.json`` beside ``NAME.h5``) when the job starts, and the training command is
``[srun|mpirun ...] python -m relaympi.train --config NAME.json [RELAYMPI_EXTRA_ARGS]``: flags
given after --config win, and the command the run file records runs it again.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jobs.settings import JobsError, JobSettings
from jobs.sweeps import GridPoint, configurations, run_name, sweep
from relaympi.config import ConfigError, RunConfig, parse_args
from relaympi.data.paths import TASK_DATA, TASK_MODEL, data_root
from relaympi.data.sets import data_problems as _data_problems
from relaympi.engines import BACKENDS  # RELAYMPI_BACKEND: relaympi.train's --backend
from relaympi.engines import check as engine_check
from relaympi.training.plan import resolve

# the checkout: the default results folder, the trainer's PYTHONPATH
ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = ("srun", "mpirun", "local")
_INPUT_FLAGS = {
    "RELAYMPI_DATA_DIR": ("--data-dir", "data"),
    "RELAYMPI_MODEL_DIR": ("--model-dir", "a model"),
}


@dataclass(frozen=True)
class Job:
    """One point of a sweep made concrete: the trainer's complete config and the exact command."""

    index: int
    config: RunConfig  # out, checkpoint_dir, data and model folders, backend included
    world_size: int
    command: list[str]
    # RELAYMPI_DATA_DIR / _MODEL_DIR that the sweep needs and nothing gives
    unset: tuple[str, ...] = ()

    @property
    def out(self) -> Path:
        assert self.config.out is not None  # _job sets it
        return self.config.out

    @property
    def checkpoint_dir(self) -> Path:
        assert self.config.checkpoint_dir is not None  # _job sets it
        return self.config.checkpoint_dir

    @property
    def config_file(self) -> Path:
        return config_path(self.out)

    @property
    def name(self) -> str:
        return self.out.stem


def config_path(out: Path) -> Path:
    """The --config JSON of the run file ``out``: beside it, NAME.json (written when the job
    starts)."""
    return out.with_suffix(".json")


def config_json(config: RunConfig) -> str:
    return json.dumps(config.to_dict(), indent=2) + "\n"


def write_config(job: Job) -> None:
    """Write the job's --config file (atomically: a reader never sees half of it)."""
    partial = job.config_file.with_name(f".{job.config_file.name}.partial")
    partial.write_text(config_json(job.config), encoding="utf-8")
    os.replace(partial, job.config_file)


def results_dir(settings: JobSettings) -> Path:
    return settings.path("RELAYMPI_RESULTS_DIR", ROOT / "results")


def launcher(settings: JobSettings) -> str:
    name = settings.get("RELAYMPI_LAUNCHER", "srun")
    if name not in LAUNCHERS:
        raise JobsError(f"RELAYMPI_LAUNCHER must be srun, mpirun or local, got {name!r}")
    return name


def backend(settings: JobSettings) -> str:
    """The trainer's backend: RELAYMPI_BACKEND, else local under RELAYMPI_LAUNCHER=local, else
    mpi."""
    name = settings.get("RELAYMPI_BACKEND") or ("local" if launcher(settings) == "local" else "mpi")
    if name not in BACKENDS:
        raise JobsError(f"RELAYMPI_BACKEND must be {', '.join(BACKENDS)}, got {name!r}")
    if name == "mpi" and launcher(settings) == "local":
        raise JobsError(
            "RELAYMPI_BACKEND=mpi runs one process per worker: use RELAYMPI_LAUNCHER srun or mpirun"
        )
    return name


def one_process(settings: JobSettings) -> bool:
    """Whether each configuration runs as one process (--backend local or batched): --ntasks=1."""
    return backend(settings) != "mpi"


def device(settings: JobSettings) -> str | None:
    """RELAYMPI_DEVICE; the batched backend runs each configuration on one GPU unless it says
    otherwise."""
    return settings.get("RELAYMPI_DEVICE") or ("cuda" if backend(settings) == "batched" else None)


def data_dirs(
    task: str, sweep_name: str, settings: JobSettings
) -> list[tuple[str, Path | None, str | None, str]]:
    """(RunConfig field, folder, data set, variable) for data_dir / model_dir: RELAYMPI_DATA_DIR /
    _MODEL_DIR if set, else the task's folder under the data root ($RELAYMPI_DATA, else
    ~/.cache/relaympi); folder None when the sweep needs one that nothing gives."""
    needs = sweep(sweep_name)
    result: list[tuple[str, Path | None, str | None, str]] = []
    for field, name, data_set, needed in (
        ("data_dir", "RELAYMPI_DATA_DIR", TASK_DATA.get(task), needs.needs_data),
        ("model_dir", "RELAYMPI_MODEL_DIR", TASK_MODEL.get(task), needs.needs_model),
    ):
        value = settings.get(name)
        if value:
            result.append((field, Path(value).expanduser().absolute(), data_set, name))
        elif data_set:
            result.append(
                (field, data_root(settings.get("RELAYMPI_DATA")) / data_set, data_set, name)
            )
        elif needed:
            result.append((field, None, None, name))
    return result


def data_problems(
    selected: Sequence[Job], sweep_name: str, settings: JobSettings, hashes: bool
) -> list[str]:
    """What is wrong with the data the ``selected`` jobs read ([] when all of it is verified)."""
    needs = [
        (data_set, path)
        for job in selected
        for _, path, data_set, _ in data_dirs(job.config.task, sweep_name, settings)
        if data_set is not None and path is not None
    ]
    return _data_problems(
        needs, hashes=hashes, allow_unverified=settings.flag("RELAYMPI_ALLOW_UNVERIFIED_DATA")
    )


def _trainer_args(config_file: Path, settings: JobSettings) -> list[str]:
    """The trainer's command line: the config file, then the user's RELAYMPI_EXTRA_ARGS (which
    win)."""
    return ["--config", str(config_file), *shlex.split(settings.get("RELAYMPI_EXTRA_ARGS", ""))]


def command(world_size: int, config_file: Path, settings: JobSettings) -> list[str]:
    python = settings.get("RELAYMPI_PYTHON") or sys.executable
    train = [
        python,
        "-m",
        settings.get("RELAYMPI_TRAIN_MODULE", "relaympi.train"),
        *_trainer_args(config_file, settings),
    ]
    name = launcher(settings)
    if one_process(settings):
        return train
    launcher_args = shlex.split(settings.get("RELAYMPI_LAUNCHER_ARGS", ""))
    if name == "srun":
        return ["srun", f"--ntasks={world_size}", *launcher_args, *train]
    return [
        *shlex.split(settings.get("RELAYMPI_MPIRUN", "mpirun")),
        "-n",
        str(world_size),
        *launcher_args,
        *train,
    ]


def _job(
    index: int,
    point: GridPoint,
    sweep_name: str,
    settings: JobSettings,
    results: Path,
    checkpoints: Path,
) -> Job:
    config, world_size = point
    name = run_name(config, world_size)
    dirs = data_dirs(config.task, sweep_name, settings)
    single = one_process(settings)
    out = results / sweep_name / config.task / f"{name}.h5"
    paths: dict[str, Any] = {field: path for field, path, _, _ in dirs if path is not None}
    config = replace(
        config,
        out=out,
        checkpoint_dir=checkpoints / sweep_name / config.task / name,
        backend=backend(settings),
        workers=world_size if single else None,
        device=device(settings) or config.device,
        **paths,
    )
    unset = tuple(variable for _, path, _, variable in dirs if path is None)
    return Job(index, config, world_size, command(world_size, config_path(out), settings), unset)


def jobs(sweep_name: str, settings: JobSettings) -> list[Job]:
    results = results_dir(settings)
    checkpoints = settings.path("RELAYMPI_CHECKPOINT_DIR", results / "checkpoints")
    return [
        _job(index, point, sweep_name, settings, results, checkpoints)
        for index, point in enumerate(configurations(sweep_name, settings))
    ]


def check_job(job: Job, settings: JobSettings, scratch: Path) -> str | None:
    """Why the trainer would refuse this job (None when it accepts it).

    The trainer's own path: its parser reads the job's --config JSON (written to ``scratch``) and
    the user's extra flags, then ``relaympi.training.plan.resolve`` and the engine's check; so a
    typo in RELAYMPI_ALGOS or
    RELAYMPI_EXTRA_ARGS, an algorithm on a topology it cannot use, or a missing data directory is
    found before anything is submitted.
    """
    if job.unset:
        flag, reads = _INPUT_FLAGS[job.unset[0]]
        return f"task {job.config.task} reads {flag} {reads}: set {job.unset[0]} (jobs/README.md)"
    # a folder not fetched yet is left to data_problems (it prints the fetch command); the run
    # file's folder is made when the job starts: check against an existing one
    folders = {field: getattr(job.config, field) for field in ("data_dir", "model_dir")}
    absent: dict[str, Any] = {
        field: None
        for field, folder in folders.items()
        if folder is not None and not folder.is_dir()
    }
    config = replace(job.config, out=scratch / f"{job.name}.h5", **absent)
    config_file = scratch / f"{job.name}.json"
    config_file.write_text(config_json(config), encoding="utf-8")
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages), contextlib.redirect_stdout(messages):
            cfg = parse_args(_trainer_args(config_file, settings))
        # what the job's engine refuses, without loading it for others
        engine_check(resolve(cfg, job.world_size))
    except ConfigError as error:
        return str(error)
    except SystemExit:  # argparse: an unknown flag or value in RELAYMPI_EXTRA_ARGS
        lines = [line for line in messages.getvalue().splitlines() if line.startswith("error:")]
        return lines[-1].removeprefix("error: ") if lines else messages.getvalue().strip()
    return None


def check_jobs(all_jobs: Sequence[Job], sweep_name: str, settings: JobSettings) -> list[str]:
    """One line per reason the trainer would refuse configurations, naming them (the first few)."""
    refused: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="relaympi-check-") as scratch:
        for job in all_jobs:
            reason = check_job(job, settings, Path(scratch))
            if reason:
                refused.setdefault(reason, []).append(f"{sweep_name}[{job.index}] {job.name}")
    lines = []
    for reason, names in refused.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        lines.append(f"{', '.join(names[:3])}{more}: {reason}")
    return lines

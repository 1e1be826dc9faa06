"""One array task: run its configuration's training command, idempotently, through preemption."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys

from jobs.commands import ROOT, data_problems, jobs, write_config
from jobs.settings import JobsError, JobSettings
from jobs.sweeps import configurations
from relaympi.results import FINISHED_STATUSES, RESUMABLE_STATUSES, run_status


class _Forwarder:
    """Forwards SIGTERM/SIGUSR1 to the training command; remembers a time-limit warning."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.time_limit = False
        self.cancelled = False

    def __call__(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGUSR1:
            self.time_limit = True  # sbatch --signal=B:USR1@T: the time limit is T seconds away
        else:
            self.cancelled = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)  # the trainer checkpoints and exits 4


def _log(message: str) -> None:
    print(f"[relaympi-jobs] {message}", flush=True)


def _requeue() -> bool:
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return False
    _log(f"requeueing SLURM job {job_id} to resume from its checkpoint")
    return subprocess.run(["scontrol", "requeue", job_id], check=False).returncode == 0


def cmd_run(sweep_name: str, settings: JobSettings, index: int | None) -> int:
    if index is None:
        task_id = os.environ.get("SLURM_ARRAY_TASK_ID")
        if task_id is None:
            count = len(configurations(sweep_name, settings))
            print(
                f"{sweep_name}: no configuration chosen. Submit the array with "
                f"'bash jobs/submit.sh {sweep_name}' (or 'sbatch --array=0-{count - 1} "
                f"jobs/{sweep_name}.sh'), "
                "run one configuration here with '--index I', or list them with "
                "DRY_RUN=1 / --dry-run.",
                file=sys.stderr,
            )
            return 2
        index, source = int(task_id), f"SLURM_ARRAY_TASK_ID {task_id}"
    else:
        source = f"--index {index}"
    all_jobs = jobs(sweep_name, settings)
    if not 0 <= index < len(all_jobs):
        # an array larger than its grid (plain sbatch after the settings shrank it) fails loudly too
        valid = f" (indices 0-{len(all_jobs) - 1})" if all_jobs else ""
        raise JobsError(
            f"{sweep_name}: {source} is outside the grid of {len(all_jobs)} configurations{valid}; "
            "list them with DRY_RUN=1, or submit with 'bash jobs/submit.sh "
            f"{sweep_name}', which sizes the array"
        )
    job = all_jobs[index]
    status = run_status(job.out)
    label = f"{sweep_name}[{index}] {job.name}"
    if status in FINISHED_STATUSES and not settings.flag("RELAYMPI_FORCE"):
        _log(f"{label}: already {status}; skipping ({job.out})")
        return 0
    if job.unset:
        raise JobsError(f"{sweep_name} needs RELAYMPI_DATA_DIR (and RELAYMPI_MODEL_DIR for agnews)")
    missing = [
        p
        for p in data_problems([job], sweep_name, settings, hashes=False)
        if ": missing (" in p or ": incomplete (" in p
    ]
    if missing:  # a cheap look (no checksums) before a whole allocation starts to fail
        raise JobsError(f"{label}: data not there:\n  " + "\n  ".join(missing))
    if status in ("missing", "corrupt") and job.checkpoint_dir.exists():
        # The checkpoint belongs to a run file that is gone: start afresh rather than resume
        # into nothing.
        _log(f"{label}: run file {status}; removing its stale checkpoint {job.checkpoint_dir}")
        shutil.rmtree(job.checkpoint_dir)
    job.out.parent.mkdir(parents=True, exist_ok=True)
    job.checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    write_config(job)
    command_line = list(job.command)
    # RELAYMPI_FORCE=1; or a damaged run file (never another kind of file)
    if status in FINISHED_STATUSES or status == "corrupt":
        command_line.append("--overwrite")
    _log(
        f"{label}: run file {status}; {'resuming' if status in RESUMABLE_STATUSES else 'starting'}"
    )
    _log(f"command: {shlex.join(command_line)}")
    forwarder = _Forwarder()
    signal.signal(signal.SIGTERM, forwarder)
    signal.signal(signal.SIGUSR1, forwarder)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    forwarder.child = subprocess.Popen(command_line, env=env)
    rc = forwarder.child.wait()
    final = run_status(job.out)
    _log(f"{label}: exit status {rc}, run file {final}")
    if rc in (0, 3):  # completed, or diverged with the result recorded
        if not settings.flag("RELAYMPI_KEEP_CHECKPOINTS") and job.checkpoint_dir.exists():
            shutil.rmtree(job.checkpoint_dir)
        return 0
    if rc == 4 or forwarder.time_limit:  # preempted: the checkpoint is saved
        if not forwarder.cancelled and settings.get("RELAYMPI_REQUEUE", "1") != "0" and _requeue():
            return 0
        return 4
    return rc if rc > 0 else 128 - rc  # a signal: report it the way a shell would

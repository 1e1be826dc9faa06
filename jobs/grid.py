"""The sweeps' command line: list, count, plan and run the configurations of a sweep.

    python -m jobs.grid list SWEEP            # every configuration, its run file's status and
    command
    python -m jobs.grid count SWEEP           # number of configurations (array size)
    python -m jobs.grid plan SWEEP [--all]    # sbatch array groups for jobs/submit.sh
    python -m jobs.grid run SWEEP [--index I] # run configuration I (default: $SLURM_ARRAY_TASK_ID)
    python -m jobs.grid config SWEEP --index I  # the --config JSON configuration I runs with
    python -m jobs.grid scripts [--check]     # write jobs/sweep_*.sh from the grids (--check:
    compare)

From the checkout (or with it on PYTHONPATH, as jobs/lib.sh sets it). Settings come from
RELAYMPI_* environment variables, then from the KEY=VALUE file named by RELAYMPI_JOBS_CONFIG;
see jobs/README.md for every name.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from jobs.commands import (
    Job,
    backend,
    check_jobs,
    config_json,
    data_problems,
    device,
    jobs,
    launcher,
    one_process,
    results_dir,
)
from jobs.runner import cmd_run
from jobs.settings import JobsError, JobSettings
from jobs.sweeps import SWEEPS, configurations, listed_fields, sweep, sweep_script
from relaympi.entrypoint import UsageParser, run
from relaympi.results import FINISHED_STATUSES, run_status


def _header(sweep_name: str, all_jobs: Sequence[Job]) -> list[str]:
    """What this grid actually runs (the settings may differ from the paper's sweep)."""
    defaults = sweep(sweep_name)
    fields = [listed_fields((job.config, job.world_size)) for job in all_jobs]

    def values(field: str) -> str:
        seen = list(dict.fromkeys(f[field] for f in fields))
        return " ".join(
            "default" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for v in seen
        )

    tasks, workers = values("task"), values("world_size")
    paper = defaults.task == tasks and " ".join(map(str, defaults.workers)) == workers
    lines = [
        f"{sweep_name}: {defaults.description}"
        if paper
        else f"{sweep_name}: the grid of '{defaults.description}', here on task {tasks} with "
        f"{workers} workers"
    ]
    lines.append(
        f"this grid: task {tasks}; workers {workers}; algorithms {values('algo')}; alpha "
        f"{values('alpha')}; "
        f"momentum {values('momentum')}; lr {values('lr')}; drop probability "
        f"{values('drop_prob')}; seeds {values('seed')}"
    )
    return lines


def cmd_list(sweep_name: str, settings: JobSettings) -> int:
    all_jobs = jobs(sweep_name, settings)
    print("\n".join(_header(sweep_name, all_jobs)))
    how = f"launcher {launcher(settings)}"
    if backend(settings) == "batched":
        how = f"backend batched (one process per configuration, device {device(settings)})"
    print(f"{len(all_jobs)} configurations; {how}; results in {results_dir(settings)}")
    counts: dict[str, int] = {}
    for job in all_jobs:
        status = run_status(job.out)
        counts[status] = counts.get(status, 0) + 1
        fields = " ".join(
            f"{k}={v}"
            for k, v in listed_fields((job.config, job.world_size)).items()
            if v is not None
        )
        print(f"[{job.index}] {status:9s} {fields}")
        print(f"    {shlex.join(job.command)}")
    print("status: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    unfinished = [job for job in all_jobs if run_status(job.out) not in FINISHED_STATUSES]
    return refusals(all_jobs, unfinished, sweep_name, settings, dry_run=True)


def refusals(
    all_jobs: Sequence[Job],
    selected: Sequence[Job],
    sweep_name: str,
    settings: JobSettings,
    *,
    dry_run: bool,
) -> int:
    """What jobs/submit.sh refuses, on stderr; one code path for a submission, its --dry-run and a
    listing (DRY_RUN=1), so all three say the same. Returns 2 when a configuration would be
    refused by the trainer (nothing is submitted when one would fail), else 0. Data that the
    ``selected`` jobs read and that is not present and verified: JobsError when submitting, a
    warning in a dry run."""
    problems = check_jobs(all_jobs, sweep_name, settings)
    if problems:
        for problem in problems:
            print(f"jobs/grid.py: error: {problem}", file=sys.stderr)
        print(
            f"jobs/grid.py: {sweep_name}: nothing submitted (check the settings: jobs/README.md)",
            file=sys.stderr,
        )
        return 2
    problems = data_problems(selected, sweep_name, settings, hashes=True)
    if problems:
        message = (
            f"{sweep_name}: the data its jobs read is not present and verified:\n  "
            + "\n  ".join(problems)
            + "\n(data put there by hand, complete but without a manifest: "
            "RELAYMPI_ALLOW_UNVERIFIED_DATA=1)"
        )
        if not dry_run:
            raise JobsError(message)
        print(f"jobs/grid.py: warning: {message}", file=sys.stderr)
    return 0


def array_spec(indices: Sequence[int]) -> str:
    """Compress sorted indices into sbatch's --array syntax: 0-5,8,10-12."""
    parts: list[str] = []
    start: int | None = None
    prev = 0  # the current run's last index, once start is set
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)


def cmd_plan(
    sweep_name: str, settings: JobSettings, include_finished: bool, dry_run: bool = False
) -> int:
    """Lines 'group<TAB>NTASKS<TAB>ARRAY<TAB>COUNT' (one per task count), 'sbatch<TAB>OPTION' for
    options the jobs need (a GPU for the batched backend), then 'logs<TAB>DIR'.

    Refuses (JobsError) when the data the planned jobs read is not present and verified; a dry
    run only warns."""
    single = one_process(settings)
    groups: dict[int, list[int]] = {}
    finished = 0
    all_jobs = jobs(sweep_name, settings)
    selected = []
    for job in all_jobs:
        if not include_finished and run_status(job.out) in FINISHED_STATUSES:
            finished += 1
            continue
        groups.setdefault(1 if single else job.world_size, []).append(job.index)
        selected.append(job)
    if refusals(all_jobs, selected, sweep_name, settings, dry_run=dry_run):
        return 2
    for ntasks, indices in sorted(groups.items()):
        print(f"group\t{ntasks}\t{array_spec(indices)}\t{len(indices)}")
    if (
        backend(settings) == "batched"
        and device(settings) == "cuda"
        and not settings.get("RELAYMPI_GPUS_PER_NODE")
    ):
        print("sbatch\t--gpus-per-node=1")  # every worker of a configuration on one GPU
    print(f"finished\t{finished}")
    print(f"logs\t{results_dir(settings) / 'logs'}")
    return 0


def cmd_config(sweep_name: str, settings: JobSettings, index: int) -> int:
    """Print the --config JSON that configuration ``index`` runs with (written when it starts)."""
    all_jobs = jobs(sweep_name, settings)
    if not 0 <= index < len(all_jobs):
        raise JobsError(
            f"{sweep_name}: index {index} is outside the grid of {len(all_jobs)} configurations"
        )
    sys.stdout.write(config_json(all_jobs[index].config))
    return 0


def cmd_scripts(check: bool) -> int:
    """Write each sweep's jobs/NAME.sh from its grid (its #SBATCH defaults); with ``check``, only
    name those that differ (exit 1)."""
    jobs_dir = Path(__file__).resolve().parent
    stale = []
    for name in SWEEPS:
        path, text = jobs_dir / f"{name}.sh", sweep_script(name)
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path.relative_to(jobs_dir.parent))
        if not check:
            path.write_text(text, encoding="utf-8")
            path.chmod(0o755)
    for path in stale:
        print(
            f"{path}: {'differs from its grid' if check else 'written'}",
            file=sys.stderr if check else sys.stdout,
        )
    return 1 if check and stale else 0


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(
        prog="python -m jobs.grid",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "count", "plan", "run", "config"):
        p = sub.add_parser(name)
        p.add_argument("sweep", choices=sorted(SWEEPS))
        if name == "plan":
            p.add_argument("--all", action="store_true", help="include finished configurations")
            p.add_argument(
                "--dry-run", action="store_true", help="warn about missing data instead of refusing"
            )
        if name == "run":
            p.add_argument(
                "--index", type=int, help="configuration to run (default: $SLURM_ARRAY_TASK_ID)"
            )
            p.add_argument(
                "--dry-run", action="store_true", help="list every configuration instead"
            )
        if name == "config":
            p.add_argument("--index", type=int, required=True, help="the configuration")
    sub.add_parser("sweeps")
    scripts = sub.add_parser("scripts", help="write jobs/sweep_*.sh from the grids")
    scripts.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming the scripts that differ"
    )
    sub.add_parser("show-config", help="print the effective RELAYMPI_* settings as JSON")
    args = parser.parse_args(argv)
    try:
        settings = JobSettings()
        if args.command == "sweeps":
            for name, defaults in SWEEPS.items():
                print(
                    f"{name}\t{len(configurations(name, JobSettings({})))}\t{defaults.description}"
                )
            return 0
        if args.command == "scripts":
            return cmd_scripts(args.check)
        if args.command == "show-config":
            print(json.dumps(settings.values, indent=2, sort_keys=True))
            return 0
        if args.command == "count":
            print(len(configurations(args.sweep, settings)))
            return 0
        if args.command == "plan":
            return cmd_plan(args.sweep, settings, args.all, args.dry_run)
        if args.command == "config":
            return cmd_config(args.sweep, settings, args.index)
        if (
            args.command == "list"
            or args.dry_run
            or os.environ.get("DRY_RUN", "0") not in ("", "0")
        ):
            return cmd_list(args.sweep, settings)
        return cmd_run(args.sweep, settings, args.index)
    except JobsError as error:
        print(f"jobs/grid.py: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    run(main)  # `DRY_RUN=1 bash jobs/sweep_alpha.sh | head`: the reader stopped listening, quietly

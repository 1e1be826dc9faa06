"""Stall and evict: SIGSTOP one rank of a running `--on-failure continue --peer-timeout S` job, time
from the stop to the survivors' heal (rank 0's "stalled" line), then SIGCONT it; check that the run
completed, that its run file records that rank as stalled, that the resumed process ended with one
line, and (``--replay``) that the survivors' numbers equal the in-process engine's replay of a loss
at the recorded step, bit for bit. Repeated ``--runs`` times: the median and the maximum.

    python -m benchmarks.stall_heal --runs 5 --worker 2 -- \\
        scripts/mpirun-ulfm -n 3 .venv/bin/python -m relaympi.train --task digits \\
        --on-failure continue --peer-timeout 2 --steps 3000 --out results/stall.h5

The job's ranks write their process ids into a folder (RELAYMPI_PID_DIR); the stop lands after
the step ``--at`` of the job's log (`--log-every 1` is added).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.kill_loop import STEP_LINE, _option, _train_args, differences, replay
from relaympi.results import read_run

HEALED = re.compile(r"lost rank (\d+) \(node \d+, stalled: silent for ([\d.]+) s\)")
# what Open MPI's failure detector makes a declared process print when it resumes (then it aborts)
DECLARED_DEAD = "I have been reported dead"


def stall_once(
    command: list[str],
    worker: int,
    at: int,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> dict:
    """Run ``command``, stop ``worker`` after step ``at``, resume it once healed: the timings, the
    run's end and the resumed process's lines.

    Args:
        command: the job (launcher and trainer).
        worker: the original id of the rank to stop.
        at: the step whose log line the stop follows.
        timeout_s: the job's limit; past it, its process group is killed and the result says so.
        env: the job's environment (default: this process's).

    Returns:
        stop_to_heal_s, the heal line's silence, the launcher's exit status, the lines the resumed
        process printed with the detector's words, whether the job ended in time, the job's output
        the stopped process's id and the wall-clock time of the stop.
    """
    pid_dir = Path(tempfile.mkdtemp(prefix="relaympi-pids-"))
    env = {**(os.environ if env is None else env), "RELAYMPI_PID_DIR": str(pid_dir)}
    if "--log-every" not in _train_args(command):
        command = [*command, "--log-every", "1"]
    if "--overwrite" not in _train_args(command):  # each run replaces the last one's file
        command = [*command, "--overwrite"]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    stopped_at: float | None = None
    result: dict[str, Any] = {"stop_to_heal_s": None, "silent_s": None, "resumed_lines": []}
    pid = None
    timed_out = threading.Event()

    def end_job() -> None:  # a job that hangs prints nothing more: end it from here
        timed_out.set()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout_s, end_job)
    watchdog.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if stopped_at is None:
            match = STEP_LINE.search(line)
            if match and int(match.group(1)) >= at:
                pid = int((pid_dir / f"worker{worker}.pid").read_text().split()[0])
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.perf_counter()
                result["stopped_wall"] = time.time()
            continue
        healed = HEALED.search(line)
        if healed and result["stop_to_heal_s"] is None:
            result["stop_to_heal_s"] = time.perf_counter() - stopped_at
            result["silent_s"] = float(healed.group(2))
            assert pid is not None
            os.kill(pid, signal.SIGCONT)  # evicted: it must learn so and end
        if DECLARED_DEAD in line:
            result["resumed_lines"].append(line.rstrip("\n"))
    result["launcher_exit"] = proc.wait()
    watchdog.cancel()
    result["ended"] = not timed_out.is_set()
    result["output"] = "".join(lines)
    result["pid"] = pid
    shutil.rmtree(pid_dir, ignore_errors=True)
    return result


def _without_timeout(command: list[str]) -> list[str]:
    """The job's command without --peer-timeout (MPI only: the in-process replay refuses it)."""
    cut = [i for i, arg in enumerate(command) if arg == "--peer-timeout"]
    return [arg for i, arg in enumerate(command) if not any(i in (c, c + 1) for c in cut)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stall_heal", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runs", type=int, default=5, help="jobs to run (default 5)")
    parser.add_argument("--worker", type=int, default=1, help="the rank to stop (default 1)")
    parser.add_argument("--at", type=int, default=50, help="stop after this step (default 50)")
    parser.add_argument(
        "--replay", action="store_true", help="check the numbers against the in-process replay"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the job")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    out = _option(_train_args(command), "--out")
    if not command or out is None:
        parser.error("give the job after --, with --out RUN.h5")
    runs = []
    for _ in range(args.runs):
        result = stall_once(command, args.worker, args.at)
        run = read_run(Path(out))
        membership = run.membership
        result["status"] = run.status
        result["membership"] = membership
        if args.replay and membership:
            size = len(np.asarray(run.data["train_loss"])[-1])
            copy = replay(_without_timeout(command), Path(out), membership, size)
            result["replay_differences"] = differences(Path(out), copy)
        runs.append(result)
        shown = {k: v for k, v in result.items() if k != "output"}
        print(json.dumps(shown), file=sys.stderr, flush=True)
    times = [r["stop_to_heal_s"] for r in runs if r["stop_to_heal_s"] is not None]
    summary = {
        "runs": len(runs),
        "healed": len(times),
        "stop_to_heal_median_s": float(np.median(times)) if times else None,
        "stop_to_heal_max_s": max(times) if times else None,
        "silent_s": [r["silent_s"] for r in runs],
        "heal_s_recorded": [[c["heal_s"] for c in r["membership"]] for r in runs],
        "all_completed": all(r["status"] == "completed" and r["ended"] for r in runs),
    }
    print(json.dumps(summary, indent=1))
    return 0 if summary["all_completed"] and len(times) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Kill loop: SIGKILL a random rank (or every rank of a random node) of a running
`--on-failure continue` job every K steps until half the ranks remain; then check that the run
completed, that its run file records exactly those losses, and (``--replay``) that every surviving
worker's numbers equal the in-process engine's replay of the same losses, bit for bit.

    python -m benchmarks.kill_loop --every 20 --replay -- \\
        scripts/mpirun-ulfm -n 8 .venv/bin/python -m relaympi.train --task digits \\
        --on-failure continue --steps 200 --out results/kill.h5

The job's ranks write their process ids into a folder (RELAYMPI_PID_DIR); the loop follows the
steps in the job's log (`--log-every 1` is added) and kills at a random moment within the step it
chose, so a loss lands anywhere in a step: in a gradient, an exchange, an evaluation. ``--baseline``
also runs the command without kills and reports both speeds (steps per second).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

from relaympi.results import read_run

STEP_LINE = re.compile(r"step (\d+)/(\d+) loss")
SKIPPED = ("time_", "gpu_")  # measured, not computed: differ between any two runs


def _train_args(command: list[str]) -> list[str]:
    """The trainer's arguments of a launcher command (what follows ``-m relaympi.train``)."""
    for i in range(len(command) - 1):
        if command[i] == "-m" and command[i + 1] == "relaympi.train":
            return command[i + 2 :]
    raise SystemExit("kill_loop: the command must run `python -m relaympi.train ...`")


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _live(pid_dir: Path, killed: set[int]) -> dict[int, tuple[int, str]]:
    """worker id -> (pid, host) of the ranks not killed yet."""
    live = {}
    for path in pid_dir.glob("worker*.pid"):
        worker = int(path.stem.removeprefix("worker"))
        if worker not in killed:
            pid, host = path.read_text().split()
            live[worker] = (int(pid), host)
    return live


def run_with_kills(
    command: list[str], every: int, seed: int, node: bool, min_workers: int | None
) -> dict:
    """Run ``command``, killing as the module says; what was killed, when, and how long it ran."""
    rng = random.Random(seed)
    pid_dir = Path(tempfile.mkdtemp(prefix="relaympi-pids-"))
    env = {**os.environ, "RELAYMPI_PID_DIR": str(pid_dir)}
    if "--log-every" not in _train_args(command):
        command = [*command, "--log-every", "1"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    kills: list[dict] = []
    killed: set[int] = set()
    step_times: list[float]
    next_kill, step_times, last = every, [], None
    workers0: int | None = None
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        sys.stdout.write(line)
        match = STEP_LINE.search(line)
        if not match:
            continue
        step, now = int(match.group(1)), time.perf_counter()
        if last is not None and step > last[0]:
            step_times.append((now - last[1]) / (step - last[0]))
        last = (step, now)
        live = _live(pid_dir, killed)
        workers0 = workers0 or len(live)
        floor = min_workers if min_workers is not None else (workers0 + 1) // 2
        if step < next_kill or len(live) <= floor:
            continue
        next_kill = step + every
        if node:
            host = rng.choice(sorted({h for _, h in live.values()}))
            victims = sorted(w for w, (_, h) in live.items() if h == host)
            if len(live) - len(victims) < floor:
                continue
        else:
            victims = [rng.choice(sorted(live))]
        # at a random moment of a step: anywhere in its gradient, exchange or evaluation
        delay = rng.uniform(0.0, float(np.median(step_times[-20:])) if step_times else 0.0)

        def kill(victims=victims, delay=delay, live=live) -> None:
            time.sleep(delay)
            for worker in victims:
                os.kill(live[worker][0], signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        killed.update(victims)
        kills.append({"workers": victims, "seen_at_step": step, "delay_s": round(delay, 4)})
    returncode = proc.wait()
    shutil.rmtree(pid_dir, ignore_errors=True)
    return {
        "kills": kills,
        "killed": sorted(killed),
        "wall_s": time.perf_counter() - start,
        "launcher_exit": returncode,
        "log_tail": "".join(lines[-5:]),
    }


def replay(command: list[str], out: Path, membership: list[dict], workers: int) -> Path:
    """The in-process engine's run of the same trainer arguments with the recorded losses."""
    args = _train_args(command)
    cleaned, skip = [], False
    for arg in args:  # its own --out and backend; the rest as the job ran
        if skip:
            skip = False
            continue
        if arg in ("--out", "--backend", "--workers", "--checkpoint-dir"):
            skip = True
            continue
        cleaned.append(arg)
    target = out.with_name(out.stem + ".replay.h5")
    inject = ",".join(f"{r}:{c['step']}" for c in membership for r in c["lost"])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "relaympi.train",
            *cleaned,
            *("--backend", "local", "--workers", str(workers), "--out", str(target)),
            "--overwrite",
        ],
        check=True,
        env={**os.environ, "RELAYMPI_INJECT_FAILURE": inject},
        stdout=subprocess.DEVNULL,
    )
    return target


def differences(first: Path, second: Path) -> list[str]:
    """Datasets (computed ones: not timers) that differ between two run files, NaN equal NaN."""
    a, b = read_run(first), read_run(second)
    found = []
    for name in sorted(set(a.data) | set(b.data)):
        if name.startswith(SKIPPED):
            continue
        if name not in a.data or name not in b.data:
            found.append(f"{name}: only in one file")
        elif not np.array_equal(a.data[name], b.data[name], equal_nan=True):
            found.append(f"{name}: values differ")
    return found


def finished_before_kill(run: Any, kills: list[dict], lost: list[int], total: int) -> list[int]:
    """The killed workers that the run file shows finishing the run: killed after the last step's
    line, not recorded as lost, and with numbers in the last row. A kill that lands after the
    ranks agreed that the run is over takes nothing from it (docs/membership.md).

    Args:
        run: the run file, as read_run gives it.
        kills: run_with_kills' kills.
        lost: the workers the run file records as lost.
        total: the run's last step.

    Returns:
        Those workers' ids, sorted.
    """
    late = {w for kill in kills if kill["seen_at_step"] >= total for w in kill["workers"]}
    last = np.asarray(run.data["train_loss"])[-1]
    return sorted(w for w in late if w not in lost and np.isfinite(last[w]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kill_loop",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--every", type=int, required=True, metavar="K", help="steps between kills")
    parser.add_argument("--seed", type=int, default=0, help="the victims' and moments' seed")
    parser.add_argument("--node", action="store_true", help="kill every rank of a random host")
    parser.add_argument(
        "--min-workers", type=int, default=None, help="stop killing here (default: half)"
    )
    parser.add_argument("--replay", action="store_true", help="compare with the local replay")
    parser.add_argument("--baseline", action="store_true", help="also run without kills")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- LAUNCHER ... relaympi.train")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.every < 1:
        parser.error(f"--every must be >= 1, got {args.every}")
    out_text = _option(_train_args(command), "--out")
    if not command or out_text is None:
        parser.error("give the job's command after --, with --out RUN.h5")
    out = Path(out_text)
    result = run_with_kills(command, args.every, args.seed, args.node, args.min_workers)
    run = read_run(out)
    membership = list(run.membership)  # parsed by the reader (it leaves attrs)
    lost = sorted(w for c in membership for w in c["lost"])
    total = int(run.config.get("total_steps") or run.data["step"][-1])
    finished = finished_before_kill(run, result["kills"], lost, total)
    expected = sorted(set(result["killed"]) - set(finished))
    result.update(
        status=run.status,
        membership=membership,
        steps_per_s=total / result["wall_s"],
        finished_before_kill=finished,
        recorded_equals_killed=lost == expected,
    )
    ok = run.status == "completed" and lost == expected
    if args.replay:
        replayed = replay(command, out, membership, int(run.attrs["world_size"]))
        result["replay_differences"] = differences(out, replayed)
        ok = ok and not result["replay_differences"]
    if args.baseline:
        base_out = out.with_name(out.stem + ".baseline.h5")
        base = [*command, "--out", str(base_out), "--overwrite"]
        t0 = time.perf_counter()
        subprocess.run(base, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result["baseline_steps_per_s"] = total / (time.perf_counter() - t0)
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    print(
        f"kill loop: {len(result['killed'])} ranks killed, {run.status}, "
        f"recorded {'=' if lost == expected else '!='} killed"
        + (f" ({len(finished)} had finished the run first)" if finished else "")
        + (
            f", replay {'identical' if not result['replay_differences'] else 'DIFFERS'}"
            if args.replay
            else ""
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

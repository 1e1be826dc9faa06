"""A neighbour held at half speed: rank 0's pace with and without --message-deadline, as ratios to
the same run with nobody slow.

Rank 1 (a neighbour of rank 0 on a chain or a ring) is held from outside: SIGSTOP for ``--stop-ms``
of every ``--period-ms`` (50 of 100 by default), from the moment its process is found until the
run ends. Rank 0's pace is its seconds per step between the first evaluation after ``--skip``
steps and the last one (``time_s`` of the run file, which rank 0 writes). Four runs per round
(``--kinds`` chooses some), in this order and in reverse in odd rounds, over ``--rounds`` rounds, so
that a busy machine weighs on all alike: clean, clean with the deadline, slow, slow with the
deadline. ``--variant NAME=TREE`` runs each kind again with relaympi imported from another checkout,
in the same rounds: a change against the code before it. The machine's load average is printed
before each run; the summary gives each run's median ratio to the clean run of its round, with a
bootstrap 90% interval of that median (single rounds on a shared machine spread by 20% and more).

    python -m benchmarks.slow_neighbour --ranks 4 --deadline 0.02 -- \\
        --task digits --algo relay --topology chain --steps 300 --eval-every 50

Everything after ``--`` goes to ``python -m relaympi.train``; run files go under
bench-results/slow_neighbour/ (each with the job's log beside it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from relaympi.launcher import launch
from relaympi.results import read_run

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench-results" / "slow_neighbour"


def rank_of(pid: int) -> int | None:
    """The rank a process was launched as: its launcher's variables, read as the trainer reads them.

    Args:
        pid: the process.

    Returns:
        Its rank, or None for a process no launcher started (or one gone).
    """
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    env = dict(entry.decode(errors="replace").partition("=")[::2] for entry in environ if entry)
    found = launch(env)
    return found.rank if found.launched else None


def descendants(root: int) -> list[int]:
    """Every process below ``root``, from /proc's parent links.

    Args:
        root: the process whose children, grandchildren and so on are wanted.

    Returns:
        Their ids, parents before their children.
    """
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def hold(job: subprocess.Popen, rank: int, stop_s: float, period_s: float) -> None:
    """SIGSTOP/SIGCONT ``rank``'s process: stopped ``stop_s`` of every ``period_s``, from the moment
    it is found below ``job`` until ``job`` ends (then it is left running).

    Args:
        job: the launcher (mpirun) whose rank to hold.
        rank: the rank to hold.
        stop_s: seconds stopped in each period.
        period_s: the period, seconds.
    """
    pid = None
    while pid is None and job.poll() is None:
        pid = next((p for p in descendants(job.pid) if rank_of(p) == rank), None)
        time.sleep(0.05)
    while pid is not None and job.poll() is None:
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(period_s - stop_s)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _pace(path: Path, skip: int) -> float:
    """Rank 0's seconds per step from the first evaluation at or after ``skip`` to the last."""
    run = read_run(path, datasets=["step", "time_s"])
    steps, seconds = run.data["step"], run.data["time_s"]
    seconds = seconds if seconds.ndim == 1 else seconds[:, 0]
    first = int(np.argmax(steps >= skip))
    return float((seconds[-1] - seconds[first]) / (steps[-1] - steps[first]))


def add_hold_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the held rank and the launcher, which slow_worker shares: --slow-rank,
    --stop-ms, --period-ms and --mpirun.

    Args:
        parser: the benchmark's parser.
    """
    parser.add_argument(
        "--slow-rank", type=int, default=1, help="the rank held at part speed (default 1)"
    )
    parser.add_argument(
        "--stop-ms", type=float, default=50.0, help="ms it is stopped each period (default 50)"
    )
    parser.add_argument(
        "--period-ms", type=float, default=100.0, help="the stop/continue period, ms (default 100)"
    )
    parser.add_argument(
        "--mpirun",
        default=str(Path(sys.executable).parent / "mpirun"),
        help="the mpirun to launch with (default: the venv's, MPICH)",
    )


KINDS = ("clean", "clean+deadline", "slow", "slow+deadline")


def parse_variant(text: str) -> tuple[str, Path]:
    """``NAME=TREE`` of --variant: a name for the rows and a checkout of relaympi to import.

    Raises:
        argparse.ArgumentTypeError: no ``=``, an empty name, or a folder without relaympi/.
    """
    name, sep, tree = text.partition("=")
    if not sep or not name or not (Path(tree) / "relaympi").is_dir():
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected NAME=TREE, TREE a checkout with a relaympi/ folder"
        )
    return name, Path(tree).resolve()


def parse_kinds(text: str) -> list[str]:
    """--kinds: a comma-separated subset of KINDS, "clean" always first (the ratios' base).

    Raises:
        argparse.ArgumentTypeError: a kind not in KINDS.
    """
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    bad = [kind for kind in kinds if kind not in KINDS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--kinds: {', '.join(bad)} unknown; choose from {', '.join(KINDS)}"
        )
    return ["clean"] + [kind for kind in KINDS[1:] if kind in kinds]


def interval(ratios: np.ndarray, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap 90% interval of the median of ``ratios`` (the rounds resampled with
    replacement): how far the median could move on a machine this noisy."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(ratios, size=(draws, len(ratios))), axis=1)
    return float(np.quantile(medians, 0.05)), float(np.quantile(medians, 0.95))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.slow_neighbour", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=4, help="MPI ranks (default 4)")
    parser.add_argument("--deadline", type=float, required=True, help="--message-deadline, s")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    parser.add_argument(
        "--skip", type=int, default=50, help="steps left out at the start (default 50)"
    )
    parser.add_argument(
        "--kinds",
        type=parse_kinds,
        default=list(KINDS),
        help=f"the runs of each round, comma-separated from {', '.join(KINDS)} (default all; "
        "clean always runs: it is what the ratios are to)",
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME=TREE",
        help="run each kind again with relaympi imported from the checkout TREE, its rows named "
        "NAME (repeatable): a change measured against the code beside it, in the same rounds",
    )
    add_hold_arguments(parser)
    args = parser.parse_args(ours)
    OUT.mkdir(parents=True, exist_ok=True)
    trees = [("", ROOT)] + args.variant
    # (label, file name stem, kind, tree): a variant's runs are "KIND [NAME]", in KIND@NAME-*.h5
    runs = [
        (f"{kind} [{name}]" if name else kind, f"{kind}@{name}" if name else kind, kind, tree)
        for name, tree in trees
        for kind in args.kinds
    ]
    paces: dict[str, list[float]] = {label: [] for label, *_ in runs}
    for round_ in range(args.rounds):
        # odd rounds in reverse: a machine growing busier or quieter weighs on every run alike
        for label, stem, kind, tree in runs if round_ % 2 == 0 else runs[::-1]:
            slow, deadline = kind.startswith("slow"), kind.endswith("+deadline")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
            out = OUT / f"{stem}-{round_}.h5"
            command = [args.mpirun, "-n", str(args.ranks), sys.executable, "-m", "relaympi.train"]
            command += [*train, "--out", str(out), "--overwrite"]
            command += ["--message-deadline", str(args.deadline)] if deadline else []
            load = os.getloadavg()[0]
            with open(out.with_suffix(".log"), "w") as log:  # the job's own lines
                job = subprocess.Popen(command, cwd=tree, env=env, stdout=log, stderr=log)
            holder = None
            if slow:
                holder = threading.Thread(
                    target=hold,
                    args=(job, args.slow_rank, args.stop_ms / 1e3, args.period_ms / 1e3),
                    daemon=True,
                )
                holder.start()
            if job.wait() != 0:
                print(
                    f"{label}: exit {job.returncode} (its log: {out.with_suffix('.log')})",
                    file=sys.stderr,
                )
                return 1
            if holder is not None:
                holder.join()
            pace = _pace(out, args.skip)
            paces[label].append(pace)
            run = read_run(out, datasets=[])
            late, skipped = run.late_drops, run.skipped_steps
            dropped = "" if late is None else f", {len(late)} late drops"
            if skipped is not None:  # rank 0's own skips make its pace look faster: say so
                by_rank0 = int(np.sum(skipped[:, 1] == 0))
                dropped += f", {len(skipped)} steps skipped ({by_rank0} by rank 0)"
            print(f"round {round_} {label}: {1e3 * pace:.2f} ms/step (load {load:.1f}{dropped})")
    clean = np.array(paces["clean"])
    for label, *_ in runs:
        ratios = np.array(paces[label]) / clean
        low, high = interval(ratios)
        print(
            f"{label}: {1e3 * np.median(paces[label]):.2f} ms/step, "
            f"median {np.median(ratios):.3f}x clean (90% interval {low:.3f}-{high:.3f}; "
            f"mean {np.mean(ratios):.3f}x; rounds: "
            f"{', '.join(f'{r:.2f}' for r in ratios)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

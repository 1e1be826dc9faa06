"""Time `python -m relaympi.report` over N hand-made run files (default 1,000).

    python -m benchmarks.bench_report [--runs 1000] [--evals 200] [--workers 16] [--keep DIR]

Writes CIFAR-style runs (a full sweep_alpha/sweep_lr-shaped grid: algorithms x alpha x lr x
seeds, 16 workers, one evaluation per epoch) into a temporary directory, then times the
report in a fresh process, as a user would run it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from relaympi.results import RunWriter

ROOT = Path(__file__).resolve().parent.parent
ALGOS = (
    ("allreduce", "fully-connected"),
    ("relay", "double-binary-trees"),
    ("dpsgd", "ring"),
    ("d2", "ring"),
    ("sgp", "exponential"),
)


def write_runs(directory: Path, runs: int, evals: int, workers: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    # seeds vary slowest: 1,000 runs cover all 150 cells (5 algos x 3 alphas x 2 momenta x 5 lrs)
    grid = itertools.product(
        range(runs), ALGOS, (1.0, 0.1, 0.01), (0.0, 0.9), (0.025, 0.05, 0.1, 0.2, 0.4)
    )
    epochs = np.arange(1, evals + 1, dtype=float)
    for i, (seed_, (algo, topology), alpha, momentum, lr) in zip(range(runs), grid, strict=False):
        config = {
            "task": "cifar10",
            "algo": algo,
            "topology": topology,
            "alpha": alpha,
            "lr": lr,
            "momentum": momentum,
            "optimizer": "sgd",
            "world_size": workers,
            "seed": seed_,
            "drop_prob": 0.0,
            "epochs": evals,
            "steps": None,
            "batch_size": 32,
            "relay_mode": None,
        }
        top = 0.9 - 0.2 * abs(np.log2(lr / 0.1)) / 2
        ramp = np.minimum(1.0, epochs / (0.6 * evals))[:, None]
        accuracy = np.clip(ramp * top - 0.05 * rng.random((evals, workers)), 0, 1)
        with RunWriter.create(
            directory / f"run{i:05d}.h5",
            config=config,
            provenance={"bench": True},
            world_size=workers,
        ) as writer:
            writer.extend(
                {
                    "step": (epochs * 98).astype(np.int64),
                    "epoch": epochs,
                    "time_s": np.arange(evals, dtype=float),
                    "train_loss": rng.random((evals, workers)),
                    "test_loss": rng.random((evals, workers)),
                    "test_accuracy": accuracy,
                    "bytes_sent": np.outer(np.arange(evals), np.full(workers, 1e6)),
                }
            )
            writer.set_status("completed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1000,
        help="number of run files to write and report on (default 1000)",
    )
    parser.add_argument(
        "--evals", type=int, default=200, help="evaluations per run, one per epoch (default 200)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=16,
        help="workers per run: the width of its per-worker arrays (default 16)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="write the runs here and keep them (default: a temporary directory, removed)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value in (
        ("--runs", args.runs),
        ("--evals", args.evals),
        ("--workers", args.workers),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    with tempfile.TemporaryDirectory(prefix="relaympi-bench-") as tmp:
        directory = args.keep or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        write_runs(directory, args.runs, args.evals, args.workers)
        written = time.perf_counter() - start
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        )
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "relaympi.report", str(directory)],
            capture_output=True,
            text=True,
            env=env,
        )
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return 1
        size_mb = sum(p.stat().st_size for p in directory.glob("*.h5")) / 1e6
        print(
            f"wrote {args.runs} run files ({args.evals} evaluations x {args.workers} workers, "
            f"{size_mb:.0f} MB) in {written:.1f} s"
        )
        print(
            f"report over {args.runs} run files: {elapsed:.2f} s "
            f"({1000 * elapsed / args.runs:.2f} ms per file, including interpreter start-up)"
        )
    return 0


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)

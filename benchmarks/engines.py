"""Samples/s and time per step of the training engines: --backend local, --backend batched and
mpirun.

    python -m benchmarks.engines                                   # digits (the default run) and a
    small VGG-11 CPU run
    python -m benchmarks.engines --workloads digits --engines local,batched
    python -m benchmarks.engines --steps 24                        # every workload cut to 24 steps
    (a quick look)

Each (workload, engine) trains once through ``python -m relaympi.train`` in a subprocess and is
timed from its run file: training time is the run's wall time less its evaluation time, so
start-up (imports, data loading) and evaluation are excluded; "wall" is the whole process.
Each engine runs with the trainer's default torch threads (relaympi.threads: its share of the CPUs
the process may run on, capped by OMP_NUM_THREADS / SLURM_CPUS_PER_TASK) unless --threads is given;
the "threads" column is the count its run file records.
The digits workload is the default digits run (16 workers, RelaySGD, alpha 0.01, 20 epochs);
vgg11 trains VGG-11 on generated CIFAR-10 files (random pixels: a speed test, not a result).
On a shared machine timings vary between runs: compare engines from the same invocation.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from relaympi.results import read_run

ENGINES = ("local", "batched", "mpirun")


@dataclass(frozen=True)
class EngineCase:
    args: tuple[str, ...]
    workers: int
    batch_size: int  # samples per worker per step


WORKLOADS = {
    "digits": EngineCase(
        ("--task", "digits", "--algo", "relay", "--alpha", "0.01"), workers=16, batch_size=8
    ),
    "vgg11": EngineCase(
        (
            "--task",
            "cifar10",
            "--algo",
            "relay",
            "--alpha",
            "0.1",
            "--steps",
            "6",
            "--eval-every",
            "1000000",
            "--eval-batch-size",
            "64",
        ),
        workers=4,
        batch_size=8,
    ),
}


@dataclass(frozen=True)
class Timing:
    steps: int
    train_s: float
    wall_s: float
    samples: int
    threads: int  # torch threads per process, as the run file records them

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_s

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.train_s / self.steps


def command(engine: str, workload: EngineCase, extra: list[str], out: Path) -> list[str]:
    train = [
        sys.executable,
        "-m",
        "relaympi.train",
        *workload.args,
        "--batch-size",
        str(workload.batch_size),
        *extra,
        "--out",
        str(out),
        "--overwrite",
    ]
    if engine == "mpirun":
        return [_mpirun(), "-n", str(workload.workers), *train]
    return [*train, "--backend", engine, "--workers", str(workload.workers)]


def _mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"  # the virtual environment's MPI, if it has one
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        raise SystemExit(
            "error: no mpirun beside the Python interpreter or on PATH; leave mpirun out "
            "with --engines local,batched"
        )
    return found


def measure(engine: str, workload: EngineCase, extra: list[str], folder: Path) -> Timing:
    """Train once with ``engine``; its timing from the run file."""
    out = folder / f"{engine}.h5"
    t0 = time.perf_counter()
    proc = subprocess.run(command(engine, workload, extra, out), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    run = read_run(out)
    data = run.data
    steps = int(data["step"][-1])
    # worker 0's clock, as the log line's
    train_s = float(data["time_s"][-1] - data["time_eval_s"][-1][0])
    return Timing(
        steps=steps,
        train_s=train_s,
        wall_s=wall,
        samples=steps * workload.workers * workload.batch_size,
        threads=int(run.provenance["torch_threads"]),
    )


def _cifar_dir(folder: Path) -> Path:
    from tests.data_factories import (
        write_cifar10_binary,  # the generator the tests use (random pixels)
    )

    write_cifar10_binary(folder, n_per_batch=64)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engines", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated: {', '.join(ENGINES)}"
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="train every workload for this many steps instead of its own length",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads per worker, every engine (default: the trainer's, "
        "each process's share of the CPUs it may run on; see relaympi.threads)",
    )
    args = parser.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--threads", args.threads)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    workloads, engines = args.workloads.split(","), args.engines.split(",")
    for name, allowed in [(w, WORKLOADS) for w in workloads] + [(e, ENGINES) for e in engines]:
        if name not in allowed:
            parser.error(f"unknown {name!r}; choose from {', '.join(allowed)}")
    print(
        f"{'workload':8} {'engine':8} {'workers':>7} {'threads':>7} {'steps':>6} "
        f"{'ms/step':>9} {'samples/s':>10} {'wall s':>7} {'vs local':>8}"
    )
    failed = False
    with tempfile.TemporaryDirectory(prefix="engines-") as tmp:
        for name in workloads:
            workload = WORKLOADS[name]
            extra = [
                *(["--threads", str(args.threads)] if args.threads is not None else []),
                *(["--steps", str(args.steps)] if args.steps is not None else []),
            ]
            if name == "vgg11":
                extra += ["--data-dir", str(_cifar_dir(Path(tmp) / "cifar10"))]
            baseline = None
            for engine in engines:
                folder = Path(tmp) / name
                folder.mkdir(exist_ok=True)
                try:
                    timing = measure(engine, workload, extra, folder)
                except RuntimeError as exc:
                    print(f"{name:8} {engine:8} failed: {exc}")
                    failed = True
                    continue
                baseline = timing if engine == "local" else baseline
                ratio = (
                    f"{baseline.train_s / timing.train_s:7.1f}x"
                    if baseline is not None
                    else f"{'-':>8}"
                )
                print(
                    f"{name:8} {engine:8} {workload.workers:7d} {timing.threads:7d} "
                    f"{timing.steps:6d} {timing.ms_per_step:9.2f} "
                    f"{timing.samples_per_s:10.0f} {timing.wall_s:7.1f} {ratio}",
                    flush=True,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

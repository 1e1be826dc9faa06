"""The batched engine against the compute it cannot avoid: N VGG-11s' forward and backward alone.

    python -m benchmarks.batched_compute --data-dir DIR --device cuda              # 16 and 64
    workers, float32 and bf16
    python -m benchmarks.batched_compute --data-dir DIR --workers 16 --batch-size 128 --steps 20

For each worker count and precision, samples/s (median step time over ``--steps`` after
``--warmup``) of:
  compute   the vmapped forward and backward of all N models (BatchedModel.gradients) on one
            fixed batch: the throughput ceiling;
  engine    the engine's step: this step's batches (indexing and augmentation on the device),
            gradients, and RelaySGD's step on double binary trees, with the losses read back
            every DEFERRED_STEPS steps (what --backend batched does on a GPU);
  engine-sync  the same with the losses read back every step (the engine before deferral).
``DIR`` holds CIFAR-10 in the binary format (e.g. tests.data_factories.write_cifar10_binary's
random pixels: a speed test). Prints one line per case and writes --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _timed(fn, sync, warmup: int, steps: int, every: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``steps`` calls (timed in groups of ``every``
    calls)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(max(1, steps // every)):
        t = time.perf_counter()
        for _ in range(every):
            fn()
        sync()
        times.append((time.perf_counter() - t) / every)
    return statistics.median(times)


def bench(
    data_dir: Path,
    device: str,
    workers: int,
    batch_size: int,
    autocast: str | None,
    warmup: int,
    steps: int,
) -> list[dict]:
    from relaympi.algorithms import AlgorithmOptions
    from relaympi.batched import BatchedOptimizer, make_batched_algorithm
    from relaympi.comm import DropPolicy
    from relaympi.engines.batched.data import BatchedData
    from relaympi.engines.batched.models import BatchedModel
    from relaympi.engines.batched.run import AUTOCAST, DEFERRED_STEPS
    from relaympi.optim import OptimizerConfig
    from relaympi.tasks import TaskOptions
    from relaympi.tasks.cifar10 import Cifar10Task
    from relaympi.tasks.partition import dirichlet_partition
    from relaympi.topology import build

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    task = Cifar10Task(TaskOptions(data_dir=data_dir, device=device))
    model = BatchedModel(task, 0, dev, autocast=AUTOCAST[autocast])
    parts = dirichlet_partition(task.train_labels, workers, 1.0, 0)
    data = BatchedData(task, parts, batch_size, 0, dev)
    X = model.stacked(workers)
    optimizer = BatchedOptimizer(OptimizerConfig(momentum=0.9, weight_decay=1e-4), X)
    algorithm = make_batched_algorithm(
        "relay",
        build("double-binary-trees", workers),
        optimizer,
        X.clone(),
        AlgorithmOptions(),
        DropPolicy(0.0, 0),
    )
    inputs, targets = data.batch(0)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    rows = []
    step = [0]

    def engine_step(read_every: int):
        def go():
            t = step[0]
            batch_inputs, batch_targets = data.batch(t)
            G, losses = model.gradients(X, batch_inputs, batch_targets)
            algorithm.step(X, G, 0.01, t)
            pending.append(losses.double())
            if len(pending) >= read_every:
                torch.stack(pending).cpu()
                pending.clear()
            step[0] += 1

        pending: list[torch.Tensor] = []
        return go

    cases = {
        "compute": lambda: model.gradients(X, inputs, targets),
        "engine": engine_step(DEFERRED_STEPS),
        "engine-sync": engine_step(1),
    }
    for name, fn in cases.items():
        seconds = _timed(fn, sync, warmup, steps, DEFERRED_STEPS if name == "engine" else 1)
        rows.append(
            {
                "case": name,
                "workers": workers,
                "batch_size": batch_size,
                "precision": autocast or "fp32",
                "device": str(dev),
                "ms_per_step": 1e3 * seconds,
                "samples_per_s": workers * batch_size / seconds,
            }
        )
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
        for row in rows:
            row["peak_memory_gib"] = peak / 2**30
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.batched_compute", description=__doc__.splitlines()[0]
    )
    p.add_argument("--data-dir", type=Path, required=True, help="CIFAR-10 in the binary format")
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument(
        "--workers", type=int, nargs="+", default=[16, 64], help="worker counts (default 16 64)"
    )
    p.add_argument(
        "--batch-size", type=int, default=128, help="samples per worker per step (default 128)"
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="float32 and/or --autocast bf16",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per case (default 16)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    for name in ("warmup", "steps", "batch_size"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(
                f"--{name.replace('_', '-')} must be "
                f"{'>= 0' if name == 'warmup' else '>= 1'}, got {getattr(args, name)}"
            )
    if any(n < 2 for n in args.workers):
        p.error(f"--workers must be >= 2 each, got {args.workers}")
    rows = []
    for workers in args.workers:
        for precision in args.precisions:
            try:
                found = bench(
                    args.data_dir,
                    args.device,
                    workers,
                    args.batch_size,
                    None if precision == "fp32" else precision,
                    args.warmup,
                    args.steps,
                )
            except torch.cuda.OutOfMemoryError as exc:
                print(
                    f"{workers} workers {precision}: out of memory ({str(exc).splitlines()[0]})",
                    flush=True,
                )
                torch.cuda.empty_cache()
                continue
            rows.extend(found)
            for row in found:
                memory = (
                    f"  peak {row['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in row else ""
                )
                print(
                    f"{row['case']:<12} n={workers:<3} {precision:<5} "
                    f"{row['ms_per_step']:8.2f} ms/step {row['samples_per_s']:10.0f} "
                    f"samples/s{memory}",
                    flush=True,
                )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

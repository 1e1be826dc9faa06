"""The anchor: one VGG-11 at the batched engine's total batch, as fast as this GPU trains it.

    python -m benchmarks.anchor --device cuda                       # batch 2048, every variant,
    --json
    python -m benchmarks.anchor --device cpu --batch-size 8 --steps 2 --warmup 1   # a dry run
    python -m benchmarks.anchor ratio --anchor anchor.json --batched b16.json b64.json

One VGG-11 (relaympi.tasks.models: no BatchNorm) trains on one fixed random batch of 32x32 images
(16 workers x 128 = 2048 samples by default): forward, cross-entropy, backward and an SGD step
(momentum 0.9, weight decay 1e-4), as samples/s over ``--steps`` after ``--warmup`` (median of
the steps' times; peak memory on a GPU). A variant names its precision and then its options:

  fp32     float32 with torch's defaults (what the batched engine runs: cuDNN may use TF32 for
           convolutions, matrix products stay IEEE float32; the row records both)
  ieee     float32, TF32 off everywhere
  tf32     TF32 on for convolutions and matrix products
  bf16     forward and backward under torch.autocast(bfloat16) (parameters and SGD in float32)
  -cl      channels_last (NHWC) model and input
  -compile torch.compile of the model (default mode)
  -graph   the whole step (forward, backward, SGD) captured once in a CUDA graph and replayed

e.g. ``bf16-cl-graph``. cudnn.benchmark is on (``--no-cudnn-benchmark``: off). A variant that fails
(out of memory, a compiler error) is a row with its error; ``--max-seconds`` starts no variant
after that much time. ``ratio`` sets the batched engine's samples/s (benchmarks.batched_compute
--json at the same total batch) against the anchor of the same precision: the eager variant with
the engine's settings ("fp32" or "bf16") and the fastest variant of that precision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GPU_VARIANTS = (
    "fp32",
    "ieee",
    "tf32",
    "bf16",
    "fp32-cl",
    "bf16-cl",
    "fp32-cl-graph",
    "bf16-cl-graph",
    "bf16-cl-compile",  # a compile takes about a minute: fp32-cl-compile on request
)
CPU_VARIANTS = ("fp32", "bf16", "fp32-cl")
PRECISIONS = ("fp32", "ieee", "tf32", "bf16")
OPTIONS = ("cl", "compile", "graph")
TARGET = 0.8  # the batched engine's samples/s over the fastest anchor of its precision


def parse_variant(name: str) -> dict[str, Any]:
    """{'precision', 'channels_last', 'compile', 'graph'} of a variant name, else ValueError."""
    precision, *options = name.split("-")
    if (
        precision not in PRECISIONS
        or any(o not in OPTIONS for o in options)
        or len(set(options)) != len(options)
    ):
        raise ValueError(
            f"variant {name!r}: a precision of {PRECISIONS} and options of {OPTIONS}, "
            "e.g. bf16-cl-graph"
        )
    if "compile" in options and "graph" in options:
        raise ValueError(f"variant {name!r}: -compile and -graph are separate variants")
    return {
        "precision": precision,
        "channels_last": "cl" in options,
        "compile": "compile" in options,
        "graph": "graph" in options,
    }


def _new_api(torch: Any) -> bool:
    return hasattr(torch.backends.cudnn, "conv") and hasattr(
        torch.backends.cudnn.conv, "fp32_precision"
    )


def _float32_precisions(torch: Any) -> tuple[Any, Any]:
    """(convolutions, matrix products) float32 switches as set, through one API (torch >= 2.9
    refuses to read a mix of its legacy and new switches)."""
    if _new_api(torch):
        return torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def _set_float32_precisions(torch: Any, conv: Any, matmul: Any) -> None:
    if _new_api(torch):
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = (
            conv,
            matmul,
        )
    else:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul


def _in_effect(value: Any) -> str:
    """'tf32' or 'ieee' for a switch's value ('none' in the new API inherits: IEEE by default)."""
    return "tf32" if value in (True, "tf32") else "ieee"


def bench_variant(
    name: str, device: str, batch_size: int, warmup: int, steps: int, cudnn_benchmark: bool
) -> dict[str, Any]:
    """One variant's row (raises on failure: the caller records the error)."""
    import torch

    from relaympi.tasks.models import VGG11, seeded

    spec = parse_variant(name)
    dev = torch.device(device)
    if spec["graph"] and dev.type != "cuda":
        raise RuntimeError("CUDA graphs need a GPU")
    before = _float32_precisions(torch), torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = cudnn_benchmark
        if spec["precision"] in ("ieee", "tf32"):
            on = spec["precision"] == "tf32"
            value = on if not _new_api(torch) else spec["precision"]
            _set_float32_precisions(torch, value, value)
        conv, matmul = _float32_precisions(torch)
        row = _bench(torch, VGG11, seeded, spec, dev, batch_size, warmup, steps)
        return {
            "variant": name,
            **spec,
            **row,
            "fp32_conv": _in_effect(conv),
            "fp32_matmul": _in_effect(matmul),
            "cudnn_benchmark": cudnn_benchmark,
            "batch_size": batch_size,
            "device": str(dev),
        }
    finally:
        _set_float32_precisions(torch, *before[0])
        torch.backends.cudnn.benchmark = before[1]


def _bench(
    torch: Any,
    vgg: Any,
    seeded: Any,
    spec: dict[str, Any],
    dev: Any,
    batch_size: int,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    fmt = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    model = seeded(0, vgg).to(dev, memory_format=fmt)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(batch_size, 3, 32, 32, generator=g).to(dev).contiguous(memory_format=fmt)
    targets = torch.randint(0, 10, (batch_size,), generator=g).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    forward = torch.compile(model) if spec["compile"] else model
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=spec["precision"] == "bf16")
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = torch.nn.functional.cross_entropy(forward(inputs), targets)
        loss.backward()
        optimizer.step()

    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if spec["graph"]:  # warm up on a side stream (the momentum buffers exist then), capture, replay
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(max(3, warmup)):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            with autocast:
                loss = torch.nn.functional.cross_entropy(forward(inputs), targets)
            loss.backward()
            optimizer.step()
        run = graph.replay
    else:
        run = step
        for _ in range(warmup):
            run()
    sync()
    setup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    row = {"ms_per_step": 1e3 * seconds, "samples_per_s": batch_size / seconds, "setup_s": setup_s}
    if cuda:
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return row


def run_main(args: argparse.Namespace) -> int:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skip: --device cuda but torch sees no GPU", flush=True)
        return 77
    variants = (
        args.variants.split(",")
        if args.variants
        else list(GPU_VARIANTS if args.device.startswith("cuda") else CPU_VARIANTS)
    )
    for name in variants:
        parse_variant(name)
    start = time.monotonic()
    info = {
        "device": args.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(torch.device(args.device))
        if args.device.startswith("cuda")
        else None,
        "batch_size": args.batch_size,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    print(
        f"# anchor: VGG-11, batch {args.batch_size}, {args.device}"
        + (f" ({info['gpu']})" if info["gpu"] else "")
        + f", torch {torch.__version__}; median of {args.steps} steps after {args.warmup}",
        flush=True,
    )
    print(
        f"{'variant':18} {'ms/step':>9} {'samples/s':>10} {'setup s':>8} {'peak GiB':>9}  "
        "conv/matmul float32",
        flush=True,
    )
    rows: list[dict[str, Any]] = []

    def save() -> None:  # after every variant: a stage cut short keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({**info, "rows": rows}, indent=1))

    for name in variants:
        if args.max_seconds is not None and time.monotonic() - start > args.max_seconds:
            rows.append(
                {
                    "variant": name,
                    **parse_variant(name),
                    "error": f"not started: past --max-seconds {args.max_seconds:g}",
                }
            )
            print(f"{name:18} not started (past --max-seconds)", flush=True)
            save()
            continue
        try:
            row = bench_variant(
                name, args.device, args.batch_size, args.warmup, args.steps, args.cudnn_benchmark
            )
        # a row that says why (out of memory, a compiler error), and on to the next
        except Exception as exc:
            error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            rows.append(
                {"variant": name, **parse_variant(name), "error": f"{type(exc).__name__}: {error}"}
            )
            print(f"{name:18} failed: {type(exc).__name__}: {error}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            save()
            continue
        rows.append(row)
        save()
        peak = f"{row['peak_memory_gib']:9.2f}" if "peak_memory_gib" in row else f"{'-':>9}"
        print(
            f"{name:18} {row['ms_per_step']:9.2f} {row['samples_per_s']:10.0f} "
            f"{row['setup_s']:8.1f} {peak}  "
            f"{row['fp32_conv']}/{row['fp32_matmul']}",
            flush=True,
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    best: dict[str, dict] = {}
    for row in (r for r in rows if "error" not in r):
        family = "bf16" if row["precision"] == "bf16" else "float32"
        if family not in best or row["samples_per_s"] > best[family]["samples_per_s"]:
            best[family] = row
    print(
        "result: fastest "
        + ", ".join(
            f"{family} {row['samples_per_s']:.0f} samples/s ({row['variant']})"
            for family, row in sorted(best.items())
        ),
        flush=True,
    )
    return 0 if best else 1


def ratios(anchor: dict[str, Any], batched: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each batched_compute row against the anchor of its precision: the eager variant with the
    engine's settings and the fastest variant of that precision (fp32: fp32, ieee, tf32)."""
    good = [r for r in anchor["rows"] if "error" not in r]
    out = []
    for row in batched:
        precision = row["precision"]
        family = [r for r in good if (r["precision"] == "bf16") == (precision == "bf16")]
        same = next((r for r in family if r["variant"] == precision), None)
        best = max(family, key=lambda r: r["samples_per_s"], default=None)
        out.append(
            {
                "case": row["case"],
                "workers": row["workers"],
                "batch_size": row["batch_size"],
                "precision": precision,
                "samples_per_s": row["samples_per_s"],
                "anchor_same": same and same["samples_per_s"],
                "vs_same": same and row["samples_per_s"] / same["samples_per_s"],
                "anchor_best": best and best["variant"],
                "vs_best": best and row["samples_per_s"] / best["samples_per_s"],
            }
        )
    return out


def ratio_main(args: argparse.Namespace) -> int:
    anchor = json.loads(args.anchor.read_text())
    batched = [row for path in args.batched for row in json.loads(path.read_text())]
    rows = ratios(anchor, batched)
    print(
        f"# the batched engine against one VGG-11 at batch {anchor['batch_size']} "
        f"({anchor['device']}); "
        f"target: engine >= {TARGET:g} x the fastest anchor of its precision"
    )
    print(
        f"{'case':12} {'workers':>7} {'batch':>5} {'prec':>5} {'samples/s':>10} "
        f"{'vs same':>8} {'vs best':>8}  best anchor"
    )
    engine = [r for r in rows if r["case"] == "engine" and r["vs_best"] is not None]
    for r in rows:
        same = f"{r['vs_same']:8.2f}" if r["vs_same"] is not None else f"{'-':>8}"
        best = f"{r['vs_best']:8.2f}" if r["vs_best"] is not None else f"{'-':>8}"
        mark = (
            ("  met" if r["vs_best"] >= TARGET else "  missed")
            if r["case"] == "engine" and r["vs_best"] is not None
            else ""
        )
        print(
            f"{r['case']:12} {r['workers']:>7} {r['batch_size']:>5} {r['precision']:>5} "
            f"{r['samples_per_s']:10.0f} {same} {best}  "
            f"{r['anchor_best'] or '-'}{mark}"
        )
    if engine:
        print(
            "result: engine/anchor "
            + ", ".join(
                f"{r['workers']} workers {r['precision']} {r['vs_best']:.2f}" for r in engine
            )
            + f" (target {TARGET:g})"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ratio"]:
        p = argparse.ArgumentParser(
            prog="python -m benchmarks.anchor ratio",
            description="the batched engine's samples/s over the anchor's",
        )
        p.add_argument("--anchor", type=Path, required=True, help="the anchor's --json")
        p.add_argument(
            "--batched",
            type=Path,
            nargs="+",
            required=True,
            help="benchmarks.batched_compute --json files",
        )
        p.add_argument("--json", type=Path, help="also write the rows here")
        return ratio_main(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.anchor", description=__doc__.splitlines()[0]
    )
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=2048,
        help="samples per step (default 2048: 16 workers x 128)",
    )
    p.add_argument(
        "--variants",
        help=f"comma-separated (default on a GPU: {','.join(GPU_VARIANTS)}; on the CPU: "
        f"{','.join(CPU_VARIANTS)})",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    p.add_argument(
        "--no-cudnn-benchmark",
        dest="cudnn_benchmark",
        action="store_false",
        help="leave cudnn.benchmark off",
    )
    p.add_argument("--max-seconds", type=float, help="start no variant after this many seconds")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch-size and --steps must be >= 1, --warmup >= 0")
    try:
        for name in (args.variants or "").split(","):
            if name:
                parse_variant(name)
    except ValueError as exc:
        p.error(str(exc))
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())

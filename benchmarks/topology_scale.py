"""Time and peak memory of `python -m relaympi.topology NAME -n N [--json]` at cluster scale.

    python -m benchmarks.topology_scale                       # every built-in, n = 1e3, 1e4, 1e5
    python -m benchmarks.topology_scale --sizes 100000 --names ring,double-binary-trees
    python -m benchmarks.topology_scale --sizes 100000 --ranks-per-node 8   # node-aware
    (--placement nodes)

Each description runs in its own subprocess (build, describe, print every edge); the table gives
its wall and CPU time (the CPU time is what a shared machine cannot inflate), its peak resident
memory (from wait4) and the bytes it printed. Families that need
a power of two (hypercube, exponential) run at the next power of two >= n; the social network has
32 ranks only and runs once. fully-connected above the command's edge limit is refused (exit 2)
in milliseconds: its n (n - 1) / 2 edges cannot be listed. With --ranks-per-node K every topology
is built with --placement nodes over nodes of K ranks (the social network, whose edges are given
rank by rank, is left out). Not a test: figures depend on the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from relaympi.entrypoint import UsageParser
from relaympi.topology import TOPOLOGY_NAMES
from relaympi.topology.graphs import SOCIAL_NETWORK_SIZE

DEFAULT_SIZES = (1_000, 10_000, 100_000)
POWERS_OF_TWO_ONLY = {"hypercube", "exponential"}
FIXED_SIZE = {"social-network", "social-network-tree"}


def world_size_for(name: str, n: int) -> int:
    """The n a family accepts for a requested n (see the module docstring)."""
    if name in FIXED_SIZE:
        return SOCIAL_NETWORK_SIZE
    if name in POWERS_OF_TWO_ONLY:
        return 1 << max(1, (n - 1).bit_length())
    return n


def measure(
    name: str, n: int, as_json: bool, ranks_per_node: int | None = None
) -> tuple[int, float, float, float, int]:
    """(exit status, wall seconds, CPU seconds, peak RSS in MiB, bytes printed) of one description
    (node-aware over nodes of ranks_per_node ranks if given)."""
    argv = [sys.executable, "-m", "relaympi.topology", name, "-n", str(n)] + (
        ["--json"] if as_json else []
    )
    if ranks_per_node is not None:
        argv += ["--placement", "nodes", "--ranks-per-node", str(ranks_per_node)]
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        printed = out.seek(0, os.SEEK_END)
    cpu = usage.ru_utime + usage.ru_stime
    # ru_maxrss: KiB on Linux
    return (process.returncode, seconds, cpu, usage.ru_maxrss / 1024, printed)


def main(argv: Sequence[str] | None = None) -> int:
    parser = UsageParser(
        prog="python -m benchmarks.topology_scale", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="comma-separated world sizes (default: %(default)s)",
    )
    parser.add_argument(
        "--names",
        default=",".join(TOPOLOGY_NAMES),
        help="comma-separated topology names (default: every built-in)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        metavar="K",
        help="build node-aware (--placement nodes) over nodes of K ranks",
    )
    args = parser.parse_args(argv)
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        parser.error(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if any(n < 1 for n in sizes):
        parser.error(f"--sizes must be >= 1, got {args.sizes!r}")
    names = args.names.split(",")
    if args.ranks_per_node is not None:
        names = [name for name in names if name not in FIXED_SIZE]
    unknown = [name for name in names if name not in TOPOLOGY_NAMES]
    if unknown:
        parser.error(
            f"--names: unknown topology {unknown[0]!r}; allowed: {', '.join(TOPOLOGY_NAMES)}"
        )
    print(
        f"{'topology':<22}{'n':>8}  "
        f"{'output':<6}{'exit':>5}{'wall s':>8}{'CPU s':>7}{'peak MiB':>10}{'printed MiB':>13}"
    )
    done = set()
    for name in names:
        for requested in sizes:
            n = world_size_for(name, requested)
            if (name, n) in done:
                continue
            done.add((name, n))
            for as_json in (False, True):
                status, seconds, cpu, peak, printed = measure(name, n, as_json, args.ranks_per_node)
                print(
                    f"{name:<22}{n:>8}  "
                    f"{'json' if as_json else 'text':<6}{status:>5}{seconds:>8.2f}{cpu:>7.2f}"
                    f"{peak:>10.0f}{printed / 2**20:>13.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)

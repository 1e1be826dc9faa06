"""Memory-bandwidth limit of the communication benchmark: a STREAM triad, and bytes moved per
exchange.

    mpirun -n 16 python -m benchmarks.membw triad --out triad.json           # the node's triad
    bandwidth (~10 s)
    python -m benchmarks.membw model --ranks 16 --numel 9225610 --triad triad.json \\
        --comm bench-results/scaling/n16.h5                                  # table: measured vs
        limit
    python -m benchmarks.membw model --ranks 16 --numel 9225610              # the byte model alone

On one node every MPI transfer is a memcpy through shared memory, so an exchange can go no
faster than its bytes moved through memory over the node's memory bandwidth.

Convention (triad and model alike): bytes moved = bytes read + bytes written, each array an
operation streams counted once per read and once per write; write-allocate (the read of a
line before a non-streaming store) is NOT counted. The triad a = b + s*c thus counts 12 bytes
per element (STREAM's convention). With write-allocate every write costs one more read: the
JSON output also carries reads and writes apart, so both conventions can be recomputed.

The model (``traffic``: a pure function of topology, size and transport) follows exactly what
each case of ``benchmarks.comm`` runs per timed repetition (float32, host buffers):

- "raw isend/irecv T": RelaySum's messages (block + counter, to and from every tree neighbour),
  Irecv/Isend only: MPI's copies only.
- "relaysum T" (``RelaySum.exchange``: assembly, then the transfers): a node of degree k per
  layer with messages of m = block + 1 elements: k = 1 (leaf) sends a view of its parcel (no
  pass); k = 2 reads parcel and both received rows and writes both rows (3m read, 2m written);
  k >= 3 sums its k rows into a scratch total, adds the parcel and writes every row = total -
  row ((k + 1)m read, (k + 1)m written; when the previous step's ``add_received`` left the sum
  in total, as in the RelaySGD step, (k + 2)m read, (k + 1)m written). The passes run over one
  cache block (32k elements) at a time, so an array reused within a block is counted once.
- "relaysum in-place T": as above, plus each relayed chunk lands from the bounce buffer into
  its row (read m, write m per message received by a node of degree >= 2).
- "relaysgd step double-binary-trees" (SGD, no momentum): the update u = -lr g and x += u
  (read g, x; write u, x), RelaySum of x as above (with the sum kept), then ``add_received``
  with the division: read x and the k received payloads (k >= 3: and write the total), write x.
- "allreduce" (MPI_Allreduce of d elements, in place): a bandwidth-optimal reduce-scatter +
  allgather (ring, or MPICH's recursive halving/doubling, same volume): each rank sends and
  receives 2 (n-1)/n d elements and reduces (n-1)/n d elements (read 2, write 1). MPICH's
  temporary-buffer copies are not counted.
- MPI's transfers (``copies``): 2 (default): the sender copies the message into a shared
  buffer and the receiver copies it out, each copy reading and writing the message (4 x the
  message's bytes per transfer, 2 x on each side); 1: single copy (CMA, XPMEM, KNEM), the
  receiver reads the sender's buffer and writes its own (2 x per transfer). The shared buffer
  is counted as memory traffic (not assumed to stay in cache). The single-copy total is also
  what two copies through a shared buffer that stays in cache move (the sender reads the
  message, the receiver writes it): the two models bracket the transport. Counters and
  per-message bookkeeping of O(1) elements are not counted.

The memory-bound limit of a case is max(sum over ranks of its bytes / aggregate triad
bandwidth (all ranks streaming at once), largest rank's bytes / one rank's triad bandwidth
(that rank streaming alone)); the ratio is the measured time (median over repetitions of the
slowest rank) over that limit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relaympi.entrypoint import UsageParser
from relaympi.topology import Topology, build

FLOAT32 = 4  # bytes per element: benchmarks.comm times float32 buffers
TRIAD_BYTES_PER_ELEMENT = 3 * FLOAT32  # a = b + s*c: read b, c; write a (no write-allocate)
COPY_MODELS = (1, 2)


@dataclass(frozen=True)
class Traffic:
    """Bytes read and written per rank by one operation (arrays of length world_size)."""

    reads: np.ndarray
    writes: np.ndarray

    @property
    def per_rank(self) -> np.ndarray:
        return self.reads + self.writes

    @property
    def total(self) -> float:
        return float(self.per_rank.sum())


class _Ledger:
    """Elements read and written per rank, kept in elements until the end."""

    def __init__(self, world_size: int):
        self.reads = np.zeros(world_size)
        self.writes = np.zeros(world_size)

    def add(self, rank: int, read: float = 0.0, written: float = 0.0) -> None:
        self.reads[rank] += read
        self.writes[rank] += written

    def transfer(self, sender: int, receiver: int, elements: float, copies: int) -> None:
        if copies == 2:  # sender: message -> shared buffer; receiver: shared buffer -> its buffer
            self.add(sender, elements, elements)
            self.add(receiver, elements, elements)
        else:  # single copy: the receiver reads the sender's buffer and writes its own
            self.add(receiver, elements, elements)

    def traffic(self) -> Traffic:
        return Traffic(FLOAT32 * self.reads, FLOAT32 * self.writes)


def _check_copies(copies: int) -> None:
    if copies not in COPY_MODELS:
        raise ValueError(f"copies must be one of {COPY_MODELS}, got {copies}")


def _messages(ledger: _Ledger, topology: Topology, numel: int, copies: int) -> None:
    """Every RelaySum message (block + counter) sent along every edge of every layer, both ways."""
    for layer, block in enumerate(topology.coordinate_blocks(numel)):
        m = block.stop - block.start + 1
        for rank in range(topology.world_size):
            for peer in topology.neighbors(rank, layer):
                ledger.transfer(rank, peer, m, copies)


def _assembly(
    ledger: _Ledger, topology: Topology, numel: int, sum_kept: bool, in_place: bool
) -> None:
    """RelaySum._assemble per rank and layer (and, in place, _land's copies out of the bounce
    buffer)."""
    for layer, block in enumerate(topology.coordinate_blocks(numel)):
        m = block.stop - block.start + 1
        for rank in range(topology.world_size):
            k = topology.degree(rank, layer)
            if k == 2:  # rows[b] += parcel; rows[a] += parcel
                ledger.add(rank, 3 * m, 2 * m)
            elif k >= 3:  # total = sum of rows (or kept), total += parcel, rows = total - rows
                ledger.add(rank, (k + 2 if sum_kept else k + 1) * m, (k + 1) * m)
            if in_place and k >= 2:  # each received chunk: bounce buffer -> its row
                ledger.add(rank, k * m, k * m)


def traffic(case: str, topology: Topology | None, numel: int, copies: int = 2) -> Traffic:
    """Bytes read and written per rank by one timed repetition of a benchmarks.comm case.

    ``case`` is one of "raw", "relaysum", "relaysum-in-place", "relaysgd-step" (over
    ``topology``) and "allreduce" (``topology`` gives only the world size)."""
    _check_copies(copies)
    if numel < 1:
        raise ValueError(f"numel must be positive, got {numel}")
    if topology is None:
        raise ValueError("traffic needs a topology (its world size at least)")
    n = topology.world_size
    ledger = _Ledger(n)
    if case == "allreduce":
        if n > 1:
            # reduce-scatter + allgather, sent (and received) per rank
            moved = 2 * (n - 1) / n * numel
            for rank in range(n):  # ring: every rank sends to its successor
                ledger.transfer(rank, (rank + 1) % n, moved, copies)
                ledger.add(rank, 2 * (n - 1) / n * numel, (n - 1) / n * numel)  # reductions
        return ledger.traffic()
    if case not in ("raw", "relaysum", "relaysum-in-place", "relaysgd-step"):
        raise ValueError(
            f"unknown case {case!r}; choose raw, relaysum, relaysum-in-place, "
            "relaysgd-step or allreduce"
        )
    if not topology.is_tree:
        raise ValueError(f"RelaySum needs a tree topology; {topology.name!r} is not")
    _messages(ledger, topology, numel, copies)
    if case == "raw":
        return ledger.traffic()
    step = case == "relaysgd-step"
    _assembly(ledger, topology, numel, sum_kept=step, in_place=case == "relaysum-in-place")
    if step:
        for rank in range(n):
            # u = -lr g (read g, write u); x += u (read x, write x)
            ledger.add(rank, 2 * numel, 2 * numel)
            for layer, block in enumerate(topology.coordinate_blocks(numel)):
                s, k = block.stop - block.start, topology.degree(rank, layer)
                # add_received: x += the k payloads (k >= 3: through total), x /= n-bar
                ledger.add(rank, (k + 1) * s, (2 if k >= 3 else 1) * s)
    return ledger.traffic()


# benchmarks.comm's operation names -> (model case, topology name); "allreduce" over any topology
COMM_CASES = {
    "raw isend/irecv chain": ("raw", "chain"),
    "raw isend/irecv double-binary-trees": ("raw", "double-binary-trees"),
    "relaysum chain": ("relaysum", "chain"),
    "relaysum double-binary-trees": ("relaysum", "double-binary-trees"),
    "relaysum in-place chain": ("relaysum-in-place", "chain"),
    "relaysum in-place double-binary-trees": ("relaysum-in-place", "double-binary-trees"),
    "relaysgd step double-binary-trees": ("relaysgd-step", "double-binary-trees"),
    "allreduce": ("allreduce", "chain"),
}


def comm_case_traffic(op: str, world_size: int, numel: int, copies: int = 2) -> Traffic | None:
    """The model of a benchmarks.comm operation by its name (None: not modelled, e.g. gossip,
    SGP)."""
    if op not in COMM_CASES:
        return None
    case, topo_name = COMM_CASES[op]
    if world_size == 1:
        return Traffic(np.zeros(1), np.zeros(1)) if case == "allreduce" else None
    return traffic(case, build(topo_name, world_size), numel, copies)


def memory_limit(t: Traffic, triad: dict) -> tuple[float, str]:
    """Seconds the traffic needs at best, and which bound binds ("aggregate" or "one rank")."""
    aggregate = t.total / (triad["aggregate_gbs"] * 1e9)
    single = float(t.per_rank.max()) / (triad["single_rank_gbs"] * 1e9)
    return (aggregate, "aggregate") if aggregate >= single else (single, "one rank")


def table(rows: list[dict], world_size: int, triad: dict | None, copies: int) -> list[dict]:
    """One line per modelled measurement: rows are benchmarks.comm's (op, numel, median_s)."""
    out = []
    for r in rows:
        t = comm_case_traffic(r["op"], world_size, r["numel"], copies)
        if t is None:
            continue
        line = {
            "op": r["op"],
            "numel": int(r["numel"]),
            "measured_ms": 1e3 * r["median_s"] if r.get("median_s") is not None else None,
            "model_gb": t.total / 1e9,
            "model_read_gb": float(t.reads.sum()) / 1e9,
            "model_write_gb": float(t.writes.sum()) / 1e9,
            "max_rank_gb": float(t.per_rank.max()) / 1e9,
        }
        if triad is not None:
            limit, bound = memory_limit(t, triad)
            line["limit_ms"], line["bound"] = 1e3 * limit, bound
            measured = line["measured_ms"]
            line["ratio"] = (
                measured / line["limit_ms"] if measured is not None and limit > 0 else None
            )
            line["achieved_gbs"] = t.total / (measured / 1e3) / 1e9 if measured else None
        out.append(line)
    return out


# -- the triad ---------------------------------------------------------------------------------


def triad(comm, elements: int, reps: int) -> dict:
    """a = b + s*c over arrays of ``elements`` float32 on every rank: best of ``reps`` lockstep
    repetitions with all ranks, then with rank 0 alone (the others wait at a barrier)."""
    import torch

    torch.set_num_threads(1)
    # touched: pages exist
    a, b, c = (torch.full((elements,), v, dtype=torch.float32) for v in (0.0, 1.0, 2.0))
    torch.add(b, c, alpha=3.0, out=a)  # warm-up

    def timed(active: bool) -> float:
        comm.barrier()
        start = time.perf_counter()
        if active:
            torch.add(b, c, alpha=3.0, out=a)
        return float(
            comm.allreduce_flags(np.array([time.perf_counter() - start if active else 0.0]))[0]
        )

    together = [timed(True) for _ in range(reps)]
    alone = [timed(comm.rank == 0) for _ in range(reps)]
    if not bool(np.all(a[:: max(1, elements // 97)].numpy() == 7.0)):
        raise RuntimeError("triad result is wrong: a != b + 3 c")
    per_rank = TRIAD_BYTES_PER_ELEMENT * elements
    n = comm.world_size
    return {
        "ranks": n,
        "elements_per_array": elements,
        "array_mib": elements * FLOAT32 / 2**20,
        "reps": reps,
        "bytes_per_element": TRIAD_BYTES_PER_ELEMENT,
        "write_allocate_counted": False,
        "aggregate_gbs": n * per_rank / min(together) / 1e9,
        "single_rank_gbs": per_rank / min(alone) / 1e9,
        "aggregate_seconds": together,
        "single_rank_seconds": alone,
        "torch_threads": torch.get_num_threads(),
        "host": socket.gethostname(),
        "cores": len(os.sched_getaffinity(0)),
    }


# -- CLI ---------------------------------------------------------------------------------------


def _read_comm(paths: list[Path], p: argparse.ArgumentParser) -> tuple[int, list[dict]]:
    import h5py

    world, rows = None, []
    for path in paths:
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            p.error(f"cannot read --comm file {str(path)!r}: {e}")
        with f:
            if "op" not in f or "median_s" not in f:
                p.error(
                    f"{str(path)!r} is not a benchmarks.comm result (no 'op'/'median_s' datasets)"
                )
            size = int(f.attrs["world_size"])
            if world is not None and size != world:
                p.error(f"--comm files mix world sizes {world} and {size}")
            world = size
            ops = [o.decode() if isinstance(o, bytes) else str(o) for o in f["op"][()]]
            rows += [
                {"op": o, "numel": int(d), "median_s": float(s)}
                for o, d, s in zip(ops, f["numel"][()], f["median_s"][()], strict=True)
            ]
    if world is None:
        p.error("--comm names no result file")
    return world, rows


def _print_table(lines: list[dict], world_size: int, triad: dict | None, copies: int) -> None:
    print(
        f"# {world_size} ranks; float32; bytes moved = read + written, write-allocate not "
        f"counted; MPI transfer = {copies} cop{'ies' if copies == 2 else 'y'}"
    )
    if triad is not None:
        print(
            f"# triad ({triad['ranks']} ranks, {triad['array_mib']:.0f} MiB arrays, best "
            f"of {triad['reps']}): "
            f"aggregate {triad['aggregate_gbs']:.1f} GB/s, one rank alone "
            f"{triad['single_rank_gbs']:.1f} GB/s"
        )
    head = (
        f"{'case':38s} {'float32s':>10s} {'measured ms':>12s} {'model GB':>9s} {'max/rank GB':>11s}"
    )
    if triad is not None:
        head += f" {'limit ms':>9s} {'bound':>9s} {'ratio':>6s} {'GB/s':>7s}"
    print(head)
    for x in lines:
        ms = "" if x["measured_ms"] is None else f"{x['measured_ms']:.3f}"
        row = (
            f"{x['op']:38s} {x['numel']:>10d} {ms:>12s} {x['model_gb']:>9.4f} "
            f"{x['max_rank_gb']:>11.4f}"
        )
        if triad is not None:
            ratio = "" if x["ratio"] is None else f"{x['ratio']:.2f}x"
            gbs = "" if x.get("achieved_gbs") is None else f"{x['achieved_gbs']:.1f}"
            row += f" {x['limit_ms']:>9.3f} {x['bound']:>9s} {ratio:>6s} {gbs:>7s}"
        print(row)


def _model(args, p: argparse.ArgumentParser) -> int:
    triad_result = None
    if args.triad is not None:
        try:
            triad_result = json.loads(args.triad.read_text())
            float(triad_result["aggregate_gbs"]), float(triad_result["single_rank_gbs"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(
                f"--triad {str(args.triad)!r} is not a triad result of `benchmarks.membw "
                f"triad`: {e}"
            )
    if args.comm:
        world, rows = _read_comm(args.comm, p)
        if args.ranks is not None and args.ranks != world:
            p.error(f"--ranks {args.ranks} but the --comm results are for {world} ranks")
        if args.numel is not None:
            rows = [r for r in rows if r["numel"] == args.numel]
            if not rows:
                p.error(f"--numel {args.numel} is not among the sizes in the --comm results")
    else:
        if args.ranks is None or args.numel is None:
            p.error("without --comm, give --ranks and --numel")
        world = args.ranks
        rows = [{"op": op, "numel": args.numel, "median_s": None} for op in COMM_CASES]
    if world < 1:
        p.error(f"--ranks must be >= 1, got {world}")
    lines = table(rows, world, triad_result, args.copies)
    if args.json:
        print(
            json.dumps(
                {"world_size": world, "copies": args.copies, "triad": triad_result, "cases": lines},
                indent=1,
            )
        )
    else:
        _print_table(lines, world, triad_result, args.copies)
    return 0


def _triad(args, p: argparse.ArgumentParser) -> int:
    from relaympi.comm import mpi_communicator

    if args.mib <= 0 or args.reps < 1:
        p.error(f"--mib must be positive and --reps >= 1, got {args.mib} and {args.reps}")
    elements = max(1, int(args.mib * 2**20) // FLOAT32)
    comm = mpi_communicator()
    if comm.rank == 0:
        print(
            f"# triad a = b + s*c: {comm.world_size} ranks x 3 arrays x {elements} "
            f"float32 ({args.mib:g} MiB each), best of {args.reps}",
            flush=True,
        )
    result = triad(comm, elements, args.reps)
    if comm.rank == 0:
        print(
            f"# aggregate {result['aggregate_gbs']:.1f} GB/s ({comm.world_size} ranks at "
            "once), one rank alone "
            f"{result['single_rank_gbs']:.1f} GB/s; 12 bytes per element, write-allocate "
            "not counted"
        )
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = UsageParser(prog="python -m benchmarks.membw", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "triad", help="measure the node's memory bandwidth (run under mpirun, one rank per core)"
    )
    # 128: 3 x 128 MiB per rank is beyond a 300 MiB L3 even for one rank alone; with 64 MiB arrays,
    # 16 ranks measured ~20% less than with 128 or 256 on an H100 node (16 cores, 300 MiB L3)
    t.add_argument(
        "--mib",
        type=float,
        default=128.0,
        help="MiB per array per rank (default 128: 3 arrays, beyond cache)",
    )
    t.add_argument("--reps", type=int, default=10, help="repetitions; the best counts (default 10)")
    t.add_argument("--out", type=Path, help="JSON file for the result")
    m = sub.add_parser(
        "model", help="bytes moved per benchmarks.comm case, and the memory-bound limit"
    )
    m.add_argument("--ranks", type=int, help="world size (default: the --comm results')")
    m.add_argument(
        "--numel", type=int, help="float32 elements (default: every size in the --comm results)"
    )
    m.add_argument("--triad", type=Path, help="JSON of `benchmarks.membw triad --out`")
    m.add_argument(
        "--comm",
        type=Path,
        nargs="+",
        help="HDF5 results of `benchmarks.comm --out` (one world size)",
    )
    m.add_argument(
        "--copies",
        type=int,
        choices=COPY_MODELS,
        default=2,
        help="memory copies per MPI transfer counted (default 2: through a shared buffer; 1: "
        "single copy, or a shared buffer in cache)",
    )
    m.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    if args.command == "triad":
        return _triad(args, t)
    return _model(args, m)


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)

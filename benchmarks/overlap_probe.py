"""Does an MPI transfer progress while the rank computes? The question behind RelaySum's pipelining.

    mpirun -n 16 python -m benchmarks.overlap_probe          # pairs r <-> r^1, 9.2M float32 each
    way
    MPIR_CVAR_ASYNC_PROGRESS=1 mpirun -n 8 python -m benchmarks.overlap_probe   # MPICH progress
    thread

Prints, for the slowest rank (median of repetitions): the transfer alone, three elementwise
passes alone, both one after the other, both with the transfer posted first and no MPI call
during the passes, the same with Testall calls between 32 pieces of the passes ("poked"), with
an Iprobe instead ("iprobed"), with relaympi's progress thread polling every --interval ms and no
MPI call from the rank ("threaded": --progress-thread), and the passes alone with that thread
polling ("passes+thread": what the thread costs the computation). If "overlap" equals
"sequential", the transport moves data only inside MPI calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from relaympi.comm.base import PROGRESS_INTERVAL_S


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overlap_probe", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--numel", type=int, default=9_225_610, help="float32 elements sent each way (VGG-11's)"
    )
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--pieces", type=int, default=32, help="Testall calls during the passes, for 'poked'"
    )
    p.add_argument(
        "--interval",
        type=float,
        default=1e3 * PROGRESS_INTERVAL_S,
        help=f"the progress thread's poll period in ms, for "
        f"'threaded' (default {1e3 * PROGRESS_INTERVAL_S:g}: --progress-thread's)",
    )
    args = p.parse_args(argv)
    from mpi4py import MPI

    from relaympi.comm.progress import ProgressThread

    comm = MPI.COMM_WORLD
    if comm.size < 2 or comm.size % 2:
        print(
            "error: run under mpirun with an even number of ranks, e.g. mpirun -n 2",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    peer, n = comm.rank ^ 1, args.numel
    send, recv = torch.ones(n), torch.zeros(n)
    a, b = torch.randn(n), torch.randn(n)

    def passes(pieces: int = 1, requests: list | None = None, iprobe: bool = False) -> None:
        step = n // pieces
        for i in range(pieces):
            part = slice(i * step, n if i == pieces - 1 else (i + 1) * step)
            a[part].add_(b[part]).mul_(0.5).add_(b[part])
            if requests is not None:
                MPI.Request.Testall(requests)
            if iprobe:
                comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def post() -> list:
        return [comm.Irecv(recv.numpy(), source=peer), comm.Isend(send.numpy(), dest=peer)]

    def timed(fn) -> float:
        samples = []
        for _ in range(args.reps):
            comm.Barrier()
            start = time.perf_counter()
            fn()
            samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        return 1e3 * statistics.median(samples[1:])

    def overlapped(pieces: int, poke: bool, iprobe: bool = False) -> None:
        requests = post()
        passes(pieces, requests if poke else None, iprobe)
        MPI.Request.Waitall(requests)

    thread = (
        ProgressThread(comm.Dup(), args.interval * 1e-3)
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE
        else None
    )

    # the transfer posted, then the passes with the thread polling (no MPI call from the rank)
    def threaded() -> None:
        assert thread is not None  # timed only with a thread
        requests = post()
        with thread.running():
            passes()
        MPI.Request.Waitall(requests)

    def sequential() -> None:
        MPI.Request.Waitall(post())
        passes()

    def passes_with_thread() -> None:
        assert thread is not None  # timed only with a thread
        with thread.running():
            passes()

    figures = {
        "transfer": timed(lambda: MPI.Request.Waitall(post())),
        "passes": timed(passes),
        "sequential": timed(sequential),
        "overlap": timed(lambda: overlapped(1, poke=False)),
        "poked": timed(lambda: overlapped(args.pieces, poke=True)),
        "iprobed": timed(lambda: overlapped(args.pieces, poke=False, iprobe=True)),
    }
    if thread is not None:
        figures["threaded"] = timed(threaded)
        figures["passes+thread"] = timed(passes_with_thread)
        thread.close()
    if comm.rank == 0:
        print(
            f"ranks {comm.size}: "
            + "  ".join(f"{name} {ms:.1f} ms" for name, ms in figures.items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many torch threads a process may use: its share of the CPUs it is allowed to run on.

The rule (the trainer's default for ``--threads``; ``benchmarks.engines`` leaves it to the trainer):

1. Start from the CPUs this process may run on (``os.sched_getaffinity``: taskset, SLURM cpusets,
   cgroups), never ``os.cpu_count()``: a job is often given a few of a node's many cores.
2. Divide them among the processes (or in-process workers) that compute on the same CPUs at once.
   Under MPI these are the node-local ranks whose allowed CPUs overlap this rank's, this rank
   included (the trainer compares the sets over a node-local communicator). Where ranks are bound
   (``srun --cpu-bind=cores``, ``mpirun -bind-to core``) no other rank shares a rank's CPUs, so
   each keeps its whole set; where they are not, every node-local rank sees the same set and gets
   an equal share of it.
3. Cap by ``OMP_NUM_THREADS`` and ``SLURM_CPUS_PER_TASK`` where set (the user's or the scheduler's
   word on threads per process).
4. At least 1.

An explicit ``--threads N`` wins over the rule (with a warning when N exceeds the share).

The batched engine, on a CPU, also times its first step with the rule's count and with 1 thread
(``time_thread_counts``) and keeps the faster: threads that meet at every operation wait for a core
each time when other processes hold the cores, which can make a small model's step many times
slower than one thread's. Where the counts give different numbers it keeps the rule's.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

# environment variables that cap threads per process, in the order they are reported
CAP_VARIABLES = ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (every CPU where the platform cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows: no affinity query
        return frozenset(range(os.cpu_count() or 1))


def sharers(mine: Collection[int], node_cpu_sets: Iterable[Collection[int]]) -> int:
    """How many processes of a node compute on this process's CPUs: those whose sets overlap
    ``mine``.

    ``node_cpu_sets`` holds every node-local process's allowed CPUs, this process's included.
    """
    mine = frozenset(mine)
    return max(1, sum(1 for cpus in node_cpu_sets if mine & frozenset(cpus)))


def env_cap(env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """The smallest positive cap from OMP_NUM_THREADS / SLURM_CPUS_PER_TASK and its variable, or
    None.

    OMP_NUM_THREADS may list one count per nesting level ("4,2"): the first is this level's.
    Values that are not positive integers are ignored (OpenMP ignores them too).
    """
    env = os.environ if env is None else env
    caps = []
    for var in CAP_VARIABLES:
        value = env.get(var, "").split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            caps.append((int(value), var))
    return min(caps) if caps else None


def share(cpus: Collection[int], sharing: int) -> int:
    """This process's share of ``cpus`` when ``sharing`` processes compute on them (at least 1)."""
    return max(1, len(cpus) // max(1, sharing))


def default_threads(
    cpus: Collection[int], sharing: int = 1, env: Mapping[str, str] | None = None
) -> int:
    """torch threads for a process allowed on ``cpus`` that ``sharing`` processes use at once (the
    rule above)."""
    threads = share(cpus, sharing)
    cap = env_cap(env)
    return min(threads, cap[0]) if cap else threads


# -- a busy machine ---------------------------------------------------------------------------
def busy_machine(load: float | None = None, cpus: int | None = None) -> str | None:
    """A one-line warning when the machine runs more tasks than it has CPUs, else None.

    ``load`` is the 1-minute load average (``os.getloadavg``; where the platform has none, no
    warning) and ``cpus`` the CPUs it counts over: the machine's, since the load average counts
    every runnable task of the machine (on a node shared through cpusets, other jobs' load on
    their own cores would otherwise read as contention on ours). On a machine this busy, threads
    that meet at every operation wait for a core each time, and timings vary from run to run.
    """
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # Windows: no load average
            return None
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    if load <= cpus:
        return None
    return (
        f"this machine is busy: load average {load:.1f} on its {cpus} CPU(s), so other "
        "processes hold the cores; steps will be slower and timings noisier than on an idle "
        "machine"
    )


# -- timing thread counts -----------------------------------------------------------------------
@dataclass(frozen=True)
class ThreadTiming:
    """What ``time_thread_counts`` measured: the median seconds of a trial per count, and the
    count that took the least (the first candidate on ties)."""

    seconds: dict[int, float]

    @property
    def fastest(self) -> int:
        order = list(self.seconds)
        return min(order, key=lambda count: (self.seconds[count], order.index(count)))

    def describe(self) -> str:
        return ", ".join(
            f"{1e3 * seconds:.1f} ms with {count} thread{'s' if count > 1 else ''}"
            for count, seconds in self.seconds.items()
        )


def time_thread_counts(
    candidates: Sequence[int],
    trial: Callable[[int], float],
    rounds: int = 3,
    budget_s: float = 5.0,
    clock: Callable[[], float] = time.perf_counter,
) -> ThreadTiming:
    """Time ``trial(count)`` (which returns its own seconds) for each candidate count, in rounds.

    A first round warms every count up (first calls allocate, spawn threads) and is not counted.
    Each later round runs every candidate once, in the opposite order to the round before, so that
    a machine whose load drifts favours none. A round is not begun once ``budget_s`` seconds went
    by (a slow trial needs fewer rounds to tell a difference; at least one counted round runs).
    """
    candidates = list(dict.fromkeys(candidates))
    samples: dict[int, list[float]] = {count: [] for count in candidates}
    start = clock()
    for count in candidates:
        trial(count)
    for index in range(rounds):
        if index and clock() - start > budget_s:
            break
        for count in candidates if index % 2 == 0 else candidates[::-1]:
            samples[count].append(trial(count))
    return ThreadTiming({count: statistics.median(times) for count, times in samples.items()})

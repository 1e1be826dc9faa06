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
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping

# environment variables that cap threads per process, in the order they are reported
CAP_VARIABLES = ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (every CPU where the platform cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows: no affinity query
        return frozenset(range(os.cpu_count() or 1))


def sharers(mine: Collection[int], node_cpu_sets: Iterable[Collection[int]]) -> int:
    """How many processes of a node compute on this process's CPUs: those whose sets overlap ``mine``.

    ``node_cpu_sets`` holds every node-local process's allowed CPUs, this process's included.
    """
    mine = frozenset(mine)
    return max(1, sum(1 for cpus in node_cpu_sets if mine & frozenset(cpus)))


def env_cap(env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """The smallest positive cap from OMP_NUM_THREADS / SLURM_CPUS_PER_TASK and its variable, or None.

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


def default_threads(cpus: Collection[int], sharing: int = 1, env: Mapping[str, str] | None = None) -> int:
    """torch threads for a process allowed on ``cpus`` that ``sharing`` processes use at once (the rule above)."""
    threads = share(cpus, sharing)
    cap = env_cap(env)
    return min(threads, cap[0]) if cap else threads

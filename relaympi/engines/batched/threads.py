"""The batched engine's torch threads on a CPU: the faster of the rule's count and 1 thread.

relaympi.threads' rule gives one batched process every CPU it may run on. Its threads meet at
every operation, and a small model's step is thousands of short operations: where other processes
hold the cores, each meeting waits for a descheduled thread (the default digits run on two busy
cores: 5 to 70 times slower than one thread). So before the run starts, ``choose_threads`` times
the run's first step, gradient and algorithm step, with each count on copies of the models and of
the algorithm's state (the run itself is untouched), and keeps the faster.

A run's numbers must not depend on the machine's load: the trials' models and gradients are
compared bit for bit, and where the counts give different numbers (a matrix product may sum in
another order with more threads) the rule's count is kept.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from relaympi.threads import ThreadTiming, time_thread_counts

# Models (all workers' parameters) above this size are not timed: each trial copies them and the
# algorithm's state, and a step over this much data spends long enough in each operation that
# threads waiting for one another at its end cost a small part of it. The default digits run's
# 16 models are 0.3 MiB; 16 VGG-11s (9.2M floats each) are 590 MiB.
TIMED_MAX_BYTES = 64 << 20


def times_threads(X: torch.Tensor, threads_flag: int | None) -> bool:
    """Whether a batched run on X chooses its threads by timing: on a CPU, without --threads,
    with more than one thread to give up, and models no larger than TIMED_MAX_BYTES."""
    return (
        threads_flag is None
        and X.device.type == "cpu"
        and torch.get_num_threads() > 1
        and X.numel() * X.element_size() <= TIMED_MAX_BYTES
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def choose_threads(
    engine: Any,
    algorithm: Any,
    lr: float,
    step: int = 0,
    timer: Callable[..., ThreadTiming] | None = None,
) -> tuple[int, str | None]:
    """Set torch's threads to the faster of the current count (the rule's) and 1 at step ``step``
    of ``engine`` (its X, gradient(step)) and ``algorithm`` (step(X, G, lr, step)); return the
    count and a line saying why where it is not the rule's (None where it is).

    ``timer(candidates, trial)`` is relaympi.threads.time_thread_counts (tests pass stand-ins).
    """
    timer = timer or time_thread_counts
    rule = torch.get_num_threads()
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def trial(count: int) -> float:
        torch.set_num_threads(count)
        X, stepper = engine.X.clone(), copy.deepcopy(algorithm)
        start = time.perf_counter()
        G, _ = engine.gradient(step)
        stepper.step(X, G, lr, step)
        seconds = time.perf_counter() - start
        results.setdefault(count, (G, X))
        return seconds

    try:
        timing = timer([rule, 1], trial)
    finally:
        torch.set_num_threads(rule)
    G0, X0 = results[rule]
    if not all(_same_bits(G, G0) and _same_bits(X, X0) for G, X in results.values()):
        return rule, None  # the counts' numbers differ: the rule's, as without timing
    chosen = timing.fastest
    torch.set_num_threads(chosen)
    if chosen == rule:
        return rule, None
    return chosen, (
        f"torch threads: {chosen} instead of {rule}, the faster here now (the first step took "
        f"{timing.describe()}); --threads N sets the count"
    )

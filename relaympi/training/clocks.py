"""Step timing for the training loop: host-clock or CUDA-event marks, and the steps whose loss and
times are read later (deferred checks on a GPU)."""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import numpy as np
import torch


class Pending(NamedTuple):
    """A step whose loss and times are not read yet (device values while checks are deferred)."""

    step: int
    loss: Any  # float, numpy [N], or a device tensor
    start: Any  # clock marks
    computed: Any
    stepped: Any


class HostClock:
    """Times with the host clock; on a GPU, each mark waits for the device (the step split into
    compute and communication needs it)."""

    def __init__(self, x: torch.Tensor | None):
        self._sync = (
            (lambda: torch.cuda.synchronize(x.device))
            if x is not None and x.is_cuda
            else (lambda: None)
        )

    def mark(self) -> float:
        self._sync()
        return time.perf_counter()

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class EventClock:
    """Times with CUDA events: marks queue on the device's stream and never stall the host;
    a duration is read once its end event completed (the settle's synchronization)."""

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def settle(loop: Any, pending: list[Pending]) -> int | None:
    """Account the pending steps' losses and times on ``loop`` (a TrainingLoop: its timers, running
    loss, last loss and finiteness flag) with one host read for all of them.

    Args:
        loop: the training loop whose steps these are.
        pending: the steps not read yet; emptied.

    Returns:
        The step a divergence is recorded at (the first step with a non-finite loss, or whose model
        was non-finite at the evaluation before it), else None. The recorded step is the one
        message passing records when it checks every step: the step after the bad one if rank 0's
        loss was still finite, else the bad one.
    """
    if not pending:
        return None
    if isinstance(pending[0].loss, torch.Tensor):
        losses = list(torch.stack([p.loss for p in pending]).cpu().numpy())  # one synchronization
    else:
        losses = [p.loss for p in pending]
    clock, bad_step = loop.clock, None
    for entry, loss in zip(pending, losses, strict=True):
        loop.timers.compute += clock.seconds(entry.start, entry.computed)
        loop.timers.comm += clock.seconds(entry.computed, entry.stepped)
        loop.loss_sum += loss
        loop.loss_count += 1
        first = float(np.ravel(loss)[0])  # rank 0's loss: the one its log and run file report
        loop.last_loss = first
        if not (bool(np.isfinite(loss).all()) and loop.model_finite):
            bad_step = entry.step + 1 if math.isfinite(first) else entry.step
            break
        loop.model_finite = True
    pending.clear()
    return bad_step

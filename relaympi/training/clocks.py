"""Step timing for the training loop: host-clock or CUDA-event marks, and the steps whose loss and
times are read later (deferred checks on a GPU)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

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

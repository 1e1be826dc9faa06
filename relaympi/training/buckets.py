"""Gradient buckets: the flat model cut into contiguous ranges that backward finishes one after the
other, each handed to the algorithm (``Algorithm.ready``) as soon as its gradient is final
(--overlap).

Backward computes the last layers first, and their parameters sit at the high end of the flat
buffer (relaympi.flat), so buckets are cut from the end: bucket 0 holds the last parameters. A
parameter's post-accumulate-grad hook marks it final (after autograd added its gradient into the
flat grad view); a bucket is final when all its parameters are. Buckets are delivered in their
fixed order only (a bucket once it and every bucket before it are final), so every rank calls
``ready`` with the same ranges in the same order whatever the timing; what backward never reaches
(unused parameters, a workload without autograd) is delivered, in order, when the gradient is done.

Autograd runs the hooks of CUDA parameters on its own thread for the device, not on the thread that
called backward. Such a hook only marks its bucket final: the thread that entered ``delivering``
delivers it, in order, when backward returns, so every call into the algorithm (and every MPI call
it makes) stays on that thread. ``any_thread`` delivers from whichever thread runs the hook instead,
as the overlapped step did when ``--device cuda --overlap`` hung on a GPU: the overlap with
backward that a GPU run would want, for diagnosis (RELAYMPI_ALLOW_CUDA_OVERLAP=hooks, see
``relaympi.launcher.cuda_overlap_mode``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

Deliver = Callable[[int, int], None]


def cut_buckets(ranges: list[tuple[int, int]], bucket_elements: int) -> list[tuple[int, int]]:
    """Contiguous buckets from parameters' flat ranges (ascending, adjacent, covering [0, numel)),
    cut from the end: each bucket takes parameters until it holds at least ``bucket_elements``;
    returned in delivery order (highest range first)."""
    buckets, hi, size = [], None, 0
    for lo, end in reversed(ranges):
        hi = end if hi is None else hi
        size += end - lo
        if size >= bucket_elements:
            buckets.append((lo, hi))
            hi, size = None, 0
    if hi is not None:
        buckets.append((ranges[0][0], hi))
    return buckets


class GradientBuckets:
    """Delivers ``grad``'s buckets to a callback while backward runs (``delivering``).

    ``params``: the model's trainable parameters whose ``.grad`` are views of ``grad``
    (flatten_module),
    or none (a workload without autograd: one bucket, delivered when the gradient is done).
    ``progress``: called from every hook (e.g. the communicator's progress, so transfers started for
    earlier buckets move while backward computes). ``any_thread``: hooks on another thread than the
    one in ``delivering`` deliver and progress too (default: they only mark their bucket final).
    """

    def __init__(
        self,
        grad: torch.Tensor,
        params: list[torch.nn.Parameter],
        bucket_mb: float,
        progress: Callable[[], None] | None = None,
        any_thread: bool = False,
    ):
        if not bucket_mb > 0:
            raise ValueError(f"bucket size must be > 0 MiB, got {bucket_mb}")
        self.numel = grad.numel()
        self.progress = progress or (lambda: None)
        bucket_elements = max(1, int(bucket_mb * 2**20) // grad.element_size())
        owners = _flat_ranges(grad, params)
        self.buckets = (
            cut_buckets([r for r, _ in owners], bucket_elements) if owners else [(0, self.numel)]
        )
        self._bucket_of: dict[int, int] = {}  # id(param) -> its bucket
        self._waiting = [0] * len(self.buckets)  # parameters not final yet, per bucket
        self._members: list[list[int]] = [[] for _ in self.buckets]
        starts = [lo for lo, _ in self.buckets]
        for (lo, _hi), p in owners:
            index = next(i for i, start in enumerate(starts) if start <= lo)
            self._bucket_of[id(p)] = index
            self._members[index].append(id(p))
        self._deliver: Deliver | None = None
        self._final = [False] * len(self.buckets)
        self._done: set[int] = set()
        self._next = 0
        self.any_thread = any_thread
        self._owner: int | None = None  # the thread in delivering()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for _, p in owners]

    def __len__(self) -> int:
        return len(self.buckets)

    @contextmanager
    def delivering(self, deliver: Deliver) -> Iterator[None]:
        """Within the block, each bucket goes to ``deliver(lo, hi)`` once its gradient is final; on
        leaving
        it, every bucket not delivered yet (unused parameters, no autograd) goes, in order."""
        self._deliver, self._next, self._owner = deliver, 0, threading.get_ident()
        self._final = [False] * len(self.buckets)
        self._waiting = [len(m) for m in self._members]
        self._done = set()
        try:
            yield
            self._flush(len(self.buckets))
        finally:
            self._deliver = None

    def _hook(self, param: torch.Tensor) -> None:
        if (
            self._deliver is None
        ):  # a backward outside a step (none in training): nothing to deliver
            return
        key = id(param)
        if key in self._done:  # a second backward into the same grad: not final at the first one
            raise RuntimeError(
                "a parameter's gradient was accumulated twice in one step; --overlap "
                "needs one backward per step"
            )
        self._done.add(key)
        index = self._bucket_of[key]
        self._waiting[index] -= 1
        # else delivered when backward returns
        here = self.any_thread or threading.get_ident() == self._owner
        if self._waiting[index] == 0:
            self._final[index] = True
            while here and self._next < len(self.buckets) and self._final[self._next]:
                self._flush(self._next + 1)
        if here:
            self.progress()

    def _flush(self, until: int) -> None:
        while self._next < until:
            lo, hi = self.buckets[self._next]
            self._next += 1
            self._deliver(lo, hi)  # type: ignore[misc]

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _flat_ranges(grad: torch.Tensor, params: list[Any]) -> list[tuple[tuple[int, int], Any]]:
    """((lo, hi), param) of every parameter whose .grad is a view of ``grad``, ascending; they must
    tile
    [0, numel) (flatten_module's layout), else ValueError."""
    base = grad.untyped_storage().data_ptr() + grad.storage_offset() * grad.element_size()
    owners = []
    for p in params:
        g = p.grad
        if g is None or g.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr():
            raise ValueError(
                "every parameter's .grad must be a view of the flat gradient "
                "(relaympi.flat.flatten_module)"
            )
        lo = (g.data_ptr() - base) // grad.element_size()
        owners.append(((lo, lo + g.numel()), p))
    owners.sort(key=lambda o: o[0])
    end = 0
    for (lo, hi), _ in owners:
        if lo != end:
            raise ValueError(
                "parameters' gradients must tile the flat gradient; a gap or overlap at "
                f"element {end}"
            )
        end = hi
    if owners and end != grad.numel():
        raise ValueError(
            f"parameters' gradients cover {end} of the flat gradient's {grad.numel()} elements"
        )
    return owners

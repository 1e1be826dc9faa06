"""The model's flat memory layout: every parameter a view of one flat vector, with spare slots.

Communication and algorithm state work on the flat vector; models and optimizers see the views.
``flatten_module`` moves a torch module's parameters and gradients into two flat buffers;
``padded_zeros`` makes a flat tensor with one spare element on each side (RelaySum's counters, so a
leaf's message is a view, not a copy); ``FlatBuffer`` names views of one flat buffer of any array
kind.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from relaympi.comm.buffers import BufferError, array_kind, check_transferable


class FlatBuffer:
    """One contiguous 1-D buffer with named views that alias it (no copies).

    Communication and algorithm state work on the flat vector; models and optimizers see
    the views. Works for numpy, torch (CPU/CUDA) and cupy storage.
    """

    def __init__(self, flat: Any, shapes: Sequence[tuple[int, ...]]):
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        total = sum(sizes)
        length = flat.shape[0] if len(flat.shape) == 1 else -1
        if length != total:
            raise BufferError(
                f"flat buffer must be 1-D with {total} elements, got shape {tuple(flat.shape)}"
            )
        check_transferable(flat, "flat buffer")
        self.flat = flat
        self.shapes = [tuple(s) for s in shapes]
        self.views = []
        offset = 0
        for shape, size in zip(self.shapes, sizes, strict=True):
            self.views.append(flat[offset : offset + size].reshape(shape))
            offset += size

    @classmethod
    def zeros(cls, shapes: Sequence[tuple[int, ...]], like: Any) -> FlatBuffer:
        """A zero flat buffer of the same kind, dtype and device as ``like``."""
        total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        kind = array_kind(like)
        flat: Any  # a torch, cupy or numpy vector
        if kind == "torch":
            import torch

            flat = torch.zeros(total, dtype=like.dtype, device=like.device)
        elif kind == "cupy":
            import cupy

            flat = cupy.zeros(total, dtype=like.dtype)
        else:
            flat = np.zeros(total, dtype=like.dtype)
        return cls(flat, shapes)


# Flat tensors made by padded_zeros: storage data pointer -> weak reference to the enclosing
# [numel + 2] tensor. Only these spare slots may be written outside a tensor's own elements.
_PADDED: dict[int, weakref.ref] = {}


def padded_zeros(numel: int, dtype: Any = None, device: Any = None) -> Any:
    """A zero flat torch tensor with one spare element before and one after it in its storage.

    The spare slots hold 1.0, the counter of a RelaySum message that carries one parcel, so that
    a leaf's message [p, 1] is a view of memory that already exists (no copy). The slots belong
    to no parameter; ``spare_slots`` finds them again.
    """
    import torch

    storage = torch.zeros(numel + 2, dtype=dtype, device=device)
    storage[0] = storage[-1] = 1.0
    for key in [k for k, ref in _PADDED.items() if ref() is None]:
        del _PADDED[key]
    _PADDED[storage.data_ptr()] = weakref.ref(storage)
    return storage[1 : numel + 1]


def padded_zeros_like(like: Any) -> Any:
    return padded_zeros(like.numel(), dtype=like.dtype, device=like.device)


def spare_slots(flat: Any) -> Any | None:
    """The [numel + 2] tensor around ``flat`` if it came from padded_zeros (whole, 1-D), else
    None."""
    if array_kind(flat) != "torch" or flat.dim() != 1:
        return None
    ref = _PADDED.get(flat.untyped_storage().data_ptr())
    storage = ref() if ref is not None else None
    if (
        storage is None
        or flat.storage_offset() != 1
        or storage.numel() != flat.numel() + 2
        or storage.dtype != flat.dtype
    ):
        return None
    return storage


def flatten_module(module: Any) -> tuple[Any, Any]:
    """Move a torch module's parameters (and gradients) into two flat buffers.

    Every parameter's ``.data`` and ``.grad`` become views of the returned (params, grads)
    flat tensors, so an optimizer or algorithm that updates the flat vector updates the
    model in place, and backward() accumulates straight into the flat gradient.
    """
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise BufferError("module has no trainable parameters")
    dtypes = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(dtypes) != 1 or len(devices) != 1:
        raise BufferError(
            f"parameters must share one dtype and device, got {sorted(map(str, dtypes))} "
            f"on {sorted(map(str, devices))}"
        )
    total = sum(p.numel() for p in params)
    # spare slots: RelaySum counters
    flat = padded_zeros(total, dtype=params[0].dtype, device=params[0].device)
    grad = torch.zeros_like(flat)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            p.grad = grad[offset : offset + n].view_as(p)
            offset += n
    return flat, grad

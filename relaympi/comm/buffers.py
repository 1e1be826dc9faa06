"""Buffers that cross the Communicator: numpy, torch (CPU/CUDA) and cupy arrays.

The model's flat memory layout (FlatBuffer, flatten_module, padded_zeros) is relaympi.flat."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

# torch and cupy are imported inside the functions that handle their arrays: both are optional
# array kinds, and the Communicator (benchmarks, numpy-only tests) must work without them.

CUDA_AWARE_ENV = "RELAYMPI_CUDA_AWARE"


class BufferError(TypeError):
    """A buffer the Communicator cannot send or receive as it is."""


_KIND_OF_TYPE: dict[
    type, str
] = {}  # every exchange asks several times: remember the answer per type


def array_kind(x: Any) -> str:
    """'numpy', 'torch' or 'cupy' for a supported array, else BufferError."""
    kind = _KIND_OF_TYPE.get(type(x))
    if kind is not None:
        return kind
    if isinstance(x, np.ndarray):
        kind = "numpy"
    elif type(x).__module__.startswith("torch"):
        kind = "torch"
    elif type(x).__module__.startswith("cupy"):
        kind = "cupy"
    else:
        raise BufferError(
            f"unsupported buffer type {type(x).__name__}; expected a numpy array, torch "
            "tensor or cupy array"
        )
    _KIND_OF_TYPE[type(x)] = kind
    return kind


def is_device(x: Any) -> bool:
    """Whether the array lives in GPU memory."""
    kind = array_kind(x)
    if kind == "torch":
        return x.device.type != "cpu"
    return kind == "cupy"


def nbytes(x: Any) -> int:
    """Bytes held by the array's elements."""
    kind = array_kind(x)
    if kind == "torch":
        return x.numel() * x.element_size()
    return int(x.nbytes)


def is_contiguous(x: Any) -> bool:
    kind = array_kind(x)
    if kind == "torch":
        return x.is_contiguous()
    return bool(x.flags.c_contiguous)


def check_transferable(x: Any, what: str) -> None:
    """Raise a BufferError naming ``what`` if MPI cannot use x in place (non-contiguous)."""
    if not is_contiguous(x):
        raise BufferError(
            f"{what} is a non-contiguous view (shape {tuple(x.shape)}); MPI needs "
            "contiguous memory: "
            "pass a contiguous buffer (e.g. .contiguous() / np.ascontiguousarray) and "
            "copy back yourself"
        )


def dtype_name(x: Any) -> str:
    kind = array_kind(x)
    if kind == "torch":
        return str(x.dtype).removeprefix("torch.")
    return str(x.dtype)


def is_half(x: Any) -> bool:
    """bfloat16/float16: MPI has no portable reduction for them (bfloat16 would travel as
    MPI_BYTE)."""
    return dtype_name(x) in ("bfloat16", "float16")


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src across array kinds (same number of elements)."""
    dkind, skind = array_kind(dst), array_kind(src)
    if dkind == "torch":
        import torch

        if skind != "torch":
            src = torch.as_tensor(_to_numpy(src))
        with torch.no_grad():
            dst.copy_(src.reshape(dst.shape), non_blocking=False)
    elif dkind == "cupy":
        import cupy

        dst[...] = cupy.asarray(src).reshape(dst.shape)
    else:
        np.copyto(dst, _to_numpy(src).reshape(dst.shape))


def clone(x: Any) -> Any:
    """An independent copy of the array, same kind and device."""
    kind = array_kind(x)
    if kind == "torch":
        return x.detach().clone()
    return x.copy()


def _to_numpy(x: Any) -> np.ndarray:
    kind = array_kind(x)
    if kind == "torch":
        return x.detach().cpu().numpy()
    if kind == "cupy":
        return x.get()
    return x


def host_view(x: Any) -> np.ndarray:
    """A numpy view (no copy) of a CPU array's memory; bfloat16 is viewed as raw bytes."""
    kind = array_kind(x)
    if kind == "numpy":
        return x
    if kind == "torch":
        if x.device.type != "cpu":
            raise BufferError(
                f"host_view of a {x.device} tensor; stage it through host memory first"
            )
        t = x.detach()
        if t.dtype.is_floating_point and t.dtype not in _NUMPY_TORCH_FLOATS:
            import torch

            t = t.view(torch.uint8)  # numpy has no bfloat16: point-to-point moves the raw bytes
        return t.numpy()
    raise BufferError("host_view of a cupy array; stage it through host memory first")


_NUMPY_TORCH_FLOATS: set = set()


def _init_torch_floats() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional for the numpy paths
        return
    _NUMPY_TORCH_FLOATS.update({torch.float16, torch.float32, torch.float64})


_init_torch_floats()


def synchronize_stream(x: Any) -> None:
    """Wait for queued GPU work on x's current stream: MPI reads device memory directly and
    does not order itself after kernels that are still writing the buffer."""
    kind = array_kind(x)
    if kind == "torch" and x.device.type == "cuda":
        import torch

        torch.cuda.current_stream(x.device).synchronize()
    elif kind == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def loaded_libmpi() -> str | None:
    """Path of the MPI library loaded in this process (mpi4py opens it RTLD_LOCAL, so its
    symbols are invisible to dlsym(NULL) and must be looked up through the library itself)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi") and ".so" in path:
                    return path
    except OSError:
        pass
    return None


def query_cuda_aware_mpi(libmpi_path: str | None = None) -> bool:
    """Whether the loaded MPI library is CUDA-aware.

    The environment variable RELAYMPI_CUDA_AWARE=1/0 forces the answer. Otherwise ask the
    library through ``MPIX_Query_cuda_support`` (MPICH and Open MPI export it; mpi4py has no
    query); a library without the symbol, or none loaded, counts as not CUDA-aware.
    """
    forced = os.environ.get(CUDA_AWARE_ENV)
    if forced is not None and forced.strip() != "":
        value = forced.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(
            f"{CUDA_AWARE_ENV}={forced!r}; expected 1/0 (or true/false, yes/no, on/off)"
        )
    path = libmpi_path or loaded_libmpi()
    if path is None:
        return False
    try:
        query = ctypes.CDLL(path).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype = ctypes.c_int
    return bool(query())

"""Device memory through pinned host memory, for an MPI that is not CUDA-aware: host buffers reused
across steps, and (torch CUDA tensors) copies on a side stream that overlap earlier transfers.

No MPI here: the MPI communicator (relaympi.comm.mpi) decides when to stage and posts the transfers.
"""

from __future__ import annotations

from typing import Any

from relaympi.comm import buffers


class StagedSend:
    """A send of device memory through pinned host memory: the copy runs on a side stream and the
    Isend is posted once it is done, so copies overlap the transfers of earlier chunks."""

    def __init__(self, host: Any, copied: Any, peer: int, tag: int):
        self.host, self.copied, self.peer, self.tag = host, copied, peer, tag
        self.request: Any = None  # the MPI request once posted


class DeviceStaging:
    """One communicator's staging: its pinned host buffers (one per slot, shape and dtype) and the
    side stream of each device that copies between them and device memory."""

    def __init__(self) -> None:
        self._pool: dict[tuple, Any] = {}
        self._side_streams: dict[Any, Any] = {}  # device -> CUDA stream for staging copies
        self._copies_from: dict[
            int, Any
        ] = {}  # pinned host buffer -> event of its last host-to-device copy

    def host_buffer(self, x: Any, slot: tuple) -> Any:
        """The pinned host buffer of ``slot`` for an array like ``x`` (a torch tensor or a cupy
        array, as ``x``), made on first use."""
        key = (slot, tuple(x.shape), buffers.dtype_name(x))
        buf = self._pool.get(key)
        if buf is None:
            kind = buffers.array_kind(x)
            if kind == "torch":
                import torch

                buf = torch.empty(tuple(x.shape), dtype=x.dtype, pin_memory=True)
            else:
                import cupyx

                buf = cupyx.empty_pinned(x.shape, dtype=x.dtype)
            self._pool[key] = buf
        return buf

    def _side_stream(self, device: Any) -> Any:
        import torch

        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def side_copy(self, dst: Any, src: Any, device: Any) -> Any:
        """dst <- src on the side stream, after the work queued so far on the current stream (the
        copy sees what kernels wrote, and kernels still reading dst go first); returns its event."""
        import torch

        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        # the allocator keeps the device tensor for the copy
        (src if src.is_cuda else dst).record_stream(stream)
        copied = torch.cuda.Event()
        copied.record(stream)
        return copied

    def stage_send(self, buf: Any, slot: tuple, peer: int, tag: int) -> StagedSend:
        """Queue buf's device-to-host copy on the side stream, after the work already queued on
        buf."""
        host = self.host_buffer(buf, slot)
        return StagedSend(host, self.side_copy(host, buf, buf.device), peer, tag)

    def stage_recv(self, buf: Any, slot: tuple, on_complete: list) -> Any:
        """A pinned host buffer to receive into; on completion its host-to-device copy runs on the
        side stream and buf's stream waits for it (the CPU does not)."""
        import torch

        host = self.host_buffer(buf, slot)
        previous = self._copies_from.get(id(host))
        if (
            previous is not None
        ):  # the last copy out of this host buffer must finish before MPI writes it
            previous.synchronize()

        def finish() -> None:
            copied = self.side_copy(buf, host, buf.device)
            torch.cuda.current_stream(buf.device).wait_event(copied)
            self._copies_from[id(host)] = copied

        on_complete.append(finish)
        return buffers.host_view(host)

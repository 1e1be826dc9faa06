"""MPI backend (mpi4py): the only module that imports mpi4py."""

from __future__ import annotations

import atexit
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

from relaympi.comm import buffers
from relaympi.comm.base import Communicator, DropPolicy, RemoteFailure, Request

_FAILURE_TAG = 0x7E
_FAILURE_BYTES = 1 << 16


def world_size() -> int:
    """Size of MPI.COMM_WORLD (1 when not launched by mpirun/srun)."""
    return MPI.COMM_WORLD.Get_size()


def library_version() -> str:
    return MPI.Get_library_version().strip().splitlines()[0]


class _Staging:
    """Pinned host buffers for device arrays when MPI is not CUDA-aware, reused across steps."""

    def __init__(self) -> None:
        self._pool: dict[tuple, Any] = {}

    def host_buffer(self, x: Any, slot: tuple) -> np.ndarray:
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


class _MPIRequest(Request):
    def __init__(self, comm: MPICommunicator, requests: list, delivered: frozenset[int], on_complete: list):
        self._comm = comm
        self._requests = requests
        self._delivered = delivered
        self._on_complete = on_complete
        self._done = False

    def wait(self) -> frozenset[int]:
        if not self._done:
            self._comm._wait(self._requests)
            for finish in self._on_complete:
                finish()
            self._done = True
        return self._delivered

    def test(self) -> bool:
        return self._done or MPI.Request.Testall(self._requests)


class MPICommunicator(Communicator):
    """A Communicator over a duplicate of MPI.COMM_WORLD (library traffic never matches users')."""

    def __init__(self, comm: Any = None, drops: DropPolicy | None = None, cuda_aware: bool | None = None):
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), drops)
        self.cuda_aware = buffers.query_cuda_aware_mpi() if cuda_aware is None else cuda_aware
        self._staging = _Staging()
        # failure channel: any rank may tell rank 0 it failed; rank 0 checks it while it waits
        self._failures = (comm or MPI.COMM_WORLD).Dup()
        self._failure_buf = bytearray(_FAILURE_BYTES)
        self._failure_req = self._failures.Irecv(self._failure_buf, source=MPI.ANY_SOURCE, tag=_FAILURE_TAG) if self.rank == 0 else None
        atexit.register(self.close)

    def close(self) -> None:
        """Cancel the pending failure receive, so MPI finalizes cleanly."""
        if self._failure_req is not None:
            self._failure_req.Cancel()
            self._failure_req.Wait()
            self._failure_req = None

    # -- waiting ---------------------------------------------------------------------------
    def _check_failures(self) -> None:
        if self._failure_req is not None:
            status = MPI.Status()
            if self._failure_req.Test(status):
                self._failure_req = None
                text = bytes(self._failure_buf[: status.Get_count(MPI.BYTE)]).decode("utf-8", "replace")
                raise RemoteFailure(f"rank {status.Get_source()} failed: {text}")

    def _wait(self, requests: list) -> None:
        """Waitall that rank 0 interrupts when another rank reports a failure (no rank waits forever)."""
        if self._failure_req is None:
            MPI.Request.Waitall(requests)
            return
        polls = 0
        while not MPI.Request.Testall(requests):
            self._check_failures()
            polls += 1
            if polls > 1000:
                time.sleep(5e-5)

    def report_failure(self, message: str) -> None:
        if self.rank == 0:
            return
        data = message.encode("utf-8")[: _FAILURE_BYTES - 1]
        request = self._failures.Isend(data, dest=0, tag=_FAILURE_TAG)
        deadline = time.monotonic() + 10.0
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(0.01)

    # -- buffers ---------------------------------------------------------------------------
    def _send_spec(self, buf: Any, slot: tuple) -> Any:
        buffers.check_transferable(buf, "send buffer")
        if buffers.is_device(buf):
            if self.cuda_aware:
                buffers.synchronize_stream(buf)  # MPI reads device memory outside the stream's order
                return self._device_spec(buf)
            host = self._staging.host_buffer(buf, slot)
            buffers.copy_into(host, buf)  # blocking copy: the host copy is complete before MPI reads it
            return buffers.host_view(host)
        return buffers.host_view(buf)

    def _recv_spec(self, buf: Any, slot: tuple, on_complete: list) -> Any:
        if buffers.is_device(buf):
            if self.cuda_aware:
                buffers.synchronize_stream(buf)  # no pending kernel may still read/write the target
                return self._device_spec(buf)
            host = self._staging.host_buffer(buf, slot)
            on_complete.append(lambda: buffers.copy_into(buf, host))
            return buffers.host_view(host)
        return buffers.host_view(buf)

    @staticmethod
    def _device_spec(buf: Any) -> Any:
        if buffers.is_half(buf) and buffers.dtype_name(buf) == "bfloat16":
            import torch

            return [buf.view(torch.uint8), MPI.BYTE]
        return buf

    def _post(self, sends: Mapping[int, Any], recvs: Mapping[int, Any], tag: int, chunk: int = 0) -> Request:
        # chunks of one message share the tag: MPI's non-overtaking rule keeps them in order
        requests, on_complete = [], []
        for peer in sorted(recvs):
            spec = self._recv_spec(recvs[peer], ("recv", peer, tag, chunk), on_complete)
            requests.append(self.comm.Irecv(spec, source=peer, tag=tag))
        for peer in sorted(sends):
            spec = self._send_spec(sends[peer], ("send", peer, tag, chunk))
            requests.append(self.comm.Isend(spec, dest=peer, tag=tag))
        return _MPIRequest(self, requests, frozenset(recvs), on_complete)

    def _post_replace(self, items: list[tuple[int, Any, bool, bool]], tag: int) -> Request:
        requests, on_complete = [], []
        for peer, buf, send, recv in sorted(items, key=lambda item: item[0]):
            if send and recv:
                spec = self._send_spec(buf, ("replace", peer, tag))
                if buffers.is_device(buf) and not self.cuda_aware:
                    host = self._staging.host_buffer(buf, ("replace", peer, tag))
                    on_complete.append(lambda buf=buf, host=host: buffers.copy_into(buf, host))
                requests.extend(self._isendrecv_replace(spec, peer, tag, on_complete))
            elif send:
                requests.append(self.comm.Isend(self._send_spec(buf, ("send", peer, tag)), dest=peer, tag=tag))
            elif recv:
                requests.append(self.comm.Irecv(self._recv_spec(buf, ("recv", peer, tag), on_complete), source=peer, tag=tag))
        return _MPIRequest(self, requests, frozenset(peer for peer, _, _, recv in items if recv), on_complete)

    def _isendrecv_replace(self, spec: Any, peer: int, tag: int, on_complete: list) -> list:
        try:
            return [self.comm.Isendrecv_replace(spec, dest=peer, sendtag=tag, source=peer, recvtag=tag)]
        except NotImplementedError:  # an MPI-3 library: receive into a transient copy instead
            target, datatype = (spec[0], spec[1]) if isinstance(spec, list) else (spec, None)
            temp = target.clone() if buffers.array_kind(target) == "torch" else target.copy()
            on_complete.insert(0, lambda: buffers.copy_into(target, temp))
            recv_spec = [temp, datatype] if datatype is not None else temp
            return [self.comm.Irecv(recv_spec, source=peer, tag=tag), self.comm.Isend(spec, dest=peer, tag=tag)]

    # -- collectives -----------------------------------------------------------------------
    def allreduce_sum(self, buf: Any) -> None:
        buffers.check_transferable(buf, "allreduce buffer")
        if buffers.is_half(buf):
            # bfloat16 would travel as MPI_BYTE and be summed bytewise (or refused): reduce in float32
            wide = buf.float() if buffers.array_kind(buf) == "torch" else buf.astype(np.float32)
            self.allreduce_sum(wide)
            buffers.copy_into(buf, wide.to(buf.dtype) if buffers.array_kind(buf) == "torch" else wide)
            return
        if buffers.is_device(buf) and not self.cuda_aware:
            host = self._staging.host_buffer(buf, ("allreduce",))
            buffers.copy_into(host, buf)
            self._wait([self.comm.Iallreduce(MPI.IN_PLACE, buffers.host_view(host), op=MPI.SUM)])
            buffers.copy_into(buf, host)
            return
        if buffers.is_device(buf):
            buffers.synchronize_stream(buf)  # MPI reads device memory outside the stream's order
            self._wait([self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)])
        else:
            self._wait([self.comm.Iallreduce(MPI.IN_PLACE, buffers.host_view(buf), op=MPI.SUM)])

    def allreduce_flags(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.float64).copy()
        self._wait([self.comm.Iallreduce(MPI.IN_PLACE, values, op=MPI.MAX)])
        return values

    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        row = np.ascontiguousarray(row, dtype=np.float64)
        out = np.empty((self.world_size, row.shape[0])) if self.rank == 0 else None
        self._wait([self.comm.Igather(row, out, root=0)])
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        return self.comm.gather(obj, root=0)

    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    def barrier(self) -> None:
        self._wait([self.comm.Ibarrier()])

    def abort(self, code: int = 1) -> None:
        MPI.COMM_WORLD.Abort(code)

    @property
    def backend(self) -> str:
        return "mpi"

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "mpi",
            "mpi_library": library_version(),
            "mpi_standard": "{}.{}".format(*MPI.Get_version()),
            "mpi4py": __import__("mpi4py").__version__,
            "cuda_aware": bool(self.cuda_aware),
            "processor_name": MPI.Get_processor_name(),
        }

"""A full disk while a run file is written: recognizing 'no space left' and the space held in
reserve
so that a failing run can still record why it failed."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

_SPACE_RESERVE_BYTES = 4 << 20


def no_space(exc: BaseException) -> bool:
    """Whether an error (OSError, or HDF5's RuntimeError text) is 'no space left on device'."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return (
        "No space left on device" in text or "errno = 28," in text or "Disk quota exceeded" in text
    )


class SpaceReserve:
    """Disk space held for a run file's last words: an unlinked temporary file in its directory,
    allocated when the writer opens (at most half the free space) and released when a write finds
    the device full, so that the pending rows and the `failed` status still fit and the file stays
    readable. The space returns to the file system on release or when the process ends."""

    def __init__(self, directory: Path, nbytes: int = _SPACE_RESERVE_BYTES) -> None:
        self._file = None
        try:
            stat = os.statvfs(directory)
            size = min(nbytes, stat.f_bavail * stat.f_frsize // 2)
            if size < 4096:
                return
            handle = tempfile.TemporaryFile(dir=directory, prefix=".relaympi-reserve-")
        except OSError:
            return
        try:
            os.posix_fallocate(handle.fileno(), 0, size)
        except OSError:
            handle.close()
            return
        self._file = handle

    def release(self) -> bool:
        """Give the space back; False when there was none to give."""
        if self._file is None:
            return False
        self._file.close()
        self._file = None
        return True

"""HTTP(S) downloads to a temporary name: resumed with Range requests, checked, then renamed."""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger("relaympi.data")

CHUNK_BYTES = 1 << 20
ATTEMPTS = 3  # tries per file; each one resumes where the last stopped
TIMEOUT_S = 60.0


class DataError(RuntimeError):
    """A fetch, check or prepare step failed; the CLI exits with status 1."""


class OfflineError(DataError):
    """The source could not be reached at all (no route, no DNS, refused)."""


class ChecksumError(DataError):
    """A file arrived complete but with the wrong digest; it has been deleted."""


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def partial_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def download(
    url: str,
    dest: Path,
    md5: str | None = None,
    *,
    progress: bool = True,
    attempts: int = ATTEMPTS,
    timeout_s: float = TIMEOUT_S,
) -> Path:
    """``dest``, downloaded from ``url`` if it is not there yet, with its md5 checked.

    Bytes go to ``dest.part``; an interrupted transfer is resumed from there (a Range
    request; restarted when the server ignores it), by the next attempt or the next run.
    Only a complete file with the right digest is renamed to ``dest``; a wrong digest
    deletes the partial file and raises ChecksumError. A ``dest`` already present (fetched
    before, or put there by hand) is checked and used.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file():
        _check_md5(dest, md5, url, delete=False)
        log.info("using %s (already downloaded%s)", dest, ", md5 verified" if md5 else "")
        return dest
    part = partial_path(dest)
    for attempt in range(1, attempts + 1):
        try:
            _transfer(url, part, progress, timeout_s)
            break
        except _Interrupted as exc:
            if attempt == attempts:
                held = part.stat().st_size if part.exists() else 0
                raise DataError(
                    f"download of {url} interrupted ({exc}); {part} holds {held} bytes: "
                    "rerun the same command to resume"
                ) from None
            log.warning(
                "download of %s interrupted (%s); trying again (attempt %d of %d)",
                url,
                exc,
                attempt + 1,
                attempts,
            )
    _check_md5(part, md5, url, delete=True)
    os.replace(part, dest)
    return dest


class _Interrupted(Exception):
    """The connection dropped mid-file: worth another attempt that resumes."""


def _transfer(url: str, part: Path, progress: bool, timeout_s: float) -> None:
    offset = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "relaympi"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # the partial file is no prefix of this one: start over
            part.unlink()
            raise _Interrupted("the server refused to resume; starting over") from None
        raise DataError(f"cannot download {url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OfflineError(f"cannot reach {url}: {reason}") from None
    with response:
        if offset and response.status != 206:
            log.info("%s does not resume downloads; starting over", url)
            offset = 0
        elif offset:
            log.info("resuming %s at byte %d", url, offset)
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length and length.isdigit() else None
        _copy(response, part, offset, total, progress)


def _copy(response: object, part: Path, offset: int, total: int | None, progress: bool) -> None:
    from tqdm import tqdm

    received = offset
    with (
        open(part, "ab" if offset else "wb") as f,
        tqdm(
            total=total,
            initial=offset,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=part.name.removesuffix(".part"),
            disable=not progress,
            leave=True,
        ) as bar,
    ):
        try:
            while chunk := response.read(CHUNK_BYTES):  # type: ignore[attr-defined]
                f.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
        except (TimeoutError, http.client.IncompleteRead, ConnectionError, OSError) as exc:
            raise _Interrupted(f"{type(exc).__name__} after {received} bytes") from None
    if total is not None and received != total:
        raise _Interrupted(f"got {received} of {total} bytes")


def _check_md5(path: Path, md5: str | None, url: str, delete: bool) -> None:
    if md5 is None:
        return
    actual = file_digest(path, "md5")
    if actual == md5:
        return
    if delete:
        path.unlink()
        raise ChecksumError(
            f"{url}: the downloaded file has md5 {actual}, expected {md5}; it was deleted "
            "(a damaged transfer or a wrong mirror: rerun, or check --url)"
        )
    raise ChecksumError(
        f"{path} has md5 {actual}, expected {md5}: it is not the published file. "
        "Delete it and rerun the fetch"
    )

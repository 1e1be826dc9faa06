"""The manifest a finished fetch or prepare step leaves in a data set's folder, and its check."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaympi.data.download import file_digest

MANIFEST = "relaympi-manifest.json"
SCHEMA = 1

# states of a data set folder, best first
VERIFIED = "verified"  # written by fetch/prepare, and every recorded file is there unchanged
UNVERIFIED = "unverified"  # a complete layout without a manifest (put there by hand)
CORRUPT = "corrupt"  # a manifest whose files are missing or changed
INCOMPLETE = "incomplete"  # the folder exists but lacks files the task reads
MISSING = "missing"


@dataclass(frozen=True)
class Status:
    name: str
    path: Path
    state: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.state == VERIFIED


def file_records(directory: Path, paths: list[Path] | None = None) -> dict[str, dict[str, Any]]:
    """{relative path: {size, sha256}} for ``paths`` (default: every file under ``directory``)."""
    if paths is None:
        paths = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {
        p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": file_digest(p)}
        for p in paths
    }


def write(directory: Path, name: str, source: str, **fields: Any) -> dict[str, Any]:
    """Write ``directory/relaympi-manifest.json`` (last step of a fetch: it marks completeness)."""
    from relaympi import __version__

    manifest = {
        "schema": SCHEMA,
        "name": name,
        "source": source,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "relaympi_version": __version__,
        **fields,
    }
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, directory / MANIFEST)
    return manifest


def read(directory: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def check_files(directory: Path, files: dict[str, dict[str, Any]], hashes: bool) -> str:
    """'' if every recorded file has its size (and sha256 when ``hashes``); else what differs."""
    for relative, record in files.items():
        path = directory / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != record["size"]:
            return f"{relative} has {path.stat().st_size} bytes, expected {record['size']}"
        if hashes and file_digest(path) != record["sha256"]:
            return f"{relative} has changed (sha256 differs from the manifest)"
    return ""

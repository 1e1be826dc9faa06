"""Crafted run files and folders: sizes a file claims are checked against what it holds before
anything is allocated, each file is read under a memory limit, nothing in one makes the reader
read another file, and no depth of folders stops the search. A refused file is a problem of the
report; the rest of the report is unchanged."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from relaympi import report
from relaympi.results import RunFileError, read_run
from relaympi.results.bounded import bounded_map, memory_reason, read_runs
from relaympi.results.reader import MAX_WORLD_SIZE
from tests import run_factories as rf

EVALS, WORKERS = 6, 4
ACC = np.linspace(0.2, 0.9, EVALS * WORKERS).reshape(EVALS, WORKERS)
SECRET = b"secret bytes of another file".ljust(EVALS * WORKERS * 8, b"!")


def good(path: Path, **config) -> Path:
    return rf.write_classification_run(path, ACC, **config)


def report_text(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = report.main([*args, "--format", "markdown"])
    return status, out.getvalue()


def problems_of(text: str) -> dict[str, str]:
    """The report's problems by file name (Markdown: "- `path`: reason")."""
    lines = [line[3:] for line in text.splitlines() if line.startswith("- `")]
    return {Path(line.split("`", 1)[0]).name: line.split("`: ", 1)[1] for line in lines}


def tables_of(text: str) -> str:
    """The report without its summary and problems: the tables alone."""
    return text.split("\n\n", 1)[1].split("### Problems")[0].strip()


@pytest.mark.slow
def test_a_claimed_world_size_is_checked_before_anything_is_allocated(tmp_path: Path) -> None:
    """A world_size far beyond any machine (with a membership record, which made the report build
    range(world_size)) and one that disagrees with the per-worker datasets or the topology are
    refused by name; in the report each is a problem and the tables are those of the good run."""
    huge = rf.write_quadratics_run(tmp_path / "runs" / "huge.h5", np.logspace(0, -8, 5))
    record = {
        "step": 10,
        "lost": [0],
        "lost_nodes": [0],
        "lost_hosts": [None],
        "world_size": 10**10 - 1,
        "heal_s": 0.1,
    }
    with h5py.File(huge, "a") as f:
        f.attrs["world_size"] = np.int64(10**10)
        f.attrs["membership"] = json.dumps([record])
    wide = good(tmp_path / "runs" / "wide.h5", seed=1)
    with h5py.File(wide, "a") as f:
        f.attrs["world_size"] = np.int64(WORKERS + 1)
    rank_node = good(tmp_path / "runs" / "rank_node.h5", seed=2)
    with h5py.File(rank_node, "a") as f:
        f.create_group("topology").create_dataset("rank_node", data=np.zeros(10**6, np.int64))
    for path, words in (
        (huge, f"'world_size' is 10000000000; a run has 1 to {MAX_WORLD_SIZE} workers"),
        (wide, "its per-worker axis must be world_size=5 wide"),
        (rank_node, "one node per worker, world_size=4"),
    ):
        with pytest.raises(RunFileError, match=words.replace("(", r"\(").replace("[", r"\[")):
            read_run(path)
    alone = good(tmp_path / "alone" / "ok.h5")
    good(tmp_path / "runs" / "ok.h5")
    status, text = report_text(str(tmp_path / "runs"))
    assert status == 0
    assert set(problems_of(text)) == {"huge.h5", "wide.h5", "rank_node.h5"}
    assert tables_of(text) == tables_of(report_text(str(alone.parent))[1])


def _allocate(mib: int) -> int:
    return int(np.ones(mib << 17).sum())  # mib MiB of float64


@pytest.mark.slow
def test_each_file_is_read_under_a_memory_limit(tmp_path: Path) -> None:
    """A worker cannot allocate beyond its limit (the call gets the reason, the others run); a
    file whose datasets claim more than the budget (rows resized to 2e9: a few KiB on disk) is
    refused before any is read, and the report lists it and tabulates the rest unchanged."""
    memory = 256 << 20
    outcomes = list(bounded_map(_allocate, [(8,), (1024,), (8,)], timeout=60, memory=memory))
    assert outcomes == [(True, 8 << 17), (False, memory_reason(memory)), (True, 8 << 17)]
    big = good(tmp_path / "runs" / "big.h5", seed=1)
    with h5py.File(big, "a") as f:
        for name in f:
            if isinstance(f[name], h5py.Dataset):
                f[name].resize(2 * 10**9, axis=0)
    assert big.stat().st_size < 1 << 20
    ((_, outcome),) = read_runs([big], memory=memory)
    assert isinstance(outcome, RunFileError) and "too large to read" in outcome.reason
    alone = good(tmp_path / "alone" / "ok.h5")
    good(tmp_path / "runs" / "ok.h5")
    status, text = report_text(str(tmp_path / "runs"))
    assert status == 0 and list(problems_of(text)) == ["big.h5"]
    assert "over the limit of 1024.0 MiB per run file" in problems_of(text)["big.h5"]
    assert tables_of(text) == tables_of(report_text(str(alone.parent))[1])


def _replace(path: Path, name: str, make) -> None:
    with h5py.File(path, "a") as f:
        del f[name]
        make(f)


@pytest.mark.parametrize("how", ["external storage", "virtual dataset", "external link"])
def test_nothing_in_a_run_file_reads_another_file(tmp_path: Path, how: str) -> None:
    """A dataset with external storage, a virtual dataset over another file and an external link
    are refused (their bytes never come back); the report lists the file as a problem."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["data"] = np.frombuffer(SECRET, dtype="<f8").reshape(EVALS, WORKERS)
    path = good(tmp_path / "runs" / "crafted.h5")
    shape = (EVALS, WORKERS)
    if how == "external storage":
        _replace(
            path,
            "train_loss",
            lambda f: f.create_dataset(
                "train_loss", shape, "<f8", external=[(str(secret), 0, len(SECRET))]
            ),
        )
    elif how == "virtual dataset":
        layout = h5py.VirtualLayout(shape=shape, dtype="<f8")
        layout[:] = h5py.VirtualSource(str(other), "data", shape=shape)
        _replace(path, "train_loss", lambda f: f.create_virtual_dataset("train_loss", layout))
    else:
        _replace(
            path,
            "train_loss",
            lambda f: f.__setitem__("train_loss", h5py.ExternalLink(other, "data")),
        )
    with pytest.raises(RunFileError, match="refused: .*train_loss"):
        read_run(path)
    status, text = report_text(str(tmp_path / "runs"))
    assert status == 1 and "refused" in problems_of(text)["crafted.h5"]


@pytest.mark.slow
def test_folders_1500_deep_are_searched(tmp_path: Path) -> None:
    """The report finds a run file under 1,500 nested folders (a RecursionError before) and one at
    the top, and does not follow a symbolic link back up (no loop)."""
    from relaympi.report.cli import find_run_files

    top = good(tmp_path / "runs" / "top.h5")
    deep = tmp_path / "runs"
    for _ in range(1500):  # Path.mkdir(parents=True) would recurse
        deep = deep / "d"
        deep.mkdir()
    bottom = good(deep / "bottom.h5", seed=1)
    (deep / "loop").symlink_to(tmp_path / "runs", target_is_directory=True)
    try:
        assert find_run_files([tmp_path / "runs"]) == sorted([top, bottom])
        status, text = report_text(str(tmp_path / "runs"))
        assert status == 0 and text.startswith("2 run file(s): 2 completed")
    finally:
        # bottom up: shutil.rmtree (pytest's clean-up of old test folders) recurses, and 1,500
        # levels exceed Python's recursion limit
        for entry in (deep / "loop", bottom):
            entry.unlink()
        while deep != tmp_path / "runs":
            deep.rmdir()
            deep = deep.parent

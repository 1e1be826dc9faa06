"""A study's result: its rows, tables and findings; its HDF5 file and its printed form."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from relaympi.studies.quadratics.tuning import Tuned
from relaympi.tasks.quadratics import CONVENTION

# 2: the quadratics in the paper's loss, no 1/2 (attribute quadratics_convention); 1 had the 1/2
SCHEMA_VERSION = 2


@dataclass
class Finding:
    """One of the paper's qualitative claims, checked against this study's numbers."""

    claim: str
    holds: bool
    evidence: str

    def line(self) -> str:
        return f"{self.claim}: {'yes' if self.holds else 'NO'} ({self.evidence})"


@dataclass
class StudyResult:
    study: str
    settings: Any
    # the table, one row per run or measurement
    rows: list[dict[str, Any]] = field(default_factory=list)
    curves: list[np.ndarray | None] = field(default_factory=list)  # per row: suboptimality per step
    # per row: every learning rate the search tried
    trials: list[np.ndarray | None] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    data: dict[str, np.ndarray] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def add(self, row: dict[str, Any], tuned: Tuned | None = None) -> None:
        self.rows.append(row)
        self.curves.append(None if tuned is None else tuned.curve)
        self.trials.append(None if tuned is None else tuned.trials)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} as JSON")


def write_result(result: StudyResult, out_dir: Path, provenance: dict[str, Any]) -> Path:
    """Write one study's HDF5 file (layout in the package docstring); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result.study}.h5"
    strings = h5py.string_dtype("utf-8")
    with h5py.File(path, "w") as f:
        f.attrs["kind"] = "quadratics-study"
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["study"] = result.study
        f.attrs["quadratics_convention"] = CONVENTION
        f.attrs.create(
            "settings",
            json.dumps(dataclasses.asdict(result.settings), sort_keys=True, default=_json_default),
            dtype=strings,
        )
        f.attrs.create(
            "provenance",
            json.dumps(provenance, sort_keys=True, default=_json_default),
            dtype=strings,
        )
        f.attrs.create(
            "findings", json.dumps([dataclasses.asdict(x) for x in result.findings]), dtype=strings
        )
        f.attrs["elapsed_s"] = result.elapsed_s
        table = f.create_group("table")
        for column in result.rows[0] if result.rows else ():
            values = [row.get(column) for row in result.rows]
            if all(isinstance(v, str) for v in values):
                table.create_dataset(column, data=np.array(values, dtype=object), dtype=strings)
            else:
                table.create_dataset(column, data=np.array(values))
        curves, trials = f.create_group("curves"), f.create_group("trials")
        for index, (curve, tried) in enumerate(zip(result.curves, result.trials, strict=True)):
            if curve is not None:
                curves.create_dataset(str(index), data=curve, compression="gzip")
            if tried is not None:
                dataset = trials.create_dataset(str(index), data=tried)
                dataset.attrs["columns"] = (
                    "lr, steps to target (-1: not reached), lowest suboptimality"
                )
        data = f.create_group("data")
        for name, array in result.data.items():
            data.create_dataset(name, data=array)
    return path


def report(result: StudyResult) -> str:
    """The printed form of a study: its tables, the paper's findings, and its wall time."""
    lines = [
        f"== {result.study} ({result.elapsed_s:.1f} s) ==",
        f"quadratics convention: {CONVENTION}",
    ]
    for table in result.tables:
        lines += [table, ""]
    lines.append("paper findings:")
    lines += [f"  - {finding.line()}" for finding in result.findings]
    return "\n".join(lines)

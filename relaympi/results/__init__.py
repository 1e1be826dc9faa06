"""The HDF5 run file: its schema, the writer used by training and the reader used by reports.

One job per module: ``schema`` (version, statuses, how attributes and rows are laid out),
``errors``, ``reader`` (read_run, run_status, file_kind), ``bounded`` (the same reads in worker
processes with a time limit, for files that may be damaged), ``writer`` (RunWriter), ``space``
(a full disk while writing), ``quality`` (runs at chance, unstable runs) and ``cli``
(``python -m relaympi.results status|show``). Every name below is importable from here.
"""

from relaympi.results.cli import OWN_TARGET_FRACTION, cost_lines, main, topology_lines
from relaympi.results.errors import (
    NotARunFileError,
    RunExistsError,
    RunFileError,
    RunFileWriteError,
    RunInUseError,
)
from relaympi.results.quality import (
    CHANCE_FACTOR,
    UNSTABLE_FACTOR,
    UNSTABLE_RULE,
    unstable_loss,
    unstable_text,
    workers_at_chance,
)
from relaympi.results.reader import Run, file_kind, read_run, run_status
from relaympi.results.schema import (
    FINISHED_STATUSES,
    PROBLEM_DIGEST_ATTR,
    RESUMABLE_STATUSES,
    SCHEMA_VERSION,
    STATUSES,
    TERMINAL_STATUSES,
    TOPOLOGY_GROUP,
    RunTopology,
)
from relaympi.results.writer import UNCLOSABLE, RunWriter

__all__ = [
    "CHANCE_FACTOR",
    "FINISHED_STATUSES",
    "OWN_TARGET_FRACTION",
    "PROBLEM_DIGEST_ATTR",
    "RESUMABLE_STATUSES",
    "SCHEMA_VERSION",
    "STATUSES",
    "TERMINAL_STATUSES",
    "TOPOLOGY_GROUP",
    "UNCLOSABLE",
    "UNSTABLE_FACTOR",
    "UNSTABLE_RULE",
    "NotARunFileError",
    "Run",
    "RunExistsError",
    "RunFileError",
    "RunFileWriteError",
    "RunInUseError",
    "RunTopology",
    "RunWriter",
    "cost_lines",
    "file_kind",
    "main",
    "read_run",
    "run_status",
    "topology_lines",
    "unstable_loss",
    "unstable_text",
    "workers_at_chance",
]

"""The HDF5 run file: its schema, the writer used by training and the reader used by reports.

One job per module: ``schema`` (version, statuses, how attributes and rows are laid out),
``errors``, ``reader`` (read_run, run_status, file_kind), ``bounded`` (the same reads in worker
processes with a time limit, for files that may be damaged), ``writer`` (RunWriter), ``space``
(a full disk while writing), ``membership`` (the workers a run lost and when: its membership
changes), ``quality`` (runs at chance, unstable runs), ``text`` (its strings shown as data) and
``cli`` (``python -m relaympi.results status|show``). Every name below is importable from here.
"""

from relaympi.results.cli import (
    OWN_TARGET_FRACTION,
    cost_lines,
    main,
    membership_lines,
    topology_lines,
)
from relaympi.results.errors import (
    NotARunFileError,
    RunExistsError,
    RunFileError,
    RunFileWriteError,
    RunInUseError,
)
from relaympi.results.membership import (
    MEMBERSHIP_ATTR,
    change_text,
    finished_workers,
    readmitted_at,
    summary_text,
)
from relaympi.results.quality import (
    CHANCE_FACTOR,
    UNSTABLE_FACTOR,
    UNSTABLE_RULE,
    nonfinite_workers,
    present_mean,
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
    "MEMBERSHIP_ATTR",
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
    "change_text",
    "cost_lines",
    "file_kind",
    "finished_workers",
    "main",
    "membership_lines",
    "nonfinite_workers",
    "present_mean",
    "read_run",
    "readmitted_at",
    "run_status",
    "summary_text",
    "topology_lines",
    "unstable_loss",
    "unstable_text",
    "workers_at_chance",
]
